"""Pipeline parallelism over the mesh's ``pp`` dimension, with ``torch.distributed.pipelining``.

The LightningModule contract (small on purpose; the same module runs unchanged with P=1):

1. **A loss on the last stage's output.** Define ``pipeline_loss(self, output, target) -> Tensor``
   (mean over the micro-batch): the last stage calls it once per micro-batch with its output
   (e.g. the logits) and that micro-batch's targets. GPT: ``F.cross_entropy(logits.flatten(0, 1), targets.flatten())``.
2. **A forward shaped like a decoder**: ``hidden = <embedding>(inputs)``; ``for block in <ModuleList>:
   hidden = block(hidden)``; ``output = head(...norm(hidden))``. Found automatically:

   * the *blocks* are the ``nn.ModuleList`` holding the most parameters (GPT's ``transformer.h``,
     Llama's ``model.layers``); each block takes and returns one hidden-state tensor;
   * stage 0 holds every module with parameters registered *before* the blocks (``wte``, ``wpe``) and
     computes the blocks' input by running the module's own ``forward(inputs)`` until block 0 is
     called (so position embeddings, dropout, scaling... are whatever the forward does);
   * the last stage holds the modules with parameters registered *after* the blocks and applies them
     in registration order (``ln_f`` then ``lm_head``; Llama's ``norm`` then ``lm_head``), then the loss.
3. **Batches** are ``(inputs, targets, ...)``: stage 0 gets ``batch[0]``, the loss gets ``batch[1]``.

Unusual models declare a ``pipeline_layout`` (class attribute or method returning a dict or
:class:`PipelineLayout`) naming ``blocks``/``embed``/``head`` by qualified name, an ``embed_fn``, a
``batch_fn``, the ``balance`` (``"count"`` or ``"params"``), an explicit ``split`` (blocks per stage),
``virtual_stages`` (stages per rank for ``interleaved_1f1b``, default 2) or ``log_names``.

Lightning integration (see ``NPUHybridStrategy``): under P > 1 the strategy, not the module's
``training_step``, runs a training step: the schedule does forward *and* backward of every
micro-batch, data-parallel gradients are averaged over ``dp``, and the strategy logs the last stage's
loss (mean over micro-batches, broadcast to every pp rank) with ``self.log(log_names["train"], loss,
prog_bar=True, sync_dist=True)`` (define ``on_pipeline_loss(kind, loss, batch, batch_idx)`` to log
differently). Validation/test run the pipeline forward-only and log ``val_loss``/``test_loss`` the same
way; predict returns the last stage's output on the last stage (``None`` on the others).

Physically each rank keeps only its stages' modules: the others are replaced in the LightningModule by
parameterless placeholders, so ``parameters()``/``state_dict()`` of a rank are those of its stages under
their original names (checkpoints are per stage and reshard by name), and ``configure_optimizers``
sees only local parameters. Gradients are plain tensors owned by exactly one stage: a global gradient
norm is the per-stage sum of squares all-reduced over the ``pp`` group.

ZeRO 2/3 (``zero_stage`` 2 or 3) compose as in torchtitan: stage modules, then FSDP2 over ``dp`` on each
stage module (`PipelineRunner.fully_shard`, which calls `lightning_npu.parallel.data_parallel.wrap.fully_shard_pipeline_stage`),
then the `PipelineStage`s, so that torch's stage finds FSDP roots. Tensor parallelism, per module, is applied to
the whole model before the split and its parameters stay DTensors on ``mesh["tp"]``; FSDP2 over ``mesh["dp"]`` (a
sibling dimension of the same mesh) then makes them 2-D ``(dp, tp)`` DTensors, as without a pipeline (torchtitan's
order: tp, pp split, FSDP, PipelineStage). Under 16-bit gathering, sequence-parallel norms become their own fp32
FSDP units first, as without a pipeline, so that their tp gradient reduction stays fp32. Parameters, their
gradients and the optimizer state are dp-sharded DTensors of this rank's stages; torch's pipelining
stage drives FSDP so that a schedule step reduce-scatters once, after its last micro-batch's backward
(replacing the dp all-reduce of ZeRO 0/1). On Lightning's accumulating micro-steps
(``accumulate_grad_batches``) that reduce-scatter is skipped too (`_Stage.perform_reduce_grad`): the
unsharded gradients stay with FSDP until the stepping micro-step. Checkpoint keys are unchanged (the
original FQNs, DTensor values), so DCP reshards across pp, dp, tp and zero stages (each stage reads only its own
keys; fused q|k|v projections saved under another tp size go through `checkpoint.load_sharded_relayout`).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from lightning_npu.parallel.data_parallel.wrap import (
    finish_backward_without_reduce,
    fully_shard_pipeline_stage,
    fully_shard_sequence_parallel_norms,
)
from lightning_npu.parallel.errors import ParallelConfigError
from lightning_npu.parallel.pipeline_parallel.plan import PipelineLayoutError, PipelinePlan


# ---- splitting the module ------------------------------------------------------------------------
class AbsentModule(nn.Module):
    """Placeholder for a module that lives on another pipeline stage (holds no parameters)."""

    def __init__(self, name: str, stage: int) -> None:
        super().__init__()
        self.name, self.stage = name, stage

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(
            f"`{self.name}` lives on pipeline stage {self.stage}, not on this rank; under pipeline parallelism the "
            "model runs through the strategy's pipeline schedule, not by calling it directly."
        )

    def extra_repr(self) -> str:
        return f"{self.name!r} on pipeline stage {self.stage}"


def _replace(root: nn.Module, fqn: str, new: nn.Module) -> None:
    parent_name, _, name = fqn.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    if isinstance(parent, (nn.ModuleList, nn.Sequential)) and name.isdigit():
        parent[int(name)] = new
    else:
        setattr(parent, name, new)


class _Captured(Exception):
    def __init__(self, hidden: torch.Tensor) -> None:
        super().__init__("pipeline stage 0 captured the blocks' input")
        self.hidden = hidden


class StageModule(nn.Module):
    """One pipeline stage: (stage 0) the embedding part of the forward, its blocks, (last) the head chain."""

    def __init__(self, runner: "PipelineRunner", stage: int, blocks: list[nn.Module],
                 embed: list[nn.Module], head: list[nn.Module]) -> None:
        super().__init__()
        self.stage = stage
        self.is_first = stage == 0
        self.is_last = stage == runner.plan.num_stages - 1
        self.blocks = nn.ModuleList(blocks)
        self.embed = nn.ModuleList(embed)  # registered so that the stage's parameters() include them
        self.head = nn.ModuleList(head)
        self._runner = [runner]  # not a submodule

    def forward(self, x: Any) -> torch.Tensor:
        if self.is_first:
            x = self._runner[0].embed(x)
        for block in self.blocks:
            x = block(x)
        for module in self.head:
            x = module(x)
        return x


@functools.cache
def _stage_class() -> type:
    """`PipelineStage` that skips FSDP2's gradient reduce-scatter while Lightning accumulates gradients.

    torch's stage reduce-scatters an FSDP stage's gradients at the end of *every* schedule step; one
    schedule step is one Lightning micro-step, so under ``accumulate_grad_batches`` that would
    communicate on each of them. The runner's ``sync_grads`` (False inside the strategy's
    `block_backward_sync`) decides instead. (No gradient scaling to skip: the runner's schedules are built
    with ``scale_grads=False``.)

    After a stage's last micro-batch backward its gradients are final: `PipelineRunner.stage_gradients_ready` lets
    ZeRO 0/1's dp buckets start reducing them while the schedule runs the other stages' backwards.
    """
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.pipelining import PipelineStage

    class _Stage(PipelineStage):
        def __init__(self, *args: Any, runner: "PipelineRunner", **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._runner = runner

        # the schedule runs inside the precision plugin's forward context; backward leaves autocast, as a
        # non-pipelined backward does (its ops take the dtypes the forward saved)
        def backward_one_chunk(self, bwd_chunk_id: int, loss: Any = None, full_backward: bool = True,
                               last_backward: bool = False) -> None:
            with torch.autocast(self.device.type, enabled=False):
                super().backward_one_chunk(bwd_chunk_id, loss=loss, full_backward=full_backward,
                                           last_backward=last_backward)
            if last_backward and full_backward:
                self._runner.stage_gradients_ready(self.submod)

        def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward: bool = False) -> None:
            with torch.autocast(self.device.type, enabled=False):
                super().backward_weight_one_chunk(bwd_chunk_id, last_backward=last_backward)
            if last_backward:
                self._runner.stage_gradients_ready(self.submod)

        def perform_reduce_grad(self, grad_scale_factor: int) -> None:
            if self._runner.sync_grads or not isinstance(self.submod, FSDPModule):
                return super().perform_reduce_grad(grad_scale_factor)
            finish_backward_without_reduce(self.submod)

    return _Stage


# ---- running ------------------------------------------------------------------------------------
class PipelineRunner:
    """Owns this rank's stages and the schedules; `step(kind, batch)` runs one pipelined step."""

    def __init__(self, module: nn.Module, plan: PipelinePlan, pp_mesh: Any, device: torch.device,
                 schedule: str, micro_batches: int) -> None:
        self.module = module
        self.plan = plan
        self.layout = plan.layout
        self.schedule_name = schedule
        self.micro_batches = micro_batches
        self.device = device
        self.group = pp_mesh.get_group()
        self.pp_rank = pp_mesh.get_local_rank()
        self.local_stages = plan.stages_of(self.pp_rank)
        self.has_first = 0 in self.local_stages
        self.has_last = plan.num_stages - 1 in self.local_stages
        self.last_rank = dist.get_global_rank(self.group, (plan.num_stages - 1) % plan.pp_size)
        self._blocks_list = module.get_submodule(plan.blocks)
        self._first_block = self._blocks_list[0]
        self.stage_modules = self._split()
        self._schedules: dict[tuple, Any] = {}
        self._unscaled: dict[int, torch.Tensor] = {}
        self.loss_factor = 1.0
        self._pending_grads: Optional[list[Optional[torch.Tensor]]] = None
        # ZeRO 2/3: FSDP2 on the stage modules (`fully_shard`); False while Lightning accumulates gradients
        self.fully_sharded = False
        self.sync_grads = True
        self._sharded_params: Optional[list[torch.Tensor]] = None
        # ZeRO 0/1: called with a stage's parameters once its last backward is done (`GradientBuckets.params_ready`)
        self.grad_listeners: list[Callable[[list[torch.Tensor]], None]] = []
        self._overlap = False

    # -- split ------------------------------------------------------------------------------------
    def _split(self) -> list[StageModule]:
        plan, module = self.plan, self.module
        local = set()
        for s in self.local_stages:
            local.update(plan.modules_of_stage(s))
        stage_of: dict[str, int] = {}
        for s in range(plan.num_stages):
            for name in plan.modules_of_stage(s):
                stage_of[name] = s
        stages = []
        for s in self.local_stages:
            blocks = [self._blocks_list[i] for i in plan.stage_blocks[s]]
            embed = [module.get_submodule(f) for f in plan.embed] if s == 0 else []
            head = [module.get_submodule(f) for f in plan.head] if s == plan.num_stages - 1 else []
            stages.append(StageModule(self, s, blocks, embed, head))
        for name, s in stage_of.items():
            if name not in local:
                _replace(module, name, AbsentModule(name, s))
        return stages

    def fully_shard(self, dp_mesh: Any, zero_stage: int, param_dtype: Optional[torch.dtype] = None) -> None:
        """ZeRO 2/3: FSDP2 over `dp_mesh` on each local stage module, before any schedule (PipelineStage) exists."""
        if self.fully_sharded:
            return
        if self._schedules:
            raise RuntimeError("PipelineRunner.fully_shard must run before the first pipeline step.")
        for stage in self.stage_modules:
            if param_dtype not in (None, torch.float32):
                fully_shard_sequence_parallel_norms(stage, dp_mesh)  # before the stage's own units
            fully_shard_pipeline_stage(stage, dp_mesh, zero_stage, param_dtype)
        self.fully_sharded = True
        # the sharded parameters (what the optimizer holds): between a forward that keeps them gathered
        # (ZeRO 2, evaluation) and the next backward, the modules expose FSDP's unsharded tensors instead
        self._sharded_params = None
        self._sharded_params = self.stage_parameters()

    def stage_parameters(self) -> list[torch.Tensor]:
        if self._sharded_params is not None:
            return list(self._sharded_params)
        seen, out = set(), []
        for stage in self.stage_modules:
            for p in stage.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
        return out

    # -- stage 0's embedding ----------------------------------------------------------------------
    def embed(self, inputs: Any) -> torch.Tensor:
        if self.layout.embed_fn is not None:
            return self.layout.embed_fn(inputs)

        def capture(mod: nn.Module, args: tuple, kwargs: dict) -> None:
            if len(args) != 1 or kwargs:
                raise PipelineLayoutError(
                    f"block 0 of `{self.plan.blocks}` is called with {len(args)} positional and {sorted(kwargs)} keyword "
                    "arguments; pipeline stages pass one hidden-state tensor between blocks. Declare pipeline_layout "
                    "'embed_fn' (and blocks that take one tensor) for this model."
                )
            raise _Captured(args[0])

        handle = self._first_block.register_forward_pre_hook(capture, prepend=True, with_kwargs=True)
        try:
            self.module(inputs)
        except _Captured as captured:
            return captured.hidden
        finally:
            handle.remove()
        raise PipelineLayoutError(
            f"{type(self.module).__name__}.forward returned without calling block 0 of `{self.plan.blocks}`; declare "
            "pipeline_layout 'blocks' (the ModuleList the forward loops over) or 'embed_fn'."
        )

    # -- batches ----------------------------------------------------------------------------------
    def split_batch(self, batch: Any) -> tuple[Any, Any]:
        if self.layout.batch_fn is not None:
            return self.layout.batch_fn(batch)
        if isinstance(batch, (tuple, list)) and len(batch) >= 2:
            return batch[0], batch[1]
        raise PipelineLayoutError(
            f"pipeline parallelism expects batches (inputs, targets, ...), got {type(batch).__name__}; declare "
            "pipeline_layout 'batch_fn' returning (inputs, targets)."
        )

    @staticmethod
    def _batch_size(x: Any) -> int:
        t = x if isinstance(x, torch.Tensor) else next(
            (v for v in (x.values() if isinstance(x, dict) else x) if isinstance(v, torch.Tensor)), None)
        if t is None:
            raise PipelineLayoutError("pipeline inputs must be a tensor (or hold one) to split into micro-batches.")
        return t.shape[0]

    def _micro_batches(self, batch_size: int, train: bool) -> int:
        m = self.micro_batches
        if batch_size % m == 0:
            return m
        if train:
            raise ParallelConfigError(
                f"the per-rank batch of {batch_size} samples is not divisible by `micro_batches={m}`; make each "
                f"data-parallel rank's batch size a multiple of {m} (or change micro_batches)."
            )
        # evaluation: the largest micro-batch count <= M that divides the batch (e.g. a last, smaller batch)
        return max(d for d in range(1, min(m, batch_size) + 1) if batch_size % d == 0)

    # -- schedules --------------------------------------------------------------------------------
    def _schedule(self, kind: str, m: int, shape_key: tuple) -> Any:
        from torch.distributed.pipelining import (
            Schedule1F1B,
            ScheduleGPipe,
            ScheduleInterleaved1F1B,
            ScheduleLoopedBFS,
        )

        key = (kind, m, shape_key)
        if key not in self._schedules:
            stage_cls = _stage_class()
            stages = [
                stage_cls(sm, sm.stage, self.plan.num_stages, self.device, group=self.group, runner=self)
                for sm in self.stage_modules
            ]
            loss_fn = {"train": self._train_loss, "eval": self._eval_loss}.get(kind)
            multi = len(stages) > 1
            if kind == "train":
                cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B}[
                    self.schedule_name]
            else:  # forward only
                cls = ScheduleLoopedBFS if multi else ScheduleGPipe
            # scale_grads=False: the loss is divided by M instead, so that gradients Lightning accumulates over
            # several training steps are not divided again by the schedule
            self._schedules[key] = cls(stages if multi else stages[0], m, loss_fn=loss_fn, scale_grads=False)
        return self._schedules[key]

    def _user_loss(self, output: Any, target: Any) -> torch.Tensor:
        return self.module.pipeline_loss(output, target)

    def _train_loss(self, output: Any, target: Any) -> torch.Tensor:
        loss = self._user_loss(output, target)
        scaled = loss * self.loss_factor
        self._unscaled[id(scaled)] = loss.detach()
        return scaled

    def _eval_loss(self, output: Any, target: Any) -> torch.Tensor:
        return self._user_loss(output, target)

    def _broadcast(self, value: Optional[torch.Tensor]) -> torch.Tensor:
        t = value.detach().float().reshape(()).clone() if value is not None else torch.zeros((), device=self.device)
        t = t.to(self.device)
        if self.plan.pp_size > 1:
            dist.broadcast(t, src=self.last_rank, group=self.group)
        return t

    @staticmethod
    def _shape_key(x: Any) -> tuple:
        leaves = [x] if isinstance(x, torch.Tensor) else list(x.values() if isinstance(x, dict) else x)
        return tuple((tuple(t.shape), t.dtype) for t in leaves if isinstance(t, torch.Tensor))

    def stage_gradients_ready(self, stage: nn.Module) -> None:
        """A stage's last micro-batch backward is done: its dp reduction may start (only where `train_step` was
        told that this step's fresh gradients are exactly what gets reduced)."""
        if self._overlap:
            params = list(stage.parameters())
            for listener in self.grad_listeners:
                listener(params)

    def train_step(self, batch: Any, loss_factor: float, sync_grads: bool = True,
                   overlap: bool = False) -> torch.Tensor:
        """Forward and backward of every micro-batch; returns the mean loss (unscaled) on every pp rank.

        The step's gradients are held aside (`.grad` is left as it was) until `apply_gradients()`: Lightning
        zeroes gradients *between* `training_step` and `backward`, and the strategy's `backward` applies them.
        ``sync_grads=False`` (an accumulating micro-step): under ZeRO 2/3 no reduce-scatter; FSDP keeps the
        unsharded gradients and no sharded gradient comes out of this step.
        ``overlap`` (ZeRO 0/1; the caller's promise that the gradients held aside are dropped before they are
        applied, i.e. no accumulated gradient is added to this step's): each stage's dp bucket reductions start
        right after its last micro-batch backward, inside the schedule, instead of after it.
        """
        self.sync_grads = sync_grads
        self._overlap = overlap and sync_grads
        params = self.stage_parameters()
        saved = [p.grad for p in params]
        for p in params:
            p.grad = None
        try:
            loss = self._train_step(batch, loss_factor)
        finally:
            self._overlap = False
            self._pending_grads = [p.grad for p in params]
            for p, g in zip(params, saved):
                p.grad = g
        return loss

    def apply_gradients(self) -> bool:
        """Accumulate the gradients of the last `train_step` into `.grad`; True when the caller must still average
        them over dp (ZeRO 0/1). False when there were none, or under ZeRO 2/3, where FSDP2 reduce-scattered
        (averaged) them over dp inside the schedule already."""
        pending, self._pending_grads = self._pending_grads, None
        if pending is None:
            return False
        for p, g in zip(self.stage_parameters(), pending):
            if g is None:
                continue
            if p.grad is None:
                p.grad = g
            else:
                p.grad.add_(g)
        return not self.fully_sharded

    def _train_step(self, batch: Any, loss_factor: float) -> torch.Tensor:
        inputs, targets = self.split_batch(batch)
        m = self._micro_batches(self._batch_size(inputs), train=True)
        schedule = self._schedule("train", m, self._shape_key(inputs) + self._shape_key(targets))
        self.loss_factor = loss_factor / m
        self._unscaled.clear()
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.has_first else ()
        schedule.step(*args, target=targets if self.has_last else None, losses=losses, return_outputs=False)
        mean = None
        if self.has_last:
            mean = torch.stack([self._unscaled[id(l)].float() for l in losses]).mean()
        self._unscaled.clear()
        return self._broadcast(mean)

    def eval_step(self, batch: Any) -> torch.Tensor:
        inputs, targets = self.split_batch(batch)
        m = self._micro_batches(self._batch_size(inputs), train=False)
        schedule = self._schedule("eval", m, self._shape_key(inputs) + self._shape_key(targets))
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.has_first else ()
        schedule.eval(*args, target=targets if self.has_last else None, losses=losses)
        mean = torch.stack([l.detach().float() for l in losses]).mean() if self.has_last else None
        return self._broadcast(mean)

    def predict_step(self, batch: Any) -> Any:
        inputs = batch[0] if isinstance(batch, (tuple, list)) and self.layout.batch_fn is None else (
            self.split_batch(batch)[0] if self.layout.batch_fn is not None else batch)
        m = self._micro_batches(self._batch_size(inputs), train=False)
        schedule = self._schedule("predict", m, self._shape_key(inputs))
        args = (inputs,) if self.has_first else ()
        out = schedule.step(*args)
        if not self.has_last:
            return None
        # vocab-parallel logits (tensor parallelism) come back as one full tensor (gathered over tp)
        return out.full_tensor() if hasattr(out, "full_tensor") else out


def bubble_fraction(pp_size: int, micro_batches: int, virtual_stages: int = 1) -> float:
    """Idle fraction of a synchronous pipeline step: (P-1) / (V*M + P-1) (V=1: GPipe and 1F1B)."""
    return (pp_size - 1) / (virtual_stages * micro_batches + pp_size - 1)
