"""Tensor parallelism on the example GPT: `NPUHybridStrategy(tensor_parallel_size=2)` (automatic plan)
against Lightning's `ModelParallelStrategy(tensor_parallel_size=2)` with the equivalent hand-written
DTensor plan in `configure_model`, side by side in one run; plus tp=1 for the memory baseline.

Reports median tokens/s (a step ends when the slowest rank ends it), median tokens per CPU-second of
the busiest rank (less sensitive to other jobs on shared cores) and, per rank, the bytes of
parameters + gradients + optimizer state (AdamW: 2 moments), in total and excluding the parameters
that tensor parallelism leaves replicated (LayerNorms and the position embedding).

The hand-written plan is Lightning's documented recipe: vocab-split embedding, column-parallel q|k|v
(with lightning-npu's `Colwise(fused=3)`, since torch has no fused-QKV style and a plain column split
would mix q, k and v heads), row-parallel output and MLP-down, column-parallel MLP-up, and an LM head
whose logits are gathered (`ColwiseParallel(output_layouts=Replicate())`) before a plain cross-entropy.
Ours keeps the logits vocab-sharded into the vocab-parallel cross-entropy.

    python benchmarks/tensor_parallel.py [--steps 20] [--warmup 3] [--repeats 2]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import lightning as L  # noqa: E402
import torch  # noqa: E402

from benchmarks._common import StepTimer, environment, median, write_json  # noqa: E402
from lightning_npu.launch import spawn  # noqa: E402

MODEL = dict(n_layer=4, n_head=8, n_embd=256, block_size=128, vocab_size=256, bias=False)
BATCH = 8  # every tp rank sees the whole batch (dp=1)
TP = 2


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class MemoryProbe(L.Callback):
    """Per-parameter local bytes of the parameter, its gradient and its optimizer state after the last step."""

    def __init__(self) -> None:
        self.bytes: dict[str, dict[str, int]] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step < trainer.max_steps:
            return
        optimizer = trainer.optimizers[0]
        inner = getattr(optimizer, "optim", optimizer)
        for name, p in pl_module.named_parameters():
            local = _local(p)
            grad = _local(p.grad) if p.grad is not None else None
            state = inner.state.get(p, {})
            self.bytes[name] = {
                "param": local.numel() * local.element_size(),
                "grad": grad.numel() * grad.element_size() if grad is not None else 0,
                "optimizer": sum(_local(v).numel() * _local(v).element_size() for v in state.values()
                                 if isinstance(v, torch.Tensor) and v.dim() > 0),
                "full_numel": p.numel(),  # DTensor: global size; local shard: its own
            }


class CPUTimer(L.Callback):
    """Process CPU seconds of every step after `warmup`: robust to other jobs sharing the cores (gloo waits
    block rather than spin, so this is the compute and communication work each rank does)."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.times: list[float] = []
        self._t0 = 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._t0 = time.process_time()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_step > self.warmup:
            self.times.append(time.process_time() - self._t0)


def _hand_tp_module():
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from examples.gpt.model import GPTModule
    from lightning_npu.parallel.tensor_parallel.styles import Colwise

    class HandTPGPT(GPTModule):
        def configure_model(self) -> None:
            tp_mesh = self.device_mesh["tensor_parallel"]
            plan = {"transformer.wte": RowwiseParallel(input_layouts=Replicate()),
                    "lm_head": ColwiseParallel(output_layouts=Replicate())}
            for i in range(len(self.model.transformer.h)):
                plan.update({
                    f"transformer.h.{i}.attn.c_attn": Colwise(fused=3),
                    f"transformer.h.{i}.attn.c_proj": RowwiseParallel(),
                    f"transformer.h.{i}.mlp.c_fc": ColwiseParallel(),
                    f"transformer.h.{i}.mlp.c_proj": RowwiseParallel(),
                })
            parallelize_module(self.model, tp_mesh, plan)
            for block in self.model.transformer.h:
                block.attn.n_head //= tp_mesh.size()

        def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
            # GPTModule's tokens/s log, with this strategy's mesh-dimension name
            elapsed = time.perf_counter() - self._step_started
            world_tokens = batch[0].numel() * self.device_mesh["data_parallel"].size()
            self.log("tokens_per_s", world_tokens / max(elapsed, 1e-9), prog_bar=True)

    return HandTPGPT


def worker(name: str, steps: int, warmup: int) -> dict[str, Any]:
    from examples.gpt.data import TextDataModule
    from examples.gpt.model import GPTModule
    from lightning_npu import NPUHybridStrategy

    L.seed_everything(0, verbose=False)
    if name == "model_parallel":
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy: Any = ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=TP)
        model = _hand_tp_module()(**MODEL)
    else:
        strategy = NPUHybridStrategy(tensor_parallel_size=TP if name == "npu_hybrid_tp2" else 1, zero_stage=0)
        model = GPTModule(**MODEL)
    devices = 1 if name == "npu_hybrid_tp1" else TP
    data = TextDataModule(block_size=MODEL["block_size"], batch_size=BATCH, shuffle=False)
    timer, cpu, probe = StepTimer(warmup), CPUTimer(warmup), MemoryProbe()
    trainer = L.Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, precision="32-true", max_steps=steps + warmup,
        limit_val_batches=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[timer, cpu, probe],
    )
    trainer.fit(model, datamodule=data)
    return {"step_times": timer.times, "cpu_times": cpu.times, "bytes": probe.bytes, "final_loss": float(trainer.callback_metrics["train_loss"])}


