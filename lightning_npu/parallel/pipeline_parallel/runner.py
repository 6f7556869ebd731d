"""Pipeline parallelism over the mesh's ``pp`` dimension, with ``torch.distributed.pipelining``.

The LightningModule contract (small on purpose; the same module runs unchanged with P=1):

1. **A loss on the last stage's output.** ``pipeline_loss(self, output, target) -> Tensor`` (mean over the
   micro-batch), called once per micro-batch with the last stage's output and that micro-batch's targets; without
   it, the cross-entropy of the output's logits (`default_pipeline_loss`).
2. **A forward over a block list**: the *blocks* are the ``nn.ModuleList`` holding the most parameters (GPT's
   ``transformer.h``, a transformers decoder's ``model.layers``). Stage 0 holds the modules with parameters
   registered before the blocks, the last stage those after (`plan.plan_pipeline`). Each stage runs the module's
   own ``forward(inputs)`` for its part (`PipelineRunner.replay`): what the forward computes around the blocks
   (positions, masks, rotary embeddings, the final norm and head) runs as written on every stage from the
   micro-batch's inputs, which every stage receives; other stages' blocks pass through, a later stage's first
   block takes the received hidden state, and a stage before the last returns its last block's output. Blocks may
   take any arguments; only the hidden state travels.
3. **Batches** are ``(inputs, targets, ...)`` or a dict with ``input_ids`` and ``labels``.

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
norm is the per-stage sum of squares all-reduced over the ``pp`` group. The exception, tied input/output
embeddings: the first and the last stage each hold a copy, their gradients are summed between the two
(`_sum_tied_gradients`) and the last stage's copy is marked so that norms count the first stage's only.

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
keys; fused q|k|v projections saved under another tp size are relaid out inside `checkpoint.sharded.load_directory`).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from lightning_npu.parallel.data_parallel.wrap import (
    finish_backward_without_reduce,
    fully_shard_pipeline_stage,
    fully_shard_sequence_parallel_norms,
)
from lightning_npu.parallel.errors import ParallelConfigError
from lightning_npu.parallel.optim.grad_norm import local_tensor
from lightning_npu.parallel.pipeline_parallel.plan import PipelineLayoutError, PipelinePlan
from lightning_npu.parallel.state import tensor_state


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


def _take_received(received: torch.Tensor, started: list[bool], module: nn.Module, args: tuple,
                   kwargs: dict) -> tuple[tuple, dict]:
    started[0] = True
    if args:
        return (received, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": received}


def _capture_output(module: nn.Module, args: Any, output: Any) -> None:
    raise _Captured(_hidden_of(output))


class _Captured(Exception):
    def __init__(self, hidden: torch.Tensor) -> None:
        super().__init__("a pipeline stage captured its blocks' output")
        self.hidden = hidden


def _hidden_of(output: Any) -> torch.Tensor:
    """A block's hidden state: its output, or the first element of the tuple some blocks return (Falcon)."""
    return output[0] if isinstance(output, (tuple, list)) else output


class _OtherStageOutput(torch.Tensor):
    """What a block of another stage returns while a stage replays the forward: its input, read as either block
    convention reads it (the tensor, or ``output[0]`` of a tuple). The first local block's input replaces it."""

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, int) and index == 0:
            return self
        return super().__getitem__(index)


