// residual add + LayerNorm / RMSNorm, forward and backward.
//
// Pre-norm blocks compute h = x + residual and then norm(h); both are memory-bound, so one row
// pass that writes h and y and keeps per-row statistics (mean, rstd) for the backward halves
// the traffic. Statistics use two passes over the row (which is cache-resident) so fp32 keeps
// ~1e-7 relative accuracy even for rows with a large mean.
#include "common.h"

namespace lnpu {
namespace {

template <typename T>
void fwd_impl(const at::Tensor& x, const at::Tensor& res, const at::Tensor& w, const at::Tensor& b, double eps, bool rms,
              at::Tensor& y, at::Tensor& h, at::Tensor& mean, at::Tensor& rstd) {
  using V = AVec<T>;
  using A = acc_t<T>;
  constexpr int64_t L = kLanes<T>;
  const int64_t H = last_dim(x), R = x.numel() / std::max<int64_t>(H, 1);
  const T* xp = x.const_data_ptr<T>();
  const T* rp = res.defined() ? res.const_data_ptr<T>() : nullptr;
  const A* wp = w.defined() ? w.const_data_ptr<A>() : nullptr;
  const A* bp = b.defined() ? b.const_data_ptr<A>() : nullptr;
  T* yp = y.mutable_data_ptr<T>();
  T* hp = h.defined() ? h.mutable_data_ptr<T>() : nullptr;
  A* mp = mean.defined() ? mean.mutable_data_ptr<A>() : nullptr;
  A* sp = rstd.mutable_data_ptr<A>();
  const A inv_h = A(1) / A(H);
  at::parallel_for(0, R, row_grain(H), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* src = xp + r * H;
      if (rp) {  // h = x + residual, rounded to T like the unfused add; the norm sees the rounded h
        T* hr = hp + r * H;
        const T* rr = rp + r * H;
        int64_t c = 0;
        for (; c + L <= H; c += L) vstore(hr + c, vload(src + c) + vload(rr + c));
        if (c < H) vstore(hr + c, vload(src + c, H - c) + vload(rr + c, H - c), H - c);
        src = hr;
      }
      A mu = 0;
      if (!rms) {
        V s(0);
        int64_t c = 0;
        for (; c + L <= H; c += L) s += vload(src + c);
        if (c < H) s += vload(src + c, H - c);
        mu = hsum(s) * inv_h;
      }
      V vmu(mu), q(0);
      {
        int64_t c = 0;
        for (; c + L <= H; c += L) {
          V d = vload(src + c) - vmu;
          q += d * d;
        }
        if (c < H) {
          V d = V::set(V(0), vload(src + c, H - c) - vmu, H - c);
          q += d * d;
        }
      }
      const A rs = A(1) / std::sqrt(hsum(q) * inv_h + A(eps));
      if (mp) mp[r] = mu;
      sp[r] = rs;
      V vrs(rs);
      T* yr = yp + r * H;
      int64_t c = 0;
      for (; c + L <= H; c += L) {
        V o = (vload(src + c) - vmu) * vrs;
        if (wp) o = o * V::loadu(wp + c);
        if (bp) o = o + V::loadu(bp + c);
        vstore(yr + c, o);
      }
      if (c < H) {
        const int64_t n = H - c;
        V o = (vload(src + c, n) - vmu) * vrs;
        if (wp) o = o * V::loadu(wp + c, n);
        if (bp) o = o + V::loadu(bp + c, n);
        vstore(yr + c, o, n);
      }
    }
  });
}

// Narrow rows cancel catastrophically in the input gradient (hidden 1, RMSNorm: the factor
// 1 - xhat^2 = eps / (x^2 + eps)), so they recompute the row statistics and the gradient in
// double. Wide rows have no such structural cancellation and stay in the vector path.
constexpr int64_t kSmallRow = 16;

