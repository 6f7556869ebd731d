"""Workers for tests/test_model_zoo.py: stock `transformers` models from tiny configs, each in a thin LightningModule.

Every model trains a few steps from the same seed on the same samples whatever the layout: the data is a fixed,
unshuffled map-style dataset (sample ``i`` drawn from seed ``i``), so dp rank ``r`` of ``dp`` reads the samples
``r, r + dp, ...`` of each global batch and one process reads the whole global batch. Dropout is off, fp32. One
launch runs every model of a layout in sequence (`run_zoo`); a model that the layout refuses reports the error.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

import lightning_npu
from lightning_npu import NPUHybridStrategy
from lightning_npu.callbacks import RouterMonitor
from lightning_npu.parallel.expert_parallel.router_monitor import experts_modules
from lightning_npu.parallel.optim.grad_norm import local_tensor
from lightning_npu.parallel.optim.mixed_precision import unwrap_optimizer

STEPS, GLOBAL_BATCH, SEQ, VOCAB, IMAGE = 3, 4, 16, 128, 16
CLIP = 0.5  # below every model's gradient norm here: each step clips, by the global norm the layout computes
DECODER = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               max_position_embeddings=64)


def _llama(T: Any) -> Any:
    return T.LlamaForCausalLM(T.LlamaConfig(num_key_value_heads=2, **DECODER))


def _qwen2(T: Any) -> Any:
    return T.Qwen2ForCausalLM(T.Qwen2Config(num_key_value_heads=2, **DECODER))


def _mistral(T: Any) -> Any:
    return T.MistralForCausalLM(T.MistralConfig(num_key_value_heads=2, **DECODER))


def _gemma3(T: Any) -> Any:
    # a scaled embedding (the `embed_scale` buffer), per-head q/k norms, tied head
    return T.Gemma3ForCausalLM(T.Gemma3TextConfig(num_key_value_heads=2, head_dim=8, pad_token_id=0, bos_token_id=1,
                                                  eos_token_id=2, **DECODER))


def _phi3(T: Any, kv_heads: int = 2) -> Any:
    # fused qkv_proj (q 32 | k 16 | v 16 with grouped kv) and gate_up_proj
    return T.Phi3ForCausalLM(T.Phi3Config(num_key_value_heads=kv_heads, pad_token_id=0, bos_token_id=1,
                                          eos_token_id=2, **DECODER))


def _gpt2(T: Any) -> Any:
    return T.GPT2LMHeadModel(T.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def _neox(T: Any) -> Any:
    # per-head interleaved query_key_value
    return T.GPTNeoXForCausalLM(T.GPTNeoXConfig(hidden_dropout=0.0, attention_dropout=0.0, **DECODER))


def _opt(T: Any) -> Any:
    return T.OPTForCausalLM(T.OPTConfig(vocab_size=VOCAB, hidden_size=32, ffn_dim=64, num_hidden_layers=2,
                                        num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=32,
                                        dropout=0.0, attention_dropout=0.0))


def _falcon(T: Any, **kwargs: Any) -> Any:
    # multi-query by default: one k/v head for all query heads
    return T.FalconForCausalLM(T.FalconConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                              num_attention_heads=4, hidden_dropout=0.0, attention_dropout=0.0,
                                              **kwargs))


def _bert(T: Any) -> Any:
    return T.BertForMaskedLM(T.BertConfig(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **DECODER))


def _vit(T: Any) -> Any:
    return T.ViTForImageClassification(T.ViTConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, image_size=IMAGE,
        patch_size=4, num_labels=10, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def _clip(T: Any) -> Any:
    tower = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    return T.CLIPModel(T.CLIPConfig(text_config=dict(vocab_size=VOCAB, max_position_embeddings=SEQ, **tower),
                                    vision_config=dict(image_size=IMAGE, patch_size=4, **tower), projection_dim=16))


def _qwen3(T: Any) -> Any:
    # per-head q/k norms
    return T.Qwen3ForCausalLM(T.Qwen3Config(num_key_value_heads=2, head_dim=8, **DECODER))


def _qwen3_moe(T: Any) -> Any:
    return T.Qwen3MoeForCausalLM(T.Qwen3MoeConfig(num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                                                  moe_intermediate_size=32, **DECODER))


def _deepseek_v3(T: Any) -> Any:
    # multi-head latent attention (low-rank q and kv, decoupled rope), a dense first layer, then routed experts
    return T.DeepseekV3ForCausalLM(T.DeepseekV3Config(
        num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8,
        n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1,
        moe_intermediate_size=32, first_k_dense_replace=1, num_mtp_layers=0, **DECODER))


def _mixtral(T: Any) -> Any:
    return T.MixtralForCausalLM(T.MixtralConfig(num_key_value_heads=2, num_local_experts=2, num_experts_per_tok=1,
                                                **DECODER))


# name -> (builder, kind); kind picks the batch and the loss
MODELS: dict[str, tuple[Callable[[Any], Any], str]] = {
    "llama": (_llama, "lm"),
    "qwen2": (_qwen2, "lm"),
    "mistral": (_mistral, "lm"),
    "gemma3": (_gemma3, "lm"),
    "phi3": (_phi3, "lm"),
    "phi3-mha": (lambda T: _phi3(T, kv_heads=4), "lm"),
    "gpt2": (_gpt2, "lm"),
    "gpt-neox": (_neox, "lm"),
    "opt": (_opt, "lm"),
    "falcon": (_falcon, "lm"),
    "falcon-gqa": (lambda T: _falcon(T, new_decoder_architecture=True, num_kv_heads=2), "lm"),
    "bert": (_bert, "lm"),
    "vit": (_vit, "image"),
    "clip": (_clip, "clip"),
    "mixtral": (_mixtral, "lm"),  # MoE: its experts are not tensor-parallel yet (replicated on request)
    "qwen3": (_qwen3, "lm"),
    "qwen3-moe": (_qwen3_moe, "lm"),
    "deepseek-v3": (_deepseek_v3, "lm"),
}


class ZooModule(L.LightningModule):
    """The thin LightningModule a user writes around a stock model: forward calls it, the loss is cross-entropy
    (CLIP: a per-pair matching loss on its scaled similarity, so that it splits over dp like every other loss)."""

    def __init__(self, name: str, lr: float = 1e-3) -> None:
        super().__init__()
        import transformers

        transformers.logging.set_verbosity_error()
        builder, self.kind = MODELS[name]
        self.lr = lr
        self.model = builder(transformers)
        self.model.config._attn_implementation = "eager"

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids).logits

    def loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        if self.kind == "lm":  # under pipeline parallelism the same cross-entropy, of `forward`, is the default
            return F.cross_entropy(self(batch["input_ids"]).flatten(0, 1).float(), batch["labels"].flatten())
        if self.kind == "image":
            return F.cross_entropy(self.model(pixel_values=batch["pixel_values"]).logits, batch["labels"])
        out = self.model(input_ids=batch["input_ids"], pixel_values=batch["pixel_values"])
        return F.binary_cross_entropy_with_logits(out.logits_per_text.diagonal() - 5.0, batch["match"])

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self.loss(batch)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.lr, eps=1e-5, weight_decay=0.01)


class ZooData(Dataset):
    """Sample ``i`` is drawn from seed ``i``: the same samples in any layout and any order of reading."""

    def __init__(self, kind: str, size: int = STEPS * GLOBAL_BATCH) -> None:
        self.kind, self.size = kind, size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        if self.kind == "lm":
            return {"input_ids": torch.randint(3, VOCAB, (SEQ,), generator=g),
                    "labels": torch.randint(0, VOCAB, (SEQ,), generator=g)}
        image = torch.randn(3, IMAGE, IMAGE, generator=g)
        if self.kind == "image":
            return {"pixel_values": image, "labels": torch.randint(0, 10, (), generator=g)}
        return {"input_ids": torch.randint(3, VOCAB, (SEQ,), generator=g), "pixel_values": image,
                "match": torch.randint(0, 2, (), generator=g).float()}


class Losses(L.Callback):
    def __init__(self) -> None:
        self.logged: list[float] = []
        self.grad_norms: list[float] = []  # the global norm clipping used (NaN where none was logged)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.logged.append(float(trainer.callback_metrics["train_loss"]))
        self.grad_norms.append(float(trainer.callback_metrics.get("npu/grad_norm", float("nan"))))


def _world() -> int:
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))
    os.environ["WORLD_SIZE"] = str(world)  # Lightning's environment deletes it at teardown
    return world


class RaisesInShardedForward(ZooModule):
    """Llama whose training step calls the (vocab-sharded) LM head with a wrong input width: the error comes from
    inside a tensor-parallel module's forward, while its parameters are swapped for DTensors."""

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self.model.lm_head(torch.zeros(2, 7)).sum()