class _OtherStageBlock(nn.Module):
    def forward(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        return hidden_states.detach().as_subclass(_OtherStageOutput)


class _EmbeddingStandIn(nn.Module):
    """An embedding of stage 0 on a later stage's replay: zeros shaped like its output (the input ids' shape and
    the received hidden state's width; under sequence parallelism the received state is a sequence shard), so the
    parent forward derives positions, masks and rotary embeddings from the true batch and length."""

    def __init__(self, fqn: str, received: torch.Tensor, inputs: Any, blocks_started: list[bool]) -> None:
        super().__init__()
        self.fqn, self.blocks_started = fqn, blocks_started
        shape = tuple(received.shape)
        if isinstance(inputs, torch.Tensor) and not inputs.is_floating_point() and inputs.dim() == received.dim() - 1:
            shape = (*inputs.shape, received.shape[-1])
        self.like = [received.new_zeros(shape)]

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.blocks_started[0]:
            raise PipelineLayoutError(
                f"`{self.fqn}` is registered before the pipeline blocks, so it was placed on the first stage, but the "
                f"forward calls it after them; declare it on the last stage: pipeline_layout = {{'head': [..., "
                f"'{self.fqn}', ...]}} (the modules after the blocks, in order).")
        return torch.zeros_like(self.like[0])


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

    def forward(self, x: Any, inputs: Any = None) -> Any:
        runner = self._runner[0]
        if runner.layout.embed_fn is None:
            return runner.replay(self, x, inputs)
        if self.is_first:
            x = runner.layout.embed_fn(x)
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
                 schedule: str, micro_batches: int, mesh: Any = None) -> None:
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
        self.stage_modules = self._split()
        # tied embeddings: the first and the last stage's copies, whose gradients are summed (`_sum_tied_gradients`)
        self._tied_group = _tied_group(mesh if mesh is not None else pp_mesh, plan) if plan.tied else None
        self._mark_tied_copies()
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
        # ZeRO 0/1 on in-place buckets (`GradientBuckets.hold` / `take`): the schedule's gradients land in them
        self.grad_buffers: list[Any] = []
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
        self._mark_tied_copies()  # FSDP2 registered new parameters
        # the sharded parameters (what the optimizer holds): between a forward that keeps them gathered
        # (ZeRO 2, evaluation) and the next backward, the modules expose FSDP's unsharded tensors instead
        self._sharded_params = None
        self._sharded_params = self.stage_parameters()

    def _tied_names(self) -> list[str]:
        """This rank's names of the tied parameters (first stage: the embedding's, last stage: the head's)."""
        if self.has_first:
            return [first for first, _ in self.plan.tied]
        if self.has_last:
            return [last for _, last in self.plan.tied]
        return []

    def _mark_tied_copies(self) -> None:
        if self.has_last and not self.has_first:
            for name in self._tied_names():  # the global gradient norm counts the first stage's copy only
                tensor_state(self.module.get_parameter(name)).pipeline_copy = True

    @torch.no_grad()
    def _sum_tied_gradients(self, params: list[torch.Tensor], grads: list[Optional[torch.Tensor]]) -> None:
        """Megatron's shared-embedding all-reduce: both copies of a tied parameter step with the sum of the first
        stage's (embedding) and the last stage's (head) gradients, so that they stay equal."""
        names = self._tied_names()
        if self._tied_group is None or not names:
            return
        index = {id(p): i for i, p in enumerate(params)}
        for name in names:
            i = index[id(self.module.get_parameter(name))]
            if grads[i] is None:
                grads[i] = torch.zeros_like(params[i])
            dist.all_reduce(local_tensor(grads[i]), group=self._tied_group)

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

    # -- a stage's part of the module's own forward -----------------------------------------------
    def replay(self, stage: StageModule, x: Any, inputs: Any) -> Any:
        """Run the LightningModule's forward for `stage` only: what the parent computes around the blocks
        (positions, masks, rotary embeddings, the final norm and head, soft-capping) runs as written, on every stage,
        from the micro-batch's inputs; the blocks of other stages pass through, and a later stage's first block
        takes the hidden state `x` received from the previous stage. A stage other than the last returns its last
        block's output."""
        first = stage.is_first
        if first:
            inputs = x
        local = set(self.plan.stage_blocks[stage.stage])
        saved_blocks = dict(self._blocks_list._modules)
        saved_embed = {fqn: self.module.get_submodule(fqn) for fqn in (self.plan.embed if not first else ())}
        handles = []
        try:
            skip = _OtherStageBlock()
            for i in range(len(self._blocks_list)):
                if i not in local:
                    self._blocks_list._modules[str(i)] = skip
            started = [False]
            for fqn in saved_embed:
                _replace(self.module, fqn, _EmbeddingStandIn(fqn, x, inputs, started))
            if not first:
                handles.append(self._blocks_list[min(local)].register_forward_pre_hook(
                    functools.partial(_take_received, x, started), prepend=True, with_kwargs=True))
            if not stage.is_last:
                handles.append(self._blocks_list[max(local)].register_forward_hook(_capture_output))
            output = self.module(inputs)
        except _Captured as captured:
            return captured.hidden
        finally:
            for handle in handles:
                handle.remove()
            self._blocks_list._modules.update(saved_blocks)
            for fqn, original in saved_embed.items():
                _replace(self.module, fqn, original)
        if not stage.is_last:
            raise PipelineLayoutError(
                f"{type(self.module).__name__}.forward returned without calling block {max(local)} of "
                f"`{self.plan.blocks}`; declare pipeline_layout 'blocks' (the ModuleList the forward loops over).")
        return output

    # -- batches ----------------------------------------------------------------------------------
    def split_batch(self, batch: Any) -> tuple[Any, Any]:
        """(inputs, targets): `batch_fn`, else ``batch[0], batch[1]``, else a dict's ``labels`` (or ``targets``)
        and its ``input_ids`` (or its one other tensor)."""
        if self.layout.batch_fn is not None:
            return self.layout.batch_fn(batch)
        if isinstance(batch, (tuple, list)) and len(batch) >= 2:
            return batch[0], batch[1]
        if isinstance(batch, dict):
            target_key = next((k for k in ("labels", "targets", "target") if k in batch), None)
            rest = [k for k in batch if k != target_key]
            input_key = "input_ids" if "input_ids" in batch else (rest[0] if len(rest) == 1 else None)
            if target_key is not None and input_key is not None:
                return batch[input_key], batch[target_key]
        raise PipelineLayoutError(
            f"pipeline parallelism expects batches (inputs, targets, ...) or a dict with 'input_ids' and 'labels', got "
            f"{type(batch).__name__}{' with keys ' + str(sorted(batch)) if isinstance(batch, dict) else ''}; declare "
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
        loss_fn = getattr(self.module, "pipeline_loss", None)
        if callable(loss_fn):
            return loss_fn(output, target)
        return default_pipeline_loss(type(self.module).__name__, output, target)

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

    def _stage_kwargs(self, inputs: Any) -> dict[str, Any]:
        """Every stage replays the module's forward from the micro-batch's inputs (`replay`)."""
        return {"inputs": inputs} if self.layout.embed_fn is None else {}

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
        right after its last micro-batch backward, inside the schedule, instead of after it, and backward writes
        straight into the in-place gradient buffers (`grad_buffers`), whose parameters show ``.grad = None`` until
        `apply_gradients` (their buffer already holds this step's gradients, being reduced).
        """
        self.sync_grads = sync_grads
        hold = overlap and sync_grads
        self._overlap = hold and not self.plan.tied  # tied gradients are summed first
        params = self.stage_parameters()
        saved = [p.grad for p in params]
        held: set[int] = set()
        if hold:
            for buffers in self.grad_buffers:
                held |= buffers.hold(params)
        for p in params:
            if id(p) not in held:
                p.grad = None
        try:
            loss = self._train_step(batch, loss_factor)
        finally:
            self._overlap = False
            self._pending_grads = [p.grad for p in params]
            for p, g in zip(params, saved):
                p.grad = None if id(p) in held else g
        return loss

    def apply_gradients(self) -> bool:
        """Accumulate the gradients of the last `train_step` into `.grad`; True when the caller must still average
        them over dp (ZeRO 0/1). False when there were none, or under ZeRO 2/3, where FSDP2 reduce-scattered
        (averaged) them over dp inside the schedule already."""
        pending, self._pending_grads = self._pending_grads, None
        if pending is None:
            return False
        params = self.stage_parameters()
        self._sum_tied_gradients(params, pending)
        for buffers in self.grad_buffers:  # added into (or already in) the in-place buckets: no copy out
            pending = buffers.take(params, pending)
        for p, g in zip(params, pending):
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
        schedule.step(*args, target=targets if self.has_last else None, losses=losses, return_outputs=False,
                      **self._stage_kwargs(inputs))
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
        schedule.eval(*args, target=targets if self.has_last else None, losses=losses, **self._stage_kwargs(inputs))
        mean = torch.stack([l.detach().float() for l in losses]).mean() if self.has_last else None
        return self._broadcast(mean)

    def predict_step(self, batch: Any) -> Any:
        inputs = batch[0] if isinstance(batch, (tuple, list)) and self.layout.batch_fn is None else (
            self.split_batch(batch)[0] if self.layout.batch_fn is not None else batch)
        m = self._micro_batches(self._batch_size(inputs), train=False)
        schedule = self._schedule("predict", m, self._shape_key(inputs))
        args = (inputs,) if self.has_first else ()
        out = schedule.step(*args, **self._stage_kwargs(inputs))
        if not self.has_last:
            return None
        # vocab-parallel logits (tensor parallelism) come back as one full tensor (gathered over tp)
        return out.full_tensor() if hasattr(out, "full_tensor") else out


def _tied_group(mesh: Any, plan: PipelinePlan) -> Any:
    """The process group of the first and the last pipeline rank along each ``pp`` line of `mesh` (created on every
    rank, in the same order, as ``new_group`` requires); this rank's, or None when it holds neither end."""
    names = tuple(getattr(mesh, "mesh_dim_names", None) or ("pp",))
    if plan.pp_size == 2:
        return (mesh["pp"] if len(names) > 1 else mesh).get_group()
    return _ends_group(mesh.mesh.movedim(names.index("pp"), 0).reshape(plan.pp_size, -1))


def _ends_group(lines: torch.Tensor) -> Any:
    """`lines[p, k]`: the global rank of pp rank p on line k."""
    mine, rank = None, dist.get_rank()
    for k in range(lines.shape[1]):
        ranks = [int(lines[0, k]), int(lines[-1, k])]
        group = dist.new_group(ranks)
        if rank in ranks:
            mine = group
    return mine


def default_pipeline_loss(owner: str, output: Any, target: Any) -> torch.Tensor:
    """Cross-entropy of the last stage's logits (a tensor, or an output with ``.logits``) against integer targets of
    one dimension less: the loss of a module that defines no `pipeline_loss`."""
    logits = getattr(output, "logits", output)
    if isinstance(logits, (tuple, list)) and logits:
        logits = logits[0]
    if (not isinstance(logits, torch.Tensor) or not isinstance(target, torch.Tensor) or target.is_floating_point()
            or logits.dim() != target.dim() + 1):
        raise PipelineLayoutError(
            f"{owner} defines no `pipeline_loss(self, output, target)` and its forward's output "
            f"({type(output).__name__}{' ' + str(tuple(logits.shape)) if isinstance(logits, torch.Tensor) else ''}) "
            f"against the targets ({type(target).__name__}"
            f"{' ' + str(tuple(target.shape)) if isinstance(target, torch.Tensor) else ''}) is not logits for "
            "cross-entropy; define `pipeline_loss`, the loss the last stage computes for one micro-batch."
        )
    return F.cross_entropy(logits.flatten(0, -2).float(), target.flatten())


def bubble_fraction(pp_size: int, micro_batches: int, virtual_stages: int = 1) -> float:
    """Idle fraction of a synchronous pipeline step: (P-1) / (V*M + P-1) (V=1: GPipe and 1F1B)."""
    return (pp_size - 1) / (virtual_stages * micro_batches + pp_size - 1)
