import os

# One BLAS thread per process keeps multi-process runs on a 2-core machine from thrashing.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest

_DIST_ENV = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
             "NODE_RANK")


@pytest.fixture(autouse=True)
def _no_leaked_process_group():
    """A test that trains in this process (devices=1) leaves Lightning's MASTER_PORT in os.environ and its
    process group (a listening TCPStore) alive; a later `lightning-npu fit` subprocess would inherit the port
    and fail with EADDRINUSE. Restore the environment and destroy the group after every test."""
    saved = {k: os.environ.get(k) for k in _DIST_ENV}
    yield
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
