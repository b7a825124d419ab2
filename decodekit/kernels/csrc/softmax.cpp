// The attention kernels' shared pieces: the causal attention's block sizes and the running softmax of a row of
// scores (AVX2 and AVX-512 forms), which paged_attention.cpp and prefill_attention.cpp both fold key blocks into.
// Part of kernels.cpp, the one translation unit of decodekit's CPU kernels: it reads what the sections
// before it in kernels.cpp define.
#include "common.h"

namespace {

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
// in place and the row's sum (`exponentiate`). With AVX2's 8 lanes these passes took a quarter of a long prompt's
// kernel time; with AVX-512 (`wide`, where the CPU has avx512f) they read 16 lanes a vector and end on masked loads,
// not a scalar tail.
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
