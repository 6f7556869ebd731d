"""Tensor-parallel checkpoints resume and consolidate exactly (fp32, real processes), and vocab-parallel cross
entropy equals the full one. (tp against one process: the layout table, tests/test_layouts.py.)"""

import pytest
import torch

from tests._layouts import TP2, Layout, launch_calls, run_layout
from tests._tp_workers import refit_after_split, vocab_parallel_ce_check

# Same bounds as the foundation parity tests (see there): a wrong shard, a missing all-reduce or a
# q/k/v mix-up moves parameters by ~lr = 3e-3 after 5 steps, three orders of magnitude above these.
RTOL, ATOL = 1e-5, 1e-6
TP2_DIR = Layout("tp2", 2, TP2, checks=(), clip=None)
TP2_FILE = Layout("tp2-file", 2, {**TP2, "save_distributed_checkpoint": False}, checks=(), clip=None)
TP1 = Layout("tp1", 1, {"zero_stage": 0}, checks=(), clip=None)
STEP3 = "epoch=0-step=3.ckpt"


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every run of the module in three launches (start-up and imports paid once per launch): 2 processes train
    tp=2 for 6 steps, checkpointing into a directory and into single files, then check vocab-parallel CE; 2 resume
    both step-3 checkpoints at tp=2; 1 resumes both at tp=1, then writes the one-process step-3 checkpoint."""
    root = tmp_path_factory.mktemp("tp")
    train = dict(steps=6, limit_train_batches=3)
    ckpt = {"dir": root / "dir" / STEP3, "file": root / "file" / STEP3}
    full_dir, full_file, ce, refit = launch_calls(2, [
        (run_layout, dict(layout=TP2_DIR, ckpt_dir=str(root / "dir"), **train)),
        (run_layout, dict(layout=TP2_FILE, ckpt_dir=str(root / "file"), **train)),
        (vocab_parallel_ce_check, {}),
        (refit_after_split, {}),
    ])
    tp2_dir, tp2_file = launch_calls(2, [(run_layout, dict(layout=lay, ckpt_in=str(ckpt[kind]), **train))
                                         for kind, lay in (("dir", TP2_DIR), ("file", TP2_FILE))])
    (tp1_dir,), (tp1_file,), _ = launch_calls(1, [
        (run_layout, dict(layout=TP1, ckpt_in=str(ckpt["dir"]), **train)),
        (run_layout, dict(layout=TP1, ckpt_in=str(ckpt["file"]), **train)),
        (run_layout, dict(layout=TP1, steps=3, ckpt_dir=str(root / "tp1"), limit_train_batches=3)),
    ])
    return dict(root=root, ckpt=ckpt, ce=ce, refit=refit, full={"dir": full_dir[0], "file": full_file[0]},
                resumed={"dir": [*tp2_dir, tp1_dir], "file": [*tp2_file, tp1_file]})


def assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].shape == b[k].shape, k
        torch.testing.assert_close(a[k], b[k], rtol=RTOL, atol=ATOL, msg=lambda m: f"{k}: {m}")


def assert_resumed(runs: dict, kind: str) -> None:
    """Resuming at step 3 at tp=2 (each rank) and under one process repeats steps 4-6 exactly."""
    full = runs["full"][kind]
    for run in runs["resumed"][kind]:
        assert run["global_step"] == 6
        torch.testing.assert_close(torch.tensor(run["logged"]), torch.tensor(full["logged"][3:]), rtol=RTOL, atol=0)
        assert_same_state(run["state"], full["state"])


def test_resume_under_tp(runs):
    """tp=2 checkpoints are DCP directories of the global tensors (each tp rank wrote its shard): resuming at tp=2
    and at tp=1 both repeat steps 4-6 exactly."""
    from lightning_npu.parallel.checkpoint.safe_load import checkpoint_tensor_metadata
    from lightning_npu.parallel.checkpoint.sharded import consolidate_model_state

    ckpt = runs["ckpt"]["dir"]
    assert ckpt.is_dir(), sorted(p.name for p in ckpt.parent.iterdir())
    stored = checkpoint_tensor_metadata(ckpt)["state_dict.model.transformer.h.0.attn.c_attn.weight"]
    assert tuple(stored.size) == (96, 32) and len(stored.chunks) == 2  # the full tensor, written as 2 tp shards
    # consolidation (`lightning-npu convert-checkpoint`) restores the original q|k|v layout: the tp=2 step-3
    # checkpoint consolidates to the one a single process writes at step 3
    tp2_full, _ = consolidate_model_state(ckpt)
    tp1_full, _ = consolidate_model_state(runs["root"] / "tp1" / STEP3)
    assert tp2_full.keys() == tp1_full.keys()
    for k, v in tp1_full.items():
        torch.testing.assert_close(tp2_full[k], v, rtol=RTOL, atol=1e-6, msg=lambda m: f"{k}: {m}")
    assert_resumed(runs, "dir")


def test_resume_from_a_single_file_under_tp(runs):
    """`save_distributed_checkpoint=False` at tp=2: one Lightning file of full tensors in the original layout (the
    fused q|k|v weight and its Adam moments un-fused once); resuming it at tp=2 and under one process repeats steps
    4-6 exactly."""
    assert runs["ckpt"]["file"].is_file()
    assert_resumed(runs, "file")


def test_vocab_parallel_cross_entropy_matches_full(runs):
    for rank in runs["ce"]:
        for reduction, r in rank.items():
            assert r["plain"], reduction  # a plain tensor comes back: `self.log(loss)` works unchanged
            assert r["local_grad_shape"] == (6, 5, 8)  # the gradient stays vocab-sharded
            torch.testing.assert_close(r["loss"], r["ref"], rtol=1e-6, atol=1e-6, msg=lambda m: f"{reduction}: {m}")
            torch.testing.assert_close(r["grad"], r["ref_grad"], rtol=1e-6, atol=1e-7, msg=lambda m: f"{reduction}: {m}")
            if reduction == "none":
                assert (r["loss"].view(6, 5)[0, :3] == 0).all()  # ignore_index contributes nothing


def test_a_split_module_is_refused_by_a_new_trainer_with_the_fix(runs):
    """A new Trainer given a module an earlier tp fit split: one clear error naming the fix (it failed inside
    DTensor's distribute_module before), and the fix (its full state into a fresh instance) trains."""
    for rank in runs["refit"]:
        assert rank["error"].startswith("ParallelConfigError: this GPTModule was already split by an earlier fit's "
                                        "NPUHybridStrategy (tensor_parallel_size=2)"), rank["error"]
        assert "lightning_npu.full_state_dict(model)" in rank["error"]
        assert rank["fresh_equals_trained"] and rank["fresh_trained"] == 2
