"""Standalone reproducer: a gloo rank aborts at interpreter exit after its work is done (torch 2.13, CPU).

Plain torch.distributed, no Lightning and no lightning_npu: two processes started the way torchrun starts
them (env:// rendezvous), a few collectives on the default group and on sub-groups (as a DeviceMesh
creates them), then the script returns without ``destroy_process_group`` -- what Lightning does, since
it never destroys the groups it creates. Some runs end with ``terminate called without an active
exception`` and SIGABRT (exit -6) while the interpreter tears down, although every rank finished.

    python benchmarks/gloo_exit_abort.py --runs 40            # count aborts as Lightning leaves the groups
    python benchmarks/gloo_exit_abort.py --runs 40 --destroy  # the mitigation: barrier, then destroy

The mitigation used by lightning_npu (``strategy._destroy_process_groups_at_exit``: a monitored barrier
then ``destroy_process_group`` in an atexit hook; ``launch.spawn`` leaves through ``os._exit``) is the
``--destroy`` variant.

Measured here (2 shared CPU cores, torch 2.13.0+cpu, Python 3.11, world 2), runs in which a rank exited -6
with "terminate called without an active exception" on stderr:

    without the mitigation   1/3, 1/40, 10/60 and 5/15 in four batches: 17/118 (about 1 in 7)
    with --destroy           0/40 and 0/40: 0/80

The rate swings between batches (with the load on the cores), so it is a rate, not a deterministic failure;
the abort comes after "rank N done" is printed, i.e. in interpreter teardown.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker(destroy: bool) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    # sub-groups as a ("pp", "dp", "tp") DeviceMesh creates them, each used once
    groups = [dist.new_group([r]) for r in range(world)] + [dist.new_group(list(range(world)))]
    x = torch.ones(1024) * (rank + 1)
    for _ in range(20):
        dist.all_reduce(x)
        x /= world
    for g in groups:
        if rank in dist.get_process_group_ranks(g):
            dist.all_reduce(torch.ones(8), group=g)
    dist.broadcast(x, src=0)
    dist.barrier()
    if destroy:
        dist.monitored_barrier()
        dist.destroy_process_group()
    print(f"rank {rank} done", flush=True)
    # return normally: the interpreter tears down the process groups (and gloo's threads)


def one_run(destroy: bool, world: int, timeout: float) -> list[int]:
    port = _free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                   WORLD_SIZE=str(world), LOCAL_RANK=str(rank), OMP_NUM_THREADS="1")
        cmd = [sys.executable, __file__, "--worker"] + (["--destroy"] if destroy else [])
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
    codes = []
    for p in procs:
        try:
            _, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
        codes.append(p.returncode)
        if p.returncode not in (0,) and os.environ.get("GLOO_EXIT_VERBOSE"):
            sys.stderr.write(err.decode(errors="replace")[-600:])
    return codes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=40)
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--destroy", action="store_true", help="barrier + destroy_process_group before exit")
    ap.add_argument("--timeout", type=float, default=120.0)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.destroy)
        return
    import torch

    aborted = failed = 0
    t0 = time.time()
    for i in range(args.runs):
        codes = one_run(args.destroy, args.world, args.timeout)
        if any(c == -signal.SIGABRT for c in codes):
            aborted += 1
        elif any(c != 0 for c in codes):
            failed += 1
        print(f"run {i + 1}/{args.runs}: exit codes {codes}", flush=True)
    print(f"torch {torch.__version__}, world {args.world}, destroy={args.destroy}: "
          f"{aborted}/{args.runs} runs aborted (SIGABRT), {failed} failed otherwise, {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
