"""A nanoGPT-class decoder and the LightningModule that trains it.

The layout (``transformer.wte/wpe/h/ln_f``, ``lm_head``, ``c_attn``/``c_proj``/``c_fc``)
follows nanoGPT/GPT-2 so that lightning-npu's automatic plans recognise it. Attention keeps
its scale+mask+softmax in one submodule so precision and fusion passes can find it.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    vocab_size: int = 256
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = True
    attention: str = "sdpa"  # "sdpa": fused kernel; "explicit": T x T scores + a softmax module


class CausalSoftmax(nn.Module):
    """scale * scores, causal mask, softmax over keys."""

    def __init__(self, head_dim: int) -> None:
        super().__init__()
        self.scale = 1.0 / math.sqrt(head_dim)

    def forward(self, scores: torch.Tensor) -> torch.Tensor:
        t = scores.size(-1)
        mask = torch.ones(t, t, dtype=torch.bool, device=scores.device).triu(1)
        return torch.softmax((scores * self.scale).masked_fill(mask, float("-inf")), dim=-1)


class CausalSDPA(nn.Module):
    """Causal attention through `F.scaled_dot_product_attention` (flash/memory-efficient kernels where they exist).

    The kernels keep the softmax statistics in fp32, so no fp32 island is needed; on Ascend the rewrite pass
    swaps in ``npu_fusion_attention``.
    """

    def __init__(self, dropout: float) -> None:
        super().__init__()
        self.dropout = dropout

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        if cfg.n_embd % cfg.n_head:
            raise ValueError(f"n_embd={cfg.n_embd} is not divisible by n_head={cfg.n_head}.")
        self.n_head = cfg.n_head
        self.head_dim = cfg.n_embd // cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        if cfg.attention == "sdpa":
            self.attn_core = CausalSDPA(cfg.dropout)
        elif cfg.attention == "explicit":
            self.attn_softmax = CausalSoftmax(self.head_dim)
            self.attn_dropout = nn.Dropout(cfg.dropout)
        else:
            raise ValueError(f"attention={cfg.attention!r}: expected 'sdpa' or 'explicit'.")
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 instead of n_embd/n_head: under tensor parallelism the local width and head count shrink.
        q, k, v = self.c_attn(x).view(b, t, 3, self.n_head, self.head_dim).permute(2, 0, 3, 1, 4)
        if hasattr(self, "attn_core"):
            y = self.attn_core(q, k, v)
        else:
            y = self.attn_dropout(self.attn_softmax(q @ k.transpose(-2, -1))) @ v
        y = y.transpose(1, 2).reshape(b, t, self.n_head * self.head_dim)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),
                wpe=nn.Embedding(cfg.block_size, cfg.n_embd),
                drop=nn.Dropout(cfg.dropout),
                h=nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)]),
                ln_f=nn.LayerNorm(cfg.n_embd, bias=cfg.bias),
            )
        )
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):  # GPT-2's scaled init of residual projections
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """`position_ids`: the tokens' positions when they are not 0..t-1 (context parallelism gives each rank
        its chunks' global positions)."""
        t = idx.size(1)
        if t > self.config.block_size:
            raise ValueError(f"sequence length {t} exceeds block_size={self.config.block_size}.")
        pos = torch.arange(t, device=idx.device) if position_ids is None else position_ids
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


class GPTModule(L.LightningModule):
    """Next-token pretraining of `GPT`; logs train/val loss and tokens per second (`throughput_clock="process"`:
    per second of this process's CPU time, steadier than wall time on a CPU other jobs share)."""

    def __init__(
        self,
        vocab_size: int = 256,
        block_size: int = 128,
        n_layer: int = 4,
        n_head: int = 4,
        n_embd: int = 128,
        dropout: float = 0.0,
        bias: bool = True,
        attention: str = "sdpa",
        learning_rate: float = 1e-3,
        weight_decay: float = 0.1,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        warmup_steps: int = 0,
        throughput_clock: str = "wall",
    ) -> None:
        super().__init__()
        if throughput_clock not in ("wall", "process"):
            raise ValueError(f"`throughput_clock={throughput_clock!r}`: choose one of 'wall' (elapsed time) or "
                             "'process' (this process's CPU time, which other jobs on a shared CPU do not inflate).")
        self.save_hyperparameters()
        self.model = GPT(GPTConfig(vocab_size, block_size, n_layer, n_head, n_embd, dropout, bias, attention))
        self._step_started: float | None = None

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)

    def loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        idx, targets = batch
        logits = self(idx)
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100)

    def pipeline_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """lightning-npu pipeline parallelism: the last stage's loss for one micro-batch (same as `loss`)."""
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), ignore_index=-100)

    def training_step(self, batch, batch_idx):
        loss = self.loss(batch)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def _clock(self) -> float:
        # "process": CPU time, for timing CPU runs on a machine other jobs share (`plan --calibrate` reads the result)
        return time.process_time() if self.hparams.throughput_clock == "process" else time.perf_counter()

    def on_train_batch_start(self, batch, batch_idx) -> None:
        self._step_started = self._clock()

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        if self._step_started is None:
            return
        elapsed = self._clock() - self._step_started
        # global tokens: only dp ranks see disjoint data (tp/pp peers share a batch)
        dp = self.device_mesh["dp"].size() if self._device_mesh is not None else self.trainer.world_size
        world_tokens = batch[0].numel() * dp
        self.log("tokens_per_s", world_tokens / max(elapsed, 1e-9), prog_bar=True)

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.loss(batch), prog_bar=True, sync_dist=True)

    def test_step(self, batch, batch_idx):
        self.log("test_loss", self.loss(batch), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        return self(batch[0]).argmax(-1)

    def configure_optimizers(self):
        decay = [p for n, p in self.named_parameters() if p.dim() >= 2]
        no_decay = [p for n, p in self.named_parameters() if p.dim() < 2]
        groups = [
            {"params": decay, "weight_decay": self.hparams.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ]
        optimizer = torch.optim.AdamW(
            groups, lr=self.hparams.learning_rate, betas=tuple(self.hparams.betas), eps=self.hparams.eps
        )
        if not self.hparams.warmup_steps:
            return optimizer
        warmup = self.hparams.warmup_steps
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
