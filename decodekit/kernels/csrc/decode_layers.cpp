// decode_layers: the Llama family's decoder layers for a decode step, in one call.
// Part of kernels.cpp, the one translation unit of decodekit's CPU kernels: it reads what the sections
// before it in kernels.cpp define.
#include "common.h"

namespace {

// ---- The decoder layers of the Llama family for a decode step: M rows of one new token each. ----
//
// Written here because at batch 1 the step's time beyond reading the weights was mostly the cost of
// calling things: inductor's step for the default model ran about ten kernels a layer, each an OpenMP
// region and a call from its Python wrapper, and even one call per layer here spent a measurable share of a token
// on dispatch and region starts (docs/performance.md). The whole stack is one call and one parallel region: the threads share
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
// time on every input of every call (several times the call of an operator taking a handle: docs/performance.md).
// The caches stay arguments: they are written.
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

}  // namespace
