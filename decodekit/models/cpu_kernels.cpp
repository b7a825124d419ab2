// decodekit's CPU kernels (AVX2 and FMA), built and loaded by native.py:
// - row_product / row_product_int8: out[M, N] = rows[M, K] @ W[N, K]^T for M = 1 to 8, the shapes of decode
//   steps and short prompts;
// - decode_layer: one whole decoder layer of the Llama family for a fixed-shape decode step.
//
// A decode step of one token reads every weight once, so the products are written to keep the memory bus
// busy: one weight row at a time (one sequential stream per thread), four independent accumulators for one
// row (an FMA chain of one would wait on its own latency) or one per row for several, each weight converted
// once for all rows, and a software prefetch ahead of the loads. Inductor's loop for the same product keeps
// two accumulators and reached 21 GB/s (bf16) and 17 GB/s (int8) on the 2-core AVX2 bench machine where
// these reached 33 and 27 (native.py says how).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <optional>
#include <type_traits>

namespace {

// How far ahead of the loads to prefetch. Measured on the bench machine, products of the default model's 120
// layer weights against a plain read of memory: int8 0.66-0.73 of the read's speed at 1 KB, 0.85 at 3 KB
// (0.81-0.85 at 4 KB, 0.62-0.67 at 8 KB); bfloat16 0.83 at 1 KB, 0.72-0.79 at 2 KB; float32 no difference.
constexpr int64_t kPrefetchBytes = 1024;
constexpr int64_t kInt8PrefetchBytes = 3072;
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
float dot_interleaved_int8(const float* x, const int8_t* w, int64_t K) {
  const int64_t quarter = K / 4;
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t c = 0; c < quarter; c += 8) {
    prefetch_block<kInt8PrefetchBytes>(w + 4 * c, 32);
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
    prefetch_block<kInt8PrefetchBytes>(w + 4 * c, 32);
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

// Calls body(n) for every weight row n, split across threads.
template <typename Body>
void for_each_weight_row(int64_t N, Body body) {
  at::parallel_for(0, N, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) body(n);
  });
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

// y[M, N] = x[M, K] @ w[N, K]^T for float32 or bfloat16 weights.
template <typename W>
void products_into(const float* x, int64_t M, const W* w, int64_t N, int64_t K, float* y) {
  if (M == 1) return for_each_weight_row(N, [&](int64_t n) { y[n] = dot(x, w + n * K, K); });
  with_row_count(M, [&](auto count) {
    for_each_weight_row(N, [&](int64_t n) { dots<count()>(x, w + n * K, K, y + n, N); });
  });
}

// The same for an interleaved int8 weight, unscaled (K % 32 == 0).
void products_int8_into(const float* x, int64_t M, const int8_t* w, int64_t N, int64_t K, float* y) {
  if (M == 1) return for_each_weight_row(N, [&](int64_t n) { y[n] = dot_interleaved_int8(x, w + n * K, K); });
  with_row_count(M, [&](auto count) {
    for_each_weight_row(N, [&](int64_t n) { dots_interleaved_int8<count()>(x, w + n * K, K, y + n, N); });
  });
}

// Any weight these kernels take: float32, bfloat16, interleaved int8 (unscaled).
void product_into(const float* x, int64_t M, const at::Tensor& weight, float* y) {
  const int64_t N = weight.size(0), K = weight.size(1);
  switch (weight.scalar_type()) {
    case at::kFloat: return products_into(x, M, weight.data_ptr<float>(), N, K, y);
    case at::kBFloat16: return products_into(x, M, weight.data_ptr<c10::BFloat16>(), N, K, y);
    case at::kChar:
      TORCH_CHECK(K % 32 == 0, "row_product_int8: the input width must be a multiple of 32, not ", K);
      return products_int8_into(x, M, weight.data_ptr<int8_t>(), N, K, y);
    default: TORCH_CHECK(false, "weights must be float32, bfloat16 or int8, not ", weight.scalar_type());
  }
}

at::Tensor product(const at::Tensor& rows, const at::Tensor& weight) {
  at::Tensor out = at::empty({rows.size(0), weight.size(0)}, rows.options());
  product_into(rows.data_ptr<float>(), rows.size(0), weight, out.data_ptr<float>());
  return out;
}

at::Tensor row_product(const at::Tensor& rows, const at::Tensor& weight) {
  check_operands(rows, weight);
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 || weight.scalar_type() == at::kFloat,
              "row_product: weight must be float32 or bfloat16, not ", weight.scalar_type());
  return product(rows, weight);
}

