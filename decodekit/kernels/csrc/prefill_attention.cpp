// prefill_attention: a prompt's causal attention (float32, bfloat16, int8 scores).
// Part of kernels.cpp, the one translation unit of decodekit's CPU kernels: it reads what the sections
// before it in kernels.cpp define.
#include "common.h"

namespace {

// fn(std::integral_constant<int, C>) for C = count, 1 to 4 vectors.
template <typename Fn>
void with_vector_count(int64_t count, Fn fn) {
  switch (count) {
    case 1: return fn(std::integral_constant<int, 1>{});
    case 2: return fn(std::integral_constant<int, 2>{});
    case 3: return fn(std::integral_constant<int, 3>{});
    default: return fn(std::integral_constant<int, 4>{});
  }
}

// out[r][c] += sum_j p[r][j] v[j][c] for R rows and 16 C columns: each value row loaded once for the R rows, the
// probabilities broadcast from their rows (no copy of either, where the library's matmul packs both first): faster
// than the library's matmul of the same blocks (docs/performance.md).
template <int R, int C>
DECODEKIT_AVX512 void add_weighted_values(const float* p, int64_t ldp, const float* v, int64_t ldv, int64_t n, float* out,
                                          int64_t ldo) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_loadu_ps(out + r * ldo + 16 * c);
  for (int64_t j = 0; j < n; ++j) {
    __m512 value[C];
    for (int c = 0; c < C; ++c) value[c] = _mm512_loadu_ps(v + j * ldv + 16 * c);
    for (int r = 0; r < R; ++r) {
      const __m512 weight = _mm512_set1_ps(p[r * ldp + j]);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_fmadd_ps(weight, value[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(out + r * ldo + 16 * c, acc[r][c]);
}

// out [M, D] += p [M, n] (rows ldp apart) x values [n, D] (rows at a stride): by add_weighted_values with AVX-512
// (`wide`) where D is a multiple of 16, else by the library's matmul.
void add_weighted_rows(const float* p, int64_t ldp, int64_t M, int64_t n, const at::Tensor& values, float* out, int64_t D,
                       bool wide) {
  if (wide && D % 16 == 0 && values.stride(1) == 1) {
    const float* v = values.data_ptr<float>();
    const int64_t ldv = values.stride(0);
    for (int64_t r0 = 0; r0 < M; r0 += 6)
      for (int64_t c0 = 0; c0 < D; c0 += 64)
        with_row_count(std::min<int64_t>(6, M - r0), [&](auto R) {
          with_vector_count(std::min<int64_t>(64, D - c0) / 16, [&](auto C) {
            add_weighted_values<R, C>(p + r0 * ldp, ldp, v + c0, ldv, n, out + r0 * D + c0, D);
          });
        });
    return;
  }
  at::Tensor rt = at::from_blob(out, {M, D}, values.options());
  rt.addmm_(at::from_blob(const_cast<float*>(p), {M, n}, {ldp, 1}, values.options()), values);
}

// The task's queries [M, D] (scaled) against keys [lo, hi) of one kv head, key block by key block; `row_range(r)`
// gives row r's visible keys as [from, to) relative to lo. Writes the normalised output [M, D] to `result`.
template <typename Softmax, typename Range>
void attend_in_key_blocks(const at::Tensor& qt, const at::Tensor& keys, const at::Tensor& values, int64_t lo, int64_t hi,
                          int64_t D, Range row_range, std::vector<float>& scores, float* result) {
  const int64_t M = qt.size(0);
  const auto opts = qt.options();
  std::vector<float> best(M, -std::numeric_limits<float>::infinity()), total(M, 0.f);
  std::fill(result, result + M * D, 0.f);
  scores.resize(M * kKeyBlock);
  for (int64_t k0 = lo; k0 < hi; k0 += kKeyBlock) {
    const int64_t width = std::min(kKeyBlock, hi - k0);
    const at::Tensor kt = keys.narrow(0, k0, width), vt = values.narrow(0, k0, width);
    at::Tensor st = at::from_blob(scores.data(), {M, width}, opts);
    at::mm_out(st, qt, kt.t());
    bool any = false;
    for (int64_t r = 0; r < M; ++r) {
      if (fold_block_row<Softmax>(scores.data() + r * width, row_range(r), k0 - lo, width, width, best[r], total[r],
                                  result + r * D, D))
        any = true;
    }
    if (any) add_weighted_rows(scores.data(), width, M, width, vt, result, D, std::is_same_v<Softmax, WideSoftmax>);
  }
  for (int64_t r = 0; r < M; ++r) divide_row(result + r * D, D, total[r]);
}

// One task of a prompt's attention: kv head g and queries [i0, i0 + rows) with every query head of g's group stacked,
// over keys [lo, hi), the ones visible to some of its queries.
struct PromptTask {
  int64_t g, i0, rows, lo, hi;
};

// Query i sits at position first + i; row r of a task's stacked rows (query i0 + r % rows of some head) sees keys
// [from, to) relative to `lo` (the task's lo, or a lower start a caller keys its blocks from).
inline std::pair<int64_t, int64_t> visible_keys(const PromptTask& t, int64_t r, int64_t first, int64_t window, int64_t lo) {
  const int64_t position = first + t.i0 + r % t.rows;
  const int64_t from = window > 0 ? std::max(lo, position - window + 1) - lo : 0;
  return {from, position - lo + 1};
}

// Runs fn(task, state) over the tasks of q [H, T, D] against KV heads of L keys, split among the threads, each with
// a State of its own. Later blocks see more keys: tasks are taken in the order first, last, second, second to
// last, ... so that the threads' contiguous shares of them cost about the same.
template <typename State, typename Fn>
void for_prompt_tasks(int64_t KV, int64_t T, int64_t L, int64_t window, Fn fn) {
  const int64_t first = L - T, blocks = (T + kQueryBlock - 1) / kQueryBlock, tasks = KV * blocks;
  const at::ThreadLocalState caller;
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    at::ThreadLocalStateGuard as_caller(caller);
    State state;
    for (int64_t n = begin; n < end; ++n) {
      const int64_t task = n % 2 == 0 ? n / 2 : tasks - 1 - n / 2;
      const int64_t g = task / blocks, i0 = task % blocks * kQueryBlock, i1 = std::min(T, i0 + kQueryBlock);
      const int64_t lo = window > 0 ? std::max<int64_t>(0, first + i0 - window + 1) : 0;
      fn(PromptTask{g, i0, i1 - i0, lo, first + i1}, state);
    }
  });
}

// Where a task's stacked output rows go: `os` as [H, T, D], or with `tokens_major` as [T, H, D] (the rows of the o
// projection).
template <typename A>
struct PromptOutput {
  A* os;
  int64_t T, H, D, group;
  bool tokens_major;

  // Row r of task t, which holds query t.i0 + r % t.rows of head t.g * group + r / t.rows.
  A* row(const PromptTask& t, int64_t r) const {
    const int64_t h = t.g * group + r / t.rows, i = t.i0 + r % t.rows;
    return os + (tokens_major ? i * H + h : h * T + i) * D;
  }
};

template <typename Softmax>
void attend_prompt(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t window, float* os,
                   bool tokens_major) {
  const int64_t H = q.size(0), T = q.size(1), D = q.size(2), KV = k.size(0), L = k.size(1);
  const int64_t group = H / KV, first = L - T;
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  const float* qs = q.data_ptr<float>();
  const PromptOutput<float> output{os, T, H, D, group, tokens_major};
  struct State {
    std::vector<float> query, scores, result, inverses;
  };
  for_prompt_tasks<State>(KV, T, L, window, [&](const PromptTask& t, State& st) {
    const int64_t M = group * t.rows, width = t.hi - t.lo;
    st.query.resize(M * D);
    st.result.resize(M * D);
    st.inverses.resize(M);
    for (int64_t h = 0; h < group; ++h)
      for (int64_t i = 0; i < t.rows; ++i) {
        const float* from = qs + ((t.g * group + h) * T + t.i0 + i) * D;
        float* to = st.query.data() + (h * t.rows + i) * D;
        for (int64_t d = 0; d < D; ++d) to[d] = from[d] * scale;
      }
    const auto opts = q.options();
    at::Tensor qt = at::from_blob(st.query.data(), {M, D}, opts);
    const auto store = [&] {
      for (int64_t r = 0; r < M; ++r) std::memcpy(output.row(t, r), st.result.data() + r * D, D * sizeof(float));
    };
    const at::Tensor head_keys = k.select(0, t.g), head_values = v.select(0, t.g);  // [L, D]; rows may be apart
    if (width > kWholeRowKeys) {
      auto row_range = [&](int64_t r) { return visible_keys(t, r, first, window, t.lo); };
      attend_in_key_blocks<Softmax>(qt, head_keys, head_values, t.lo, t.hi, D, row_range, st.scores, st.result.data());
      return store();
    }
    st.scores.resize(M * width);
    const at::Tensor kt = head_keys.narrow(0, t.lo, width), vt = head_values.narrow(0, t.lo, width);
    at::Tensor sc = at::from_blob(st.scores.data(), {M, width}, opts);
    at::mm_out(sc, qt, kt.t());
    for (int64_t r = 0; r < M; ++r) {
      const auto [from, to] = visible_keys(t, r, first, window, t.lo);
      float* row = st.scores.data() + r * width;
      const float best = Softmax::top(row + from, to - from);
      st.inverses[r] = 1.f / Softmax::exponentiate(row + from, to - from, best);
      std::fill(row, row + from, 0.f);
      std::fill(row + to, row + width, 0.f);
    }
    std::fill(st.result.begin(), st.result.end(), 0.f);
    add_weighted_rows(st.scores.data(), width, M, width, vt, st.result.data(), D, std::is_same_v<Softmax, WideSoftmax>);
    for (int64_t r = 0; r < M; ++r) {  // normalised here: D products a row rather than one per visible key
      float* out = st.result.data() + r * D;
      for (int64_t d = 0; d < D; ++d) out[d] *= st.inverses[r];
    }
    store();
  });
}

void attend_into(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t window, bool wide, float* out,
                 bool tokens_major) {
  if (wide) {
    attend_prompt<WideSoftmax>(q, k, v, window, out, tokens_major);
  } else {
    attend_prompt<NarrowSoftmax>(q, k, v, window, out, tokens_major);
  }
}

// The per-thread state of a task of a tiled prompt kernel (attend_prompt_bf16, attend_prompt_int8): a key block's
// scores, the task's output sums, each row's running maximum and total.
struct TiledTaskState {
  std::vector<float> scores, result, best, total;
  std::vector<c10::BFloat16> probabilities;  // the bfloat16 kernel's rounded probabilities
};

// Keys a tiled kernel's score tile spans: two vectors of 16 float32 or int32 sums.
constexpr int64_t kTileKeys = 32;

// A task of a tiled prompt kernel over keys [lo, t.hi) (lo at or before t.lo), its M stacked rows: in one block
// through kWholeRowKeys keys, longer in kKeyBlock blocks with fold_block_row's running softmax. A block's scores come
// by tiles of up to kRowsPerChunk rows of one head (a head's rows are consecutive in q) by kTileKeys keys,
// `score(R, r, key, out, ldo)` writing rows r.. r + R - 1 of the keys from `key`; then each row is folded and
// `folded(r, row, used, ldo)` sees it; `weigh(k0, n, used, ldp)` adds the block's probabilities times its values to
// st.result. The rows end divided by their totals.
template <typename Score, typename Folded, typename Weigh>
void tiled_task(const PromptTask& t, int64_t lo, int64_t M, int64_t D, int64_t first, int64_t window, TiledTaskState& st,
                Score score, Folded folded, Weigh weigh) {
  const int64_t width = t.hi - lo, block = width > kWholeRowKeys ? kKeyBlock : width;
  const int64_t columns = (block + kTileKeys - 1) / kTileKeys * kTileKeys;
  st.scores.resize(M * columns);
  st.result.assign(M * D, 0.f);
  st.best.assign(M, -std::numeric_limits<float>::infinity());
  st.total.assign(M, 0.f);
  for (int64_t k0 = lo; k0 < t.hi; k0 += block) {
    const int64_t n = std::min(block, t.hi - k0), tiles = (n + kTileKeys - 1) / kTileKeys, used = tiles * kTileKeys;
    for (int64_t r = 0; r < M;) {
      const int64_t run = std::min({int64_t{kRowsPerChunk}, t.rows - r % t.rows, M - r});
      with_row_count(run, [&](auto R) {
        for (int64_t c = 0; c < tiles; ++c)
          score(R, r, k0 + c * kTileKeys, st.scores.data() + r * columns + c * kTileKeys, columns);
      });
      r += run;
    }
    bool any = false;
    for (int64_t r = 0; r < M; ++r) {
      float* row = st.scores.data() + r * columns;
      if (fold_block_row<WideSoftmax>(row, visible_keys(t, r, first, window, lo), k0 - lo, n, used, st.best[r],
                                      st.total[r], st.result.data() + r * D, D))
        any = true;
      folded(r, row, used, columns);
    }
    if (any) weigh(k0, n, used, columns);
  }
  for (int64_t r = 0; r < M; ++r) divide_row(st.result.data() + r * D, D, st.total[r]);
}

// Prompt attention of a bfloat16 model on a CPU with AVX512-BF16, whose vdpbf16ps multiplies pairs of bfloat16 and
// sums them into float32 lanes at twice the rate of float32 FMAs. q, k and v are bfloat16 already (the model's
// activations and cache), so both products read them as they are; the scores and the output sum in float32, and
// the probabilities are rounded to bfloat16 for the second product, as torch's CPU flash attention does for
// bfloat16. On the AVX512-BF16 bench machine the float32 kernel's products ran at the float32 peak and took about
// a third of a bfloat16 prompt chunk's forward.
#define DECODEKIT_AVX512BF16 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16")))

// Both products run on tiles of up to kRowsPerChunk stacked rows by 32 columns: 16 float32 accumulators.
constexpr int64_t kBf16Columns = 32;
static_assert(kBf16Columns == kTileKeys, "tiled_task's score tiles are pair_tile's 32 columns");

// c[r][n] = scale * (c[r][n] where `accumulate`) + sum_p a[r][p] . b[p][n] for R rows and 32 columns: a's rows hold
// bfloat16 pairs (one 32-bit word each) lda words apart, b is [pairs][ldb] words, each the pair of two consecutive
// products' bfloat16 (vdpbf16ps multiplies a pair by a pair and adds both to a float32 lane). Both products of the
// attention are this: the scores (a = queries, b = keys paired along head_dim, scaled) and the output (a = the
// rounded probabilities, b = values paired along the keys, accumulated block after block).
template <int R>
DECODEKIT_AVX512BF16 void pair_tile(const uint32_t* a, int64_t lda, const uint32_t* b, int64_t ldb, int64_t pairs,
                                    float* c, int64_t ldc, bool accumulate, float scale) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) {
    acc[r][0] = accumulate ? _mm512_loadu_ps(c + r * ldc) : _mm512_setzero_ps();
    acc[r][1] = accumulate ? _mm512_loadu_ps(c + r * ldc + 16) : _mm512_setzero_ps();
  }
  for (int64_t p = 0; p < pairs; ++p) {
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(b + p * ldb);
    const __m512bh b1 = (__m512bh)_mm512_loadu_si512(b + p * ldb + 16);
    for (int r = 0; r < R; ++r) {
      const __m512bh ar = (__m512bh)_mm512_set1_epi32(static_cast<int>(a[r * lda + p]));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], ar, b0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], ar, b1);
    }
  }
  const __m512 s = _mm512_set1_ps(scale);
  for (int r = 0; r < R; ++r) {
    _mm512_storeu_ps(c + r * ldc, _mm512_mul_ps(acc[r][0], s));
    _mm512_storeu_ps(c + r * ldc + 16, _mm512_mul_ps(acc[r][1], s));
  }
}

