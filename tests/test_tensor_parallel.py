"""Tensor parallelism (DTensor) must reproduce single-process training exactly (fp32, real processes)."""

import pytest
import torch
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel

from lightning_npu.launch import spawn
from tests._tp_workers import train_tp, vocab_parallel_ce_check

# Same bounds as the foundation parity tests (see there): a wrong shard, a missing all-reduce or a
# q/k/v mix-up moves parameters by ~lr = 3e-3 after 5 steps, three orders of magnitude above these.
RTOL, ATOL = 1e-5, 1e-6


def assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].shape == b[k].shape, k
        torch.testing.assert_close(a[k], b[k], rtol=RTOL, atol=ATOL, msg=lambda m: f"{k}: {m}")


def assert_parity(ranks: list, ref: dict) -> None:
    assert ref["logged"][-1] < ref["logged"][0]  # it trained
    for rank in ranks:
        assert rank["sharded"]
        torch.testing.assert_close(torch.tensor(rank["logged"]), torch.tensor(ref["logged"]), rtol=RTOL, atol=0)
        assert_same_state(rank["state"], ref["state"])
        assert rank["val_loss"] == pytest.approx(ref["val_loss"], rel=RTOL)


_refs: dict = {}


def reference(arch: str) -> dict:
    """One process, same seed and global batch (8): computed once per architecture."""
    if arch not in _refs:
        _refs[arch] = spawn(train_tp, 1, 1, 8, 5, {"zero_stage": 0}, arch)[0]
    return _refs[arch]


def test_tp2_matches_single_process():
    ranks = spawn(train_tp, 2, 2, 8, 5, {"zero_stage": 0, "tensor_parallel_size": 2})
    ref = reference("gpt")
    assert ranks[0]["mesh"] == (1, 1, 2)
    # every projection, the embedding and the head are sharded; only norms and wpe (32x32) stay whole
    assert ranks[0]["local_numel"] < 0.55 * ref["local_numel"]
    assert "model.transformer.h.0.attn.c_attn: qkv" in ranks[0]["report"]
    assert "n_head 4 -> 2" in ranks[0]["report"]
    assert_parity(ranks, ref)


def test_tp2_dict_plan_with_parallel_style_objects():
    """A user plan: globs -> style names, and a DTensor ParallelStyle object (LM head gathered, no loss parallel)."""
    plan = {
        "model.transformer.wte": "vocab",
        "*.attn.c_attn": "qkv",
        "*.attn.c_proj": "rowwise",
        "*.mlp.c_fc": "colwise",
        "*.mlp.c_proj": "rowwise",
        "model.lm_head": ColwiseParallel(output_layouts=Replicate()),
    }
    ranks = spawn(train_tp, 2, 2, 8, 5, {"zero_stage": 0, "tensor_parallel_size": 2, "tp_plan": plan})
    assert "model.lm_head: custom" in ranks[0]["report"]
    assert_parity(ranks, reference("gpt"))


def test_tp2_sequence_parallel_matches_single_process():
    """Norms, dropout and residuals on sequence shards (reduce-scatter after row-parallel, gather into blocks)."""
    ranks = spawn(train_tp, 2, 2, 8, 5, {"zero_stage": 0, "tensor_parallel_size": 2, "sequence_parallel": True})
    report = ranks[0]["report"]
    assert "sequence parallel" in report and "model.transformer.h.0.ln_1: norm" in report
    assert "model.transformer.wpe: position" in report and "model.transformer.h.0.attn: gather_seq" in report
    assert_parity(ranks, reference("gpt"))


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage", [0, 1])
def test_dp2_tp2_matches_single_process(zero_stage):
    ranks = spawn(train_tp, 4, 4, 8, 5, {"zero_stage": zero_stage, "tensor_parallel_size": 2})
    assert ranks[0]["mesh"] == (1, 2, 2)
    assert ranks[0]["optimizer"] == ("DistributedOptimizer" if zero_stage == 1 else "MixedPrecisionOptimizer")
    assert_parity(ranks, reference("gpt"))


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_transformers_auto_plan_tp2(arch):
    """`transformers` LlamaForCausalLM (GQA, gated MLP) and GPT2LMHeadModel (Conv1D, fused c_attn, tied head)."""
    ranks = spawn(train_tp, 2, 2, 8, 5, {"zero_stage": 0, "tensor_parallel_size": 2}, arch)
    report = ranks[0]["report"]
    if arch == "llama":
        assert "self_attn.k_proj: colwise" in report and "mlp.down_proj: rowwise" in report
    else:
        assert "attn.c_attn: qkv" in report and "num_heads 4 -> 2" in report
    assert "model.lm_head: vocab" in report
    assert_parity(ranks, reference(arch))


