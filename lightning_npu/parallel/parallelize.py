"""Apply a layout to a model, in one order; and the path of one training step.

A training step under ``npu_hybrid``, one call each (the strategy's Lightning hooks only route to these):

1. batch: `sampler.ResumableDistributedSampler` gives each dp rank its part of the global batch
   (tp and pp peers read the same one);
2. forward: `LightningModule.training_step` inside `HybridPrecision.forward_context` (autocast, fp32 norms
   and softmax), or `pipeline.PipelineRunner.train_step`, which also runs backward;
   without a DDP wrapper, `buffers.BufferBroadcast` first gives every dp rank dp-rank 0's buffers, as DDP
   does; a LightningModule that holds parameters itself under ZeRO 2/3 is an FSDP root: the step runs
   through its forward hooks;
3. loss: `F.cross_entropy` on vocab-sharded logits runs as `tensor.vocab_parallel_cross_entropy`;
4. backward: `HybridPrecision.backward` of loss x scale (the schedule's, under pp);
5. gradient sync: `Parallelized.grad_sync.finish()`; every bucket goes through `grad_sync.reduce_bucket`;
6. clip: `optimizer.MixedPrecisionOptimizer.clip_grad_norm_` (HybridPrecision calls it after
   `prepare_grads`: unscale, all-rank overflow check): the global norm of `grad_norm.gradient_statistics`,
   computed once per step (the guards and the logged ``grad_norm`` read it too);
7. step: `MixedPrecisionOptimizer.step`, the user's optimizer on the fp32 masters, then the model's parameters
   refreshed from them (ZeRO-1: `DistributedOptimizer`, its subclass, steps the dp slices and all-gathers);
8. checkpoint: `checkpoint` writes DCP shards and commits them once, atomically.

`parallelize` applies, in this order: fused ops, branch layouts (each branch sharded at its own tp size, which the
top-level plan then skips), tensor parallelism, activation checkpointing, the
pipeline split, data parallelism. Tensor parallelism rewrites parameters into DTensors and needs the
whole model; activation checkpointing then wraps blocks whose parameters are already sharded (as
torchtitan orders them); the split keeps this rank's stages; data parallelism wraps only what this rank
holds (FSDP2 per stage module, gradient buckets over the stage's parameters).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_npu.ops import rewrite_modules
from lightning_npu.parallel.branch import apply as branch
from lightning_npu.parallel.config import ParallelConfig
from lightning_npu.parallel.data_parallel import sync as gs
from lightning_npu.parallel.data_parallel import wrap as data_parallel
from lightning_npu.parallel.data_parallel.buffers import buffer_broadcast
from lightning_npu.parallel.data_parallel.compression import Compressor
from lightning_npu.parallel.data_parallel.compression_spec import parse_compression
from lightning_npu.parallel.errors import ParallelConfigError
from lightning_npu.parallel.expert_parallel import dispatch as ep
from lightning_npu.parallel.mesh import replica_mesh
from lightning_npu.parallel.pipeline_parallel.runner import PipelineRunner
from lightning_npu.parallel.recompute import AutoRecompute, apply_activation_checkpointing
from lightning_npu.parallel.state import module_state
from lightning_npu.parallel.tensor_parallel import plan as tp
from lightning_npu.parallel.tensor_parallel import shards as tp_shards


def split_layout(cfg: ParallelConfig, branches: bool) -> str:
    """How a layout changes the module itself (sharded or removed layers), or "" where it does not: ZeRO and
    context parallelism leave a module that another strategy can take up again."""
    sizes = [f"{name}={getattr(cfg, name)}" for name in
             ("tensor_parallel_size", "pipeline_parallel_size", "expert_parallel_size") if getattr(cfg, name) > 1]
    return ", ".join(sizes + (["branch_layouts"] if branches else []))


def mark_split(model: nn.Module, owner: str, how: str) -> None:
    if how:
        module_state(model).split_by = (owner, how)


def check_not_split_elsewhere(model: nn.Module, owner: str) -> None:
    """A module an earlier fit split (a new Trainer fitting, validating or testing it) holds that fit's shards and
    stages: splitting it again fails deep inside DTensor or the pipeline. Refused before any process group."""
    state = module_state(model, create=False)
    if state is None or state.split_by is None or state.split_by[0] == owner:
        return
    raise ParallelConfigError(
        f"this {type(model).__name__} was already split by an earlier fit's NPUHybridStrategy ({state.split_by[1]}): "
        "its layers hold that fit's shards and stages, which another strategy cannot split again. Use the Trainer "
        "that trained it, or give a fresh instance the trained weights: on every rank, "
        "`state = lightning_npu.full_state_dict(model)` (full tensors, the original names), then "
        "`new_model = MyModule(...); new_model.load_state_dict(state)` and fit/validate/test `new_model` (or resume "
        "a fresh instance from the checkpoint with `ckpt_path=`).")


@dataclass
class Parallelized:
    """What `parallelize` made: the module Lightning keeps, this rank's pipeline, the gradient sync."""

    model: nn.Module  # a DDP wrapper under zero 0/1 at pp = 1 with more than one replica, else the LightningModule
    pipeline: Any = None  # pipeline.PipelineRunner when pp > 1
    grad_sync: gs.GradientSync = field(default_factory=gs.GradientSync)
    fusion_report: Any = None
    recompute_report: Any = None  # recompute.RecomputeReport when activation_checkpointing is set
    auto_recompute: Any = None  # recompute.AutoRecompute under activation_checkpointing="auto"
    buffer_sync: Any = None  # buffers.BufferBroadcast where no DDP wrapper keeps buffers in step over dp


