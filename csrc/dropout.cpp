// bias + dropout + residual add, forward and backward.
//
// The keep mask is a counter-based hash of (seed, flat element index), so the backward
// regenerates it from the seed instead of saving a mask tensor: nothing but the output is
// written forward, and the backward reads only the incoming gradient.
#include "common.h"

namespace lnpu {
namespace {

inline uint32_t fmix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x85ebca6bu;
  h ^= h >> 13;
  h *= 0xc2b2ae35u;
  h ^= h >> 16;
  return h;
}

struct KeepMask {
  uint32_t k1, k2, threshold;
  KeepMask(int64_t seed, double p) {
    const uint64_t s = static_cast<uint64_t>(seed);
    k1 = fmix32(static_cast<uint32_t>(s) ^ 0x9e3779b9u);
    k2 = fmix32(static_cast<uint32_t>(s >> 32) + 0x7f4a7c15u);
    const double t = std::ldexp(p, 32);
    threshold = t >= 4294967295.0 ? 0xffffffffu : static_cast<uint32_t>(t);
  }
  // writes `scale` where kept and 0 where dropped, for flat indices [i, i + n)
  template <typename A>
  inline void fill(int64_t i, int64_t n, A scale, A* out) const {
    const uint32_t hi = fmix32(static_cast<uint32_t>(static_cast<uint64_t>(i) >> 32) ^ k2);
    const uint32_t lo = static_cast<uint32_t>(i);
    for (int64_t j = 0; j < n; ++j) {
      const uint32_t h = fmix32(fmix32((lo + static_cast<uint32_t>(j)) ^ k1) ^ hi);
      out[j] = h >= threshold ? scale : A(0);
    }
  }
};

// One pass over rows: out = (src [+ bias]) * mask [+ residual]; optionally accumulates the
// result into per-column partial sums (the bias gradient).
template <typename T>
void apply(const T* src, const T* bias, const T* res, T* out, int64_t R, int64_t H, const KeepMask& km, double p,
           ColumnPartials<acc_t<T>>* parts) {
  using V = AVec<T>;
  using A = acc_t<T>;
  constexpr int64_t L = kLanes<T>;
  const A scale = p >= 1.0 ? A(0) : static_cast<A>(1.0 / (1.0 - p));
  at::parallel_for(0, R, row_grain(H), [&](int64_t r0, int64_t r1) {
    alignas(64) A m[L];
    A* acc = parts ? parts->slot(0, 1) : nullptr;
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t base = r * H;
      for (int64_t c = 0; c < H; c += L) {
        const int64_t n = std::min<int64_t>(L, H - c);
        km.fill<A>(base + c, n, scale, m);
        V v = n == L ? vload(src + base + c) : vload(src + base + c, n);
        if (bias) v = v + (n == L ? vload(bias + c) : vload(bias + c, n));
        v = v * V::loadu(m, n);
        if (acc) (V::loadu(acc + c, n) + v).store(acc + c, n);
        if (res) v = v + (n == L ? vload(res + base + c) : vload(res + base + c, n));
        if (n == L)
          vstore(out + base + c, v);
        else
          vstore(out + base + c, v, n);
      }
    }
  });
}

}  // namespace

at::Tensor bias_dropout_add_forward(const at::Tensor& x, const c10::optional<at::Tensor>& bias,
                                    const at::Tensor& residual, double p, int64_t seed) {
  check_cpu_contig(x, "x");
  check_cpu_contig(residual, "residual");
  TORCH_CHECK(residual.sizes() == x.sizes() && residual.scalar_type() == x.scalar_type(), "residual must match x");
  TORCH_CHECK(p >= 0.0 && p <= 1.0, "dropout probability must be in [0, 1], got ", p);
  at::Tensor b = bias.has_value() ? *bias : at::Tensor();
  if (b.defined()) check_cpu_contig(b, "bias");
  const int64_t H = last_dim(x), R = x.numel() / std::max<int64_t>(H, 1);
  at::Tensor y = at::empty_like(x);
  const KeepMask km(seed, p);
  LNPU_DISPATCH_FLOATING(x.scalar_type(), "bias_dropout_add_forward", [&] {
    apply<scalar_t>(x.const_data_ptr<scalar_t>(), b.defined() ? b.const_data_ptr<scalar_t>() : nullptr,
                    residual.const_data_ptr<scalar_t>(), y.mutable_data_ptr<scalar_t>(), R, H, km, p, nullptr);
  });
  return y;
}

// returns [grad_x, grad_bias (undefined unless need_bias_grad)]; grad_residual is grad itself
std::vector<at::Tensor> bias_dropout_add_backward(const at::Tensor& gy, double p, int64_t seed, bool need_bias_grad) {
  check_cpu_contig(gy, "grad");
  const int64_t H = last_dim(gy), R = gy.numel() / std::max<int64_t>(H, 1);
  at::Tensor gx = at::empty_like(gy);
  at::Tensor gb = need_bias_grad ? at::empty({H}, gy.options()) : at::Tensor();
  const KeepMask km(seed, p);
  LNPU_DISPATCH_FLOATING(gy.scalar_type(), "bias_dropout_add_backward", [&] {
    using A = acc_t<scalar_t>;
    ColumnPartials<A> parts(H, 1);
    apply<scalar_t>(gy.const_data_ptr<scalar_t>(), nullptr, nullptr, gx.mutable_data_ptr<scalar_t>(), R, H, km, p,
                    need_bias_grad ? &parts : nullptr);
    if (need_bias_grad) parts.reduce_into(0, 1, gb.mutable_data_ptr<scalar_t>());
  });
  return {gx, gb};
}

}  // namespace lnpu
