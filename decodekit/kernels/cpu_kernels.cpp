// decodekit's CPU kernels (AVX2, FMA and F16C; AVX-512 forms where the CPU has it), built and loaded by native.py:
// - row_product / row_product_int8: out[M, N] = rows[M, K] @ W[N, K]^T for M = 1 to 16, the shapes of decode
//   steps and short prompts (W float32, bfloat16, or GGUF's blocks of 32: Q4Block, Q8Block);
// - decode_layers (with bind_weights / unbind_weights): the decoder layers of the Llama family for a
//   fixed-shape decode step, in one call;
// - split_product: a prompt's rows by an int8 weight through int8 x int8 products (its int8 prefill);
// - paged_attention: attention of the tokens of many requests over a paged KV cache (continuous batching).
//
// A decode step of one token reads every weight once, so the products are written to keep the memory bus
// busy: one weight row at a time (one sequential stream per thread), four independent accumulators for one
// row (an FMA chain of one would wait on its own latency) or one per row for several, each weight converted
// once for all rows, and a software prefetch ahead of the loads. Inductor's loop for the same product keeps
// two accumulators and reached 21 GB/s (bf16) and 17 GB/s (int8) on the 2-core AVX2 bench machine where
// these reached 33 and 27 (native.py says how).
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/_int_mm.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/add.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/mul.h>
#include <ATen/ops/rms_norm.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <omp.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <vector>

// MKL's packed-matrix API, where libtorch_cpu carries MKL (null otherwise): see mkl_pack below.
extern "C" {
__attribute__((weak)) size_t cblas_sgemm_pack_get_size(int identifier, int m, int n, int k);
__attribute__((weak)) void cblas_sgemm_pack(int layout, int identifier, int trans, int m, int n, int k, float alpha,
                                            const float* src, int ld, float* dest);
__attribute__((weak)) void cblas_sgemm_compute(int layout, int transa, int transb, int m, int n, int k, const float* a,
                                               int lda, const float* b, int ldb, float beta, float* c, int ldc);
}

namespace {

// How far ahead of the loads to prefetch. Measured on the bench machine, products of the default model's 120
// layer weights against a plain read of memory: int8 0.66-0.73 of the read's speed at 1 KB, 0.85 at 3 KB
// (0.81-0.85 at 4 KB, 0.62-0.67 at 8 KB); bfloat16 0.83 at 1 KB, 0.72-0.79 at 2 KB; float32 no difference.
constexpr int64_t kPrefetchBytes = 1024;
constexpr int64_t kInt8PrefetchBytes = 3072;
constexpr int64_t kRowsPerTask = 16;
constexpr int64_t kMaxRows = 16;
constexpr int kRowsPerChunk = 8;  // one float32 accumulator per row: 8 of the 16 AVX2 registers

inline float horizontal_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_hadd_ps(s, s);
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(s);
}

inline float horizontal_sum(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  return horizontal_sum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
}

template <int64_t Ahead = kPrefetchBytes>
inline void prefetch_block(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p) + Ahead;
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(c + off, _MM_HINT_T0);
}

// Eight weights as eight float32 lanes.
inline __m256 load8(const float* w) { return _mm256_loadu_ps(w); }
inline __m256 load8(const c10::BFloat16* w) {  // bfloat16 is the top half of a float32
  __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

template <typename W>
float dot(const float* x, const W* w, int64_t K) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    prefetch_block(w + k, 32 * sizeof(W));
    a0 = _mm256_fmadd_ps(load8(w + k), _mm256_loadu_ps(x + k), a0);
    a1 = _mm256_fmadd_ps(load8(w + k + 8), _mm256_loadu_ps(x + k + 8), a1);
    a2 = _mm256_fmadd_ps(load8(w + k + 16), _mm256_loadu_ps(x + k + 16), a2);
    a3 = _mm256_fmadd_ps(load8(w + k + 24), _mm256_loadu_ps(x + k + 24), a3);
  }
  for (; k + 8 <= K; k += 8) a0 = _mm256_fmadd_ps(load8(w + k), _mm256_loadu_ps(x + k), a0);
  float sum = horizontal_sum(a0, a1, a2, a3);
  for (; k < K; ++k) sum += x[k] * static_cast<float>(w[k]);
  return sum;
}

// M rows (stride K) by one weight row, into y[m * N].
template <int M, typename W>
void dots(const float* x, const W* w, int64_t K, float* y, int64_t N) {
  __m256 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    prefetch_block(w + k, 8 * sizeof(W));
    const __m256 wv = load8(w + k);
    for (int m = 0; m < M; ++m) acc[m] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(x + m * K + k), acc[m]);
  }
  for (int m = 0; m < M; ++m) {
    float sum = horizontal_sum(acc[m]);
    for (int64_t j = k; j < K; ++j) sum += x[m * K + j] * static_cast<float>(w[j]);
    y[m * N] = sum;
  }
}

// An interleaved int8 row (quantize.Int8Linear), unscaled: byte j of 32-bit lane c holds the weight of
// input column j * K/4 + c, so one 32-byte load gives eight lanes and shifts give their four bytes.
// Every int8 weight in this file is laid out so (K % 32 == 0): dot and dots below are its overloads of the
// float32/bfloat16 ones above, so that weight_rows serves all three.
inline void load32_int8(const int8_t* w, __m256 b[4]) {
  const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  b[0] = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 24), 24));
  b[1] = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 16), 24));
  b[2] = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 8), 24));
  b[3] = _mm256_cvtepi32_ps(_mm256_srai_epi32(v, 24));
}

float dot(const float* x, const int8_t* w, int64_t K) {
  const int64_t quarter = K / 4;
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t c = 0; c < quarter; c += 8) {
    prefetch_block<kInt8PrefetchBytes>(w + 4 * c, 32);
    __m256 b[4];
    load32_int8(w + 4 * c, b);
    a0 = _mm256_fmadd_ps(b[0], _mm256_loadu_ps(x + c), a0);
    a1 = _mm256_fmadd_ps(b[1], _mm256_loadu_ps(x + quarter + c), a1);
    a2 = _mm256_fmadd_ps(b[2], _mm256_loadu_ps(x + 2 * quarter + c), a2);
    a3 = _mm256_fmadd_ps(b[3], _mm256_loadu_ps(x + 3 * quarter + c), a3);
  }
  return horizontal_sum(a0, a1, a2, a3);
}

template <int M>
void dots(const float* x, const int8_t* w, int64_t K, float* y, int64_t N) {
  const int64_t quarter = K / 4;
  __m256 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t c = 0; c < quarter; c += 8) {
    prefetch_block<kInt8PrefetchBytes>(w + 4 * c, 32);
    __m256 b[4];
    load32_int8(w + 4 * c, b);
    for (int m = 0; m < M; ++m) {
      const float* xm = x + m * K + c;
      acc[m] = _mm256_fmadd_ps(b[0], _mm256_loadu_ps(xm), acc[m]);
      acc[m] = _mm256_fmadd_ps(b[1], _mm256_loadu_ps(xm + quarter), acc[m]);
      acc[m] = _mm256_fmadd_ps(b[2], _mm256_loadu_ps(xm + 2 * quarter), acc[m]);
      acc[m] = _mm256_fmadd_ps(b[3], _mm256_loadu_ps(xm + 3 * quarter), acc[m]);
    }
  }
  for (int m = 0; m < M; ++m) y[m * N] = horizontal_sum(acc[m]);
}

// ---- Block-quantized weights as GGUF files hold them (kernels/blocks.py): a row of K weights is K / 32 blocks. ----
// A weight's tensor dtype names its block format, so the same WeightRef carries it through the products and the
// layer stack: uint8 rows of Q4Blocks (GGUF's Q4_1 block: weight = d * q + m, q a 4-bit value, the low nibbles
// of qs weights 0-15 of the block and the high nibbles weights 16-31), int16 rows of Q8Blocks (GGUF's Q8_0:
// weight = d * q, q an int8). Each block is converted in registers to float32 and multiplied in float32, so the
// product is the dequantized weight's to float32 rounding.
constexpr int64_t kBlockSize = 32;
struct Q4Block {
  uint16_t d, m;  // float16
  uint8_t qs[16];
};
struct Q8Block {
  uint16_t d;  // float16
  int8_t qs[32];
};
static_assert(sizeof(Q4Block) == 20 && sizeof(Q8Block) == 34);

// A q4 block's scale and minimum as the first two float32 lanes: one load and one conversion for both.
inline __m128 scale_and_minimum(const Q4Block& b) {
  int32_t both;
  std::memcpy(&both, &b, sizeof(both));
  return _mm_cvtph_ps(_mm_cvtsi32_si128(both));
}

inline void load_block(const Q4Block& b, __m256 w[4]) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b.qs));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(bytes, mask), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), mask);
  const __m128 dm = scale_and_minimum(b);
  const __m256 d = _mm256_broadcastss_ps(dm), m = _mm256_broadcastss_ps(_mm_movehdup_ps(dm));
  w[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(lo)), d, m);
  w[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(lo, 8))), d, m);
  w[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(hi)), d, m);
  w[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(hi, 8))), d, m);
}

inline void load_block(const Q8Block& b, __m256 w[4]) {
  const __m256 d = _mm256_set1_ps(_cvtsh_ss(b.d));
  for (int j = 0; j < 4; ++j) {
    const __m128i eight = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(b.qs + 8 * j));
    w[j] = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(eight)), d);
  }
}

template <typename B>
constexpr bool is_block = std::is_same_v<B, Q4Block> || std::is_same_v<B, Q8Block>;

// A row by one weight row of blocks; two accumulators, as the four products of a block would else wait on each other.
template <typename B>
float block_dot(const float* x, const B* w, int64_t K) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0;
  for (int64_t b = 0; b < K / kBlockSize; ++b, x += kBlockSize) {
    _mm_prefetch(reinterpret_cast<const char*>(w + b) + kInt8PrefetchBytes, _MM_HINT_T0);
    __m256 q[4];
    load_block(w[b], q);
    a0 = _mm256_fmadd_ps(q[0], _mm256_loadu_ps(x), a0);
    a1 = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(x + 8), a1);
    a0 = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(x + 16), a0);
    a1 = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(x + 24), a1);
  }
  return horizontal_sum(_mm256_add_ps(a0, a1));
}

// M rows (stride K) by one weight row of blocks, each block converted once for all rows.
template <int M, typename B>
void block_dots(const float* x, const B* w, int64_t K, float* y, int64_t N) {
  __m256 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t b = 0, k = 0; k < K; ++b, k += kBlockSize) {
    _mm_prefetch(reinterpret_cast<const char*>(w + b) + kInt8PrefetchBytes, _MM_HINT_T0);
    __m256 q[4];
    load_block(w[b], q);
    for (int m = 0; m < M; ++m) {
      const float* xm = x + m * K + k;
      acc[m] = _mm256_fmadd_ps(q[0], _mm256_loadu_ps(xm), acc[m]);
      acc[m] = _mm256_fmadd_ps(q[1], _mm256_loadu_ps(xm + 8), acc[m]);
      acc[m] = _mm256_fmadd_ps(q[2], _mm256_loadu_ps(xm + 16), acc[m]);
      acc[m] = _mm256_fmadd_ps(q[3], _mm256_loadu_ps(xm + 24), acc[m]);
    }
  }
  for (int m = 0; m < M; ++m) y[m * N] = horizontal_sum(acc[m]);
}

// The same products with AVX-512 (16 lanes), where the CPU has it: a block's 32 weights are two vectors, half the
// conversions and products of AVX2's four. `block_lanes` (set_block_lanes) says which run: 16 where the CPU has
// AVX-512 (blocks.py may measure and set 8), else 8.
#define DECODEKIT_BLOCKS512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl")))
std::atomic<int> block_lanes{__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") ? 16 : 8};

DECODEKIT_BLOCKS512 inline void load_block16(const Q4Block& b, __m512 w[2]) {
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b.qs));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128 dm = scale_and_minimum(b);
  const __m512 d = _mm512_broadcastss_ps(dm), m = _mm512_broadcastss_ps(_mm_movehdup_ps(dm));
  w[0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(bytes, mask))), d, m);
  w[1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(bytes, 4), mask))), d, m);
}

DECODEKIT_BLOCKS512 inline void load_block16(const Q8Block& b, __m512 w[2]) {
  const __m512 d = _mm512_set1_ps(_cvtsh_ss(b.d));
  for (int j = 0; j < 2; ++j) {
    const __m128i sixteen = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b.qs + 16 * j));
    w[j] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sixteen)), d);
  }
}

