// paged_attention: many requests' tokens over a paged KV cache.
// Part of kernels.cpp, the one translation unit of decodekit's CPU kernels: it reads what the sections
// before it in kernels.cpp define.
#include "common.h"

namespace {

// ---- Attention over a paged KV cache (decodekit/batching): the tokens of many requests in one call. ----
//
// keys/values [slots, kv_heads, D] are a pool of blocks of `block_size` slots; position j of the request in
// row r of `tables` is in slot tables[r, j / block_size] * block_size + j % block_size. Token i (query q[i],
// of request owner[i], at position positions[i] = p) attends to its request's positions max(0, p - window + 1)
// to p (window 0: from 0), all written before this call; so a prefill chunk is causal by construction.

// Each task is one token and a range of its kv heads (all of them when there are enough tokens to keep every
// thread busy): a slot's keys and values for those heads are one contiguous row. A task reads its positions in runs
// of 8, keys and values together, the query heads of a kv head together (each key and value vector loaded once for
// them): a head's scores for a run folded into the head's running softmax, and the run's values added to the head's
// output. The kernel before it scored position by position (a horizontal sum a head and position) and read keys and
// values in two passes, well below what runs read; runs of 16 with AVX-512 read no faster (docs/performance.md).
constexpr int kPagedRun = 8;

template <typename A>
struct PagedTask {
  const A *ks, *vs;
  const int64_t* table;  // the token's row of the tables
  int64_t block_size, KV, g0, D, per_group, heads, first, p;

  // Where position j's row for this task's heads starts, in elements of the pools.
  int64_t row(int64_t j) const { return ((table[j / block_size] * block_size + j % block_size) * KV + g0) * D; }
  int64_t row_bytes() const { return heads / per_group * D * static_cast<int64_t>(sizeof(A)); }
};

// The next run's key and value rows, prefetched a few lines at each of a run's steps: blocks sit anywhere in the pool,
// so the hardware prefetcher loses the stream at every block boundary. Issued all at once, or a row a head, the
// prefetches stalled the work they were meant to overlap (a core keeps only so many misses in flight). Into L2 (T1)
// rather than L1: `perf` put a quarter of the kernel's samples on the prefetch waiting for a free L1 miss slot, and
// L2 keeps more misses in flight (docs/performance.md).
class RunPrefetch {
 public:
  template <typename A>
  RunPrefetch(const PagedTask<A>& t, int64_t from, int64_t steps)
      : lines_((t.row_bytes() + 63) / 64),
        rows_(2 * std::max<int64_t>(0, std::min<int64_t>(kPagedRun, t.p + 1 - from))) {
    for (int64_t r = 0; r < rows_ / 2; ++r) {
      at_[2 * r] = reinterpret_cast<const char*>(t.ks + t.row(from + r));
      at_[2 * r + 1] = reinterpret_cast<const char*>(t.vs + t.row(from + r));
    }
    per_step_ = (rows_ * lines_ + steps - 1) / steps;
  }
  void step() {
    for (int64_t k = 0; k < per_step_ && row_ < rows_; ++k) {
      _mm_prefetch(at_[row_] + line_ * 64, _MM_HINT_T1);
      if (++line_ == lines_) line_ = 0, ++row_;
    }
  }

