"""Data parallelism over the mesh's ``dp`` dimension.

ZeRO 0 keeps parameters, gradients and optimizer state replicated and rides on PyTorch's
DistributedDataParallel (bucketed all-reduce overlapped with backward) restricted to the dp
process group. ZeRO 1 is `lightning_npu.parallel.optim.distributed.DistributedOptimizer`:
Megatron's distributed-optimizer step (reduce-scatter gradients, step the local slice, all-gather
parameters) with no DDP wrapper; the model is only synchronised from dp-rank 0 at setup.

ZeRO 2 and 3 use FSDP2 (`fully_shard`) over the dp mesh: every transformer block (each child
of an ``nn.ModuleList``) becomes one FSDP unit, then every top-level submodule of the
LightningModule, then (only if it holds parameters directly, like ViT's ``cls_token``) the
LightningModule itself, as the root unit of those leftovers. Parameters are stored as dp-sharded
DTensors (the fp32 master shards), gradients are reduce-scattered into dp-sharded DTensors (each
unit's bucket through `sync.reduce_bucket`), and the user's optimizer steps the
local shards. Stage 2 keeps the all-gathered parameters from forward through backward
(``reshard_after_forward=False``, no second all-gather); stage 3 frees them after each unit's
forward and gathers again in backward (``reshard_after_forward=True``). Both reshard after
backward, so between steps a rank holds 1/dp of the parameters in both stages.

With tensor parallelism (tp > 1) the strategy applies the TP plan first and keeps its parameters
as DTensors on ``mesh["tp"]`` (no `localize_parameters`); `fully_shard` over ``mesh["dp"]`` then
turns them into 2-D (dp, tp) DTensors, as torchtitan composes FSDP2 with TP. FSDP2's all-gather
hands each module back its tp-sharded DTensors, so the TP styles' own input/output hooks run
unchanged, and DCP saves and reshards the 2-D shards natively. (FSDP2 over the *localized* plain
shards was rejected: the per-module DTensor-rebuild hooks hold the original parameter objects,
which FSDP2 replaces, and DCP would see the same key with different contents on the two tp ranks.)
Replicated-over-tp parameters (norms, position embeddings) stay plain and are sharded over dp only.

Sequence parallelism makes the norms DTensors replicated over tp (DTensor's ``SequenceParallel``):
they see sequence shards, so their weight gradients are partial sums over tp, which FSDP2
all-reduces before its reduce-scatter, in the dtype it gathered the parameters in. Under bf16
compute that would be a bf16 gradient reduction; those norms therefore become their own FSDP
units gathered in fp32 (a few KiB each), so the reduction stays fp32 as everywhere else.
"""

from __future__ import annotations

import re
import warnings
from typing import Any, Optional

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer

from lightning_npu.parallel.data_parallel.sync import fsdp_modules, fsdp_reduce_scatter
from lightning_npu.parallel.mesh import replica_mesh
from lightning_npu.parallel.optim.mixed_precision import unwrap_optimizer
from lightning_npu.parallel.state import module_state
from lightning_npu.parallel.tensor_parallel.plan import tp_replicated_modules


def wrap_data_parallel(
    module: torch.nn.Module,
    mesh: DeviceMesh,
    device_ids: Optional[list[int]],
    bucket_size_mb: float,
    ddp_kwargs: dict[str, Any],
) -> DistributedDataParallel:
    kwargs = {"bucket_cap_mb": bucket_size_mb, "gradient_as_bucket_view": True, **ddp_kwargs}
    return DistributedDataParallel(module, device_ids=device_ids, process_group=replica_mesh(mesh).get_group(), **kwargs)


def _fsdp_units(module: torch.nn.Module) -> list[torch.nn.Module]:
    """Transformer blocks (children of any ``nn.ModuleList``) that own parameters, innermost first."""
    units = []
    for sub in module.modules():
        if isinstance(sub, torch.nn.ModuleList):
            units.extend(child for child in sub if any(True for _ in child.parameters()))
    return units


