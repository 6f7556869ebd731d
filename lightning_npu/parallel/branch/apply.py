"""Apply branch layouts: each branch gets a ``(outer, bdp, btp)`` DeviceMesh over the top-level tp groups.

The ranks of one top-level tp group read the same batch. A branch at tp size ``btp`` splits that group into
``bdp = tp / btp`` groups of ``btp`` ranks: it is sharded over ``btp`` with the project's tp plans, each ``bdp``
rank runs it on its slice of the batch, and its output is all-gathered over ``bdp`` so the rest of the model (a
contrastive loss) sees every sample. Backward is the matching slice, so each bdp rank's branch gradients hold its
slice's part: they are summed over ``bdp`` (`BranchGradientSync`), then reduced over the top-level dp like every
other gradient.

A branch's own ``zero_stage`` 1 (`zero1_groups`) keeps its parameters whole on each rank of its btp group (local
tp shards, as ZeRO 0) and gives ZeRO-1's optimizer extra gradient buckets over ``fdp`` (below): one reduce-scatter
there sums over bdp and the top-level dp at once, divided by the top-level dp size, and its fp32 masters and moments
are sharded over every fdp rank (2-D ``(fdp, btp)`` DTensors under a branch tp), so neither the bdp sum nor the
top level's dp reduction touches them.

A branch's own ``zero_stage`` 2/3 (`shard_branches`) makes its blocks and itself FSDP2 units over ``fdp``, the
(outer x bdp) ranks flattened: every rank that holds the same branch tp shard. Its tp parameters stay DTensors on
``btp``, which FSDP2 makes 2-D (fdp, btp) as torchtitan composes FSDP2 with TP. The one reduce-scatter over fdp then
does both sums at once: over bdp (the slices' parts) and over the top-level dp (``outer``), divided by the top-level
dp size only (`gradient_divisor`), the mean over the global batch. So nothing else reduces those parameters: DDP,
ZeRO-1's buckets (its optimizer steps the shards as they are) and `BranchGradientSync` skip them.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_npu.parallel.collectives import all_gather_into
from lightning_npu.parallel.data_parallel import wrap
from lightning_npu.parallel.data_parallel.sync import GradientSync, fsdp_modules, fsdp_reduce_scatter
from lightning_npu.parallel.errors import ParallelConfigError
from lightning_npu.parallel.state import module_state
from lightning_npu.parallel.tensor_parallel import plan as tp
from lightning_npu.parallel.tensor_parallel import shards as tp_shards

MESH_DIMS = ("outer", "bdp", "btp")
FSDP_DIM = "fdp"  # (outer, bdp) flattened: the ranks a ZeRO-2/3 branch shards over


def fully_sharded(layout: Any) -> bool:
    """A branch that shards itself with FSDP2 (its own zero_stage 2 or 3)."""
    return layout.zero_stage in (2, 3)


@dataclass
class BranchShard:
    """What a branch module records (`module_state(branch).branch`): its name, layout, mesh and batch split."""

    name: str
    layout: Any  # spec.BranchLayout
    mesh: DeviceMesh  # (outer, bdp, btp)
    plan: Any = None  # its TensorParallelPlan (btp > 1)
    batches: list = field(default_factory=list)  # the global batch size of each call in flight

    @property
    def bdp(self) -> int:
        return self.mesh["bdp"].size()

    @property
    def bdp_rank(self) -> int:
        return self.mesh["bdp"].get_local_rank()

    @property
    def bdp_group(self) -> Any:
        return self.mesh["bdp"].get_group()


def branch_mesh(mesh: DeviceMesh, btp: int) -> DeviceMesh:
    """The (outer, bdp, btp) mesh: every top-level tp group (the innermost dim) split into groups of `btp` ranks.
    Collective (every rank builds the same groups in the same order)."""
    ranks = mesh.mesh
    top_tp = ranks.shape[-1]
    return DeviceMesh(mesh.device_type, ranks.reshape(-1, top_tp // btp, btp), mesh_dim_names=MESH_DIMS)


def plan_branch(module: nn.Module, name: str, layout: Any) -> Any:
    """The branch's tp plan at its own size ('auto' on the submodule); validates heads and widths, no process
    group needed."""
    if layout.tensor_parallel_size == 1:
        return None
    try:
        return tp.plan_tensor_parallel(module, layout.tensor_parallel_size, "auto")
    except ParallelConfigError as err:
        raise ParallelConfigError(f"`branch_layouts[{layout.glob!r}]['tensor_parallel_size']="
                                  f"{layout.tensor_parallel_size}` on {name}: {err}") from None


def apply_branches(model: nn.Module, mesh: DeviceMesh, branches: list[tuple[str, Any, Any]]) -> list[str]:
    """Shard each branch ``(name, layout, plan)`` of `model` over its own mesh and install its batch split (once:
    validate/test after fit find it applied). Collective. Returns the names of the branches' tp-sharded
    parameters (they differ between ranks)."""
    meshes: dict[int, DeviceMesh] = {}
    for name, layout, plan in branches:
        sub = model.get_submodule(name)
        state = module_state(sub)
        if state.branch is not None:
            continue
        btp = layout.tensor_parallel_size
        if btp not in meshes:
            meshes[btp] = branch_mesh(mesh, btp)
        shard = BranchShard(name, layout, meshes[btp], plan)
        if plan is not None and plan.styles:
            tp.apply_tensor_parallel(sub, shard.mesh["btp"], plan)
            fused = {f"{name}.{k}": v for k, v in tp_shards.fused_parameters(sub).items()}
            if not fully_sharded(layout):  # FSDP2 needs the DTensors (2-D with its fdp)
                tp_shards.localize_parameters(sub)
            tp_shards.set_fused_layout(model, {**tp_shards.fused_layout(model), **fused})
        state.branch = shard
        if shard.bdp > 1:
            sub.register_forward_pre_hook(_slice_inputs, with_kwargs=True)
            sub.register_forward_hook(_gather_outputs)
    return tp_shards.tensor_parallel_parameter_names(model)


def applied_branches(model: nn.Module) -> list[tuple[str, nn.Module, BranchShard]]:
    out = []
    for name, module in model.named_modules():
        shard = getattr(module_state(module, create=False), "branch", None)
        if shard is not None:
            out.append((name, module, shard))
    return out


def branch_parameters(model: nn.Module) -> list[tuple[BranchShard, list[tuple[str, nn.Parameter]]]]:
    """Each applied branch with bdp > 1 and its (full name, parameter) pairs that the bdp sum reduces, in module
    order: all of a ZeRO-0 branch's, none of a ZeRO-1 branch's (ZeRO-1's fdp buckets sum them), none of a ZeRO-2/3
    branch's but those FSDP2 leaves out (0-dim)."""
    out = []
    for name, module, shard in applied_branches(model):
        if shard.bdp > 1 and shard.layout.zero_stage != 1:
            named = list(module.named_parameters(prefix=name))  # frozen ones too: `BaseFinetuning` unfreezes later
            if fully_sharded(shard.layout):
                named = [(n, p) for n, p in named if p.dim() == 0]
            if named:
                out.append((shard, named))
    return out


def dtensor_modules(model: nn.Module) -> set[int]:
    """ids of the modules of ZeRO-2/3 branches: the top level's `localize_parameters` must leave their DTensors."""
    return {id(m) for _, module, shard in applied_branches(model) if fully_sharded(shard.layout)
            for m in module.modules()}


def fully_sharded_names(model: nn.Module) -> list[str]:
    """Full names of the parameters a ZeRO-2/3 branch reduces itself (DDP and ZeRO-1 must skip them)."""
    out = []
    for name, module, shard in applied_branches(model):
        if fully_sharded(shard.layout):
            out += [f"{name}.{n}" for n, p in module.named_parameters() if p.dim() > 0]
    return out


def fully_sharded_units(model: nn.Module) -> list[nn.Module]:
    """The FSDP2 units of the ZeRO-2/3 branches (accumulating micro-steps switch their reduce-scatter off)."""
    return [u for _, module, shard in applied_branches(model) if fully_sharded(shard.layout)
            for u in fsdp_modules(module)]


def zero1_groups(model: nn.Module) -> list[tuple[DeviceMesh, int, list[nn.Parameter]]]:
    """Each branch with its own ZeRO-1: ``(fdp mesh, top-level dp size, its parameters)``. ZeRO-1's optimizer gives
    them buckets over fdp (module docstring): their SUM there, divided by the top-level dp size. Collective the
    first time (`fsdp_mesh`)."""
    return [(fsdp_mesh(shard), shard.mesh["outer"].size(), list(module.parameters()))
            for _, module, shard in applied_branches(model) if shard.layout.zero_stage == 1]


def fsdp_mesh(shard: BranchShard) -> DeviceMesh:
    """fdp: the (outer, bdp) ranks flattened, those holding the same branch tp shard. 1-D: FSDP2 finds the btp dim
    of the branch's DTensors on the same root mesh and makes them 2-D itself (a 2-D mesh would mean HSDP).
    Collective the first time (a new process group)."""
    try:
        return shard.mesh[FSDP_DIM]
    except (KeyError, RuntimeError, ValueError):
        return shard.mesh["outer", "bdp"]._flatten(FSDP_DIM)


def shard_branches(model: nn.Module, param_dtype: Optional[torch.dtype]) -> None:
    """FSDP2 on each ZeRO-2/3 branch (module docstring): its blocks, then the branch itself, over `fsdp_mesh`; 0-dim
    parameters stay whole (the bdp sum and the top level reduce them). Its reduce-scatter sums over every rank of
    fdp and divides by the top-level dp size. Collective; once (a later validate/test finds the units)."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    for name, module, shard in applied_branches(model):
        if not fully_sharded(shard.layout) or isinstance(module, FSDPModule):
            continue
        kwargs = wrap._fully_shard_kwargs(module, fsdp_mesh(shard), shard.layout.zero_stage, param_dtype,
                                          check_scalars=False)
        scalars = set(wrap.scalar_parameters(module))
        if scalars:
            kwargs["ignored_params"] = scalars
        dp = shard.mesh["outer"].size()
        units = [u for u in wrap._fsdp_units(module) if not isinstance(u, FSDPModule)] + [module]
        for unit in units:
            fully_shard(unit, **kwargs)
            unit.set_gradient_divide_factor(float(dp))  # FSDP2's own path where fdp = 1 (no reduce-scatter runs)
            module_state(unit).gradient_divisor = dp
        wrap.route_reduce_scatter(module)


def compress_fully_sharded(model: nn.Module, compressor: Any) -> bool:
    """Each ZeRO-2/3 branch with a `gradient_compression` reduce-scatters through `compressor` (a compressed sum
    over fdp of which each rank keeps its chunk; one residual per FSDP2 unit). Returns whether any does."""
    from torch.distributed.fsdp import FSDPModule

    found = False
    for name, module, shard in applied_branches(model):
        spec = shard.layout.compression
        if not fully_sharded(shard.layout) or spec is None:
            continue
        dp = shard.mesh["outer"].size()
        for sub_name, unit in module.named_modules():
            if isinstance(unit, FSDPModule):
                key = f"branch:{name}.{sub_name}" if sub_name else f"branch:{name}"
                unit.set_custom_reduce_scatter(fsdp_reduce_scatter(dp, compressor, spec, key))
                found = True
    return found


# ---- the batch split: slice at the input, all-gather at the output ------------------------------------------
def _gather(x: torch.Tensor, group: Any, parts: int) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((parts * x.shape[0], *x.shape[1:]))
    all_gather_into(out, x, group=group)
    return out


class _SliceBatch(torch.autograd.Function):
    """Forward: this bdp rank's rows; backward: every rank's input gradient rows, gathered (the input is
    replicated over bdp, so each rank's upstream needs the whole gradient)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, rank: int, parts: int) -> torch.Tensor:
        ctx.group, ctx.parts = group, parts
        n = x.shape[0] // parts
        return x.narrow(0, rank * n, n).clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return _gather(grad, ctx.group, ctx.parts), None, None, None


class _GatherBatch(torch.autograd.Function):
    """Forward: every bdp rank's output rows, gathered; backward: this rank's rows of the gradient (the layers
    after the branch run replicated over bdp, so every rank holds the same whole gradient)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, rank: int, parts: int) -> torch.Tensor:
        ctx.rank, ctx.n = rank, x.shape[0]
        return _gather(x, group, parts)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> Any:
        return grad.narrow(0, ctx.rank * ctx.n, ctx.n).contiguous(), None, None, None


def _map(obj: Any, fn: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):  # transformers' ModelOutput is an OrderedDict: keys and attributes, updated in place
        for k in list(obj.keys()):
            obj[k] = _map(obj[k], fn)
        return obj
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_map(v, fn) for v in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(_map(v, fn) for v in obj)
    return obj


def _first_batch_size(args: Any, kwargs: Any) -> Optional[int]:
    found: list[int] = []

    def look(t: torch.Tensor) -> torch.Tensor:
        if not found and t.dim() >= 1:
            found.append(t.shape[0])
        return t

    _map(list(args), look)
    _map(dict(kwargs), look)
    return found[0] if found else None


def _slice_inputs(module: nn.Module, args: Any, kwargs: Any) -> Any:
    shard = module_state(module).branch
    batch = _first_batch_size(args, kwargs)
    if batch is None:
        raise ParallelConfigError(f"`branch_layouts[{shard.layout.glob!r}]`: {shard.name} got no tensor with a batch "
                                  "dimension to split over its branch-dp ranks.")
    if batch % shard.bdp:
        raise ParallelConfigError(
            f"`branch_layouts[{shard.layout.glob!r}]`: {shard.name}'s {shard.bdp} branch-dp ranks "
            f"(tensor_parallel_size={shard.layout.tensor_parallel_size} of the top level's "
            f"{shard.bdp * shard.layout.tensor_parallel_size}) split its batch of {batch}, which they do not divide; "
            f"use a batch size that is a multiple of {shard.bdp}, or a larger branch tensor_parallel_size.")
    shard.batches.append(batch)
    group, rank, parts = shard.bdp_group, shard.bdp_rank, shard.bdp

    def cut(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 0 or t.shape[0] != batch:
            return t
        if t.requires_grad:
            return _SliceBatch.apply(t, group, rank, parts)
        n = batch // parts
        return t.narrow(0, rank * n, n)

    return _map(tuple(args), cut), _map(dict(kwargs), cut)


def _gather_outputs(module: nn.Module, args: Any, output: Any) -> Any:
    shard = module_state(module).branch
    local = shard.batches.pop() // shard.bdp
    group, rank, parts = shard.bdp_group, shard.bdp_rank, shard.bdp

    def join(t: torch.Tensor) -> torch.Tensor:
        if t.dim() == 0 or t.shape[0] != local:
            return t
        if t.requires_grad:
            return _GatherBatch.apply(t, group, rank, parts)
        return _gather(t, group, parts)

    return _map(output, join)


# ---- gradients: summed over branch dp ---------------------------------------------------------------------
class BranchGradientSync(GradientSync):
    """The layout's gradient sync, plus each branch's gradients summed over its bdp group (compressed where the
    branch says so). ``from_hooks`` (ZeRO-1 at dp > 1): the sum runs from each parameter's post-accumulate-grad hook,
    registered before the optimizer's buckets, so it precedes their reduce-scatter; else after `inner.finish()`
    (a sum over bdp and the mean over dp commute)."""

    def __init__(self, inner: GradientSync, branches: list[tuple[BranchShard, list[tuple[str, nn.Parameter]]]],
                 compressor: Any, from_hooks: bool, fsdp_units: Optional[list[nn.Module]] = None) -> None:
        self.inner, self.branches, self.from_hooks = inner, branches, from_hooks
        self.fsdp_units = list(fsdp_units or ())  # ZeRO-2/3 branches under a top-level ZeRO 0: their own sync
        self._compressor = compressor  # the branches' compressor where the top level has none
        self.sent_bytes = 0  # bytes this rank sent for the bdp sums (uncompressed: fp32, 4 per value)
        if from_hooks:
            for shard, named in branches:
                for name, p in named:
                    frozen = not p.requires_grad  # hooked now all the same: before ZeRO-1's, once unfrozen
                    p.requires_grad_(True)
                    p.register_post_accumulate_grad_hook(
                        lambda p, s=shard, n=name: self._reduce(s, [p], f"branch:{n}") if self.enabled else None)
                    p.requires_grad_(not frozen)

    @property
    def compressor(self) -> Any:  # type: ignore[override]
        return self.inner.compressor if self.inner.compressor is not None else self._compressor

    @property
    def dp_compressor(self) -> Any:
        """Not the branches' own: a branch's `gradient_compression` must not compress ZeRO-1's top-level buckets."""
        return self.inner.dp_compressor

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        self.enabled = False
        for unit in self.fsdp_units:
            unit.set_requires_gradient_sync(False, recurse=False)
        try:
            with self.inner.no_sync():
                yield
        finally:
            for unit in self.fsdp_units:
                unit.set_requires_gradient_sync(True, recurse=False)
            self.enabled = True

    def bind(self, optimizers: list[Any], pipeline: Any = None) -> None:
        self.inner.bind(optimizers, pipeline)

    def release(self) -> None:
        self.inner.release()

    def finish(self) -> None:
        self.inner.finish()
        if not self.from_hooks:
            for shard, named in self.branches:
                self._reduce(shard, [p for _, p in named if p.requires_grad], f"branch:{shard.name}")

    @torch.no_grad()
    def _reduce(self, shard: BranchShard, params: list[nn.Parameter], key: str) -> None:
        if not params:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = torch.cat([g.reshape(-1).float() for g in grads])
        spec = shard.layout.compression
        compressor = self.compressor
        if spec is not None and compressor is not None:
            before = getattr(compressor, "sent_bytes", 0)
            compressor.sum(flat, shard.bdp_group, key, spec=spec, params=params)
            self.sent_bytes += getattr(compressor, "sent_bytes", 0) - before
        else:
            dist.all_reduce(flat, group=shard.bdp_group)
            self.sent_bytes += flat.numel() * 4
        offset = 0
        for p, g in zip(params, grads):
            n = g.numel()
            if p.grad is not None:
                p.grad.copy_(flat[offset:offset + n].view_as(g))
            offset += n