at::Tensor row_product_int8(const at::Tensor& rows, const at::Tensor& weight) {
  check_operands(rows, weight);
  TORCH_CHECK(weight.scalar_type() == at::kChar, "row_product_int8: weight must be int8");
  return product(rows, weight);
}

// ---- One decoder layer of the Llama family for a decode step: M rows of one new token each. ----
//
// Written here because at batch 1 the step's time beyond reading the weights was mostly the cost of
// calling things: inductor's step for the default model runs about ten kernels a layer, each an OpenMP
// region and a call from its Python wrapper. This layer is one call, its only parallel regions are the
// four products and the attention. Values are rounded to the activation dtype A where the model stores
// them (norm outputs, product outputs, the residual stream, the cache); elementwise chains between those
// points are computed in float32, as inductor computes them.

template <typename A>
inline float round_to(float v) {
  return static_cast<float>(static_cast<A>(v));
}

template <typename A>
const A* optional_data(const std::optional<at::Tensor>& t) {
  return t.has_value() && t->numel() ? t->data_ptr<A>() : nullptr;
}

// RMSNorm as models/llama.py computes it: normalise in float32, round, scale by the weight, round.
template <typename A>
void rms_norm(const float* x, const A* weight, int64_t n, double eps, float* out) {
  float squares = 0.f;
  for (int64_t i = 0; i < n; ++i) squares += x[i] * x[i];
  const float inv = 1.f / std::sqrt(squares / n + static_cast<float>(eps));
  for (int64_t i = 0; i < n; ++i) out[i] = round_to<A>(round_to<A>(x[i] * inv) * static_cast<float>(weight[i]));
}