// n floats (n % 16 == 0) rounded to bfloat16 (to nearest even, as c10::BFloat16 rounds).
DECODEKIT_AVX512BF16 inline void round_to_bf16(const float* x, int64_t n, c10::BFloat16* out) {
  for (int64_t j = 0; j < n; j += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + j), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + j)));
}

// q [H, T, D], k and v [KV, L, D] bfloat16 (D % 32 == 0) -> out [H, T, D] bfloat16, as attend_prompt. The keys and
// values are laid out in pairs once per call (a copy each, which every task of a kv head reads), and every task
// takes its keys in blocks from an even position, so that a block's values pair as laid out.
// A task keys through kWholeRowKeys in one block, longer in kKeyBlock blocks with fold_block_row's running
// softmax.
DECODEKIT_AVX512BF16 void attend_prompt_bf16(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t window,
                                            c10::BFloat16* os) {
  const int64_t H = q.size(0), T = q.size(1), D = q.size(2), KV = k.size(0), L = k.size(1);
  const int64_t group = H / KV, first = L - T, pairs = D / 2;
  // Room for a block of keys read from any even position: the last tile of 32 may run past L.
  const int64_t padded = (L + 1) / 2 * 2 + kBf16Columns;
  // keys [KV, D/2, padded] of 32-bit pairs, values [KV, padded/2, D] of pairs along the keys.
  at::Tensor kp = at::zeros({KV, pairs, padded}, k.options().dtype(at::kInt));
  kp.view(at::kBFloat16).view({KV, pairs, padded, 2}).narrow(2, 0, L).copy_(k.view({KV, L, pairs, 2}).transpose(1, 2));
  at::Tensor vpad = at::zeros({KV, padded, D}, v.options());
  vpad.narrow(1, 0, L).copy_(v);
  const at::Tensor vp = vpad.view({KV, padded / 2, 2, D}).transpose(2, 3).contiguous();
  const auto* keys = reinterpret_cast<const uint32_t*>(kp.data_ptr<int>());
  const auto* values = reinterpret_cast<const uint32_t*>(vp.data_ptr<c10::BFloat16>());
  const auto* qs = reinterpret_cast<const uint32_t*>(q.data_ptr<c10::BFloat16>());
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  const PromptOutput<c10::BFloat16> output{os, T, H, D, group, false};
  for_prompt_tasks<TiledTaskState>(KV, T, L, window, [&](const PromptTask& t, TiledTaskState& st) {
    const int64_t M = group * t.rows;
    const uint32_t* head_keys = keys + t.g * pairs * padded;
    const uint32_t* head_values = values + t.g * (padded / 2) * D;
    // Row r's query: rows of one head are consecutive in q, so the stacked rows are one head's block after another.
    const auto query = [&](int64_t r) { return qs + ((t.g * group + r / t.rows) * T + t.i0 + r % t.rows) * pairs; };
    const auto score = [&](auto R, int64_t r, int64_t key, float* out, int64_t ldo) {
      pair_tile<R>(query(r), pairs, head_keys + key, padded, pairs, out, ldo, false, scale);
    };
    const auto rounded = [&](int64_t r, const float* row, int64_t used, int64_t columns) {
      st.probabilities.resize(st.scores.size());
      round_to_bf16(row, used, st.probabilities.data() + r * columns);
    };
    const auto weigh = [&](int64_t k0, int64_t, int64_t used, int64_t columns) {
      const auto* p = reinterpret_cast<const uint32_t*>(st.probabilities.data());
      for (int64_t r0 = 0; r0 < M; r0 += kRowsPerChunk)
        with_row_count(std::min<int64_t>(kRowsPerChunk, M - r0), [&](auto R) {
          for (int64_t d0 = 0; d0 < D; d0 += kBf16Columns)
            pair_tile<R>(p + r0 * columns / 2, columns / 2, head_values + k0 / 2 * D + d0, D, used / 2,
                         st.result.data() + r0 * D + d0, D, true, 1.f);
        });
    };
    tiled_task(t, t.lo / 2 * 2, M, D, first, window, st, score, rounded, weigh);
    for (int64_t r = 0; r < M; ++r) round_to_bf16(st.result.data() + r * D, D, output.row(t, r));
  });
}

