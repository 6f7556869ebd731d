// Shared helpers for the fused CPU kernels.
//
// Every kernel reads its activation type T (float, BFloat16 or double) and computes in
// acc_t<T> (double for double, float otherwise) with ATen's Vectorized<acc_t<T>>, which is
// the same SIMD layer inductor's generated CPU code uses. Loads/stores convert on the fly so a
// bf16 tensor is never materialised in fp32.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

namespace lnpu {

using at::vec::Vectorized;

template <typename T>
using acc_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

template <typename T>
using AVec = Vectorized<acc_t<T>>;

template <typename T>
constexpr int64_t kLanes = AVec<T>::size();

// ---- loads / stores that convert to and from the accumulation type -------------------
template <typename T>
inline AVec<T> vload(const T* p) {
  if constexpr (std::is_same_v<T, acc_t<T>>) {
    return AVec<T>::loadu(p);
  } else {
    AVec<T> out;
    at::vec::load_to_float<T>(p, out);
    return out;
  }
}

template <typename T>
inline AVec<T> vload(const T* p, int64_t n) {
  if constexpr (std::is_same_v<T, acc_t<T>>) {
    return AVec<T>::loadu(p, n);
  } else {
    auto lo = std::get<0>(at::vec::convert_to_float<T>(Vectorized<T>::loadu(p, n)));
    // lanes past n are undefined after conversion; zero them so reductions stay exact
    return AVec<T>::set(AVec<T>(0), lo, n);
  }
}

template <typename T>
inline void vstore(T* p, const AVec<T>& v) {
  if constexpr (std::is_same_v<T, acc_t<T>>) {
    v.store(p);
  } else {
    at::vec::convert_from_float<T>(v, v).store(p, kLanes<T>);
  }
}

template <typename T>
inline void vstore(T* p, const AVec<T>& v, int64_t n) {
  if constexpr (std::is_same_v<T, acc_t<T>>) {
    v.store(p, n);
  } else {
    at::vec::convert_from_float<T>(v, v).store(p, n);
  }
}

template <typename V>
inline auto hsum(const V& v) {
  using S = typename V::value_type;
  return at::vec::vec_reduce_all<S>([](V a, V b) { return a + b; }, v);
}

template <typename V>
inline auto hmax(const V& v) {
  using S = typename V::value_type;
  return at::vec::vec_reduce_all<S>([](V a, V b) { return at::vec::maximum(a, b); }, v);
}

// Rows per parallel task: enough work per task to amortise the fork, whatever the width.
inline int64_t row_grain(int64_t width) {
  return std::max<int64_t>(1, 16384 / std::max<int64_t>(1, width));
}

// Per-thread partial column sums (bias/weight gradients) reduced at the end: no atomics and
// a deterministic result for a fixed thread count.
template <typename A>
struct ColumnPartials {
  int64_t width;
  int64_t nthreads;
  std::vector<A> buf;
  ColumnPartials(int64_t width_, int64_t count)
      : width(width_), nthreads(at::get_num_threads()), buf(static_cast<size_t>(nthreads * width_ * count), A(0)) {}
  A* slot(int64_t which, int64_t count) {
    return buf.data() + (static_cast<int64_t>(at::get_thread_num()) * count + which) * width;
  }
  // sum over threads of slot `which` into out (converted to O)
  template <typename O>
  void reduce_into(int64_t which, int64_t count, O* out) const {
    for (int64_t c = 0; c < width; ++c) {
      A s = 0;
      for (int64_t t = 0; t < nthreads; ++t) s += buf[(t * count + which) * width + c];
      out[c] = static_cast<O>(s);
    }
  }
};

inline void check_cpu_contig(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), "lightning_npu fused op: ", name, " must be a CPU tensor");
  TORCH_CHECK(t.is_contiguous(), "lightning_npu fused op: ", name, " must be contiguous (the Python wrapper makes it so)");
}

inline int64_t last_dim(const at::Tensor& t) { return t.dim() == 0 ? 1 : t.size(-1); }

}  // namespace lnpu

#define LNPU_DISPATCH_FLOATING(TYPE, NAME, ...) \
  AT_DISPATCH_FLOATING_TYPES_AND(at::ScalarType::BFloat16, TYPE, NAME, __VA_ARGS__)
