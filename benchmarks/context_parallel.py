"""Context parallelism on CPU: step time and saved activations per rank of the example GPT at cp = 1 and at cp = 2
with ring attention and with all-gathered K/V.

    python benchmarks/context_parallel.py [--seqs 1024 2048 4096 8192] [--steps 4]

Each point is a Trainer run of `npu_hybrid` (fp32, batch 1 per dp group) on 1 process (cp = 1) or 2 (cp = 2, dp = 1,
``context_parallel_attention`` "ring" or "allgather"): the median step time after one warm-up step, and the peak
bytes autograd saves for backward on rank 0 during the step (`lightning_npu.memory.SavedActivations`). The
attention-only figure is the saved bytes of one attention call (queries, keys and values of the local tokens in,
output out) under the same split and form. Writes ``benchmarks/results/context_parallel_cpu.json``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import lightning as L  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

from benchmarks import _env  # noqa: E402
from benchmarks._common import StepTimer, median  # noqa: E402
from lightning_npu.launch import spawn  # noqa: E402
from lightning_npu.memory import SavedActivations  # noqa: E402

MODEL = dict(vocab_size=256, n_layer=2, n_head=4, n_embd=64)


class _Tokens(Dataset):
    def __init__(self, seq: int, size: int) -> None:
        self.seq, self.size = seq, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int):
        t = torch.randint(0, 256, (self.seq + 1,), generator=torch.Generator().manual_seed(i))
        return t[:-1], t[1:]


class _Saved(L.Callback):
    """Peak saved-for-backward bytes of each training step (forward start to backward start), rank 0's."""

    def __init__(self) -> None:
        self.counter, self.peaks = SavedActivations(), []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.counter.start()

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        self.peaks.append(self.counter.peak)
        self.counter.stop()


def _attention_bytes(seq: int, cp: int, method: str) -> int:
    """Saved bytes of one attention call over `seq` tokens split over `cp` ranks (this rank's)."""
    from lightning_npu.parallel.context_parallel import attention, ring
    from lightning_npu.parallel.context_parallel.layout import ChunkLayout

    heads, dim = MODEL["n_head"], MODEL["n_embd"] // MODEL["n_head"]
    leaves = [torch.randn(1, heads, seq // cp, dim, requires_grad=True) for _ in range(3)]
    with SavedActivations() as saved:
        q, k, v = (t * 1.0 for t in leaves)  # activations, as in a model (leaves would not count)
        if cp == 1:
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            import torch.distributed as dist

            layout = ChunkLayout(cp, dist.get_rank())
            attention.STATE.group = dist.group.WORLD
            attention.STATE.query_positions = layout.positions(seq, "cpu")
            attention.STATE.key_positions = layout.gathered_positions(seq, "cpu")
            attention.STATE.key_order = torch.argsort(attention.STATE.key_positions)
            attention.STATE.chunks = layout.chunks(layout.rank)
            attention.STATE.all_chunks = tuple(layout.chunks(r) for r in range(cp))
            attention.STATE.method, attention.STATE.ring = method, ring.Ring(dist.group.WORLD)
            out = attention.cp_attention(q, k, v)
            del out
    return saved.peak


def point(seq: int, cp: int, steps: int, method: str = "ring") -> dict:
    from examples.gpt.model import GPTModule
    from lightning_npu import NPUHybridStrategy

    L.seed_everything(0, verbose=False)
    model = GPTModule(block_size=seq, **MODEL)
    model.on_train_batch_end = lambda *a, **k: None  # no throughput logging
    timer, saved = StepTimer(warmup=1), _Saved()
    trainer = L.Trainer(accelerator="cpu", devices=cp, strategy=NPUHybridStrategy(
        context_parallel_size=cp, context_parallel_attention=method, zero_stage=0),
                        max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[timer, saved], limit_val_batches=0,
                        num_sanity_val_steps=0)
    trainer.fit(model, DataLoader(_Tokens(seq, steps), batch_size=1))
    return {"seq": seq, "cp": cp, "attention": method if cp > 1 else "sdpa", "step_s": median(timer.times),
            "saved_activation_bytes": max(saved.peaks), "attention_saved_bytes": _attention_bytes(seq, cp, method)}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seqs", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "context_parallel_cpu.json"))
    args = p.parse_args(argv)
    rows = []
    for seq in args.seqs:
        one = spawn(point, 1, seq, 1, args.steps)[0]
        rows.append(one)
        for method in ("ring", "allgather"):
            two = spawn(point, 2, seq, 2, args.steps, method)[0]
            rows.append(two)
            print(f"seq {seq} cp2 {method}: step {one['step_s']:.3f} s -> {two['step_s']:.3f} s; saved activations "
                  f"per rank {one['saved_activation_bytes'] / 2**20:.1f} -> "
                  f"{two['saved_activation_bytes'] / 2**20:.1f} MiB "
                  f"(x{two['saved_activation_bytes'] / one['saved_activation_bytes']:.2f}); attention only "
                  f"x{two['attention_saved_bytes'] / one['attention_saved_bytes']:.2f}", flush=True)
    result = {"model": MODEL, "batch": 1, "precision": "32-true", "rows": rows,
              "note": "cp=2 'ring' passes K/V blocks point-to-point (1/cp of attention's saved bytes per rank); "
                      "'allgather' keeps the whole sequence's K/V on every rank."}
    _env.write_json(args.out, result)
    return result


if __name__ == "__main__":
    main()
