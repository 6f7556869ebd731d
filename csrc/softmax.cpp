// scale + mask + softmax over the last dim of attention scores, forward and backward.
//
// Eager attention writes scores*scale, then the masked copy, then the softmax; here one row
// pass does all three from a cache-resident scratch row. Causal rows stop at the diagonal, so
// the masked upper triangle costs a zero-fill instead of exp(). The backward needs only the
// output: masked probabilities are zero, so the mask never has to be read again.
#include "common.h"

namespace lnpu {
namespace {

template <typename T>
void fwd_impl(const at::Tensor& x, double scale_d, bool causal, const at::Tensor& mask, at::Tensor& y) {
  using V = AVec<T>;
  using A = acc_t<T>;
  constexpr int64_t L = kLanes<T>;
  const int64_t Tk = last_dim(x), R = x.numel() / std::max<int64_t>(Tk, 1);
  const int64_t Tq = x.dim() >= 2 ? x.size(-2) : 1;
  const T* xp = x.const_data_ptr<T>();
  T* yp = y.mutable_data_ptr<T>();
  const bool* mp = mask.defined() ? mask.const_data_ptr<bool>() : nullptr;
  const int64_t nlead = x.dim() - 1;
  std::vector<int64_t> sizes, mstrides;
  if (mp) {
    for (int64_t d = 0; d < nlead; ++d) {
      sizes.push_back(x.size(d));
      mstrides.push_back(mask.stride(d));
    }
  }
  const int64_t mlast = mp ? mask.stride(-1) : 0;
  const A scale = static_cast<A>(scale_d);
  const A ninf = -std::numeric_limits<A>::infinity();
  at::parallel_for(0, R, row_grain(Tk), [&](int64_t r0, int64_t r1) {
    std::vector<A> z(static_cast<size_t>(Tk));
    A* zp = z.data();
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = xp + r * Tk;
      T* yr = yp + r * Tk;
      int64_t limit = Tk;
      if (causal) limit = std::clamp<int64_t>(r % Tq + (Tk - Tq) + 1, 0, Tk);
      int64_t c = 0;
      const V vs(scale);
      for (; c + L <= limit; c += L) (vload(xr + c) * vs).store(zp + c);
      if (c < limit) (vload(xr + c, limit - c) * vs).store(zp + c, limit - c);
      if (mp) {
        int64_t off = 0, rem = r;
        for (int64_t d = nlead - 1; d >= 0; --d) {
          off += (rem % sizes[d]) * mstrides[d];
          rem /= sizes[d];
        }
        const bool* mr = mp + off;
        if (mlast == 0) {
          if (mr[0]) limit = 0;
        } else {
          for (int64_t j = 0; j < limit; ++j) zp[j] = mr[j] ? ninf : zp[j];
        }
      }
      V vmax(ninf);
      c = 0;
      for (; c + L <= limit; c += L) vmax = at::vec::maximum(vmax, V::loadu(zp + c));
      if (c < limit) vmax = at::vec::maximum(vmax, V::set(V(ninf), V::loadu(zp + c, limit - c), limit - c));
      const A mx = limit > 0 ? hmax(vmax) : ninf;
      if (mx == ninf) {  // fully masked row: zeros (eager softmax would give NaN)
        c = 0;
        for (; c + L <= Tk; c += L) vstore(yr + c, V(0));
        if (c < Tk) vstore(yr + c, V(0), Tk - c);
        continue;
      }
      const V vm(mx);
      V vsum(0);
      c = 0;
      for (; c + L <= limit; c += L) {
        V e = (V::loadu(zp + c) - vm).exp();
        e.store(zp + c);
        vsum += e;
      }
      if (c < limit) {
        V e = V::set(V(0), (V::loadu(zp + c, limit - c) - vm).exp(), limit - c);
        e.store(zp + c, limit - c);
        vsum += e;
      }
      const V inv(A(1) / hsum(vsum));
      c = 0;
      for (; c + L <= limit; c += L) vstore(yr + c, V::loadu(zp + c) * inv);
      if (c < limit) {
        vstore(yr + c, V::loadu(zp + c, limit - c) * inv, limit - c);
        c = limit;
      }
      for (; c < Tk && (c % L) != 0; ++c) yr[c] = T(0);
      for (; c + L <= Tk; c += L) vstore(yr + c, V(0));
      if (c < Tk) vstore(yr + c, V(0), Tk - c);
    }
  });
}

template <typename T>
void bwd_impl(const at::Tensor& gy, const at::Tensor& y, double scale_d, bool causal, at::Tensor& gx) {
  using V = AVec<T>;
  using A = acc_t<T>;
  constexpr int64_t L = kLanes<T>;
  const int64_t Tk = last_dim(y), R = y.numel() / std::max<int64_t>(Tk, 1);
  const int64_t Tq = y.dim() >= 2 ? y.size(-2) : 1;
  const T* gp = gy.const_data_ptr<T>();
  const T* yp = y.const_data_ptr<T>();
  T* op = gx.mutable_data_ptr<T>();
  const V vs(static_cast<A>(scale_d));
  at::parallel_for(0, R, row_grain(Tk), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* gr = gp + r * Tk;
      const T* yr = yp + r * Tk;
      T* o = op + r * Tk;
      int64_t limit = causal ? std::clamp<int64_t>(r % Tq + (Tk - Tq) + 1, 0, Tk) : Tk;
      V d(0);
      int64_t c = 0;
      for (; c + L <= limit; c += L) d += vload(gr + c) * vload(yr + c);
      if (c < limit) d += vload(gr + c, limit - c) * vload(yr + c, limit - c);
      const V vd(hsum(d));
      c = 0;
      for (; c + L <= limit; c += L) {
        V yy = vload(yr + c);
        vstore(o + c, vs * yy * (vload(gr + c) - vd));
      }
      if (c < limit) {
        const int64_t n = limit - c;
        V yy = vload(yr + c, n);
        vstore(o + c, vs * yy * (vload(gr + c, n) - vd), n);
        c = limit;
      }
      for (; c < Tk && (c % L) != 0; ++c) o[c] = T(0);
      for (; c + L <= Tk; c += L) vstore(o + c, V(0));
      if (c < Tk) vstore(o + c, V(0), Tk - c);
    }
  });
}

}  // namespace

