"""What a user sees in the first runs (issue 27): the model summary counts the whole model in every layout, and a
resumed run's progress bar counts from the resumed step. One 2-process launch (tests/_first_hour_workers.py) for the
summaries; the progress bar runs in-process, on one process."""

from __future__ import annotations

import lightning as L
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint, RichProgressBar, TQDMProgressBar
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.utilities.model_summary.model_summary import get_human_readable_count

from examples.gpt.model import GPTModule
from lightning_npu.launch import spawn
from tests._first_hour_workers import summaries
from tests._gpt_workers import SMALL_GPT


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    return spawn(summaries, 2, str(tmp_path_factory.mktemp("first_hour")), threads=1)


@pytest.mark.parametrize("layout", ["tp2", "pp2", "zero3"])
def test_summary_counts_the_whole_model(ranks, layout):
    model = GPTModule(**SMALL_GPT)
    total = get_human_readable_count(sum(p.numel() for p in model.parameters()))
    lines = [" ".join(line.split()) for line in ranks[0][layout]]
    assert f"{total} Total params" in lines and f"{total} Trainable params" in lines, "\n".join(lines)
    assert not any("Other params" in line for line in lines), "\n".join(lines)  # no stage's layers miscounted
    note = [line for line in lines if line.startswith("npu_hybrid: the parameter counts are the whole model's")]
    assert len(note) == (1 if layout == "pp2" else 0), lines
    assert not any("Total params" in line for line in ranks[1][layout])
    assert "WholeModelSummary" in ranks[0][f"{layout}-callbacks"]  # the user's ModelSummary(max_depth=2), replaced


@pytest.mark.parametrize("bar", [TQDMProgressBar, RichProgressBar])
def test_progress_bar_after_a_mid_epoch_resume_counts_from_the_resumed_batch(tmp_path, bar):
    """Lightning skips `on_train_epoch_start` on a mid-epoch resume: its tqdm bar read `5/?` at a rate of 5 batches
    over one, rich's total was the remaining steps (`5/3`). One process, in-process: BoringModel's 32-batch epoch,
    2 batches a step, resumed at step 2 (batch 4) with max_steps=5: 6 more batches, of 10 in the epoch. The bar is
    the user's own object throughout."""
    seen, first, bars = [], [], []

    class Probe(L.Callback):
        def on_train_epoch_start(self, trainer, pl_module):
            pb = trainer.progress_bar_callback
            first.append((type(pb).__name__, pb.train_progress_bar.total))

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            pb = trainer.progress_bar_callback
            if isinstance(pb, TQDMProgressBar):
                b = pb.train_progress_bar
                seen.append((type(pb).__name__, b.initial, b.n, b.total, b.desc))
            else:
                t = pb.progress.tasks[pb.train_progress_bar_id]
                # rich's speed counts the samples after the first: none may hold the jump to the resumed batch
                seen.append((type(pb).__name__, sum(s.completed for s in t._progress), t.completed, t.total,
                             t.description))

    def fit(max_steps, callbacks, ckpt_path=None):
        bars.append(bar())
        trainer = L.Trainer(accelerator="cpu", devices=1, strategy="npu_hybrid", max_steps=max_steps,
                            accumulate_grad_batches=2, limit_val_batches=0, logger=False, enable_model_summary=False,
                            default_root_dir=tmp_path, callbacks=[bars[-1], *callbacks])
        trainer.fit(BoringModel(), ckpt_path=ckpt_path)
        assert trainer.progress_bar_callback is bars[-1]

    fit(2, [ModelCheckpoint(dirpath=tmp_path / "ckpt", filename="mid", every_n_train_steps=2), Probe()])
    seen.clear()
    fit(5, [Probe()], ckpt_path=str(tmp_path / "ckpt" / "mid.ckpt"))
    name = bar.__name__
    if bar is TQDMProgressBar:
        assert [s[:4] for s in seen] == [(name, 4, 4 + i, 10) for i in range(1, 7)]
    else:
        assert [s[:4] for s in seen] == [(name, i, 4 + i, 10) for i in range(1, 7)]
    assert all("Epoch 0" in s[4] for s in seen), seen
    assert first == [(name, 4)], first  # a fresh epoch's total counts batches: 2 steps of 2
