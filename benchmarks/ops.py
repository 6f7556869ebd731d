"""Forward+backward time of each fused op: ours vs eager PyTorch vs torch.compile (inductor).

Run as a script: ``python benchmarks/ops.py [--quick]``; writes benchmarks/results/ops.json and
prints a table. All three implementations run in the same process on the same inputs; the
reported numbers are medians over repeated fwd+bwd calls (after warm-up and compilation). The
end-to-end part times a training step (forward, backward, AdamW) of the example GPT with the
rewrite pass applied vs not.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks import _env  # noqa: E402
from lightning_npu.ops import extension  # noqa: E402
from lightning_npu.ops import functional as fx
from lightning_npu.ops import reference as ref


def fwd_bwd(op, leaves, make_inputs):
    """A closure running op forward and backward with fixed upstream gradients."""
    inputs = make_inputs()
    outs = op(*inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    grads = [torch.randn_like(o) for o in outs]

    def run():
        for t in leaves:
            t.grad = None
        o = op(*inputs)
        o = o if isinstance(o, tuple) else (o,)
        torch.autograd.backward(list(o), grads)

    return run


def op_cases(dtype, tokens: int, heads: int, seq: int):
    def leaf(*shape, scale=1.0):
        return (torch.randn(*shape) * scale).to(dtype).requires_grad_()

    h, f = 768, 3072
    cases = []
    x, b = leaf(tokens, f, scale=2.0), leaf(f)
    cases.append(("bias_gelu[erf]", (tokens, f), [x, b], lambda: (x, b),
                  lambda x, b: fx.bias_gelu(x, b, "none"), lambda x, b: ref.bias_gelu(x, b, "none")))
    cases.append(("bias_gelu[tanh]", (tokens, f), [x, b], lambda: (x, b),
                  lambda x, b: fx.bias_gelu(x, b, "tanh"), lambda x, b: ref.bias_gelu(x, b, "tanh")))
    xd, bd, rd = leaf(tokens, h), leaf(h), leaf(tokens, h)
    cases.append(("bias_dropout_add[p=0.1]", (tokens, h), [xd, bd, rd], lambda: (xd, bd, rd),
                  lambda x, b, r: fx.bias_dropout_add(x, b, r, 0.1), lambda x, b, r: ref.bias_dropout_add(x, b, r, 0.1)))
    xn, rn = leaf(tokens, h), leaf(tokens, h)
    w, bb = (torch.randn(h) * 0.1 + 1).requires_grad_(), torch.randn(h).requires_grad_()
    cases.append(("add_layer_norm", (tokens, h), [xn, rn, w, bb], lambda: (xn, rn, w, bb),
                  lambda x, r, w, b: fx.add_layer_norm(x, r, w, b, 1e-5),
                  lambda x, r, w, b: ref.add_layer_norm(x, r, w.to(x.dtype), b.to(x.dtype), 1e-5)))
    cases.append(("layer_norm", (tokens, h), [xn, w, bb], lambda: (xn, w, bb),
                  lambda x, w, b: fx.layer_norm(x, w, b, 1e-5),
                  lambda x, w, b: torch.nn.functional.layer_norm(x, (h,), w.to(x.dtype), b.to(x.dtype), 1e-5)))
    cases.append(("add_rms_norm", (tokens, h), [xn, rn, w], lambda: (xn, rn, w),
                  lambda x, r, w: fx.add_rms_norm(x, r, w, 1e-6),
                  lambda x, r, w: ref.add_rms_norm(x, r, w.to(x.dtype), 1e-6)))
    s = leaf(1, heads, seq, seq, scale=3.0)
    scale = 1 / 8.0
    cases.append(("scale_causal_softmax", tuple(s.shape), [s], lambda: (s,),
                  lambda s: fx.scale_mask_softmax(s, scale, causal=True),
                  lambda s: ref.scale_mask_softmax(s, scale, causal=True)))
    cases.append(("softmax", tuple(s.shape), [s], lambda: (s,),
                  lambda s: fx.scale_mask_softmax(s), lambda s: torch.softmax(s, dim=-1)))
    g, u = leaf(tokens, f, scale=2.0), leaf(tokens, f)
    cases.append(("swiglu", (tokens, f), [g, u], lambda: (g, u), fx.swiglu, ref.swiglu))
    return cases


def interleaved(fns: dict, repeat: int, warmup: int = 2) -> dict:
    """Round-robin timing: on a shared, noisy machine every variant sees the same contention."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    samples = {k: [] for k in fns}
    for _ in range(repeat):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            samples[k].append((time.perf_counter() - t0) * 1e3)
    return {k: (statistics.median(v), min(v)) for k, v in samples.items()}


