"""Expert parallelism: each MoE layer's experts split over an ``ep`` group carved from the data-parallel ranks.

As in Megatron-core and torchtitan, attention and dense layers stay data-parallel over those ranks; only the experts
are spread. Each rank keeps ``num_experts / ep`` whole experts (rows of the 3-D ``gate_up_proj`` / ``down_proj``,
recorded as ``Shard(0)`` over the ep mesh, so checkpoints, full state dicts and the gradient norm read them as the
experts of the whole model). A layer's forward, registered with transformers' own ``ExpertsInterface`` (the
mechanism its grouped-GEMM kernels use): the tokens' assignments are sorted by expert, sent to the experts' ranks
with one all-to-all, computed by the local experts (a loop over experts, not tokens), sent back with a second
all-to-all, weighted and summed. The router runs on every rank.

Gradients: the all-to-all's backward brings every ep rank's tokens' contributions to the expert's rank, so an
expert's local gradient already sums over its ep group; `ExpertGradientSync` sums it over the ranks that hold the
same experts (``dp / ep`` of them) and divides by dp, the mean a one-process run takes. DDP skips the experts;
under ZeRO-1 the `DistributedOptimizer`'s edp buckets do this reduction, under ZeRO 2/3 FSDP2's expert units.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import _functional_collectives as funcol
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from lightning_npu.parallel.data_parallel.sync import GradientSync
from lightning_npu.parallel.errors import ParallelConfigError
from lightning_npu.parallel.expert_parallel.router_monitor import experts_modules
from lightning_npu.parallel.state import module_state, tensor_state
from lightning_npu.parallel.tensor_parallel.shards import Sharding, sharding_of

IMPLEMENTATION = "lightning_npu_expert_parallel"
PARAMS = ("gate_up_proj", "down_proj")


@dataclass
class ExpertShard:
    """One experts module's part of the ep group: experts ``[first, first + local)`` of `total`."""

    group: Any
    ep: int
    first: int
    local: int
    total: int


