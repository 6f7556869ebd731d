"""The device mesh every parallel feature composes on.

One 3-D mesh with dims ``("pp", "dp", "tp")``, tp innermost so tensor-parallel peers are
neighbouring ranks (same node, fastest links), then dp, then pp outermost, as Megatron orders them.
"""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

MESH_DIMS = ("pp", "dp", "tp")


def build_mesh(device_type: str, pp: int, dp: int, tp: int) -> DeviceMesh:
    return init_device_mesh(device_type, (pp, dp, tp), mesh_dim_names=MESH_DIMS)
