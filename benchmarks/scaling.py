"""Data-parallel scaling on the example GPT: ddp vs ZeRO 0/1/2/3, and tp=2 vs Lightning's ModelParallelStrategy.

    python benchmarks/scaling.py [--steps 6] [--warmup 2] [--repeats 3] [--arms ddp zero1 ...]
    python benchmarks/scaling.py --collectives      # gloo: all-reduce vs reduce-scatter vs all-gather, per size
    python benchmarks/scaling.py --profile          # also each step's split from torch.profiler

Each repeat is one launch of 2 processes (gloo) running every 2-process arm one after the other, the arms' order
rotating each repeat (a slow minute of the shared machine hits every arm alike), and a 1-process launch, before or
after it in turn, for the baseline at the same per-rank batch (1 thread, as each of the 2 ranks has: Lightning's
launcher would give the one process both cores, so `Recorder` pins it back). fp32, AdamW, GPT 4 layers d=256 T=128.

ZeRO-1's choices have benchmark-only arms (`VARIANTS`: ``zero1_allreduce``, ``zero1_no_overlap``,
``zero1_bucket4``), reported with their ratio to ``zero1`` (``over_zero1``, ``over_zero1_cpu``).

- ``ddp``: Lightning's ``"ddp"``; ``zero0`` .. ``zero3``: ``NPUHybridStrategy(zero_stage=S)`` at dp=2;
  ``tp2``: ``NPUHybridStrategy(tensor_parallel_size=2, zero_stage=0)``; ``model_parallel``: Lightning's
  ``ModelParallelStrategy(tensor_parallel_size=2)`` with the hand-written plan of benchmarks/tensor_parallel.py.
- ``step_ms``: median over steps (pooled over repeats) of the slowest rank's wall time of a step; ``cpu_ms`` the
  busiest rank's process CPU time (less sensitive to other jobs on the cores).
- ``weak_scaling_efficiency`` = tokens/s of the arm ÷ (world × tokens/s of one process at the same per-rank batch)
  (for tp2 the per-rank batch is the whole batch: both ranks see it). 1.0: communication fully hidden.
- ``split_ms``: ``optimizer`` (median wall time from ``on_before_optimizer_step`` to the step's end),
  ``compute`` (the 1-process arm's forward + backward, same per-rank batch, nothing to wait for) and
  ``exposed_comm`` (this arm's forward + backward, slowest rank, minus that: every wait on communication the
  step does not hide: DDP's, ZeRO's bucket reductions, the overlapped parameter all-gather), from timers.
- ``profile_split_ms`` (``--profile``): the same split from torch.profiler's events on every rank (`split_steps`:
  CPU activity only, no stacks/shapes/memory, a schedule over the timed steps; this configuration runs on 2 gloo
  processes), median over steps and ranks: ``compute``, ``exposed_comm`` (in a ``c10d::`` or functional-collective call, or waiting while a
  ``gloo:`` collective runs), ``optimizer``, ``other`` (Python between ops), ``step``. The profiler slows the
  steps: compare the step times of profiled runs only with each other.

The machine is shared: the load average is recorded before and after (``environment.load_average`` and
``load_after``). Writes benchmarks/results/scaling.json.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning as L  # noqa: E402
import torch  # noqa: E402

from benchmarks._common import environment, write_json  # noqa: E402
from benchmarks._env import load_average  # noqa: E402
from lightning_npu.launch import spawn  # noqa: E402

MODEL = dict(n_layer=4, n_head=8, n_embd=256, block_size=128, vocab_size=256, bias=False)
PER_RANK_BATCH = 4
DP_ARMS = ["ddp", "zero0", "zero1", "zero2", "zero3"]
TP_ARMS = ["tp2", "model_parallel"]


# benchmark-only ZeRO-1 variants (``--arms zero1 zero1_allreduce ...``): what each default was chosen against
VARIANTS: dict[str, dict[str, Any]] = {
    "zero1_allreduce": {"inplace_reduction": "all_reduce"},  # gloo's in-place buckets all-reduced (before #31's a2a)
    "zero1_no_overlap": {"defer_gather": False},  # the parameter all-gather waited for right after the step
    "zero1_bucket4": {"strategy": {"bucket_size_mb": 4.0}},
}


def _set_variant(variant: dict[str, Any]) -> None:
    """Set (or, with ``{}``, reset) the class-level choices a variant changes; each arm runs in the same process."""
    from lightning_npu.parallel.data_parallel.sync import GradientBuckets

    GradientBuckets.inplace_reduction = variant.get("inplace_reduction", "all_to_all")


class _NoDeferredGather(L.Callback):
    """``zero1_no_overlap``: ZeRO-1 waits for its parameter all-gather inside the step."""

    def on_train_start(self, trainer, pl_module) -> None:
        for opt in trainer.strategy.optimizers:
            if hasattr(opt, "defer_gather"):
                opt.defer_gather = False


class Recorder(L.Callback):
    """Per step after `warmup`: wall and process-CPU time, and the wall time up to ``on_before_optimizer_step``
    (forward and backward with every wait on communication: DDP's, ZeRO's bucket reductions, the overlapped
    parameter all-gather) and after it (the optimizer step)."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.threads = torch.get_num_threads()  # the launch's (`spawn(..., threads=1)`)
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self.fwd_bwd: list[float] = []
        self.optimizer: list[float] = []

    def on_fit_start(self, trainer, pl_module) -> None:
        # Lightning's launcher sets torch's threads to cpu_count / processes (2 for the one-process baseline on this
        # 2-core machine): keep the launch's (1), so that the baseline computes as each of the 2 ranks does
        torch.set_num_threads(self.threads)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._t0, self._c0 = time.perf_counter(), time.process_time()
        self._t1 = None

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self._t1 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        t, c = time.perf_counter(), time.process_time()
        if trainer.global_step - 1 >= self.warmup and self._t1 is not None:
            self.wall.append(t - self._t0)
            self.cpu.append(c - self._c0)
            self.fwd_bwd.append(self._t1 - self._t0)
            self.optimizer.append(t - self._t1)


