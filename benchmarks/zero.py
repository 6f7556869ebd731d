"""Per-rank parameter/gradient/optimizer bytes, peak RSS and tokens/s of ZeRO 0-3 vs Lightning's "ddp".

    python benchmarks/zero.py [--dp 2 4] [--steps 12] [--out benchmarks/results/zero.json]

Each (dp, mode) runs in fresh processes (so peak RSS is its own) on CPU/gloo, training the example
GPT in fp32 with AdamW. Bytes are counted from tensors (local shards), not RSS:

* parameters "at rest" (after the optimizer step) and "in backward" (what forward left gathered);
* gradients the optimizer steps with (DDP's full gradients, ZeRO-1's reduce-scattered slices, FSDP2's
  shards), and the model's own gradients still held at that point; optimizer state after the step.

The ZeRO paper's formula for mixed-precision Adam is (2 + 2 + 12) bytes/param (bf16 params, bf16
grads, fp32 master + 2 moments); in this fp32 run the same split is (4 + 4 + 8) bytes/param (no
separate master copy). Per rank with N = dp: stage 0: all whole; 1: optimizer / N; 2: + gradients / N;
3: + parameters / N. The JSON holds the measured bytes, the fp32 formula, their ratio, and the
(2+2+12) projection for bf16-mixed with fp32 master shards.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import _env  # noqa: E402

MODEL = dict(n_layer=4, n_head=4, n_embd=128, block_size=64, bias=False, learning_rate=1e-3, eps=1e-5)
PER_RANK_BATCH = 4


def _worker(mode: str, steps: int) -> dict:
    import lightning as L

    import lightning_npu  # noqa: F401
    from examples.gpt.data import TextDataModule
    from examples.gpt.model import GPTModule
    from lightning_npu import NPUHybridStrategy
    from lightning_npu import device as dev
    from tests._zero_workers import Probe

    class Timer(L.Callback):
        def __init__(self) -> None:
            self.times: list[float] = []

        def on_train_batch_start(self, *args) -> None:
            self._t = time.perf_counter()

        def on_train_batch_end(self, *args) -> None:
            self.times.append(time.perf_counter() - self._t)

    world = int(os.environ["WORLD_SIZE"])
    L.seed_everything(0, verbose=False)
    strategy = "ddp" if mode == "ddp" else NPUHybridStrategy(zero_stage=int(mode[-1]))
    model = GPTModule(**MODEL)
    probe, timer = Probe(), Timer()
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=strategy, precision="32-true", max_steps=steps,
        limit_val_batches=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[probe, timer],
    )
    data = TextDataModule(block_size=MODEL["block_size"], batch_size=PER_RANK_BATCH, shuffle=False)
    trainer.fit(model, datamodule=data)
    n_params = sum(p.numel() for p in GPTModule(**MODEL).parameters())
    step_time = statistics.median(timer.times[2:])
    return {
        "params": n_params,
        "param_bytes_rest": probe.param_bytes_rest[-1],
        "param_bytes_backward": probe.param_bytes_fwd[-1],
        "grad_bytes": probe.step_grad_bytes[-1],
        "model_grad_bytes": probe.grad_bytes[-1],
        "optimizer_bytes": probe.optim_bytes[-1],
        "peak_rss_bytes": dev.peak_rss_bytes(),
        "tokens_per_s": world * PER_RANK_BATCH * MODEL["block_size"] / step_time,
    }


def formula(stage: int, n_params: int, dp: int, split: tuple[int, int, int]) -> dict:
    p, g, o = (b * n_params for b in split)
    return {
        "param_bytes": p / dp if stage >= 3 else p,
        "grad_bytes": g / dp if stage >= 2 else g,
        "optimizer_bytes": o / dp if stage >= 1 else o,
    }


def main() -> None:
    from lightning_npu.launch import spawn

    parser = argparse.ArgumentParser()
    parser.add_argument("--dp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/zero.json"))
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    rows = []
    for dp in args.dp:
        base_tps = None
        for mode in ["ddp", "zero0", "zero1", "zero2", "zero3"]:
            ranks = spawn(_worker, dp, mode, args.steps, threads=1)
            r0 = ranks[0]
            stage = 0 if mode == "ddp" else int(mode[-1])
            fp32 = formula(stage, r0["params"], dp, (4, 4, 8))
            row = {
                "dp": dp,
                "mode": mode,
                "params": r0["params"],
                "param_bytes_rest": max(r["param_bytes_rest"] for r in ranks),
                "param_bytes_backward": max(r["param_bytes_backward"] for r in ranks),
                "grad_bytes": max(r["grad_bytes"] for r in ranks),
                "model_grad_bytes": max(r["model_grad_bytes"] for r in ranks),
                "optimizer_bytes": max(r["optimizer_bytes"] for r in ranks),
                "peak_rss_mib": max(r["peak_rss_bytes"] for r in ranks) / 2**20,
                "tokens_per_s": r0["tokens_per_s"],
                "formula_fp32_4_4_8": fp32,
                "formula_mixed_2_2_12": formula(stage, r0["params"], dp, (2, 2, 12)),
            }
            row["measured_over_formula"] = {
                "param": row["param_bytes_rest"] / fp32["param_bytes"],
                "grad": row["grad_bytes"] / fp32["grad_bytes"],
                "optimizer": row["optimizer_bytes"] / fp32["optimizer_bytes"],
            }
            if mode == "zero0":
                base_tps = row["tokens_per_s"]
            rows.append(row)
            print(json.dumps({k: row[k] for k in ("dp", "mode", "param_bytes_rest", "grad_bytes", "optimizer_bytes",
                                                  "peak_rss_mib", "tokens_per_s")}), flush=True)
        for row in rows:
            if row["dp"] == dp:
                row["tokens_per_s_vs_zero0"] = row["tokens_per_s"] / base_tps
    import torch

    out = {
        "setup": {"model": MODEL, "per_rank_batch": PER_RANK_BATCH, "steps": args.steps, "precision": "32-true",
                  "optimizer": "AdamW", "device": "cpu/gloo, 1 thread per rank", "torch": torch.__version__,
                  "cpus": os.cpu_count()},
        "rows": rows,
    }
    _env.write_json(args.out, out, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
