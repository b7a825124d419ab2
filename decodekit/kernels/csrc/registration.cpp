// The operators' schemas and their CPU (and oneDNN-tensor) implementations, registered as torch.ops.decodekit.*.
// Part of kernels.cpp, after every section.
#include "common.h"

TORCH_LIBRARY_FRAGMENT(decodekit, m) {  // packed.py defines the namespace
  m.def("row_product(Tensor rows, Tensor weight) -> Tensor");
  m.def("row_product_int8(Tensor rows, Tensor weight) -> Tensor");
  m.def(
      "decode_layers(Tensor x, Tensor cos, Tensor sin, Tensor slots, Tensor[] masks, Tensor(a!)[] keys, "
      "Tensor(b!)[] values, int weights, int heads, int kv_heads, float eps, Tensor? rows=None) -> Tensor");
  // Called eagerly, never traced: one kernel for every backend.
  m.def("bind_weights(int handle, Tensor[] weights, Tensor?[] scales, Tensor?[] biases, Tensor?[] norms) -> ()",
        &bind_weights);
  m.def("unbind_weights(int handle) -> ()", &unbind_weights);
  m.def("split_product(Tensor rows, Tensor weight, Tensor? scales=None, bool interleaved=False) -> Tensor");
  m.def("mkl_pack(Tensor weight) -> Tensor");
  m.def("packed_product(Tensor rows, Tensor packed, int out_features, Tensor? bias=None) -> Tensor");
  m.def("prefill_attention(Tensor q, Tensor k, Tensor v, int window=0, bool wide=False) -> Tensor");
  m.def("prefill_attention_int8(Tensor q, Tensor k, Tensor v, int window=0) -> Tensor");
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.def("rotary(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.def("prompt_layer_start(Tensor x, Tensor norm, float eps, Tensor qkv, int qkv_route, Tensor? qkv_bias, "
        "Tensor? qkv_scales, Tensor? q_norm, Tensor? k_norm, Tensor cos, Tensor sin, int heads, int kv_heads) -> "
        "(Tensor, Tensor, Tensor)");
  m.def("prompt_layer_end(Tensor(a!) x, Tensor q, Tensor k, Tensor v, int window, bool wide, Tensor o, int o_route, "
        "Tensor? o_bias, Tensor? o_scales, Tensor norm, float eps, Tensor gate_up, int gate_up_route, "
        "Tensor? gate_up_bias, Tensor? gate_up_scales, Tensor down, int down_route, Tensor? down_bias, "
        "Tensor? down_scales, int intermediate) -> Tensor(a!)");
  m.def("prompt_layer_finish(Tensor(a!) x, Tensor attended, Tensor o, int o_route, Tensor? o_bias, Tensor? o_scales, "
        "Tensor norm, float eps, Tensor gate_up, int gate_up_route, Tensor? gate_up_bias, Tensor? gate_up_scales, "
        "Tensor down, int down_route, Tensor? down_bias, Tensor? down_scales, int intermediate) -> Tensor(a!)");
  m.def("set_block_lanes(int lanes=0) -> int", &set_block_lanes);
  m.def("tiled_product(Tensor rows, Tensor weight, Tensor? scales=None, bool interleaved=False, bool blocks=False, "
        "bool wide=False) -> Tensor");
  m.def("paged_attention(Tensor q, Tensor k, Tensor v, Tensor(a!) keys, Tensor(b!) values, Tensor slots, Tensor tables, "
        "Tensor owner, Tensor positions, int block_size, int window) -> Tensor");
}

TORCH_LIBRARY_IMPL(decodekit, CPU, m) {
  m.impl("row_product", &row_product);
  m.impl("row_product_int8", &row_product_int8);
  m.impl("decode_layers", &decode_layers);
  m.impl("split_product", &split_product);
  m.impl("tiled_product", &tiled_product);
  m.impl("prefill_attention", &prefill_attention);
  m.impl("prefill_attention_int8", &prefill_attention_int8);
  m.impl("rms_norm", &rms_norm_rows);
  m.impl("silu_mul", &silu_mul);
  m.impl("rotary", &rotary);
  m.impl("prompt_layer_start", &prompt_layer_start);
  m.impl("prompt_layer_end", &prompt_layer_end);
  m.impl("prompt_layer_finish", &prompt_layer_finish);
  m.impl("paged_attention", &paged_attention);
  m.impl("mkl_pack", &mkl_pack);
  m.impl("packed_product", &packed_product);
}

// A weight reordered for oneDNN (the "onednn" route) is an MkldnnCPU tensor, which sends the call there.
TORCH_LIBRARY_IMPL(decodekit, MkldnnCPU, m) {
  m.impl("prompt_layer_start", &prompt_layer_start);
  m.impl("prompt_layer_end", &prompt_layer_end);
  m.impl("prompt_layer_finish", &prompt_layer_finish);
}