// Prompt attention of an int8 model's float32 q, k, v on a CPU with AVX512-VNNI (for the Ice Lake and Cascade Lake
// servers, which have no AVX512-BF16): the scores in int8 products, vpdpbusd multiplying four unsigned bytes by four
// signed ones into an int32 lane, four times the multiply-adds of a float32 FMA; the probabilities times the values
// stay float32, since 8 bits would round the small probabilities of long rows away. A query row is rounded to int8
// with a scale of its own and shifted by 128 into vpdpbusd's unsigned operand (the shift's share, 128 x the key's
// sum, is taken off again); a key, less its kv head's mean key, with a scale of its own. Taking the mean key off
// moves all the scores of a row by one amount, which leaves its softmax as it was, and narrows what a key's 8 bits
// must span. Why an int8 model may: its weights' rounding sets its error (attention.py).
#define DECODEKIT_AVX512VNNI __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512vnni")))

// The largest |x[d] - centre[d]| of D floats.
DECODEKIT_AVX512VNNI inline float largest_difference(const float* x, const float* centre, int64_t D) {
  __m512 top = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 16) {
    const __mmask16 lanes = lanes_left(D - d);
    const __m512 y = _mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, x + d), _mm512_maskz_loadu_ps(lanes, centre + d));
    top = _mm512_max_ps(top, _mm512_abs_ps(y));
  }
  return _mm512_reduce_max_ps(top);
}