template <typename B>
DECODEKIT_BLOCKS512 float wide_block_dot(const float* x, const B* w, int64_t K) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0;
  for (int64_t b = 0; b < K / kBlockSize; ++b, x += kBlockSize) {
    _mm_prefetch(reinterpret_cast<const char*>(w + b) + kInt8PrefetchBytes, _MM_HINT_T0);
    __m512 q[2];
    load_block16(w[b], q);
    a0 = _mm512_fmadd_ps(q[0], _mm512_loadu_ps(x), a0);
    a1 = _mm512_fmadd_ps(q[1], _mm512_loadu_ps(x + 16), a1);
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
}

template <int M, typename B>
DECODEKIT_BLOCKS512 void wide_block_dots(const float* x, const B* w, int64_t K, float* y, int64_t N) {
  __m512 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t b = 0, k = 0; k < K; ++b, k += kBlockSize) {
    _mm_prefetch(reinterpret_cast<const char*>(w + b) + kInt8PrefetchBytes, _MM_HINT_T0);
    __m512 q[2];
    load_block16(w[b], q);
    for (int m = 0; m < M; ++m) {
      const float* xm = x + m * K + k;
      acc[m] = _mm512_fmadd_ps(q[0], _mm512_loadu_ps(xm), acc[m]);
      acc[m] = _mm512_fmadd_ps(q[1], _mm512_loadu_ps(xm + 16), acc[m]);
    }
  }
  for (int m = 0; m < M; ++m) y[m * N] = _mm512_reduce_add_ps(acc[m]);
}

template <typename B>
float any_block_dot(const float* x, const B* w, int64_t K) {
  return block_lanes.load(std::memory_order_relaxed) == 16 ? wide_block_dot(x, w, K) : block_dot(x, w, K);
}

template <int M, typename B>
void any_block_dots(const float* x, const B* w, int64_t K, float* y, int64_t N) {
  if (block_lanes.load(std::memory_order_relaxed) == 16) return wide_block_dots<M>(x, w, K, y, N);
  block_dots<M>(x, w, K, y, N);
}

float dot(const float* x, const Q4Block* w, int64_t K) { return any_block_dot(x, w, K); }
float dot(const float* x, const Q8Block* w, int64_t K) { return any_block_dot(x, w, K); }
template <int M>
void dots(const float* x, const Q4Block* w, int64_t K, float* y, int64_t N) { any_block_dots<M>(x, w, K, y, N); }
template <int M>
void dots(const float* x, const Q8Block* w, int64_t K, float* y, int64_t N) { any_block_dots<M>(x, w, K, y, N); }

// Which block products run: 8 (AVX2) or 16 (AVX-512, where the CPU has it) lanes; 0 leaves it. Returns the lanes
// in force before.
int64_t set_block_lanes(int64_t lanes) {
  TORCH_CHECK(lanes == 0 || lanes == 8 || lanes == 16, "set_block_lanes: lanes must be 0, 8 or 16, not ", lanes);
  TORCH_CHECK(lanes != 16 || (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")),
              "set_block_lanes: 16 lanes need a CPU with avx512f and avx512bw");
  const int before = block_lanes.load();
  if (lanes != 0) block_lanes.store(static_cast<int>(lanes));
  return before;
}

// Weight row n's first element: a row of blocks holds K / 32 of them.
template <typename W>
inline const W* row_at(const W* w, int64_t n, int64_t K) {
  if constexpr (is_block<W>) return w + n * (K / kBlockSize);
  return w + n * K;
}

// The rows' count as a template argument: the accumulators stay in registers.
template <typename Fn>
void with_row_count(int64_t M, Fn fn) {
  switch (M) {
    case 1: return fn(std::integral_constant<int, 1>{});
    case 2: return fn(std::integral_constant<int, 2>{});
    case 3: return fn(std::integral_constant<int, 3>{});
    case 4: return fn(std::integral_constant<int, 4>{});
    case 5: return fn(std::integral_constant<int, 5>{});
    case 6: return fn(std::integral_constant<int, 6>{});
    case 7: return fn(std::integral_constant<int, 7>{});
    default: return fn(std::integral_constant<int, kRowsPerChunk>{});
  }
}

// Up to 8 rows per pass over a weight row; 9 to 16 rows take a second pass over the same weight row, which
// then comes from L1 (a row of the default model's weights is at most 6 KB), so memory still sees one read.
template <typename Fn>
void in_chunks(int64_t M, Fn pass) {
  if (M <= kRowsPerChunk) return with_row_count(M, [&](auto count) { pass(0, count, std::integral_constant<int, 0>{}); });
  with_row_count(M - kRowsPerChunk, [&](auto rest) { pass(kRowsPerChunk, std::integral_constant<int, kRowsPerChunk>{}, rest); });
}

// A weight as these kernels read it, checked beforehand, so that the loops below never throw (they run
// inside parallel regions).
struct WeightRef {
  at::ScalarType dtype;  // float32, bfloat16, int8 interleaved (unscaled; K % 32 == 0), Q4Block (uint8), Q8Block (int16)
  const void* data;
  int64_t N, K;
};

// The input width of a weight [out, stored]: the stored width, or for rows of blocks 32 weights a block.
int64_t stored_width(const at::Tensor& weight, const char* op) {
  const int64_t width = weight.size(1), bytes = weight.element_size() * width;
  if (weight.scalar_type() == at::kByte) {
    TORCH_CHECK(bytes % sizeof(Q4Block) == 0, op, ": a row of 4-bit blocks is a multiple of 20 bytes, not ", bytes);
    return bytes / sizeof(Q4Block) * kBlockSize;
  }
  if (weight.scalar_type() == at::kShort) {
    TORCH_CHECK(bytes % sizeof(Q8Block) == 0, op, ": a row of 8-bit blocks is a multiple of 34 bytes, not ", bytes);
    return bytes / sizeof(Q8Block) * kBlockSize;
  }
  return width;
}

WeightRef weight_ref(const at::Tensor& weight, const char* op) {
  const auto dtype = weight.scalar_type();
  TORCH_CHECK(weight.device().is_cpu() && weight.dim() == 2 && weight.is_contiguous(), op,
              ": weight must be a contiguous [out, in] matrix on the CPU");
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kChar || dtype == at::kByte ||
                  dtype == at::kShort,
              op, ": weights must be float32, bfloat16, int8, or blocks (uint8: 4-bit, int16: 8-bit), not ", dtype);
  TORCH_CHECK(dtype != at::kChar || weight.size(1) % 32 == 0, op,
              ": the input width of an int8 weight must be a multiple of 32, not ", weight.size(1));
  return {dtype, weight.data_ptr(), weight.size(0), stored_width(weight, op)};
}

// y[m * N + n] = x[m] . w[n] for the weight rows n in [begin, end) and the M rows of x (W: float, bfloat16,
// or interleaved int8).
template <typename W>
void weight_rows(const float* x, int64_t M, const W* w, int64_t N, int64_t K, float* y, int64_t begin, int64_t end) {
  if (M == 1) {
    for (int64_t n = begin; n < end; ++n) y[n] = dot(x, row_at(w, n, K), K);
    return;
  }
  in_chunks(M, [&](int64_t split, auto first, auto rest) {
    for (int64_t n = begin; n < end; ++n) {
      dots<first()>(x, row_at(w, n, K), K, y + n, N);
      if constexpr (rest() > 0) dots<rest()>(x + split * K, row_at(w, n, K), K, y + split * N + n, N);
    }
  });
}

void weight_rows(const float* x, int64_t M, const WeightRef& w, float* y, int64_t begin, int64_t end) {
  switch (w.dtype) {
    case at::kFloat: return weight_rows(x, M, static_cast<const float*>(w.data), w.N, w.K, y, begin, end);
    case at::kBFloat16:
      return weight_rows(x, M, static_cast<const c10::BFloat16*>(w.data), w.N, w.K, y, begin, end);
    case at::kByte: return weight_rows(x, M, static_cast<const Q4Block*>(w.data), w.N, w.K, y, begin, end);
    case at::kShort: return weight_rows(x, M, static_cast<const Q8Block*>(w.data), w.N, w.K, y, begin, end);
    default: return weight_rows(x, M, static_cast<const int8_t*>(w.data), w.N, w.K, y, begin, end);
  }
}

// out = rows @ weight^T for the row_product operators; the weight is checked by weight_ref.
at::Tensor product(const at::Tensor& rows, const at::Tensor& weight, const char* op) {
  const WeightRef w = weight_ref(weight, op);
  TORCH_CHECK(rows.device().is_cpu() && rows.scalar_type() == at::kFloat && rows.is_contiguous() && rows.dim() == 2,
              op, ": rows must be a contiguous float32 [rows, in] matrix on the CPU");
  const int64_t M = rows.size(0);
  TORCH_CHECK(M >= 1 && M <= kMaxRows, op, ": takes 1 to ", kMaxRows, " rows, not ", M);
  TORCH_CHECK(rows.size(1) == w.K, op, ": rows have ", rows.size(1), " values, weight rows ", w.K);
  at::Tensor out = at::empty({M, w.N}, rows.options());
  const float* x = rows.data_ptr<float>();
  float* y = out.data_ptr<float>();
  at::parallel_for(0, w.N, kRowsPerTask, [&](int64_t begin, int64_t end) { weight_rows(x, M, w, y, begin, end); });
  return out;
}

at::Tensor row_product(const at::Tensor& rows, const at::Tensor& weight) {
  const auto dtype = weight.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat || dtype == at::kByte || dtype == at::kShort,
              "row_product: weight must be float32, bfloat16 or blocks (uint8: 4-bit, int16: 8-bit), not ", dtype);
  return product(rows, weight, "row_product");
}

at::Tensor row_product_int8(const at::Tensor& rows, const at::Tensor& weight) {
  TORCH_CHECK(weight.scalar_type() == at::kChar, "row_product_int8: weight must be int8, not ", weight.scalar_type());
  return product(rows, weight, "row_product_int8");
}

// ---- A prompt's rows by an int8 weight through int8 x int8 products (quantize.split_int8_product). ----

float largest_magnitude(const float* x, int64_t K) {
  __m256 top = _mm256_setzero_ps();
  const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) top = _mm256_max_ps(top, _mm256_and_ps(_mm256_loadu_ps(x + k), magnitude));
  float lanes[8];
  _mm256_storeu_ps(lanes, top);
  float largest = *std::max_element(lanes, lanes + 8);
  for (; k < K; ++k) largest = std::max(largest, std::fabs(x[k]));
  return largest;
}

// Row `x` [K] split into two int8 parts, x = scale * (high + low / 127) with scale = max|x| / 127; returns the
// scale. With `interleaved`, the parts' columns are in the stored order of an interleaved int8 weight: column
// 4c + j holds input column j * K/4 + c.
float split_row(const float* row, int64_t K, bool interleaved, int8_t* high, int8_t* low) {
  const int64_t Q = K / 4;
  const float top = std::max(largest_magnitude(row, K), 1e-30f);
  const float inverse = 127.0f / top;
  int64_t c = 0;
  if (interleaved) {  // eight columns c of each quarter j at a time: 32 output bytes of each part
    const __m256 by = _mm256_set1_ps(inverse);
    for (; c + 8 <= Q; c += 8) {
      __m256i h = _mm256_setzero_si256(), l = _mm256_setzero_si256();
      for (int j = 0; j < 4; ++j) {
        const __m256 t = _mm256_mul_ps(_mm256_loadu_ps(row + j * Q + c), by);
        const __m256 rh = _mm256_round_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m256 rl = _mm256_round_ps(_mm256_mul_ps(_mm256_sub_ps(t, rh), _mm256_set1_ps(127.0f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
        const __m256i byte = _mm256_set1_epi32(0xff);  // byte j of each 32-bit lane
        h = _mm256_or_si256(h, _mm256_slli_epi32(_mm256_and_si256(_mm256_cvtps_epi32(rh), byte), 8 * j));
        l = _mm256_or_si256(l, _mm256_slli_epi32(_mm256_and_si256(_mm256_cvtps_epi32(rl), byte), 8 * j));
      }
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(high + 4 * c), h);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(low + 4 * c), l);
    }
  }
  const auto put = [&](int64_t k, int64_t at) {  // the columns the vector loop left (all of a plain row)
    const float t = row[k] * inverse;
    const float h = std::nearbyint(t);  // half to even, as torch.round and _mm256_round_ps
    high[at] = static_cast<int8_t>(h);
    low[at] = static_cast<int8_t>(std::nearbyint((t - h) * 127.0f));
  };
  if (interleaved) {
    for (; c < Q; ++c) {
      for (int64_t j = 0; j < 4; ++j) put(j * Q + c, 4 * c + j);
    }
  } else {
    for (int64_t k = 0; k < K; ++k) put(k, k);
  }
  return top / 127.0f;
}

// The int32 sums of a row's two parts [N] each -> to[n] = (high + low / 127) * scale (* columns[n] where given).
void join_row(const int32_t* high, const int32_t* low, int64_t N, float scale, const float* columns, float* to) {
  const float fine = scale / 127.0f;
  int64_t n = 0;
  for (; n + 8 <= N; n += 8) {
    const __m256 h = _mm256_cvtepi32_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(high + n)));
    const __m256 l = _mm256_cvtepi32_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(low + n)));
    __m256 y = _mm256_fmadd_ps(l, _mm256_set1_ps(fine), _mm256_mul_ps(h, _mm256_set1_ps(scale)));
    if (columns != nullptr) y = _mm256_mul_ps(y, _mm256_loadu_ps(columns + n));
    _mm256_storeu_ps(to + n, y);
  }
  for (; n < N; ++n) {
    const float y = std::fma(static_cast<float>(low[n]), fine, static_cast<float>(high[n]) * scale);
    to[n] = columns != nullptr ? y * columns[n] : y;
  }
}