def fully_shard_data_parallel(
    module: torch.nn.Module,
    mesh: DeviceMesh,
    zero_stage: int,
    param_dtype: Optional[torch.dtype] = None,
) -> torch.nn.Module:
    """Apply FSDP2 over ``mesh["dp"]`` for ZeRO stage 2 or 3, in place; returns `module`.

    `module` is the LightningModule: its blocks, then each of its direct children that hold parameters, become
    FSDP units; parameters it holds itself become a root unit (FSDP2 makes the LightningModule's class a subclass,
    so Lightning keeps calling its hooks). 0-dim parameters (CLIP's ``logit_scale``), which FSDP2 cannot shard,
    are left out of every unit (`scalar_parameters`): they stay whole on every rank and the strategy all-reduces
    their gradients, as DDP does. With
    `param_dtype` (bf16-mixed compute) parameters are all-gathered in that dtype while the stored
    shards, the optimizer's master copy, stay fp32, and gradients are reduced in fp32.
    """
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    kwargs = _fully_shard_kwargs(module, replica_mesh(mesh), zero_stage, param_dtype, check_scalars=False)
    scalars = set(scalar_parameters(module))
    if scalars:
        kwargs["ignored_params"] = scalars
    if param_dtype not in (None, torch.float32):
        fully_shard_sequence_parallel_norms(module, replica_mesh(mesh))
    for unit in _fsdp_units(module):
        if not isinstance(unit, FSDPModule):
            fully_shard(unit, **kwargs)
    for child in _child_units(module):
        if not isinstance(child, FSDPModule):
            fully_shard(child, **kwargs)
    if any(p not in scalars for p in module.parameters(recurse=False)):
        # What the LightningModule holds itself (ViT's cls_token/pos_embed, a GPT's `pos`) is sharded in a root
        # unit, as FSDP2 does with leftovers. It stays gathered from forward to backward (FSDP2's root default;
        # the step's calls of `forward` would otherwise free it mid-step), and leaves the step's inputs uncast.
        # The strategy runs each step through this root's forward hooks (`is_sharded_root`).
        root_mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32, cast_forward_inputs=False)
        fully_shard(module, mesh=replica_mesh(mesh), reshard_after_forward=False, mp_policy=root_mp,
                    **({"ignored_params": scalars} if scalars else {}))
    route_reduce_scatter(module)
    return module


def route_reduce_scatter(module: torch.nn.Module) -> None:
    """Every FSDP2 unit under `module` reduce-scatters its gradient bucket through `sync.reduce_bucket`."""
    comm = fsdp_reduce_scatter()
    for unit in fsdp_modules(module):
        divisor = getattr(module_state(unit, create=False), "gradient_divisor", None)
        unit.set_custom_reduce_scatter(comm if divisor is None else fsdp_reduce_scatter(divisor))


def fully_shard_experts(experts: list[torch.nn.Module], edp_mesh: DeviceMesh, zero_stage: int,
                        param_dtype: Optional[torch.dtype], dp: int) -> None:
    """Under expert parallelism each experts module is its own FSDP2 unit over the ranks that hold the same experts
    (edp). The all-to-all's backward has already summed an expert's gradient over its ep group, so the unit sums
    over edp and divides by dp: the mean over every dp rank's samples, as for the other parameters."""
    from torch.distributed.fsdp import fully_shard

    kwargs = _fully_shard_kwargs(experts[0], edp_mesh, zero_stage, param_dtype, check_scalars=False)
    for module in experts:
        fully_shard(module, **kwargs)
        module.set_gradient_divide_factor(float(dp))  # FSDP2's own path where edp = 1 (no reduce-scatter runs)
        module_state(module).gradient_divisor = dp


def _child_units(module: torch.nn.Module) -> list[torch.nn.Module]:
    """Direct children that hold parameters; containers without a forward (``self.blocks = nn.ModuleList(...)``
    on the LightningModule, an ``nn.ModuleDict``) cannot be FSDP units: their children stand in for them."""
    units = []
    for child in module.children():
        if not any(True for _ in child.parameters()):
            continue
        if isinstance(child, (torch.nn.ModuleList, torch.nn.ModuleDict)):
            units.extend(_child_units(child))
        else:
            units.append(child)
    return units


def is_sharded_root(module: torch.nn.Module) -> bool:
    """The LightningModule itself is an FSDP2 unit (it holds parameters directly): its steps must run through
    its forward hooks, which gather those parameters and reduce-scatter their gradients."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def scalar_parameters(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The 0-dim parameters of `module` (CLIP's ``logit_scale``): FSDP2 cannot shard them along dim 0."""
    return [p for p in module.parameters() if p.dim() == 0]


