"""Tensor-parallel checkpoints resume and consolidate exactly (fp32, real processes), and vocab-parallel cross
entropy equals the full one. (tp against one process: the layout table, tests/test_layouts.py.)"""

from functools import partial

import torch

from lightning_npu.launch import spawn
from tests._layouts import TP2, Layout, run_layout
from tests._tp_workers import vocab_parallel_ce_check

# Same bounds as the foundation parity tests (see there): a wrong shard, a missing all-reduce or a
# q/k/v mix-up moves parameters by ~lr = 3e-3 after 5 steps, three orders of magnitude above these.
RTOL, ATOL = 1e-5, 1e-6


def assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].shape == b[k].shape, k
        torch.testing.assert_close(a[k], b[k], rtol=RTOL, atol=ATOL, msg=lambda m: f"{k}: {m}")


def test_resume_under_tp(tmp_path):
    """tp=2 checkpoints are DCP directories of the global tensors (each tp rank wrote its shard): resuming at tp=2
    and at tp=1 both repeat steps 4-6 exactly."""
    from lightning_npu.parallel.checkpoint.safe_load import checkpoint_tensor_metadata
    from lightning_npu.parallel.checkpoint.sharded import consolidate_model_state

    tp2, tp1 = Layout("tp2", 2, TP2, checks=(), clip=None), Layout("tp1", 1, {"zero_stage": 0}, checks=(), clip=None)
    full = spawn(partial(run_layout, steps=6, ckpt_dir=str(tmp_path), limit_train_batches=3), 2, tp2)
    ckpt = tmp_path / "epoch=0-step=3.ckpt"
    assert ckpt.is_dir(), sorted(p.name for p in tmp_path.iterdir())
    stored = checkpoint_tensor_metadata(ckpt)["state_dict.model.transformer.h.0.attn.c_attn.weight"]
    assert tuple(stored.size) == (96, 32) and len(stored.chunks) == 2  # the full tensor, written as 2 tp shards
    resume = partial(run_layout, steps=6, ckpt_in=str(ckpt), limit_train_batches=3)
    resumed, (relaid,) = spawn(resume, 2, tp2), spawn(resume, 1, tp1)
    # consolidation (`lightning-npu convert-checkpoint`) restores the original q|k|v layout: the tp=2 step-3
    # checkpoint consolidates to the one a single process writes at step 3
    spawn(partial(run_layout, steps=3, ckpt_dir=str(tmp_path / "tp1"), limit_train_batches=3), 1, tp1)
    tp2_full, _ = consolidate_model_state(ckpt)
    tp1_full, _ = consolidate_model_state(tmp_path / "tp1" / "epoch=0-step=3.ckpt")
    assert tp2_full.keys() == tp1_full.keys()
    for k, v in tp1_full.items():
        torch.testing.assert_close(tp2_full[k], v, rtol=RTOL, atol=1e-6, msg=lambda m: f"{k}: {m}")
    for run in (resumed[0], resumed[1], relaid):
        assert run["global_step"] == 6
        torch.testing.assert_close(torch.tensor(run["logged"]), torch.tensor(full[0]["logged"][3:]), rtol=RTOL, atol=0)
        assert_same_state(run["state"], full[0]["state"])


def test_resume_from_a_single_file_under_tp(tmp_path):
    """`save_distributed_checkpoint=False` at tp=2: one Lightning file of full tensors in the original layout (the
    fused q|k|v weight and its Adam moments un-fused once); resuming it at tp=2 and under one process repeats steps
    4-6 exactly."""
    tp2 = Layout("tp2-file", 2, {**TP2, "save_distributed_checkpoint": False}, checks=(), clip=None)
    tp1 = Layout("tp1", 1, {"zero_stage": 0}, checks=(), clip=None)
    full = spawn(partial(run_layout, steps=6, ckpt_dir=str(tmp_path), limit_train_batches=3), 2, tp2)
    ckpt = tmp_path / "epoch=0-step=3.ckpt"
    assert ckpt.is_file()
    resume = partial(run_layout, steps=6, ckpt_in=str(ckpt), limit_train_batches=3)
    resumed, (relaid,) = spawn(resume, 2, tp2), spawn(resume, 1, tp1)
    for run in (resumed[0], resumed[1], relaid):
        assert run["global_step"] == 6
        torch.testing.assert_close(torch.tensor(run["logged"]), torch.tensor(full[0]["logged"][3:]), rtol=RTOL, atol=0)
        assert_same_state(run["state"], full[0]["state"])


def test_vocab_parallel_cross_entropy_matches_full():
    for rank in spawn(vocab_parallel_ce_check, 2):
        for reduction, r in rank.items():
            assert r["plain"], reduction  # a plain tensor comes back: `self.log(loss)` works unchanged
            assert r["local_grad_shape"] == (6, 5, 8)  # the gradient stays vocab-sharded
            torch.testing.assert_close(r["loss"], r["ref"], rtol=1e-6, atol=1e-6, msg=lambda m: f"{reduction}: {m}")
            torch.testing.assert_close(r["grad"], r["ref_grad"], rtol=1e-6, atol=1e-7, msg=lambda m: f"{reduction}: {m}")
            if reduction == "none":
                assert (r["loss"].view(6, 5)[0, :3] == 0).all()  # ignore_index contributes nothing
