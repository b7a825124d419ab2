// GGUF's blocks of 32 (Q4Block, Q8Block) and their dot products, AVX2 and AVX-512.
// Part of kernels.cpp, the one translation unit of decodekit's CPU kernels: it reads what the sections
// before it in kernels.cpp define.
#include "common.h"

namespace {

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

// A block's bytes widened straight from memory, then split into nibbles as 32-bit lanes: fewer shuffles than
// splitting the bytes first (docs/performance.md). Bytes 0-7 hold weights 0-7 (low nibbles) and 16-23 (high).
inline void load_block(const Q4Block& b, __m256 w[4]) {
  const __m256i mask = _mm256_set1_epi32(0x0F);
  const __m256i first = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b.qs)));
  const __m256i second = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(b.qs + 8)));
  const __m128 dm = scale_and_minimum(b);
  const __m256 d = _mm256_broadcastss_ps(dm), m = _mm256_broadcastss_ps(_mm_movehdup_ps(dm));
  w[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(first, mask)), d, m);
  w[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(second, mask)), d, m);
  w[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(first, 4)), d, m);
  w[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(second, 4)), d, m);
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
  const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b.qs)));
  const __m128 dm = scale_and_minimum(b);
  const __m512 d = _mm512_broadcastss_ps(dm), m = _mm512_broadcastss_ps(_mm_movehdup_ps(dm));
  w[0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(bytes, _mm512_set1_epi32(0x0F))), d, m);
  w[1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4)), d, m);
}

DECODEKIT_BLOCKS512 inline void load_block16(const Q8Block& b, __m512 w[2]) {
  const __m512 d = _mm512_set1_ps(_cvtsh_ss(b.d));
  for (int j = 0; j < 2; ++j) {
    const __m128i sixteen = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b.qs + 16 * j));
    w[j] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sixteen)), d);
  }
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

// ---- One row by q4 blocks, factored: a block's sum of (d q + m) x is d sum(q x) + m sum(x), with the row's block
// sums taken once a call (block_sums). A block's scaling is one product instead of a conversion of each of its
// weights: fewer products a block, where these products are bound by their arithmetic (docs/performance.md).
// The row's block sums, as (0, sum) pairs: a block's (d, m) times a pair puts m * sum in the second lane.
void block_sums(const float* x, int64_t K, std::vector<float>& out) {
  out.assign(K / kBlockSize * 2, 0.f);
  for (int64_t b = 0; b < K / kBlockSize; ++b) {
    const __m256 v = _mm256_add_ps(_mm256_add_ps(_mm256_loadu_ps(x + kBlockSize * b), _mm256_loadu_ps(x + kBlockSize * b + 8)),
                                   _mm256_add_ps(_mm256_loadu_ps(x + kBlockSize * b + 16), _mm256_loadu_ps(x + kBlockSize * b + 24)));
    out[2 * b + 1] = horizontal_sum(v);
  }
}

inline __m128 minimum_share(const __m128 dm, const float* sums, __m128 minimums) {
  return _mm_fmadd_ps(dm, _mm_castsi128_ps(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sums))), minimums);
}

// Block b of the row (x at its first value): its products scaled into acc, its minimum's share (sums: the row's
// block sums) into minimums.
inline void factored_block(const float* x, const float* sums, int64_t b, const Q4Block& w, __m256& acc,
                           __m128& minimums) {
  // Bytes 0-7 hold weights 0-7 (low nibbles) and 16-23 (high); bytes 8-15 weights 8-15 and 24-31.
  const __m256i mask = _mm256_set1_epi32(0x0F);
  const __m256i first = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w.qs)));
  const __m256i second = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w.qs + 8)));
  __m256 p = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_and_si256(first, mask)), _mm256_loadu_ps(x));
  __m256 r = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_and_si256(second, mask)), _mm256_loadu_ps(x + 8));
  p = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(first, 4)), _mm256_loadu_ps(x + 16), p);
  r = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(second, 4)), _mm256_loadu_ps(x + 24), r);
  const __m128 dm = scale_and_minimum(w);
  acc = _mm256_fmadd_ps(_mm256_broadcastss_ps(dm), _mm256_add_ps(p, r), acc);
  minimums = minimum_share(dm, sums + 2 * b, minimums);
}