def parallelize(
    model: nn.Module,
    mesh: DeviceMesh,
    cfg: ParallelConfig,
    *,
    tp_plan: Any,
    pipeline_plan: Any,
    precision: Any,
    device: torch.device,
    device_ids: Optional[list[int]],
    ddp_kwargs: dict[str, Any],
    pipeline: Any = None,
    hierarchy: Any = None,
    branches: Optional[list] = None,
) -> Parallelized:
    """Shard `model` (the LightningModule, in place) over `mesh` as `cfg` says. Collective.

    `pipeline`: this model's stages when an earlier validate/test already split it (kept as they are).
    `hierarchy`: the dp group's `hierarchical.HierarchicalAllReduce` (zero 0 all-reduce buckets), or None.
    `branches`: ``(module name, BranchLayout, its tp plan)`` of `branch_layouts` (the tp plan already skips them).
    """
    fusion_report = apply_fused_ops(model, device, cfg.fuse_ops) if cfg.fuse_ops else None
    zero23 = cfg.zero_stage in (2, 3)
    branch_names = branch.apply_branches(model, mesh, branches) if branches else []
    tp_names = sorted(set(apply_tp(model, mesh, tp_plan, localize=not zero23)) | set(branch_names))
    recompute_report = apply_ac(model, cfg.activation_checkpointing)
    self_reduced: list[str] = []  # ZeRO-2/3 branches: FSDP2 reduces them over dp x branch dp (DDP skips them)
    if branches:
        branch.shard_branches(model, data_parallel.fsdp_param_dtype(precision))
        self_reduced = branch.fully_sharded_names(model)
    expert_names = apply_ep(model, mesh, cfg, precision)
    if pipeline is None and cfg.pipeline_parallel_size > 1:
        pipeline = apply_pp(model, mesh, cfg, pipeline_plan, device)
    wrapped, sync = apply_dp(model, pipeline, mesh, cfg, precision, tp_names, device_ids, ddp_kwargs, hierarchy,
                             expert_names, self_reduced)
    if expert_names and not zero23 and not cfg.uses_distributed_optimizer:
        # FSDP2's expert units (`apply_ep`) and ZeRO-1's edp buckets (`DistributedOptimizer`) reduce their own
        held = dict(model.named_parameters())  # under pp: this rank's stages' experts
        sync = ep.ExpertGradientSync(sync, [held[n] for n in expert_names if n in held],
                                     module_state(model).expert_mesh, cfg.resolved_dp)
    if branches:
        sync = apply_branch_sync(model, sync, cfg)
    buffer_sync = buffer_broadcast(model, mesh, uses_ddp=wrapped is not model)
    auto = None
    if cfg.activation_checkpointing == "auto":
        auto = AutoRecompute(model, cfg.memory_budget_gb * 1e9 if cfg.memory_budget_gb else None)
    return Parallelized(wrapped, pipeline, sync, fusion_report, recompute_report, auto, buffer_sync)


