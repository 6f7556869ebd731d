"""Model FLOPs utilisation of a ~1B Llama-class model in bf16 on one device, four ways in one run.

    python benchmarks/gpu_mfu.py                 # ~1.1B Llama (2048 wide, 16 layers, GQA 32/8), T=2048
    python benchmarks/gpu_mfu.py --tiny          # a tiny config; the test suite runs it on CPU

Arms, interleaved over ``--repeats`` rounds so drift hits all of them alike:
``torch`` (a plain loop: autocast, fused AdamW), Lightning ``"ddp"`` (bf16-mixed), ``npu_hybrid``
(zero 0, as shipped), ``npu_hybrid_no_loss_scale`` and ``npu_hybrid_no_fp32_functions`` (each with one
HybridPrecision feature off, to price it), and ``npu_hybrid_fuse_ops`` (``fuse_ops="all"``: every
pattern rewritten regardless of the device's measured table, the numbers that table needs). Every arm
builds the same `transformers` `LlamaForCausalLM` from the same seed on the device and trains on the same synthetic token batches, so their losses agree.

MFU = tokens/s x FLOPs per token / the device's dense bf16 peak. FLOPs per token = 6 N, N counting
every parameter a matmul touches (all but the input embedding), plus attention's 12 L d T (scores
and values, forward and backward, the full T x T as Megatron and PaLM count it). The peak comes from
``--peak-tflops``, Lightning's `get_available_flops` (the table behind its `ThroughputMonitor`), or `PEAK_BF16_FLOPS`
for the names that table misses; on a device without one, MFU is left out, not guessed.
Writes ``benchmarks/results/gpu_mfu_<device>.json``.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks import _env  # noqa: E402
from benchmarks._common import environment, median  # noqa: E402
from lightning_npu import device as dev  # noqa: E402

# dense bf16 peaks from the vendors' datasheets (no sparsity), for the names Lightning's table misses: its
# `get_available_flops` returns None for "NVIDIA H200", the name torch reports for an H200 SXM (it expects "h200 sxm1")
PEAK_BF16_FLOPS = {"NVIDIA H200": 989e12, "NVIDIA H100 80GB HBM3": 989e12, "NVIDIA A100-SXM4-80GB": 312e12}


def _available_flops(acc: str, name: str) -> Optional[float]:
    """Lightning's `get_available_flops` (ThroughputMonitor's peak table) where it knows the device, else ours."""
    if acc == "cuda":
        import warnings

        from lightning.fabric.utilities.throughput import get_available_flops

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "FLOPs not found for ...": answered by our table below
            peak = get_available_flops(torch.device("cuda", 0), torch.bfloat16)
        if peak:
            return float(peak)
    return PEAK_BF16_FLOPS.get(name)

MODELS = {
    "1b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=2048),
    "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64),
}


def flops_per_token(n_matmul_params: int, cfg: dict, seq: int) -> float:
    return 6 * n_matmul_params + 12 * cfg["num_hidden_layers"] * cfg["hidden_size"] * seq


class SyntheticTokens(torch.utils.data.Dataset):
    """Fixed random token windows: the same batches for every arm, no I/O in the timed loop."""

    def __init__(self, vocab: int, seq: int, n: int) -> None:
        g = torch.Generator().manual_seed(1234)
        self.data = torch.randint(0, vocab, (n, seq + 1), generator=g)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int):
        return self.data[i, :-1], self.data[i, 1:]


class StepClock(L.Callback):
    """Device-synchronised wall time of every training step after `warmup` steps."""

    def __init__(self, warmup: int) -> None:
        self.warmup, self.times, self._t0 = warmup, [], 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        dev.synchronize(pl_module.device)
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        dev.synchronize(pl_module.device)
        if batch_idx >= self.warmup:
            self.times.append(time.perf_counter() - self._t0)


def _module(cfg: dict, fused: bool):
    from examples.llama.model import LlamaModule

    class Seeded(LlamaModule):
        def configure_model(self) -> None:
            torch.manual_seed(0)  # the same weights in every arm, whatever the trainer drew before
            super().configure_model()

    return Seeded(**cfg, learning_rate=3e-4, attn_implementation="sdpa", fused_optimizer=fused)


def run_torch(acc: str, cfg: dict, data, batch: int, steps: int, warmup: int, fused: bool) -> dict[str, Any]:
    """The reference: the same module's model and optimizer in a plain autocast loop."""
    L.seed_everything(0, verbose=False)
    module = _module(cfg, fused)
    with torch.device(acc):
        module.configure_model()
    opt = module.configure_optimizers()
    loader = torch.utils.data.DataLoader(data, batch_size=batch, shuffle=False)
    times, losses = [], []
    for i, (x, y) in enumerate(loader):
        if i >= steps + warmup:
            break
        dev.synchronize(acc)
        t0 = time.perf_counter()
        x, y = x.to(acc, non_blocking=True), y.to(acc, non_blocking=True)
        with torch.autocast(acc, dtype=torch.bfloat16):
            logits = module.model(input_ids=x, use_cache=False).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        dev.synchronize(acc)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    return {"step_times": times, "losses": losses}


