"""Global gradient norm, clipping and the all-reduced overflow decision.

Under hybrid parallelism a parameter's gradient can be replicated (DDP, ZeRO-1, a LayerNorm under
tensor parallelism), sharded (a DTensor with ``Shard`` placements under TP or FSDP2/ZeRO-2/3) or
owned by one pipeline stage. The global L2 norm must count every element exactly once:

* plain tensors are treated as replicated over ``dp`` and ``tp`` and owned by this pipeline stage;
* a sharded parameter's (`tp_shards.sharding_of`, whatever holds the shard)
  local squared sum is all-reduced over exactly the mesh dims it is *sharded* on
  (``Replicate`` dims are not reduced, so replicas are not double-counted; pending ``Partial``
  gradients are reduced first);
* the per-stage sums are then all-reduced over the ``pp`` group (stages hold disjoint parameters).

Everything is accumulated in fp32. The overflow check is one MAX all-reduce over WORLD, so every
rank takes the same skip/step decision (a per-rank decision deadlocks sharded optimizers).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_npu.parallel.state import tensor_state
from lightning_npu.parallel.tensor_parallel.shards import sharding_of

try:  # DTensor is public from torch 2.5
    from torch.distributed.tensor import DTensor, Replicate
except ImportError:  # pragma: no cover
    DTensor = None  # type: ignore[assignment,misc]
    Replicate = None  # type: ignore[assignment,misc]


def _is_dtensor(t: object) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def local_tensor(t: Tensor) -> Tensor:
    """The part of `t` this rank holds (the tensor itself unless it is a DTensor)."""
    return t.to_local() if _is_dtensor(t) else t


def _is_sharded(placement: object) -> bool:
    # FSDP2 (and ZeRO-1) over tensor-parallel dim-0 shards use `_StridedShard`, which is not a `Shard` and whose
    # `is_shard()` is False in torch 2.13: its dim must be reduced over all the same
    return placement.is_shard() or type(placement).__name__ == "_StridedShard"


def _reduced_placements(grad: Tensor) -> Tensor:
    if any(p.is_partial() for p in grad.placements):
        grad = grad.redistribute(grad.device_mesh, [Replicate() if p.is_partial() else p for p in grad.placements])
    return grad


def _global_moments(pairs: Iterable[tuple[Tensor, Optional[Tensor]]], pp_group: Optional[dist.ProcessGroup]) -> Tensor:
    """fp32 ``[sum of squares, sum, element count]`` of the tensors over every rank, each element counted once.

    `pairs` are ``(parameter, tensor)``: the tensor (a gradient or a value, None counts nothing) is sharded
    like its parameter. Every rank of a tp / FSDP group must pass the same parameters in the same order.
    """
    # key: None for replicated tensors, else (mesh, sharded mesh dims); dicts keep first-seen order on every rank
    buckets: dict[object, list[Tensor]] = {}
    meshes: dict[object, tuple] = {}
    device: Optional[torch.device] = None
    for p, t in pairs:
        key = None
        sharding = sharding_of(p)
        if sharding is not None:
            mesh, placements = sharding.mesh, sharding.placements
            shard_dims = tuple(i for i, pl in enumerate(placements) if _is_sharded(pl))
            if shard_dims:
                key = (id(mesh), shard_dims)
                meshes[key] = (mesh, shard_dims)
        bucket = buckets.setdefault(key, [])
        if device is None:
            device = local_tensor(p).device
        if t is None or getattr(tensor_state(p, create=False), "pipeline_copy", False):
            continue  # the last stage's copy of a tied embedding: stage 0 counts it
        if _is_dtensor(t):
            t = _reduced_placements(t).to_local()
        bucket.append(t)
    device = device or torch.device("cpu")
    total = torch.zeros(3, dtype=torch.float32, device=device)
    for key, tensors in buckets.items():
        part = torch.zeros(3, dtype=torch.float32, device=device)
        if tensors:
            norms = torch._foreach_norm(tensors, 2.0, dtype=torch.float32)
            part[0] = torch.stack([n.to(device) for n in norms]).square().sum()
            part[1] = torch.stack([t.sum(dtype=torch.float32).to(device) for t in tensors]).sum()
            part[2] = float(sum(t.numel() for t in tensors))
        if key is not None:
            mesh, shard_dims = meshes[key]
            for dim in shard_dims:
                dist.all_reduce(part, op=dist.ReduceOp.SUM, group=mesh.get_group(dim))
        total = total + part
    if pp_group is not None and dist.get_world_size(pp_group) > 1:
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=pp_group)
    return total


def gradient_statistics(parameters: Iterable[Tensor], pp_group: Optional[dist.ProcessGroup] = None) -> Tensor:
    """fp32 ``[global L2 norm, element variance]`` of the gradients of `parameters` over every rank.

    The one definition that clipping, the logged ``grad_norm`` and the health guards read. Every rank of a
    tensor-parallel / FSDP group must call this with the same parameters in the same order (as optimizers hold
    them); a parameter without a gradient counts nothing.
    """
    sq, total, count = _global_moments(((p, p.grad) for p in parameters), pp_group)
    count = count.clamp(min=1.0)
    mean = total / count
    return torch.stack([sq.sqrt(), sq / count - mean * mean])


def global_norm(parameters: Sequence[Tensor], values: Sequence[Tensor], pp_group: Optional[dist.ProcessGroup] = None) -> Tensor:
    """fp32 global L2 norm of `values`, each sharded like the matching parameter (e.g. weights or updates)."""
    return _global_moments(zip(parameters, values), pp_group)[0].sqrt()


def grad_norm(module: torch.nn.Module, norm_type: Union[float, int, str],
              group_separator: str = "/") -> dict[str, Tensor]:
    """Lightning's ``lightning.pytorch.utilities.grad_norm`` over every rank, in every layout. Collective.

    Same arguments and keys (``grad_{p}_norm/{name}`` per parameter, ``grad_{p}_norm_total``), and on a plain
    replicated gradient the same values. Each gradient counts once whatever holds it: a dp-sharded DTensor
    (ZeRO 1/2/3), a tp shard (a DTensor, or a plain local shard under zero 0/1) or a pipeline stage's (every rank
    returns every stage's entries). The values are identical on every rank, so ``self.log_dict(...,
    sync_dist=True)`` logs them unchanged. Why not Lightning's own: it builds its total with
    ``torch.tensor(list_of_norms)``, which cannot read DTensors (FSDP2's and ZeRO-1's gradients), and a local
    shard's norm is not the parameter's. Call it on every rank, e.g. in ``on_before_optimizer_step``.
    """
    p = float(norm_type)
    if p <= 0:
        raise ValueError(f"`norm_type` must be a positive number or 'inf' (infinity norm). Got {p}")
    named = [(name, param) for name, param in module.named_parameters() if param.grad is not None]
    values = _per_parameter_norms(named, p)
    names = [name for name, _ in named]
    pp_group = pipeline_group(getattr(module, "_device_mesh", None))
    if pp_group is not None:  # stages hold disjoint parameters: every rank gets every stage's entries
        parts: list[Any] = [None] * dist.get_world_size(pp_group)
        dist.all_gather_object(parts, [names, values.cpu().tolist()], group=pp_group)
        names = [n for part in parts for n in part[0]]
        values = torch.tensor([v for part in parts for v in part[1]], dtype=torch.float32, device=values.device)
    norms = {f"grad_{p}_norm{group_separator}{name}": v for name, v in zip(names, values.unbind(0))}
    if norms:
        norms[f"grad_{p}_norm_total"] = values.norm(p)
    return norms


def _reduction_groups(param: Tensor, grad: Tensor) -> tuple[Any, ...]:
    """The process groups a gradient's elements are spread over (each to be summed over once)."""
    groups: dict[int, Any] = {}
    # the gradient's own sharding (dp slices) and its parameter's (tp): the same groups once where they agree
    for sharding in (sharding_of(grad), sharding_of(param)):
        if sharding is not None:
            for i, pl in enumerate(sharding.placements):
                if _is_sharded(pl):
                    group = sharding.mesh.get_group(i)
                    groups.setdefault(id(group), group)
    return tuple(groups.values())