// y = round(round((x @ W^T) * scale) + bias), as Linear / Int8Linear return it.
template <typename A>
void linear_into(const float* x, int64_t M, const at::Tensor& weight, const std::optional<at::Tensor>& scale,
                 const std::optional<at::Tensor>& bias, float* y) {
  const int64_t N = weight.size(0);
  product_into(x, M, weight, y);
  const float* s = optional_data<float>(scale);
  const A* b = optional_data<A>(bias);
  for (int64_t i = 0; i < M * N; ++i) {
    float v = round_to<A>(s ? y[i] * s[i % N] : y[i]);
    y[i] = b ? round_to<A>(v + static_cast<float>(b[i % N])) : v;
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

// Attention of one query head over the visible slots of its row's cache, in float32; masked slots cost nothing.
template <typename A>
void attend(const float* q, const A* keys, const A* values, const bool* visible, int64_t L, int64_t D, float* scores,
            float* out) {
  const float scale = 1.f / std::sqrt(static_cast<float>(D));
  float best = -std::numeric_limits<float>::infinity();
  for (int64_t j = 0; j < L; ++j) {
    if (!visible[j]) continue;
    scores[j] = dot(q, keys + j * D, D) * scale;
    best = std::max(best, scores[j]);
  }
  std::fill(out, out + D, 0.f);
  float total = 0.f;
  for (int64_t j = 0; j < L; ++j) {
    if (!visible[j]) continue;
    const float p = std::exp(scores[j] - best);
    total += p;
    add_scaled(out, p, values + j * D, D);
  }
  const float inv = total > 0.f ? 1.f / total : 0.f;  // no visible slot: zeros, never read (see llama.py)
  for (int64_t d = 0; d < D; ++d) out[d] *= inv;
}

struct LayerShape {
  int64_t M, H, D, L, heads, kv_heads, inter;
};

template <typename A>
at::Tensor decode_layer_as(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t slot,
                           const at::Tensor& mask, at::Tensor& keys, at::Tensor& values, at::TensorList weights,
                           const c10::List<std::optional<at::Tensor>>& scales,
                           const c10::List<std::optional<at::Tensor>>& biases,
                           const c10::List<std::optional<at::Tensor>>& norms, const LayerShape& s, double eps) {
  const int64_t M = s.M, H = s.H, D = s.D, L = s.L, QKV = (s.heads + 2 * s.kv_heads) * D, Q = s.heads * D;
  const int64_t group = s.heads / s.kv_heads;
  // One float32 workspace: residual, normed, q/k/v, attention output, product output, gate/up, scores.
  at::Tensor work = at::empty({M * (3 * H + QKV + Q + 3 * s.inter + s.heads * L)}, x.options().dtype(at::kFloat));
  float* resid = work.data_ptr<float>();
  float* normed = resid + M * H;
  float* qkv = normed + M * H;
  float* attn = qkv + M * QKV;
  float* out = attn + M * Q;
  float* gate_up = out + M * H;
  float* hidden = gate_up + M * 2 * s.inter;
  float* scores = hidden + M * s.inter;

  const A* xs = x.data_ptr<A>();
  for (int64_t i = 0; i < M * H; ++i) resid[i] = static_cast<float>(xs[i]);
  const A* attn_norm = norms.get(0)->data_ptr<A>();
  const A* mlp_norm = norms.get(1)->data_ptr<A>();
  const A* q_norm = optional_data<A>(norms.get(2));
  const A* k_norm = optional_data<A>(norms.get(3));
  for (int64_t m = 0; m < M; ++m) rms_norm(resid + m * H, attn_norm, H, eps, normed + m * H);
  linear_into<A>(normed, M, weights[0], scales.get(0), biases.get(0), qkv);

  A* kc = keys.data_ptr<A>();
  A* vc = values.data_ptr<A>();
  const A* cs = cos.data_ptr<A>();
  const A* sn = sin.data_ptr<A>();
  for (int64_t m = 0; m < M; ++m) {
    float* row = qkv + m * QKV;
    for (int64_t h = 0; h < s.heads + s.kv_heads; ++h) {  // q heads, then k heads
      float* head = row + h * D;
      const A* norm = h < s.heads ? q_norm : k_norm;
      if (norm != nullptr) rms_norm(head, norm, D, eps, head);
      rotate(head, cs + m * D, sn + m * D, D);
    }
    for (int64_t g = 0; g < s.kv_heads; ++g) {
      const int64_t at = ((m * s.kv_heads + g) * L + slot) * D;
      for (int64_t d = 0; d < D; ++d) {
        kc[at + d] = static_cast<A>(row[Q + g * D + d]);
        vc[at + d] = static_cast<A>(row[Q + (s.kv_heads + g) * D + d]);
      }
    }
  }
  const bool* visible = mask.data_ptr<bool>();
  at::parallel_for(0, M * s.heads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t m = task / s.heads, h = task % s.heads, g = h / group;
      const int64_t cached = (m * s.kv_heads + g) * L * D;
      float* o = attn + m * Q + h * D;
      attend(qkv + m * QKV + h * D, kc + cached, vc + cached, visible + m * L, L, D, scores + task * L, o);
      for (int64_t d = 0; d < D; ++d) o[d] = round_to<A>(o[d]);
    }
  });
  linear_into<A>(attn, M, weights[1], scales.get(1), biases.get(1), out);
  for (int64_t i = 0; i < M * H; ++i) resid[i] = round_to<A>(resid[i] + out[i]);

  for (int64_t m = 0; m < M; ++m) rms_norm(resid + m * H, mlp_norm, H, eps, normed + m * H);
  linear_into<A>(normed, M, weights[2], scales.get(2), biases.get(2), gate_up);
  for (int64_t m = 0; m < M; ++m) {
    const float* gu = gate_up + m * 2 * s.inter;
    for (int64_t i = 0; i < s.inter; ++i) {
      const float g = gu[i];
      hidden[m * s.inter + i] = round_to<A>(g / (1.f + std::exp(-g)) * gu[s.inter + i]);
    }
  }
  linear_into<A>(hidden, M, weights[3], scales.get(3), biases.get(3), out);
  at::Tensor result = at::empty_like(x);
  A* ys = result.data_ptr<A>();
  for (int64_t i = 0; i < M * H; ++i) ys[i] = static_cast<A>(resid[i] + out[i]);
  return result;
}

