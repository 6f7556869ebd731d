"""A `transformers` Llama trained by Lightning: built from a small `LlamaConfig`, nothing downloaded.

The model is created in `configure_model`, Lightning's hook for models that a strategy shards, so
under ``tensor_parallel_size=2`` the automatic plan splits attention (q/k/v colwise, o rowwise), the
MLP (gate/up colwise, down rowwise) and the vocabulary (embedding and head) over the tp ranks.
Attention runs through PyTorch's `scaled_dot_product_attention` (``attn_implementation="sdpa"``), whose
flash and memory-efficient kernels keep the softmax statistics in fp32. ``fused_optimizer=True`` picks
AdamW's single-kernel step on accelerators.
"""

from __future__ import annotations

from typing import Optional

import lightning as L
import torch
import torch.nn.functional as F

from lightning_npu.extras import import_optional


class LlamaModule(L.LightningModule):
    """Next-token pretraining of `transformers.LlamaForCausalLM` (byte vocabulary by default)."""

    def __init__(
        self,
        vocab_size: int = 256,
        hidden_size: int = 64,
        intermediate_size: int = 176,
        num_hidden_layers: int = 2,
        num_attention_heads: int = 4,
        num_key_value_heads: int = 2,
        max_position_embeddings: int = 128,
        learning_rate: float = 2e-3,
        weight_decay: float = 0.1,
        attn_implementation: str = "sdpa",
        fused_optimizer: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model: Optional[torch.nn.Module] = None

    def configure_model(self) -> None:
        if self.model is not None:  # fit -> validate reuse the model
            return
        transformers = import_optional("transformers", "examples/llama (a transformers Llama)")
        LlamaConfig, LlamaForCausalLM = transformers.LlamaConfig, transformers.LlamaForCausalLM
        h = self.hparams
        config = LlamaConfig(
            vocab_size=h.vocab_size,
            hidden_size=h.hidden_size,
            intermediate_size=h.intermediate_size,
            num_hidden_layers=h.num_hidden_layers,
            num_attention_heads=h.num_attention_heads,
            num_key_value_heads=h.num_key_value_heads,
            max_position_embeddings=h.max_position_embeddings,
            tie_word_embeddings=False,
            attn_implementation=h.attn_implementation,
        )
        self.model = LlamaForCausalLM(config)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=idx, use_cache=False).logits

    def loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        idx, targets = batch
        logits = self(idx)
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.loss(batch), prog_bar=True, sync_dist=True)

    def configure_optimizers(self):
        decay = [p for p in self.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.dim() < 2]
        return torch.optim.AdamW(
            [{"params": decay, "weight_decay": self.hparams.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=self.hparams.learning_rate,
            betas=(0.9, 0.95),
            fused=self.hparams.fused_optimizer or None,
        )