// (x[d] - centre[d]) * inverse rounded to the nearest integer (ties to even) plus `offset`, as D bytes: int8 with
// offset 0, uint8 with 128.
DECODEKIT_AVX512VNNI inline void round_to_bytes(const float* x, const float* centre, int64_t D, float inverse, int offset,
                                               int8_t* out) {
  const __m512 by = _mm512_set1_ps(inverse);
  const __m512i shift = _mm512_set1_epi32(offset);
  for (int64_t d = 0; d < D; d += 16) {
    const __mmask16 lanes = lanes_left(D - d);
    const __m512 y = _mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, x + d), _mm512_maskz_loadu_ps(lanes, centre + d));
    const __m512i i = _mm512_add_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(y, by)), shift);
    _mm512_mask_cvtepi32_storeu_epi8(out + d, lanes, i);
  }
}

// c[r][n] = (sum_p a[r][p] . b[p][n] - shift[n]) * row_scale[r] * key_scale[n] for R rows and 32 columns: a's rows
// hold quads of unsigned bytes (one 32-bit word each) lda words apart, b is [quads][ldb] words of four signed bytes
// (vpdpbusd multiplies a word's four bytes by another's and adds the four products to an int32 lane). The sums are
// exact: 4 x 255 x 127 a quad, under 2^24 for head_dim up to 256 after the shift is taken off.
template <int R>
DECODEKIT_AVX512VNNI void quad_tile(const uint32_t* a, int64_t lda, const uint32_t* b, int64_t ldb, int64_t quads,
                                    const int32_t* shift, const float* key_scale, const float* row_scale, float* c,
                                    int64_t ldc) {
  __m512i acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_si512();
  for (int64_t p = 0; p < quads; ++p) {
    const __m512i b0 = _mm512_loadu_si512(b + p * ldb), b1 = _mm512_loadu_si512(b + p * ldb + 16);
    for (int r = 0; r < R; ++r) {
      const __m512i ar = _mm512_set1_epi32(static_cast<int>(a[r * lda + p]));
      acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], ar, b0);
      acc[r][1] = _mm512_dpbusd_epi32(acc[r][1], ar, b1);
    }
  }
  const __m512i s0 = _mm512_loadu_si512(shift), s1 = _mm512_loadu_si512(shift + 16);
  const __m512 k0 = _mm512_loadu_ps(key_scale), k1 = _mm512_loadu_ps(key_scale + 16);
  for (int r = 0; r < R; ++r) {
    const __m512 by = _mm512_set1_ps(row_scale[r]);
    _mm512_storeu_ps(c + r * ldc, _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][0], s0)), k0), by));
    _mm512_storeu_ps(c + r * ldc + 16,
                     _mm512_mul_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][1], s1)), k1), by));
  }
}