def bench_ops(dtypes, tokens, heads, seq, repeat, with_inductor, only=None):
    rows = []
    for dtype in dtypes:
        for name, shape, leaves, make, ours, eager in op_cases(dtype, tokens, heads, seq):
            if only and name not in only:
                continue
            row = {"op": name, "dtype": str(dtype).replace("torch.", ""), "shape": list(shape)}
            fns = {"ours": fwd_bwd(ours, leaves, make), "eager": fwd_bwd(eager, leaves, make)}
            if with_inductor:
                torch._dynamo.reset()
                compiled = torch.compile(eager, dynamic=False)
                t0 = time.perf_counter()
                fns["inductor"] = fwd_bwd(compiled, leaves, make)
                fns["inductor"]()
                row["inductor_compile_s"] = round(time.perf_counter() - t0, 1)
            for k, (med, best) in interleaved(fns, repeat).items():
                row[f"{k}_ms"], row[f"{k}_min_ms"] = round(med, 3), round(best, 3)
            row["speedup_vs_eager"] = round(row["eager_ms"] / row["ours_ms"], 2)
            if with_inductor:
                row["speedup_vs_inductor"] = round(row["inductor_ms"] / row["ours_ms"], 2)
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


def bench_gpt(configs, steps):
    from examples.gpt.model import GPT, GPTConfig
    from lightning_npu.ops import rewrite_modules

    out = []
    for label, cfg, batch in configs:
        torch.manual_seed(0)
        base = GPT(GPTConfig(**cfg))
        steps_fn = {}
        for fused in (False, True, "explicit"):
            model = copy.deepcopy(base)
            if fused == "explicit":
                model = GPT(GPTConfig(**cfg, attention="explicit"))
                model.load_state_dict(base.state_dict())
            if fused is True:
                rewrite_modules(model, device="cpu")
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            idx = torch.randint(0, cfg["vocab_size"], (batch, cfg["block_size"]))
            tgt = torch.randint(0, cfg["vocab_size"], (batch, cfg["block_size"]))

            def step(model=model, opt=opt, idx=idx, tgt=tgt):
                opt.zero_grad(set_to_none=True)
                logits = model(idx)
                torch.nn.functional.cross_entropy(logits.flatten(0, 1), tgt.flatten()).backward()
                opt.step()

            steps_fn[fused] = step
        res = interleaved(steps_fn, steps)
        timings = {k: v[0] for k, v in res.items()}
        row = {"model": label, "config": cfg, "batch": batch, "unfused_step_ms": round(timings[False], 2), "unfused_min_ms": round(res[False][1], 2),
               "fused_min_ms": round(res[True][1], 2),
               "fused_step_ms": round(timings[True], 2), "speedup": round(timings[False] / timings[True], 3),
               # the same model with attention="explicit" (T x T softmax module), unfused: SDPA's gain
               "explicit_attention_step_ms": round(timings["explicit"], 2),
               "sdpa_vs_explicit_speedup": round(timings["explicit"] / timings[False], 3)}
        print(json.dumps(row), flush=True)
        out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="small shapes, no inductor (smoke run)")
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "ops.json"))
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads (1 = robust on a shared box)")
    ap.add_argument("--e2e-only", action="store_true", help="only the end-to-end GPT steps")
    ap.add_argument("--ops", nargs="*", default=None, help="only these op rows (e.g. layer_norm softmax), no end-to-end")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if extension.load() is None:
        raise SystemExit(f"C++ kernels unavailable: {extension.load_error()}")
    tokens, heads, seq = (1024, 4, 256) if args.quick else (8 * 1024, 12, 1024)
    ops = [] if args.e2e_only else bench_ops([torch.float32, torch.bfloat16], tokens, heads, seq, args.repeat, not args.quick and not args.ops,
                    only=args.ops)
    gpt_cfgs = [
        ("example GPT (examples/gpt/config.yaml)", dict(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=128), 8),
        ("GPT-2-small width, 2 layers", dict(vocab_size=256, block_size=256, n_layer=2, n_head=12, n_embd=768), 4),
    ]
    e2e = [] if args.ops else bench_gpt(gpt_cfgs[:1] if args.quick else gpt_cfgs, 10 if args.quick else 15)
    result = {
        "meta": {
            "torch": torch.__version__, "threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine(),
            "simd": getattr(extension.load(), "simd", "?"), "repeat": args.repeat,
            "note": "fwd+bwd medians in ms; softmax uses batch 1 x heads x seq x seq scores to bound memory/time",
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        },
        "ops": ops,
        "end_to_end": e2e,
    }
    _env.write_json(args.out, result)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    main()