class ProfileSplit(L.Callback):
    """``--profile``: torch.profiler over the timed steps (CPU activity only: no stacks, shapes or memory, a schedule
    skipping `warmup` steps), and from its events each step's split of the main thread's time (`split_step`)."""

    def __init__(self, warmup: int, steps: int) -> None:
        self.warmup, self.steps = warmup, steps
        self.split: list[dict[str, float]] = []

    def on_train_start(self, trainer, pl_module) -> None:
        from torch.profiler import ProfilerActivity, profile, schedule

        self.prof = profile(activities=[ProfilerActivity.CPU], record_shapes=False, with_stack=False,
                            profile_memory=False, acc_events=True,
                            schedule=schedule(wait=0, warmup=self.warmup, active=self.steps, repeat=1))
        self.prof.__enter__()

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        # the optimizer's part of the step, as the timers take it: Lightning runs forward and backward as a closure
        # inside ``optimizer.step`` (torch's ``Optimizer.step#`` range holds them under "ddp")
        self._range = torch.autograd.profiler.record_function("split:optimizer")
        self._range.__enter__()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if getattr(self, "_range", None) is not None:
            self._range.__exit__(None, None, None)
            self._range = None
        if trainer.global_step < self.warmup + self.steps:
            self.prof.step()
            return
        # the last step: stop while no collective is in flight. ZeRO-1's parameter all-gather, launched under the
        # profiler and waited after it stopped (fit's end), crashed the process (SIGSEGV in the wait)
        for opt in trainer.strategy.optimizers:
            getattr(opt, "wait_parameters", lambda: None)()
        self.prof.step()
        self.prof.__exit__(None, None, None)
        self.split = split_steps(self.prof.events())


# collectives as the main thread sees them: c10d's ops, and the functional collectives DTensor issues (tensor
# parallelism's all-reduces and their ``wait_tensor``, where the main thread blocks)
_COMM = ("c10d::", "_c10d_functional::", "c10d_functional::")