def run_lightning(acc: str, cfg: dict, data, batch: int, steps: int, warmup: int, fused: bool, strategy: Any,
                  plugins: Optional[list] = None) -> dict[str, Any]:
    L.seed_everything(0, verbose=False)
    module = _module(cfg, fused)
    clock = StepClock(warmup)

    class Losses(L.Callback):
        values: list[float] = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            self.values.append(float(outputs["loss"]))

    rec = Losses()
    rec.values = []
    trainer = L.Trainer(
        accelerator=acc, devices=1, strategy=strategy, precision=None if plugins else "bf16-mixed", plugins=plugins,
        max_steps=steps + warmup, limit_val_batches=0, logger=False, enable_checkpointing=False, use_distributed_sampler=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[clock, rec],
    )
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=batch, shuffle=False))
    out = {"step_times": clock.times, "losses": rec.values}
    report = getattr(trainer.strategy, "fusion_report", None)
    if report is not None:
        out["fusion_report"] = str(report)
    return out


def arms(acc: str) -> dict[str, Callable[..., dict[str, Any]]]:
    from lightning_npu import HybridPrecision, NPUHybridStrategy

    return {
        "torch": lambda *a: run_torch(acc, *a),
        "ddp": lambda *a: run_lightning(acc, *a, strategy="ddp"),
        "npu_hybrid": lambda *a: run_lightning(acc, *a, strategy=NPUHybridStrategy(zero_stage=0)),
        "npu_hybrid_no_loss_scale": lambda *a: run_lightning(
            acc, *a, strategy=NPUHybridStrategy(zero_stage=0), plugins=[HybridPrecision("bf16-mixed", loss_scale=None)]
        ),
        "npu_hybrid_no_fp32_functions": lambda *a: run_lightning(
            acc, *a, strategy=NPUHybridStrategy(zero_stage=0), plugins=[HybridPrecision("bf16-mixed", fp32_functions=False)]
        ),
        "npu_hybrid_fuse_ops": lambda *a: run_lightning(acc, *a, strategy=NPUHybridStrategy(zero_stage=0, fuse_ops="all")),
    }


