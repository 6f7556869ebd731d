"""How a tensor-parallel shard is stored, measured: DTensor parameters against plain local shards.

The same tp=2 example GPT (the automatic plan, vocab-parallel loss) trains with AdamW (foreach, torch's default)
in two arms, alternating, in one 2-process run:

* ``dtensor``: the parameters stay DTensors (what Lightning's `ModelParallelStrategy` keeps); the optimizer steps
  DTensors;
* ``local``: `tp_shards.localize_parameters` stores plain local shards that each module re-wraps as DTensors
  around its own forward (what `npu_hybrid` does under ZeRO 0/1); the optimizer steps plain tensors.

Forward and backward run on DTensors in both arms, so the difference is the optimizer step (DTensor dispatch per
foreach op) and the re-wrapping. Reports the median of each phase (forward+backward, optimizer step) and the
losses of both arms, which must agree (same math).

    python benchmarks/tp_storage.py [--steps 30] [--warmup 3] [--repeats 3]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks import _env  # noqa: E402
from benchmarks._common import environment, median, write_json  # noqa: E402
from lightning_npu.launch import spawn  # noqa: E402

MODEL = dict(n_layer=4, n_head=8, n_embd=256, block_size=128, vocab_size=256, bias=False)  # tensor_parallel.py's
BATCH, TP = 8, 2


def _arm(storage: str, steps: int, warmup: int) -> dict[str, Any]:
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh

    from examples.gpt.model import GPTModule
    from lightning_npu.parallel.tensor_parallel import plan as tp
    from lightning_npu.parallel.tensor_parallel import shards as tp_shards

    torch.manual_seed(0)
    module = GPTModule(**MODEL)
    mesh = init_device_mesh("cpu", (TP,), mesh_dim_names=("tp",))
    tp.apply_tensor_parallel(module, mesh, tp.plan_tensor_parallel(module, TP))
    if storage == "local":
        tp_shards.localize_parameters(module)
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(1)
    fwd_bwd, step, losses = [], [], []
    for i in range(steps + warmup):
        idx = torch.randint(0, MODEL["vocab_size"], (BATCH, MODEL["block_size"] + 1), generator=gen)
        t0 = time.perf_counter()
        with tp.vocab_parallel_cross_entropy():
            logits = module(idx[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1).float(), idx[:, 1:].flatten())
            loss.backward()  # loss_parallel's backward runs inside its context too
        t1 = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad()
        t2 = time.perf_counter()
        losses.append(float(loss))
        if i >= warmup:
            fwd_bwd.append(t1 - t0)
            step.append(t2 - t1)
    return {"fwd_bwd_s": fwd_bwd, "step_s": step, "losses": losses}


def worker(arms: list[str], steps: int, warmup: int) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for storage in arms:
        out.setdefault(storage, []).append(_arm(storage, steps, warmup))
    return out


def main(argv: Any = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="tp_storage.json")
    args = parser.parse_args(argv)

    arms = [a for i in range(args.repeats) for a in (("local", "dtensor") if i % 2 == 0 else ("dtensor", "local"))]
    ranks = spawn(worker, TP, arms, args.steps, args.warmup)
    results: dict[str, Any] = {}
    for storage in ("dtensor", "local"):
        # a phase ends when the slowest rank ends it
        fb = [max(ts) for runs in zip(*(r[storage] for r in ranks)) for ts in zip(*(x["fwd_bwd_s"] for x in runs))]
        st = [max(ts) for runs in zip(*(r[storage] for r in ranks)) for ts in zip(*(x["step_s"] for x in runs))]
        results[storage] = {"fwd_bwd_ms_median": 1e3 * median(fb), "optimizer_step_ms_median": 1e3 * median(st),
                            "total_ms_median": 1e3 * median([a + b for a, b in zip(fb, st)]),
                            "losses_first_run": ranks[0][storage][0]["losses"]}
    d, loc = results["dtensor"], results["local"]
    summary = {
        "local_speedup_total": d["total_ms_median"] / loc["total_ms_median"],
        "local_speedup_optimizer_step": d["optimizer_step_ms_median"] / loc["optimizer_step_ms_median"],
        "local_speedup_fwd_bwd": d["fwd_bwd_ms_median"] / loc["fwd_bwd_ms_median"],
        "max_loss_difference": max(abs(a - b) for a, b in zip(d["losses_first_run"], loc["losses_first_run"])),
    }
    payload = {"benchmark": "tp_storage", "model": MODEL, "batch": BATCH, "tp": TP, "steps": args.steps,
               "warmup": args.warmup, "repeats": args.repeats, "environment": environment(),
               "results": results, "summary": summary}
    path = write_json(args.out, payload) if "/" not in args.out else _env.write_json(args.out, payload)
    print(f"wrote {path}")
    for storage, r in results.items():
        print(f"{storage:8s} fwd+bwd {r['fwd_bwd_ms_median']:7.1f} ms  step {r['optimizer_step_ms_median']:6.1f} ms  "
              f"total {r['total_ms_median']:7.1f} ms")
    print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in summary.items()})
    return payload


if __name__ == "__main__":
    main()
