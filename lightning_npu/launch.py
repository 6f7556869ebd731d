"""Start N real local processes the way torchrun does, and collect what each returns.

Lightning's `LightningEnvironment` sees `LOCAL_RANK`/`WORLD_SIZE` in the environment and
treats the processes as externally launched, exactly as under torchrun. Tests, benchmarks
and notebooks use this to run `Trainer(devices=N, ...)` without re-executing a script.
"""

from __future__ import annotations

import os
import socket
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(
    local_rank: int, fn: Callable[..., Any], world_size: int, port: int, out_dir: str, threads: int, args: tuple
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(world_size),
        RANK=str(local_rank),
        LOCAL_RANK=str(local_rank),
        LOCAL_WORLD_SIZE=str(world_size),
        GROUP_RANK="0",
        NODE_RANK="0",
    )
    torch.set_num_threads(threads)
    result = fn(*args)
    torch.save(result, Path(out_dir) / f"rank{local_rank}.pt")


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, threads: int | None = None) -> list[Any]:
    """Run `fn(*args)` in `world_size` fresh processes; returns each rank's return value.

    `fn` must be importable (module level). A failing rank raises here with its traceback.
    """
    if threads is None:
        threads = max(1, (os.cpu_count() or 1) // world_size)
    with tempfile.TemporaryDirectory(prefix="lnpu-spawn-") as out_dir:
        mp.start_processes(
            _worker,
            args=(fn, world_size, free_port(), out_dir, threads, args),
            nprocs=world_size,
            join=True,
            start_method="spawn",
        )
        return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]