def apply_fused_ops(model: nn.Module, device: torch.device, cfg_fuse: Any = True) -> Any:
    patterns = None if cfg_fuse is True else cfg_fuse  # True: the device's measured table
    return rewrite_modules(model, device=device, patterns=patterns)


def apply_tp(model: nn.Module, mesh: DeviceMesh, plan: Any, localize: bool) -> list[str]:
    """Shard over ``mesh["tp"]``; returns the names of the tp-sharded parameters.

    ``localize`` (zero 0/1): the parameters are stored as plain local shards (`tp_shards` says why); under
    zero 2/3 they stay DTensors, which FSDP2 makes 2-D ``(dp, tp)``.
    """
    model.__dict__.pop("_ddp_params_and_buffers_to_ignore", None)
    if plan is None or not plan.styles:
        return []
    if not plan.applied:
        tp.apply_tensor_parallel(model, mesh["tp"], plan)
        fused = tp_shards.fused_parameters(model)  # read from the DTensor parameters, before localizing or FSDP2
        if localize:
            tp_shards.localize_parameters(model, skip=branch.dtensor_modules(model))
        tp_shards.set_fused_layout(model, {**tp_shards.fused_layout(model), **fused})  # (with the branches')
    return tp_shards.tensor_parallel_parameter_names(model)


def apply_branch_sync(model: nn.Module, sync: gs.GradientSync, cfg: ParallelConfig) -> gs.GradientSync:
    """Each branch's gradients summed over its branch dp (`branch.apply.BranchGradientSync`): from each parameter's
    hook under ZeRO-1 at dp > 1 (before the optimizer's reduce-scatter, whose hooks come later), else after `sync`."""
    groups = branch.branch_parameters(model)
    fsdp = branch.fully_sharded_units(model)
    specs = [s.layout.compression for s, _ in groups if s.layout.compression is not None] + [
        s.layout.compression for _, _, s in branch.applied_branches(model)
        if branch.fully_sharded(s.layout) and s.layout.compression is not None]
    if not groups and not specs and (not fsdp or cfg.zero_stage in (2, 3)):  # the top level's FSDP2 sync covers them
        return sync
    compressor = None
    if specs and sync.compressor is None:
        compressor = Compressor(specs[0])
        compressor.resolve(model.named_parameters())
        # its state (residuals) belongs to the bdp group (checkpoints), or to fdp under a branch's ZeRO 2/3
        compressor.world = groups[0][0].bdp if groups else next(  # (the last group it sums over in a step)
            s.mesh["outer"].size() * s.bdp for _, _, s in branch.applied_branches(model) if s.layout.compression)
    if specs:  # a branch's frozen_variance binds the optimizers (1-bit Adam), whichever compressor sums it
        (compressor or sync.compressor).also = specs
    branch.compress_fully_sharded(model, compressor or sync.compressor)
    return branch.BranchGradientSync(sync, groups, compressor, from_hooks=cfg.uses_distributed_optimizer,
                                     fsdp_units=[] if cfg.zero_stage in (2, 3) else fsdp)


def apply_ac(model: nn.Module, policy: Any) -> Any:
    """Recompute blocks' activations in backward (`recompute`); hooks only, so names and the module tree stay."""
    if policy is None:
        return None
    return apply_activation_checkpointing(model, policy)


