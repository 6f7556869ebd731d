"""Gradient compression on the wire: step time, bytes per step and exposed communication per mode.

    python benchmarks/communication.py [--quick] [--steps 300] [--timing-steps 60] [--repeats 2]
                                       [--warmup 10] [--nodes2x2 | --no-nodes2x2]
                                       [--out benchmarks/results/communication.json]

The example GPT (AdamW, as shipped) trains under ``NPUHybridStrategy(zero_stage=0, gradient_compression=MODE)`` at
dp=2 and dp=4 (real processes, gloo; each pass is one launch running every mode one after the other), and on
2 nodes x 2 processes (two ``torchrun --nnodes 2 --node-rank {0,1} --master-addr 127.0.0.1`` launches on this
machine). Every arm starts from the same seed and sees the same data. Modes: none, bf16, int8, topk (ratio 0.1),
onebit (``warmup_steps=5``, fp32 first), powersgd (rank 1); all lossy modes with error feedback.

What is measured, per mode, after ``--warmup`` steps (onebit's fp32 warm-up is inside that):

- ``step_ms``: median over steps (pooled over ``--repeats`` passes, the arms' order alternating) of the slowest
  rank's wall time from ``on_train_batch_start`` to ``on_train_batch_end`` (forward, backward with the gradient
  exchange, optimizer step).
- ``payload_bytes``: bytes this rank hands to torch.distributed collectives inside ``grad_sync.reduce_bucket`` per
  step (the gradient traffic only; the tensor's size for all-reduce, the input for all-gather/reduce-scatter),
  counted by wrapping the collectives (``tests/_compression_workers.Wire``). Exact, and the number that must hold.
- ``ring_bytes``: what a ring implementation sends per rank for those calls: all-reduce 2(w-1)/w x size,
  all-gather (w-1) x input, reduce-scatter (w-1)/w x input. All-gather based modes (int8, topk, onebit) grow with
  w, all-reduce based ones (none, bf16, powersgd) do not: at dp=2 both ratios agree; from dp=3 on the all-gather
  modes save less than their payload ratio says.
- ``exposed_comm_ms`` = ``step_ms`` - ``compute_only`` ``step_ms``. ``compute_only`` is the same processes, the
  same model and per-rank batch, in the same launch, with ``reduce_bucket`` replaced by a local no-op (no
  gradient exchange at all; each rank steps on its own gradients). It is the communication time the step does not
  hide behind compute, plus the compression's own compute.

Honest caveats: on a 2-core CPU machine (gloo over loopback; dp=4 runs 4 processes on 2 cores) communication is
cheap and the compression kernels (topk, bit packing, the PowerSGD matmuls) run on the same cores as the model, so the
compressed modes are *not* faster here, and the timings move by several ms with the machine's load (an exposed time
below 0 is that noise). The byte counts are exact and are what carries over to real interconnects. The loss curves
(``communication_loss.png``, dp=2, 300 steps) use AdamW, the example's optimizer: topk, onebit and powersgd end far
above the uncompressed loss there (``tests/test_compression_convergence.py`` asserts bf16/int8 within 3% and records
the others as strict xfails).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import lightning as L  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks import _env  # noqa: E402
from benchmarks._common import environment  # noqa: E402

MODEL = dict(n_layer=2, n_head=4, n_embd=128, block_size=64, vocab_size=256, bias=False, learning_rate=3e-3,
             warmup_steps=10)
QUICK_MODEL = dict(MODEL, n_embd=64)
PER_RANK_BATCH = 4
MODES: dict[str, Any] = {
    "none": None,
    "bf16": "bf16",
    "int8": "int8",
    "topk": {"mode": "topk", "ratio": 0.1},
    "onebit": {"mode": "onebit", "warmup_steps": 5},
    "powersgd": {"mode": "powersgd", "rank": 1},
}
ARMS = ["compute_only", *MODES]
RING = {"all_reduce": lambda w: 2 * (w - 1) / w, "all_gather": lambda w: w - 1, "reduce_scatter": lambda w: (w - 1) / w}


class StepRecorder(L.Callback):
    """Per optimizer step: wall time, the payload bytes and ring-model bytes sent inside the bucket reduction, loss."""

    def __init__(self, wire: Any, calls: list) -> None:
        self.wire, self.calls = wire, calls
        self.times: list[float] = []
        self.payload: list[int] = []
        self.ring: list[float] = []
        self.losses: list[float] = []
        self._t0 = 0.0
        self._b0 = 0
        self._c0 = 0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._t0, self._b0, self._c0 = time.perf_counter(), self.wire.bytes, len(self.calls)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.times.append(time.perf_counter() - self._t0)
        self.payload.append(self.wire.bytes - self._b0)
        w = trainer.world_size
        self.ring.append(sum(RING[kind](w) * n for kind, n in self.calls[self._c0:]))
        self.losses.append(float(trainer.callback_metrics["train_loss"]))


def _record_kinds(wire: Any, calls: list) -> dict:
    """Wrap the (already `Wire`-counted) collectives once more to note each gradient call's kind and size."""
    wrapped = {}
    for name in ("all_reduce", "reduce_scatter_tensor", "reduce_scatter_single", "all_gather_into_tensor",
                 "all_gather_single"):
        fn = getattr(dist, name, None)
        if fn is None:
            continue
        kind = name.split("_into")[0].replace("_tensor", "").replace("_single", "")

        def counted(*a, _fn=fn, _kind=kind, _name=name, **k):
            if wire.inside:
                t = a[0] if _name == "all_reduce" else a[1]
                calls.append((_kind, t.numel() * t.element_size()))
            return _fn(*a, **k)

        wrapped[name] = fn
        setattr(dist, name, counted)
    return wrapped


