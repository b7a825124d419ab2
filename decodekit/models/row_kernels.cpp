// Products of a few rows by a weight matrix on CPU (AVX2 and FMA): out[M, N] = rows[M, K] @ W[N, K]^T for
// M = 1 to 8, the shapes of decode steps and short prompts.
//
// Built and loaded by native.py. A decode step of one token reads every weight once, so these loops are
// written to keep the memory bus busy: one weight row at a time (one sequential stream per thread), four
// independent accumulators for one row (an FMA chain of one would wait on its own latency) or one per
// row for several, each weight converted once for all rows, and a software prefetch a kilobyte ahead. Inductor's loop for the same product keeps two accumulators and reached 21 GB/s (bf16)
// and 17 GB/s (int8) on the 2-core AVX2 bench machine where these reach 33 and 27 (native.py says how).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include <cstdint>
#include <type_traits>

namespace {

constexpr int64_t kPrefetchBytes = 1024;
constexpr int64_t kRowsPerTask = 16;
constexpr int64_t kMaxRows = 8;

inline float horizontal_sum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_hadd_ps(s, s);
  s = _mm_hadd_ps(s, s);
  return _mm_cvtss_f32(s);
}

inline float horizontal_sum(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  return horizontal_sum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
}

inline void prefetch_block(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p) + kPrefetchBytes;
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
float dot_interleaved_int8(const float* x, const int8_t* w, int64_t K) {
  const int64_t quarter = K / 4;
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t c = 0; c < quarter; c += 8) {
    prefetch_block(w + 4 * c, 32);
    __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 4 * c));
    __m256 b0 = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 24), 24));
    __m256 b1 = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 16), 24));
    __m256 b2 = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 8), 24));
    __m256 b3 = _mm256_cvtepi32_ps(_mm256_srai_epi32(v, 24));
    a0 = _mm256_fmadd_ps(b0, _mm256_loadu_ps(x + c), a0);
    a1 = _mm256_fmadd_ps(b1, _mm256_loadu_ps(x + quarter + c), a1);
    a2 = _mm256_fmadd_ps(b2, _mm256_loadu_ps(x + 2 * quarter + c), a2);
    a3 = _mm256_fmadd_ps(b3, _mm256_loadu_ps(x + 3 * quarter + c), a3);
  }
  return horizontal_sum(a0, a1, a2, a3);
}

template <int M>
void dots_interleaved_int8(const float* x, const int8_t* w, int64_t K, float* y, int64_t N) {
  const int64_t quarter = K / 4;
  __m256 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t c = 0; c < quarter; c += 8) {
    prefetch_block(w + 4 * c, 32);
    __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 4 * c));
    const __m256 b0 = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 24), 24));
    const __m256 b1 = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 16), 24));
    const __m256 b2 = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(v, 8), 24));
    const __m256 b3 = _mm256_cvtepi32_ps(_mm256_srai_epi32(v, 24));
    for (int m = 0; m < M; ++m) {
      const float* xm = x + m * K + c;
      acc[m] = _mm256_fmadd_ps(b0, _mm256_loadu_ps(xm), acc[m]);
      acc[m] = _mm256_fmadd_ps(b1, _mm256_loadu_ps(xm + quarter), acc[m]);
      acc[m] = _mm256_fmadd_ps(b2, _mm256_loadu_ps(xm + 2 * quarter), acc[m]);
      acc[m] = _mm256_fmadd_ps(b3, _mm256_loadu_ps(xm + 3 * quarter), acc[m]);
    }
  }
  for (int m = 0; m < M; ++m) y[m * N] = horizontal_sum(acc[m]);
}