def apply_pp(model: nn.Module, mesh: DeviceMesh, cfg: ParallelConfig, plan: Any, device: torch.device) -> Any:
    """Keep only this rank's stages of `model` (in place) and build their schedules."""
    # the whole model's parameter order: a single-file optimizer state indexes the stages' parameters by it, as a
    # one-process run does (interleaved stages would otherwise come rank by rank)
    module_state(model).parameter_order = {n: i for i, (n, _) in enumerate(model.named_parameters(remove_duplicate=False))}
    runner = PipelineRunner(model, plan, mesh["pp"], device, cfg.pipeline_schedule,
                            cfg.micro_batches or cfg.pipeline_parallel_size, mesh=mesh)
    # Lightning broadcasts rank 0's parameters before validate/test: pipeline stages hold different modules
    model._ddp_params_and_buffers_to_ignore = [n for n, _ in model.named_parameters()] + [
        n for n, _ in model.named_buffers()]
    return runner


def apply_ep(model: nn.Module, mesh: DeviceMesh, cfg: ParallelConfig, precision: Any) -> list[str]:
    """Keep this rank's experts of each MoE layer (`expert_parallel.dispatch`), before the pipeline split (every
    rank sees every layer, so a stage without MoE layers is no error); under ZeRO 2/3 each experts module becomes
    its own FSDP2 unit over the ranks holding the same experts. The expert parameters' names."""
    if cfg.expert_parallel_size == 1:
        return []
    zero23 = cfg.zero_stage in (2, 3)
    state = module_state(model)
    if state.expert_mesh is None:
        ep.apply_expert_parallel(model, mesh, cfg.expert_parallel_size, as_dtensors=zero23)
        if zero23:
            data_parallel.fully_shard_experts(ep.sharded_experts(model), state.expert_mesh["edp"], cfg.zero_stage,
                                              data_parallel.fsdp_param_dtype(precision), cfg.resolved_dp)
    return ep.expert_parameter_names(model)