def train_arm(arm: str, steps: int, devices: int, num_nodes: int, model_kwargs: dict) -> dict[str, Any]:
    from examples.gpt.data import TextDataModule
    from examples.gpt.model import GPTModule
    from lightning_npu import NPUHybridStrategy
    from lightning_npu.parallel.data_parallel import sync as grad_sync
    from lightning_npu.parallel.data_parallel.hierarchical import DoneWork
    from tests._compression_workers import Wire

    L.seed_everything(0, verbose=False)
    model = GPTModule(**model_kwargs)
    data = TextDataModule(block_size=model_kwargs["block_size"], batch_size=PER_RANK_BATCH, shuffle=False)
    wire, calls = Wire(), []
    recorder = StepRecorder(wire, calls)
    strategy = NPUHybridStrategy(zero_stage=0, gradient_compression=MODES.get(arm))
    trainer = L.Trainer(accelerator="cpu", devices=devices, num_nodes=num_nodes, strategy=strategy,
                        precision="32-true", max_steps=steps, limit_val_batches=0, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[recorder])
    original = grad_sync.reduce_bucket
    with wire.counting():
        saved = _record_kinds(wire, calls)
        if arm == "compute_only":  # no exchange at all: the bucket is "reduced" to itself (times dp: the caller
            def local(flat, group, out=None, **_):  # divides by dp, keeping the magnitude)
                flat.mul_(dist.get_world_size(group))
                if out is not None:
                    out.copy_(flat.view(dist.get_world_size(group), -1)[dist.get_rank(group)])
                return DoneWork(flat if out is None else out)
            grad_sync.reduce_bucket = local
        try:
            trainer.fit(model, datamodule=data)
        finally:
            grad_sync.reduce_bucket = original
            for name, fn in saved.items():
                setattr(dist, name, fn)
    return {"times": recorder.times, "payload": recorder.payload, "ring": recorder.ring, "losses": recorder.losses}


