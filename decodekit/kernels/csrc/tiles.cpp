// tiled_product: many rows by bfloat16, int8 or block weights, a tile at a time.
// Part of kernels.cpp, the one translation unit of decodekit's CPU kernels: it reads what the sections
// before it in kernels.cpp define.
#include "common.h"

namespace {

// Products of many rows (a prompt's prefill) by bfloat16 or int8 weights on a CPU without matrix instructions for
// them. The weight is converted to float32 a tile of its rows at a time, into a buffer that stays in the core's
// L2 cache, and each tile's product is the library's float32 matmul (MKL's sgemm, one thread a tile): the
// products run at the float32 peak and the conversion costs one pass over the weight as stored, where converting
// the whole weight first wrote and read back a float32 copy of it (4 bytes a weight) through memory on every call.
constexpr int64_t kTileBytes = 1024 * 1024;

inline void to_float(const c10::BFloat16* w, const float*, float* out, int64_t K) {
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) _mm256_storeu_ps(out + k, load8(w + k));
  for (; k < K; ++k) out[k] = static_cast<float>(w[k]);
}

inline void to_float(const int8_t* w, const float* scale, float* out, int64_t K) {
  const float by = scale == nullptr ? 1.f : *scale;
  const __m256 s = _mm256_set1_ps(by);
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    __m256i wide = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + k)));
    _mm256_storeu_ps(out + k, _mm256_mul_ps(_mm256_cvtepi32_ps(wide), s));
  }
  for (; k < K; ++k) out[k] = static_cast<float>(w[k]) * by;
}

template <typename B, std::enable_if_t<is_block<B>, int> = 0>
inline void to_float(const B* w, const float*, float* out, int64_t K) {
  for (int64_t b = 0; b < K / kBlockSize; ++b, out += kBlockSize) {
    __m256 q[4];
    load_block(w[b], q);
    for (int j = 0; j < 4; ++j) _mm256_storeu_ps(out + 8 * j, q[j]);
  }
}

// An interleaved int8 row (see load32_int8; K % 32 == 0) into float32 in the input's column order, times its scale.
inline void to_float_interleaved(const int8_t* w, const float* scale, float* out, int64_t K) {
  const __m256 s = _mm256_set1_ps(scale == nullptr ? 1.f : *scale);
  const int64_t quarter = K / 4;
  for (int64_t c = 0; c < quarter; c += 8) {
    __m256 b[4];
    load32_int8(w + 4 * c, b);
    for (int j = 0; j < 4; ++j) _mm256_storeu_ps(out + j * quarter + c, _mm256_mul_ps(b[j], s));
  }
}

// The "blocks" form of a tile's product, for products of a few dozen rows (continuous batching's decode steps),
// where the library's one-thread matmul spent much of its time packing each tile for rows it would use a few
// dozen times: no packing, each weight read as stored (bfloat16 converted in registers). A block of kBlockRows
// rows times kBlockWeights weight rows is twelve dot products at once, one accumulator each, in registers
// (12 accumulators, 3 rows and a weight vector: the 16 AVX2 registers); the weight block stays in L1 while every
// row of the tile's row range passes it, and the next weight blocks are prefetched while the first rows do.
// Ahead of the tiles for a few dozen rows and behind them for hundreds (MKL's packed kernel runs nearer the peak
// there: docs/performance.md), so it is one more route that choices.py measures.
constexpr int kBlockRows = 3, kBlockWeights = 4;
constexpr int64_t kBlocksAhead = 2;          // weight blocks prefetched ahead (none was slower: docs/performance.md)
constexpr int64_t kRowRangeBytes = 256 * 1024;  // rows (float32) that pass one weight block: within a core's L2

