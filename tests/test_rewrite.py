"""The module-rewrite pass on the example GPT and on small transformers Llama / GPT-2 models."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch
import torch.nn as nn

from examples.gpt.model import GPT, GPTConfig
from lightning_npu.ops import extension, rewrite_modules
from lightning_npu.ops.modules import FusedModule
from tests._layouts import launch_calls

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module", autouse=True)
def built():
    if extension.load() is None:
        pytest.skip(f"C++ kernels could not be built here: {extension.load_error()}")


def assert_same_training_signal(plain: nn.Module, fused: nn.Module, forward, rtol: float = 1e-5) -> None:
    """Outputs and every parameter gradient of fused == unfused (fp32, norm-wise rtol)."""
    y0, y1 = forward(plain), forward(fused)
    assert ((y1 - y0).norm() / y0.norm()).item() <= rtol
    y0.square().mean().backward()
    y1.square().mean().backward()
    for (name, p), (_, q) in zip(plain.named_parameters(), fused.named_parameters()):
        if p.grad is None:
            assert q.grad is None, name
            continue
        err = ((q.grad - p.grad).norm() / p.grad.norm().clamp_min(1e-12)).item()
        assert err <= rtol, (name, err)


def small_gpt(**kw) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(**{**dict(n_layer=2, n_head=4, n_embd=64, block_size=32, attention="explicit"), **kw}))


def test_example_gpt_rewrite_matches_unfused():
    plain = small_gpt()
    fused = copy.deepcopy(plain)
    # the CPU table keeps LayerNorm and the GELU MLP eager (slower end to end at this size): test every kernel
    assert rewrite_modules(copy.deepcopy(plain), device="cpu").counts() == {"scale_causal_softmax": 2}
    report = rewrite_modules(fused, device="cpu", patterns="all")
    assert list(plain.state_dict()) == list(fused.state_dict())
    counts = report.counts()
    assert counts == {
        "residual_add+layer_norm": 2,
        "layer_norm": 5,
        "scale_causal_softmax": 2,
        "linear+bias_gelu": 2,
    }, counts
    assert "C++ kernels" in report.backend
    assert {s.name for s in report.skipped} == {"transformer.h.0.mlp.gelu", "transformer.h.1.mlp.gelu"}
    assert "FusedBlock" in str(report) and isinstance(fused.transformer.h[0], type(plain.transformer.h[0]))
    idx = torch.randint(0, 256, (3, 32))
    assert_same_training_signal(plain, fused, lambda m: m(idx))


def test_checkpoint_loads_across_fusion_and_pickles():
    plain, other = small_gpt(), small_gpt(n_layer=2)
    fused = copy.deepcopy(other)
    rewrite_modules(fused, patterns="all")
    fused.load_state_dict(plain.state_dict())  # unfused checkpoint -> fused model
    other.load_state_dict(fused.state_dict())  # and back
    idx = torch.randint(0, 256, (2, 16))
    torch.testing.assert_close(fused(idx), plain(idx), rtol=1e-5, atol=1e-6)
    clone = pickle.loads(pickle.dumps(fused))
    assert isinstance(clone.transformer.ln_f, FusedModule)
    torch.testing.assert_close(clone(idx), fused(idx), rtol=0, atol=0)


def test_second_pass_is_a_no_op():
    model = small_gpt()
    rewrite_modules(model)
    again = rewrite_modules(model)
    assert again.replaced == []


def test_unrecognised_forms_are_skipped_with_reasons():
    class OddNorm(nn.LayerNorm):
        def forward(self, x):
            return super().forward(x) * 2

    class MyMLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_fc, self.gelu = nn.Linear(4, 8), nn.GELU()

        def forward(self, x):
            return self.gelu(self.c_fc(x)) + 1

    model = nn.Sequential(OddNorm(4), nn.LayerNorm([3, 4]), nn.Softmax(dim=1), MyMLP())
    report = rewrite_modules(model, patterns="all")
    reasons = {s.name: s.reason for s in report.skipped}
    assert "own forward" in reasons["0"] and "2 dims" in reasons["1"] and "dim=1" in reasons["2"]
    assert "not a recognised" in reasons["3"]
    assert [r.name for r in report.replaced] == ["3.gelu"]  # the GELU alone is still exact to fuse
    assert type(model[0]) is OddNorm


def _hf_models():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64,
        )
    )
    gpt2 = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(
            vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
            attn_pdrop=0.0, bos_token_id=0, eos_token_id=0,
        )
    )
    return {"llama": llama, "gpt2": gpt2}


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_transformers_models(arch):
    plain = _hf_models()[arch].eval()
    fused = copy.deepcopy(plain)
    report = rewrite_modules(fused, device="cpu", patterns="all")
    assert list(plain.state_dict()) == list(fused.state_dict())
    counts = report.counts()
    if arch == "llama":
        assert counts == {"rms_norm": 5, "swiglu": 2}, counts
    else:
        assert counts == {"layer_norm": 5, "gelu[tanh]": 2}, counts
    assert any("attention" in s.reason for s in report.skipped)
    idx = torch.randint(0, 128, (2, 16))
    assert_same_training_signal(plain, fused, lambda m: m(idx).logits)


@pytest.fixture(scope="module")
def dp2():
    """The module's 2-process checks in one launch (start-up and imports paid once): the GPT trained without and
    with the fused ops, then fused ops on DTensor inputs; per call, each rank's result."""
    from tests import _ops_workers as w

    return launch_calls(2, [(w.train_small_gpt, dict(fuse_ops=False)), (w.train_small_gpt, dict(fuse_ops=True)),
                            (w.dtensor_local_shards, {})])


def test_fuse_ops_training_dp2_matches_unfused(dp2):
    plain, fused, _ = dp2
    assert fused[0]["replaced"] and not plain[0]["replaced"]
    for rank in range(2):
        torch.testing.assert_close(fused[rank]["losses"], plain[rank]["losses"], rtol=1e-5, atol=1e-6)
        for k, v in plain[rank]["state"].items():
            got = fused[rank]["state"][k]
            if k.endswith("attn.c_attn.bias"):
                # the key third of the q|k|v bias has a zero gradient in exact arithmetic (softmax ignores a shift of
                # all of a query's scores), so Adam turns the kernels' rounding noise there into updates of up to lr
                # per step (1.3e-6 apart on an AVX512 CPU): bounded by lr x steps; q and v stay tight
                q, key, val = got.chunk(3)
                q_ref, key_ref, val_ref = v.chunk(3)
                torch.testing.assert_close(key, key_ref, rtol=0, atol=4 * 1e-3, msg=k)
                got, v = torch.cat([q, val]), torch.cat([q_ref, val_ref])
            torch.testing.assert_close(got, v, rtol=1e-4, atol=1e-6, msg=k)


def test_dtensor_inputs_run_on_local_shards(dp2):
    for rank_result in dp2[2]:
        for what, err in rank_result.items():
            assert err < 1e-5, (what, err)