def expert_mesh(mesh: DeviceMesh, ep: int) -> DeviceMesh:
    """``(rest, edp, ep, tp)`` over the same ranks as `mesh`: each dp line split into ``dp / ep`` groups of ``ep``
    consecutive dp ranks, tp kept innermost so an expert can be split over ``(ep, tp)`` (collective: every rank
    builds it)."""
    names = tuple(mesh.mesh_dim_names)
    ranks = mesh.mesh.movedim((names.index("dp"), names.index("tp")), (-2, -1))  # [..., dp, tp]
    dp, tp = ranks.shape[-2:]
    lines = ranks.reshape(-1, dp // ep, ep, tp)
    return DeviceMesh(mesh.device_type, lines, mesh_dim_names=("rest", "edp", "ep", "tp"))


def sharded_experts(model: nn.Module) -> list[nn.Module]:
    return [m for m in experts_modules(model).values() if getattr(module_state(m, create=False), "experts", None)]


def expert_parameter_names(model: nn.Module) -> list[str]:
    return [f"{fqn}.{pname}" for fqn, module in experts_modules(model).items()
            if getattr(module_state(module, create=False), "experts", None) is not None for pname in PARAMS]


def apply_expert_parallel(model: nn.Module, mesh: DeviceMesh, ep: int, as_dtensors: bool) -> None:
    """Keep this rank's experts of every MoE layer of `model` (in place), after tensor parallelism.

    An expert already split over tp keeps its tp placement: it becomes ``(Shard(0), tp placement)`` over the
    ``(ep, tp)`` mesh. `as_dtensors` (ZeRO 2/3): the experts are DTensors, which FSDP2 then shards over edp;
    otherwise plain local tensors whose layout `shards.Sharding` records, as tp's local shards are.
    """
    layers = experts_modules(model)
    if not layers:
        raise ParallelConfigError(
            f"`expert_parallel_size={ep}` needs a mixture-of-experts model (transformers' experts modules holding "
            f"3-D gate_up_proj/down_proj), but {type(model).__name__} has none; set expert_parallel_size=1.")
    emesh = expert_mesh(mesh, ep)
    ep_mesh = emesh["ep"]
    rank = ep_mesh.get_local_rank()
    _register()
    for fqn, module in layers.items():
        total = module.num_experts
        if total % ep:
            raise ParallelConfigError(
                f"`expert_parallel_size={ep}` does not divide the {total} experts of {fqn}; choose an "
                f"expert_parallel_size that divides {total}.")
        local = total // ep
        own = module_state(module, create=False)
        tp_locals = getattr(own, "local_params", None)  # tp's plain shards, re-wrapped around forward
        for pname in PARAMS:
            whole = module._parameters[pname]
            tp_layout = sharding_of(whole)
            part = _local(whole).detach()[rank * local:(rank + 1) * local].clone()
            if tp_layout is None:
                layout = Sharding(ep_mesh, (Shard(0),), whole.shape, whole.stride())
            else:
                layout = Sharding(emesh["ep", "tp"], (Shard(0), *tp_layout.placements), tp_layout.shape,
                                  tp_layout.stride)
            if as_dtensors:
                part = DTensor.from_local(part, layout.mesh, layout.placements, run_check=False, shape=layout.shape,
                                          stride=layout.stride)
            shard = nn.Parameter(part, requires_grad=whole.requires_grad)
            if not as_dtensors:
                tensor_state(shard).sharding = layout
            module.register_parameter(pname, shard)
            if tp_locals is not None and pname in tp_locals:
                tp_locals[pname] = shard
        module_state(module).experts = ExpertShard(ep_mesh.get_group(), ep, rank * local, local, total)
        module.config._experts_implementation = IMPLEMENTATION
    module_state(model).expert_mesh = emesh


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _register() -> None:
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    ALL_EXPERTS_FUNCTIONS.register(IMPLEMENTATION, expert_parallel_forward)


def expert_parallel_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' experts forward over the ep group: dispatch, the local experts, combine."""
    shard: ExpertShard = module_state(self).experts
    tokens, k = top_k_index.shape
    expert = top_k_index.reshape(-1)
    order = torch.argsort(expert, stable=True)
    expert = expert[order]
    token = torch.arange(tokens, device=expert.device).repeat_interleave(k)[order]
    weight = top_k_weights.reshape(-1)[order]
    send = torch.bincount(expert // shard.local, minlength=shard.ep)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=shard.group)
    send_sizes, recv_sizes = send.tolist(), recv.tolist()
    x = _all_to_all(hidden_states[token], recv_sizes, send_sizes, shard.group)
    local_expert = torch.empty(sum(recv_sizes), dtype=expert.dtype, device=expert.device)
    dist.all_to_all_single(local_expert, expert.contiguous(), recv_sizes, send_sizes, group=shard.group)
    local_expert -= shard.first
    # the local experts, each on its rows of what was received (a loop over experts, not tokens); FSDP2 hands
    # them back as DTensors over (ep[, tp]): their local parts are this rank's experts
    gate_up_proj, down_proj = _local(self.gate_up_proj), _local(self.down_proj)
    y = torch.zeros_like(x)
    hit = torch.unique(local_expert).tolist()
    for e in hit:
        rows = torch.nonzero(local_expert == e).squeeze(1)
        gate_up = nn.functional.linear(x[rows], gate_up_proj[e])
        out = nn.functional.linear(self._apply_gate(gate_up), down_proj[e])
        y = y.index_add(0, rows, out)
    if len(hit) < shard.local and torch.is_grad_enabled():
        # an expert no token reached still takes part in backward (a zero gradient, as a grouped GEMM gives): every
        # rank of the ep group then runs the backward all-to-all, and each expert's gradient exists on every rank
        # that holds it, so the reductions over edp match
        y = y + 0 * x.sum() + 0 * (gate_up_proj.sum() + down_proj.sum())
    back = _all_to_all(y, send_sizes, recv_sizes, shard.group)
    combined = torch.zeros_like(hidden_states)
    return combined.index_add(0, token, (back * weight[:, None]).to(combined.dtype))


def _all_to_all(t: torch.Tensor, output_sizes: list[int], input_sizes: list[int], group: Any) -> torch.Tensor:
    out = funcol.all_to_all_single_autograd(t.contiguous(), output_sizes, input_sizes, group)
    return funcol.wait_tensor(out)


class ExpertGradientSync(GradientSync):
    """The layout's gradient sync (DDP's, which skips the experts), then the experts': summed over the ranks that
    hold the same experts and divided by dp."""

    def __init__(self, inner: GradientSync, experts: list[nn.Parameter], mesh: DeviceMesh, dp: int) -> None:
        self.inner, self.experts, self.dp = inner, experts, dp
        self.edp_group = mesh["edp"].get_group() if mesh["edp"].size() > 1 else None

    @property
    def compressor(self) -> Any:  # type: ignore[override]
        return self.inner.compressor

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        self.enabled = False
        with self.inner.no_sync():
            yield
        self.enabled = True

    def bind(self, optimizers: list[Any], pipeline: Any = None) -> None:
        self.inner.bind(optimizers, pipeline)

    def release(self) -> None:
        self.inner.release()

    @torch.no_grad()
    def finish(self) -> None:
        self.inner.finish()
        for p in self.experts:
            if p.grad is None:
                continue
            if self.edp_group is not None:
                dist.all_reduce(p.grad, group=self.edp_group)
            p.grad.div_(self.dp)
