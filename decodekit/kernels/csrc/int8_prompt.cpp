// split_product: a prompt's rows by an int8 weight through int8 x int8 products.
// Part of kernels.cpp, the one translation unit of decodekit's CPU kernels: it reads what the sections
// before it in kernels.cpp define.
#include "common.h"

namespace {

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
    // prefills ran faster so than with the threads sharing each block's steps, as below, on AMX and no slower held
    // to VNNI (docs/performance.md).
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

}  // namespace