template <typename T, typename A>
void small_row_backward(const T* gr, const T* hr, const T* er, const A* wp, int64_t H, double eps, bool rms, A* accw,
                        A* accb, T* out) {
  double mu = 0, q = 0, s1 = 0, s2 = 0;
  if (!rms) {
    for (int64_t c = 0; c < H; ++c) mu += static_cast<double>(hr[c]);
    mu /= static_cast<double>(H);
  }
  for (int64_t c = 0; c < H; ++c) {
    const double d = static_cast<double>(hr[c]) - mu;
    q += d * d;
  }
  const double rs = 1.0 / std::sqrt(q / static_cast<double>(H) + eps);
  for (int64_t c = 0; c < H; ++c) {
    const double g0 = static_cast<double>(gr[c]);
    const double xh = (static_cast<double>(hr[c]) - mu) * rs;
    if (accw) accw[c] += static_cast<A>(g0 * xh);
    if (accb) accb[c] += static_cast<A>(g0);
    const double g = wp ? g0 * static_cast<double>(wp[c]) : g0;
    s1 += g;
    s2 += g * xh;
  }
  const double m1 = rms ? 0.0 : s1 / static_cast<double>(H), m2 = s2 / static_cast<double>(H);
  for (int64_t c = 0; c < H; ++c) {
    const double g = wp ? static_cast<double>(gr[c]) * static_cast<double>(wp[c]) : static_cast<double>(gr[c]);
    const double xh = (static_cast<double>(hr[c]) - mu) * rs;
    double o = rs * (g - m1 - xh * m2);
    if (er) o += static_cast<double>(er[c]);
    out[c] = static_cast<T>(o);
  }
}

template <typename T>
void bwd_impl(const at::Tensor& gy, const at::Tensor& h, const at::Tensor& w, const at::Tensor& mean,
              const at::Tensor& rstd, const at::Tensor& gh_extra, double eps, bool rms, bool need_gb, at::Tensor& gx,
              at::Tensor& gw, at::Tensor& gb) {
  using V = AVec<T>;
  using A = acc_t<T>;
  constexpr int64_t L = kLanes<T>;
  const int64_t H = last_dim(h), R = h.numel() / std::max<int64_t>(H, 1);
  const T* gp = gy.const_data_ptr<T>();
  const T* hp = h.const_data_ptr<T>();
  const T* ep = gh_extra.defined() ? gh_extra.const_data_ptr<T>() : nullptr;
  const A* wp = w.defined() ? w.const_data_ptr<A>() : nullptr;
  const A* mp = rms ? nullptr : mean.const_data_ptr<A>();
  const A* sp = rstd.const_data_ptr<A>();
  T* gxp = gx.mutable_data_ptr<T>();
  const bool need_gw = gw.defined();
  ColumnPartials<A> part(H, 2);
  const A inv_h = A(1) / A(H);
  at::parallel_for(0, R, row_grain(H), [&](int64_t r0, int64_t r1) {
    A* accw = part.slot(0, 2);
    A* accb = part.slot(1, 2);
    for (int64_t r = r0; r < r1; ++r) {
      const T* gr = gp + r * H;
      const T* hr = hp + r * H;
      if (H <= kSmallRow) {
        small_row_backward(gr, hr, ep ? ep + r * H : nullptr, wp, H, eps, rms, need_gw ? accw : nullptr,
                           need_gb ? accb : nullptr, gxp + r * H);
        continue;
      }
      const V vmu(mp ? mp[r] : A(0)), vrs(sp[r]);
      V s1(0), s2(0);
      int64_t c = 0;
      for (; c + L <= H; c += L) {
        V g = vload(gr + c);
        V xh = (vload(hr + c) - vmu) * vrs;
        if (need_gw) (V::loadu(accw + c) + g * xh).store(accw + c);
        if (need_gb) (V::loadu(accb + c) + g).store(accb + c);
        if (wp) g = g * V::loadu(wp + c);
        s1 += g;
        s2 += g * xh;
      }
      if (c < H) {
        const int64_t n = H - c;
        V g = vload(gr + c, n);
        V xh = V::set(V(0), (vload(hr + c, n) - vmu) * vrs, n);
        if (need_gw) (V::loadu(accw + c, n) + g * xh).store(accw + c, n);
        if (need_gb) (V::loadu(accb + c, n) + g).store(accb + c, n);
        if (wp) g = g * V::loadu(wp + c, n);
        s1 += g;
        s2 += g * xh;
      }
      const V m1(rms ? A(0) : hsum(s1) * inv_h), m2(hsum(s2) * inv_h);
      T* out = gxp + r * H;
      const T* er = ep ? ep + r * H : nullptr;
      c = 0;
      for (; c + L <= H; c += L) {
        V g = vload(gr + c);
        if (wp) g = g * V::loadu(wp + c);
        V xh = (vload(hr + c) - vmu) * vrs;
        V o = vrs * (g - m1 - xh * m2);
        if (er) o = o + vload(er + c);
        vstore(out + c, o);
      }
      if (c < H) {
        const int64_t n = H - c;
        V g = vload(gr + c, n);
        if (wp) g = g * V::loadu(wp + c, n);
        V xh = (vload(hr + c, n) - vmu) * vrs;
        V o = vrs * (g - m1 - xh * m2);
        if (er) o = o + vload(er + c, n);
        vstore(out + c, o, n);
      }
    }
  });
  if (need_gw) part.reduce_into(0, 2, gw.mutable_data_ptr<A>());
  if (need_gb) part.reduce_into(1, 2, gb.mutable_data_ptr<A>());
}

