"""pp=2 x dp=2 under ZeRO 0/1: the dp bucket reductions launch inside the schedule (after each stage's last backward),
with the same results as reducing after it."""

from __future__ import annotations

import time
from typing import Any

import lightning as L
import torch

from examples.gpt.model import GPTModule
from lightning_npu import NPUHybridStrategy
from tests._gpt_workers import LossRecorder, parity_trainer
from tests._pp_workers import PP_GPT


class _Overlap(L.Callback):
    """Records how many buckets were in flight when the schedule returned, and the wall time of each step; with
    ``enabled=False`` it removes the runner's listeners (the reduction then starts after the schedule, as before)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.in_flight: list[int] = []
        self.times: list[float] = []
        self.in_buffer: list[float] = []  # per step: the fraction of gradients that are views of a bucket buffer
        self.copied = 0  # bytes the gradient sync copied over the run
        self._counting_now = False
        self.grad_bytes = 0  # this rank's fp32 gradient bytes in the buckets
        self._t = 0.0

    def on_train_start(self, trainer, pl_module) -> None:
        runner = trainer.strategy._pipeline
        if runner is None:  # the one-process reference
            self.buckets = []
            return
        if not self.enabled:
            runner.grad_listeners = []
        self.buckets = list(runner.grad_buffers)  # the `GradientBuckets` (the listeners are their `params_ready`)
        self.grad_bytes = 4 * sum(p.numel() for gb in self.buckets for p in gb.params)
        for gb in self.buckets:  # count what the gradient sync copies (its launches, the finish, `take`)
            for name in ("_launch", "finish", "take"):
                setattr(gb, name, self._counting(getattr(gb, name)))

    def _counting(self, method: Any) -> Any:
        from tests.test_pp_inplace_buckets import CopiedBytes

        def counted(*args: Any, **kwargs: Any) -> Any:
            if self._counting_now:  # `finish` launches: counted once, by the outer call
                return method(*args, **kwargs)
            self._counting_now = True
            try:
                with CopiedBytes() as counter:
                    out = method(*args, **kwargs)
            finally:
                self._counting_now = False
            self.copied += counter.bytes
            return out

        return counted

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._t = time.perf_counter()

    def on_before_backward(self, trainer, pl_module, loss) -> None:  # after training_step ran the schedule
        self.in_flight.append(sum(b.launched for gb in self.buckets for b in gb.buckets))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        # after backward: each gradient (zero 1: its local dp slice) is a view of its bucket's in-place buffer
        storages = {b.flat.untyped_storage().data_ptr() for gb in self.buckets for b in gb.buckets
                    if b.flat is not None}
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        self.in_buffer.append(sum(getattr(g, "_local_tensor", g).untyped_storage().data_ptr() in storages
                                  for g in grads) / max(1, len(grads)))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.times.append(time.perf_counter() - self._t)


def train_overlap(runs: list[dict[str, Any]], steps: int, model_kwargs: dict[str, Any],
                  devices: int = 4) -> list[dict[str, Any]]:
    """Each run at pp=2 (dp = devices / 2), or (``"pp": 1``) without a pipeline: the one-process reference."""
    out = []
    for run in runs:
        L.seed_everything(0, verbose=False)
        pipeline = {"pipeline_parallel_size": 2, "micro_batches": 2} if run.get("pp", 2) == 2 else {}
        strategy = NPUHybridStrategy(**pipeline, **run["strategy"])
        model = GPTModule(**{**PP_GPT, **model_kwargs})
        rec, overlap = LossRecorder(), _Overlap(run["overlap"])
        trainer, data = parity_trainer(strategy, model, devices, 8, steps, [rec, overlap], num_sanity_val_steps=0,
                                       **run.get("trainer", {}))
        trainer.fit(model, datamodule=data)
        out.append({"logged": rec.logged, "in_flight": overlap.in_flight, "in_buffer": overlap.in_buffer,
                    "copied_per_step": overlap.copied / steps, "grad_bytes": overlap.grad_bytes, "times": overlap.times,
                    "state": {k: v.detach().clone() for k, v in model.state_dict().items()}})
    return out
