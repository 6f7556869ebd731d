"""A `transformers` CLIPModel trained by Lightning with per-branch layouts: built from a small CLIPConfig, nothing
downloaded.

The loss is CLIP's own symmetric contrastive loss over the whole batch (``return_loss=True``): with
``branch_layouts`` the text tower runs on its branch-dp rank's slice of the batch and its embeddings are all-gathered,
so the loss still compares every image with every caption. The model is built in `configure_model`, the hook for
models a strategy shards.
"""

from __future__ import annotations

import time
from typing import Optional

import lightning as L
import torch

from lightning_npu.extras import import_optional


class CLIPModule(L.LightningModule):
    def __init__(
        self,
        vocab_size: int = 192,  # 3 special + 32 filler + 2 words x 64 concepts (examples.clip.data)
        max_length: int = 16,
        image_size: int = 32,
        patch_size: int = 8,
        hidden_size: int = 64,
        intermediate_size: int = 128,
        num_hidden_layers: int = 2,
        num_attention_heads: int = 4,
        projection_dim: int = 32,
        learning_rate: float = 1e-3,
        weight_decay: float = 0.1,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model: Optional[torch.nn.Module] = None
        self._step_started = 0.0

    def configure_model(self) -> None:
        if self.model is not None:  # fit -> validate reuse the model
            return
        transformers = import_optional("transformers", "examples/clip (a transformers CLIPModel)")
        transformers.logging.set_verbosity_error()
        h = self.hparams
        tower = dict(hidden_size=h.hidden_size, intermediate_size=h.intermediate_size,
                     num_hidden_layers=h.num_hidden_layers, num_attention_heads=h.num_attention_heads)
        config = transformers.CLIPConfig(
            text_config=dict(vocab_size=h.vocab_size, max_position_embeddings=h.max_length, bos_token_id=1,
                             eos_token_id=2, pad_token_id=0, **tower),
            vision_config=dict(image_size=h.image_size, patch_size=h.patch_size, **tower),
            projection_dim=h.projection_dim)
        self.model = transformers.CLIPModel(config)

    def loss(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.model(input_ids=batch["input_ids"], pixel_values=batch["pixel_values"], return_loss=True).loss

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def on_train_batch_start(self, batch, batch_idx) -> None:
        self._step_started = time.perf_counter()

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        """Image-text pairs per second over every dp rank (tp peers share a batch): what `lightning-npu plan
        --calibrate` reads as the step time."""
        elapsed = time.perf_counter() - self._step_started
        dp = self.device_mesh["dp"].size() if self._device_mesh is not None else self.trainer.world_size
        self.log("samples_per_s", batch["input_ids"].shape[0] * dp / max(elapsed, 1e-9), prog_bar=True)

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.loss(batch), prog_bar=True, sync_dist=True)

    def configure_optimizers(self):
        decay = [p for p in self.parameters() if p.dim() >= 2]
        no_decay = [p for p in self.parameters() if p.dim() < 2]
        return torch.optim.AdamW(
            [{"params": decay, "weight_decay": self.hparams.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=self.hparams.learning_rate)
