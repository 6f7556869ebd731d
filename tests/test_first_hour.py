"""What a user sees in the first runs (issue 27): the model summary counts the whole model in every layout, and a
resumed run's progress bar counts from the resumed step. One 2-process launch (tests/_first_hour_workers.py)."""

from __future__ import annotations

import pytest
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
