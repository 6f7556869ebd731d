"""Step latency with heavy image preprocessing: inline on the training process vs in DataLoader workers.

    python benchmarks/data_loading.py [--steps 30] [--workers 2] [--out benchmarks/results/data_loading.json]

Each sample is "decoded" (a uint8 image from its seed) and augmented (random resized crop, a 5x5 blur applied a few
times, colour jitter, normalisation): deliberately expensive, as JPEG decoding and augmentation are. The step is a
tiny CLIP vision tower (transformers CLIPVisionModel, built from a config) with AdamW. Step latency = wall time from
one step's start to the next's (waiting for the batch included), median after 3 warm-up steps.

- ``inline``: ``DataLoader(num_workers=0)``: the training process preprocesses every batch between steps;
- ``async``: ``DataLoader(num_workers=N, persistent_workers=True, prefetch_factor=2, pin_memory=<device has
  streams>)`` wrapped in `lightning_npu.data.DevicePrefetcher` (the next batch's copy on a side stream; inline on CPU).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

from benchmarks import _env  # noqa: E402
from lightning_npu import device as dev  # noqa: E402
from lightning_npu.data import DevicePrefetcher  # noqa: E402

IMAGE, RAW = 32, 96


class AugmentedImages(Dataset):
    def __init__(self, size: int, blur_passes: int = 6) -> None:
        self.size, self.blur_passes = size, blur_passes
        self.kernel = torch.ones(3, 1, 5, 5) / 25

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        raw = torch.randint(0, 256, (3, RAW, RAW), generator=g, dtype=torch.uint8)  # "decoded"
        x = raw.float().div(255)[None]
        top, left = (int(v) for v in torch.randint(0, RAW // 4, (2,), generator=g))
        x = x[..., top:top + 3 * RAW // 4, left:left + 3 * RAW // 4]
        x = F.interpolate(x, size=(2 * IMAGE, 2 * IMAGE), mode="bilinear", align_corners=False)
        for _ in range(self.blur_passes):
            x = F.conv2d(F.pad(x, (2, 2, 2, 2), mode="reflect"), self.kernel, groups=3)
        x = x * (0.8 + 0.4 * torch.rand(3, 1, 1, generator=g)) + 0.1 * torch.randn(1, generator=g)
        x = F.interpolate(x, size=(IMAGE, IMAGE), mode="area")[0]
        x = (x - 0.5) / 0.25
        return {"pixel_values": x.contiguous(), "label": torch.randint(0, 10, (), generator=g)}


def _model() -> torch.nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.CLIPVisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                           num_attention_heads=4, image_size=IMAGE, patch_size=8)
    return transformers.CLIPVisionModel(config)


def run(mode: str, steps: int, batch: int, workers: int, device: torch.device) -> list[float]:
    torch.manual_seed(0)
    model = _model().to(device)
    head = torch.nn.Linear(64, 10).to(device)
    opt = torch.optim.AdamW([*model.parameters(), *head.parameters()], lr=1e-3)
    dataset = AugmentedImages(steps * batch)
    streams = dev.side_stream(device) is not None
    if mode == "inline":
        loader = DataLoader(dataset, batch_size=batch, num_workers=0)
    else:
        loader = DevicePrefetcher(DataLoader(dataset, batch_size=batch, num_workers=workers, persistent_workers=True,
                                             prefetch_factor=2, pin_memory=streams), device)
    times, last = [], None
    for b in loader:
        b = {k: v.to(device) for k, v in b.items()}  # no-op for the prefetched batches
        out = model(pixel_values=b["pixel_values"]).pooler_output
        loss = F.cross_entropy(head(out), b["label"])
        opt.zero_grad()
        loss.backward()
        opt.step()
        dev.synchronize(device)
        now = time.perf_counter()
        if last is not None:
            times.append(now - last)
        last = now
    return times[3:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the training process")
    parser.add_argument("--accelerator", default="cpu", help="cpu, or auto (the best device here)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "data_loading.json"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    kind = dev.accelerator_type() if args.accelerator == "auto" else args.accelerator
    device = torch.device(kind)
    results = {}
    for mode in ("inline", "async"):
        times = run(mode, args.steps, args.batch, args.workers, device)
        results[mode] = {"median_step_ms": round(1000 * statistics.median(times), 2),
                         "mean_step_ms": round(1000 * statistics.fmean(times), 2), "steps_timed": len(times)}
        print(mode, results[mode])
    reduction = 1 - results["async"]["median_step_ms"] / results["inline"]["median_step_ms"]
    payload = {"benchmark": "data_loading", "device": str(device), "batch": args.batch, "workers": args.workers,
               "threads": args.threads, "results": results, "latency_reduction": round(reduction, 3),
               "seed_claim": 0.40}
    print(f"step latency {results['inline']['median_step_ms']} -> {results['async']['median_step_ms']} ms: "
          f"{100 * reduction:.0f}% lower (the seed says 40%)")
    _env.write_json(args.out, payload)


if __name__ == "__main__":
    main()