inline __m128 horizontal_sums(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {  // [sum a0, sum a1, sum a2, sum a3]
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// out[i * ldo + j] (+)= x[i] . w[j] over columns [0, len) of MR rows x and NR weight rows w, both of row stride ld;
// len % 8 == 0. `add`: added to what out holds (a later panel of the columns), else stored.
template <int MR, int NR, typename W>
inline void block_dots(const float* x, const W* w, int64_t ld, int64_t len, float* out, int64_t ldo, bool add) {
  __m256 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < len; k += 8) {
    __m256 a[MR];
    for (int i = 0; i < MR; ++i) a[i] = _mm256_loadu_ps(x + i * ld + k);
    for (int j = 0; j < NR; ++j) {
      const __m256 b = load8(w + j * ld + k);
      for (int i = 0; i < MR; ++i) acc[i][j] = _mm256_fmadd_ps(a[i], b, acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i) {
    if constexpr (NR == 4) {
      __m128 sums = horizontal_sums(acc[i][0], acc[i][1], acc[i][2], acc[i][3]);
      if (add) sums = _mm_add_ps(sums, _mm_loadu_ps(out + i * ldo));
      _mm_storeu_ps(out + i * ldo, sums);
    } else {
      for (int j = 0; j < NR; ++j) out[i * ldo + j] = horizontal_sum(acc[i][j]) + (add ? out[i * ldo + j] : 0.f);
    }
  }
}

// The same blocks with AVX-512 (`wide`, where the CPU has avx512f: choices.py offers it as its own route): 16
// lanes a vector and 32 registers, so blocks of 4 rows by 4 weight rows (16 accumulators, 4 rows, a weight vector).
// The kernels are built for AVX2 on every x86 CPU; these functions and the attention's softmax (softmax.cpp) carry
// the AVX-512 target and run only where `wide` was asked for and the CPU was checked: the AVX2 blocks run near what
// AVX2 allows, so more lanes are what is left (docs/performance.md).
constexpr int kWideRows = 4;

#define DECODEKIT_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl")))

DECODEKIT_AVX512 inline __m512 load16(const float* w) { return _mm512_loadu_ps(w); }
DECODEKIT_AVX512 inline __m512 load16(const c10::BFloat16* w) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}

template <int MR, int NR, typename W>
DECODEKIT_AVX512 void wide_block_dots(const float* x, const W* w, int64_t ld, int64_t len, float* out, int64_t ldo,
                                      bool add) {
  __m512 acc[MR][NR];
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < len; k += 16) {
    __m512 a[MR];
    for (int i = 0; i < MR; ++i) a[i] = _mm512_loadu_ps(x + i * ld + k);
    for (int j = 0; j < NR; ++j) {
      const __m512 b = load16(w + j * ld + k);
      for (int i = 0; i < MR; ++i) acc[i][j] = _mm512_fmadd_ps(a[i], b, acc[i][j]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) out[i * ldo + j] = _mm512_reduce_add_ps(acc[i][j]) + (add ? out[i * ldo + j] : 0.f);
}

// How a block of MR rows by NR weight rows is computed: AVX2's block_dots (blocks of 3 rows) or AVX-512's (4).
struct NarrowDots {
  static constexpr int kRows = kBlockRows;
  static constexpr bool kWidens = true;  // bfloat16 weight blocks widened once (blocks_product)
  template <int MR, int NR, typename W>
  static void run(const float* x, const W* w, int64_t ld, int64_t len, float* out, int64_t ldo, bool add) {
    block_dots<MR, NR>(x, w, ld, len, out, ldo, add);
  }
};

struct WideDots {
  static constexpr int kRows = kWideRows;
  static constexpr bool kWidens = false;
  template <int MR, int NR, typename W>
  DECODEKIT_AVX512 static void run(const float* x, const W* w, int64_t ld, int64_t len, float* out, int64_t ldo,
                                   bool add) {
    wide_block_dots<MR, NR>(x, w, ld, len, out, ldo, add);
  }
};

// Rows [M, len] by NR weight rows (both of row stride ld), into out[:, 0:NR] (row stride ldo; added to it with
// `add`): Dots::kRows rows at a time, then the rest. The bytes [next, end) (part of a weight block ahead) are
// prefetched along the way, a share before each block of rows: issued all by the first block, they were more than a
// core keeps in flight, and products of weights read from memory fell well behind the same in cache.
template <typename Dots, int NR, typename W>
void rows_by_weights(const float* x, int64_t M, const W* w, int64_t ld, int64_t len, float* out, int64_t ldo,
                     bool add, const char* next, const char* end) {
  constexpr int MR = Dots::kRows;
  const int64_t share = ((end - next) / 64 / std::max<int64_t>(1, M / MR) + 1) * 64;
  auto prefetch_share = [&]() {
    for (const char* stop = std::min(end, next + share); next < stop; next += 64) _mm_prefetch(next, _MM_HINT_T0);
  };
  int64_t i = 0;
  for (; i + MR <= M; i += MR) {
    prefetch_share();
    Dots::template run<MR, NR>(x + i * ld, w, ld, len, out + i * ldo, ldo, add);
  }
  prefetch_share();
  if constexpr (MR > 3) {
    if (M - i == 3) Dots::template run<3, NR>(x + i * ld, w, ld, len, out + i * ldo, ldo, add);
  }
  if (M - i == 2) Dots::template run<2, NR>(x + i * ld, w, ld, len, out + i * ldo, ldo, add);
  if (M - i == 1) Dots::template run<1, NR>(x + i * ld, w, ld, len, out + i * ldo, ldo, add);
}

// A block's columns are taken in panels of at most kPanelColumns. Whole, a long row did not fit the core's L1 with its
// block: at K = 1,536 (the default model's down projection) the weight block (4 rows, 24 KB as float32) and a block
// of rows (18 KB) were more than a 32 KB L1, and the prefetched blocks ahead pushed both out. In panels those
// products ran faster at every row count, and products of K = 576 alike whether split in two or not, so rows up to
// kPanelColumns stay whole (docs/performance.md).
constexpr int64_t kPanelColumns = 768;

// The columns of one pass: K in equal panels of at most kPanelColumns (multiples of `lanes`), or whole.
inline int64_t panel_width(int64_t K, int64_t lanes) {
  if (K <= kPanelColumns) return K;
  const int64_t panels = (K + kPanelColumns - 1) / kPanelColumns;
  return ((K + panels - 1) / panels + lanes - 1) / lanes * lanes;
}

// x [M, K] @ w[0:rows, K]^T into out[:, 0:rows] (row stride ldo), by register blocks; K a multiple of the lanes,
// taken in panels (panel_width).
// With AVX2, a bfloat16 weight block that kWidenFromRows rows or more pass is widened to float32 once, into a
// buffer that stays in L1, rather than in registers by every block of rows: converted in registers, the AVX2 blocks
// kept a bf16 prefill behind float32's; widened, nearly level. Fewer rows (a decode step's 32) read the weight
// faster as bf16 converted in registers, and so did the AVX-512 blocks at every row count: those keep converting in
// registers (docs/performance.md).
constexpr int64_t kWidenFromRows = 64;

template <typename Dots, typename W>
void blocks_product(const float* x, int64_t M, const W* w, int64_t rows, int64_t K, float* out, int64_t ldo) {
  constexpr int MR = Dots::kRows;
  const int64_t range = std::max<int64_t>(MR, kRowRangeBytes / (4 * K) / MR * MR);
  const bool widen = Dots::kWidens && !std::is_same_v<W, float> && std::min(M, range) >= kWidenFromRows;
  const int64_t panel = panel_width(K, std::is_same_v<Dots, NarrowDots> ? 8 : 16);
  std::vector<float> widened(widen ? kBlockWeights * K : 0);
  // Runs NR weight rows over the row range in panels of the columns, prefetching `ahead`'s bytes a panel's share at
  // a time.
  auto panels = [&](auto nr, const auto* weights, const float* rows_from, int64_t m, float* to, const char* ahead,
                    int64_t ahead_bytes) {
    constexpr int NR = decltype(nr)::value;
    const int64_t count = (K + panel - 1) / panel;
    for (int64_t p = 0; p < count; ++p) {
      const int64_t k0 = p * panel, len = std::min(panel, K - k0);
      const char* next = ahead == nullptr ? nullptr : ahead + ahead_bytes * p / count;
      const char* end = ahead == nullptr ? nullptr : ahead + ahead_bytes * (p + 1) / count;
      rows_by_weights<Dots, NR>(rows_from + k0, m, weights + k0, K, len, to, ldo, p > 0, next, end);
    }
  };
  using Four = std::integral_constant<int, kBlockWeights>;
  using One = std::integral_constant<int, 1>;
  for (int64_t m0 = 0; m0 < M; m0 += range) {
    const int64_t m = std::min(range, M - m0);
    int64_t j = 0;
    for (; j + kBlockWeights <= rows; j += kBlockWeights) {
      const W* block = w + j * K;
      const W* ahead = block + kBlocksAhead * kBlockWeights * K;
      if constexpr (!std::is_same_v<W, float>) {
        if (widen && m >= kWidenFromRows) {
          for (int64_t k = 0; k < kBlockWeights * K; k += 64 / sizeof(W))
            _mm_prefetch(reinterpret_cast<const char*>(ahead + k), _MM_HINT_T0);
          to_float(block, nullptr, widened.data(), kBlockWeights * K);
          panels(Four{}, widened.data(), x + m0 * K, m, out + m0 * ldo + j, nullptr, 0);
          continue;
        }
      }
      panels(Four{}, block, x + m0 * K, m, out + m0 * ldo + j, reinterpret_cast<const char*>(ahead),
             kBlockWeights * K * sizeof(W));
    }
    for (; j < rows; ++j) {
      const W* weights = w + j * K;
      panels(One{}, weights, x + m0 * K, m, out + m0 * ldo + j,
             reinterpret_cast<const char*>(weights + kBlocksAhead * kBlockWeights * K), K * sizeof(W));
    }
  }
}

// Where blocks run: AVX2 (8 lanes), or AVX-512 (16) where `wide` was asked for.
template <typename W>
void any_blocks_product(bool wide, const float* x, int64_t M, const W* w, int64_t rows, int64_t K, float* out,
                        int64_t ldo) {
  if (wide) {
    blocks_product<WideDots>(x, M, w, rows, K, out, ldo);
  } else {
    blocks_product<NarrowDots>(x, M, w, rows, K, out, ldo);
  }
}

template <typename W>
void tiled_product_as(const at::Tensor& x, const W* w, const float* scales, int64_t N, const at::Tensor& out,
                      bool interleaved = false, bool blocks = false, bool wide = false) {
  const int64_t K = x.size(1);
  // Tiles of about kTileBytes as float32, as many as a multiple of the threads so that each gets the same rows:
  // narrower tiles made thin products well below the float32 matmul's speed.
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  int64_t tiles = (N + std::max<int64_t>(16, kTileBytes / (4 * K)) - 1) / std::max<int64_t>(16, kTileBytes / (4 * K));
  tiles = (tiles + threads - 1) / threads * threads;
  const int64_t tile = ((N + tiles - 1) / tiles + 15) / 16 * 16;
  tiles = (N + tile - 1) / tile;
  const at::ThreadLocalState caller;  // inference mode and the like, for the matmuls the worker threads call
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    at::ThreadLocalStateGuard as_caller(caller);
    // Blocks read float32 and bfloat16 weights as stored; everything else is converted a tile at a time.
    constexpr bool in_registers = std::is_same_v<W, float> || std::is_same_v<W, c10::BFloat16>;
    std::vector<float> buffer(std::is_same_v<W, float> || (blocks && in_registers) ? 0 : tile * K);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * tile, rows = std::min(tile, N - n0);
      float* part_out = out.data_ptr<float>() + n0;
      if constexpr (in_registers) {
        if (blocks) {
          any_blocks_product(wide, x.data_ptr<float>(), x.size(0), w + n0 * K, rows, K, part_out, N);
          continue;
        }
      }
      at::Tensor converted;
      if constexpr (std::is_same_v<W, float>) {  // nothing to convert: the tile is the weight's own rows
        converted = at::from_blob(const_cast<float*>(w) + n0 * K, {rows, K}, x.options());
      } else {
        for (int64_t n = 0; n < rows; ++n) {
          const float* scale = scales == nullptr ? nullptr : scales + n0 + n;
          if constexpr (std::is_same_v<W, int8_t>) {
            if (interleaved) {
              to_float_interleaved(w + (n0 + n) * K, scale, buffer.data() + n * K, K);
              continue;
            }
          }
          to_float(row_at(w, n0 + n, K), scale, buffer.data() + n * K, K);
        }
        converted = at::from_blob(buffer.data(), {rows, K}, x.options());
      }
      if (blocks) {
        any_blocks_product(wide, x.data_ptr<float>(), x.size(0), converted.data_ptr<float>(), rows, K, part_out, N);
        continue;
      }
      at::Tensor part = out.narrow(1, n0, rows);
      at::mm_out(part, x, converted.t());  // inside the parallel region: one thread
    }
  });
}

