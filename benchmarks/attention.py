"""One training step of the example GPT with attention through SDPA vs the explicit T x T softmax.

    python benchmarks/attention.py [--seq 128] [--repeats 30] [--device cpu]

Both models hold the same weights and see the same batch; the step is forward, backward and AdamW,
timed alternately (SDPA, explicit, SDPA, ...) so load drifts hit both, and the medians are compared.
Writes ``benchmarks/results/attention_<device>.json``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks import _env  # noqa: E402
from benchmarks._common import environment, median  # noqa: E402
from examples.gpt.model import GPT, GPTConfig  # noqa: E402
from lightning_npu import device as dev  # noqa: E402


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--device", default=None, help="default: the accelerator if any, else cpu")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = p.parse_args(argv)
    device = torch.device(args.device or dev.accelerator_type())
    cfg = dict(vocab_size=256, block_size=args.seq, n_layer=args.layers, n_head=args.heads, n_embd=args.width)
    torch.manual_seed(0)
    models = {"sdpa": GPT(GPTConfig(**cfg, attention="sdpa")).to(device)}
    models["explicit"] = GPT(GPTConfig(**cfg, attention="explicit")).to(device)
    models["explicit"].load_state_dict(models["sdpa"].state_dict())
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-3) for k, m in models.items()}
    x = torch.randint(0, 256, (args.batch, args.seq + 1), device=device)
    idx, tgt = x[:, :-1], x[:, 1:]
    times: dict[str, list[float]] = {k: [] for k in models}
    losses: dict[str, list[float]] = {k: [] for k in models}
    for i in range(args.repeats + 3):
        for name, model in models.items():
            dev.synchronize(device)
            t0 = time.perf_counter()
            loss = F.cross_entropy(model(idx).flatten(0, 1), tgt.flatten())
            loss.backward()
            opts[name].step()
            opts[name].zero_grad(set_to_none=True)
            dev.synchronize(device)
            if i >= 3:
                times[name].append(time.perf_counter() - t0)
            losses[name].append(float(loss.detach()))
    result = {
        "environment": environment(), "device": str(device), "model": cfg, "batch": args.batch,
        "step_ms": {k: median(v) * 1e3 for k, v in times.items()},
        "max_loss_diff": max(abs(a - b) for a, b in zip(losses["sdpa"], losses["explicit"])),
    }
    result["sdpa_speedup"] = result["step_ms"]["explicit"] / result["step_ms"]["sdpa"]
    print(f"{device} T={args.seq}: SDPA {result['step_ms']['sdpa']:.1f} ms, explicit {result['step_ms']['explicit']:.1f} ms "
          f"per step ({result['sdpa_speedup']:.2f}x); max loss difference {result['max_loss_diff']:.2e}")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    _env.write_json(Path(args.out) / f"attention_{device.type}.json", result)
    return result


if __name__ == "__main__":
    main()
