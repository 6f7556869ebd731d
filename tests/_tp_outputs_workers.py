"""A `transformers` Llama trained under tp whose logits ordinary code uses: torchmetrics, argmax, `self.log`,
`all_gather`, `generate`. `lightning_npu.launch.spawn` runs `run_outputs` in real processes."""

from __future__ import annotations

from typing import Any, Optional

import lightning as L
import torch
import torch.nn.functional as F
from torchmetrics import SumMetric
from torchmetrics.classification import MulticlassAccuracy
from torchmetrics.text import Perplexity

import lightning_npu
from lightning_npu import NPUHybridStrategy
from lightning_npu.parallel.tensor_parallel.logits import VocabParallelLogits
from tests._gpt_workers import SMALL_GPT, LossRecorder, parity_trainer
from tests._tp_workers import HFCausalLM

VOCAB = 256
PROMPT = torch.tensor([[72, 101, 108, 108, 111, 32], [84, 104, 101, 32, 99, 97]])  # "Hello ", "The ca"


def _local_bytes(t: torch.Tensor) -> tuple[int, int]:
    """(storage id, bytes) of the storage a saved tensor holds on this rank (a DTensor: its local shard)."""
    local = t.to_local() if hasattr(t, "to_local") else t
    storage = local.untyped_storage()
    return storage.data_ptr(), storage.nbytes()


class OrdinaryLM(HFCausalLM):
    """A Llama whose steps use the logits the way ordinary Lightning code does."""

    def __init__(self) -> None:
        super().__init__("llama", **SMALL_GPT)
        self.ppl = Perplexity()
        self.acc = MulticlassAccuracy(num_classes=VOCAB, average="micro")
        self.tokens = SumMetric()
        self.logits_bytes: list[int] = []  # bytes of logits-sized tensors saved for backward, forward + loss
        self.gathered_for_loss: list[bool] = []
        self.logits_types: set[str] = set()
        self.generated: Optional[torch.Tensor] = None
        self.gathered: list[torch.Tensor] = []

    def on_train_start(self) -> None:
        # greedy decoding with the KV cache, before any step (the same weights as one process)
        self.generated = self.model.generate(PROMPT.to(self.device), max_new_tokens=6, do_sample=False).cpu()

    def training_step(self, batch, batch_idx):
        idx, targets = batch
        held: dict[int, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            if t.numel() == idx.numel() * VOCAB:  # logits-sized (a DTensor reports its global size)
                ptr, nbytes = _local_bytes(t)
                held[ptr] = nbytes
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logits = self(idx)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        self.logits_bytes.append(sum(held.values()))
        self.logits_types.add(type(logits).__name__)
        self.gathered_for_loss.append(isinstance(logits, VocabParallelLogits) and logits._full is not None)
        # ordinary code on the logits: torchmetrics, argmax == y, a logged statistic, a logged DTensor
        self.ppl.update(logits, targets)
        self.acc.update(logits.flatten(0, 1), targets.flatten())
        self.tokens.update(torch.tensor(float(targets.numel())))
        self.log("argmax_acc", (logits.argmax(-1) == targets).float().mean(), sync_dist=True)
        self.log("logit_sq_mean", logits.float().square().mean(), sync_dist=True)
        as_dtensor = logits.dtensor if isinstance(logits, VocabParallelLogits) else logits
        self.log("logit_mean_dtensor", as_dtensor.detach().float().mean(), sync_dist=True)
        self.log("train_loss", loss, sync_dist=True)
        self.gathered.append(self.all_gather(as_dtensor.detach().float().mean()).cpu())  # DTensor: full value per rank
        return loss

    def validation_step(self, batch, batch_idx):
        idx, targets = batch
        logits = self(idx)
        as_dtensor = logits.dtensor if isinstance(logits, VocabParallelLogits) else logits
        # on_epoch accumulation of a DTensor and of a logits statistic
        self.log("val_mean_dtensor", as_dtensor.float().mean(), sync_dist=True)
        self.log("val_loss", F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten()), sync_dist=True)


class MetricsRecorder(L.Callback):
    def __init__(self) -> None:
        self.rows: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        keys = ("argmax_acc", "logit_sq_mean", "logit_mean_dtensor", "train_loss")
        self.rows.append({k: float(trainer.callback_metrics[k]) for k in keys})


def run_outputs(devices: int, tp: int, override: bool = False, steps: int = 3) -> dict[str, Any]:
    strategy_kwargs = {"tensor_parallel_size": tp, "zero_stage": 1 if devices > tp else 0}
    L.seed_everything(0, verbose=False)
    model = OrdinaryLM()
    recorder, metrics = LossRecorder(), MetricsRecorder()
    trainer, data = parity_trainer(NPUHybridStrategy(**strategy_kwargs), model, devices, 8, steps,
                                   [recorder, metrics], log_every_n_steps=1)
    trainer.fit(model, datamodule=data)
    val = trainer.validate(model, datamodule=data, verbose=False)[0]
    strategy = trainer.strategy
    rank = trainer.global_rank
    out: dict[str, Any] = {
        "logged": recorder.logged,
        "rows": metrics.rows,
        "val": val,
        "state": {k: v.detach().clone() for k, v in lightning_npu.full_state_dict(model).items()},
        "ppl": float(model.ppl.compute()),
        "acc": float(model.acc.compute()),
        "tokens": float(model.tokens.compute()),
        "metric_group_size": (torch.distributed.get_world_size(model.tokens.process_group)
                              if model.tokens.process_group is not None else None),
        "logits_bytes": model.logits_bytes,
        "gathered_for_loss": model.gathered_for_loss,
        "logits_types": sorted(model.logits_types),
        "generated": model.generated,
        "gathered": model.gathered,
        "any_rank0": strategy.reduce_boolean_decision(rank == 0, all=False),
        "all_rank0": strategy.reduce_boolean_decision(rank == 0, all=True),
    }
    if override:
        # a dict plan on top of "auto": the LM head replicated (plain, full logits; the loss is an ordinary one)
        L.seed_everything(0, verbose=False)
        model = OrdinaryLM()
        recorder = LossRecorder()
        plan = {"*": "auto", "model.lm_head": "replicate"}
        trainer, data = parity_trainer(NPUHybridStrategy(**strategy_kwargs, tp_plan=plan), model, devices, 8, 2,
                                       [recorder])
        trainer.fit(model, datamodule=data)
        out["override"] = {"logged": recorder.logged, "report": str(trainer.strategy.tp_report),
                           "logits_types": sorted(model.logits_types)}
    return out