def apply_dp(model: nn.Module, pipeline: Any, mesh: DeviceMesh, cfg: ParallelConfig, precision: Any,
             tp_names: list[str], device_ids: Optional[list[int]],
             ddp_kwargs: dict[str, Any], hierarchy: Any = None,
             expert_names: Optional[list[str]] = None,
             self_reduced: Optional[list[str]] = None) -> tuple[nn.Module, gs.GradientSync]:
    """Data parallelism over ``mesh["dp"]``; returns the module Lightning keeps and the layout's gradient sync.
    `self_reduced`: names of parameters whose own FSDP2 units reduce them (ZeRO-2/3 branches): DDP skips them."""
    dp_mesh = replica_mesh(mesh)  # dp, or dp x cp under context parallelism
    # reduced elsewhere, different on each rank: each rank's own experts (`ExpertGradientSync`), FSDP2 branches
    own = list(expert_names or ()) + list(self_reduced or ())
    if cfg.zero_stage in (2, 3):
        param_dtype = data_parallel.fsdp_param_dtype(precision)
        if pipeline is not None:
            # FSDP2 on each stage module, before any PipelineStage exists (torchtitan's order)
            pipeline.fully_shard(dp_mesh, cfg.zero_stage, param_dtype)
        else:
            data_parallel.fully_shard_data_parallel(model, mesh, cfg.zero_stage, param_dtype)
            # Lightning broadcasts rank 0's parameters before validate/test (non-fitting setup): never the shards
            model._ddp_params_and_buffers_to_ignore = [name for name, _ in model.named_parameters()]
            scalars = data_parallel.scalar_parameters(model)  # left out of FSDP2: all-reduced as under DDP
            if scalars:
                replicated = gs.GradientBuckets(scalars, dp_mesh, cfg.bucket_size_mb, shard=False, overlap=False)
                return model, gs.FullyShardedGradientSync(model, replicated)
        return model, gs.FullyShardedGradientSync(model if pipeline is None else None)
    parsed = parse_compression(cfg.gradient_compression)
    compressor = None if parsed is None else Compressor(parsed)  # every dp bucket reduction goes through it
    if compressor is not None:
        resolve_compression(compressor, model, cfg)
    if cfg.uses_distributed_optimizer:
        # the DistributedOptimizer's buckets reduce-scatter the gradients (bound in setup_optimizers)
        if pipeline is None:
            # start from dp-rank 0's weights, as DDP would (each ep rank keeps its own experts, each rank of a ZeRO-2/3
            # branch its own FSDP2 shards)
            data_parallel.broadcast_module_states(model, mesh, ignore=set(own))
            model._ddp_params_and_buffers_to_ignore = list(tp_names) + own
        return model, gs.DistributedOptimizerSync(compressor)
    if pipeline is not None:
        if cfg.replicas == 1:
            return model, gs.GradientSync()
        experts = {id(p) for n, p in model.named_parameters() if n in set(expert_names or ())}
        stage_params = [p for p in pipeline.stage_parameters() if id(p) not in experts]  # `ExpertGradientSync`'s
        # the schedule runs backward per micro-batch, so no hooks: each stage's buckets reduce after its last
        # micro-batch backward; fp32 gradients accumulate in the buckets' buffers, all-reduced in place (no copy)
        buckets = gs.GradientBuckets(stage_params, dp_mesh, cfg.bucket_size_mb, shard=False, overlap=False,
                                     compressor=compressor, hierarchy=hierarchy, inplace=compressor is None)
        pipeline.grad_listeners = [buckets.params_ready]
        pipeline.grad_buffers = [buckets]
        return model, gs.BucketedGradientSync(buckets)
    if cfg.replicas == 1 and compressor is None:
        # one replica: nothing to reduce, so no DDP wrapper, which would refuse what one device allows (a fully
        # frozen model, parameters unused in forward) and tie the module to a process group (torch.save(model))
        model._ddp_params_and_buffers_to_ignore = list(tp_names) + own
        return model, gs.GradientSync()
    if own:  # not averaged over dp by DDP
        model._ddp_params_and_buffers_to_ignore = own
    wrapped = data_parallel.wrap_data_parallel(model, mesh, device_ids, cfg.bucket_size_mb, ddp_kwargs)
    if tp_names or own:
        # DDP has taken every parameter (tp shards are averaged over dp too); from now on Lightning's whole-world
        # state broadcast (before validate/test) must skip the tp shards and experts, which differ between ranks
        model._ddp_params_and_buffers_to_ignore = list(tp_names) + own
    return wrapped, gs.DDPGradientSync(wrapped, fp32=getattr(precision, "fp32_reduce", True), compressor=compressor,
                                      hierarchy=hierarchy)


def resolve_compression(compressor: Any, model: nn.Module, cfg: ParallelConfig) -> None:
    """Give each parameter its compression spec from its name in the LightningModule (`model`: tp, the pipeline
    split and activation checkpointing keep names; DDP's ``module.`` prefix is not in them). With globs, one that
    matches no parameter on any rank (the pipeline's stages together) is an error. Collective (with globs)."""
    import torch.distributed as dist

    matched = compressor.resolve(model.named_parameters())
    if not compressor.per_module:
        return
    if dist.is_initialized():
        everywhere: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everywhere, sorted(matched))
        matched = {g for m in everywhere for g in m}
    unmatched = [g for g in compressor.spec if g not in matched]
    if unmatched:
        raise ParallelConfigError(
            f"`gradient_compression[{unmatched[0]!r}]` matches no parameter of {type(model).__name__}: a glob matches "
            "a parameter's module name (e.g. 'text.encoder.*') or its full name (e.g. '*.bias'), as "
            f"`named_parameters()` of the LightningModule gives them; fix or remove it ({cfg.gradient_compression!r}).")