def worker(arms: list[str], steps: int, devices: int, num_nodes: int, model_kwargs: dict) -> dict[str, Any]:
    out = {}
    world = devices * num_nodes
    for arm in arms:
        os.environ["WORLD_SIZE"] = str(world)
        out[arm] = train_arm(arm, steps, devices, num_nodes, model_kwargs)
    return out


def summarise(repeats: list[list[dict]], warmup: int) -> dict[str, dict]:
    """Per arm: the median over measured steps (pooled over repeats) of the slowest rank's step time; rank 0's bytes
    (every rank sends the same); the loss curve of the first repeat."""
    rows = {}
    for arm in repeats[0][0]:
        slowest, payload, ring = [], [], []
        for ranks in repeats:
            n = len(ranks[0][arm]["times"])
            slowest += [max(r[arm]["times"][i] for r in ranks) for i in range(warmup, n)]
            payload += ranks[0][arm]["payload"][warmup:]
            ring += ranks[0][arm]["ring"][warmup:]
        rows[arm] = {"step_ms": 1e3 * statistics.median(slowest), "measured_steps": len(slowest),
                     "payload_bytes": int(statistics.median(payload)), "ring_bytes": float(statistics.median(ring)),
                     "losses": repeats[0][0][arm]["losses"]}
    rows = {arm: rows[arm] for arm in ARMS}
    base = rows["compute_only"]["step_ms"]
    plain = rows["none"]["payload_bytes"]
    plain_ring = rows["none"]["ring_bytes"]
    for arm, row in rows.items():
        row["exposed_comm_ms"] = row["step_ms"] - base
        if arm != "compute_only":
            row["payload_ratio_vs_none"] = row["payload_bytes"] / plain
            row["ring_ratio_vs_none"] = row["ring_bytes"] / plain_ring
            row["step_ratio_vs_none"] = row["step_ms"] / rows["none"]["step_ms"]
    return rows


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_two_nodes(arms: list[str], steps: int, model_kwargs: dict) -> list[dict]:
    """2 nodes x 2 processes: two torchrun launches on this machine, each running `--torchrun-worker`."""
    with tempfile.TemporaryDirectory(prefix="lnpu-comm-") as tmp:
        out, port = Path(tmp) / "rank", _free_port()
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
        spec = json.dumps({"arms": arms, "steps": steps, "model": model_kwargs, "out": str(out)})
        procs = [subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
             "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(port),
             str(Path(__file__).resolve()), "--torchrun-worker", spec],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for node in (0, 1)]
        logs = [p.communicate(timeout=1800)[0] for p in procs]
        if any(p.returncode for p in procs):
            raise RuntimeError("2x2 torchrun launch failed:\n" + "\n".join(log[-3000:] for log in logs))
        return [json.loads(Path(f"{out}.{r}").read_text()) for r in range(4)]


def torchrun_worker(spec_json: str) -> None:
    spec = json.loads(spec_json)
    result = worker(spec["arms"], spec["steps"], devices=int(os.environ["LOCAL_WORLD_SIZE"]), num_nodes=2,
                    model_kwargs=spec["model"])
    Path(f"{spec['out']}.{os.environ['RANK']}").write_text(json.dumps(result))  # per-rank scratch, merged by the parent
    sys.stdout.flush()
    os._exit(0)  # as `launch.spawn`: skip gloo's process-group teardown at exit


def table(name: str, rows: dict[str, dict]) -> str:
    lines = [f"== {name} ==",
             f"{'mode':14s} {'step ms':>8s} {'exposed ms':>10s} {'payload B/step':>15s} {'x none':>7s} "
             f"{'ring B/step':>12s} {'x none':>7s} {'loss last5':>10s}"]
    for arm, r in rows.items():
        tail = r["losses"][-5:]
        lines.append(f"{arm:14s} {r['step_ms']:8.1f} {r['exposed_comm_ms']:10.1f} {r['payload_bytes']:15,d} "
                     f"{r.get('payload_ratio_vs_none', float('nan')):7.3f} {r['ring_bytes']:12,.0f} "
                     f"{r.get('ring_ratio_vs_none', float('nan')):7.3f} {sum(tail) / len(tail):10.3f}")
    return "\n".join(lines)