at::ScalarType acc_type(at::ScalarType t) { return t == at::kDouble ? at::kDouble : at::kFloat; }

at::Tensor opt(const c10::optional<at::Tensor>& t) { return t.has_value() ? *t : at::Tensor(); }

}  // namespace

// returns [y, h (x + residual; undefined without residual), mean (undefined for RMSNorm), rstd]
std::vector<at::Tensor> add_norm_forward(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                         const c10::optional<at::Tensor>& weight,
                                         const c10::optional<at::Tensor>& bias, double eps, bool rms) {
  check_cpu_contig(x, "x");
  at::Tensor res = opt(residual), w = opt(weight), b = opt(bias);
  const auto at_ = acc_type(x.scalar_type());
  if (res.defined()) {
    check_cpu_contig(res, "residual");
    TORCH_CHECK(res.sizes() == x.sizes() && res.scalar_type() == x.scalar_type(), "residual must match x");
  }
  for (auto* p : {&w, &b}) {
    if (p->defined()) {
      check_cpu_contig(*p, "weight/bias");
      TORCH_CHECK(p->numel() == last_dim(x) && p->scalar_type() == at_, "weight/bias must be [hidden] in ", at_);
    }
  }
  const int64_t H = last_dim(x), R = x.numel() / std::max<int64_t>(H, 1);
  at::Tensor y = at::empty_like(x);
  at::Tensor h = res.defined() ? at::empty_like(x) : at::Tensor();
  at::Tensor mean = rms ? at::Tensor() : at::empty({R}, x.options().dtype(at_));
  at::Tensor rstd = at::empty({R}, x.options().dtype(at_));
  LNPU_DISPATCH_FLOATING(x.scalar_type(), "add_norm_forward",
                         [&] { fwd_impl<scalar_t>(x, res, w, b, eps, rms, y, h, mean, rstd); });
  return {y, h, mean, rstd};
}

// returns [grad_h (= grad of x and of residual), grad_weight, grad_bias]
std::vector<at::Tensor> add_norm_backward(const at::Tensor& gy, const at::Tensor& h,
                                          const c10::optional<at::Tensor>& weight,
                                          const c10::optional<at::Tensor>& mean, const at::Tensor& rstd,
                                          const c10::optional<at::Tensor>& grad_h, double eps, bool rms,
                                          bool need_gw, bool need_gb) {
  check_cpu_contig(gy, "grad");
  check_cpu_contig(h, "input");
  at::Tensor w = opt(weight), m = opt(mean), gh = opt(grad_h);
  if (gh.defined()) check_cpu_contig(gh, "grad of the sum");
  const auto at_ = acc_type(h.scalar_type());
  const int64_t H = last_dim(h);
  at::Tensor gx = at::empty_like(h);
  at::Tensor gw = need_gw ? at::empty({H}, h.options().dtype(at_)) : at::Tensor();
  at::Tensor gb = need_gb ? at::empty({H}, h.options().dtype(at_)) : at::Tensor();
  LNPU_DISPATCH_FLOATING(h.scalar_type(), "add_norm_backward",
                         [&] { bwd_impl<scalar_t>(gy, h, w, m, rstd, gh, eps, rms, need_gb, gx, gw, gb); });
  return {gx, gw, gb};
}

}  // namespace lnpu
