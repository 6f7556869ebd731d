"""Hierarchical all-reduce of one gradient bucket: within a node, then across nodes, then within the node again.

Links inside a node (HCCS, NVLink) are several times faster than those between nodes. A flat ring all-reduce
over ``dp`` ranks on ``n`` nodes sends every byte of the bucket over the slow links; reduce-scatter inside the node
first, and each rank only sends its ``1/local`` shard across nodes:

1. intra-node reduce-scatter: each of the node's ``local`` dp ranks holds the node's sum of one shard;
2. inter-node all-reduce of that shard among the ranks with the same position on every node;
3. intra-node all-gather: every rank holds the whole sum again.

The groups are sub-groups of each ``dp`` group of the mesh, built once by every rank in the same order
(`build_hierarchy`, called by the strategy after the mesh). `parallelize` hands it to the layout's all-reduce buckets
(ZeRO 0: DDP's comm hook and the pipeline's buckets), whose `sync.reduce_bucket` calls go through here when the
hierarchy applies. ZeRO 1-3 reduce-scatter their buckets; the hierarchy does not apply to them.

Asynchrony: `HierarchicalAllReduce.all_reduce` returns the last stage's work. Each stage boundary is a
``Work.wait()``, which on NCCL/HCCL only makes the current stream wait (the host goes on, so a bucket still overlaps
backward); on gloo it blocks, so there the three stages run back to back in the caller. All stages are issued from
the caller's thread in bucket order, so every rank issues the same collectives in the same order on each group.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence, Union

import torch
import torch.distributed as dist

from lightning_npu import device as dev
from lightning_npu.parallel.collectives import all_gather_into, reduce_scatter_into
from lightning_npu.parallel.errors import ParallelConfigError

AUTO_MIN_BUCKET_BYTES = 8 * 2**20  # "auto": buckets of at least 8 MiB (the seeds' threshold) go hierarchical

class HierarchicalAllReduce:
    """This rank's intra-node and inter-node groups of its dp group, and the bucket sizes that use them."""

    def __init__(self, intra: Any, inter: Any, local: int, nodes: int, min_bytes: int) -> None:
        self.intra = intra
        self.inter = inter
        self.local = local  # dp ranks per node
        self.nodes = nodes  # nodes the dp group spans
        self.min_bytes = min_bytes
        self.launched = 0  # buckets reduced hierarchically (tests read it to tell which path ran)

    def applies(self, flat: torch.Tensor) -> bool:
        return flat.numel() * flat.element_size() >= self.min_bytes

    def all_reduce(self, flat: torch.Tensor) -> Any:
        """SUM `flat` in place over the dp group in three stages; returns a work to wait on (see module doc)."""
        self.launched += 1
        if self.local == 1:  # one dp rank per node: only the inter-node stage is left
            return dist.all_reduce(flat, group=self.inter, async_op=True)
        numel = flat.numel()
        chunk = math.ceil(numel / self.local)
        padded = chunk * self.local != numel or not flat.is_contiguous()
        buf = flat
        if padded:
            buf = torch.zeros(chunk * self.local, dtype=flat.dtype, device=flat.device)
            buf[:numel].copy_(flat.reshape(-1))
        buf = buf.view(-1)
        shard = torch.empty(chunk, dtype=flat.dtype, device=flat.device)
        reduce_scatter_into(shard, buf, group=self.intra, async_op=True).wait()
        dist.all_reduce(shard, group=self.inter, async_op=True).wait()
        work = all_gather_into(buf, shard, group=self.intra, async_op=True)
        if not padded:
            return work
        work.wait()
        flat.copy_(buf[:numel].view_as(flat))
        return DoneWork(flat)


class DoneWork:
    """A collective's work that is already complete (a synchronous or copied-back result), for callers that wait or
    chain on it as on torch's async work."""

    def __init__(self, value: torch.Tensor) -> None:
        self.value = value

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def get_future(self) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result([self.value])
        return fut