def check_no_scalar_parameters(module: torch.nn.Module, zero_stage: int) -> None:
    """A pipeline stage under ZeRO 2/3 shards every parameter it holds along dim 0 (its FSDP2 units cannot leave
    one out yet); FSDP2's own refusal of a 0-dim parameter names neither the parameter nor the stage: fail first
    with both."""
    scalars = [name for name, p in module.named_parameters() if p.dim() == 0]
    if scalars:
        raise ValueError(
            f"zero_stage={zero_stage} with pipeline parallelism shards every stage parameter along dim 0, but "
            f"{', '.join(scalars[:4])} {'is a 0-dim parameter' if len(scalars) == 1 else 'are 0-dim parameters'}; "
            "use zero_stage=0 or 1 (they keep it whole and all-reduce its gradient), or pipeline_parallel_size=1."
        )


# ---- ZeRO 2/3 under pipeline parallelism (used by lightning_npu.parallel.pipeline_parallel) -------------------
def fully_shard_sequence_parallel_norms(module: torch.nn.Module, dp_mesh: DeviceMesh) -> None:
    """Under 16-bit gathering, sequence-parallel norms become their own FSDP2 units gathered in fp32.

    Their weight gradients are partial sums over tp, which FSDP2 all-reduces in the gathered dtype; their own
    fp32 units keep that reduction fp32 (they compute in fp32 anyway). Kept gathered until backward (a few KiB):
    no second all-gather, and nothing to re-gather if the model modifies a norm output in place
    (``SequenceParallel`` returns a view, which FSDP2 warns about; silenced for these modules only).
    """
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    norms = [m for m in tp_replicated_modules(module) if not isinstance(m, FSDPModule)]
    for norm in norms:
        fully_shard(norm, mesh=dp_mesh, reshard_after_forward=False,
                    mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32))
    if norms:
        names = "|".join(sorted({re.escape(type(n).__name__) for n in norms}))
        warnings.filterwarnings(
            "ignore", message=rf"FSDP2-wrapped module \((?:{names})\) returned a view tensor", category=UserWarning
        )


def _fully_shard_kwargs(module: torch.nn.Module, dp_mesh: DeviceMesh, zero_stage: int,
                        param_dtype: Optional[torch.dtype], check_scalars: bool = True) -> dict[str, Any]:
    """`fully_shard`'s arguments for every unit of a ZeRO-2/3 layout, after checking the module can be sharded."""
    if zero_stage not in (2, 3):
        raise ValueError(f"FSDP2 (fully_shard) is for zero_stage 2 or 3, got {zero_stage}.")
    if check_scalars:
        check_no_scalar_parameters(module, zero_stage)
    return dict(mesh=dp_mesh, reshard_after_forward=zero_stage == 3, mp_policy=_mixed_precision(param_dtype))


