"""Start N real local processes the way torchrun does, and collect what each returns.

Lightning's `LightningEnvironment` sees `LOCAL_RANK`/`WORLD_SIZE` in the environment and
treats the processes as externally launched, exactly as under torchrun. Tests, benchmarks
and notebooks use this to run `Trainer(devices=N, ...)` without re-executing a script.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.multiprocessing as mp
from lightning.pytorch.strategies.launchers.multiprocessing import _MultiProcessingLauncher
from lightning.pytorch.trainer.states import TrainerFn

from lightning_npu.parallel.checkpoint.full_state import full_state_dict


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Imported once by the fork server, so that a launch costs a fork, not an interpreter start (about 4 s per launch
# with torch, Lightning and transformers on a 2-core CPU host; 0.05 s forked). Only modules the caller already has.
_PRELOAD = ("torch", "lightning", "transformers", "lightning_npu")


def _start_method() -> str:
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    multiprocessing.set_forkserver_preload([m for m in _PRELOAD if m in sys.modules])  # read at the server's start
    return "forkserver"


def _worker(
    local_rank: int,
    fn: Callable[..., Any],
    world_size: int,
    port: int,
    out_dir: str,
    threads: int,
    args: tuple,
    environ: dict[str, str],
) -> None:
    # a forked child has the fork server's environment, not the caller's at this launch: restore the caller's
    os.environ.clear()
    os.environ.update(environ)
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
    # Leave without interpreter teardown: torch 2.13's gloo can abort a rank while its process groups are
    # destroyed at exit ("terminate called without an active exception"), after all the work is done.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(fn: Callable[..., Any], world_size: int, *args: Any, threads: int | None = None) -> list[Any]:
    """Run `fn(*args)` in `world_size` fresh processes (forked from a fork server that has imported torch once, where
    the platform has one); returns each rank's return value.

    `fn` must be importable (module level). A failing rank raises here with its traceback.
    """
    if threads is None:
        threads = max(1, (os.cpu_count() or 1) // world_size)
    with tempfile.TemporaryDirectory(prefix="lnpu-spawn-") as out_dir:
        try:
            mp.start_processes(
                _worker,
                args=(fn, world_size, free_port(), out_dir, threads, args, dict(os.environ)),
                nprocs=world_size,
                join=True,
                start_method=_start_method(),
            )
        except mp.ProcessExitedException as err:
            # a rank that aborted after saving its result died in teardown, not in `fn`: keep the results
            saved = all((Path(out_dir) / f"rank{r}.pt").exists() for r in range(world_size))
            if not (saved and err.signal_name == "SIGABRT"):
                raise
            warnings.warn(f"lightning_npu.launch.spawn: {err} after every rank returned its result; ignored.")
        # not a checkpoint: any picklable return value of `fn`, written by this call's own workers into a private
        # (0700) temporary directory, so weights_only=False here trusts nothing but this process's children
        return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


class FullStateMultiProcessingLauncher(_MultiProcessingLauncher):
    """Lightning's spawn/fork launcher, handing the main process the trained weights as full tensors in the model's
    original layout (rank 0's own `state_dict` holds only its ZeRO-3/tp shards, or one pipeline stage), so that the
    main process's module is the trained one, as under ``"ddp_spawn"``."""

    def _collect_rank_zero_results(self, trainer: Any, results: Any) -> Any:
        if trainer.state.fn != TrainerFn.FITTING:
            return super()._collect_rank_zero_results(trainer, results)
        state = full_state_dict(trainer.lightning_module)  # a collective: every rank
        output = super()._collect_rank_zero_results(trainer, results)
        if output is not None and output.weights_path is not None:
            self._strategy.checkpoint_io.save_checkpoint(state, output.weights_path)
        return output
