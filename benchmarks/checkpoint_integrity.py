"""What the checkpoints' CRC32s cost: save and load of the example GPT's checkpoints, checksum on vs off.

The model of examples/gpt/config.yaml (4 layers, 128 wide, block 128, AdamW, bf16-mixed) on 2 CPU processes, in
two layouts: the config's own (pp=2: a sharded DCP directory, each rank checksums the shard it writes while writing
it) and dp=2 (one Lightning file, which rank 0 reads back once to checksum it). After 2 training steps each arm
saves (``trainer.save_checkpoint``) and loads (``strategy.load_checkpoint``, the resume path: verification, then
DCP / torch.load into the model) the checkpoint `--repeats` times, the arms interleaved in rotating order:

* ``crc32``: the default, every file's size and CRC32 in the marker, verified before the load (the ranks split
  the files); the verified-CRC cache is cleared before every load, so each load reads every file once more;
* ``sizes``: ``LIGHTNING_NPU_CHECKSUM=0``, sizes only (recorded and checked);
* ``no_marker``: no marker at all (what a ModelCheckpoint save was before): the cost of the marker itself.

Wall time is rank 0's, between barriers (so the slower rank counts); CPU time is both ranks' process time
summed, which other processes' load on a shared machine inflates far less. The files are in the page cache (a
resume soon after a save). Reports per arm the median wall and CPU seconds, and as the checksum's cost the median of
the per-round ratios crc32 / sizes (arms of one round run back to back, so they share the machine's load) and the
ratio of the median CPU times; likewise sizes / no_marker for the marker itself. And, robust to the machine's
load, the time spent computing CRC32s itself (``zlib.crc32`` timed inside the checkpoint code, the slower rank's)
as a share of the crc32 arm's median save and load.

    python benchmarks/checkpoint_integrity.py [--repeats 31] [--out checkpoint_integrity.json] [--summarize JSON]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import environment, median, write_json  # noqa: E402
from lightning_npu.launch import spawn  # noqa: E402

# examples/gpt/config.yaml's model, data and precision
MODEL = dict(n_layer=4, n_head=4, n_embd=128, block_size=128, learning_rate=0.002, warmup_steps=20)
BATCH = 8
LAYOUTS = {"pp2_directory": dict(pipeline_parallel_size=2), "dp2_file": dict()}
ARMS = ("crc32", "sizes", "no_marker")


def _layout(root: str, strategy_kwargs: dict[str, Any], repeats: int) -> dict[str, Any]:
    import lightning as L
    import torch.distributed as dist

    from examples.gpt.data import TextDataModule
    from examples.gpt.model import GPTModule
    from lightning_npu import NPUHybridStrategy
    from lightning_npu.parallel.checkpoint import commit

    os.environ["WORLD_SIZE"] = str(dist.get_world_size() if dist.is_initialized() else os.environ["WORLD_SIZE"])
    L.seed_everything(1234, verbose=False)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=NPUHybridStrategy(**strategy_kwargs),
                        precision="bf16-mixed", max_steps=2, limit_val_batches=0, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(GPTModule(**MODEL), datamodule=TextDataModule(block_size=MODEL["block_size"], batch_size=BATCH))
    strategy = trainer.strategy
    crc_seconds = _time_crc32(commit)

    def timed(fn: Any) -> tuple[float, float]:
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        c1 = time.process_time()
        dist.barrier()
        cpu: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(cpu, c1 - c0)
        return time.perf_counter() - t0, sum(cpu)

    kinds = ("save", "load", "save_cpu", "load_cpu", "save_crc", "load_crc")
    times: dict[str, dict[str, list[float]]] = {a: {k: [] for k in kinds} for a in ARMS}
    size = files = 0
    for i in range(repeats + 1):  # the first round warms up (allocations, page cache, code paths)
        order = ARMS[i % len(ARMS):] + ARMS[: i % len(ARMS)]
        for arm in order:
            os.environ[commit.CHECKSUM_ENV] = "0" if arm == "sizes" else "1"
            path = Path(root) / f"{arm}.ckpt"
            options = commit.CommitRequest(marker=None) if arm == "no_marker" else None
            crc_seconds[0] = 0.0
            saved = timed(lambda: trainer.save_checkpoint(path, storage_options=options))
            crc_save = _slowest(crc_seconds[0])
            commit._crc_cache.clear()  # every load verifies from the files
            crc_seconds[0] = 0.0
            loaded = timed(lambda: strategy.load_checkpoint(path))
            crc_load = _slowest(crc_seconds[0])
            if i:
                for kind, (wall, cpu), crc in (("save", saved, crc_save), ("load", loaded, crc_load)):
                    times[arm][kind].append(wall)
                    times[arm][kind + "_cpu"].append(cpu)
                    times[arm][kind + "_crc"].append(crc)
            if arm == "crc32":
                found = [p for p in ([path] if path.is_file() else path.rglob("*")) if p.is_file()]
                size, files = sum(p.stat().st_size for p in found), len(found)
    os.environ.pop(commit.CHECKSUM_ENV, None)
    return {"times": times, "checkpoint_bytes": size, "files": files}


def _time_crc32(commit: Any) -> list[float]:
    """Accumulate the seconds the checkpoint code spends in ``zlib.crc32`` (benchmark instrumentation)."""
    import types
    import zlib

    total = [0.0]

    def crc32(data: Any, value: int = 0) -> int:
        t0 = time.perf_counter()
        out = zlib.crc32(data, value)
        total[0] += time.perf_counter() - t0
        return out

    commit.zlib = types.SimpleNamespace(crc32=crc32)
    return total


def _slowest(seconds: float) -> float:
    import torch.distributed as dist

    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, seconds)
    return max(out)


def _paired(t: dict[str, dict[str, list[float]]], a: str, b: str, kind: str) -> float:
    return median([x / y for x, y in zip(t[a][kind], t[b][kind])])


def _paired_iqr(t: dict[str, dict[str, list[float]]], a: str, b: str, kind: str) -> list[float]:
    """The quartiles of the per-round ratios: how far apart two arms of one round can be on this machine."""
    q = statistics.quantiles([x / y for x, y in zip(t[a][kind], t[b][kind])], n=4)
    return [q[0], q[2]]


def _summary(run: dict[str, Any]) -> dict[str, Any]:
    t = run["times"]
    med = {a: {k: median(v) for k, v in t[a].items()} for a in ARMS}
    out: dict[str, Any] = {"checkpoint_mb": run["checkpoint_bytes"] / 2**20, "files": run["files"], "median_s": med}
    for a, b in (("crc32", "sizes"), ("sizes", "no_marker")):
        out[f"{a}_over_{b}"] = {
            **{f"{k}_wall_paired": _paired(t, a, b, k) for k in ("save", "load")},
            **{f"{k}_wall_paired_iqr": _paired_iqr(t, a, b, k) for k in ("save", "load")},
            **{f"{k}_cpu": med[a][k + "_cpu"] / med[b][k + "_cpu"] for k in ("save", "load")},
        }
    ratio = {k: v for k, v in out["crc32_over_sizes"].items() if not k.endswith("_iqr")}
    out["checksum_cost_pct"] = {k: 100.0 * (v - 1.0) for k, v in ratio.items()}
    out["crc32_compute_pct"] = {k: 100.0 * med["crc32"][k + "_crc"] / med["crc32"][k] for k in ("save", "load")}
    out["runs_s"] = t
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=31)
    p.add_argument("--out", default="checkpoint_integrity.json", help="file name under benchmarks/results/")
    p.add_argument("--summarize", metavar="JSON", help="recompute the summaries of an earlier result from its runs")
    args = p.parse_args()
    if args.summarize:
        result = json.loads(Path(args.summarize).read_text())
        for name in LAYOUTS:
            run = {"times": result[name]["runs_s"], "files": result[name]["files"],
                   "checkpoint_bytes": result[name]["checkpoint_mb"] * 2**20}
            result[name] = _summary(run)
        print(f"wrote {write_json(Path(args.out).name, result)}")
        return
    result: dict[str, Any] = {"config": {"model": MODEL, "batch_size": BATCH, "precision": "bf16-mixed",
                                         "processes": 2, "repeats": args.repeats, **environment(),
                                         "load_average_before": os.getloadavg()}}
    for name, kwargs in LAYOUTS.items():
        with tempfile.TemporaryDirectory(prefix=f"lnpu-integrity-{name}-") as root:
            ranks = spawn(_layout, 2, root, kwargs, args.repeats, threads=1)
        result[name] = _summary(ranks[0])
        s = result[name]
        cost = s["checksum_cost_pct"]
        print(f"{name}: {s['checkpoint_mb']:.1f} MB in {s['files']} file(s); median save "
              + ", ".join(f"{a} {s['median_s'][a]['save'] * 1e3:.0f} ms" for a in ARMS) + "; median load "
              + ", ".join(f"{a} {s['median_s'][a]['load'] * 1e3:.0f} ms" for a in ARMS)
              + f"; CRC32 cost: save {cost['save_wall_paired']:+.1f}% wall (paired), {cost['save_cpu']:+.1f}% CPU; "
              f"load {cost['load_wall_paired']:+.1f}% wall (paired), {cost['load_cpu']:+.1f}% CPU; time computing "
              f"CRC32s: {s['crc32_compute_pct']['save']:.1f}% of a save, {s['crc32_compute_pct']['load']:.1f}% of a "
              "load", flush=True)
    result["config"]["load_average_after"] = os.getloadavg()
    out = write_json(Path(args.out).name, result)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
