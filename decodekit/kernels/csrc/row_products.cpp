// row_product: 1 to 16 rows by a float32, bfloat16, int8 or block weight.
// Part of kernels.cpp, the one translation unit of decodekit's CPU kernels: it reads what the sections
// before it in kernels.cpp define.
#include "common.h"

namespace {

// y[m * N + n] = x[m] . w[n] for the weight rows n in [begin, end) and the M rows of x (W: float, bfloat16,
// or interleaved int8).
template <typename W>
void weight_rows(const float* x, int64_t M, const W* w, int64_t N, int64_t K, float* y, int64_t begin, int64_t end) {
  if (M == 1) {
    if constexpr (std::is_same_v<W, Q4Block>) {  // factored (blocks.cpp): the row's block sums once, for every row
      thread_local std::vector<float> sums;
      block_sums(x, K, sums);
      for (int64_t n = begin; n < end; ++n) y[n] = any_factored_dot(x, sums.data(), row_at(w, n, K), K);
    } else {
      for (int64_t n = begin; n < end; ++n) y[n] = dot(x, row_at(w, n, K), K);
    }
    return;
  }
  in_chunks(M, [&](int64_t split, auto first, auto rest) {
    for (int64_t n = begin; n < end; ++n) {
      dots<first()>(x, row_at(w, n, K), K, y + n, N);
      if constexpr (rest() > 0) dots<rest()>(x + split * K, row_at(w, n, K), K, y + split * N + n, N);
    }
  });
}

void weight_rows(const float* x, int64_t M, const WeightRef& w, float* y, int64_t begin, int64_t end) {
  switch (w.dtype) {
    case at::kFloat: return weight_rows(x, M, static_cast<const float*>(w.data), w.N, w.K, y, begin, end);
    case at::kBFloat16:
      return weight_rows(x, M, static_cast<const c10::BFloat16*>(w.data), w.N, w.K, y, begin, end);
    case at::kByte: return weight_rows(x, M, static_cast<const Q4Block*>(w.data), w.N, w.K, y, begin, end);
    case at::kShort: return weight_rows(x, M, static_cast<const Q8Block*>(w.data), w.N, w.K, y, begin, end);
    default: return weight_rows(x, M, static_cast<const int8_t*>(w.data), w.N, w.K, y, begin, end);
  }
}

// out = rows @ weight^T for the row_product operators; the weight is checked by weight_ref.
at::Tensor product(const at::Tensor& rows, const at::Tensor& weight, const char* op) {
  const WeightRef w = weight_ref(weight, op);
  TORCH_CHECK(rows.device().is_cpu() && rows.scalar_type() == at::kFloat && rows.is_contiguous() && rows.dim() == 2,
              op, ": rows must be a contiguous float32 [rows, in] matrix on the CPU");
  const int64_t M = rows.size(0);
  TORCH_CHECK(M >= 1 && M <= kMaxRows, op, ": takes 1 to ", kMaxRows, " rows, not ", M);
  TORCH_CHECK(rows.size(1) == w.K, op, ": rows have ", rows.size(1), " values, weight rows ", w.K);
  at::Tensor out = at::empty({M, w.N}, rows.options());
  const float* x = rows.data_ptr<float>();
  float* y = out.data_ptr<float>();
  at::parallel_for(0, w.N, kRowsPerTask, [&](int64_t begin, int64_t end) { weight_rows(x, M, w, y, begin, end); });
  return out;
}

at::Tensor row_product(const at::Tensor& rows, const at::Tensor& weight) {
  const auto dtype = weight.scalar_type();
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kFloat || dtype == at::kByte || dtype == at::kShort,
              "row_product: weight must be float32, bfloat16 or blocks (uint8: 4-bit, int16: 8-bit), not ", dtype);
  return product(rows, weight, "row_product");
}

at::Tensor row_product_int8(const at::Tensor& rows, const at::Tensor& weight) {
  TORCH_CHECK(weight.scalar_type() == at::kChar, "row_product_int8: weight must be int8, not ", weight.scalar_type());
  return product(rows, weight, "row_product_int8");
}

}  // namespace
