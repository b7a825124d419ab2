// mkl_pack / packed_product: float32 products by a weight packed once for MKL.
// Part of kernels.cpp, the one translation unit of decodekit's CPU kernels: it reads what the sections
// before it in kernels.cpp define.
#include "common.h"

namespace {

// ---- float32 products by a weight packed once for MKL's kernels (linear.py's "packed" route). ----
//
// The library's matmul packs the weight into its kernel's layout on every call: for a prompt of 128 rows by the
// default model's layers that is as much memory traffic as the product's own and is not hidden behind it (the same
// products by weights packed once run faster: docs/performance.md).
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
    // product and rounding follow each other in that thread's cache: bf16 rows then cost about float32 rows' time
    // from 512 rows on, a little more at 128, where each thread's block is half as long (docs/performance.md).
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

}  // namespace
