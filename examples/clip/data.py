"""Synthetic image-caption pairs: each of `classes` concepts has its own image pattern and its own caption words.

Sample ``i`` is drawn from seed ``i`` (the same pairs in any layout). An image is its concept's pattern, randomly
flipped, shifted and noised (the augmentation runs in the DataLoader's workers); its caption is BOS, the concept's
two words, a few random filler words, EOS (token 2: CLIP pools the text at it).
"""

from __future__ import annotations

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

FILLER = 32  # tokens 3..34 are filler words; concept words follow


class CaptionedImages(Dataset):
    def __init__(self, size: int, classes: int = 64, image_size: int = 32, max_length: int = 16, offset: int = 0) -> None:
        self.size, self.classes, self.image_size, self.max_length, self.offset = size, classes, image_size, max_length, offset
        g = torch.Generator().manual_seed(1234)
        self.patterns = torch.randn(classes, 3, image_size // 4, image_size // 4, generator=g)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(self.offset + i)
        c = int(torch.randint(0, self.classes, (), generator=g))
        image = torch.nn.functional.interpolate(self.patterns[c][None], scale_factor=4, mode="bilinear")[0]
        if bool(torch.rand((), generator=g) < 0.5):
            image = image.flip(-1)
        shift = int(torch.randint(-2, 3, (), generator=g))
        image = image.roll(shift, dims=-2) + 0.3 * torch.randn(image.shape, generator=g)
        words = [3 + FILLER + 2 * c, 3 + FILLER + 2 * c + 1]
        filler = torch.randint(3, 3 + FILLER, (self.max_length - 4,), generator=g).tolist()
        position = int(torch.randint(0, len(filler) + 1, (), generator=g))
        tokens = [1] + filler[:position] + words + filler[position:] + [2]
        return {"pixel_values": image, "input_ids": torch.tensor(tokens[: self.max_length])}


class CaptionDataModule(L.LightningDataModule):
    """Training and validation pairs; `num_workers` > 0 runs the augmentation in persistent worker processes."""

    def __init__(self, batch_size: int = 32, train_size: int = 4800, val_size: int = 128, classes: int = 64,
                 image_size: int = 32, max_length: int = 16, num_workers: int = 1) -> None:
        super().__init__()
        self.save_hyperparameters()

    def _loader(self, size: int, offset: int) -> DataLoader:
        h = self.hparams
        data = CaptionedImages(size, h.classes, h.image_size, h.max_length, offset)
        return DataLoader(data, batch_size=h.batch_size, num_workers=h.num_workers,
                          persistent_workers=h.num_workers > 0, drop_last=True)

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.hparams.train_size, 0)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.hparams.val_size, 10**6)