 private:
  const char* at_[2 * kPagedRun];
  int64_t lines_, rows_, per_step_ = 0, row_ = 0, line_ = 0;
};

// Half a run: the positions whose keys and values a group's heads read together.
constexpr int kHalfRun = kPagedRun / 2;
static_assert(kHalfRun == 4, "group_scores sums a half run's accumulators four at a time (horizontal_sums)");

// scores[g][s] = q_g . key[s] (unscaled) for G query heads of one kv head (rows of `q`, D apart) and a run's n
// positions (zeros past n). Each key vector is loaded once for the G heads: a head at a time, the loads of keys
// outnumbered the products, and the kernel ran at about a quarter of the FMA rate with the pool in cache. Half a run
// at a time keeps G x 4 accumulators, G queries and a key in AVX2's 16 registers (G <= 3).
template <int G, typename A>
inline void group_scores(const float* q, int64_t D, const A* const* key, int64_t off, int n, RunPrefetch& ahead,
                         float (*scores)[kPagedRun]) {
  const int64_t vector_end = D / 8 * 8;
  for (int half = 0; half < kPagedRun; half += kHalfRun) {
    __m256 acc[G][kHalfRun];
    for (int g = 0; g < G; ++g)
      for (int s = 0; s < kHalfRun; ++s) acc[g][s] = _mm256_setzero_ps();
    for (int64_t d = 0; d < vector_end; d += 8) {
      ahead.step();
      __m256 qd[G];
      for (int g = 0; g < G; ++g) qd[g] = _mm256_loadu_ps(q + g * D + d);
      for (int s = 0; s < kHalfRun; ++s) {
        if (half + s >= n) break;
        const __m256 k = load8(key[half + s] + off + d);
        for (int g = 0; g < G; ++g) acc[g][s] = _mm256_fmadd_ps(qd[g], k, acc[g][s]);
      }
    }
    for (int g = 0; g < G; ++g)
      _mm_storeu_ps(scores[g] + half, horizontal_sums(acc[g][0], acc[g][1], acc[g][2], acc[g][3]));
  }
  for (int g = 0; g < G; ++g)
    for (int s = 0; s < kPagedRun; ++s) {
      float tail = 0.f;
      if (s < n)
        for (int64_t d = vector_end; d < D; ++d) tail += q[g * D + d] * static_cast<float>(key[s][off + d]);
      scores[g][s] = s < n ? scores[g][s] + tail : 0.f;
    }
}

// out_g[D] += sum_s weights[g][s] * value[s] for G heads' outputs (rows of `out`, D apart): each value vector loaded
// once for the G heads, half a run's weights in registers.
template <int G, typename A>
inline void group_values(float* out, int64_t D, const A* const* value, int64_t off, int n,
                         const float (*weights)[kPagedRun]) {
  const int64_t vector_end = D / 8 * 8;
  for (int half = 0; half < n; half += kHalfRun) {
    const int m = std::min(kHalfRun, n - half);
    __m256 w[G][kHalfRun];
    for (int g = 0; g < G; ++g)
      for (int s = 0; s < kHalfRun; ++s) w[g][s] = _mm256_set1_ps(weights[g][half + s]);
    for (int64_t d = 0; d < vector_end; d += 8) {
      __m256 sum[G];
      for (int g = 0; g < G; ++g) sum[g] = _mm256_loadu_ps(out + g * D + d);
      for (int s = 0; s < m; ++s) {
        const __m256 v = load8(value[half + s] + off + d);
        for (int g = 0; g < G; ++g) sum[g] = _mm256_fmadd_ps(w[g][s], v, sum[g]);
      }
      for (int g = 0; g < G; ++g) _mm256_storeu_ps(out + g * D + d, sum[g]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int64_t d = vector_end; d < D; ++d)
      for (int s = 0; s < n; ++s) out[g * D + d] += weights[g][s] * static_cast<float>(value[s][off + d]);
}

// Query heads of one kv head taken together: at most 3 (AVX2's registers), a group of more in parts.
constexpr int kHeadsTogether = 3;

// fn(std::integral_constant<int, G>) for G = heads, 1 to kHeadsTogether.
template <typename Fn>
void with_heads_together(int64_t heads, Fn fn) {
  static_assert(kHeadsTogether == 3, "with_heads_together names each G up to kHeadsTogether");
  if (heads == 1) return fn(std::integral_constant<int, 1>{});
  if (heads == 2) return fn(std::integral_constant<int, 2>{});
  fn(std::integral_constant<int, 3>{});
}

// A task's runs (any head_dim: 8 columns a vector, then one at a time), the query heads of each kv head together,
// each head's scores folded into its running softmax by fold_block_row, as the prompt kernel's key blocks are.
// `result` [heads, D] gets the unnormalised outputs, `best` and `total` each head's largest score and sum of
// exp(score - best).
template <typename A>
void paged_task(const PagedTask<A>& t, const float* query, float* result, float* best, float* total) {
  constexpr int kRun = kPagedRun;
  const int64_t D = t.D, heads = t.heads;
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  std::fill(result, result + heads * D, 0.f);
  std::fill(best, best + heads, -std::numeric_limits<float>::infinity());
  std::fill(total, total + heads, 0.f);
  const int64_t parts_per_group = (t.per_group + kHeadsTogether - 1) / kHeadsTogether;
  const int64_t steps = heads / t.per_group * parts_per_group * 2 * std::max<int64_t>(1, D / 8);
  for (int64_t j0 = t.first; j0 <= t.p; j0 += kRun) {
    const int n = static_cast<int>(std::min<int64_t>(kRun, t.p + 1 - j0));
    const A* key[kRun];
    const A* value[kRun];
    for (int s = 0; s < n; ++s) key[s] = t.ks + t.row(j0 + s), value[s] = t.vs + t.row(j0 + s);
    RunPrefetch ahead(t, j0 + kRun, steps);
    for (int64_t g0 = 0; g0 < heads; g0 += t.per_group) {  // each kv head's query heads, in parts
      const int64_t off = g0 / t.per_group * D;
      for (int64_t h0 = g0; h0 < g0 + t.per_group; h0 += kHeadsTogether) {
        with_heads_together(std::min<int64_t>(kHeadsTogether, g0 + t.per_group - h0), [&](auto together) {
          constexpr int G = decltype(together)::value;
          alignas(32) float weights[G][kRun];
          group_scores<G>(query + h0 * D, D, key, off, n, ahead, weights);
          for (int g = 0; g < G; ++g) {
            for (int s = 0; s < kRun; ++s) weights[g][s] *= scale;
            fold_block_row<NarrowSoftmax>(weights[g], {0, n}, 0, n, kRun, best[h0 + g], total[h0 + g],
                                          result + (h0 + g) * D, D);
          }
          group_values<G>(result + h0 * D, D, value, off, n, weights);
        });
      }
    }
  }
}

// The tasks of a call in parallel, the outputs normalised and rounded to A once.
template <typename A>
void paged_attention_as(const at::Tensor& q, const at::Tensor& keys, const at::Tensor& values, const int64_t* tables,
                        int64_t per_row, const int64_t* owner, const int64_t* positions, int64_t block_size,
                        int64_t window, const at::Tensor& out) {
  const int64_t N = q.size(0), H = q.size(1), D = q.size(2), KV = keys.size(1);
  const A* qs = q.data_ptr<A>();
  A* os = out.data_ptr<A>();
  const int64_t per_group = H / KV;
  const int64_t parts = N >= 4 * at::get_num_threads() ? 1 : KV;  // kv-head ranges a token is split into
  const int64_t groups = KV / parts, heads = groups * per_group;  // a task's kv heads and query heads
  at::parallel_for(0, N * parts, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> query(heads * D), result(heads * D), best(heads), total(heads);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t i = task / parts, g0 = task % parts * groups, p = positions[i], h0 = g0 * per_group;
      const PagedTask<A> t{keys.data_ptr<A>(), values.data_ptr<A>(), tables + owner[i] * per_row, block_size, KV, g0, D,
                           per_group, heads, window > 0 ? std::max<int64_t>(0, p - window + 1) : 0, p};
      for (int64_t e = 0; e < heads * D; ++e) query[e] = static_cast<float>(qs[(i * H + h0) * D + e]);
      paged_task(t, query.data(), result.data(), best.data(), total.data());
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t at_q = (i * H + h0 + h) * D;
        const float inverse = 1.f / total[h];
        for (int64_t d = 0; d < D; ++d) os[at_q + d] = static_cast<A>(round_to<A>(result[h * D + d] * inverse));
      }
    }
  });
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& keys,
                           const at::Tensor& values, const at::Tensor& slots, const at::Tensor& tables,
                           const at::Tensor& owner, const at::Tensor& positions, int64_t block_size, int64_t window) {
  const auto dtype = q.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "paged_attention: q must be float32 or bfloat16, not ", dtype);
  TORCH_CHECK(q.device().is_cpu() && q.dim() == 3 && q.is_contiguous(),
              "paged_attention: q must be a contiguous [tokens, heads, head_dim] tensor on the CPU");
  for (const at::Tensor* pool : {&keys, &values}) {
    TORCH_CHECK(pool->scalar_type() == dtype && pool->is_contiguous() && pool->dim() == 3 && pool->size(2) == q.size(2) &&
                    pool->sizes() == keys.sizes(),
                "paged_attention: keys and values must be contiguous [slots, kv_heads, head_dim] pools of q's dtype");
  }
  const int64_t N = q.size(0), KV = keys.size(1), slots_in_pool = keys.size(0);
  TORCH_CHECK(KV >= 1 && q.size(1) % KV == 0, "paged_attention: heads must be a multiple of kv_heads");
  TORCH_CHECK(block_size >= 1 && slots_in_pool % block_size == 0, "paged_attention: the pools must hold whole blocks of ",
              block_size, " slots");
  TORCH_CHECK(window >= 0, "paged_attention: window must be 0 (none) or positive");
  for (const at::Tensor* t : {&tables, &owner, &positions}) {
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->device().is_cpu(),
                "paged_attention: tables, owner and positions must be contiguous int64 tensors on the CPU");
  }
  TORCH_CHECK(tables.dim() == 2 && owner.numel() == N && positions.numel() == N,
              "paged_attention: tables must be [requests, blocks], owner and positions one value per token");
  const int64_t R = tables.size(0), per_row = tables.size(1), blocks = slots_in_pool / block_size;
  const int64_t *table = tables.data_ptr<int64_t>(), *own = owner.data_ptr<int64_t>(), *pos = positions.data_ptr<int64_t>();
  for (int64_t i = 0; i < N; ++i) {  // every block a token reads must be in the pool
    TORCH_CHECK(own[i] >= 0 && own[i] < R, "paged_attention: owner ", own[i], " is not a row of tables");
    TORCH_CHECK(pos[i] >= 0 && pos[i] < per_row * block_size, "paged_attention: position ", pos[i],
                " is past the ", per_row * block_size, " slots a table row holds");
    for (int64_t b = 0; b <= pos[i] / block_size; ++b) {
      const int64_t block = table[own[i] * per_row + b];
      TORCH_CHECK(block >= 0 && block < blocks, "paged_attention: block ", block, " is outside the pool of ", blocks);
    }
  }
  // The tokens' own keys and values first (k, v [tokens, kv_heads, head_dim] at `slots`): they attend to themselves.
  TORCH_CHECK(k.sizes() == v.sizes() && k.dim() == 3 && k.size(0) == N && k.size(1) == KV && k.size(2) == q.size(2) &&
                  k.scalar_type() == dtype && v.scalar_type() == dtype && slots.scalar_type() == at::kLong &&
                  slots.numel() == N && slots.is_contiguous(),
              "paged_attention: k and v must be [tokens, kv_heads, head_dim] of q's dtype, slots one int64 per token");
  const int64_t* at_slot = slots.data_ptr<int64_t>();
  const at::Tensor kc = k.contiguous(), vc = v.contiguous();
  const int64_t row = KV * q.size(2), bytes = row * kc.element_size();
  for (int64_t i = 0; i < N; ++i) {
    TORCH_CHECK(at_slot[i] >= 0 && at_slot[i] < slots_in_pool, "paged_attention: slot ", at_slot[i], " is outside the pool");
    std::memcpy(static_cast<char*>(keys.data_ptr()) + at_slot[i] * bytes, static_cast<const char*>(kc.data_ptr()) + i * bytes, bytes);
    std::memcpy(static_cast<char*>(values.data_ptr()) + at_slot[i] * bytes, static_cast<const char*>(vc.data_ptr()) + i * bytes, bytes);
  }
  at::Tensor out = at::empty_like(q);
  if (dtype == at::kBFloat16) {
    paged_attention_as<c10::BFloat16>(q, keys, values, table, per_row, own, pos, block_size, window, out);
  } else {
    paged_attention_as<float>(q, keys, values, table, per_row, own, pos, block_size, window, out);
  }
  return out;
}

}  // namespace