// Blocks of split_product: as many rows as keep the block's int32 sums ([2R, N]) within kSplitSumBytes, at most
// kSplitRows. The sums are written by the library's product and read back by the join while still in cache; one call
// over a whole long prompt wrote them through memory into a fresh allocation, whose page faults made it the slowest
// step of an int8 prefill on the AMX bench machine (a 2,048-token prompt's products at 580 GOP/s of a 2,000 GOP/s
// peak, against 1,700 into a buffer already mapped). The buffers are the calling thread's, kept between calls.
constexpr int64_t kSplitRows = 256, kSplitSumBytes = int64_t{8} << 20;
// Rows of a block each thread splits, multiplies and joins alone (at most), where every thread has at least
// kOwnSplitMinRows (below).
constexpr int64_t kOwnSplitRows = 128, kOwnSplitMinRows = 64;

// M rows cut into `count` blocks of `rows` (the last shorter, or empty), as many for each of the threads, none longer
// than `most`: the blocks threads take for their own (split_product, and packed_product's bfloat16 rows).
struct OwnBlocks {
  int64_t count, rows;
  OwnBlocks(int64_t M, int64_t most, int64_t threads)
      : count(threads * ((M + threads * most - 1) / (threads * most))), rows((M + count - 1) / count) {}
};

// rows [M, K] float32 @ weight [N, K]^T int8 -> [M, N] float32 through int8 x int8 products (at::_int_mm:
// oneDNN's VNNI or AMX kernels where the CPU has them): each row split into two int8 parts (split_row), so the
// activations keep about 14 bits, the int32 sums exact, joined and scaled by `scales` [N] (the weight's
// per-channel scales) where given. `interleaved`: the weight's columns are stored interleaved and the rows are
// in the input's order. A block of rows at a time, into buffers reused across blocks and calls.
at::Tensor split_product(const at::Tensor& rows, const at::Tensor& weight, const std::optional<at::Tensor>& scales,
                         bool interleaved) {
  TORCH_CHECK(rows.device().is_cpu() && rows.scalar_type() == at::kFloat && rows.is_contiguous() && rows.dim() == 2,
              "split_product: rows must be a contiguous float32 [rows, in] matrix on the CPU");
  const int64_t M = rows.size(0), K = rows.size(1), N = weight.size(0);
  TORCH_CHECK(weight.scalar_type() == at::kChar && weight.is_contiguous() && weight.dim() == 2 && weight.size(1) == K,
              "split_product: weight must be a contiguous int8 [out, ", K, "] matrix");
  TORCH_CHECK(!interleaved || K % 4 == 0, "split_product: interleaved columns need a width that is a multiple of 4");
  const float* columns = nullptr;
  if (scales.has_value()) {
    TORCH_CHECK(scales->scalar_type() == at::kFloat && scales->is_contiguous() && scales->numel() == N,
                "split_product: scales must be float32 [", N, "]");
    columns = scales->data_ptr<float>();
  }
  at::Tensor out = at::empty({M, N}, rows.options());
  const float* x = rows.data_ptr<float>();
  float* y = out.data_ptr<float>();
  const at::Tensor transposed = weight.t();
  const auto int8 = rows.options().dtype(at::kChar), int32 = rows.options().dtype(at::kInt);
  const int64_t threads = at::get_num_threads();
  const bool fits = 2 * kOwnSplitRows * N * int64_t{sizeof(int32_t)} <= kSplitSumBytes;  // each thread keeps its sums
  if (M >= threads * kOwnSplitMinRows && fits) {
    // A block of up to kOwnSplitRows for each thread at a time, split, multiplied (the library's int8 product runs on
    // the calling thread inside the region) and joined by that thread, with no wait for the others between: int8
    // prefills of 512 and 2,048 tokens ran 1.08-1.16x and 1.05-1.09x faster so on the AMX bench machine than with
    // the threads sharing each block's steps, as below (alternating processes, 3 rounds), and 1.00-1.05x with oneDNN
    // held to VNNI without AMX (ONEDNN_MAX_CPU_ISA=AVX512_CORE_VNNI). At 128 tokens (a block of 64 rows each)
    // 1.12x on AMX (59.8-60.4 ms against 66.6-68.4, three pairs), within noise held to VNNI.
    const OwnBlocks own(M, kOwnSplitRows, threads);
    const int64_t block = own.rows;
    at::parallel_for(0, own.count, 1, [&](int64_t first, int64_t last) {
      thread_local at::Tensor own_parts, own_sums;  // this thread's, kept between calls (viewed per call, as below)
      if (!own_parts.defined() || own_parts.numel() < 2 * block * K) own_parts = at::empty({2 * block * K}, int8);
      if (!own_sums.defined() || own_sums.numel() < 2 * block * N) own_sums = at::empty({2 * block * N}, int32);
      std::vector<float> row_scales(block);
      for (int64_t b = first; b < last && b * block < M; ++b) {
        const int64_t start = b * block, r = std::min(block, M - start);
        int8_t* part = static_cast<int8_t*>(own_parts.data_ptr());
        for (int64_t m = 0; m < r; ++m)
          row_scales[m] = split_row(x + (start + m) * K, K, interleaved, part + m * K, part + (r + m) * K);
        at::Tensor sums = at::from_blob(own_sums.data_ptr(), {2 * r, N}, int32);
        at::_int_mm_out(sums, at::from_blob(part, {2 * r, K}, int8), transposed);
        const int32_t* s = static_cast<const int32_t*>(own_sums.data_ptr());
        for (int64_t m = 0; m < r; ++m)
          join_row(s + m * N, s + (r + m) * N, N, row_scales[m], columns, y + (start + m) * N);
      }
    });
    return out;
  }
  const int64_t fit = std::max<int64_t>(kSplitSumBytes / (2 * N * int64_t{sizeof(int32_t)}), 8);
  const int64_t R = std::max<int64_t>(std::min({M, kSplitRows, fit}), 1);
  // The buffers are the library's allocations (aligned for its vector stores), used through views made per call:
  // a buffer made in inference mode is an inference tensor, which may not be written to outside it.
  thread_local at::Tensor part_buffer, sum_buffer;
  if (!part_buffer.defined() || part_buffer.numel() < 2 * R * K) part_buffer = at::empty({2 * R * K}, int8);
  if (!sum_buffer.defined() || sum_buffer.numel() < 2 * R * N) sum_buffer = at::empty({2 * R * N}, int32);
  at::Tensor parts = at::from_blob(part_buffer.data_ptr(), {2 * R, K}, int8);
  at::Tensor sums = at::from_blob(sum_buffer.data_ptr(), {2 * R, N}, int32);
  std::vector<float> row_scales(R);
  for (int64_t start = 0; start < M; start += R) {
    const int64_t r = std::min(R, M - start);
    int8_t* part = parts.data_ptr<int8_t>();
    at::parallel_for(0, r, 1, [&](int64_t begin, int64_t end) {
      for (int64_t m = begin; m < end; ++m) {
        row_scales[m] = split_row(x + (start + m) * K, K, interleaved, part + m * K, part + (r + m) * K);
      }
    });
    at::Tensor block = sums.narrow(0, 0, 2 * r);
    at::_int_mm_out(block, parts.narrow(0, 0, 2 * r), transposed);
    const int32_t* s = block.data_ptr<int32_t>();
    at::parallel_for(0, r, 1, [&](int64_t begin, int64_t end) {
      for (int64_t m = begin; m < end; ++m) {
        join_row(s + m * N, s + (r + m) * N, N, row_scales[m], columns, y + (start + m) * N);
      }
    });
  }
  return out;
}

// ---- The decoder layers of the Llama family for a decode step: M rows of one new token each. ----
//
// Written here because at batch 1 the step's time beyond reading the weights was mostly the cost of
// calling things: inductor's step for the default model ran about ten kernels a layer, each an OpenMP
// region and a call from its Python wrapper, and one call per layer here still cost about 29 us of
// dispatch and region starts. The whole stack is one call and one parallel region: the threads share
// each product's weight rows and the attention's heads, and wait at a barrier between the steps that
// depend on each other; the small steps between (norms, rotary, cache writes) run on one thread. Values
// are rounded to the activation dtype A where the model stores them (norm outputs, product outputs, the
// residual stream, the cache); elementwise chains between those points are computed in float32, as
// inductor computes them.

template <typename A>
inline float round_to(float v) {
  return static_cast<float>(static_cast<A>(v));
}

// The first and one past the last of n items that this thread of a parallel region takes.
struct Share {
  int64_t begin, end;
  Share(int64_t n) {
    const int64_t id = omp_get_thread_num(), size = omp_get_num_threads();
    begin = n * id / size;
    end = n * (id + 1) / size;
  }
};

// RMSNorm as models/llama.py computes it: normalise in float32, round, scale by the weight, round.
template <typename A>
void rms_norm(const float* x, const A* weight, int64_t n, double eps, float* out) {
  float squares = 0.f;
  for (int64_t i = 0; i < n; ++i) squares += x[i] * x[i];
  const float inv = 1.f / std::sqrt(squares / n + static_cast<float>(eps));
  for (int64_t i = 0; i < n; ++i) out[i] = round_to<A>(round_to<A>(x[i] * inv) * static_cast<float>(weight[i]));
}

template <typename A>
struct LinearRef {
  WeightRef weight;
  const float* scale;  // int8 weights: one per output
  const A* bias;
};

// This thread's share of y = round(round((x @ W^T) * scale) + bias), as Linear / Int8Linear return it.
template <typename A>
void linear_share(const float* x, int64_t M, const LinearRef<A>& linear, float* y) {
  const int64_t N = linear.weight.N;
  const Share share(N);
  weight_rows(x, M, linear.weight, y, share.begin, share.end);
  for (int64_t m = 0; m < M; ++m) {
    float* row = y + m * N;
    for (int64_t n = share.begin; n < share.end; ++n) {
      const float v = round_to<A>(linear.scale ? row[n] * linear.scale[n] : row[n]);
      row[n] = linear.bias ? round_to<A>(v + static_cast<float>(linear.bias[n])) : v;
    }
  }
}

// Rotates one head in place (rotate-half form): out_i = x_i cos_i - x_{i+D/2} sin_i, then + for the second half.
template <typename A>
void rotate(float* x, const A* cos, const A* sin, int64_t D) {
  const int64_t half = D / 2;
  for (int64_t i = 0; i < half; ++i) {
    const float a = x[i], b = x[i + half];
    x[i] = round_to<A>(a * static_cast<float>(cos[i]) - b * static_cast<float>(sin[i]));
    x[i + half] = round_to<A>(b * static_cast<float>(cos[i + half]) + a * static_cast<float>(sin[i + half]));
  }
}

