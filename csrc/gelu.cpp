// bias + GELU (erf and tanh forms), forward and backward in one pass each.
//
// Forward reads x and bias once and writes y; backward recomputes the pre-activation from the
// saved input instead of storing it, so no intermediate (x + bias) tensor ever exists.
#include "common.h"

namespace lnpu {
namespace {

template <typename V>
struct GeluConsts {
  using S = typename V::value_type;
  V half{S(0.5)}, one{S(1)}, inv_sqrt2{S(M_SQRT1_2)}, k_pdf{S(0.5 * M_2_SQRTPI * M_SQRT1_2)},
      k_tanh{S(M_SQRT2 * M_2_SQRTPI * 0.5)}, c{S(0.044715)}, c3{S(3 * 0.044715)}, neg_half{S(-0.5)},
      two_k_tanh{S(M_SQRT2 * M_2_SQRTPI)};
};

template <typename V>
inline V gelu_f(const V& x, bool tanh_form, const GeluConsts<V>& k) {
  if (tanh_form) {  // 0.5 x (1 + tanh(u)) == x * sigmoid(2u): one exp instead of a (slower) tanh
    V u2 = k.two_k_tanh * (x + k.c * x * x * x);
    return x / (k.one + u2.neg().exp());
  }
  return k.half * x * (k.one + (x * k.inv_sqrt2).erf());
}

template <typename V>
inline V gelu_grad(const V& x, bool tanh_form, const GeluConsts<V>& k) {
  if (tanh_form) {  // with s = sigmoid(2u): 0.5 (1 + tanh u) = s and 1 - tanh(u)^2 = 4 s (1 - s)
    V x2 = x * x;
    V s = k.one / (k.one + (k.two_k_tanh * (x + k.c * x2 * x)).neg().exp());
    return s + k.two_k_tanh * x * s * (k.one - s) * (k.one + k.c3 * x2);
  }
  V cdf = k.half * (k.one + (x * k.inv_sqrt2).erf());
  V pdf = (k.neg_half * x * x).exp() * k.k_pdf;
  return cdf + x * pdf;
}

template <typename T>
void fwd_impl(const at::Tensor& x, const at::Tensor& bias, bool tanh_form, at::Tensor& y) {
  using V = AVec<T>;
  const int64_t H = last_dim(x), R = x.numel() / std::max<int64_t>(H, 1);
  const T* xp = x.const_data_ptr<T>();
  const T* bp = bias.defined() ? bias.const_data_ptr<T>() : nullptr;
  T* yp = y.mutable_data_ptr<T>();
  const GeluConsts<V> k;
  if (!bp) {  // no bias: elementwise over the flat buffer, ignore rows
    const int64_t N = x.numel();
    at::parallel_for(0, N, 32768, [&](int64_t b, int64_t e) {
      int64_t i = b;
      for (; i + kLanes<T> <= e; i += kLanes<T>) vstore(yp + i, gelu_f(vload(xp + i), tanh_form, k));
      if (i < e) vstore(yp + i, gelu_f(vload(xp + i, e - i), tanh_form, k), e - i);
    });
    return;
  }
  at::parallel_for(0, R, row_grain(H), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = xp + r * H;
      T* yr = yp + r * H;
      int64_t c = 0;
      for (; c + kLanes<T> <= H; c += kLanes<T>) vstore(yr + c, gelu_f(vload(xr + c) + vload(bp + c), tanh_form, k));
      if (c < H) vstore(yr + c, gelu_f(vload(xr + c, H - c) + vload(bp + c, H - c), tanh_form, k), H - c);
    }
  });
}

template <typename T>
void bwd_impl(const at::Tensor& gy, const at::Tensor& x, const at::Tensor& bias, bool tanh_form, at::Tensor& gx,
              at::Tensor& gb) {
  using V = AVec<T>;
  using A = acc_t<T>;
  const int64_t H = last_dim(x), R = x.numel() / std::max<int64_t>(H, 1);
  const T* xp = x.const_data_ptr<T>();
  const T* gp = gy.const_data_ptr<T>();
  const T* bp = bias.defined() ? bias.const_data_ptr<T>() : nullptr;
  T* gxp = gx.mutable_data_ptr<T>();
  const GeluConsts<V> k;
  if (!bp) {
    const int64_t N = x.numel();
    at::parallel_for(0, N, 32768, [&](int64_t b, int64_t e) {
      int64_t i = b;
      for (; i + kLanes<T> <= e; i += kLanes<T>) vstore(gxp + i, vload(gp + i) * gelu_grad(vload(xp + i), tanh_form, k));
      if (i < e) vstore(gxp + i, vload(gp + i, e - i) * gelu_grad(vload(xp + i, e - i), tanh_form, k), e - i);
    });
    return;
  }
  ColumnPartials<A> part(H, 1);
  at::parallel_for(0, R, row_grain(H), [&](int64_t r0, int64_t r1) {
    A* acc = part.slot(0, 1);
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = xp + r * H;
      const T* gr = gp + r * H;
      T* out = gxp + r * H;
      int64_t c = 0;
      for (; c + kLanes<T> <= H; c += kLanes<T>) {
        V g = vload(gr + c) * gelu_grad(vload(xr + c) + vload(bp + c), tanh_form, k);
        vstore(out + c, g);
        (V::loadu(acc + c) + g).store(acc + c);
      }
      if (c < H) {
        const int64_t n = H - c;
        V g = vload(gr + c, n) * gelu_grad(vload(xr + c, n) + vload(bp + c, n), tanh_form, k);
        vstore(out + c, g, n);
        (V::loadu(acc + c, n) + g).store(acc + c, n);
      }
    }
  });
  part.reduce_into(0, 1, gb.mutable_data_ptr<T>());
}

}  // namespace

at::Tensor bias_gelu_forward(const at::Tensor& x, const c10::optional<at::Tensor>& bias, bool tanh_form) {
  check_cpu_contig(x, "x");
  at::Tensor b = bias.has_value() ? *bias : at::Tensor();
  if (b.defined()) {
    check_cpu_contig(b, "bias");
    TORCH_CHECK(b.numel() == last_dim(x) && b.scalar_type() == x.scalar_type(), "bias must match x's last dim and dtype");
  }
  at::Tensor y = at::empty_like(x);
  LNPU_DISPATCH_FLOATING(x.scalar_type(), "bias_gelu_forward", [&] { fwd_impl<scalar_t>(x, b, tanh_form, y); });
  return y;
}

std::vector<at::Tensor> bias_gelu_backward(const at::Tensor& gy, const at::Tensor& x,
                                           const c10::optional<at::Tensor>& bias, bool tanh_form) {
  check_cpu_contig(gy, "grad");
  check_cpu_contig(x, "x");
  at::Tensor b = bias.has_value() ? *bias : at::Tensor();
  at::Tensor gx = at::empty_like(x);
  at::Tensor gb = b.defined() ? at::empty_like(b) : at::Tensor();
  LNPU_DISPATCH_FLOATING(x.scalar_type(), "bias_gelu_backward", [&] { bwd_impl<scalar_t>(gy, x, b, tanh_form, gx, gb); });
  return {gx, gb};
}

}  // namespace lnpu
