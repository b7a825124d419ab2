// rms_norm, silu_mul, rotary: a layer's elementwise steps.
// Part of kernels.cpp, the one translation unit of decodekit's CPU kernels: it reads what the sections
// before it in kernels.cpp define.
#include "common.h"

namespace {

// Where a row computed in float32 goes: straight to a float32 output, or through `buffer` to a bfloat16 one.
inline float* row_out(float* out, float*) { return out; }
inline float* row_out(c10::BFloat16*, float* buffer) { return buffer; }
inline void row_done(float*, const float*, int64_t) {}
inline void row_done(c10::BFloat16* out, const float* buffer, int64_t n) { narrow_row(buffer, out, n); }

inline void check_elementwise(const char* op, std::initializer_list<const at::Tensor*> tensors) {
  const at::ScalarType dtype = (*tensors.begin())->scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kBFloat16, op, ": float32 or bfloat16 tensors expected");
  for (const at::Tensor* t : tensors) TORCH_CHECK(t->scalar_type() == dtype, op, ": tensors of one dtype expected");
}

// x [..., D] -> weight * x / sqrt(mean(x^2) + eps) per row, weight [D].
template <typename A>
void rms_norm_as(const A* xp, const A* wp, int64_t M, int64_t D, double eps, A* op) {
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> buffer(std::is_same_v<A, float> ? 0 : D);
    for (int64_t m = begin; m < end; ++m) {
      const A* r = xp + m * D;
      float* o = row_out(op + m * D, buffer.data());
      __m256 sum8 = _mm256_setzero_ps();
      int64_t d = 0;
      for (; d + 8 <= D; d += 8) sum8 = _mm256_fmadd_ps(load8(r + d), load8(r + d), sum8);
      float squares = horizontal_sum(sum8);
      for (; d < D; ++d) squares += static_cast<float>(r[d]) * static_cast<float>(r[d]);
      const float inv = 1.f / std::sqrt(squares / D + static_cast<float>(eps));
      const __m256 inv8 = _mm256_set1_ps(inv);
      for (d = 0; d + 8 <= D; d += 8) _mm256_storeu_ps(o + d, _mm256_mul_ps(load8(wp + d), _mm256_mul_ps(load8(r + d), inv8)));
      for (; d < D; ++d) o[d] = static_cast<float>(wp[d]) * (static_cast<float>(r[d]) * inv);
      row_done(op + m * D, o, D);
    }
  });
}

// rms_norm_as for contiguous rows and weight of one dtype (float32 or bfloat16), into `out` of theirs.
void rms_norm_into(const at::Tensor& rows, const at::Tensor& w, double eps, at::Tensor& out) {
  const int64_t D = w.size(0), M = D == 0 ? 0 : rows.numel() / D;
  if (rows.scalar_type() == at::kBFloat16) {
    rms_norm_as(rows.data_ptr<c10::BFloat16>(), w.data_ptr<c10::BFloat16>(), M, D, eps, out.data_ptr<c10::BFloat16>());
  } else {
    rms_norm_as(rows.data_ptr<float>(), w.data_ptr<float>(), M, D, eps, out.data_ptr<float>());
  }
}

at::Tensor rms_norm_rows(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_elementwise("rms_norm", {&x, &weight});
  TORCH_CHECK(x.dim() >= 1 && weight.dim() == 1 && x.size(-1) == weight.size(0), "rms_norm: rows [..., D] and weight [D] expected");
  const at::Tensor rows = x.contiguous(), w = weight.contiguous();
  at::Tensor out = at::empty(rows.sizes(), rows.options());
  rms_norm_into(rows, w, eps, out);
  return out;
}

// gate_up [..., 2I] (gate then up, as MLP's fused product) -> silu(gate) * up [..., I].
template <typename A>
void silu_mul_as(const A* gp, int64_t M, int64_t I, A* op) {
  at::parallel_for(0, M, 16, [&](int64_t begin, int64_t end) {
    const __m256 one = _mm256_set1_ps(1.f);
    std::vector<float> buffer(std::is_same_v<A, float> ? 0 : I);
    for (int64_t m = begin; m < end; ++m) {
      const A* g = gp + m * 2 * I;
      const A* u = g + I;
      float* o = row_out(op + m * I, buffer.data());
      int64_t i = 0;
      for (; i + 8 <= I; i += 8) {  // exp8 clamps its input: a gate below -87 gives a silu of about 0, as it should
        const __m256 x = load8(g + i);
        const __m256 sig = _mm256_div_ps(one, _mm256_add_ps(one, exp8(_mm256_sub_ps(_mm256_setzero_ps(), x))));
        _mm256_storeu_ps(o + i, _mm256_mul_ps(_mm256_mul_ps(x, sig), load8(u + i)));
      }
      for (; i < I; ++i) {
        const float x = static_cast<float>(g[i]);
        o[i] = x / (1.f + std::exp(-x)) * static_cast<float>(u[i]);
      }
      row_done(op + m * I, o, I);
    }
  });
}

