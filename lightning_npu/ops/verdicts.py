"""Which fusion patterns ``fuse_ops`` rewrites on which device type, and the evidence for each.

``fuse_ops`` must never slow a run down, so a pattern is rewritten on a device type only when
its fused kernel was measured faster there (or, on NPU, where the measurement is still owed,
when the vendor's fused kernel replaces an eager composite). The verdicts are data, each with
its source, so a new measurement changes one line here; ``rewrite_modules(..., patterns=...)``
overrides them per call, which is how a table for a new device is measured in the first place.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from lightning_npu import device as dev


@dataclass(frozen=True)
class Verdict:
    rewrite: bool
    speedup: Optional[float]  # measured fwd+bwd speedup of the fused kernel vs eager; None: not measured
    source: str

    def why(self) -> str:
        return self.source if self.speedup is None else f"{self.speedup:.2f}x vs eager ({self.source})"


# every kernel name the rewrite pass can announce
PATTERNS = (
    "layer_norm", "rms_norm", "gelu[none]", "gelu[tanh]", "softmax", "scale_causal_softmax",
    "linear+bias_gelu", "swiglu", "residual_add+layer_norm", "fusion_attention",
)

# CPU speedups: fwd+bwd median of the fused kernel vs eager, the lower of fp32 and bf16, 1 thread avx512
_CPU_OPS = "benchmarks/results/ops.json"
_CPU_RECHECK = "benchmarks/results/ops_cpu_recheck.json"  # benchmarks/ops.py --ops layer_norm softmax --repeat 25
_CPU_E2E = "example GPT training step, benchmarks/results/ops_e2e_patterns_cpu.json"
_NO_CPU_ATTN = "no faster kernel on this device: F.scaled_dot_product_attention is already PyTorch's fused kernel"
_NPU_OWED = "torch_npu fused kernel, not yet measured on Ascend"
_NO_NPU_KERNEL = "no faster kernel on this device (no torch_npu kernel wired: same eager ops)"
_CUDA = "no faster kernel measured on this device (fuse_ops=True ran 0.84x on an H200 with the CPU kernel set)"

MEASURED: dict[str, dict[str, Verdict]] = {
    dev.CPU: {
        "gelu[none]": Verdict(False, 0.984, _CPU_E2E + " (as linear+bias_gelu, the same kernel)"),
        "gelu[tanh]": Verdict(True, 1.70, _CPU_OPS + " (bias_gelu[tanh])"),
        # faster per op (bias_gelu 1.22x, add_layer_norm 1.32x, layer_norm 1.08x) but not in a GPT training step:
        # 0.98x / 0.99x / 0.97x at n_embd=128, equal within noise at n_embd=768
        "linear+bias_gelu": Verdict(False, 0.984, _CPU_E2E),
        "residual_add+layer_norm": Verdict(False, 0.986, _CPU_E2E),
        "rms_norm": Verdict(True, 8.14, _CPU_OPS + " (add_rms_norm)"),
        "scale_causal_softmax": Verdict(True, 3.51, _CPU_OPS),
        "swiglu": Verdict(True, 1.45, _CPU_OPS),
        "layer_norm": Verdict(False, 0.967, _CPU_E2E),
        # plain softmax (no scale/mask to fuse): fp32 1.00x, bf16 0.87x in the recheck, so it stays eager
        "softmax": Verdict(False, 0.87, _CPU_RECHECK),
        "fusion_attention": Verdict(False, None, _NO_CPU_ATTN),
    },
    dev.NPU: {
        "rms_norm": Verdict(True, None, _NPU_OWED + " (npu_rms_norm)"),
        "residual_add+layer_norm": Verdict(True, None, _NPU_OWED + " (npu_add_layer_norm)"),
        "swiglu": Verdict(True, None, _NPU_OWED + " (npu_swiglu)"),
        "softmax": Verdict(True, None, _NPU_OWED + " (npu_scaled_masked_softmax)"),
        "scale_causal_softmax": Verdict(True, None, _NPU_OWED + " (npu_scaled_masked_softmax)"),
        "fusion_attention": Verdict(True, None, _NPU_OWED + " (npu_fusion_attention)"),
        "layer_norm": Verdict(False, None, _NO_NPU_KERNEL),
        "gelu[none]": Verdict(False, None, _NO_NPU_KERNEL),
        "gelu[tanh]": Verdict(False, None, _NO_NPU_KERNEL),
        "linear+bias_gelu": Verdict(False, None, _NO_NPU_KERNEL),
    },
}


def verdict(device_type: str, pattern: str) -> Verdict:
    """The verdict for one pattern; device types without a table (CUDA, ...) rewrite nothing."""
    table = MEASURED.get(device_type)
    if table is None:
        return Verdict(False, None, _NO_CPU_ATTN if pattern == "fusion_attention" else _CUDA)
    return table.get(pattern, Verdict(False, None, "no measurement for this pattern on this device"))


def default_patterns(device_type: str) -> frozenset[str]:
    return frozenset(p for p in PATTERNS if verdict(device_type, p).rewrite)


def check_patterns(patterns) -> frozenset[str]:
    if isinstance(patterns, str):
        patterns = PATTERNS if patterns == "all" else (patterns,)
    chosen = frozenset(patterns)
    unknown = sorted(chosen - set(PATTERNS))
    if unknown:
        raise ValueError(f"`patterns` has unknown names {unknown}; choose from {list(PATTERNS)} or pass 'all'.")
    return chosen
