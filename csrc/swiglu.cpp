// SwiGLU: silu(gate) * up, forward and backward in one pass each (eager needs three kernels
// forward and five backward, each a full read/write of the [tokens, ffn] activations).
#include "common.h"

namespace lnpu {
namespace {

template <typename T>
void fwd_impl(const at::Tensor& g, const at::Tensor& u, at::Tensor& y) {
  using V = AVec<T>;
  using A = acc_t<T>;
  constexpr int64_t L = kLanes<T>;
  const T* gp = g.const_data_ptr<T>();
  const T* up = u.const_data_ptr<T>();
  T* yp = y.mutable_data_ptr<T>();
  const V one(A(1));
  auto f = [&](V a, V b) { return a / (one + a.neg().exp()) * b; };
  at::parallel_for(0, g.numel(), 32768, [&](int64_t b, int64_t e) {
    int64_t i = b;
    for (; i + L <= e; i += L) vstore(yp + i, f(vload(gp + i), vload(up + i)));
    if (i < e) vstore(yp + i, f(vload(gp + i, e - i), vload(up + i, e - i)), e - i);
  });
}

template <typename T>
void bwd_impl(const at::Tensor& gy, const at::Tensor& g, const at::Tensor& u, at::Tensor& gg, at::Tensor& gu) {
  using V = AVec<T>;
  using A = acc_t<T>;
  constexpr int64_t L = kLanes<T>;
  const T* dp = gy.const_data_ptr<T>();
  const T* gp = g.const_data_ptr<T>();
  const T* up = u.const_data_ptr<T>();
  T* ggp = gg.mutable_data_ptr<T>();
  T* gup = gu.mutable_data_ptr<T>();
  const V one(A(1));
  auto step = [&](int64_t i, int64_t n) {
    V d = n == L ? vload(dp + i) : vload(dp + i, n);
    V a = n == L ? vload(gp + i) : vload(gp + i, n);
    V b = n == L ? vload(up + i) : vload(up + i, n);
    V s = one / (one + a.neg().exp());
    V ga = d * b * s * (one + a * (one - s));
    V gb = d * a * s;
    if (n == L) {
      vstore(ggp + i, ga);
      vstore(gup + i, gb);
    } else {
      vstore(ggp + i, ga, n);
      vstore(gup + i, gb, n);
    }
  };
  at::parallel_for(0, g.numel(), 32768, [&](int64_t b, int64_t e) {
    int64_t i = b;
    for (; i + L <= e; i += L) step(i, L);
    if (i < e) step(i, e - i);
  });
}

}  // namespace

at::Tensor swiglu_forward(const at::Tensor& gate, const at::Tensor& up) {
  check_cpu_contig(gate, "gate");
  check_cpu_contig(up, "up");
  TORCH_CHECK(gate.sizes() == up.sizes() && gate.scalar_type() == up.scalar_type(), "gate and up must match");
  at::Tensor y = at::empty_like(gate);
  LNPU_DISPATCH_FLOATING(gate.scalar_type(), "swiglu_forward", [&] { fwd_impl<scalar_t>(gate, up, y); });
  return y;
}

std::vector<at::Tensor> swiglu_backward(const at::Tensor& gy, const at::Tensor& gate, const at::Tensor& up) {
  check_cpu_contig(gy, "grad");
  check_cpu_contig(gate, "gate");
  check_cpu_contig(up, "up");
  at::Tensor gg = at::empty_like(gate), gu = at::empty_like(up);
  LNPU_DISPATCH_FLOATING(gate.scalar_type(), "swiglu_backward", [&] { bwd_impl<scalar_t>(gy, gate, up, gg, gu); });
  return {gg, gu};
}

}  // namespace lnpu