def fit(name: str, strategy_kwargs: dict[str, Any], model_cls: type = ZooModule) -> dict[str, Any]:
    """Train `name` for STEPS steps under `strategy_kwargs`; its logged losses, final full state and tp plan."""
    world = _world()
    L.seed_everything(0, verbose=False)
    model = model_cls(name)
    strategy_kwargs = dict(strategy_kwargs)
    precision = strategy_kwargs.pop("precision", "32-true")  # a Trainer argument, carried with the layout
    strategy = NPUHybridStrategy(**strategy_kwargs)
    cfg = strategy.parallel_config
    dp = world // (cfg.tensor_parallel_size * cfg.pipeline_parallel_size)
    losses = Losses()
    callbacks: list[L.Callback] = [losses]
    if experts_modules(model):  # the routers' loads, as rank 0 logs them: every stage's layers under pp
        callbacks.append(RouterMonitor(log_every_n_steps=1))
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=strategy, max_steps=STEPS, logger=False, precision=precision,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
        num_sanity_val_steps=0, limit_val_batches=0, deterministic=True, gradient_clip_val=CLIP,
    )
    loader = DataLoader(ZooData(model.kind), batch_size=GLOBAL_BATCH // dp, shuffle=False)
    try:
        trainer.fit(model, train_dataloaders=loader)
    except Exception as err:  # noqa: BLE001 (a refusal is a result here)
        return {"error": f"{type(err).__name__}: {err}", "process_group": dist.is_initialized()}
    report = trainer.strategy.tp_report
    if trainer.strategy.pipeline_plan is not None:
        report = f"{report}\n{trainer.strategy.pipeline_plan}" if report is not None else trainer.strategy.pipeline_plan
    return {"logged": losses.logged, "grad_norms": losses.grad_norms, "state": lightning_npu.full_state_dict(model),
            "report": str(report) if report is not None else None,
            "buffers": {n: type(b).__name__ for n, b in model.named_buffers()},
            # what this rank holds of the MoE experts' parameters (elements)
            "local_experts": sum(local_tensor(p).numel() for n, p in model.named_parameters() if ".experts." in n),
            # ZeRO-1: what this rank steps of the experts (fp32 master slices; AdamW's exp_avg is shaped alike)
            "expert_masters": _expert_masters(trainer, model),
            "router_layers": sorted(callbacks[-1].last) if len(callbacks) > 1 else []}


def _expert_masters(trainer: L.Trainer, model: L.LightningModule) -> Optional[dict[str, int]]:
    """Elements of this rank's ZeRO-1 master slices and AdamW exp_avg of the experts (None without ZeRO-1)."""
    optimizers = [unwrap_optimizer(o) for o in trainer.optimizers]
    zero1 = [o for o in optimizers if hasattr(o, "master_of")]
    if not zero1:
        return None
    masters = [zero1[0].master_of(p) for n, p in model.named_parameters() if ".experts." in n]
    return {"masters": sum(local_tensor(m).numel() for m in masters),
            "exp_avg": sum(zero1[0].inner.state[zero1[0]._local_of[id(m)]]["exp_avg"].numel() for m in masters)}


@dataclass(frozen=True)
class Case:
    """One cell of the matrix: a model (its MODELS name) trained under a layout, plus strategy arguments."""

    model: str
    strategy: dict[str, Any] = field(default_factory=dict)
    model_cls: str = "ZooModule"


def run_zoo(strategy_kwargs: dict[str, Any], cases: dict[str, Case]) -> dict[str, Any]:
    """One process group, every case in turn (`strategy_kwargs` is the layout, each case may add to it)."""
    classes = {"ZooModule": ZooModule, "RaisesInShardedForward": RaisesInShardedForward}
    return {name: fit(case.model, {**strategy_kwargs, **case.strategy}, classes[case.model_cls])
            for name, case in cases.items()}