// out[D] += p * v[D]
template <typename A>
void add_scaled(float* out, float p, const A* v, int64_t D) {
  int64_t d = 0;
  const __m256 pv = _mm256_set1_ps(p);
  for (; d + 8 <= D; d += 8) _mm256_storeu_ps(out + d, _mm256_fmadd_ps(pv, load8(v + d), _mm256_loadu_ps(out + d)));
  for (; d < D; ++d) out[d] += p * static_cast<float>(v[d]);
}

// exp of eight floats: x = n ln2 + r with |r| <= ln2 / 2 (ln2 in two parts, so r keeps its bits), exp(r) by its
// Taylor polynomial to r^6 (relative error under 1e-7 there), 2^n put into the exponent bits. Inputs below -87
// give about 1e-38: a masked score (-inf) weighs nothing.
constexpr float kLog2e = 1.44269504088896341f, kLn2High = 0.693359375f, kLn2Low = -2.12194440e-4f;
constexpr float kExpTaylor[] = {1.f / 720, 1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f};  // r^6 down to r^0

inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.f)), _mm256_set1_ps(88.f));
  const __m256 n =
      _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Low), _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2High), x));
  __m256 p = _mm256_setzero_ps();
  for (const float c : kExpTaylor) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(c));
  const __m256i scale = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(scale));
}

// The largest of x[0..n), n >= 1. Four vector accumulators: a scalar loop waits on each comparison's latency, and in
// the prompt attention below it took about as long as the two products it sits between.
inline float row_max(const float* x, int64_t n) {
  float top = x[0];
  int64_t j = 0;
  if (n >= 8) {
    __m256 a0 = _mm256_loadu_ps(x), a1 = a0, a2 = a0, a3 = a0;
    for (; j + 32 <= n; j += 32) {
      a0 = _mm256_max_ps(a0, _mm256_loadu_ps(x + j));
      a1 = _mm256_max_ps(a1, _mm256_loadu_ps(x + j + 8));
      a2 = _mm256_max_ps(a2, _mm256_loadu_ps(x + j + 16));
      a3 = _mm256_max_ps(a3, _mm256_loadu_ps(x + j + 24));
    }
    for (; j + 8 <= n; j += 8) a0 = _mm256_max_ps(a0, _mm256_loadu_ps(x + j));
    // Lanes folded by shuffles: a scalar pass over short rows (the paged attention's runs of 8) waited on each
    // comparison in turn.
    const __m256 a = _mm256_max_ps(_mm256_max_ps(a0, a1), _mm256_max_ps(a2, a3));
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    top = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
  }
  for (; j < n; ++j) top = std::max(top, x[j]);
  return top;
}

// scores[j] = exp(scores[j] - best) for j < L, in place; returns their sum (eight lanes, then the tail).
inline float exp_and_sum(float* scores, int64_t L, float best) {
  const __m256 top = _mm256_set1_ps(best);
  __m256 sum8 = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= L; j += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + j), top));
    _mm256_storeu_ps(scores + j, e);
    sum8 = _mm256_add_ps(sum8, e);
  }
  float total = horizontal_sum(sum8);
  for (; j < L; ++j) {
    scores[j] = std::exp(scores[j] - best);
    total += scores[j];
  }
  return total;
}

// Attention of one query head over the visible slots of its row's cache, in float32; masked slots cost nothing
// but their place in the softmax's vector pass. `at(j)`: where slot j's entry starts in keys/values (its row's,
// or the row a shared-rows cache names, or its block's in a paged cache).
template <typename A, typename At, typename Visible>
void attend(const float* q, const A* keys, const A* values, At at, Visible visible, int64_t L, int64_t D,
            float* scores, float* out) {
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  const float masked = -std::numeric_limits<float>::infinity();
  float best = masked;
  for (int64_t j = 0; j < L; ++j) {
    scores[j] = visible(j) ? dot(q, keys + at(j), D) * scale : masked;
    best = std::max(best, scores[j]);
  }
  std::fill(out, out + D, 0.f);
  if (best == masked) return;  // no visible slot: zeros, never read (see llama.py)
  const float total = exp_and_sum(scores, L, best);
  for (int64_t j = 0; j < L; ++j) {
    if (visible(j)) add_scaled(out, scores[j], values + at(j), D);
  }
  const float inv = 1.f / total;
  for (int64_t d = 0; d < D; ++d) out[d] = round_to<A>(out[d] * inv);
}

struct StackShape {
  int64_t M, H, D, L, heads, kv_heads, inter;
};

template <typename A>
struct LayerRef {
  LinearRef<A> qkv, o, gate_up, down;
  const A *attn_norm, *mlp_norm, *q_norm, *k_norm;
  A *keys, *values;
  const bool* visible;
};

template <typename A>
const A* optional_data(const std::optional<at::Tensor>& t) {
  return t.has_value() ? t->data_ptr<A>() : nullptr;
}

// Float32 scratch for the stack, one region each: residual, normed, q/k/v, attention output, product
// output, gate/up, hidden, scores.
struct Scratch {
  at::Tensor memory;
  float *resid, *normed, *qkv, *attn, *out, *gate_up, *hidden, *scores;
  Scratch(const StackShape& s, const at::TensorOptions& options) {
    const int64_t M = s.M, QKV = (s.heads + 2 * s.kv_heads) * s.D, Q = s.heads * s.D;
    memory = at::empty({M * (3 * s.H + QKV + Q + 3 * s.inter + s.heads * s.L)}, options.dtype(at::kFloat));
    resid = memory.data_ptr<float>();
    normed = resid + M * s.H;
    qkv = normed + M * s.H;
    attn = qkv + M * QKV;
    out = attn + M * Q;
    gate_up = out + M * s.H;
    hidden = gate_up + M * 2 * s.inter;
    scores = hidden + M * s.inter;
  }
};

// One layer; every thread of the region calls it.
template <typename A>
void run_layer(const LayerRef<A>& layer, const StackShape& s, const A* cos, const A* sin, int64_t slot,
               const int64_t* rows, double eps, const Scratch& w) {
  const int64_t M = s.M, H = s.H, D = s.D, Q = s.heads * D, QKV = (s.heads + 2 * s.kv_heads) * D;
#pragma omp single
  for (int64_t m = 0; m < M; ++m) rms_norm(w.resid + m * H, layer.attn_norm, H, eps, w.normed + m * H);
  linear_share(w.normed, M, layer.qkv, w.qkv);
#pragma omp barrier
#pragma omp single
  for (int64_t m = 0; m < M; ++m) {
    float* row = w.qkv + m * QKV;
    for (int64_t h = 0; h < s.heads + s.kv_heads; ++h) {  // q heads, then k heads
      float* head = row + h * D;
      const A* norm = h < s.heads ? layer.q_norm : layer.k_norm;
      if (norm != nullptr) rms_norm(head, norm, D, eps, head);
      rotate(head, cos + m * D, sin + m * D, D);
    }
    for (int64_t g = 0; g < s.kv_heads; ++g) {
      const int64_t at = ((m * s.kv_heads + g) * s.L + slot) * D;
      for (int64_t d = 0; d < D; ++d) {
        layer.keys[at + d] = static_cast<A>(row[Q + g * D + d]);
        layer.values[at + d] = static_cast<A>(row[Q + (s.kv_heads + g) * D + d]);
      }
    }
  }
  const Share tasks(M * s.heads);
  for (int64_t task = tasks.begin; task < tasks.end; ++task) {
    const int64_t m = task / s.heads, h = task % s.heads, g = h / (s.heads / s.kv_heads);
    const A *keys = layer.keys + g * s.L * D, *values = layer.values + g * s.L * D;
    const float* query = w.qkv + m * QKV + h * D;
    const bool* visible = layer.visible + m * s.L;
    float *scores = w.scores + task * s.L, *out = w.attn + m * Q + h * D;
    const int64_t stride = s.kv_heads * s.L * D;  // one row of a layer's cache
    const auto seen = [=](int64_t j) { return visible[j]; };
    if (rows == nullptr) {
      const int64_t own = m * stride;
      attend(query, keys, values, [=](int64_t j) { return own + j * D; }, seen, s.L, D, scores, out);
    } else {  // a shared-rows cache (StaticCache.share_rows): slot j of this row is in row rows[m, j]
      const int64_t* row_of = rows + m * s.L;
      attend(query, keys, values, [=](int64_t j) { return row_of[j] * stride + j * D; }, seen, s.L, D, scores, out);
    }
  }
#pragma omp barrier
  linear_share(w.attn, M, layer.o, w.out);
#pragma omp barrier
#pragma omp single
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t i = m * H; i < (m + 1) * H; ++i) w.resid[i] = round_to<A>(w.resid[i] + w.out[i]);
    rms_norm(w.resid + m * H, layer.mlp_norm, H, eps, w.normed + m * H);
  }
  linear_share(w.normed, M, layer.gate_up, w.gate_up);
#pragma omp barrier
  const Share units(M * s.inter);
  for (int64_t u = units.begin; u < units.end; ++u) {
    const int64_t m = u / s.inter, i = u % s.inter;
    const float g = w.gate_up[m * 2 * s.inter + i];
    w.hidden[u] = round_to<A>(g / (1.f + std::exp(-g)) * w.gate_up[m * 2 * s.inter + s.inter + i]);
  }
#pragma omp barrier
  linear_share(w.hidden, M, layer.down, w.out);
#pragma omp barrier
#pragma omp single
  for (int64_t i = 0; i < M * H; ++i) w.resid[i] = round_to<A>(w.resid[i] + w.out[i]);
}

using OptionalTensors = c10::List<std::optional<at::Tensor>>;

template <typename A>
LinearRef<A> linear_ref(const at::Tensor& weight, const std::optional<at::Tensor>& scale,
                        const std::optional<at::Tensor>& bias, int64_t in, int64_t out, at::ScalarType dtype) {
  const WeightRef w = weight_ref(weight, "decode_layers");
  TORCH_CHECK(w.N == out && w.K == in, "decode_layers: a weight is [", w.N, ", ", w.K, "] where [", out, ", ", in,
              "] was expected");
  TORCH_CHECK((w.dtype == at::kChar) == scale.has_value(), "decode_layers: int8 weights, and only they, come with scales");
  TORCH_CHECK(!scale.has_value() || (scale->scalar_type() == at::kFloat && scale->is_contiguous() && scale->numel() == out),
              "decode_layers: scales must be contiguous float32 with one value per output");
  TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == dtype && bias->is_contiguous() && bias->numel() == out),
              "decode_layers: biases must be contiguous, of x's dtype, with one value per output");
  return {w, scale.has_value() ? scale->data_ptr<float>() : nullptr, optional_data<A>(bias)};
}

template <typename A>
at::Tensor decode_layers_as(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t slot,
                            const int64_t* rows, at::TensorList masks, at::TensorList keys, at::TensorList values, at::TensorList weights,
                            const OptionalTensors& scales, const OptionalTensors& biases, const OptionalTensors& norms,
                            const StackShape& s, double eps) {
  const auto dtype = x.scalar_type();
  std::vector<LayerRef<A>> layers;
  for (size_t l = 0; l < keys.size(); ++l) {
    const size_t i = 4 * l;
    for (const at::Tensor* cache : {&keys[l], &values[l]}) {
      TORCH_CHECK(cache->scalar_type() == dtype && cache->is_contiguous() &&
                      cache->sizes() == at::IntArrayRef({s.M, s.kv_heads, s.L, s.D}),
                  "decode_layers: every cache must be a contiguous [", s.M, ", ", s.kv_heads, ", ", s.L, ", ", s.D,
                  "] tensor of x's dtype");
    }
    TORCH_CHECK(masks[l].scalar_type() == at::kBool && masks[l].is_contiguous() && masks[l].numel() == s.M * s.L,
                "decode_layers: every mask must be a contiguous boolean [rows, slots]");
    for (int64_t k = 0; k < 4; ++k) {
      const auto& norm = norms.get(i + k);
      TORCH_CHECK(k >= 2 || norm.has_value(), "decode_layers: the attention and mlp norms are required");
      TORCH_CHECK(!norm.has_value() || (norm->scalar_type() == dtype && norm->is_contiguous() &&
                                        norm->numel() == (k < 2 ? s.H : s.D)),
                  "decode_layers: norm weights must be contiguous, of x's dtype and the width they normalise");
    }
    const int64_t Q = s.heads * s.D, QKV = (s.heads + 2 * s.kv_heads) * s.D;
    layers.push_back({linear_ref<A>(weights[i], scales.get(i), biases.get(i), s.H, QKV, dtype),
                      linear_ref<A>(weights[i + 1], scales.get(i + 1), biases.get(i + 1), Q, s.H, dtype),
                      linear_ref<A>(weights[i + 2], scales.get(i + 2), biases.get(i + 2), s.H, 2 * s.inter, dtype),
                      linear_ref<A>(weights[i + 3], scales.get(i + 3), biases.get(i + 3), s.inter, s.H, dtype),
                      norms.get(i)->data_ptr<A>(), norms.get(i + 1)->data_ptr<A>(), optional_data<A>(norms.get(i + 2)),
                      optional_data<A>(norms.get(i + 3)), keys[l].data_ptr<A>(), values[l].data_ptr<A>(),
                      masks[l].data_ptr<bool>()});
  }
  Scratch w(s, x.options());
  const A* xs = x.data_ptr<A>();
  for (int64_t i = 0; i < s.M * s.H; ++i) w.resid[i] = static_cast<float>(xs[i]);
  const A* cs = cos.data_ptr<A>();
  const A* sn = sin.data_ptr<A>();
#pragma omp parallel num_threads(at::get_num_threads())
  for (const LayerRef<A>& layer : layers) run_layer(layer, s, cs, sn, slot, rows, eps, w);
  at::Tensor result = at::empty_like(x);
  A* ys = result.data_ptr<A>();
  for (int64_t i = 0; i < s.M * s.H; ++i) ys[i] = static_cast<A>(w.resid[i]);
  return result;
}