// rows [M, K] float32 @ weight [N, K]^T (float32, bfloat16, or int8 times scales [N] where given) -> [M, N] float32.
// `interleaved`: the int8 weight's columns are in quantize.interleaved_columns' order (K % 32 == 0); the rows are
// in the input's order all the same.
at::Tensor tiled_product(const at::Tensor& rows, const at::Tensor& weight, const std::optional<at::Tensor>& scales,
                         bool interleaved, bool blocks, bool wide) {
  TORCH_CHECK(rows.dim() == 2 && weight.dim() == 2, "tiled_product: rows [M, K] and weight [N, K] expected");
  const auto dtype = weight.scalar_type();
  const bool int8 = dtype == at::kChar, fp32 = dtype == at::kFloat, q4 = dtype == at::kByte, q8 = dtype == at::kShort;
  TORCH_CHECK(int8 || fp32 || q4 || q8 || dtype == at::kBFloat16,
              "tiled_product: a float32, bfloat16, int8 or block (uint8: 4-bit, int16: 8-bit) weight expected");
  TORCH_CHECK(rows.size(1) == stored_width(weight, "tiled_product"),
              "tiled_product: rows [M, K] and weight [N, K] expected; rows have ", rows.size(1), " values, weight rows ",
              stored_width(weight, "tiled_product"));
  TORCH_CHECK(rows.scalar_type() == at::kFloat, "tiled_product: float32 rows expected");
  TORCH_CHECK(int8 || !scales.has_value(), "tiled_product: scales go with an int8 weight");
  TORCH_CHECK(!interleaved || (int8 && weight.size(1) % 32 == 0),
              "tiled_product: interleaved columns are an int8 weight's, of a width that is a multiple of 32");
  TORCH_CHECK(!blocks || rows.size(1) % 8 == 0, "tiled_product: blocks=True takes rows of a width that is a multiple of 8");
  TORCH_CHECK(!wide || (blocks && rows.size(1) % 16 == 0),
              "tiled_product: wide=True goes with blocks=True and rows of a width that is a multiple of 16");
  TORCH_CHECK(!wide || __builtin_cpu_supports("avx512f"), "tiled_product: wide=True needs a CPU with avx512f");
  const at::Tensor x = rows.contiguous(), w = weight.contiguous();
  const int64_t N = w.size(0);
  at::Tensor out = at::empty({x.size(0), N}, x.options());
  if (int8 && scales.has_value()) {
    const at::Tensor s = scales->to(at::kFloat).contiguous();
    TORCH_CHECK(s.numel() == N, "tiled_product: one scale per weight row expected");
    tiled_product_as(x, w.data_ptr<int8_t>(), s.data_ptr<float>(), N, out, interleaved, blocks, wide);
  } else if (int8) {
    tiled_product_as(x, w.data_ptr<int8_t>(), nullptr, N, out, interleaved, blocks, wide);
  } else if (q4) {
    tiled_product_as(x, static_cast<const Q4Block*>(w.data_ptr()), nullptr, N, out, false, blocks, wide);
  } else if (q8) {
    tiled_product_as(x, static_cast<const Q8Block*>(w.data_ptr()), nullptr, N, out, false, blocks, wide);
  } else if (fp32) {
    tiled_product_as(x, w.data_ptr<float>(), nullptr, N, out, false, blocks, wide);
  } else {
    tiled_product_as(x, w.data_ptr<c10::BFloat16>(), nullptr, N, out, false, blocks, wide);
  }
  return out;
}

}  // namespace