def _per_parameter_norms(named: Sequence[tuple[str, Tensor]], p: float) -> Tensor:
    """fp32 global p-norm of each parameter's gradient: one reduction per set of process groups."""
    inf = math.isinf(p)
    device = local_tensor(named[0][1].grad).device if named else torch.device("cpu")
    local = torch.zeros(len(named), dtype=torch.float32, device=device)
    by_groups: dict[tuple[int, ...], tuple[tuple[Any, ...], list[int]]] = {}
    for i, (_, param) in enumerate(named):
        grad = param.grad
        groups = _reduction_groups(param, grad)
        if _is_dtensor(grad):
            grad = _reduced_placements(grad).to_local()
        if grad.numel():
            n = torch.linalg.vector_norm(grad, p, dtype=torch.float32)
            local[i] = n if inf else n.pow(p)
        by_groups.setdefault(tuple(id(g) for g in groups), (groups, []))[1].append(i)
    op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
    for groups, index in by_groups.values():
        if not groups:
            continue
        idx = torch.tensor(index, device=device)
        part = local.index_select(0, idx)
        for group in groups:
            dist.all_reduce(part, op=op, group=group)
        local.index_copy_(0, idx, part)
    return local if inf else local.pow(1.0 / p)


def pipeline_group(mesh: Optional[Any]) -> Optional[dist.ProcessGroup]:
    """The ``pp`` process group of a device mesh that has one of size > 1 (stages hold disjoint parameters)."""
    if mesh is None or "pp" not in (getattr(mesh, "mesh_dim_names", None) or ()) or mesh["pp"].size() == 1:
        return None
    return mesh["pp"].get_group()


def clip_grads_by_total_norm_(parameters: Iterable[Tensor], max_norm: float, total_norm: Tensor) -> None:
    """Scale gradients by ``min(1, max_norm / (total_norm + 1e-6))`` (torch's `clip_grad_norm_` rule)."""
    grads = [local_tensor(p.grad) for p in parameters if p.grad is not None]
    if not grads:
        return
    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    for (device, dtype), group in _group_by_device_dtype(grads).items():
        torch._foreach_mul_(group, coef.to(device=device, dtype=dtype))


def _group_by_device_dtype(tensors: Iterable[Tensor]) -> dict[tuple[torch.device, torch.dtype], list[Tensor]]:
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return groups


def unscale_and_check_(grads: Iterable[Tensor], inv_scale: float, device: torch.device) -> Tensor:
    """Multiply local gradients by `inv_scale` in place; returns this rank's found-inf flag (1.0/0.0, fp32)."""
    found_inf = torch.zeros(1, dtype=torch.float32, device=device)
    for (dev, _), group in _group_by_device_dtype(local_tensor(g) for g in grads).items():
        flag = torch.zeros(1, dtype=torch.float32, device=dev)
        torch._amp_foreach_non_finite_check_and_unscale_(
            group, flag, torch.full((1,), inv_scale, dtype=torch.float32, device=dev)
        )
        found_inf = torch.maximum(found_inf, flag.to(device))
    return found_inf


def all_ranks_found_inf(found_inf: Tensor) -> bool:
    """One MAX all-reduce over WORLD: True when any rank saw inf/nan. Every rank must call this."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(found_inf, op=dist.ReduceOp.MAX)
    return bool(found_inf.item() > 0)
