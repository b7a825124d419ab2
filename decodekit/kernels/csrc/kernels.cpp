// decodekit's CPU kernels (AVX2, FMA and F16C; AVX-512 forms where the CPU has it), built and loaded by native.py:
// - row_product / row_product_int8: out[M, N] = rows[M, K] @ W[N, K]^T for M = 1 to 16, the shapes of decode
//   steps and short prompts (W float32, bfloat16, or GGUF's blocks of 32: Q4Block, Q8Block);
// - decode_layers (with bind_weights / unbind_weights): the decoder layers of the Llama family for a
//   fixed-shape decode step, in one call;
// - split_product: a prompt's rows by an int8 weight through int8 x int8 products (its int8 prefill);
// - paged_attention: attention of the tokens of many requests over a paged KV cache (continuous batching).
//
// A decode step of one token reads every weight once, so the products are written to keep the memory bus
// busy: one weight row at a time (one sequential stream per thread), four independent accumulators for one
// row (an FMA chain of one would wait on its own latency) or one per row for several, each weight converted
// once for all rows, and a software prefetch ahead of the loads. Inductor's loop for the same product keeps
// two accumulators and reads the weights markedly slower (docs/performance.md).
//
// One translation unit, built as one extension by native.py: the sections below share inline helpers and templates
// (common.h and those of earlier sections), and torch's headers are parsed once rather than once a section.
// Each section is a file of its own, in the order they build on each other.
#include "common.h"

#include "blocks.cpp"
#include "row_products.cpp"
#include "int8_prompt.cpp"
#include "decode_layers.cpp"
#include "tiles.cpp"
#include "mkl_packed.cpp"
#include "softmax.cpp"
#include "paged_attention.cpp"
#include "prefill_attention.cpp"
#include "elementwise.cpp"
#include "prompt_layers.cpp"
#include "registration.cpp"