def _free(acc: str) -> None:
    gc.collect()
    if acc != "cpu":
        dev.empty_cache(acc)
        dev.reset_peak_memory(acc)


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="tiny model, short sequence (CPU smoke run)")
    p.add_argument("--seq", type=int, default=None, help="sequence length (default 2048; 32 with --tiny)")
    p.add_argument("--batch", type=int, default=None, help="sequences per step (default 8; 2 with --tiny)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per arm and round (default 12; 2 with --tiny)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=2, help="rounds over all arms")
    p.add_argument("--arms", default=None, help="comma-separated subset of: torch,ddp,npu_hybrid,...")
    p.add_argument("--peak-tflops", type=float, default=None, help="the device's dense bf16 peak, if not in the table")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = p.parse_args(argv)
    acc = dev.accelerator_type()
    cfg = MODELS["tiny" if args.tiny else "1b"]
    seq = args.seq or (32 if args.tiny else 2048)
    batch = args.batch or (2 if args.tiny else 8)
    steps = args.steps or (2 if args.tiny else 12)
    fused = acc != "cpu"
    name = torch.cuda.get_device_name(0) if acc == "cuda" else acc
    peak = args.peak_tflops * 1e12 if args.peak_tflops else _available_flops(acc, name)

    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        probe = LlamaForCausalLM(LlamaConfig(**cfg, tie_word_embeddings=False))
    n_params = sum(t.numel() for t in probe.parameters())
    n_matmul = n_params - probe.get_input_embeddings().weight.numel()
    fpt = flops_per_token(n_matmul, cfg, seq)
    data = SyntheticTokens(cfg["vocab_size"], seq, batch * (steps + args.warmup))
    table = arms(acc)
    chosen = args.arms.split(",") if args.arms else list(table)
    unknown = sorted(set(chosen) - set(table))
    if unknown:
        raise SystemExit(f"--arms: unknown {unknown}; choose from {sorted(table)}")
    result: dict[str, Any] = {
        "environment": environment(), "device": name, "accelerator": acc, "model": cfg, "n_params": n_params,
        "n_matmul_params": n_matmul, "seq": seq, "batch": batch, "tokens_per_step": batch * seq,
        "flops_per_token": fpt, "peak_bf16_flops": peak, "steps": steps, "warmup": args.warmup,
        "repeats": args.repeats, "arms": {},
    }
    runs: dict[str, list[dict[str, Any]]] = {a: [] for a in chosen}
    for _ in range(args.repeats):
        for arm in chosen:
            _free(acc)
            try:
                r = table[arm](cfg, data, batch, steps, args.warmup, fused)
                if acc != "cpu":
                    r["peak_allocated_bytes"] = dev.memory_stats(acc)["max_allocated_bytes"]
            except Exception:  # one broken arm must not hide the others' numbers
                r = {"error": traceback.format_exc()[-3000:]}
                print(arm, r["error"], flush=True)
            runs[arm].append(r)
    for arm, rs in runs.items():
        ok = [r for r in rs if "error" not in r]
        if not ok:
            result["arms"][arm] = {"error": rs[-1]["error"]}
            continue
        step = median([t for r in ok for t in r["step_times"]])
        tps = batch * seq / step
        entry = {"step_ms": step * 1e3, "tokens_per_s": tps, "mfu": tps * fpt / peak if peak else None,
                 "losses": ok[-1]["losses"], "peak_allocated_gib": (ok[-1].get("peak_allocated_bytes") or 0) / 2**30}
        if "fusion_report" in ok[-1]:
            entry["fusion_report"] = ok[-1]["fusion_report"]
        result["arms"][arm] = entry
    base = result["arms"].get("ddp", {}).get("tokens_per_s")
    for arm, entry in result["arms"].items():
        if base and "tokens_per_s" in entry:
            entry["ratio_vs_ddp"] = entry["tokens_per_s"] / base
    print(f"{name}: {n_params / 1e9:.3f}B params, {batch}x{seq} tokens/step, {fpt / 1e9:.2f} GFLOP/token")
    print(f"{'arm':28s} {'step ms':>9s} {'tokens/s':>10s} {'MFU':>7s} {'vs ddp':>7s} {'peak GiB':>9s}")
    for arm, e in result["arms"].items():
        if "error" in e:
            print(f"{arm:28s} ERROR")
            continue
        mfu = f"{e['mfu'] * 100:6.1f}%" if e["mfu"] is not None else "    n/a"
        print(f"{arm:28s} {e['step_ms']:9.1f} {e['tokens_per_s']:10.0f} {mfu:>7s} {e.get('ratio_vs_ddp', 0):7.3f} "
              f"{e['peak_allocated_gib']:9.2f}")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    path = Path(args.out) / f"gpu_mfu_{acc}.json"
    _env.write_json(path, result)
    print("wrote", path)
    return result


if __name__ == "__main__":
    main()
