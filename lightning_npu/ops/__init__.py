"""Fused operators and the module-rewrite pass (``NPUHybridStrategy(fuse_ops=True)``).

``rewrite_modules`` is the public entry point; the functions in ``functional`` are usable on
their own. Importing this package compiles nothing: the C++ kernels are built (once, cached)
the first time a CPU op or the rewrite pass needs them.
"""

from lightning_npu.ops.functional import (
    add_layer_norm,
    add_rms_norm,
    bias_dropout_add,
    bias_gelu,
    layer_norm,
    rms_norm,
    scale_mask_softmax,
    swiglu,
)
from lightning_npu.ops.rewrite import FusionReport, rewrite_modules

__all__ = [
    "FusionReport",
    "add_layer_norm",
    "add_rms_norm",
    "bias_dropout_add",
    "bias_gelu",
    "layer_norm",
    "rms_norm",
    "rewrite_modules",
    "scale_mask_softmax",
    "swiglu",
]