// q [H, T, D], k and v [KV, L, D] float32 (D % 4 == 0; k and v rows may be apart) -> out [H, T, D] float32, as
// attend_prompt. The keys are rounded and laid out in quads once per call, each query row once; every task keys
// through kWholeRowKeys in one block, longer in kKeyBlock blocks with fold_block_row's running softmax, and adds a
// block's probabilities times its values by add_weighted_values (the library's matmul where head_dim is not a multiple
// of 16).
DECODEKIT_AVX512VNNI void attend_prompt_int8(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, int64_t window,
                                            float* os) {
  const int64_t H = q.size(0), T = q.size(1), D = q.size(2), KV = k.size(0), L = k.size(1);
  const int64_t group = H / KV, first = L - T, quads = D / 4;
  const int64_t padded = L + kTileKeys;  // a block's last tile may read up to 31 keys past L: zeros
  const float* ks = k.data_ptr<float>();
  const int64_t head_stride = k.stride(0), key_stride = k.stride(1);
  // Each kv head's mean key (in double: a sum over up to tens of thousands of keys).
  std::vector<float> centre(KV * D), zeros(D, 0.f);
  for (int64_t g = 0; g < KV; ++g) {
    std::vector<double> sum(D, 0.0);
    for (int64_t j = 0; j < L; ++j)
      for (int64_t d = 0; d < D; ++d) sum[d] += ks[g * head_stride + j * key_stride + d];
    for (int64_t d = 0; d < D; ++d) centre[g * D + d] = static_cast<float>(sum[d] / static_cast<double>(L));
  }
  // keys [KV, D/4, padded] words of four int8, their scales and 128 x their sums [KV, padded].
  at::Tensor key_words = at::zeros({KV, quads, padded}, k.options().dtype(at::kInt));
  at::Tensor key_scales = at::zeros({KV, padded}, k.options());
  at::Tensor shifts = at::zeros({KV, padded}, k.options().dtype(at::kInt));
  auto* words = reinterpret_cast<uint32_t*>(key_words.data_ptr<int>());
  float* kscale = key_scales.data_ptr<float>();
  int32_t* kshift = shifts.data_ptr<int>();
  at::parallel_for(0, KV * L, 256, [&](int64_t begin, int64_t end) {
    std::vector<int8_t> bytes(D);
    for (int64_t n = begin; n < end; ++n) {
      const int64_t g = n / L, j = n % L;
      const float* key = ks + g * head_stride + j * key_stride;
      const float top = largest_difference(key, centre.data() + g * D, D);
      round_to_bytes(key, centre.data() + g * D, D, top > 0.f ? 127.f / top : 0.f, 0, bytes.data());
      int32_t sum = 0;
      for (int64_t d = 0; d < D; ++d) sum += bytes[d];
      for (int64_t p = 0; p < quads; ++p) std::memcpy(words + (g * quads + p) * padded + j, bytes.data() + 4 * p, 4);
      kscale[g * padded + j] = top / 127.f;
      kshift[g * padded + j] = 128 * sum;
    }
  });
  // Query rows as bytes + 128 [H * T, D] and their scales, 1/sqrt(D) included.
  at::Tensor query_bytes = at::empty({H * T, D}, q.options().dtype(at::kByte));
  std::vector<float> qscale(H * T);
  const float* qs = q.data_ptr<float>();
  auto* qb = reinterpret_cast<int8_t*>(query_bytes.data_ptr<uint8_t>());
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  at::parallel_for(0, H * T, 256, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const float top = largest_difference(qs + n * D, zeros.data(), D);
      round_to_bytes(qs + n * D, zeros.data(), D, top > 0.f ? 127.f / top : 0.f, 128, qb + n * D);
      qscale[n] = top / 127.f * scale;
    }
  });
  const auto* queries = reinterpret_cast<const uint32_t*>(qb);
  const PromptOutput<float> output{os, T, H, D, group, false};
  for_prompt_tasks<TiledTaskState>(KV, T, L, window, [&](const PromptTask& t, TiledTaskState& st) {
    const int64_t M = group * t.rows;
    const uint32_t* head_keys = words + t.g * quads * padded;
    // Row r's query: rows of one head are consecutive in q, so the stacked rows are one head's block after another.
    const auto row_of = [&](int64_t r) { return (t.g * group + r / t.rows) * T + t.i0 + r % t.rows; };
    const at::Tensor head_values = v.select(0, t.g);  // [L, D]; rows may be apart
    const auto score = [&](auto R, int64_t r, int64_t key, float* out, int64_t ldo) {
      quad_tile<R>(queries + row_of(r) * quads, quads, head_keys + key, padded, quads, kshift + t.g * padded + key,
                   kscale + t.g * padded + key, qscale.data() + row_of(r), out, ldo);
    };
    const auto weigh = [&](int64_t k0, int64_t n, int64_t, int64_t columns) {
      add_weighted_rows(st.scores.data(), columns, M, n, head_values.narrow(0, k0, n), st.result.data(), D, true);
    };
    tiled_task(t, t.lo, M, D, first, window, st, score, [](int64_t, const float*, int64_t, int64_t) {}, weigh);
    for (int64_t r = 0; r < M; ++r) std::memcpy(output.row(t, r), st.result.data() + r * D, D * sizeof(float));
  });
}

