"""ZeRO-1: a distributed optimizer over the mesh's ``dp`` dimension.

Every dp rank keeps the whole model (parameters replicated, as in plain data parallelism) but
owns only a 1/dp slice of every parameter: the rows ``[r*c, (r+1)*c)`` of its dim 0, with
``c = ceil(dim0 / dp)`` (``torch.chunk``'s split, the one DTensor ``Shard(0)`` and FSDP2 use).
A step is Megatron's distributed-optimizer step:

1. gradients are reduce-scattered in fp32 bucket by bucket (`sync.GradientBuckets`, whose
   reductions all go through `sync.reduce_bucket`), each bucket launched from a post-accumulate-grad
   hook as soon as its last gradient is ready, so communication overlaps the rest of backward;
   accumulating micro-steps communicate nothing;
2. the user's optimizer (its class and hyper-parameters, re-created over the slices) steps the
   fp32 master slices, which carry the reduced gradient slices; unscaling, the all-rank overflow skip,
   clipping and the gradient statistics are those of `lightning_npu.parallel.optim.mixed_precision.MixedPrecisionOptimizer`,
   which this class extends (one master-weight scheme: here the slices are the masters);
3. the updated slices are all-gathered (``dist.all_gather_single``) back into the parameters,
   in their own dtype (bf16 parameters get fp32 masters for free: the slice is the master).
   Without pipeline parallelism the all-gather overlaps the next forward, as Megatron's
   ``overlap_param_gather``: one async all-gather per bucket, each waited on by a forward pre-hook of
   the modules holding its parameters (and by ``state_dict``, checkpoints, fit's end and the next step).
   Between ``optimizer.step()`` and the next forward the parameters are therefore one step old; code
   that reads them there (a callback's ``on_train_batch_end``) calls :meth:`DistributedOptimizer.wait_parameters`.

Why row slices of each parameter rather than Megatron's contiguous byte range: the slices, their
gradients and the optimizer state are then plain DTensors (``Shard(0)`` over dp, or the 2-D
``(dp, tp)`` placements FSDP2 uses on top of tensor parallelism). Global gradient-norm clipping,
the health guards and DCP checkpoints treat them like FSDP2's, and a ZeRO-1 checkpoint reshards
to ZeRO 0/2/3 and any dp/tp size with no conversion. The communication volume is Megatron's; the
price is a copy into the bucket (``torch._chunk_cat``, as FSDP2) and padding of ``dim0 % dp`` rows.

Under expert parallelism a rank's experts (``Shard(0)`` over ``ep``) get their own buckets over the ``edp`` ranks
that hold the same experts, their SUM divided by dp (the all-to-all's backward already summed over ep), and their
masters are sliced over edp inside the ep shard: 2-D DTensors over ``(edp, ep)``, FSDP2's layout of ZeRO-3's experts,
so the gradient norm counts each expert once and checkpoints reshard across ep sizes and ZeRO stages.

Parameters an FSDP2 unit already shards (a branch's own ZeRO 2/3 under ``branch_layouts``) are left to it: FSDP2's
reduce-scatter has reduced their gradients over its own ranks, so they get no bucket and no dp reduction here; each
rank steps its FSDP2 shard as it is (an fp32 shard is its own master, a 16-bit one gets an fp32 master DTensor of the
same layout; its optimizer state is sharded with it), the gradient norm counts its DTensor gradient once, and
checkpoints store it as FSDP2's DTensor.

A branch's own ZeRO-1 (``branch_layouts``, `branch.apply.zero1_groups`) gives its parameters extra buckets over the
branch's ``fdp`` ranks (top-level dp x branch dp: every rank holding the same branch tp shard): one reduce-scatter
sums the bdp slices' parts and the top-level replicas at once, divided by the top-level dp size, and their masters
and state are sliced over fdp (2-D ``(fdp, btp)`` DTensors under a branch tp). The top level then need not be ZeRO-1
itself: at a top-level dp of 1 its buckets span one rank, and under a top-level ZeRO 0 (`replicate`) they are
all-reduced and stepped whole on every rank (Replicate masters), DDP's result with this class's one gradient path.

A 0-dim parameter (CLIP's ``logit_scale``) has no rows to slice: its gradient is all-reduced and every rank
steps it whole, as under DDP (its master is a ``Replicate`` DTensor over dp, saved and resharded like the rest).

Only element-wise optimizers are correct on local slices (a per-parameter norm, as in LAMB, or a
factored second moment, as in Adafactor, would see a slice); others are refused with the fix. An optimizer
that evaluates the closure itself (LBFGS) steps the DTensor slices instead, as under ZeRO 2/3: its dot products
and norms over the whole gradient are DTensor reductions over dp (one small collective each), its history vectors
stay sharded, and each closure evaluation refreshes the parameters and reduce-scatters that backward's gradients.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import MutableMapping
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard
from torch.optim import Optimizer

from lightning_npu.parallel.branch import apply as branch
from lightning_npu.parallel.collectives import all_gather_into
from lightning_npu.parallel.data_parallel.sync import GradientBuckets, fsdp_modules
from lightning_npu.parallel.mesh import replica_mesh
from lightning_npu.parallel.optim import grad_norm as gn
from lightning_npu.parallel.optim.mixed_precision import MixedPrecisionOptimizer, needs_closure, refuse_unflattenable
from lightning_npu.parallel.state import module_state, tensor_state
from lightning_npu.parallel.tensor_parallel.shards import sharding_of

# the size of one overlapped parameter all-gather (gathered bytes): the forward waits for the first layers' only
GATHER_CHUNK_BYTES = 4 * 2**20
# optimizers whose update of an element depends only on that element's gradient and state
ELEMENTWISE_OPTIMIZERS: tuple[type, ...] = tuple(
    getattr(torch.optim, name)
    for name in ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad", "RMSprop", "Adadelta", "Rprop", "ASGD")
    if hasattr(torch.optim, name)
)


def fsdp_sharded(module: nn.Module) -> set[int]:
    """ids of the parameters FSDP2 units of `module` shard (a branch's own ZeRO 2/3): they reduce-scatter their own
    gradients, so ZeRO-1 neither buckets nor slices them."""
    return {id(p) for m in fsdp_modules(module) for p in m.parameters() if isinstance(p, DTensor)}


def _is_expert(param: torch.Tensor) -> bool:
    """A parameter split over the ``ep`` mesh dim (this rank's experts of an MoE layer)."""
    spec = sharding_of(param)
    return spec is not None and "ep" in (spec.mesh.mesh_dim_names or ())


class ModelParamGroup(MutableMapping):
    """One of the user's optimizer's param groups as seen through the ZeRO-1 wrapper: ``"params"`` lists the model's
    parameters instead of their master slices; every other entry is the group's own (reads and writes)."""

    def __init__(self, group: dict[str, Any], model_of: dict[int, torch.Tensor]) -> None:
        self.group, self._model_of = group, model_of

    def __getitem__(self, key: str) -> Any:
        value = self.group[key]
        return [self._model_of[id(m)] for m in value] if key == "params" else value

    def __setitem__(self, key: str, value: Any) -> None:
        if key == "params":
            raise ValueError("A ZeRO-1 param group's parameters are fixed; set `optimizer.param_groups` or call "
                             "`optimizer.add_param_group`.")
        self.group[key] = value

    def __delitem__(self, key: str) -> None:
        del self.group[key]

    def __iter__(self) -> Any:
        return iter(self.group)

    def __len__(self) -> int:
        return len(self.group)


class DistributedOptimizer(MixedPrecisionOptimizer):
    """Wraps the user's optimizer for ZeRO stage 1 (see the module docstring).

    The user's optimizer (`optimizer`, never stepped itself) holds groups of the DTensor slices with the user's
    hyper-parameters: LR schedulers, clipping and checkpoints act on what is actually stepped. This wrapper's own
    `param_groups` show those groups with the model's parameters (`ModelParamGroup`), as under DDP. `state` is that of `inner`, the user's optimizer class re-created over plain local views of the slices. The strategy calls :meth:`finish_gradient_sync` at the end of a stepping backward
    (also after a pipeline schedule, without hooks) and clears `grad_buckets.enabled` while accumulating.
    """

    def __init__(
        self,
        optimizer: Optimizer,
        module: nn.Module,
        mesh: DeviceMesh,
        bucket_size_mb: float = 25.0,
        overlap: bool = True,
        scaler: Optional[Any] = None,
        pp_group: Optional[Any] = None,
        compressor: Optional[Any] = None,
        defer_gather: Optional[bool] = None,
        replicate: bool = False,
    ) -> None:
        if isinstance(optimizer, MixedPrecisionOptimizer):
            raise ValueError(f"The optimizer is already a {type(optimizer).__name__}.")
        # LBFGS: steps the DTensor slices (global dot products), not their local views (see the module docstring)
        self.steps_dtensors = needs_closure(optimizer)
        self.closure_optimizer = type(optimizer).__name__
        if not isinstance(optimizer, ELEMENTWISE_OPTIMIZERS) and not self.steps_dtensors:
            raise ValueError(
                f"zero_stage=1 steps each rank's slice of every parameter, which is only correct for element-wise "
                f"optimizers ({', '.join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)}) and closure-taking ones "
                f"(LBFGS); {type(optimizer).__name__} is not one of them. Use zero_stage=0, or zero_stage 2/3 if "
                "the optimizer works on FSDP2 shards."
            )
        if optimizer.state:
            raise ValueError(
                f"{type(optimizer).__name__} already holds state before ZeRO-1 sharding; return a fresh optimizer "
                "from `configure_optimizers` (or use zero_stage=0)."
            )
        self.dp_mesh = replica_mesh(mesh)  # dp, or dp x cp flattened (`mesh`)
        self.dp_group = self.dp_mesh.get_group()
        self.dp = self.dp_mesh.size()
        self.dp_rank = self.dp_mesh.get_local_rank()
        self.fqn = {id(p): name for name, p in module.named_parameters(remove_duplicate=True)}
        self._params_by_id = {id(p): p for p in module.parameters()}
        params = [p for g in optimizer.param_groups for p in g["params"]]
        unknown = [p for p in params if id(p) not in self.fqn]
        if unknown:
            raise ValueError(
                f"{len(unknown)} optimizer parameter(s) are not parameters of the LightningModule; ZeRO-1 needs every "
                "optimized tensor to be a module parameter (register it, or use zero_stage=0)."
            )
        if len({id(p) for p in params}) != len(params):
            raise ValueError("A parameter appears in more than one optimizer param group.")
        # expert parallelism: each rank's experts (`expert_parallel.dispatch`) are sliced over the edp ranks that hold
        # the same experts, their SUM divided by dp (the all-to-all's backward already summed over ep)
        expert_mesh = getattr(module_state(module, create=False), "expert_mesh", None)
        self.edp_mesh = expert_mesh["edp"] if expert_mesh is not None else None
        experts = {id(p) for p in params if self.edp_mesh is not None and _is_expert(p)}
        # FSDP2's own shards (a branch's ZeRO 2/3): stepped as they are, no bucket (`_add_self_sharded`)
        self.self_sharded = fsdp_sharded(module) & {id(p) for p in params}
        # a branch's own ZeRO-1 (`branch_layouts`): buckets over its fdp ranks (`_add_branch_buckets`)
        self._branch_of = {id(p): (fdp, dp) for fdp, dp, ps in branch.zero1_groups(module) for p in ps}
        in_branches = {id(p) for p in params if id(p) in self._branch_of}
        if self.steps_dtensors:  # a closure optimizer steps DTensors: all of them must share one mesh
            for ids, what, fix in ((experts, "expert_parallel_size > 1 at zero_stage=1", "zero_stage=0"),
                                   (self.self_sharded, "a branch's own zero_stage 2/3 under the top-level zero_stage=1",
                                    "the top-level zero_stage 0, 2 or 3"),
                                   (in_branches, "a branch's own zero_stage=1", "the branch's zero_stage 0, 2 or 3")):
                if ids:
                    raise ValueError(
                        f"{self.closure_optimizer} with {what} is not supported (its DTensor steps would mix two "
                        f"meshes); use an element-wise optimizer such as AdamW, or {fix}.")
        # `replicate`: a top-level ZeRO 0 beside a branch's own ZeRO-1: the rest is all-reduced and stepped whole
        self.replicate = replicate
        self.grad_buckets = GradientBuckets([], self.dp_mesh, bucket_size_mb, shard=True, overlap=overlap,
                                            compressor=compressor)
        self.grad_buckets.add([p for p in params if id(p) not in experts | self.self_sharded | in_branches],
                              replicate=replicate)
        if experts:
            for bucket in self.grad_buckets.add([p for p in params if id(p) in experts], mesh=self.edp_mesh,
                                                divide_by=self.dp):
                bucket.spec = None  # uncompressed: the compressors' state belongs to the dp group
        self._add_branch_buckets([p for p in params if id(p) in in_branches])
        self.buckets = self.grad_buckets.buckets
        # this rank's fp32 master rows of each bucket (the slice is the master copy, whatever the parameters' dtype)
        self.masters: list[torch.Tensor] = []
        self._shard_of: dict[int, nn.Parameter] = {}  # model param id -> master DTensor parameter
        self._grad_of: dict[int, DTensor] = {}
        self._model_grad_of: dict[int, DTensor] = {}
        # the public groups hold the DTensor slices (what schedulers, clipping, guards and checkpoints see); the
        # user's optimizer class steps plain views of the same storage: DTensor dispatch per foreach op cost ~6x
        # the AdamW step itself on the example GPT
        self._local_of: dict[int, nn.Parameter] = {}
        self._add_masters(self.buckets)
        self._add_self_sharded([p for p in params if id(p) in self.self_sharded])
        # the parameter all-gather overlapped with the next forward (pp = 1: the pipeline's stages run their own
        # forward; LBFGS re-evaluates inside its step): bucket index -> (gathered, work), waited by pre-hooks
        self.defer_gather = (overlap and not self.steps_dtensors) if defer_gather is None else defer_gather
        self._pending: dict[int, tuple[torch.Tensor, Any, tuple[int, int, int]]] = {}  # chunk -> gather in flight
        self._module = module
        self._wait_hooks: list[Any] = []
        if self.defer_gather:
            self._install_wait_hooks(module)
        hparams = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        accepted = inspect.signature(type(optimizer).__init__).parameters
        defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
        self.inner = type(optimizer)([
            {**h, "params": [self._local_of[id(self._shard_of[id(p)])] for p in g["params"]]}
            for h, g in zip(hparams, optimizer.param_groups)
        ], **defaults)
        public = [{**h, "params": [self._shard_of[id(p)] for p in g["params"]]}
                  for h, g in zip(hparams, optimizer.param_groups)]
        self.model_params = params
        # the user's optimizer (`self.optimizer`, what LR schedulers and LearningRateMonitor hold) shows the public
        # groups, so a scheduler's learning rate is the one stepped and is read back from the same dicts
        optimizer.param_groups = public
        MixedPrecisionOptimizer.__init__(self, optimizer, scaler=scaler, pp_group=pp_group)

    def _add_branch_buckets(self, params: list[nn.Parameter]) -> list[Any]:
        """Buckets of the ZeRO-1 branches' parameters, one set per branch, over its fdp mesh (the top-level dp x its
        branch dp), their SUM divided by the top-level dp; uncompressed (the top level's compressor state belongs to
        its dp group)."""
        new: list[Any] = []
        for fdp, dp in {id(v[0]): v for v in self._branch_of.values()}.values():
            mine = [p for p in params if self._branch_of[id(p)][0] is fdp]
            if mine:
                new += self.grad_buckets.add(mine, mesh=fdp, divide_by=dp)
        for bucket in new:
            bucket.spec = None
        return new

    def _share_state(self) -> None:
        self.state = self.inner.state  # keyed by the local views: plain tensors of this rank's slices
        self.defaults = self.optimizer.defaults

    @torch.no_grad()
    def _add_masters(self, buckets: list[Any]) -> None:
        """This rank's fp32 master slices of the parameters in `buckets`, their DTensor views and local views."""
        for bucket in buckets:
            flat = torch.zeros(bucket.total, dtype=torch.float32, device=bucket.grad.device)
            self.masters.append(flat)
            for s in bucket.slices:
                bucket.local_view(flat, s).copy_(s.rows_of(s.param.detach()))
                master = nn.Parameter(self._dtensor(bucket.local_view(flat, s), s.param, bucket.replicated,
                                                    bucket.mesh))
                tensor_state(master).master = True  # checkpoints store it in place of the parameter
                tensor_state(master).pipeline_copy = getattr(tensor_state(s.param, create=False), "pipeline_copy", False)
                self._shard_of[id(s.param)] = master
                self._grad_of[id(s.param)] = self._dtensor(bucket.grad_view(s), s.param, bucket.replicated,
                                                           bucket.mesh)
                if s.param.dtype == torch.float32:  # what the model parameter shows as `.grad` (a view, no copy)
                    self._model_grad_of[id(s.param)] = self._model_grad(bucket.grad_view(s), s.param,
                                                                        bucket.replicated, bucket.mesh)
                self._local_of[id(master)] = master if self.steps_dtensors else nn.Parameter(
                    master.to_local(), requires_grad=master.requires_grad)
        if self.steps_dtensors:
            refuse_unflattenable(self.closure_optimizer, [
                (self.fqn[id(s.param)], self._shard_of[id(s.param)]) for b in buckets for s in b.slices], "zero_stage=1")

    @torch.no_grad()
    def _add_self_sharded(self, params: list[nn.Parameter]) -> None:
        """FSDP2's sharded fp32 parameters are their own masters: the public groups hold them (DTensors), the user's
        optimizer class steps a plain Parameter over their local shard (`_rebind_self_sharded` re-points it). A
        16-bit shard (``bf16-true``) gets an fp32 master DTensor of the same layout, copied back after each step:
        master weights stay fp32, as for ZeRO-1's slices."""
        for p in params:
            master = p
            if p.dtype != torch.float32:
                master = nn.Parameter(DTensor.from_local(p.to_local().float(), p.device_mesh, p.placements,
                                                         run_check=False, shape=p.shape, stride=p.stride()),
                                      requires_grad=p.requires_grad)
                tensor_state(master).master = True  # checkpoints store it in place of the parameter
            self._shard_of[id(p)] = master
            self._local_of[id(master)] = nn.Parameter(master.to_local(), requires_grad=p.requires_grad)

    def _own_masters(self) -> list[tuple[nn.Parameter, nn.Parameter]]:
        """(FSDP2 shard, its master) for the shards stepped through a separate fp32 master (16-bit shards)."""
        pairs = ((self._params_by_id[pid], self._shard_of[pid]) for pid in sorted(self.self_sharded))
        return [(p, m) for p, m in pairs if m is not p]

    @torch.no_grad()
    def _rebind_self_sharded(self) -> None:
        """FSDP2 may swap a sharded parameter's local storage (re-padding it at its lazy init, a state-dict load):
        the stepped Parameter (the key of its optimizer state) is re-pointed at the current one before each use."""
        for pid in self.self_sharded:
            p = self._shard_of[pid]
            if p is not self._params_by_id[pid]:  # its own fp32 master: storage of ours
                continue
            view = self._local_of[id(p)]
            local = p.to_local()
            if view.data_ptr() != local.data_ptr() or view.shape != local.shape:
                view.data = local

    @torch.no_grad()
    def _attach_self_sharded(self) -> None:
        """16-bit shards: their masters get FSDP2's reduced gradient in fp32 (fp32 shards carry their own)."""
        for p, master in self._own_masters():
            master.grad = None if p.grad is None or not p.requires_grad else DTensor.from_local(
                p.grad.to_local().float(), master.device_mesh, master.placements, run_check=False,
                shape=master.shape, stride=master.stride())

    @torch.no_grad()
    def _copy_self_sharded(self, to_masters: bool = False) -> None:
        """16-bit shards from their fp32 masters after a step or a load (`to_masters`: the other way)."""
        for p, master in self._own_masters():
            if to_masters:
                master.to_local().copy_(p.to_local())
            else:
                p.to_local().copy_(master.to_local())

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """A new group while training (Lightning's `BaseFinetuning` unfreezing layers): its parameters get their own
        gradient buckets and fp32 master slices, the user's optimizer class steps them with the group's
        hyper-parameters (its defaults fill the rest), and the user's optimizer shows the group, so that LR
        schedulers and `LearningRateMonitor` see it. Collective-free, but every dp rank must add the same group."""
        if "optimizer" not in vars(self):  # torch's Optimizer.__init__ adds the placeholder group
            return Optimizer.add_param_group(self, param_group)
        self.wait_parameters()  # the new buckets change the gather plan that the gathers in flight were cut by
        params = param_group["params"]
        params = [params] if isinstance(params, torch.Tensor) else list(params)
        unknown = [p for p in params if id(p) not in self.fqn]
        if unknown:
            raise ValueError(
                f"add_param_group: {len(unknown)} parameter(s) are not parameters of the LightningModule; ZeRO-1 needs "
                "every optimized tensor to be a module parameter (register it, or use zero_stage=0)."
            )
        if len({id(p) for p in params}) != len(params) or any(id(p) in self._shard_of for p in params):
            raise ValueError("add_param_group: a parameter appears in more than one optimizer param group.")
        if self.edp_mesh is not None and any(_is_expert(p) for p in params):
            raise ValueError("add_param_group: adding expert-parallel parameters while training is not supported at "
                             "zero_stage=1; put them in `configure_optimizers`' groups, or use zero_stage=0.")
        new_sharded = fsdp_sharded(self._module) & {id(p) for p in params}
        rest = [p for p in params if id(p) not in new_sharded]
        self._add_masters(self.grad_buckets.add([p for p in rest if id(p) not in self._branch_of],
                                                replicate=self.replicate))
        self._add_masters(self._add_branch_buckets([p for p in rest if id(p) in self._branch_of]))
        self.self_sharded |= new_sharded
        self._add_self_sharded([p for p in params if id(p) in new_sharded])
        self.model_params.extend(params)
        hparams = {k: v for k, v in param_group.items() if k != "params"}
        self.inner.add_param_group({**hparams, "params": [self._local_of[id(self._shard_of[id(p)])] for p in params]})
        hparams = {k: v for k, v in self.inner.param_groups[-1].items() if k != "params"}  # with the defaults
        self.optimizer.param_groups.append({**hparams, "params": [self._shard_of[id(p)] for p in params]})

    @property  # type: ignore[override]
    def param_groups(self) -> list[Any]:
        """The user's optimizer's groups with the model's parameters in place of their master slices, as under DDP:
        Lightning's `BaseFinetuning` finds, names and restores its groups by the module's parameters (writes to the
        hyper-parameters reach the stepped groups). The stepped groups are `optimizer.param_groups`."""
        inner = vars(self).get("optimizer")
        if inner is None:  # torch's Optimizer.__init__ (the placeholder group)
            return vars(self)["_own_groups"]
        model_of = {id(m): p for p, m in ((self._params_by_id[pid], m) for pid, m in self._shard_of.items())}
        return [ModelParamGroup(g, model_of) for g in inner.param_groups]

    @param_groups.setter
    def param_groups(self, groups: list[Any]) -> None:
        """Groups by the model's parameters (or their masters): known ones keep their masters and state, with the
        given hyper-parameters; groups of parameters not yet optimized are added (`add_param_group`), as
        `BaseFinetuning` restores the groups it had added."""
        if "optimizer" not in vars(self):
            vars(self)["_own_groups"] = groups
            return
        self.wait_parameters()
        master_ids = {id(m) for m in self._shard_of.values()}
        known: list[tuple[dict[str, Any], list[nn.Parameter]]] = []
        new: list[dict[str, Any]] = []
        for group in groups:
            params = list(group["params"])
            masters = [p if id(p) in master_ids else self._shard_of.get(id(p)) for p in params]
            hparams = {k: v for k, v in group.items() if k != "params"}
            if all(m is not None for m in masters):
                known.append((hparams, masters))
            elif all(m is None for m in masters):
                new.append({**hparams, "params": params})
            else:
                raise ValueError("param_groups: a group mixes parameters this ZeRO-1 optimizer steps with new ones; "
                                 "add the new ones as their own group (`optimizer.add_param_group`).")
        local_of = self._local_of
        defaults = {k: v for k, v in self.inner.defaults.items() if k != "params"}
        self.inner.param_groups = [{**defaults, **h, "params": [local_of[id(m)] for m in ms]} for h, ms in known]
        self.optimizer.param_groups = [{**defaults, **h, "params": ms} for h, ms in known]
        for group in new:
            self.add_param_group(group)

    # ---- layout ---------------------------------------------------------------------------
    def _dtensor(self, local: torch.Tensor, param: torch.Tensor, replicated: bool = False,
                 mesh: Optional[DeviceMesh] = None) -> DTensor:
        """The master slice `local` as a DTensor over its bucket's `mesh` (dp, or a ZeRO-1 branch's fdp), 2-D with
        the tp dim where `param` is a local tp shard (the top level's tp, or the branch's btp)."""
        spec = sharding_of(param)
        if mesh is not None and mesh is self.edp_mesh:  # an expert: edp slices the rows of this rank's experts
            return self._expert_dtensor(local, spec)
        mesh = self.dp_mesh if mesh is None else mesh
        # replicated: a 0-dim parameter (or any under `replicate`), whole on every dp rank, stepped identically
        dp_placement: Any = Replicate() if replicated else Shard(0)
        if spec is None or param.dim() == 0:
            return DTensor.from_local(local, mesh, (dp_placement,), run_check=False, shape=param.shape,
                                      stride=param.stride())
        (tp_placement,) = spec.placements
        if not replicated and isinstance(tp_placement, Shard) and tp_placement.dim == 0:
            dp_placement = _StridedShard(0, split_factor=spec.mesh.size())  # dp slices each tp shard's rows
        return DTensor.from_local(local, self._with_tp(mesh, spec.mesh), (dp_placement, tp_placement),
                                  run_check=False, shape=spec.shape, stride=spec.stride)

    def _with_tp(self, mesh: DeviceMesh, tp_mesh: DeviceMesh) -> DeviceMesh:
        """The 2-D (dp, tp) mesh of `mesh` and the tp mesh beside it on their root mesh, one object per pair (the
        gradient norm groups tensors by mesh). A ZeRO-0 branch's btp shard in the top level's dp buckets: its
        branch mesh's ``outer`` dim holds the top-level dp ranks (branches refuse pp and cp), beside its btp."""
        cache = self.__dict__.setdefault("_meshes_2d", {})
        key = (id(mesh), id(tp_mesh))
        if key not in cache:
            root = mesh._get_root_mesh()  # (by dim names: torch may map an equal mesh of an earlier fit to its root)
            if not set(tp_mesh.mesh_dim_names) <= set(root.mesh_dim_names):
                root, mesh = tp_mesh._get_root_mesh(), None
            names = mesh.mesh_dim_names if mesh is not None else (branch.MESH_DIMS[0],)
            cache[key] = root[(*names, *tp_mesh.mesh_dim_names)]
        return cache[key]

    def _expert_dtensor(self, local: torch.Tensor, spec: Any) -> DTensor:
        """Over ``(edp, ep[, tp])``: the experts' layout (``Shard(0)`` over ep) with edp slicing each ep shard's rows,
        as FSDP2 lays out ZeRO-3's experts (so checkpoints reshard between ZeRO 0/1/3 and ep sizes)."""
        assert self.edp_mesh is not None
        root = self.edp_mesh._get_root_mesh()
        mesh = root[("edp", *spec.mesh.mesh_dim_names)]
        rows = math.prod(spec.mesh.size(i) for i, pl in enumerate(spec.placements)
                         if isinstance(pl, Shard) and pl.dim == 0)
        edp = _StridedShard(0, split_factor=rows) if rows > 1 else Shard(0)
        return DTensor.from_local(local, mesh, (edp, *spec.placements), run_check=False, shape=spec.shape,
                                  stride=spec.stride)

    def _model_grad(self, local: torch.Tensor, param: torch.Tensor, replicated: bool = False,
                    mesh: Optional[DeviceMesh] = None) -> torch.Tensor:
        # over dp only (an expert's: over edp), shaped like the model parameter (a local tp shard under tp: `.grad`
        # must match its shape); a scalar's all-reduced gradient is shown as DDP shows it, a plain tensor
        if replicated:
            return local
        return DTensor.from_local(local, self.dp_mesh if mesh is None else mesh, (Shard(0),), run_check=False,
                                  shape=param.shape, stride=param.stride())

    def master_of(self, param: torch.Tensor) -> Optional[nn.Parameter]:
        """The fp32 DTensor slice this rank steps for a model parameter (None if not managed here, or if the
        parameter is an fp32 FSDP2 shard, its own master)."""
        master = self._shard_of.get(id(param))
        return None if master is param else master

    def finish_gradient_sync(self) -> None:
        """End of the stepping backward: reduce what the hooks did not launch (all of it without hooks, e.g.
        after a pipeline schedule), wait, average, attach to the masters.

        A backward that gave none of this optimizer's parameters a gradient (another optimizer's turn under
        manual optimization) communicates nothing and leaves the masters without gradients, so it steps nothing.
        """
        if not self.grad_buckets.has_gradients():
            for pid, master in self._shard_of.items():
                if pid not in self.self_sharded:  # FSDP2's gradients are its own (reduced already, or None)
                    master.grad = None
            self._attach_self_sharded()
            return
        self.grad_buckets.finish()
        self._attach_gradients()

    def _attach_gradients(self) -> None:
        # frozen parameters get none, so the optimizer skips them as it would have (no weight decay, no momentum)
        for bucket in self.buckets:
            for p in bucket.params:
                self._shard_of[id(p)].grad = self._grad_of[id(p)] if p.requires_grad else None
        self._attach_self_sharded()
        self.publish_model_grads()

    @torch.no_grad()
    def publish_model_grads(self) -> None:
        """Each model parameter's ``.grad`` is its reduced gradient as a dp-sharded DTensor (``Shard(0)``, this rank's
        rows, as FSDP2 shows them): a view of the reduce-scattered slice for fp32 parameters, so gradient memory
        stays 1/dp and unscaling and clipping show in it; a 16-bit copy of the slice for 16-bit parameters."""
        for bucket in self.buckets:
            for s in bucket.slices:
                p = s.param
                master = self._shard_of[id(p)]
                if master.grad is None:
                    continue
                shown = self._model_grad_of.get(id(p))
                if shown is None:  # 16-bit parameter: refresh the copy made at the first publish of this step
                    shown = self._published.get(id(p))
                    local = bucket.grad_view(s)
                    if shown is None or p.grad is not shown:
                        shown = self._model_grad(local.to(p.dtype), p, bucket.replicated, bucket.mesh)
                    else:
                        gn.local_tensor(shown).copy_(local)
                p.grad = shown
                self._published[id(p)] = shown
        for p, master in self._own_masters():  # FSDP2's 16-bit gradient shows the unscaled, clipped master's
            if p.grad is not None and master.grad is not None:
                gn.local_tensor(p.grad).copy_(master.grad.to_local())

    def _published_params(self) -> list[torch.Tensor]:
        return self.model_params

    def hide_model_grads(self) -> None:
        """Before a backward: the shown slices go; in-place buckets show their buffer views again (autograd adds
        to them, so accumulation and a second backward before ``zero_grad`` sum as ``.grad`` would)."""
        super().hide_model_grads()
        self.grad_buckets.attach_views()

    # ---- step -----------------------------------------------------------------------------
    def _install_wait_hooks(self, module: nn.Module) -> None:
        # every module holding parameters waits for its buckets' all-gathers before its forward; the root (a
        # LightningModule's training_step uses its own parameters without a forward) is gathered eagerly
        for m in module.modules():
            if m is not module and any(True for _ in m.parameters(recurse=False)):
                # first: tensor parallelism's own pre-hook swaps the plain shards for DTensor views (`shards.py`)
                self._wait_hooks.append(m.register_forward_pre_hook(self._wait_module, prepend=True))
        self._wait_hooks.append(module.register_state_dict_pre_hook(self._wait_all))
        self._wait_hooks.append(module.register_load_state_dict_pre_hook(self._wait_all))

    def _wait_all(self, *args: Any, **kwargs: Any) -> None:
        self.wait_parameters()

    def remove_wait_hooks(self) -> None:
        """Fit's end: nothing is in flight any more, and the hooks (bound to this optimizer and its process groups)
        would keep the module from pickling (``torch.save(model)``)."""
        self.wait_parameters()
        for handle in self._wait_hooks:
            handle.remove()
        self._wait_hooks.clear()

    def _wait_module(self, m: nn.Module, args: Any) -> None:
        if not self._pending:
            return
        chunk_of = self._gather_plan()[1]
        indices = {chunk_of[id(p)] for p in m.parameters(recurse=False) if id(p) in chunk_of}
        if indices & self._pending.keys():
            self.wait_parameters(indices)

    def _gather_plan(self) -> tuple[list[tuple[int, int, int]], dict[int, int]]:
        """The all-gathers of a step, in the order the forward needs them: ``(bucket, first slice, end slice)``
        ranges of at most `GATHER_CHUNK_BYTES` gathered bytes (a whole gradient bucket would arrive only when
        the forward that waits for its first layer starts), and each parameter's chunk index."""
        cached = self.__dict__.get("_plan")
        if cached is not None and cached[2] == len(self.buckets):
            return cached[0], cached[1]
        chunks: list[tuple[int, int, int]] = []
        chunk_of: dict[int, int] = {}
        for bi in reversed(range(len(self.buckets))):  # buckets run from the last layers to the first
            bucket = self.buckets[bi]
            if bucket.replicated:
                continue
            size = torch.empty((), dtype=bucket.dtype).element_size() * bucket.world
            hi, nbytes = len(bucket.slices), 0
            for lo in reversed(range(len(bucket.slices))):
                nbytes += bucket.slices[lo].numel * size
                if nbytes >= GATHER_CHUNK_BYTES or lo == 0:
                    chunk_of.update({id(s.param): len(chunks) for s in bucket.slices[lo:hi]})
                    chunks.append((bi, lo, hi))
                    hi, nbytes = lo, 0
        self.__dict__["_plan"] = (chunks, chunk_of, len(self.buckets))  # a cache (LightningOptimizer copies __dict__)
        return chunks, chunk_of

    @torch.no_grad()
    def wait_parameters(self, chunks: Optional[set[int]] = None) -> None:
        """Finish the parameter all-gathers still in flight after a step, so that the model's parameters hold the
        stepped weights (e.g. for a callback reading them in ``on_train_batch_end``). `chunks`: only those (the
        forward pre-hooks' use). Local (launches no collective); a no-op when none is in flight."""
        for index in sorted(self._pending if chunks is None else chunks & self._pending.keys()):
            full, work, where = self._pending.pop(index)  # `where`: the chunk's range when it was launched
            work.wait()
            self._scatter_gathered(*where, full)

    @torch.no_grad()
    def gather_parameters(self, defer: bool = False) -> None:
        """All-gather every rank's master slice into the (replicated) parameters, in their dtype. `defer`: leave
        the gathers in flight, each waited on by the forward of the modules holding its parameters."""
        self.wait_parameters()
        self._copy_self_sharded()
        for bucket, master in zip(self.buckets, self.masters):
            if bucket.replicated:  # every rank stepped the whole (scalar) parameters: nothing to gather
                for s in bucket.slices:
                    s.param.copy_(bucket.local_view(master, s))
        chunks, chunk_of = self._gather_plan()
        for index, (bi, lo, hi) in enumerate(chunks):
            bucket, master = self.buckets[bi], self.masters[bi]
            a, b = bucket.slices[lo].offset, bucket.slices[hi - 1].offset + bucket.slices[hi - 1].numel
            mine = master[a:b].to(bucket.dtype)
            full = torch.empty(bucket.world, b - a, dtype=bucket.dtype, device=mine.device)
            work = all_gather_into(full.view(-1), mine, group=bucket.group, async_op=True)
            self._pending[index] = (full, work, (bi, lo, hi))
        if not defer:
            self.wait_parameters()
        else:  # the root's own parameters: a LightningModule's training_step may use them without a forward
            eager = {chunk_of[id(p)] for p in self._module.parameters(recurse=False) if id(p) in chunk_of}
            if eager:
                self.wait_parameters(eager)

    def _scatter_gathered(self, bi: int, lo: int, hi: int, full: torch.Tensor) -> None:
        bucket = self.buckets[bi]
        base, world = bucket.slices[lo].offset, bucket.world
        for s in bucket.slices[lo:hi]:
            rows = s.param.shape[0]
            part = full[:, s.offset - base : s.offset - base + s.numel]
            if rows == world * s.chunk_rows and s.param.is_contiguous():
                s.param.view(world, s.numel).copy_(part)  # no padding: one strided copy
            else:
                s.param.copy_(part.reshape(world * s.chunk_rows, *s.param.shape[1:])[:rows])

    def _copy_model_grads_to_main_grads(self) -> None:
        pass  # `finish_gradient_sync` attached the reduce-scattered slices to the masters

    def _step_main_params(self, closure: Optional[Callable[[], Any]] = None, **kwargs: Any) -> Any:
        for public, local in zip(self.optimizer.param_groups, self.inner.param_groups):
            local.update({k: v for k, v in public.items() if k != "params"})  # lr from schedulers, ...
        if self.steps_dtensors:  # the DTensor masters hold their gradients: each evaluation's, attached in backward
            return self.inner.step(closure, **kwargs) if closure is not None else self.inner.step(**kwargs)
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._rebind_self_sharded()
        for public, local in zip(self.optimizer.param_groups, self.inner.param_groups):
            for master, view in zip(public["params"], local["params"]):
                view.grad = None if master.grad is None else master.grad.to_local()  # None: skipped (frozen, guard)
        self.inner.step(**kwargs)
        return loss

    def _copy_main_params_to_model_params(self) -> None:
        self.gather_parameters(defer=self.defer_gather)

    def zero_grad(self, set_to_none: bool = True) -> None:
        # the masters' gradients are views of the reduce-scatter output (or of the in-place buffers, zeroed here):
        # the next sync overwrites them (state lives on the buckets: Lightning's LightningOptimizer calls this on a
        # copy of our __dict__)
        MixedPrecisionOptimizer.hide_model_grads(self)  # the shown slices, even with set_to_none=False
        self.grad_buckets.clear(set_to_none)
        for p in self.model_params:
            if p.grad is not None:
                if set_to_none:
                    p.grad = None
                else:
                    p.grad.zero_()

    # ---- state ----------------------------------------------------------------------------
    def _state_view(self, master: DTensor, value: Any) -> Any:
        """A slice-shaped state tensor as a DTensor over its storage (DCP writes/loads it in place)."""
        if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape == master.to_local().shape:
            return DTensor.from_local(value, master.device_mesh, master.placements, run_check=False,
                                      shape=master.shape, stride=master.stride())
        return value

    @torch.no_grad()
    def sharded_state_dict(self) -> dict[str, Any]:
        """FQN-keyed, flattened (``state.<fqn>.<name>``, ``param_groups.<fqn>.<hparam>``) like
        `get_optimizer_state_dict(..., flatten_optimizer_state_dict=True)` gives for FSDP2: DTensor slices."""
        from torch.distributed.checkpoint.state_dict import _init_optim_state

        self.wait_parameters()
        self._rebind_self_sharded()
        _init_optim_state(self.inner)  # a fresh optimizer has no state tensors to load into yet
        out: dict[str, Any] = {}
        fqn_of_master = {id(m): self.fqn[pid] for pid, m in self._shard_of.items()}
        for group in self.optimizer.param_groups:
            for master in group["params"]:
                fqn = fqn_of_master[id(master)]
                for name, value in self.inner.state.get(self._local_of[id(master)], {}).items():
                    out[f"state.{fqn}.{name}"] = self._state_view(master, value)
                for k, v in group.items():
                    if k != "params":
                        out[f"param_groups.{fqn}.{k}"] = v
        return out

    @torch.no_grad()
    def load_sharded_state_dict(self, state: dict[str, Any]) -> None:
        """Apply a dict from :meth:`sharded_state_dict` that DCP has filled in place (or re-sliced)."""
        self.wait_parameters()
        self._rebind_self_sharded()
        fqn_of_master = {id(m): self.fqn[pid] for pid, m in self._shard_of.items()}
        for group in self.optimizer.param_groups:
            for master in group["params"]:
                fqn = fqn_of_master[id(master)]
                slot = self.inner.state.setdefault(self._local_of[id(master)], {})
                prefix = f"state.{fqn}."
                for key, value in state.items():
                    if not key.startswith(prefix):
                        continue
                    name = key[len(prefix):]
                    local = value.to_local() if isinstance(value, DTensor) else value
                    current = slot.get(name)
                    if isinstance(current, torch.Tensor) and isinstance(local, torch.Tensor) \
                            and current.shape == local.shape and current.dim() > 0:
                        if current.data_ptr() != local.data_ptr():
                            current.copy_(local)
                    else:
                        slot[name] = local
            first = fqn_of_master[id(group["params"][0])] if group["params"] else None
            if first is not None:
                for key, value in state.items():
                    if key.startswith(f"param_groups.{first}."):
                        group[key[len(f"param_groups.{first}."):]] = value

    def master_state_dict(self) -> dict[str, DTensor]:
        """FQN -> fp32 master slice (DTensor): the exact weights, for sharded checkpoints."""
        self.wait_parameters()
        return {self.fqn[pid]: master for pid, master in self._shard_of.items()}

    @torch.no_grad()
    def refresh_masters_from_parameters(self) -> None:
        """After parameters were loaded directly (e.g. a single-file checkpoint), re-slice the masters."""
        self.wait_parameters()
        self._copy_self_sharded(to_masters=True)
        for bucket, master in zip(self.buckets, self.masters):
            for s in bucket.slices:
                bucket.local_view(master, s).copy_(s.rows_of(s.param.detach()))

    def state_dict(self) -> dict[str, Any]:
        raise RuntimeError(
            "A ZeRO-1 DistributedOptimizer holds only this rank's slices; use the strategy's sharded checkpoints "
            "(trainer.save_checkpoint) or `sharded_state_dict()` with torch.distributed.checkpoint."
        )

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a full (unsharded) torch optimizer state dict, e.g. from a ZeRO-0 single-file checkpoint."""
        groups = state_dict["param_groups"]
        if len(groups) != len(self.optimizer.param_groups) or any(
            len(g["params"]) != len(mine["params"]) for g, mine in zip(groups, self.optimizer.param_groups)
        ):
            raise ValueError(
                "The optimizer state does not match this optimizer's param groups (group count or sizes differ); "
                "resume with the same `configure_optimizers`."
            )
        self._rebind_self_sharded()
        by_master = {id(m): self.grad_buckets.slice_of[pid][1] for pid, m in self._shard_of.items()
                     if pid not in self.self_sharded}
        for saved, mine in zip(groups, self.optimizer.param_groups):
            mine.update({k: v for k, v in saved.items() if k != "params"})
            for index, master in zip(saved["params"], mine["params"]):
                s = by_master.get(id(master))
                entry = {}
                for name, value in state_dict["state"].get(index, {}).items():
                    if s is None and isinstance(value, torch.Tensor) and value.shape == master.shape and master.dim():
                        value = _local_part(value, master)  # FSDP2's shard of a full state tensor
                    elif s is not None and isinstance(value, torch.Tensor) and value.shape == s.param.shape \
                            and s.param.dim():
                        value = s.rows_of(value).to(torch.float32).contiguous()
                    elif isinstance(value, torch.Tensor):
                        value = value.clone()
                    entry[name] = value
                self.inner.state[self._local_of[id(master)]] = entry

    def __repr__(self) -> str:
        return f"DistributedOptimizer(dp={self.dp}, buckets={len(self.buckets)}, inner={self.inner!r})"


def _local_part(full: torch.Tensor, sharded: DTensor) -> torch.Tensor:
    """This rank's part of a full tensor laid out as `sharded` (an FSDP2 parameter), fp32: every rank holds `full`,
    so each slices its own (``src_data_rank=None``: no communication)."""
    full = full.to(device=sharded.to_local().device, dtype=torch.float32)
    return distribute_tensor(full, sharded.device_mesh, sharded.placements, src_data_rank=None).to_local().contiguous()