def test_resume_under_tp(tmp_path):
    """tp=2 checkpoints are DCP directories of the global tensors (each tp rank wrote its shard): resuming at tp=2
    and at tp=1 both repeat steps 4-6 exactly."""
    from lightning_npu.parallel.checkpoint import checkpoint_tensor_metadata, consolidate_model_state

    tp2 = {"zero_stage": 0, "tensor_parallel_size": 2}
    full = spawn(train_tp, 2, 2, 8, 6, tp2, "gpt", None, str(tmp_path), None, 3)
    ckpt = tmp_path / "epoch=0-step=3.ckpt"
    assert ckpt.is_dir(), sorted(p.name for p in tmp_path.iterdir())
    stored = checkpoint_tensor_metadata(ckpt)["state_dict.model.transformer.h.0.attn.c_attn.weight"]
    assert tuple(stored.size) == (96, 32) and len(stored.chunks) == 2  # the full tensor, written as 2 tp shards
    resumed = spawn(train_tp, 2, 2, 8, 6, tp2, "gpt", None, None, str(ckpt), 3)
    relaid = spawn(train_tp, 1, 1, 8, 6, {"zero_stage": 0}, "gpt", None, None, str(ckpt), 3)
    # consolidation (`lightning-npu convert-checkpoint`) restores the original q|k|v layout: the tp=2 step-3
    # checkpoint consolidates to the one a single process writes at step 3
    spawn(train_tp, 1, 1, 8, 3, {"zero_stage": 0}, "gpt", None, str(tmp_path / "tp1"), None, 3)
    tp2_full, _ = consolidate_model_state(ckpt)
    tp1_full, _ = consolidate_model_state(tmp_path / "tp1" / "epoch=0-step=3.ckpt")
    assert tp2_full.keys() == tp1_full.keys()
    for k, v in tp1_full.items():
        torch.testing.assert_close(tp2_full[k], v, rtol=RTOL, atol=1e-6, msg=lambda m: f"{k}: {m}")
    for run in (resumed[0], resumed[1], relaid[0]):
        assert run["global_step"] == 6
        torch.testing.assert_close(torch.tensor(run["logged"]), torch.tensor(full[0]["logged"][3:]), rtol=RTOL, atol=0)
        assert_same_state(run["state"], full[0]["state"])


def test_resume_from_a_single_file_under_tp(tmp_path):
    """`save_distributed_checkpoint=False` at tp=2: one Lightning file of full tensors in the original layout (the
    fused q|k|v weight and its Adam moments un-fused once); resuming it at tp=2 and under one process repeats steps
    4-6 exactly."""
    tp2 = {"zero_stage": 0, "tensor_parallel_size": 2, "save_distributed_checkpoint": False}
    full = spawn(train_tp, 2, 2, 8, 6, tp2, "gpt", None, str(tmp_path), None, 3)
    ckpt = tmp_path / "epoch=0-step=3.ckpt"
    assert ckpt.is_file()
    resumed = spawn(train_tp, 2, 2, 8, 6, tp2, "gpt", None, None, str(ckpt), 3)
    relaid = spawn(train_tp, 1, 1, 8, 6, {"zero_stage": 0}, "gpt", None, None, str(ckpt), 3)
    for run in (resumed[0], resumed[1], relaid[0]):
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