// q [H, T, D] made contiguous and k, v [KV, L, D] with contiguous rows, their shapes checked for `op`. k and v may
// come with their rows apart (continuous batching gathers a chunk's keys as [L, KV, D] and passes them transposed):
// the products read rows at a stride, so only a strided last dimension is copied.
std::tuple<at::Tensor, at::Tensor, at::Tensor> attention_operands(const char* op, const at::Tensor& q_in,
                                                                  const at::Tensor& k_in, const at::Tensor& v_in) {
  TORCH_CHECK(q_in.dim() == 3 && k_in.dim() == 3 && v_in.sizes() == k_in.sizes(), op,
              ": q [H, T, D], k and v [KV, L, D] expected");
  const auto rows_of = [](const at::Tensor& t) { return t.stride(2) == 1 ? t : t.contiguous(); };
  const at::Tensor q = q_in.contiguous(), k = rows_of(k_in), v = rows_of(v_in);
  TORCH_CHECK(k.size(2) == q.size(2) && k.size(0) > 0 && q.size(0) % k.size(0) == 0 && k.size(1) >= q.size(1), op,
              ": shapes do not fit");
  return {q, k, v};
}

at::Tensor prefill_attention_int8(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in, int64_t window) {
  TORCH_CHECK(q_in.scalar_type() == at::kFloat && k_in.scalar_type() == at::kFloat && v_in.scalar_type() == at::kFloat,
              "prefill_attention_int8: q, k, v all float32 expected");
  const auto [q, k, v] = attention_operands("prefill_attention_int8", q_in, k_in, v_in);
  TORCH_CHECK(q.size(2) % 4 == 0 && q.size(2) <= 256, "prefill_attention_int8: head_dim a multiple of 4 up to 256 expected, got ",
              q.size(2));
  TORCH_CHECK(__builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512bw"),
              "prefill_attention_int8: needs a CPU with avx512_vnni");
  at::Tensor out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  attend_prompt_int8(q, k, v, window, out.data_ptr<float>());
  return out;
}