def plot_losses(rows: dict[str, dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for arm, r in rows.items():
        if arm != "compute_only":
            ax.plot(range(1, len(r["losses"]) + 1), r["losses"], label=arm, lw=1.2)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("train loss (dp mean)")
    ax.set_title(title)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Optional[list[str]] = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="dp=2 only, a smaller model, 12 steps (a smoke run)")
    p.add_argument("--steps", type=int, default=None, help="steps per arm at dp=2 (default 300, quick 12)")
    p.add_argument("--timing-steps", type=int, default=60,
                   help="steps per arm in the other passes (dp=4, 2x2, and dp=2's repeats)")
    p.add_argument("--repeats", type=int, default=2, help="passes over all arms per layout (timings pooled)")
    p.add_argument("--warmup", type=int, default=None, help="steps left out of the medians (default 10, quick 6)")
    p.add_argument("--nodes2x2", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--out", default=str(ROOT / "benchmarks/results/communication.json"))
    p.add_argument("--plot", default=None, help="loss PNG (default: next to --out, communication_loss.png)")
    p.add_argument("--torchrun-worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.torchrun_worker:
        torchrun_worker(args.torchrun_worker)
    from lightning_npu.launch import spawn

    model = QUICK_MODEL if args.quick else MODEL
    steps = args.steps or (12 if args.quick else 300)
    warmup = args.warmup if args.warmup is not None else (6 if args.quick else 10)
    repeats = 1 if args.quick else args.repeats
    layouts = [("dp2", 2)] if args.quick else [("dp2", 2), ("dp4", 4)] + [("nodes2x2", 4)] * args.nodes2x2
    results: dict[str, Any] = {}
    started = time.perf_counter()
    for name, world in layouts:
        t = time.perf_counter()
        runs = []
        for r in range(repeats):  # alternate the arms' order between repeats (load drifts on a shared machine)
            arms = ARMS if r % 2 == 0 else ARMS[::-1]
            n = steps if name == "dp2" and r == 0 else args.timing_steps  # dp2's first pass: the loss curves
            runs.append(run_two_nodes(arms, n, model) if name == "nodes2x2" else
                        spawn(worker, world, arms, n, world, 1, model))
        results[name] = summarise(runs, warmup)
        print(table(f"{name} ({repeats} pass(es), {time.perf_counter() - t:.0f} s)", results[name]), flush=True)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    plot = Path(args.plot) if args.plot else out.parent / "communication_loss.png"
    plot_losses(results["dp2"], plot,
                f"example GPT, dp=2, AdamW, {steps} steps: train loss per gradient compression mode")
    payload = {"config": {"model": model, "per_rank_batch": PER_RANK_BATCH, "zero_stage": 0, "modes": MODES,
                          "steps_dp2_first_pass": steps, "timing_steps": args.timing_steps, "repeats": repeats,
                          "warmup": warmup,
                          "quick": args.quick},
               "definitions": {
                   "step_ms": "median over measured steps of the slowest rank's batch_start->batch_end wall time",
                   "payload_bytes": "bytes per rank per step handed to collectives inside reduce_bucket",
                   "ring_bytes": "ring model of what is sent per rank: all_reduce 2(w-1)/w, all_gather (w-1), "
                                 "reduce_scatter (w-1)/w times the payload",
                   "exposed_comm_ms": "step_ms - compute_only step_ms (same launch, reduce_bucket a local no-op)"},
               "environment": environment(), "wall_s": time.perf_counter() - started, "results": results}
    _env.write_json(out, payload)
    print(f"wrote {out} and {plot} ({time.perf_counter() - started:.0f} s)")
    print("note: on 2 CPU cores the compressed modes need not be faster; the bytes are the number that carries over.")
    return payload


if __name__ == "__main__":
    main()