// Weights bound to a handle (bind_weights): a compiled step passes the handle, a constant of its graph,
// where it would pass some 300 tensors on every call. Dynamo, AOT autograd and inductor's wrapper spend
// time on every input of every call: in a toy graph, an operator taking 360 tensors cost 434 us a call
// compiled against 52 us for one taking a handle. The caches stay arguments: they are written.
struct BoundWeights {
  std::vector<at::Tensor> weights;
  OptionalTensors scales, biases, norms;
};
std::mutex bound_mutex;
std::unordered_map<int64_t, std::shared_ptr<const BoundWeights>> bound_weights;

void bind_weights(int64_t handle, at::TensorList weights, const OptionalTensors& scales, const OptionalTensors& biases,
                  const OptionalTensors& norms) {
  const size_t n = weights.size();
  TORCH_CHECK(n >= 4 && n % 4 == 0 && scales.size() == n && biases.size() == n && norms.size() == n,
              "bind_weights: takes, for each layer, 4 weights, scales and biases (qkv, o, gate_up, down) and 4 norms "
              "(attention, mlp, q, k)");
  auto entry = std::make_shared<const BoundWeights>(BoundWeights{weights.vec(), scales.copy(), biases.copy(), norms.copy()});
  const std::lock_guard<std::mutex> lock(bound_mutex);
  bound_weights[handle] = std::move(entry);
}

void unbind_weights(int64_t handle) {
  const std::lock_guard<std::mutex> lock(bound_mutex);
  bound_weights.erase(handle);
}

at::Tensor decode_layers(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& slots,
                         at::TensorList masks, at::TensorList keys, at::TensorList values, int64_t handle,
                         int64_t heads, int64_t kv_heads, double eps, const std::optional<at::Tensor>& rows) {
  std::shared_ptr<const BoundWeights> bound;
  {
    const std::lock_guard<std::mutex> lock(bound_mutex);
    const auto found = bound_weights.find(handle);
    TORCH_CHECK(found != bound_weights.end(), "decode_layers: no weights are bound to handle ", handle,
                " (LlamaForCausalLM.bind_native_layers binds them)");
    bound = found->second;
  }
  const std::vector<at::Tensor>& weights = bound->weights;
  const OptionalTensors &scales = bound->scales, &biases = bound->biases, &norms = bound->norms;
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "decode_layers: x must be float32 or bfloat16, not ", dtype);
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.is_contiguous() && x.size(0) >= 1 && x.size(0) <= kMaxRows,
              "decode_layers: x must be a contiguous [rows, hidden] matrix of 1 to ", kMaxRows, " rows on the CPU");
  const size_t n = keys.size();
  TORCH_CHECK(n >= 1 && values.size() == n && masks.size() == n && weights.size() == 4 * n,
              "decode_layers: takes a mask, a key and a value cache for each of the ", weights.size() / 4,
              " layers whose weights are bound, not ", masks.size(), ", ", n, " and ", values.size());
  TORCH_CHECK(heads >= 1 && kv_heads >= 1 && heads % kv_heads == 0 && keys[0].dim() == 4,
              "decode_layers: heads must be a multiple of kv_heads and the caches [rows, kv_heads, slots, head_dim]");
  const StackShape s{x.size(0), x.size(1), keys[0].size(3), keys[0].size(2), heads, kv_heads, weights[2].size(0) / 2};
  TORCH_CHECK(cos.scalar_type() == dtype && sin.scalar_type() == dtype && cos.is_contiguous() && sin.is_contiguous() &&
                  cos.numel() == s.M * s.D && sin.numel() == s.M * s.D,
              "decode_layers: cos and sin must be contiguous [rows, head_dim] of x's dtype");
  TORCH_CHECK(slots.numel() == 1 && slots.scalar_type() == at::kLong && slots.device().is_cpu(),
              "decode_layers: slots must be one int64 slot index on the CPU");
  const int64_t slot = slots.item<int64_t>();
  TORCH_CHECK(slot >= 0 && slot < s.L, "decode_layers: slot ", slot, " is outside the cache of ", s.L, " slots");
  const int64_t* row_of = nullptr;
  if (rows.has_value()) {
    TORCH_CHECK(rows->scalar_type() == at::kLong && rows->is_contiguous() && rows->device().is_cpu() &&
                    rows->sizes() == at::IntArrayRef({s.M, s.L}),
                "decode_layers: rows must be a contiguous int64 [", s.M, ", ", s.L, "] tensor on the CPU");
    row_of = rows->data_ptr<int64_t>();
    TORCH_CHECK(std::all_of(row_of, row_of + s.M * s.L, [&](int64_t r) { return r >= 0 && r < s.M; }),
                "decode_layers: rows must hold row indices in [0, ", s.M, ")");
  }
  if (dtype == at::kBFloat16) {
    return decode_layers_as<c10::BFloat16>(x, cos, sin, slot, row_of, masks, keys, values, weights, scales, biases,
                                           norms, s, eps);
  }
  return decode_layers_as<float>(x, cos, sin, slot, row_of, masks, keys, values, weights, scales, biases, norms, s, eps);
}

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
// Measured on the 2-core AVX2 bench machine, the default model's products of a decode step (30 layers and the
// lm_head, weights from memory): 32 rows 1.2-1.3x the tiles in float32 and bfloat16, 1.1x at 64; behind them at
// 512 rows (MKL's packed kernel runs nearer the peak there), so it is one more route that choices.py measures.
constexpr int kBlockRows = 3, kBlockWeights = 4;
constexpr int64_t kBlocksAhead = 2;          // weight blocks prefetched ahead (1-8 measured alike, 0 about 10% slower)
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
// The kernels are built for AVX2 on every x86 CPU; these functions and the prompt attention's softmax below carry
// the AVX-512 target and run only where `wide` was asked for and the CPU was checked. On the AMX bench machine
// (AVX-512) the AVX2 blocks ran a 32-row decode step's products at 128 GFLOP/s, near what AVX2 allows on its two
// cores.
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
// prefetched along the way, a share before each block of rows: issued all by the first block, a 32-row product of
// weights read from memory ran at 138 GFLOP/s against 187 in cache on the AVX512-BF16 EPYC (more prefetches at once
// than a core keeps in flight).
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
// of rows (18 KB) were more than a 32 KB L1, and the prefetched blocks ahead pushed both out. Measured on the
// AVX512-BF16 EPYC, 30 layers' weights read from memory, GFLOP/s: that product at 32 rows 114 -> 157-164 in
// panels (the AVX-512 blocks 108 -> 125), at 128 and 512 rows 153-158 -> 176-183; products of K = 576 alike
// whether split in two or not, so rows up to kPanelColumns stay whole.
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
// ran a bf16 weight at 0.90-0.93x float32's speed at 128-512 rows on the AVX512-BF16 EPYC, which kept a bf16
// prefill behind float32's on AVX2; widened, 0.96-0.99x. Fewer rows (a decode step's 32) read the weight faster
// as bf16 (1.08x float32 converted in registers, 1.00-1.04x widened), and so did the AVX-512 blocks at every row
// count (1.03-1.18x in registers, 0.94-0.96x widened): those keep converting in registers.
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
  // narrower tiles made thin products that ran at 0.7x the float32 matmul.
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


// ---- float32 products by a weight packed once for MKL's kernels (linear.py's "packed" route). ----
//
// The library's matmul packs the weight into its kernel's layout on every call: for a prompt of 128 rows by the
// default model's layers that is as much memory traffic as the product's own and is not hidden behind it (its
// products ran at 291 GFLOP/s where the same products by weights packed once ran at 375, on the AMX bench machine).
// MKL's packed-matrix API (cblas_sgemm_pack / cblas_sgemm_compute) takes a weight packed once for any number of
// rows. Its functions are weak symbols (declared at the top of this file) that libtorch_cpu provides: a torch
// built without MKL has none, and then mkl_pack returns an empty tensor and the route is not offered.
constexpr int kRowMajor = 101, kNoTrans = 111, kTrans = 112, kPacked = 151, kMatrixB = 162;
// The row count the layout is chosen for; the packed weight serves any number of rows.
constexpr int kPackRows = 128;

bool mkl_packing() {
  return cblas_sgemm_pack_get_size != nullptr && cblas_sgemm_pack != nullptr && cblas_sgemm_compute != nullptr;
}

// weight [N, K] float32 -> its MKL packing (bytes of MKL's own layout, never moved once made: MKL's buffer may point
// into itself), or an empty tensor where torch has no MKL.
at::Tensor mkl_pack(const at::Tensor& weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.device().is_cpu(),
              "mkl_pack: a float32 [out, in] weight on the CPU expected");
  TORCH_CHECK(weight.size(0) < INT32_MAX && weight.size(1) < INT32_MAX, "mkl_pack: dimensions past MKL's int range");
  const auto options = weight.options().dtype(at::kByte);
  if (!mkl_packing()) return at::empty({0}, options);
  const at::Tensor w = weight.contiguous();
  const int N = static_cast<int>(w.size(0)), K = static_cast<int>(w.size(1));
  at::Tensor packed = at::empty({static_cast<int64_t>(cblas_sgemm_pack_get_size(kMatrixB, kPackRows, N, K))}, options);
  cblas_sgemm_pack(kRowMajor, kMatrixB, kTrans, kPackRows, N, K, 1.0f, w.data_ptr<float>(), K,
                   reinterpret_cast<float*>(packed.data_ptr<uint8_t>()));
  return packed;
}

// A row of bfloat16 as float32, and back, rounded to nearest even as torch rounds (a NaN stays a quiet NaN).
inline void widen_row(const c10::BFloat16* in, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(out + i, load8(in + i));
  for (; i < n; ++i) out[i] = static_cast<float>(in[i]);
}

inline void narrow_row(const float* in, c10::BFloat16* out, int64_t n) {
  const __m256i one = _mm256_set1_epi32(1), half = _mm256_set1_epi32(0x7FFF), nan = _mm256_set1_epi32(0x7FC0);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(in + i);
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), one);  // ties go to the even neighbour
    __m256i top = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(half, odd)), 16);
    top = _mm256_blendv_epi8(top, nan, _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
    const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(top), _mm256_extracti128_si256(top, 1));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), packed);
  }
  for (; i < n; ++i) out[i] = c10::BFloat16(in[i]);
}