// mask: bool, already expanded (a strided view, no copy) to x's shape, last-dim stride 0 or 1;
// true marks a position to drop, as in Tensor.masked_fill.
at::Tensor scale_mask_softmax_forward(const at::Tensor& x, double scale, bool causal,
                                      const c10::optional<at::Tensor>& mask) {
  check_cpu_contig(x, "scores");
  at::Tensor m = mask.has_value() ? *mask : at::Tensor();
  if (m.defined()) {
    TORCH_CHECK(m.scalar_type() == at::kBool && m.sizes() == x.sizes(), "mask must be bool and expanded to the scores");
    TORCH_CHECK(m.stride(-1) == 0 || m.stride(-1) == 1, "mask's last dim must have stride 0 or 1");
  }
  at::Tensor y = at::empty_like(x);
  LNPU_DISPATCH_FLOATING(x.scalar_type(), "scale_mask_softmax_forward", [&] { fwd_impl<scalar_t>(x, scale, causal, m, y); });
  return y;
}

at::Tensor scale_mask_softmax_backward(const at::Tensor& gy, const at::Tensor& y, double scale, bool causal) {
  check_cpu_contig(gy, "grad");
  check_cpu_contig(y, "probs");
  at::Tensor gx = at::empty_like(y);
  LNPU_DISPATCH_FLOATING(y.scalar_type(), "scale_mask_softmax_backward", [&] { bwd_impl<scalar_t>(gy, y, scale, causal, gx); });
  return gx;
}

}  // namespace lnpu
