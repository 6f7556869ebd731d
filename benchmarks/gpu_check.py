"""One-shot accelerator check: the same strategy code on a real GPU/NPU (never run in CI).

Proves the device layer picks the accelerator and its backend, trains the example GPT under
`npu_hybrid` and Lightning's `"ddp"` side by side (tokens/s, MFU, ratio), checks bf16-mixed
autocasts on the accelerator, and compares the fused-op rewrite against the unfused model there.

    python benchmarks/gpu_check.py [--out DIR] [--steps 30] [--small]
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks import _env  # noqa: E402
from benchmarks._common import environment, median, run_gpt  # noqa: E402
from lightning_npu import device as dev  # noqa: E402

PEAK_BF16_FLOPS = {"NVIDIA H200": 989e12, "NVIDIA H100 80GB HBM3": 989e12}


def flops_per_token(n_params: int, n_layer: int, n_embd: int, block: int) -> float:
    # 6N for the matmuls' forward+backward, plus attention scores/values (PaLM appendix B).
    return 6 * n_params + 12 * n_layer * n_embd * block


def check_device() -> dict:
    acc = dev.accelerator_type()
    return {"accelerator_type": acc, "backend": dev.comm_backend(acc), "count": dev.device_count(acc),
            "name": torch.cuda.get_device_name(0) if acc == "cuda" else acc}


def check_training(acc: str, model: dict, batch: int, steps: int) -> dict:
    from examples.gpt.model import GPT, GPTConfig
    from lightning_npu import NPUHybridStrategy

    n_params = sum(p.numel() for p in GPT(GPTConfig(**{k: model[k] for k in ("n_layer", "n_head", "n_embd",
                                                                              "block_size")})).parameters())
    tokens_per_step = batch * model["block_size"]
    fpt = flops_per_token(n_params, model["n_layer"], model["n_embd"], model["block_size"])
    peak = PEAK_BF16_FLOPS.get(torch.cuda.get_device_name(0) if acc == "cuda" else "", None)
    out = {"n_params": n_params, "tokens_per_step": tokens_per_step}
    from lightning_npu import HybridPrecision

    # (strategy, plugins): Lightning's DDP+autocast; ours as shipped (fp32 norm/softmax islands, dynamic loss
    # scale); ours without the loss scaler (bf16 needs none); ours with the fused-op rewrite. Run twice, interleaved.
    configs = {
        "ddp": lambda: ("ddp", None),
        "npu_hybrid": lambda: (NPUHybridStrategy(zero_stage=0), None),
        "npu_hybrid_no_loss_scale": lambda: (NPUHybridStrategy(zero_stage=0),
                                             [HybridPrecision("bf16-mixed", loss_scale=None)]),
        "npu_hybrid_fuse_ops": lambda: (NPUHybridStrategy(zero_stage=0, fuse_ops=True), None),
    }
    runs: dict[str, list[dict]] = {name: [] for name in configs}
    for _ in range(2):
        for name, make in configs.items():
            strategy, plugins = make()
            r = run_gpt(strategy, 1, steps, 5, batch, model, precision="bf16-mixed", accelerator=acc, plugins=plugins)
            runs[name].append(r)
    for name, rs in runs.items():
        step = median([t for r in rs for t in r["step_times"]])
        tps = tokens_per_step / step
        out[name] = {"step_ms": step * 1e3, "tokens_per_s": tps, "final_loss": rs[-1]["final_loss"],
                     "mfu": (tps * fpt / peak) if peak else None}
    for name in configs:
        out[name]["ratio_vs_ddp"] = out[name]["tokens_per_s"] / out["ddp"]["tokens_per_s"]
    if acc == "cuda":
        out["max_allocated_gib"] = torch.cuda.max_memory_allocated() / 2**30
    return out


def check_precision(acc: str) -> dict:
    import lightning as L

    trainer = L.Trainer(strategy="npu_hybrid", accelerator=acc, devices=1, precision="bf16-mixed", logger=False)
    plugin = trainer.strategy.precision_plugin
    with plugin.forward_context():
        y = torch.ones(4, 4, device=acc) @ torch.ones(4, 4, device=acc)
    return {"plugin": type(plugin).__name__, "plugin_device": getattr(plugin, "device", None),
            "matmul_dtype": str(y.dtype)}


def check_rewrite(acc: str) -> dict:
    from examples.gpt.model import GPT, GPTConfig
    from lightning_npu.ops import rewrite_modules

    torch.manual_seed(0)
    ref = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=128, block_size=64)).to(acc)
    fused = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=128, block_size=64)).to(acc)
    fused.load_state_dict(ref.state_dict())
    report = rewrite_modules(fused, device=torch.device(acc))
    x = torch.randint(0, 256, (4, 64), device=acc)
    a, b = ref(x), fused(x)
    a.float().square().mean().backward()
    b.float().square().mean().backward()
    grad_err = max(((p.grad - q.grad).abs().max() / (p.grad.abs().max() + 1e-12)).item()
                   for p, q in zip(ref.parameters(), fused.parameters()))
    return {"report": str(report)[:2000], "same_keys": list(ref.state_dict()) == list(fused.state_dict()),
            "max_rel_out_err": ((a - b).abs().max() / a.abs().max()).item(), "max_rel_grad_err": grad_err}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", default=str(Path(__file__).resolve().parent / "results"))
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--small", action="store_true", help="tiny model (smoke test on CPU)")
    args = p.parse_args()
    model = (dict(n_layer=2, n_head=4, n_embd=64, block_size=64) if args.small
             else dict(n_layer=12, n_head=12, n_embd=768, block_size=1024))
    batch = 4 if args.small else 16
    result: dict = {"environment": environment(), "model": model, "batch": batch}
    result["device"] = check_device()
    acc = result["device"]["accelerator_type"]
    for name, fn in (("precision", lambda: check_precision(acc)), ("rewrite", lambda: check_rewrite(acc)),
                     ("training", lambda: check_training(acc, model, batch, args.steps))):
        try:
            result[name] = fn()
        except Exception:  # keep going: one broken check must not hide the others' numbers
            result[name] = {"error": traceback.format_exc()[-3000:]}
        print(name, json.dumps(result[name], indent=1)[:3000], flush=True)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    path = Path(args.out) / f"gpu_check_{acc}.json"
    _env.write_json(path, result)
    print("wrote", path)


if __name__ == "__main__":
    main()