def split_steps(events: Any) -> list[dict[str, float]]:
    """Each profiled step (a ``ProfilerStep`` range) of the main thread (the one running the steps), in ms, by what
    the main thread is doing at each instant, first match wins:

    - ``exposed_comm``: inside a ``c10d::`` call (a blocking collective, or launching an async one) or a functional
      collective's (``_c10d_functional::all_reduce`` / ``wait_tensor``: DTensor's tp all-reduces), or between
      ops while a ``gloo:`` collective runs on gloo's threads (the main thread waits for it: DDP's reducer, a
      bucket's ``wait``, the all-gather's pre-forward hook);
    - ``optimizer``: from ``on_before_optimizer_step`` to the step's end (a ``split:optimizer`` range: the
      optimizer step, ZeRO-1's parameter all-gather launch; torch's ``Optimizer.step#`` range holds Lightning's
      closure, forward and backward included);
    - ``compute``: inside any other op (``aten::``, autograd nodes): forward and backward;
    - ``other``: none of these (Python and Lightning between ops, with no collective in flight).
    """
    steps = [e for e in events if e.name.startswith("ProfilerStep")]
    if not steps:
        return []
    main = steps[0].thread
    mine = [e for e in events if e.thread == main and not e.name.startswith("ProfilerStep")]
    comm_calls = [(e.time_range.start, e.time_range.end) for e in mine if e.name.startswith(_COMM)]
    optim = [(e.time_range.start, e.time_range.end) for e in mine if e.name == "split:optimizer"]
    ops = [(e.time_range.start, e.time_range.end) for e in mine
           if not e.name.startswith((*_COMM, "Optimizer.", "gloo:", "split:"))]
    in_flight = [(e.time_range.start, e.time_range.end) for e in events if e.thread != main
                 and e.name.startswith("gloo:")]
    kinds = [("exposed_comm", comm_calls), ("optimizer", optim), ("compute", ops), ("exposed_comm", in_flight)]
    out = []
    for step in steps:
        lo, hi = step.time_range.start, step.time_range.end
        points = sorted({lo, hi} | {t for _, spans in kinds for a, b in spans for t in (a, b) if lo < t < hi})
        split = dict.fromkeys(("compute", "exposed_comm", "optimizer", "other"), 0.0)
        covered = [(kind, _union([(max(a, lo), min(b, hi)) for a, b in spans if a < hi and b > lo]))
                   for kind, spans in kinds]
        for a, b in zip(points, points[1:]):
            mid = (a + b) / 2
            kind = next((k for k, spans in covered if _inside(spans, mid)), "other")
            split[kind] += (b - a) / 1e3  # us -> ms
        split["step"] = (hi - lo) / 1e3
        out.append(split)
    return out


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    merged: list[list[float]] = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def _inside(spans: list[tuple[float, float]], t: float) -> bool:
    import bisect

    i = bisect.bisect_right(spans, (t, float("inf"))) - 1
    return i >= 0 and spans[i][0] <= t < spans[i][1]


def _arm(name: str, steps: int, warmup: int, profile: bool = False) -> dict[str, Any]:
    from examples.gpt.data import TextDataModule
    from examples.gpt.model import GPTModule
    from lightning_npu import NPUHybridStrategy

    os.environ["WORLD_SIZE"] = os.environ.get("LNPU_BENCH_WORLD", os.environ.get("WORLD_SIZE", "1"))
    _set_variant({})
    L.seed_everything(0, verbose=False)
    devices = int(os.environ["WORLD_SIZE"])
    model: Any = GPTModule(**MODEL)
    if name == "ddp":
        strategy: Any = "ddp"
    elif name in VARIANTS:  # ZeRO-1 with one choice changed, to measure it against the default
        strategy = NPUHybridStrategy(zero_stage=1, **VARIANTS[name].get("strategy", {}))
        _set_variant(VARIANTS[name])
    elif name.startswith("zero"):
        strategy = NPUHybridStrategy(zero_stage=int(name[-1]))
    elif name == "tp2":
        strategy = NPUHybridStrategy(tensor_parallel_size=2, zero_stage=0)
    elif name == "model_parallel":
        from lightning.pytorch.strategies import ModelParallelStrategy

        from benchmarks.tensor_parallel import _hand_tp_module

        strategy = ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2)
        model = _hand_tp_module()(**MODEL)
    else:  # "single": one process
        strategy = NPUHybridStrategy()
    recorder = Recorder(warmup)
    profiler = ProfileSplit(warmup, steps) if profile else None
    data = TextDataModule(block_size=MODEL["block_size"], batch_size=PER_RANK_BATCH, shuffle=False)
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, precision="32-true",
                        max_steps=warmup + steps, limit_val_batches=0, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[recorder] + ([_NoDeferredGather()] if name == "zero1_no_overlap" else [])
                        + ([profiler] if profiler is not None else []))
    trainer.fit(model, datamodule=data)
    return {"wall": recorder.wall, "cpu": recorder.cpu, "fwd_bwd": recorder.fwd_bwd, "optimizer": recorder.optimizer,
            "loss": float(trainer.callback_metrics["train_loss"]),
            "profile": profiler.split if profiler is not None else []}