void check_operands(const at::Tensor& rows, const at::Tensor& weight) {
  TORCH_CHECK(rows.device().is_cpu() && weight.device().is_cpu(), "row_product: rows and weight must be on the CPU");
  TORCH_CHECK(rows.scalar_type() == at::kFloat && rows.is_contiguous() && rows.dim() == 2,
              "row_product: rows must be a contiguous float32 [rows, in] matrix");
  TORCH_CHECK(rows.size(0) >= 1 && rows.size(0) <= kMaxRows, "row_product: takes 1 to ", kMaxRows, " rows, not ",
              rows.size(0));
  TORCH_CHECK(weight.dim() == 2 && weight.is_contiguous(), "row_product: weight must be a contiguous [out, in] matrix");
  TORCH_CHECK(rows.size(1) == weight.size(1), "row_product: rows have ", rows.size(1), " values, weight rows ",
              weight.size(1));
}

// Calls body(n, y + n) for every weight row n, split across threads; body writes y[m * N + n] for each row m.
template <typename Body>
at::Tensor products_in_parallel(const at::Tensor& rows, int64_t N, Body body) {
  at::Tensor out = at::empty({rows.size(0), N}, rows.options());
  float* y = out.data_ptr<float>();
  at::parallel_for(0, N, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) body(n, y + n);
  });
  return out;
}

// The rows' count as a template argument: the accumulators stay in registers.
template <typename Fn>
void with_row_count(int64_t M, Fn fn) {
  switch (M) {
    case 2: return fn(std::integral_constant<int, 2>{});
    case 3: return fn(std::integral_constant<int, 3>{});
    case 4: return fn(std::integral_constant<int, 4>{});
    case 5: return fn(std::integral_constant<int, 5>{});
    case 6: return fn(std::integral_constant<int, 6>{});
    case 7: return fn(std::integral_constant<int, 7>{});
    default: return fn(std::integral_constant<int, 8>{});
  }
}

template <typename W>
at::Tensor products(const at::Tensor& rows, const W* w, int64_t N, int64_t K) {
  const float* x = rows.data_ptr<float>();
  const int64_t M = rows.size(0);
  if (M == 1) return products_in_parallel(rows, N, [&](int64_t n, float* y) { *y = dot(x, w + n * K, K); });
  at::Tensor out;
  with_row_count(M, [&](auto count) {
    out = products_in_parallel(rows, N, [&](int64_t n, float* y) { dots<count()>(x, w + n * K, K, y, N); });
  });
  return out;
}

at::Tensor row_product(const at::Tensor& rows, const at::Tensor& weight) {
  check_operands(rows, weight);
  const int64_t N = weight.size(0), K = weight.size(1);
  if (weight.scalar_type() == at::kBFloat16) return products(rows, weight.data_ptr<c10::BFloat16>(), N, K);
  TORCH_CHECK(weight.scalar_type() == at::kFloat, "row_product: weight must be float32 or bfloat16, not ",
              weight.scalar_type());
  return products(rows, weight.data_ptr<float>(), N, K);
}

at::Tensor row_product_int8(const at::Tensor& rows, const at::Tensor& weight) {
  check_operands(rows, weight);
  const int64_t N = weight.size(0), K = weight.size(1);
  TORCH_CHECK(weight.scalar_type() == at::kChar, "row_product_int8: weight must be int8");
  TORCH_CHECK(K % 32 == 0, "row_product_int8: the input width must be a multiple of 32, not ", K);
  const float* x = rows.data_ptr<float>();
  const int8_t* w = weight.data_ptr<int8_t>();
  if (rows.size(0) == 1) {
    return products_in_parallel(rows, N, [&](int64_t n, float* y) { *y = dot_interleaved_int8(x, w + n * K, K); });
  }
  at::Tensor out;
  with_row_count(rows.size(0), [&](auto count) {
    out = products_in_parallel(rows, N, [&](int64_t n, float* y) {
      dots_interleaved_int8<count()>(x, w + n * K, K, y, N);
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(decodekit, m) {  // packed.py defines the namespace
  m.def("row_product(Tensor rows, Tensor weight) -> Tensor");
  m.def("row_product_int8(Tensor rows, Tensor weight) -> Tensor");
}

TORCH_LIBRARY_IMPL(decodekit, CPU, m) {
  m.impl("row_product", &row_product);
  m.impl("row_product_int8", &row_product_int8);
}