// silu_mul_as for M contiguous rows [2 x I] of float32 or bfloat16, into `out` [M, I] of their dtype.
void silu_mul_into(const at::Tensor& rows, int64_t M, int64_t I, at::Tensor& out) {
  if (rows.scalar_type() == at::kBFloat16) {
    silu_mul_as(rows.data_ptr<c10::BFloat16>(), M, I, out.data_ptr<c10::BFloat16>());
  } else {
    silu_mul_as(rows.data_ptr<float>(), M, I, out.data_ptr<float>());
  }
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_elementwise("silu_mul", {&gate_up});
  TORCH_CHECK(gate_up.dim() >= 1 && gate_up.size(-1) % 2 == 0, "silu_mul: rows [..., 2 * I] expected");
  const at::Tensor rows = gate_up.contiguous();
  const int64_t I = rows.size(-1) / 2, M = I == 0 ? 0 : rows.numel() / (2 * I);
  std::vector<int64_t> shape(rows.sizes().begin(), rows.sizes().end());
  shape.back() = I;
  at::Tensor out = at::empty(shape, rows.options());
  silu_mul_into(rows, M, I, out);
  return out;
}

// Rotary embedding of q or k [B, H, T, D] (any strides but a contiguous last dimension: the split of the fused
// q/k/v product, transposed) by cos, sin [B or 1, 1, T, D]: x * cos + rotate_half(x) * sin, as rope.apply_rotary,
// written contiguous [B, H, T, D].
template <typename A>
void rotary_as(const at::Tensor& x, const A* cp, const A* sp, int64_t table_b, A* op) {
  const int64_t B = x.size(0), H = x.size(1), T = x.size(2), D = x.size(3), half = D / 2;
  const A* xp = x.data_ptr<A>();
  const int64_t sb = x.stride(0), sh = x.stride(1), st = x.stride(2);
  at::parallel_for(0, B * H * T, 64, [&](int64_t begin, int64_t end) {
    std::vector<float> buffer(std::is_same_v<A, float> ? 0 : D);
    for (int64_t r = begin; r < end; ++r) {
      const int64_t b = r / (H * T), h = r / T % H, t = r % T;
      const A* in = xp + b * sb + h * sh + t * st;
      const A* co = cp + b * table_b + t * D;
      const A* si = sp + b * table_b + t * D;
      float* o = row_out(op + r * D, buffer.data());
      int64_t d = 0;
      for (; d + 8 <= half; d += 8) {  // the first half pairs with minus the second, the second with the first
        const __m256 lo = load8(in + d), hi = load8(in + half + d);
        _mm256_storeu_ps(o + d, _mm256_fnmadd_ps(hi, load8(si + d), _mm256_mul_ps(lo, load8(co + d))));
        _mm256_storeu_ps(o + half + d, _mm256_fmadd_ps(lo, load8(si + half + d), _mm256_mul_ps(hi, load8(co + half + d))));
      }
      for (; d < half; ++d) {
        const float lo = static_cast<float>(in[d]), hi = static_cast<float>(in[half + d]);
        o[d] = lo * static_cast<float>(co[d]) - hi * static_cast<float>(si[d]);
        o[half + d] = hi * static_cast<float>(co[half + d]) + lo * static_cast<float>(si[half + d]);
      }
      row_done(op + r * D, o, D);
    }
  });
}

// rotary_as for x of float32 or bfloat16 and contiguous tables of its dtype, into a contiguous `out`.
void rotary_into(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t table_b, at::Tensor& out) {
  if (x.scalar_type() == at::kBFloat16) {
    rotary_as(x, cos.data_ptr<c10::BFloat16>(), sin.data_ptr<c10::BFloat16>(), table_b, out.data_ptr<c10::BFloat16>());
  } else {
    rotary_as(x, cos.data_ptr<float>(), sin.data_ptr<float>(), table_b, out.data_ptr<float>());
  }
}

at::Tensor rotary(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  check_elementwise("rotary", {&x, &cos, &sin});
  TORCH_CHECK(x.dim() == 4 && cos.dim() == 4 && sin.sizes() == cos.sizes() && x.size(3) % 2 == 0 && x.stride(3) == 1 &&
              cos.size(1) == 1 && cos.size(2) == x.size(2) && cos.size(3) == x.size(3) &&
              (cos.size(0) == x.size(0) || cos.size(0) == 1),
              "rotary: x [B, H, T, D] (D even, its last dimension contiguous) and cos, sin [B or 1, 1, T, D] expected");
  const at::Tensor c = cos.contiguous(), sn = sin.contiguous();
  at::Tensor out = at::empty(x.sizes(), x.options());
  rotary_into(x, c, sn, c.size(0) == 1 ? 0 : x.size(2) * x.size(3), out);
  return out;
}

}  // namespace