def _worker(arms: list[str], repeat: int, steps: int, warmup: int, profile: bool = False) -> dict[str, Any]:
    """Every arm once, in an order rotated by `repeat` (and reversed every other repeat)."""
    os.environ["LNPU_BENCH_WORLD"] = os.environ["WORLD_SIZE"]
    out: dict[str, list[dict]] = {a: [] for a in arms}
    order = arms[repeat % len(arms):] + arms[: repeat % len(arms)]
    for arm in (order if repeat % 2 == 0 else order[::-1]):
        out[arm].append(_arm(arm, steps, warmup, profile))
    return {"runs": out}


def _merge(parts: list[list[dict]]) -> list[dict]:
    """Per rank, the runs of several launches (one per repeat) as if from one."""
    merged = [{"runs": {}} for _ in parts[0]]
    for part in parts:
        for rank, result in zip(merged, part):
            for arm, runs in result["runs"].items():
                rank["runs"].setdefault(arm, []).extend(runs)
    return merged


def _collectives(sizes_mib: list[float], iters: int) -> dict[str, Any]:
    """Median ms of each way to move one fp32 bucket of each size over the world (gloo), every op per iteration in
    an order that alternates, after a barrier. The ZeRO-1 bucket is parameter-major (``p.grad`` views), so a
    reduce-scatter from it first packs this rank's send buffer rank-major (``pack``: one copy of the bucket):

    - ``all_reduce``: in place (DDP's and ZeRO-1's former gloo path);
    - ``reduce_scatter``: ``reduce_scatter_tensor`` (gloo's own);
    - ``reduce_scatter_a2a``: ``all_to_all_single`` of the rank-major buffer, then this rank's parts summed locally
      (the bytes of a ring reduce-scatter); ``..._packed``: with the pack copy in front, and the SUM written into
      a strided view (what ZeRO-1 does);
    - ``reduce_scatter_a2a_peers``: only the other ranks' rows packed and sent (uneven splits, 0 to itself), the
      received parts added in place into this rank's rows of the bucket (what ZeRO-1 does on gloo);
    - ``all_gather``: ``all_gather_into_tensor``; ``all_gather_list``: ``dist.all_gather`` into views of one buffer;
    - ``rs_a2a_plus_ag``: ZeRO-1's whole step, packed reduce-scatter + all-gather, against ``all_reduce``
      (DDP's) and ``all_reduce_plus_ag`` (ZeRO-1's gloo path before).
    """
    import torch
    import torch.distributed as dist

    from lightning_npu.parallel.collectives import all_gather_into, reduce_scatter_into

    world = dist.get_world_size()
    rank = dist.get_rank()
    out: dict[str, Any] = {}
    for mib in sizes_mib:
        n = int(mib * 2**20 / 4) // world * world
        x = torch.randn(n)
        bucket = torch.randn(n)  # parameter-major: pack copies it rank-major (one copy, as torch._chunk_cat)
        send = torch.empty(n)
        recv = torch.empty(n)
        part = torch.empty(n // world)
        # P parameters of `world` x m elements each (a 256 x 256 weight at dp=2: m = 32768), parameter-major
        m = 2**15 if n % (world * 2**15) == 0 else n // world
        by_param = bucket.view(-1, world, m)

        def pack() -> None:
            send.view(world, -1, m).copy_(by_param.transpose(0, 1))  # this rank's rows of every parameter, rank-major
        full = torch.empty(n)
        views = list(full.view(world, -1).unbind(0))

        def rs_a2a() -> None:
            dist.all_to_all_single(recv, send)
            torch.sum(recv.view(world, -1), dim=0, out=part)

        def rs_a2a_packed() -> None:
            pack()
            dist.all_to_all_single(recv, send)
            torch.sum(recv.view(world, -1), dim=0, out=part)
            by_param[:, rank].copy_(part.view(-1, m))  # the SUM back into this rank's rows of the bucket

        # only the peers' rows travel: this rank's own rows stay in the bucket, the SUM is added into them in place
        peers = torch.empty((world - 1) * (n // world))
        got = torch.empty_like(peers)
        splits = [0 if r == rank else n // world for r in range(world)]
        others = [r for r in range(world) if r != rank]

        def rs_a2a_peers() -> None:
            for i, r in enumerate(others):
                peers.view(world - 1, -1, m)[i].copy_(by_param[:, r])
            dist.all_to_all_single(got, peers, splits, splits)
            own = by_param[:, rank]
            for i in range(world - 1):
                own.add_(got.view(world - 1, -1, m)[i])

        ops = {"all_reduce": lambda: dist.all_reduce(x),
               "reduce_scatter_a2a_peers": rs_a2a_peers,
               "reduce_scatter": lambda: reduce_scatter_into(part, x),
               "reduce_scatter_a2a": rs_a2a,
               "reduce_scatter_a2a_packed": rs_a2a_packed,
               "all_gather": lambda: all_gather_into(full, part),
               "all_gather_list": lambda: dist.all_gather(views, part),
               "pack": pack}
        row: dict[str, float] = {}
        for _ in range(2):  # warm-up
            for op in ops.values():
                op()
        times: dict[str, list[float]] = {k: [] for k in ops}
        for i in range(iters):
            names = list(ops)
            names = names[i % len(names):] + names[:i % len(names)]
            for name in (names if i % 2 == 0 else names[::-1]):
                dist.barrier()
                t0 = time.perf_counter()
                ops[name]()
                times[name].append(1e3 * (time.perf_counter() - t0))
        for name, ts in times.items():
            row[f"{name}_ms"] = statistics.median(ts)
        row["rs_a2a_packed_plus_ag_ms"] = row["reduce_scatter_a2a_packed_ms"] + row["all_gather_ms"]
        row["rs_a2a_peers_plus_ag_ms"] = row["reduce_scatter_a2a_peers_ms"] + row["all_gather_ms"]
        row["all_reduce_plus_ag_ms"] = row["all_reduce_ms"] + row["all_gather_ms"]
        out[f"{mib:g}MiB"] = row
    return out


def _collectives_worker(sizes: list[float], iters: int) -> dict[str, Any]:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        return _collectives(sizes, iters)
    finally:
        dist.destroy_process_group()


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6, help="timed steps per arm and repeat")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--arms", nargs="*", default=DP_ARMS + TP_ARMS)
    parser.add_argument("--collectives", action="store_true", help="only time gloo's collectives")
    parser.add_argument("--iters", type=int, default=15, help="--collectives: timed iterations per op and size")
    parser.add_argument("--out", default="scaling.json")
    parser.add_argument("--profile", action="store_true",
                        help="also split each step from torch.profiler's events (`profile_split_ms`; slows the steps)")
    args = parser.parse_args()

    if args.collectives:
        sizes = [1.0, 4.0, 12.0, 16.0]
        load_before = load_average()
        result = spawn(_collectives_worker, 2, sizes, args.iters, threads=1)[0]
        path = write_json("scaling_collectives.json", {"benchmark": "scaling --collectives", "world": 2,
                                                       "backend": "gloo", "threads_per_rank": 1,
                                                       "iterations": args.iters, "load_before": load_before,
                                                       "load_after": load_average(), "median_ms": result})
        for size, row in result.items():
            print(size, "  ".join(f"{k} {v:.2f}" for k, v in row.items()))
        print(f"wrote {path}")
        return

    started = time.time()
    env = environment()
    singles, twos = [], []
    for r in range(args.repeats):  # the 1-process baseline alternates with the 2-process launches too
        launches = [lambda: singles.append(spawn(_worker, 1, ["single"], r, args.steps, args.warmup, args.profile,
                                                 threads=1)),
                    lambda: twos.append(spawn(_worker, 2, args.arms, r, args.steps, args.warmup, args.profile,
                                              threads=1))]
        for launch in (launches if r % 2 == 0 else launches[::-1]):
            launch()
    single, two = _merge(singles)[0], _merge(twos)
    tokens = PER_RANK_BATCH * MODEL["block_size"]

    def row(ranks: list[dict], arm: str, world: int, global_batch_ranks: int) -> dict[str, Any]:
        walls, cpus, fwd_bwd, optim = [], [], [], []
        for rep in range(len(ranks[0]["runs"][arm])):
            per_rank = [r["runs"][arm][rep] for r in ranks]
            walls += [max(ts) for ts in zip(*(p["wall"] for p in per_rank))]
            cpus += [max(ts) for ts in zip(*(p["cpu"] for p in per_rank))]
            fwd_bwd += [max(ts) for ts in zip(*(p["fwd_bwd"] for p in per_rank))]
            optim += [max(ts) for ts in zip(*(p["optimizer"] for p in per_rank))]
        step, cpu = _median(walls), _median(cpus)
        tps = tokens * global_batch_ranks / step
        profiled = [split for r in ranks for run in r["runs"][arm] for split in run.get("profile", [])]
        extra = {"profile_split_ms": {k: _median([p[k] for p in profiled]) for k in profiled[0]}} if profiled else {}
        return {**extra, "step_ms": 1e3 * step, "cpu_ms": 1e3 * cpu, "tokens_per_s": tps, "tokens_per_cpu_s":
                tokens * global_batch_ranks / cpu, "timed_steps": len(walls), "world": world,
                "forward_backward_ms": 1e3 * _median(fwd_bwd), "optimizer_ms": 1e3 * _median(optim),
                "final_loss": ranks[0]["runs"][arm][-1]["loss"]}

    results = {"single": row([single], "single", 1, 1)}
    for arm in args.arms:
        results[arm] = row(two, arm, 2, 1 if arm in TP_ARMS else 2)
    for arm in args.arms:
        if arm in VARIANTS and "zero1" in results:
            results[arm]["over_zero1"] = results[arm]["tokens_per_s"] / results["zero1"]["tokens_per_s"]
            results[arm]["over_zero1_cpu"] = results[arm]["tokens_per_cpu_s"] / results["zero1"]["tokens_per_cpu_s"]
    base = results["single"]
    for arm, r in results.items():
        r["weak_scaling_efficiency"] = r["tokens_per_s"] / (r["world"] * base["tokens_per_s"])
        r["weak_scaling_efficiency_cpu"] = r["tokens_per_cpu_s"] / (r["world"] * base["tokens_per_cpu_s"])
        # one process at the same per-rank batch computes the same forward/backward with nothing to wait for
        r["split_ms"] = {"compute": base["forward_backward_ms"], "optimizer": r["optimizer_ms"],
                         "exposed_comm": r["forward_backward_ms"] - base["forward_backward_ms"]}

    def ratio(a: str, b: str, key: str = "tokens_per_s") -> Any:
        return results[a][key] / results[b][key] if a in results and b in results else None

    summary = {
        "zero1_over_ddp": ratio("zero1", "ddp"), "zero1_over_ddp_cpu": ratio("zero1", "ddp", "tokens_per_cpu_s"),
        "zero0_over_ddp": ratio("zero0", "ddp"), "zero0_over_ddp_cpu": ratio("zero0", "ddp", "tokens_per_cpu_s"),
        "tp2_over_model_parallel": ratio("tp2", "model_parallel"),
        "tp2_over_model_parallel_cpu": ratio("tp2", "model_parallel", "tokens_per_cpu_s"),
        "efficiency": {arm: r["weak_scaling_efficiency"] for arm, r in results.items()},
    }
    payload = {"benchmark": "scaling", "model": MODEL, "profiled": args.profile, "per_rank_batch": PER_RANK_BATCH,
               "precision": "32-true",
               "optimizer": "AdamW", "steps": args.steps, "warmup": args.warmup, "repeats": args.repeats,
               "environment": env, "load_after": load_average(),
               "wall_s": time.time() - started, "results": results, "summary": summary}
    path = write_json(args.out, payload)
    print(f"load before {env.get('load_average_1_5_15min')} after {payload['load_after']}, {payload['wall_s']:.0f} s")
    print(f"{'arm':16s} {'step ms':>8s} {'cpu ms':>7s} {'tok/s':>7s} {'eff':>5s}  split ms (compute/optimizer/exposed comm)")
    for arm, r in results.items():
        s = r.get("profile_split_ms", r["split_ms"])  # the profiler's where it ran
        print(f"{arm:16s} {r['step_ms']:8.1f} {r['cpu_ms']:7.1f} {r['tokens_per_s']:7.0f} "
              f"{r['weak_scaling_efficiency']:5.3f}  {s['compute']:.0f}/{s['optimizer']:.0f}/{s['exposed_comm']:.0f}"
              + (f" (other {s['other']:.0f}, profiler)" if "other" in s else ""))
    print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in summary.items() if k != "efficiency"})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