def _mixed_precision(param_dtype: Optional[torch.dtype]) -> Any:
    """Gradients are reduce-scattered in fp32 whatever the parameters' dtype (bf16-true's 16-bit shards too)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)


def fsdp_param_dtype(precision_plugin: Any) -> Optional[torch.dtype]:
    """bf16-mixed compute all-gathers bf16 copies of the fp32 master shards; every other precision gathers as stored."""
    return torch.bfloat16 if str(getattr(precision_plugin, "precision", "")) == "bf16-mixed" else None


def fully_shard_pipeline_stage(
    stage: torch.nn.Module,
    dp_mesh: DeviceMesh,
    zero_stage: int,
    param_dtype: Optional[torch.dtype] = None,
) -> torch.nn.Module:
    """FSDP2 over `dp_mesh` on one pipeline stage module (torchtitan's order: tp, then FSDP, then PipelineStage).

    Every module the stage holds in an ``nn.ModuleList`` (its blocks, its embedding and head modules) becomes
    its own FSDP unit, and the stage module itself the parameterless FSDP root. Why: (1) torch's
    `PipelineStage` recognises an FSDP root and then skips the reduce-scatter on all but the last micro-batch's
    backward, reducing once per schedule step; (2) each unit is also a module of the LightningModule, so
    FSDP2's state-dict hooks (which put the sharded parameters back after a forward that left them gathered)
    fire when Lightning and DCP read ``LightningModule.state_dict()``; a root holding parameters would not be
    in that tree. ZeRO 2 keeps the gathered parameters from forward to backward, ZeRO 3 gathers them again
    for each micro-batch's backward (torchtitan's default under PP is the former, to save per-micro-batch
    all-gathers: pick zero_stage=2 for that); both reshard after the step's backward.
    """
    from torch.distributed.fsdp import FSDPModule, fully_shard

    kwargs = _fully_shard_kwargs(stage, dp_mesh, zero_stage, param_dtype)
    units = _fsdp_units(stage)
    in_units = {id(p) for unit in units for p in unit.parameters()}
    loose = [n for n, p in stage.named_parameters() if id(p) not in in_units]
    if loose:
        raise ValueError(
            f"pipeline stage {type(stage).__name__} holds parameters {loose[:4]} outside its module lists; under "
            f"zero_stage={zero_stage} every stage parameter must live in a block, embedding or head module."
        )
    for unit in units:
        if not isinstance(unit, FSDPModule):  # a sequence-parallel norm already made its own fp32 unit (pipeline.py)
            fully_shard(unit, **kwargs)
    fully_shard(stage, **kwargs)
    route_reduce_scatter(stage)
    return stage


def finish_backward_without_reduce(stage: torch.nn.Module) -> None:
    """End a pipeline schedule's backward on an FSDP stage root without gradient communication.

    Used on the accumulating micro-steps of ``accumulate_grad_batches``, in place of what torch's
    `PipelineStage.perform_reduce_grad` does at the end of every schedule step (turn gradient sync back
    on and run each FSDP group's post-backward: a reduce-scatter per unit). Here the post-backward runs
    with sync off, exactly as FSDP2's own no-sync backward: parameters are resharded and the unsharded
    gradients stay with FSDP, to be added in and reduce-scattered by the stepping micro-step.
    (`PipelineStage` reaches into the same FSDP2 state; there is no public API for this yet.)
    """
    from torch.distributed.fsdp import fully_shard

    stage.set_is_last_backward(True)
    stage.set_reshard_after_backward(True)
    stage.set_requires_gradient_sync(False)
    state = fully_shard.state(stage)
    for sub in state._state_ctx.all_states:
        for group in sub._fsdp_param_groups:
            group.post_backward()
    state._root_post_backward_final_callback()
    stage.set_requires_gradient_sync(True)  # FSDP2's default between steps; the schedule sets it per backward


def is_fully_sharded(module: torch.nn.Module) -> bool:
    return bool(fsdp_modules(module))


def broadcast_module_states(module: torch.nn.Module, mesh: DeviceMesh, ignore: Optional[set[str]] = None) -> None:
    """Copy dp-rank 0's parameters and buffers to the other dp ranks (what DDP's constructor does), but those named in
    `ignore` (expert-parallel experts, which differ between dp ranks)."""
    from torch.distributed.utils import _sync_module_states

    group = replica_mesh(mesh).get_group()
    _sync_module_states(module, group, broadcast_bucket_size=250 * 2**20, src=0,
                        params_and_buffers_to_ignore=set(ignore or ()))


def _local_bytes(t: torch.Tensor) -> int:
    local = t.to_local() if hasattr(t, "to_local") else t
    return local.numel() * local.element_size()


def parameter_bytes(module: torch.nn.Module) -> int:
    """Bytes of parameters this rank holds right now (its dp shard under ZeRO 3)."""
    return sum(_local_bytes(p) for p in module.parameters())


def gradient_bytes(module: torch.nn.Module) -> int:
    """Bytes of gradients this rank holds (its dp shard under ZeRO 2/3)."""
    return sum(_local_bytes(p.grad) for p in module.parameters() if p.grad is not None)


def sharded_optimizer_state_bytes(optimizer: Optimizer) -> int:
    """Bytes of optimizer state this rank holds (its ZeRO shard, or everything when unsharded)."""
    inner = unwrap_optimizer(optimizer)
    total = 0
    for state in inner.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                local = value.to_local() if hasattr(value, "to_local") else value
                total += local.numel() * local.element_size()
    return total
