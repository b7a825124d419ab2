// What every section of decodekit's CPU kernels shares: torch's and the compiler's headers, MKL's packed-matrix
// API, and the small vector helpers (sums, prefetches, loads, dot products of float32, bfloat16 and int8 rows).
#pragma once

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

// MKL's packed-matrix API, where libtorch_cpu carries MKL (null otherwise): see mkl_pack (mkl_packed.cpp).
extern "C" {
__attribute__((weak)) size_t cblas_sgemm_pack_get_size(int identifier, int m, int n, int k);
__attribute__((weak)) void cblas_sgemm_pack(int layout, int identifier, int trans, int m, int n, int k, float alpha,
                                            const float* src, int ld, float* dest);
__attribute__((weak)) void cblas_sgemm_compute(int layout, int transa, int transb, int m, int n, int k, const float* a,
                                               int lda, const float* b, int ldb, float beta, float* c, int ldc);
}


namespace {

// How far ahead of the loads to prefetch: the distances at which products of the default model's layer weights came
// nearest a plain read of memory, per weight format (docs/performance.md, measurements behind the code's choices).
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

}  // namespace
