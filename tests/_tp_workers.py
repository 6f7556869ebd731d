"""Tensor-parallel models and checks that `lightning_npu.launch.spawn` runs in real processes."""

from __future__ import annotations

from typing import Any, Optional

import lightning as L
import torch
import torch.nn.functional as F

from examples.gpt.model import GPTModule
from lightning_npu import NPUHybridStrategy
from tests._gpt_workers import SMALL_GPT, parity_trainer


class HFCausalLM(GPTModule):
    """GPTModule's loss and optimizer around a `transformers` causal LM built from a small config."""

    def __init__(self, arch: str = "llama", **kwargs: Any) -> None:
        super().__init__(**{k: v for k, v in kwargs.items() if k in SMALL_GPT})
        import transformers

        common = dict(vocab_size=256, tie_word_embeddings=arch == "gpt2")
        if arch == "llama":
            cfg = transformers.LlamaConfig(
                hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64, attention_bias=False, **common,
            )
            cfg._attn_implementation = "eager"
            self.model = transformers.LlamaForCausalLM(cfg)
        elif arch == "gpt2":
            cfg = transformers.GPT2Config(
                n_embd=32, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                **common,
            )
            cfg._attn_implementation = "eager"
            self.model = transformers.GPT2LMHeadModel(cfg)
        else:
            raise ValueError(arch)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=idx, use_cache=False).logits


def _make_model(arch: str, model_kwargs: Optional[dict[str, Any]]) -> L.LightningModule:
    kwargs = {**SMALL_GPT, **(model_kwargs or {})}
    if arch == "gpt":
        return GPTModule(**kwargs)
    return HFCausalLM(arch, **kwargs)


def vocab_parallel_ce_check(seed: int = 0) -> dict[str, Any]:
    """Vocab-parallel CE on tp-sharded logits vs F.cross_entropy on the full logits (values and grads)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from lightning_npu.parallel.tensor_parallel.plan import vocab_parallel_cross_entropy

    owned = not dist.is_initialized()  # else: one of several checks in a launch (`tests._layouts.run_calls`)
    if owned:
        dist.init_process_group("gloo")
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("tp",))
    torch.manual_seed(seed)
    # large logits to exercise the max-subtraction; some ignored targets
    logits = (torch.randn(6, 5, 16) * 30).requires_grad_(True)
    targets = torch.randint(0, 16, (6, 5))
    targets[0, :3] = -100
    targets[4, 1] = -100
    out = {}
    for reduction in ("mean", "sum", "none"):
        ref = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100, reduction=reduction)
        (ref_grad,) = torch.autograd.grad(ref.sum(), logits)
        shard = distribute_tensor(logits.detach(), mesh, [Shard(2)]).requires_grad_(True)
        with vocab_parallel_cross_entropy():
            loss = F.cross_entropy(shard.flatten(0, 1).float(), targets.flatten(), ignore_index=-100, reduction=reduction)
            is_plain = not isinstance(loss, torch.distributed.tensor.DTensor)
            loss.sum().backward()
        out[reduction] = dict(
            loss=loss.detach(), ref=ref.detach(), grad=shard.grad.full_tensor(), ref_grad=ref_grad,
            local_grad_shape=tuple(shard.grad.to_local().shape), plain=is_plain,
        )
    if owned:
        dist.destroy_process_group()
    return out


def fit_expect_error(tp: int, model_kwargs: dict[str, Any], extra_linear: bool = False) -> dict[str, Any]:
    """Run Trainer.fit with a layout that must be refused; report the error and whether a process group existed."""
    import torch.distributed as dist

    strategy = NPUHybridStrategy(tensor_parallel_size=tp)
    model = GPTModule(**{**SMALL_GPT, **model_kwargs})
    if extra_linear:
        model.model.adapter = torch.nn.Linear(8, 8)
    trainer, data = parity_trainer(strategy, model, tp, 2, 1, [], num_sanity_val_steps=0)
    try:
        trainer.fit(model, datamodule=data)
    except Exception as err:  # noqa: BLE001
        return {"type": type(err).__name__, "message": str(err), "pg": dist.is_initialized()}
    return {"type": None, "message": "", "pg": dist.is_initialized()}


def refit_after_split(steps: int = 2) -> dict[str, Any]:
    """A tp=2 module after its fit: the same Trainer validates it; a new Trainer is refused before any process group
    with the fix; that fix (the full state into a fresh instance) trains from the trained weights."""
    import lightning_npu

    L.seed_everything(0, verbose=False)
    model = GPTModule(**SMALL_GPT)
    trainer, data = parity_trainer(NPUHybridStrategy(tensor_parallel_size=2), model, 2, 4, steps, [])
    trainer.fit(model, datamodule=data)
    trainer.validate(model, datamodule=data, verbose=False)
    out: dict[str, Any] = {}
    again, data = parity_trainer(NPUHybridStrategy(tensor_parallel_size=2), model, 2, 4, steps, [])
    try:
        again.fit(model, datamodule=data)
    except Exception as err:  # noqa: BLE001 - the message is the result
        out["error"] = f"{type(err).__name__}: {err}"
    state = lightning_npu.full_state_dict(model)
    fresh = GPTModule(**SMALL_GPT)
    fresh.load_state_dict(state)
    out["fresh_equals_trained"] = all(torch.equal(v, state[k]) for k, v in fresh.state_dict().items())
    again, data = parity_trainer(NPUHybridStrategy(tensor_parallel_size=2), fresh, 2, 4, steps, [])
    again.fit(fresh, datamodule=data)
    out["fresh_trained"] = again.global_step
    return out
