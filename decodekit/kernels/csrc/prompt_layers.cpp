// prompt_layer_start / _end / _finish: a prompt's decoder layer in two calls.
// Part of kernels.cpp, the one translation unit of decodekit's CPU kernels: it reads what the sections
// before it in kernels.cpp define.
#include "common.h"

namespace {

// ---- A prompt's decoder layer in two calls (llama.py's prompt layers). ----
//
// What Block computes for one unpadded prompt on CPU, float32 or bfloat16 rows (products and attention in float32),
// by the kernels the Python layers call, in their order and rounding where they round, so the results are the same
// bits; what goes is the Python between some twenty operations a layer (docs/performance.md). The cache stays with
// the caller: it
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