def dp_rank_lists(mesh: Any) -> list[list[int]]:
    """Global ranks of every dp group of a ``("pp", "dp", "tp")`` mesh, each in dp order, in one fixed order."""
    ranks = mesh.mesh  # (pp, dp, tp)
    dp = ranks.shape[1]
    return ranks.permute(0, 2, 1).reshape(-1, dp).tolist()


def build_hierarchy(
    mesh: Any,
    mode: Union[str, bool],
    node_of_rank: Sequence[int],
    min_bytes: int = AUTO_MIN_BUCKET_BYTES,
    pg_options: Any = None,
) -> Optional[HierarchicalAllReduce]:
    """Create the intra- and inter-node sub-groups of every dp group and return this rank's (None: flat). Collective:
    every rank calls it with the same arguments.

    `node_of_rank[r]` is global rank r's node. ``mode="auto"``: only where every dp group spans more than one node with
    more than one dp rank on each, and for buckets of at least `min_bytes`; ``True``: every bucket, and an error where
    the dp groups cannot be split over nodes evenly; ``False``: None.
    """
    if mode is False:
        return None
    groups = dp_rank_lists(mesh)
    dp = len(groups[0])
    by_node: list[dict[int, list[int]]] = []
    for ranks in groups:
        nodes: dict[int, list[int]] = {}
        for r in ranks:
            nodes.setdefault(node_of_rank[r], []).append(r)
        by_node.append(nodes)
    spans = {len(n) for n in by_node}
    sizes = {len(members) for n in by_node for members in n.values()}
    problem = None
    if dp == 1:
        problem = "the data-parallel size is 1: there is nothing to all-reduce"
    elif spans == {1}:
        problem = (f"every data-parallel group (dp={dp}) lies inside one node, so there is no inter-node stage "
                   f"(nodes seen: {sorted(set(node_of_rank))})")
    elif len(spans) != 1 or len(sizes) != 1:
        problem = (f"the dp={dp} ranks of a data-parallel group do not split evenly over nodes "
                   f"({[{n: len(m) for n, m in g.items()} for g in by_node]})")
    if problem is not None:
        if mode is True:
            raise ParallelConfigError(
                f"`hierarchical_allreduce=True`: {problem}. Launch the same number of processes on each of 2+ nodes "
                "(Trainer(num_nodes=N), torchrun --nnodes N) with dp a multiple of the nodes, or use 'auto'/False.")
        return None
    (local,) = sizes
    (nodes_per_group,) = spans
    if mode == "auto" and local == 1:
        return None  # one dp rank per node: the hierarchy is the flat all-reduce with extra groups
    intra_lists = [members for g in by_node for members in g.values()]
    inter_lists = [[members[j] for members in g.values()] for g in by_node for j in range(local)]
    intra, _ = dist.new_subgroups_by_enumeration(intra_lists, pg_options=pg_options)
    inter, _ = dist.new_subgroups_by_enumeration(inter_lists, pg_options=pg_options)
    return HierarchicalAllReduce(intra, inter, local, nodes_per_group, min_bytes if mode == "auto" else 0)


def gather_node_ranks(node_rank: int) -> list[int]:
    """Every global rank's node (one all-gather over the world): robust to any rank numbering a launcher picks."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, int(node_rank))
    return [int(n) for n in out]


def setup_hierarchy(mesh: Any, mode: Union[str, bool], zero_stage: int, num_nodes: int, node_rank: int,
                    device_type: str, bucket_size_mb: float) -> Optional[HierarchicalAllReduce]:
    """The strategy's entry: decide and build the hierarchy for this mesh's dp group (collective); the layout's
    all-reduce buckets get it from `parallelize`."""
    if mode is False or zero_stage != 0:
        return None  # ZeRO 1-3 reduce-scatter (config refuses True there)
    if num_nodes <= 1:
        if mode is True:
            raise ParallelConfigError(
                "`hierarchical_allreduce=True` needs more than one node (Trainer(num_nodes=N) or torchrun --nnodes N, "
                "N >= 2); on one node every link is intra-node: use 'auto' or False.")
        return None
    return build_hierarchy(mesh, mode, gather_node_ranks(node_rank),
                           pg_options=dev.group_options(device_type, bucket_size_mb))
