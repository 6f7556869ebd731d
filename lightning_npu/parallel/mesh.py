"""The device mesh every parallel feature composes on.

One mesh with dims ``("pp", "dp", "tp")``, tp innermost so tensor-parallel peers are
neighbouring ranks (same node, fastest links), then dp, then pp outermost, as Megatron orders them.
Under context parallelism (cp > 1) a ``cp`` dim sits between dp and tp, ``("pp", "dp", "cp", "tp")``,
and ``dp`` x ``cp`` is also flattened into ``dp_cp``: cp ranks hold the same weights but different
tokens, so gradients, ZeRO shards, buffers and metrics reduce over ``dp_cp`` while the sampler reads
``dp`` alone. At cp = 1 the mesh stays 3-D, so no existing process group changes.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_DIMS = ("pp", "dp", "tp")
CP_MESH_DIMS = ("pp", "dp", "cp", "tp")


def build_mesh(device_type: str, pp: int, dp: int, tp: int, cp: int = 1) -> DeviceMesh:
    if cp == 1:
        return init_device_mesh(device_type, (pp, dp, tp), mesh_dim_names=MESH_DIMS)
    mesh = init_device_mesh(device_type, (pp, dp, cp, tp), mesh_dim_names=CP_MESH_DIMS)
    mesh["dp", "cp"]._flatten("dp_cp")  # collective: every rank, same order, before any model exists
    return mesh


def dp_rank_of(mesh_shape: tuple[int, ...], rank: int) -> int:
    """The ``dp`` coordinate of a global rank in `build_mesh`'s layout (`init_device_mesh` lays the ranks out
    row-major over `mesh_shape`), known before any process group exists: Lightning's data connector may ask for the
    sampler's rank before ``Trainer.fit`` initialises the processes (as `DDPStrategy` answers it)."""
    inner = 1
    for size in mesh_shape[2:]:
        inner *= size
    return (rank // inner) % mesh_shape[1]


def has_cp(mesh: DeviceMesh) -> bool:
    return mesh is not None and "cp" in (mesh.mesh_dim_names or ())


def replica_dim(mesh: DeviceMesh) -> str:
    """The name of the dim whose ranks hold replicas of the weights: ``dp_cp`` under cp, else ``dp``."""
    return "dp_cp" if has_cp(mesh) else "dp"


def replica_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The 1-D mesh that gradients, ZeRO/FSDP2 shards, DDP, buffers and metrics reduce over."""
    return mesh[replica_dim(mesh)]
