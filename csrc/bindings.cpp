// pybind11 module of the fused CPU kernels. Only this file includes torch/extension.h (the
// kernel files use the lighter ATen headers) to keep the one-time JIT build short. The
// functions are raw kernels; lightning_npu/ops/library.py registers them as torch.library
// custom ops with autograd and fake kernels.
#include <torch/extension.h>

#include <vector>

namespace lnpu {
at::Tensor bias_gelu_forward(const at::Tensor&, const c10::optional<at::Tensor>&, bool);
std::vector<at::Tensor> bias_gelu_backward(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&, bool);
std::vector<at::Tensor> add_norm_forward(const at::Tensor&, const c10::optional<at::Tensor>&,
                                         const c10::optional<at::Tensor>&, const c10::optional<at::Tensor>&, double,
                                         bool);
std::vector<at::Tensor> add_norm_backward(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&,
                                          const c10::optional<at::Tensor>&, const at::Tensor&,
                                          const c10::optional<at::Tensor>&, double, bool, bool, bool);
at::Tensor scale_mask_softmax_forward(const at::Tensor&, double, bool, const c10::optional<at::Tensor>&);
at::Tensor scale_mask_softmax_backward(const at::Tensor&, const at::Tensor&, double, bool);
at::Tensor swiglu_forward(const at::Tensor&, const at::Tensor&);
std::vector<at::Tensor> swiglu_backward(const at::Tensor&, const at::Tensor&, const at::Tensor&);
at::Tensor bias_dropout_add_forward(const at::Tensor&, const c10::optional<at::Tensor>&, const at::Tensor&, double,
                                    int64_t);
std::vector<at::Tensor> bias_dropout_add_backward(const at::Tensor&, double, int64_t, bool);
}  // namespace lnpu

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "lightning-npu fused CPU kernels (vectorised with ATen Vectorized, parallel over rows)";
  m.def("bias_gelu_forward", &lnpu::bias_gelu_forward);
  m.def("bias_gelu_backward", &lnpu::bias_gelu_backward);
  m.def("add_norm_forward", &lnpu::add_norm_forward);
  m.def("add_norm_backward", &lnpu::add_norm_backward);
  m.def("scale_mask_softmax_forward", &lnpu::scale_mask_softmax_forward);
  m.def("scale_mask_softmax_backward", &lnpu::scale_mask_softmax_backward);
  m.def("swiglu_forward", &lnpu::swiglu_forward);
  m.def("swiglu_backward", &lnpu::swiglu_backward);
  m.def("bias_dropout_add_forward", &lnpu::bias_dropout_add_forward);
  m.def("bias_dropout_add_backward", &lnpu::bias_dropout_add_backward);
#if defined(CPU_CAPABILITY_AVX512)
  m.attr("simd") = "avx512";
#elif defined(CPU_CAPABILITY_AVX2)
  m.attr("simd") = "avx2";
#else
  m.attr("simd") = "default";
#endif
}