def _memory(per_param: dict[str, dict[str, int]], sharded_names: set[str]) -> dict[str, int]:
    total = sum(v["param"] + v["grad"] + v["optimizer"] for v in per_param.values())
    sharded = sum(v["param"] + v["grad"] + v["optimizer"] for k, v in per_param.items() if k in sharded_names)
    return {"param_grad_optimizer_bytes": total, "excluding_replicated_bytes": sharded}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    world = {"npu_hybrid_tp2": TP, "model_parallel": TP, "npu_hybrid_tp1": 1}
    raw: dict[str, list[dict]] = {n: [] for n in world}
    for i in range(args.repeats):
        for name in (("npu_hybrid_tp2", "model_parallel") if i % 2 == 0 else ("model_parallel", "npu_hybrid_tp2")):
            raw[name].append(spawn(worker, world[name], name, args.steps, args.warmup))
    raw["npu_hybrid_tp1"].append(spawn(worker, 1, "npu_hybrid_tp1", 2, 1))

    tokens_per_step = BATCH * MODEL["block_size"]
    # parameters tp shards: those whose tp=2 local size is below the full size (by name, same in all runs)
    tp1_bytes = raw["npu_hybrid_tp1"][0][0]["bytes"]
    ours_rank0 = raw["npu_hybrid_tp2"][0][0]["bytes"]
    sharded_names = {k for k, v in ours_rank0.items() if v["param"] < tp1_bytes[k]["param"]}
    results: dict[str, Any] = {}
    for name, repeats in raw.items():
        entry: dict[str, Any] = {"memory_per_rank": [_memory(r["bytes"], sharded_names) for r in repeats[0]]}
        if name != "npu_hybrid_tp1":
            step_times = [max(ts) for ranks in repeats for ts in zip(*(r["step_times"] for r in ranks))]
            cpu_times = [max(ts) for ranks in repeats for ts in zip(*(r["cpu_times"] for r in ranks))]
            entry.update(tokens_per_s_median=tokens_per_step / median(step_times),
                         step_time_s_median=median(step_times), timed_steps=len(step_times),
                         tokens_per_cpu_s_median=tokens_per_step / median(cpu_times),
                         step_cpu_s_median=median(cpu_times),
                         final_loss=repeats[0][0]["final_loss"])
        results[name] = entry

    ours, theirs, tp1 = results["npu_hybrid_tp2"], results["model_parallel"], results["npu_hybrid_tp1"]
    tp1_mem = tp1["memory_per_rank"][0]
    summary = {
        "tokens_per_s_ratio_vs_model_parallel": ours["tokens_per_s_median"] / theirs["tokens_per_s_median"],
        "tokens_per_cpu_s_ratio_vs_model_parallel": ours["tokens_per_cpu_s_median"] / theirs["tokens_per_cpu_s_median"],
        "bytes_ratio_tp2_over_tp1_excluding_replicated": max(
            m["excluding_replicated_bytes"] for m in ours["memory_per_rank"]) / tp1_mem["excluding_replicated_bytes"],
        "bytes_ratio_tp2_over_tp1_total": max(
            m["param_grad_optimizer_bytes"] for m in ours["memory_per_rank"]) / tp1_mem["param_grad_optimizer_bytes"],
        "bytes_ratio_model_parallel_over_ours_total": max(
            m["param_grad_optimizer_bytes"] for m in theirs["memory_per_rank"]) / max(
            m["param_grad_optimizer_bytes"] for m in ours["memory_per_rank"]),
        "replicated_parameters": sorted(set(tp1_bytes) - sharded_names),
    }
    payload = {"benchmark": "tensor_parallel", "model": MODEL, "batch": BATCH, "tp": TP, "steps": args.steps,
               "warmup": args.warmup, "repeats": args.repeats, "environment": environment(),
               "results": results, "summary": summary}
    path = write_json("tensor_parallel.json", payload)
    print(f"wrote {path}")
    for name, entry in results.items():
        if "tokens_per_s_median" in entry:
            print(f"{name:16s} {entry['tokens_per_s_median']:10.0f} tokens/s  step {entry['step_time_s_median']*1e3:7.1f} ms"
                  f"  {entry['tokens_per_cpu_s_median']:10.0f} tokens/cpu-s")
        print(f"{'':16s} per-rank bytes: {entry['memory_per_rank']}")
    for k, v in summary.items():
        print(f"{k}: {v}")


if __name__ == "__main__":
    main()