// rows [M, K] float32 or bfloat16 @ W^T (+ bias [out_features] float32), W [out_features, K] given as mkl_pack's
// result -> [M, out_features] in the rows' dtype, the sums and the bias added in float32 and rounded once. Rows of
// bfloat16 go through in blocks of kPackRows: a block is widened into a buffer and its float32 product narrowed
// while both are in cache (converting the whole rows and product in passes of their own cost a bfloat16 prefill
// 5% on the AMX bench machine held to AVX2).
void check_packed(const at::Tensor& rows, const at::Tensor& packed, int64_t out_features,
                  const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(mkl_packing() && packed.numel() > 0 && packed.scalar_type() == at::kByte,
              "packed_product: a weight packed by mkl_pack expected");
  TORCH_CHECK(rows.dim() == 2 && (rows.scalar_type() == at::kFloat || rows.scalar_type() == at::kBFloat16) &&
              rows.device().is_cpu(), "packed_product: float32 or bfloat16 rows [M, K] on the CPU expected");
  TORCH_CHECK(!bias || (bias->dim() == 1 && bias->size(0) == out_features && bias->scalar_type() == at::kFloat),
              "packed_product: the bias must be float32 [out_features]");
  TORCH_CHECK(packed.numel() >= static_cast<int64_t>(
                                    cblas_sgemm_pack_get_size(kMatrixB, kPackRows, out_features, rows.size(1))),
              "packed_product: the packed weight is smaller than one of [", out_features, ", ", rows.size(1), "]");
}

// packed_product into `out` [M, out_features] (contiguous, in the rows' dtype), for a caller that keeps its buffers.
void packed_product_into(const at::Tensor& rows, const at::Tensor& packed, int64_t out_features,
                         const std::optional<at::Tensor>& bias, at::Tensor& out) {
  const bool bf16 = rows.scalar_type() == at::kBFloat16;
  const at::Tensor x = rows.contiguous();
  const int64_t M = x.size(0), N = out_features, K = x.size(1);
  const float* w = reinterpret_cast<const float*>(packed.data_ptr<uint8_t>());
  const at::Tensor b = bias ? bias->contiguous() : at::Tensor();
  const float* added = bias ? b.data_ptr<float>() : nullptr;
  const auto compute = [&](int64_t m, const float* a, float* c) {
    cblas_sgemm_compute(kRowMajor, kNoTrans, kPacked, static_cast<int>(m), static_cast<int>(N), static_cast<int>(K),
                        a, static_cast<int>(K), w, static_cast<int>(N), 0.0f, c, static_cast<int>(N));
  };
  if (M == 0) return;
  if (!bf16) {
    compute(M, x.data_ptr<float>(), out.data_ptr<float>());
    if (added) {
      float* y = out.data_ptr<float>();
      at::parallel_for(0, M, 1, [&](int64_t begin, int64_t end) {
        for (int64_t m = begin; m < end; ++m)
          for (int64_t n = 0; n < N; ++n) y[m * N + n] += added[n];
      });
    }
    return;
  }
  const c10::BFloat16* in = x.data_ptr<c10::BFloat16>();
  c10::BFloat16* y = out.data_ptr<c10::BFloat16>();
  // A block of rows widened into `a`, multiplied into `c`, the bias added and rounded back; `rows(m, fn)` runs fn on
  // each of the block's m rows.
  const auto through = [&](int64_t m0, int64_t m, float* a, float* c, const auto& rows) {
    rows(m, [&](int64_t i) { widen_row(in + (m0 + i) * K, a + i * K, K); });
    compute(m, a, c);
    rows(m, [&](int64_t i) {
      float* row = c + i * N;
      if (added)
        for (int64_t n = 0; n < N; ++n) row[n] += added[n];
      narrow_row(row, y + (m0 + i) * N, N);
    });
  };
  const int64_t threads = at::get_num_threads();
  if (M >= threads * kPackRows) {
    // Each thread takes blocks of its own (MKL runs on the calling thread inside the region), so a block's widening,
    // product and rounding follow each other in that thread's cache. Held to AVX2, the AMX bench machine's bf16 rows
    // then cost 1.00-1.01x float32 rows' time at 512 and 2,048 rows (1.02-1.04x with MKL's threads sharing each
    // block's product, as below), but 1.06x at 128 rows, where each thread's block is half as long.
    const OwnBlocks own(M, kPackRows, threads);
    const int64_t block = own.rows;
    const auto serially = [](int64_t m, const auto& fn) {
      for (int64_t i = 0; i < m; ++i) fn(i);
    };
    at::parallel_for(0, own.count, 1, [&](int64_t first, int64_t last) {
      const std::unique_ptr<float[]> a(new float[block * K]), c(new float[block * N]);  // left uninitialised
      for (int64_t b = first; b < last && b * block < M; ++b)
        through(b * block, std::min(block, M - b * block), a.get(), c.get(), serially);
    });
    return;
  }
  // Fewer rows: MKL's threads share each block's product, and the block's rows are widened and rounded in parallel.
  const auto shared = [](int64_t m, const auto& fn) {
    at::parallel_for(0, m, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) fn(i);
    });
  };
  const int64_t block = std::min<int64_t>(M, kPackRows);
  const std::unique_ptr<float[]> a(new float[block * K]), c(new float[block * N]);  // left uninitialised
  for (int64_t m0 = 0; m0 < M; m0 += block) through(m0, std::min(block, M - m0), a.get(), c.get(), shared);
}

at::Tensor packed_product(const at::Tensor& rows, const at::Tensor& packed, int64_t out_features,
                          const std::optional<at::Tensor>& bias) {
  check_packed(rows, packed, out_features, bias);
  at::Tensor out = at::empty({rows.size(0), out_features}, rows.options());
  packed_product_into(rows, packed, out_features, bias, out);
  return out;
}


// Causal attention of a prompt (or a prompt chunk) over its keys, in float32: q [H, T, D], k, v [KV, L, D], query
// i at position L - T + i, seeing keys j <= its position (and, with a window w > 0, j > position - w). A task is
// one kv head and a block of queries with every query head of its group stacked (GQA): their scores are one
// matmul [heads x block, D] x [D, keys], the softmax runs on the visible range of each row while it is in cache,
// and the output is a second matmul [heads x block, keys] x [keys, D]. Stacking the group makes the products wide
// enough for the library's matmul to run near its peak, where attention kernels with head_dim 64 products of one
// head at a time ran at a third of it.
constexpr int64_t kQueryBlock = 64;
// Past this many visible keys a block's scores ([heads x 64, keys] floats) no longer stay in a core's L2: the keys
// are then taken kKeyBlock at a time with an online softmax (a running maximum and sum per row, the output
// rescaled when the maximum grows), so the scores, probabilities and the output block stay in cache throughout.
constexpr int64_t kWholeRowKeys = 768, kKeyBlock = 256;

// The softmax of a row of scores between the two products: its largest visible score (`top`), then exp(score - top)
// in place and the row's sum (`exponentiate`). At 2,048 tokens these passes took a quarter of the kernel's time on
// the AMX bench machine with AVX2's 8 lanes (the two products alone ran at 335 GFLOP/s, the kernel at 255); with
// AVX-512 (`wide`, where the CPU has avx512f) they read 16 lanes a vector and end on masked loads, not a scalar tail.
struct NarrowSoftmax {
  static float top(const float* x, int64_t n) { return row_max(x, n); }
  static float exponentiate(float* x, int64_t n, float best) { return exp_and_sum(x, n, best); }
};

// exp16 is exp8 with 16 lanes: the same reduction and polynomial, 2^n applied by scalef.
DECODEKIT_AVX512 inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(88.f));
  const __m512 n =
      _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Low), _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2High), x));
  __m512 p = _mm512_setzero_ps();
  for (const float c : kExpTaylor) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  return _mm512_scalef_ps(p, n);
}

// The lanes of a 16-float vector that hold the first min(n, 16) of n remaining floats.
DECODEKIT_AVX512 inline __mmask16 lanes_left(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
}

struct WideSoftmax {
  DECODEKIT_AVX512 static float top(const float* x, int64_t n) {
    const __m512 lowest = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    __m512 a0 = lowest, a1 = lowest, a2 = lowest, a3 = lowest;
    int64_t j = 0;
    for (; j + 64 <= n; j += 64) {
      a0 = _mm512_max_ps(a0, _mm512_loadu_ps(x + j));
      a1 = _mm512_max_ps(a1, _mm512_loadu_ps(x + j + 16));
      a2 = _mm512_max_ps(a2, _mm512_loadu_ps(x + j + 32));
      a3 = _mm512_max_ps(a3, _mm512_loadu_ps(x + j + 48));
    }
    for (; j < n; j += 16) a0 = _mm512_max_ps(a0, _mm512_mask_loadu_ps(lowest, lanes_left(n - j), x + j));
    return _mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(a0, a1), _mm512_max_ps(a2, a3)));
  }

  DECODEKIT_AVX512 static float exponentiate(float* x, int64_t n, float best) {
    const __m512 shift = _mm512_set1_ps(best);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 lanes = lanes_left(n - j);
      const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(lanes, x + j), shift));
      _mm512_mask_storeu_ps(x + j, lanes, e);
      sum = _mm512_mask_add_ps(sum, lanes, sum, e);
    }
    return _mm512_reduce_add_ps(sum);
  }
};

// One key block's scores of a row folded into the row's running softmax (its largest score so far `best` and the sum
// `total` of exp(score - best)): `visible` [from, to) is the row's keys relative to the task's first, `offset` the
// block's first relative to it, `n` its keys. The visible scores become exp(score - best) in place and the rest of
// `width` floats zeros; where the maximum grows, the row's output sums so far (`out`, D floats) and its total shrink by
// exp(old - new). Whether any key of the block was visible.
template <typename Softmax>
bool fold_block_row(float* row, std::pair<int64_t, int64_t> visible, int64_t offset, int64_t n, int64_t width,
                    float& best, float& total, float* out, int64_t D) {
  const int64_t from = std::max<int64_t>(visible.first - offset, 0), to = std::min<int64_t>(visible.second - offset, n);
  if (from >= to) {  // nothing of this block is visible to the row
    std::fill(row, row + width, 0.f);
    return false;
  }
  const float top = Softmax::top(row + from, to - from);
  if (top > best) {
    const float shrink = std::exp(best - top);
    total *= shrink;
    for (int64_t d = 0; d < D; ++d) out[d] *= shrink;
    best = top;
  }
  total += Softmax::exponentiate(row + from, to - from, best);
  std::fill(row, row + from, 0.f);
  std::fill(row + to, row + width, 0.f);
  return true;
}

// A row's output sums divided by its softmax's total (zeros where it saw no key).
inline void divide_row(float* out, int64_t D, float total) {
  const float inverse = total > 0.f ? 1.f / total : 0.f;
  for (int64_t d = 0; d < D; ++d) out[d] *= inverse;
}

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
// values in two passes: 7-13 GB/s of the 28 a 2-core AVX512-BF16 EPYC's memory gives (30 layers' pools, blocks
// scattered), where runs read 11-18. Runs of 16 with AVX-512 read no faster there (docs/performance.md).
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
// prefetches stalled the work they were meant to overlap (a core keeps only so many misses in flight): with runs of
// 16 they read 14-17 GB/s, spread so about 19. Into L2 (T1) rather than L1: `perf` put a quarter of the kernel's
// samples on the prefetch waiting for a free L1 miss slot; the AVX512-BF16 EPYC's L2 keeps more misses in flight, and
// a 32-row step over 30 layers' pools ran 12-25% faster (in one process, alternating).
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
// probabilities broadcast from their rows (no copy of either, where the library's matmul packs both first). Against
// the library's matmul of the same blocks (AMD EPYC, AVX-512; paired runs of one layer's attention, 512 and 2,048
// tokens and a 256-token chunk after 768): the float32 kernel 6-7% faster, the int8 one 2-14%.
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

// Where a row computed in float32 goes: straight to a float32 output, or through `buffer` to a bfloat16 one.
inline float* row_out(float* out, float*) { return out; }
inline float* row_out(c10::BFloat16*, float* buffer) { return buffer; }
inline void row_done(float*, const float*, int64_t) {}
inline void row_done(c10::BFloat16* out, const float* buffer, int64_t n) { narrow_row(buffer, out, n); }

inline void check_elementwise(const char* op, std::initializer_list<const at::Tensor*> tensors) {
  const at::ScalarType dtype = (*tensors.begin())->scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, op, ": float32 or bfloat16 tensors expected");
  for (const at::Tensor* t : tensors) TORCH_CHECK(t->scalar_type() == dtype, op, ": tensors of one dtype expected");
}

