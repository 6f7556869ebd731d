"""Mixture of experts: step time and per-rank expert memory of expert parallelism against the replicated layout.

A `transformers` Mixtral from a config (2 layers, hidden 64, 8 experts of 256, top-2; sequences of 64 tokens, 4
per rank, fp32, AdamW) on 2 CPU processes, in three arms run in rotating order for `--rounds` rounds:

* ``replicated``: dp=2, ZeRO-0, every rank holds every expert;
* ``ep2``: dp=2, ``expert_parallel_size=2``: each rank holds 4 experts, tokens dispatched by all-to-all;
* ``tp2_experts``: tp=2 with ``tp_plan="auto"``: every expert split over the 2 ranks (both read one batch, so it
  processes half the tokens per step of the dp arms: compare its ``tokens_per_s``).

Per arm: the median step time (rank 0, after `--warmup` steps), tokens per second over the whole job, and the
bytes of expert parameters each rank holds. Ratios are against ``replicated`` (medians of the per-round values).

    python benchmarks/moe.py [--rounds 3] [--steps 10] [--out moe.json]
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
import torch.nn.functional as F  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from benchmarks._common import environment, median, write_json  # noqa: E402
from lightning_npu import NPUHybridStrategy  # noqa: E402
from lightning_npu.launch import spawn  # noqa: E402
from lightning_npu.parallel.optim.grad_norm import local_tensor  # noqa: E402

SEQ, PER_RANK, VOCAB = 64, 4, 256
ARMS = {
    "replicated": {"zero_stage": 0},
    "ep2": {"zero_stage": 0, "expert_parallel_size": 2},
    "tp2_experts": {"tensor_parallel_size": 2},
}


class Mixtral(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        import transformers

        transformers.logging.set_verbosity_error()
        config = transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
                                            num_experts_per_tok=2, max_position_embeddings=SEQ)
        self.model = transformers.MixtralForCausalLM(config)
        self.model.config._attn_implementation = "sdpa"

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.model(input_ids=x).logits.flatten(0, 1), y.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class StepTimer(L.Callback):
    def __init__(self) -> None:
        self.times: list[float] = []

    def on_train_batch_start(self, *args: Any) -> None:
        self._t = time.perf_counter()

    def on_train_batch_end(self, *args: Any) -> None:
        self.times.append(time.perf_counter() - self._t)


def _arm(strategy: dict[str, Any], steps: int, warmup: int) -> dict[str, Any]:
    L.seed_everything(0, verbose=False)
    model, timer = Mixtral(), StepTimer()
    s = NPUHybridStrategy(**strategy)
    dp = 2 // s.parallel_config.tensor_parallel_size
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=s, max_steps=steps + warmup, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=[timer], num_sanity_val_steps=0, limit_val_batches=0)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (PER_RANK * 2 * (steps + warmup), SEQ + 1), generator=g)
    start = time.perf_counter()
    trainer.fit(model, DataLoader(TensorDataset(tokens[:, :-1], tokens[:, 1:]), batch_size=PER_RANK))
    wall = time.perf_counter() - start
    expert_bytes = sum(local_tensor(p).numel() * p.element_size() for n, p in model.named_parameters()
                       if ".experts." in n)
    timed = timer.times[warmup:]
    return {"step_s": median(timed), "tokens_per_s": dp * PER_RANK * SEQ / median(timed), "fit_wall_s": wall,
            "expert_bytes_per_rank": expert_bytes}


def run(rounds: int, steps: int, warmup: int) -> list[dict[str, Any]]:
    out = []
    names = list(ARMS)
    for r in range(rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        out.append({name: _arm(ARMS[name], steps, warmup) for name in order})
    return out


def main(argv: Any = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", default="moe.json")
    args = parser.parse_args(argv)
    rounds = spawn(run, 2, args.rounds, args.steps, args.warmup)[0]
    arms = {}
    for name in ARMS:
        per = [r[name] for r in rounds]
        arms[name] = {k: median([p[k] for p in per]) for k in per[0]}
    ratios = {name: {"step_time_vs_replicated": median([r[name]["step_s"] / r["replicated"]["step_s"] for r in rounds]),
                     "tokens_per_s_vs_replicated": median([r[name]["tokens_per_s"] / r["replicated"]["tokens_per_s"]
                                                           for r in rounds]),
                     "expert_memory_vs_replicated": arms[name]["expert_bytes_per_rank"]
                     / arms["replicated"]["expert_bytes_per_rank"]} for name in ARMS if name != "replicated"}
    result = {"benchmark": "moe", "environment": environment(),
              "args": vars(args), "arms": arms, "ratios": ratios, "rounds": rounds}
    path = write_json(args.out, result)
    print(f"wrote {path}")
    for name, r in ratios.items():
        print(f"{name}: step x{r['step_time_vs_replicated']:.2f}, tokens/s x{r['tokens_per_s_vs_replicated']:.2f}, "
              f"expert memory per rank x{r['expert_memory_vs_replicated']:.2f}")
    return result


if __name__ == "__main__":
    main()
