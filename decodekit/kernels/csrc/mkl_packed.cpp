// mkl_pack / packed_product: float32 products by a weight packed once for MKL.
// Part of kernels.cpp, the one translation unit of decodekit's CPU kernels: it reads what the sections
// before it in kernels.cpp define.
#include "common.h"

namespace {

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

}  // namespace