// x [..., D] -> weight * x / sqrt(mean(x^2) + eps) per row, weight [D].
template <typename A>
void rms_norm_as(const A* xp, const A* wp, int64_t M, int64_t D, double eps, A* op) {
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> buffer(std::is_same_v<A, float> ? 0 : D);
    for (int64_t m = begin; m < end; ++m) {
      const A* r = xp + m * D;
      float* o = row_out(op + m * D, buffer.data());
      __m256 sum8 = _mm256_setzero_ps();
      int64_t d = 0;
      for (; d + 8 <= D; d += 8) sum8 = _mm256_fmadd_ps(load8(r + d), load8(r + d), sum8);
      float squares = horizontal_sum(sum8);
      for (; d < D; ++d) squares += static_cast<float>(r[d]) * static_cast<float>(r[d]);
      const float inv = 1.f / std::sqrt(squares / D + static_cast<float>(eps));
      const __m256 inv8 = _mm256_set1_ps(inv);
      for (d = 0; d + 8 <= D; d += 8) _mm256_storeu_ps(o + d, _mm256_mul_ps(load8(wp + d), _mm256_mul_ps(load8(r + d), inv8)));
      for (; d < D; ++d) o[d] = static_cast<float>(wp[d]) * (static_cast<float>(r[d]) * inv);
      row_done(op + m * D, o, D);
    }
  });
}

// rms_norm_as for contiguous rows and weight of one dtype (float32 or bfloat16), into `out` of theirs.
void rms_norm_into(const at::Tensor& rows, const at::Tensor& w, double eps, at::Tensor& out) {
  const int64_t D = w.size(0), M = D == 0 ? 0 : rows.numel() / D;
  if (rows.scalar_type() == at::kBFloat16) {
    rms_norm_as(rows.data_ptr<c10::BFloat16>(), w.data_ptr<c10::BFloat16>(), M, D, eps, out.data_ptr<c10::BFloat16>());
  } else {
    rms_norm_as(rows.data_ptr<float>(), w.data_ptr<float>(), M, D, eps, out.data_ptr<float>());
  }
}

at::Tensor rms_norm_rows(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_elementwise("rms_norm", {&x, &weight});
  TORCH_CHECK(x.dim() >= 1 && weight.dim() == 1 && x.size(-1) == weight.size(0), "rms_norm: rows [..., D] and weight [D] expected");
  const at::Tensor rows = x.contiguous(), w = weight.contiguous();
  at::Tensor out = at::empty(rows.sizes(), rows.options());
  rms_norm_into(rows, w, eps, out);
  return out;
}

// gate_up [..., 2I] (gate then up, as MLP's fused product) -> silu(gate) * up [..., I].
template <typename A>
void silu_mul_as(const A* gp, int64_t M, int64_t I, A* op) {
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    const __m256 one = _mm256_set1_ps(1.f);
    std::vector<float> buffer(std::is_same_v<A, float> ? 0 : I);
    for (int64_t m = begin; m < end; ++m) {
      const A* g = gp + m * 2 * I;
      const A* u = g + I;
      float* o = row_out(op + m * I, buffer.data());
      int64_t i = 0;
      for (; i + 8 <= I; i += 8) {  // exp8 clamps its input: a gate below -87 gives a silu of about 0, as it should
        const __m256 x = load8(g + i);
        const __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), x))));
        _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_mul_ps(x, sig), load8(u + i)));
      }
      for (; i < I; ++i) {
        const float x = static_cast<float>(g[i]);
        o[i] = x / (1.f + std::exp(-x)) * static_cast<float>(u[i]);
      }
      row_done(op + m * I, o, I);
    }
  });
}

// silu_mul_as for M contiguous rows [2 x I] of float32 or bfloat16, into `out` [M, I] of their dtype.
void silu_mul_into(const at::Tensor& rows, int64_t M, int64_t I, at::Tensor& out) {
  if (rows.scalar_type() == at::kBFloat16) {
    silu_mul_as(rows.data_ptr<c10::BFloat16>(), M, I, out.data_ptr<c10::BFloat16>());
  } else {
    silu_mul_as(rows.data_ptr<float>(), M, I, out.data_ptr<float>());
  }
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_elementwise("silu_mul", {&gate_up});
  TORCH_CHECK(gate_up.dim() >= 1 && gate_up.size(-1) % 2 == 0, "silu_mul: rows [..., 2 * I] expected");
  const at::Tensor rows = gate_up.contiguous();
  const int64_t I = rows.size(-1) / 2, M = I == 0 ? 0 : rows.numel() / (2 * I);
  std::vector<int64_t> shape(rows.sizes().begin(), rows.sizes().end());
  shape.back() = I;
  at::Tensor out = at::empty(shape, rows.options());
  silu_mul_into(rows, M, I, out);
  return out;
}

// Rotary embedding of q or k [B, H, T, D] (any strides but a contiguous last dimension: the split of the fused
// q/k/v product, transposed) by cos, sin [B or 1, 1, T, D]: x * cos + rotate_half(x) * sin, as rope.apply_rotary,
// written contiguous [B, H, T, D].
template <typename A>
void rotary_as(const at::Tensor& x, const A* cp, const A* sp, int64_t table_b, A* op) {
  const int64_t B = x.size(0), H = x.size(1), T = x.size(2), D = x.size(3), half = D / 2;
  const A* xp = x.data_ptr<A>();
  const int64_t sb = x.stride(0), sh = x.stride(1), st = x.stride(2);
  at::parallel_for(0, B * H * T, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> buffer(std::is_same_v<A, float> ? 0 : D);
    for (int64_t r = begin; r < end; ++r) {
      const int64_t b = r / (H * T), h = r / T % H, t = r % T;
      const A* in = xp + b * sb + h * sh + t * st;
      const A* co = cp + b * table_b + t * D;
      const A* si = sp + b * table_b + t * D;
      float* o = row_out(op + r * D, buffer.data());
      int64_t d = 0;
      for (; d + 8 <= half; d += 8) {  // the first half pairs with minus the second, the second with the first
        const __m256 lo = load8(in + d), hi = load8(in + half + d);
        _mm256_storeu_ps(o + d, _mm256_fnmadd_ps(hi, load8(si + d), _mm256_mul_ps(lo, load8(co + d))));
        _mm256_storeu_ps(o + half + d, _mm256_fmadd_ps(lo, load8(si + half + d), _mm256_mul_ps(hi, load8(co + half + d))));
      }
      for (; d < half; ++d) {
        const float lo = static_cast<float>(in[d]), hi = static_cast<float>(in[half + d]);
        o[d] = lo * static_cast<float>(co[d]) - hi * static_cast<float>(si[d]);
        o[half + d] = hi * static_cast<float>(co[half + d]) + lo * static_cast<float>(si[half + d]);
      }
      row_done(op + r * D, o, D);
    }
  });
}

// rotary_as for x of float32 or bfloat16 and contiguous tables of its dtype, into a contiguous `out`.
void rotary_into(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t table_b, at::Tensor& out) {
  if (x.scalar_type() == at::kBFloat16) {
    rotary_as(x, cos.data_ptr<c10::BFloat16>(), sin.data_ptr<c10::BFloat16>(), table_b, out.data_ptr<c10::BFloat16>());
  } else {
    rotary_as(x, cos.data_ptr<float>(), sin.data_ptr<float>(), table_b, out.data_ptr<float>());
  }
}

at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  check_elementwise("rotary", {&x, &cos, &sin});
  TORCH_CHECK(x.dim() == 4 && cos.dim() == 4 && sin.sizes() == cos.sizes() && x.size(3) % 2 == 0 && x.stride(3) == 1 &&
              cos.size(1) == 1 && cos.size(2) == x.size(2) && cos.size(3) == x.size(3) &&
              (cos.size(0) == x.size(0) || cos.size(0) == 1),
              "rotary: x [B, H, T, D] (D even, its last dimension contiguous) and cos, sin [B or 1, 1, T, D] expected");
  const at::Tensor c = cos.contiguous(), sn = sin.contiguous();
  at::Tensor out = at::empty(x.sizes(), x.options());
  rotary_into(x, c, sn, c.size(0) == 1 ? 0 : x.size(2) * x.size(3), out);
  return out;
}


// ---- A prompt's decoder layer in two calls (llama.py's prompt layers). ----
//
// What Block computes for one unpadded prompt on CPU, float32 or bfloat16 rows (products and attention in float32),
// by the kernels the Python layers call, in their order and rounding where they round, so the results are the same
// bits; what goes is the Python between some twenty operations a layer (about 6 ms of a 128-token prefill of the
// default model on the AMX bench machine). The cache stays with the caller: it
// stores the keys and values prompt_layer_start returns and hands prompt_layer_end the keys and values to attend to.

// The route of one product, as the Python layers take it for float32 rows (linear.Linear.prompt_route,
// quantize.Int8Linear.prompt_route): the library's matmul by a float32 weight, a weight packed by mkl_pack,
// decodekit::tiled_product's tiles, blocks or AVX-512 blocks, an int8 weight's split product or tiles (with its
// scales; kInterleaved added where its columns are stored interleaved), or a float32 weight reordered for oneDNN.
enum ProductRoute : int64_t {
  kLibraryRoute = 0, kPackedRoute = 1, kTilesRoute = 2, kBlocksRoute = 3, kWideRoute = 4, kInt8SplitRoute = 5,
  kInt8TilesRoute = 6, kOneDnnRoute = 7, kInterleaved = 16
};

// rows [M, K] float32 @ W^T (+ bias), W reordered by mkldnn._reorder_linear_weight: oneDNN's linear, the operator
// linear.onednn_product calls, found once through the dispatcher.
at::Tensor onednn_product(const at::Tensor& rows, const at::Tensor& reordered, const std::optional<at::Tensor>& bias) {
  static const auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  std::vector<c10::IValue> stack{rows, reordered, bias.has_value() ? c10::IValue(*bias) : c10::IValue(),
                                 c10::IValue(std::string("none")), c10::IValue(c10::List<std::optional<at::Scalar>>()),
                                 c10::IValue(std::string(""))};
  op.callBoxed(&stack);
  return stack.at(0).toTensor();
}

// The product [M, N] in the rows' dtype (a new tensor: the routes that make their own are not copied again).
at::Tensor layer_product(const at::Tensor& rows, const at::Tensor& weight, int64_t route, int64_t N,
                         const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& scales) {
  const bool interleaved = route & kInterleaved;
  route &= ~kInterleaved;
  TORCH_CHECK(route >= kLibraryRoute && route <= kOneDnnRoute &&
                  (!interleaved || route == kInt8SplitRoute || route == kInt8TilesRoute),
              "prompt layer: a product route from 0 to 7 expected (16 added for an int8 weight's interleaved columns), "
              "got ", route + (interleaved ? kInterleaved : 0));
  TORCH_CHECK(!bias || (bias->dim() == 1 && bias->size(0) == N && bias->scalar_type() == at::kFloat),
              "prompt layer: a bias must be float32 [", N, "]");
  TORCH_CHECK(route == kInt8SplitRoute || route == kInt8TilesRoute || !scales,
              "prompt layer: scales go with an int8 weight's route");
  if (route == kPackedRoute) {
    check_packed(rows, weight, N, bias);
    at::Tensor out = at::empty({rows.size(0), N}, rows.options());
    packed_product_into(rows, weight, N, bias, out);
    return out;
  }
  TORCH_CHECK(weight.dim() == 2 && weight.size(0) == N && weight.size(1) == rows.size(1),
              "prompt layer: a weight [", N, ", ", rows.size(1), "] expected, got ", weight.sizes());
  if (route == kOneDnnRoute) {
    TORCH_CHECK(weight.scalar_type() == at::kFloat, "prompt layer: oneDNN's route takes a float32 weight");
    return onednn_product(rows.to(at::kFloat), weight, bias).to(rows.scalar_type());
  }
  // bfloat16 rows: computed in float32 and rounded once, as Linear._many_rows does.
  const at::Tensor wide_rows = rows.to(at::kFloat);
  at::Tensor y;
  if (route == kLibraryRoute) {  // as F.linear on float32 operands: addmm with a bias, mm without
    const at::Tensor w = weight.to(at::kFloat);
    y = bias ? at::addmm(*bias, wide_rows, w.t()) : at::mm(wide_rows, w.t());
  } else {
    if (route == kInt8SplitRoute) {
      y = split_product(wide_rows, weight, scales, interleaved);
    } else if (route == kInt8TilesRoute) {
      TORCH_CHECK(weight.scalar_type() == at::kChar, "prompt layer: int8 tiles take an int8 weight");
      y = tiled_product(wide_rows, weight, scales, interleaved, false, false);
    } else {
      y = tiled_product(wide_rows, weight, std::nullopt, false, route != kTilesRoute, route == kWideRoute);
    }
    if (bias) y = at::add(y, *bias);
  }
  return y.to(rows.scalar_type());
}