at::Tensor decode_layer(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& slots,
                        const at::Tensor& mask, at::Tensor& keys, at::Tensor& values, at::TensorList weights,
                        const c10::List<std::optional<at::Tensor>>& scales,
                        const c10::List<std::optional<at::Tensor>>& biases,
                        const c10::List<std::optional<at::Tensor>>& norms, int64_t heads, int64_t kv_heads,
                        double eps) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, "decode_layer: x must be float32 or bfloat16, not ", dtype);
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(0) >= 1 && x.size(0) <= kMaxRows,
              "decode_layer: x must be a contiguous [rows, hidden] matrix of 1 to ", kMaxRows, " rows");
  TORCH_CHECK(keys.dim() == 4 && keys.is_contiguous() && values.is_contiguous() && keys.sizes() == values.sizes(),
              "decode_layer: keys and values must be contiguous [rows, kv_heads, slots, head_dim] caches");
  TORCH_CHECK(keys.scalar_type() == dtype && values.scalar_type() == dtype && cos.scalar_type() == dtype &&
                  sin.scalar_type() == dtype,
              "decode_layer: the cache and the rotary tables must have x's dtype ", dtype);
  const LayerShape s{x.size(0), x.size(1), keys.size(3), keys.size(2), heads, kv_heads,
                     weights.size() == 4 ? weights[2].size(0) / 2 : 0};
  TORCH_CHECK(keys.size(0) == s.M && keys.size(1) == kv_heads && heads % kv_heads == 0,
              "decode_layer: the cache must be [", s.M, ", ", kv_heads, ", slots, head_dim]");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == s.M * s.D && sin.numel() == s.M * s.D,
              "decode_layer: cos and sin must be contiguous [rows, head_dim]");
  TORCH_CHECK(mask.scalar_type() == at::kBool && mask.is_contiguous() && mask.numel() == s.M * s.L,
              "decode_layer: mask must be a contiguous boolean [rows, slots]");
  TORCH_CHECK(weights.size() == 4 && scales.size() == 4 && biases.size() == 4 && norms.size() == 4,
              "decode_layer: takes 4 weights, scales and biases (qkv, o, gate_up, down) and 4 norms "
              "(attention, mlp, q, k)");
  const int64_t in[4] = {s.H, s.heads * s.D, s.H, s.inter};
  const int64_t out[4] = {(heads + 2 * kv_heads) * s.D, s.H, 2 * s.inter, s.H};
  for (int i = 0; i < 4; ++i) {
    TORCH_CHECK(weights[i].is_contiguous() && weights[i].dim() == 2 && weights[i].size(0) == out[i] &&
                    weights[i].size(1) == in[i],
                "decode_layer: weight ", i, " must be a contiguous [", out[i], ", ", in[i], "] matrix");
    const auto& scale = scales.get(i);
    TORCH_CHECK((weights[i].scalar_type() == at::kChar) == scale.has_value(),
                "decode_layer: int8 weights, and only they, come with scales");
    TORCH_CHECK(!scale.has_value() || (scale->scalar_type() == at::kFloat && scale->numel() == out[i]),
                "decode_layer: scales must be float32 with one value per output");
    const auto& bias = biases.get(i);
    TORCH_CHECK(!bias.has_value() || (bias->scalar_type() == dtype && bias->numel() == out[i]),
                "decode_layer: biases must have x's dtype and one value per output");
  }
  for (int i = 0; i < 4; ++i) {
    const auto& norm = norms.get(i);
    TORCH_CHECK(i >= 2 || norm.has_value(), "decode_layer: the attention and mlp norms are required");
    TORCH_CHECK(!norm.has_value() || (norm->scalar_type() == dtype && norm->numel() == (i < 2 ? s.H : s.D)),
                "decode_layer: norm weights must have x's dtype and the width they normalise");
  }
  const int64_t slot = slots.item<int64_t>();  // a CPU tensor: no device sync
  TORCH_CHECK(slot >= 0 && slot < s.L, "decode_layer: slot ", slot, " is outside the cache of ", s.L, " slots");
  if (dtype == at::kBFloat16) {
    return decode_layer_as<c10::BFloat16>(x, cos, sin, slot, mask, keys, values, weights, scales, biases, norms, s, eps);
  }
  return decode_layer_as<float>(x, cos, sin, slot, mask, keys, values, weights, scales, biases, norms, s, eps);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(decodekit, m) {  // packed.py defines the namespace
  m.def("row_product(Tensor rows, Tensor weight) -> Tensor");
  m.def("row_product_int8(Tensor rows, Tensor weight) -> Tensor");
  m.def(
      "decode_layer(Tensor x, Tensor cos, Tensor sin, Tensor slots, Tensor mask, Tensor(a!) keys, Tensor(b!) values, "
      "Tensor[] weights, Tensor?[] scales, Tensor?[] biases, Tensor?[] norms, int heads, int kv_heads, float eps) "
      "-> Tensor");
}

TORCH_LIBRARY_IMPL(decodekit, CPU, m) {
  m.impl("row_product", &row_product);
  m.impl("row_product_int8", &row_product_int8);
  m.impl("decode_layer", &decode_layer);
}
