"""The guards' view of a step's statistics: the same numbers the strategy clips and logs.

Under ``npu_hybrid`` the optimizer wrapper (`lightning_npu.parallel.optim.mixed_precision.MixedPrecisionOptimizer`)
computes the step's gradient statistics once and shares them; under any other strategy (plain DDP, FSDP, ...)
they come from the same function,
`lightning_npu.parallel.optim.grad_norm.gradient_statistics`, which counts tp shards, FSDP/ZeRO slices and
pipeline stages once.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from lightning_npu.parallel.optim import grad_norm as gn
from lightning_npu.parallel.optim.mixed_precision import MixedPrecisionOptimizer, stepped_params, unwrap_optimizer


def _pp_group(pl_module: Any) -> Any:
    return gn.pipeline_group(getattr(pl_module, "_device_mesh", None))


def gradient_statistics(trainer: Any, pl_module: Any, optimizer: Any) -> torch.Tensor:
    """fp32 ``[global grad norm, element variance]`` of the unscaled gradients `optimizer` steps. Collective."""
    wrapper = unwrap_optimizer(optimizer)
    if isinstance(wrapper, MixedPrecisionOptimizer):
        return wrapper.gradient_statistics()
    return gn.gradient_statistics(stepped_params(optimizer), _pp_group(pl_module))


def params_norm_and_delta(pl_module: Any, params: Sequence[torch.Tensor], before: Sequence[torch.Tensor]) -> tuple[float, float]:
    """(|w_before|, |w_after - w_before|), global over shards and pipeline stages. Collective."""
    group = _pp_group(pl_module)
    w = gn.global_norm(params, list(before), group)
    d = gn.global_norm(params, [p.detach() - b for p, b in zip(params, before)], group)
    return tuple(torch.stack([w, d]).tolist())  # type: ignore[return-value]