DECODEKIT_BLOCKS512 inline void wide_factored_block(const float* x, const float* sums, int64_t b, const Q4Block& w,
                                                    __m512& acc, __m128& minimums) {
  const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.qs)));
  // A nibble's value looked up (vpermps reads an index's low 4 bits) rather than converted: the lookups go to other
  // execution units than the products do.
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 lo = _mm512_permutexvar_ps(bytes, iota);
  const __m512 hi = _mm512_permutexvar_ps(_mm512_srli_epi32(bytes, 4), iota);
  const __m512 p = _mm512_fmadd_ps(hi, _mm512_loadu_ps(x + 16), _mm512_mul_ps(lo, _mm512_loadu_ps(x)));
  const __m128 dm = scale_and_minimum(w);
  acc = _mm512_fmadd_ps(_mm512_broadcastss_ps(dm), p, acc);
  minimums = minimum_share(dm, sums + 2 * b, minimums);
}

// A q8 block factored as the q4 one is: its sum of d q x is d sum(q x), the scale one product (no minimum, no sums).
inline void factored_block(const float* x, const float*, int64_t, const Q8Block& w, __m256& acc, __m128&) {
  __m256 p = _mm256_setzero_ps(), r = p;
  for (int j = 0; j < 4; j += 2) {
    const __m256 a = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w.qs + 8 * j))));
    const __m256 b = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w.qs + 8 * j + 8))));
    p = _mm256_fmadd_ps(a, _mm256_loadu_ps(x + 8 * j), p);
    r = _mm256_fmadd_ps(b, _mm256_loadu_ps(x + 8 * j + 8), r);
  }
  acc = _mm256_fmadd_ps(_mm256_set1_ps(_cvtsh_ss(w.d)), _mm256_add_ps(p, r), acc);
}

DECODEKIT_BLOCKS512 inline void wide_factored_block(const float* x, const float*, int64_t, const Q8Block& w,
                                                    __m512& acc, __m128&) {
  const __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.qs))));
  const __m512 b = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w.qs + 16))));
  const __m512 p = _mm512_fmadd_ps(b, _mm512_loadu_ps(x + 16), _mm512_mul_ps(a, _mm512_loadu_ps(x)));
  acc = _mm512_fmadd_ps(_mm512_set1_ps(_cvtsh_ss(w.d)), p, acc);
}

// One row by a row of blocks: two accumulators over alternate blocks (a block's scaling waits on its products).
// `sums`: the row's block sums (block_sums) for q4 blocks; q8 blocks read none.
template <typename B>
float factored_dot(const float* x, const float* sums, const B* w, int64_t K) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0;
  __m128 m0 = _mm_setzero_ps(), m1 = m0;
  const int64_t blocks = K / kBlockSize;
  int64_t b = 0;
  for (; b + 2 <= blocks; b += 2) {
    _mm_prefetch(reinterpret_cast<const char*>(w + b) + kInt8PrefetchBytes, _MM_HINT_T0);
    factored_block(x + kBlockSize * b, sums, b, w[b], a0, m0);
    factored_block(x + kBlockSize * (b + 1), sums, b + 1, w[b + 1], a1, m1);
  }
  if (b < blocks) factored_block(x + kBlockSize * b, sums, b, w[b], a0, m0);
  return horizontal_sum(_mm256_add_ps(a0, a1)) + _mm_cvtss_f32(_mm_movehdup_ps(_mm_add_ps(m0, m1)));
}

template <typename B>
DECODEKIT_BLOCKS512 float wide_factored_dot(const float* x, const float* sums, const B* w, int64_t K) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0;
  __m128 m0 = _mm_setzero_ps(), m1 = m0;
  const int64_t blocks = K / kBlockSize;
  int64_t b = 0;
  for (; b + 2 <= blocks; b += 2) {
    _mm_prefetch(reinterpret_cast<const char*>(w + b) + kInt8PrefetchBytes, _MM_HINT_T0);
    wide_factored_block(x + kBlockSize * b, sums, b, w[b], a0, m0);
    wide_factored_block(x + kBlockSize * (b + 1), sums, b + 1, w[b + 1], a1, m1);
  }
  if (b < blocks) wide_factored_block(x + kBlockSize * b, sums, b, w[b], a0, m0);
  return _mm512_reduce_add_ps(_mm512_add_ps(a0, a1)) + _mm_cvtss_f32(_mm_movehdup_ps(_mm_add_ps(m0, m1)));
}

template <typename B>
float any_factored_dot(const float* x, const float* sums, const B* w, int64_t K) {
  if (block_lanes.load(std::memory_order_relaxed) == 16) return wide_factored_dot(x, sums, w, K);
  return factored_dot(x, sums, w, K);
}

template <int M, typename B>
void any_block_dots(const float* x, const B* w, int64_t K, float* y, int64_t N) {
  if (block_lanes.load(std::memory_order_relaxed) == 16) return wide_block_dots<M>(x, w, K, y, N);
  block_dots<M>(x, w, K, y, N);
}

float dot(const float* x, const Q8Block* w, int64_t K) { return any_factored_dot(x, nullptr, w, K); }
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

}  // namespace
