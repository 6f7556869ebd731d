"""Byte-level text data for the GPT example, with a built-in corpus so nothing is downloaded.

The default corpus is generated from a small grammar with a fixed seed: it has real structure
(words, agreement, punctuation), so the loss visibly falls within a few hundred steps on CPU.
Point `path` at any UTF-8 text file to train on your own data instead.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Optional

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

_SUBJECTS = ["the cat", "a dog", "the old man", "my sister", "the engineer", "a small bird", "the teacher", "our team"]
_VERBS = ["sees", "likes", "builds", "finds", "carries", "paints", "trains", "follows"]
_OBJECTS = ["the red ball", "a long road", "the model", "a quiet river", "the new bridge", "a green tree", "the cluster"]
_PLACES = ["in the morning", "near the station", "after the rain", "on the hill", "at night", "with great care"]


def builtin_corpus(num_sentences: int = 20000, seed: int = 1234) -> str:
    rng = random.Random(seed)
    out = []
    for _ in range(num_sentences):
        sentence = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}"
        if rng.random() < 0.5:
            sentence += f" {rng.choice(_PLACES)}"
        out.append(sentence[0].upper() + sentence[1:] + rng.choice([".", ".", "!", "?"]))
    return " ".join(out)


class TokenWindows(Dataset):
    """Non-overlapping windows of `block_size + 1` bytes: inputs and next-byte targets."""

    def __init__(self, tokens: torch.Tensor, block_size: int) -> None:
        if tokens.numel() < block_size + 1:
            raise ValueError(f"the text has {tokens.numel()} bytes, fewer than block_size+1={block_size + 1}.")
        self.tokens = tokens
        self.block_size = block_size

    def __len__(self) -> int:
        return (self.tokens.numel() - 1) // self.block_size

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        chunk = self.tokens[i * self.block_size : (i + 1) * self.block_size + 1]
        return chunk[:-1], chunk[1:]


class TextDataModule(L.LightningDataModule):
    def __init__(
        self,
        path: Optional[str] = None,
        block_size: int = 128,
        batch_size: int = 16,
        val_fraction: float = 0.05,
        shuffle: bool = True,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.train_set: Optional[TokenWindows] = None
        self.val_set: Optional[TokenWindows] = None

    def _text(self) -> str:
        if self.hparams.path is None:
            return builtin_corpus()
        path = Path(self.hparams.path)
        if not path.is_file():
            raise FileNotFoundError(f"TextDataModule(path={str(path)!r}): no such file; pass a UTF-8 text file.")
        return path.read_text(encoding="utf-8", errors="replace")

    def setup(self, stage: Optional[str] = None) -> None:
        if self.train_set is not None:
            return
        tokens = torch.frombuffer(bytearray(self._text().encode("utf-8")), dtype=torch.uint8).long()
        split = int(tokens.numel() * (1 - self.hparams.val_fraction))
        self.train_set = TokenWindows(tokens[:split], self.hparams.block_size)
        self.val_set = TokenWindows(tokens[split:], self.hparams.block_size)

    def _loader(self, dataset: Dataset, shuffle: bool) -> DataLoader:
        return DataLoader(
            dataset,
            batch_size=self.hparams.batch_size,
            shuffle=shuffle,
            num_workers=self.hparams.num_workers,
            drop_last=True,
        )

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, self.hparams.shuffle)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, False)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, False)

    def predict_dataloader(self) -> DataLoader:
        return self._loader(self.val_set, False)