void check_prompt_rows(const char* op, const at::Tensor& x, const at::Tensor& norm) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) &&
              x.is_contiguous() && x.device().is_cpu(), op,
              ": contiguous float32 or bfloat16 rows [T, hidden] on the CPU expected");
  TORCH_CHECK(norm.dim() == 1 && norm.size(0) == x.size(1) && norm.scalar_type() == x.scalar_type() &&
              norm.is_contiguous(), op, ": a norm weight [hidden] of the rows' dtype expected");
}

// RMSNorm of a head's q or k rows [1, T, heads, D] (a view into the q/k/v product) as llama.RMSNorm computes it for
// rows that are not contiguous: the library's rms_norm in float32, rounded to the rows' dtype, then the weight.
at::Tensor head_norm(const at::Tensor& x, const std::optional<at::Tensor>& weight, double eps) {
  if (!weight) return x;
  return at::mul(*weight, at::rms_norm(x.to(at::kFloat), {x.size(-1)}, std::nullopt, eps).to(x.scalar_type()));
}

// x [T, hidden] -> (q [1, heads, T, D], k and v [1, kv_heads, T, D]): the attention norm, the q/k/v product, the
// heads' q/k norms where the model has them and the rotary embedding by cos, sin [T, D].
std::tuple<at::Tensor, at::Tensor, at::Tensor> prompt_layer_start(
    const at::Tensor& x, const at::Tensor& norm, double eps, const at::Tensor& qkv, int64_t qkv_route,
    const std::optional<at::Tensor>& qkv_bias, const std::optional<at::Tensor>& qkv_scales,
    const std::optional<at::Tensor>& q_norm,
    const std::optional<at::Tensor>& k_norm, const at::Tensor& cos, const at::Tensor& sin, int64_t heads,
    int64_t kv_heads) {
  check_prompt_rows("prompt_layer_start", x, norm);
  const int64_t T = x.size(0), hidden = x.size(1), D = cos.size(-1);
  TORCH_CHECK(cos.dim() == 2 && cos.sizes() == sin.sizes() && cos.size(0) == T && D % 2 == 0 &&
              cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "prompt_layer_start: cos, sin [T, head_dim] (head_dim even) of the rows' dtype expected");
  TORCH_CHECK(heads > 0 && kv_heads > 0 && heads % kv_heads == 0, "prompt_layer_start: heads a multiple of kv_heads");
  const int64_t N = (heads + 2 * kv_heads) * D;
  at::Tensor h = at::empty_like(x);
  rms_norm_into(x, norm, eps, h);
  const at::Tensor product = layer_product(h, qkv, qkv_route, N, qkv_bias, qkv_scales);
  const at::Tensor q = head_norm(product.narrow(1, 0, heads * D).view({1, T, heads, D}), q_norm, eps);
  const at::Tensor k = head_norm(product.narrow(1, heads * D, kv_heads * D).view({1, T, kv_heads, D}), k_norm, eps);
  const at::Tensor v = product.narrow(1, (heads + kv_heads) * D, kv_heads * D).view({1, T, kv_heads, D});
  const at::Tensor c = cos.contiguous(), sn = sin.contiguous();
  const auto rotated = [&](const at::Tensor& rows) {
    const at::Tensor by_head = rows.transpose(1, 2);
    at::Tensor out = at::empty(by_head.sizes(), x.options());
    rotary_into(by_head, c, sn, 0, out);
    return out;
  };
  return {rotated(q), rotated(k), v.transpose(1, 2).contiguous()};
}

// The layer after its attention, x [T, hidden] updated in place: the o product of `attended` [T, heads x D] (the
// rows' dtype) added to x, the MLP norm, the gate/up product [T, 2 x intermediate] (gate first), SiLU(gate) * up and
// the down product added to x.
at::Tensor& prompt_layer_finish(at::Tensor& x, const at::Tensor& attended, const at::Tensor& o, int64_t o_route,
                                const std::optional<at::Tensor>& o_bias, const std::optional<at::Tensor>& o_scales,
                                const at::Tensor& norm, double eps, const at::Tensor& gate_up, int64_t gate_up_route,
                                const std::optional<at::Tensor>& gate_up_bias,
                                const std::optional<at::Tensor>& gate_up_scales, const at::Tensor& down,
                                int64_t down_route, const std::optional<at::Tensor>& down_bias,
                                const std::optional<at::Tensor>& down_scales, int64_t intermediate) {
  check_prompt_rows("prompt_layer_finish", x, norm);
  const int64_t T = x.size(0), hidden = x.size(1);
  TORCH_CHECK(attended.dim() == 2 && attended.size(0) == T && attended.scalar_type() == x.scalar_type() &&
              attended.is_contiguous(),
              "prompt_layer_finish: the attention output [T, heads x head_dim] of the rows' dtype, contiguous, expected");
  TORCH_CHECK(intermediate > 0, "prompt_layer_finish: a positive intermediate size expected");
  x.add_(layer_product(attended, o, o_route, hidden, o_bias, o_scales));
  at::Tensor h = at::empty_like(x);
  rms_norm_into(x, norm, eps, h);
  const int64_t I = intermediate;
  const at::Tensor both = layer_product(h, gate_up, gate_up_route, 2 * I, gate_up_bias, gate_up_scales);
  at::Tensor hidden_rows = at::empty({T, I}, x.options());
  silu_mul_into(both, T, I, hidden_rows);
  x.add_(layer_product(hidden_rows, down, down_route, hidden, down_bias, down_scales));
  return x;
}

// The rest of the layer, x [T, hidden] updated in place: attention of q [1, heads, T, D] over k, v [1, kv_heads, L,
// D] (causal, the prompt's queries last; a sliding window > 0), then prompt_layer_finish. `wide`: the softmax
// passes with AVX-512.
at::Tensor& prompt_layer_end(at::Tensor& x, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                             int64_t window, bool wide, const at::Tensor& o, int64_t o_route,
                             const std::optional<at::Tensor>& o_bias, const std::optional<at::Tensor>& o_scales,
                             const at::Tensor& norm, double eps, const at::Tensor& gate_up, int64_t gate_up_route,
                             const std::optional<at::Tensor>& gate_up_bias,
                             const std::optional<at::Tensor>& gate_up_scales, const at::Tensor& down,
                             int64_t down_route, const std::optional<at::Tensor>& down_bias,
                             const std::optional<at::Tensor>& down_scales, int64_t intermediate) {
  check_prompt_rows("prompt_layer_end", x, norm);
  const auto dtype = x.scalar_type();
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.sizes() == k.sizes() && q.size(0) == 1 && k.size(0) == 1 &&
              q.scalar_type() == dtype && k.scalar_type() == dtype && v.scalar_type() == dtype &&
              q.size(2) == x.size(0) && k.size(2) >= q.size(2) && k.size(3) == q.size(3) &&
              q.size(1) % k.size(1) == 0,
              "prompt_layer_end: q [1, heads, T, D] and k, v [1, kv_heads, L >= T, D] of the rows' dtype expected");
  TORCH_CHECK(!wide || __builtin_cpu_supports("avx512f"), "prompt_layer_end: wide=True needs a CPU with avx512f");
  const int64_t T = x.size(0), heads = q.size(1), D = q.size(3);
  // Attention in float32 (bfloat16 q, k, v widened, its output rounded back, as attention.kernel does).
  const auto float32 = [](const at::Tensor& t) { return t[0].to(at::kFloat).contiguous(); };
  at::Tensor y = at::empty({T, heads * D}, x.options().dtype(at::kFloat));
  attend_into(float32(q), float32(k), float32(v), window, wide, y.data_ptr<float>(), true);
  return prompt_layer_finish(x, y.to(dtype), o, o_route, o_bias, o_scales, norm, eps, gate_up, gate_up_route,
                             gate_up_bias, gate_up_scales, down, down_route, down_bias, down_scales, intermediate);
}

}  // namespace


TORCH_LIBRARY_FRAGMENT(decodekit, m) {  // packed.py defines the namespace
  m.def("row_product(Tensor rows, Tensor weight) -> Tensor");
  m.def("row_product_int8(Tensor rows, Tensor weight) -> Tensor");
  m.def(
      "decode_layers(Tensor x, Tensor cos, Tensor sin, Tensor slots, Tensor[] masks, Tensor(a!)[] keys, "
      "Tensor(b!)[] values, int weights, int heads, int kv_heads, float eps, Tensor? rows=None) -> Tensor");
  // Called eagerly, never traced: one kernel for every backend.
  m.def("bind_weights(int handle, Tensor[] weights, Tensor?[] scales, Tensor?[] biases, Tensor?[] norms) -> ()",
        &bind_weights);
  m.def("unbind_weights(int handle) -> ()", &unbind_weights);
  m.def("split_product(Tensor rows, Tensor weight, Tensor? scales=None, bool interleaved=False) -> Tensor");
  m.def("mkl_pack(Tensor weight) -> Tensor");
  m.def("packed_product(Tensor rows, Tensor packed, int out_features, Tensor? bias=None) -> Tensor");
  m.def("prefill_attention(Tensor q, Tensor k, Tensor v, int window=0, bool wide=False) -> Tensor");
  m.def("prefill_attention_int8(Tensor q, Tensor k, Tensor v, int window=0) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("rotary(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.def("prompt_layer_start(Tensor x, Tensor norm, float eps, Tensor qkv, int qkv_route, Tensor? qkv_bias, "
        "Tensor? qkv_scales, Tensor? q_norm, Tensor? k_norm, Tensor cos, Tensor sin, int heads, int kv_heads) -> "
        "(Tensor, Tensor, Tensor)");
  m.def("prompt_layer_end(Tensor(a!) x, Tensor q, Tensor k, Tensor v, int window, bool wide, Tensor o, int o_route, "
        "Tensor? o_bias, Tensor? o_scales, Tensor norm, float eps, Tensor gate_up, int gate_up_route, "
        "Tensor? gate_up_bias, Tensor? gate_up_scales, Tensor down, int down_route, Tensor? down_bias, "
        "Tensor? down_scales, int intermediate) -> Tensor(a!)");
  m.def("prompt_layer_finish(Tensor(a!) x, Tensor attended, Tensor o, int o_route, Tensor? o_bias, Tensor? o_scales, "
        "Tensor norm, float eps, Tensor gate_up, int gate_up_route, Tensor? gate_up_bias, Tensor? gate_up_scales, "
        "Tensor down, int down_route, Tensor? down_bias, Tensor? down_scales, int intermediate) -> Tensor(a!)");
  m.def("set_block_lanes(int lanes=0) -> int", &set_block_lanes);
  m.def("tiled_product(Tensor rows, Tensor weight, Tensor? scales=None, bool interleaved=False, bool blocks=False, "
        "bool wide=False) -> Tensor");
  m.def("paged_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) keys, Tensor(b!) values, Tensor slots, Tensor tables, "
        "Tensor owner, Tensor positions, int block_size, int window) -> Tensor");
}

TORCH_LIBRARY_IMPL(decodekit, CPU, m) {
  m.impl("row_product", &row_product);
  m.impl("row_product_int8", &row_product_int8);
  m.impl("decode_layers", &decode_layers);
  m.impl("split_product", &split_product);
  m.impl("tiled_product", &tiled_product);
  m.impl("prefill_attention", &prefill_attention);
  m.impl("prefill_attention_int8", &prefill_attention_int8);
  m.impl("rms_norm", &rms_norm_rows);
  m.impl("silu_mul", &silu_mul);
  m.impl("rotary", &rotary);
  m.impl("prompt_layer_start", &prompt_layer_start);
  m.impl("prompt_layer_end", &prompt_layer_end);
  m.impl("prompt_layer_finish", &prompt_layer_finish);
  m.impl("paged_attention", &paged_attention);
  m.impl("mkl_pack", &mkl_pack);
  m.impl("packed_product", &packed_product);
}

// A weight reordered for oneDNN (the "onednn" route) is an MkldnnCPU tensor, which sends the call there.
TORCH_LIBRARY_IMPL(decodekit, MkldnnCPU, m) {
  m.impl("prompt_layer_start", &prompt_layer_start);
  m.impl("prompt_layer_end", &prompt_layer_end);
  m.impl("prompt_layer_finish", &prompt_layer_finish);
}