// `wide`: the softmax passes with AVX-512; the caller checks that the CPU has it (attention.py).
at::Tensor prefill_attention(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in, int64_t window,
                             bool wide) {
  const at::ScalarType dtype = q_in.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && k_in.scalar_type() == dtype && v_in.scalar_type() == dtype,
              "prefill_attention: q, k, v all float32 or all bfloat16 expected");
  const auto [q, k, v] = attention_operands("prefill_attention", q_in, k_in, v_in);
  TORCH_CHECK(!wide || __builtin_cpu_supports("avx512f"), "prefill_attention: wide=True needs a CPU with avx512f");
  at::Tensor out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  if (dtype == at::kBFloat16) {  // products in bfloat16 (`wide` does not apply: the softmax is AVX-512's)
    TORCH_CHECK(__builtin_cpu_supports("avx512bf16"), "prefill_attention: bfloat16 q, k, v need a CPU with avx512_bf16");
    TORCH_CHECK(q.size(2) % kBf16Columns == 0, "prefill_attention: bfloat16 needs a head_dim multiple of 32, got ",
                q.size(2));
    attend_prompt_bf16(q, k, v, window, out.data_ptr<c10::BFloat16>());
    return out;
  }
  attend_into(q, k, v, window, wide, out.data_ptr<float>(), false);
  return out;
}

// The elementwise work between a prompt's products, one pass each where the library makes several: RMSNorm
// (torch's CPU rms_norm is composite: a square, a mean, an add, a reciprocal root and two products, each a pass
// over the rows, then the weight's), SiLU(gate) * up (two passes and a temporary) and the rotary embedding (four).
// Rows of float32 or bfloat16, computed in float32 and written in their own dtype (bfloat16 rounded once, a row at a
// time from a buffer in cache: rounded by the caller, a pass of its own, they cost a bf16 prefill about 2% more on
// the AMX bench machine held to AVX2), split among the threads. About 5% of a 512-token fp32 prefill on the AVX2 bench
// machine went to these passes.

}  // namespace
