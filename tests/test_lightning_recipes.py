"""Lightning recipes that failed under ``npu_hybrid`` in Lightning's own test suite (issue #33), on 2 CPU processes at
ZeRO 0, 1 and 3, against Lightning's "ddp" or a one-process torch replay of the batches the ranks read (fp32 rtol
1e-5): closure-taking optimizers (LBFGS), manual optimization through `Strategy.backward`, training without an
optimizer, `add_param_group` while training (BaseFinetuning), a trained module that pickles, Lightning's error
wording, changing accumulation, and `storage_options` for single-file checkpoints. One launch fits every case
(`_run_all`); each test reads its part."""

from __future__ import annotations

import copy
import io
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import lightning as L
import pytest
import torch
import torchmetrics
from lightning.pytorch.callbacks import (
    BaseFinetuning,
    GradientAccumulationScheduler,
    LearningRateMonitor,
)
from lightning.pytorch.demos.boring_classes import BoringModel, RandomDataset
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning.pytorch.strategies import Strategy
from torch import nn
from torch.utils.data import DataLoader

from lightning_npu import NPUHybridStrategy, full_state_dict
from lightning_npu.launch import spawn
from lightning_npu.parallel.optim.mixed_precision import MixedPrecisionOptimizer

RTOL, ATOL = 1e-5, 1e-6
STAGES = (0, 1, 3)


def close(a: Any, b: Any, msg: str = "") -> None:
    torch.testing.assert_close(a, b, rtol=RTOL, atol=ATOL, msg=msg)


# ---- what the ranks fit ---------------------------------------------------------------------------------------
class Recorded(BoringModel):
    """BoringModel that keeps the batches it trained on (the replay's input) and counts its `backward` hook."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[torch.Tensor] = []
        self.hook_calls = 0

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        self.seen.append(batch.detach().clone())
        return super().training_step(batch, batch_idx)

    def backward(self, loss: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        self.hook_calls += 1
        super().backward(loss, *args, **kwargs)

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class LBFGSModel(Recorded):
    def configure_optimizers(self) -> Any:
        return torch.optim.LBFGS(self.parameters(), lr=0.1, max_iter=3)


class Manual(Recorded):
    """Lightning's test_multiple_optimizers_manual_call_counts, with one parameter per optimizer (ZeRO-1 refuses
    shared ones): 3 backward calls per step, the second loss backpropagated twice."""

    def __init__(self, shared: bool = False) -> None:
        super().__init__()
        self.automatic_optimization = False
        self.shared = shared

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        opt_a, opt_b = self.optimizers()
        self.manual_backward(self.step(batch))
        opt_a.step()
        opt_a.zero_grad()
        loss = self.step(batch)
        self.manual_backward(loss, retain_graph=True)
        self.manual_backward(loss)
        opt_b.step()
        opt_b.zero_grad()
        return loss

    def configure_optimizers(self) -> Any:
        if self.shared:
            return torch.optim.SGD(self.parameters(), lr=0.1), torch.optim.SGD(self.parameters(), lr=0.1)
        return torch.optim.SGD([self.layer.weight], lr=0.1), torch.optim.Adam([self.layer.bias], lr=0.1)


class NoOptimizer(BoringModel):
    def configure_optimizers(self) -> None:
        return None


class Finetuned(Recorded):
    """A frozen backbone that joins the optimizer as a second param group at epoch 1."""

    def __init__(self) -> None:
        super().__init__()
        self.backbone = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(self.backbone(x))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.1, momentum=0.9)


class Unfreeze(BaseFinetuning):
    def freeze_before_training(self, pl_module: Any) -> None:
        self.freeze(pl_module.backbone)

    def finetune_function(self, pl_module: Any, epoch: int, optimizer: Any) -> None:
        if epoch == 1:
            self.unfreeze_and_add_param_group(pl_module.backbone, optimizer, lr=0.05, initial_denom_lr=1.0)
        elif epoch > 1:  # resumed: `freeze_before_training` froze it again at setup; its group came back
            self.make_trainable(pl_module.backbone)


class WithMetric(BoringModel):
    def __init__(self) -> None:
        super().__init__()
        self.mean_loss = torchmetrics.MeanMetric()

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        out = super().training_step(batch, batch_idx)
        self.mean_loss.update(out["loss"].detach())
        return out


class RecordingIO(TorchCheckpointIO):
    """A CheckpointIO plugin that takes storage_options (Lightning's TorchCheckpointIO refuses them)."""

    def __init__(self) -> None:
        super().__init__()
        self.options: list[Any] = []

    def save_checkpoint(self, checkpoint: dict, path: Any, storage_options: Any = None) -> None:
        self.options.append(storage_options)
        super().save_checkpoint(checkpoint, path)


def _trainer(strategy: Any, **kwargs: Any) -> L.Trainer:
    options = dict(accelerator="cpu", devices=2, strategy=strategy, max_epochs=1, limit_train_batches=2,
                   limit_val_batches=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                   enable_model_summary=False)
    return L.Trainer(**{**options, **kwargs})


def _strategy(stage: Any, **kwargs: Any) -> Any:
    return "ddp" if stage == "ddp" else NPUHybridStrategy(zero_stage=stage, **kwargs)


def _state(model: nn.Module, stage: Any) -> dict[str, torch.Tensor]:
    state = model.state_dict() if stage == "ddp" else full_state_dict(model)
    return {k: v.detach().clone() for k, v in state.items()}


def _global_batches(model: Recorded) -> list[torch.Tensor]:
    """The batch every step read over both ranks (the mean loss over it is what dp averages)."""
    out = []
    for batch in model.seen:
        parts = [torch.empty_like(batch) for _ in range(2)]
        torch.distributed.all_gather(parts, batch)
        out.append(torch.cat(parts))
    return out


def _data(n: int = 16) -> DataLoader:
    return DataLoader(RandomDataset(32, n), batch_size=4)


def _error(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except Exception as err:  # noqa: BLE001 (the message is the result)
        return f"{type(err).__name__}: {err}"
    return ""


def _attempt(fn: Callable[..., Any], *args: Any) -> Any:
    """One stage's result, or its traceback (a failing stage does not hide the others)."""
    try:
        return fn(*args)
    except Exception:  # noqa: BLE001 (reported by the test)
        return traceback.format_exc()


def _pickles(obj: Any) -> str:
    try:
        torch.save(obj, io.BytesIO())
    except Exception as err:  # noqa: BLE001
        return f"{type(err).__name__}: {err}"
    return "ok"


def _lbfgs() -> dict[str, Any]:
    def fit(stage: Any) -> dict[str, torch.Tensor]:
        L.seed_everything(0)
        model = LBFGSModel()
        _trainer(_strategy(stage)).fit(model)
        return _state(model, stage)

    def uneven(stage: int) -> str:  # 3 rows over 2 ranks: an uneven DTensor, which LBFGS cannot flatten
        model = LBFGSModel()
        model.layer = nn.Linear(32, 3)
        return _error(lambda: _trainer(_strategy(stage)).fit(model))

    L.seed_everything(0)
    out: dict[str, Any] = {"init": LBFGSModel().state_dict()}
    out.update({stage: _attempt(fit, stage) for stage in ("ddp", 0, 1, 2, 3)})
    out["uneven"] = {stage: uneven(stage) for stage in (1, 3)}
    return out


def _manual() -> dict[str, Any]:
    def fit(stage: Any) -> dict[str, Any]:
        L.seed_everything(0)
        model, trainer = Manual(), _trainer(_strategy(stage))
        with mock.patch.object(Strategy, "backward", wraps=trainer.strategy.backward) as backward:
            trainer.fit(model)
        return {"strategy_backward": backward.call_count, "hook": model.hook_calls, "state": _state(model, stage),
                "global_step": trainer.global_step}

    out: dict[str, Any] = {stage: _attempt(fit, stage) for stage in ("ddp", *STAGES)}
    out["shared_zero1"] = _error(lambda: _trainer(_strategy(1)).fit(Manual(shared=True)))
    return out


def _pickle() -> dict[str, Any]:
    """torch.save of the trained module (ZeRO 0 and 1) and of the whole trainer (ZeRO 0); tp=2: the dp sub-group
    that setup gives the module's torchmetrics is taken back at teardown."""
    def fit(stage: int) -> dict[str, str]:
        model, trainer = BoringModel(), _trainer(_strategy(stage))
        trainer.fit(model)
        return {"model": _pickles(model), "trainer": _pickles(trainer) if stage == 0 else "ok"}

    def fit_tp() -> dict[str, str]:
        model = WithMetric()
        _trainer(NPUHybridStrategy(tensor_parallel_size=2, tp_plan=None, zero_stage=0)).fit(model)
        return {"model": _pickles(model), "process_group": repr(model.mean_loss.process_group)}

    out: dict[str, Any] = {stage: _attempt(fit, stage) for stage in (0, 1)}
    out["tp"] = _attempt(fit_tp)
    return out


def _no_optimizer(root: str) -> dict[str, Any]:
    def fit(stage: int) -> dict[str, Any]:
        kwargs = dict(default_root_dir=f"{root}/noopt{stage}", enable_checkpointing=True, limit_train_batches=1)
        _trainer(_strategy(stage), **kwargs).fit(NoOptimizer())
        saved = sorted(Path(f"{root}/noopt{stage}/checkpoints").glob("*.ckpt"))
        out = {"saved": [p.name for p in saved]}
        if stage != 0:  # resume: a file (ZeRO-1) and a sharded directory (ZeRO-3)
            resumed = _trainer(_strategy(stage), **{**kwargs, "max_epochs": 2})
            resumed.fit(NoOptimizer(), ckpt_path=str(saved[-1]))
            out["resumed_step"] = resumed.global_step
        return out

    return {stage: _attempt(fit, stage) for stage in STAGES}


def _finetuning(root: str) -> dict[str, Any]:
    def fit(stage: int) -> dict[str, Any]:
        L.seed_everything(0)
        model, monitor, data = Finetuned(), LearningRateMonitor(logging_interval="step"), _data()
        init = copy.deepcopy(model.state_dict())
        strategy = _strategy(stage, save_distributed_checkpoint=True) if stage == 1 else _strategy(stage)
        trainer = _trainer(strategy, max_epochs=2, callbacks=[Unfreeze(), monitor],
                           logger=CSVLogger(f"{root}/logs{stage}"), log_every_n_steps=1)
        trainer.fit(model, train_dataloaders=data)
        out = {"init": init, "batches": _global_batches(model), "state": _state(model, stage),
               "lrs": {k: [float(v) for v in vals] for k, vals in monitor.lrs.items()}}
        if stage == 0:
            return out
        # resumed from a sharded directory: BaseFinetuning's group is back before the optimizer state loads
        path = f"{root}/finetuned{stage}"
        trainer.save_checkpoint(path)
        resumed, monitor = Finetuned(), LearningRateMonitor(logging_interval="step")
        strategy = _strategy(stage, save_distributed_checkpoint=True) if stage == 1 else _strategy(stage)
        trainer = _trainer(strategy, max_epochs=3, callbacks=[Unfreeze(), monitor],
                           logger=CSVLogger(f"{root}/resumed{stage}"), log_every_n_steps=1)
        trainer.fit(resumed, train_dataloaders=data, ckpt_path=path)
        out["resumed"] = {"directory": Path(path).is_dir(), "batches": _global_batches(resumed),
                          "state": _state(resumed, stage),
                          "lrs": {k: [float(v) for v in vals] for k, vals in monitor.lrs.items()}}
        return out

    return {stage: _attempt(fit, stage) for stage in STAGES}


def _accumulation(root: str) -> dict[str, Any]:
    def fit(stage: int) -> dict[str, Any]:
        L.seed_everything(0)
        model, plugin = Recorded(), RecordingIO()
        init = copy.deepcopy(model.state_dict())
        trainer = _trainer(_strategy(stage), max_epochs=3, limit_train_batches=4, plugins=[plugin],
                           callbacks=[GradientAccumulationScheduler({1: 2, 2: 4})])
        trainer.fit(model, train_dataloaders=_data(32))
        out = {"init": init, "batches": _global_batches(model), "state": _state(model, stage),
               "global_step": trainer.global_step}
        # storage_options reach the CheckpointIO plugin for a single file (ZeRO-1); a sharded directory refuses them
        path = f"{root}/options{stage}.ckpt"
        out["save"] = _error(lambda: trainer.save_checkpoint(path, storage_options={"bucket": "b"}))
        out["io_options"] = plugin.options
        out["saved"] = Path(path).is_file()
        return out

    return {stage: _attempt(fit, stage) for stage in (1, 3)}


def _missing_checkpoint(root: str) -> dict[str, str]:
    return {"error": _error(lambda: _trainer(_strategy(1)).fit(BoringModel(), ckpt_path=f"{root}/missing.ckpt"))}


def _run_all(root: str) -> dict[str, Any]:
    cases = {"lbfgs": _lbfgs, "manual": _manual, "no_optimizer": lambda: _no_optimizer(root),
             "finetuning": lambda: _finetuning(root), "accumulation": lambda: _accumulation(root),
             "missing_checkpoint": lambda: _missing_checkpoint(root), "pickle": _pickle}
    out: dict[str, Any] = {}
    for name, case in cases.items():
        try:
            out[name] = case()
        except Exception:  # noqa: BLE001 (reported by the case's test)
            out[name] = traceback.format_exc()
    return out


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return spawn(_run_all, 2, str(tmp_path_factory.mktemp("recipes")))


def _case(ranks: list[dict[str, Any]], name: str) -> list[Any]:
    for rank in ranks:
        assert not isinstance(rank[name], str), rank[name]
    return [rank[name] for rank in ranks]


def _ran(result: Any) -> Any:
    assert not isinstance(result, str), result  # a stage's traceback
    return result


# ---- the one-process references -----------------------------------------------------------------------------
def _replay(model: nn.Module, batches: list[torch.Tensor], accumulate: Callable[[int], int],
            groups: Callable[[int, torch.optim.Optimizer], None] = lambda step, opt: None) -> dict[str, torch.Tensor]:
    """Plain torch over the global batches: SGD(0.1, momentum 0.9), `accumulate(i)` batches per step from batch i,
    `groups(step, opt)` before each step (add_param_group)."""
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
    i = step = 0
    while i < len(batches):
        groups(step, opt)
        n = accumulate(i)
        opt.zero_grad()
        for batch in batches[i : i + n]:
            (model.step(batch) / n).backward()
        opt.step()
        i, step = i + n, step + 1
    return model.state_dict()


# ---- the tests ----------------------------------------------------------------------------------------------
@pytest.mark.timeout(300)
def test_lbfgs_closure_reaches_the_optimizer(ranks):
    """LBFGS evaluates Lightning's closure itself (several times a step): every ZeRO stage trains as "ddp" does (ZeRO-1
    steps the DTensor slices, whose dot products are global); a parameter whose rows do not split evenly over dp is
    refused at setup with the fix (DTensor cannot flatten it)."""
    for got in _case(ranks, "lbfgs"):
        ddp = _ran(got["ddp"])
        assert any(not torch.equal(ddp[k], v) for k, v in got["init"].items())  # it trained
        for stage in (0, 1, 2, 3):
            state = _ran(got[stage])
            for key, value in ddp.items():
                close(state[key], value, f"zero {stage} {key}")
        for stage, error in got["uneven"].items():
            assert error.startswith("ValueError: LBFGS flattens") and ("`layer.weight` (shape (3, 32))" in error
                                                                       or "`layer.bias` (shape (3,))" in error), error
            assert "zero_stage=0" in error, error


def test_manual_backward_goes_through_strategy_backward(ranks):
    """Lightning's own count (Strategy.backward mocked): 3 per step, 6 in 2 steps, as under "ddp"; each through
    the module's `backward` hook; the parameters are "ddp"'s."""
    for got in _case(ranks, "manual"):
        ddp = _ran(got["ddp"])
        assert ddp["strategy_backward"] == ddp["hook"] == 6 and ddp["global_step"] == 4
        for stage in STAGES:
            run = _ran(got[stage])
            assert run["strategy_backward"] == 6 and run["hook"] == 6, (stage, run)
            assert run["global_step"] == 4
            for key, value in ddp["state"].items():
                close(run["state"][key], value, f"zero {stage} {key}")
        # two optimizers stepping one parameter: each ZeRO-1 optimizer would overwrite it with its stale slice
        assert "step the same parameter" in got["shared_zero1"] and "zero_stage=0" in got["shared_zero1"]


def test_training_without_an_optimizer(ranks):
    """`configure_optimizers` returning None: fit saves its checkpoint (Lightning's empty optimizer state) and
    resumes from a file (ZeRO-1) and a sharded directory (ZeRO-3)."""
    for got in _case(ranks, "no_optimizer"):
        for stage in STAGES:
            run = _ran(got[stage])
            assert run["saved"] == ["epoch=0-step=1.ckpt"], (stage, run)
            assert stage == 0 or run["resumed_step"] == 2, (stage, run)


def test_add_param_group_while_training(ranks):
    """A frozen backbone joins the optimizer at epoch 1 through Lightning's BaseFinetuning, at dp = 2: its steps reach
    the masters, the ZeRO-1 slices and DDP's late-unfrozen gradients, as one process replays them;
    LearningRateMonitor logs both groups. Resumed from a sharded directory (ZeRO 1 and 3), the group is back before
    its optimizer state (momentum) loads: the third epoch continues the replay."""
    for rank, got in enumerate(_case(ranks, "finetuning")):
        for stage in STAGES:
            run = _ran(got[stage])
            resumed = run.get("resumed")
            model = Finetuned()
            model.load_state_dict(run["init"])
            model.backbone.requires_grad_(False)

            def unfreeze(step: int, opt: torch.optim.Optimizer, model: Finetuned = model) -> None:
                if step == 2:  # epoch 1 (2 steps an epoch)
                    model.backbone.requires_grad_(True)
                    opt.add_param_group({"params": list(model.backbone.parameters()), "lr": 0.05})

            opt_steps: list[dict[str, torch.Tensor]] = []
            batches = run["batches"] + (resumed["batches"] if resumed else [])

            def replay_groups(step: int, opt: torch.optim.Optimizer) -> None:
                if step == len(run["batches"]):
                    opt_steps.append({k: v.detach().clone() for k, v in model.state_dict().items()})
                unfreeze(step, opt)

            expected = _replay(model, batches, lambda i: 1, replay_groups)
            first = opt_steps[0] if resumed else expected
            for key, value in first.items():
                close(run["state"][key], value, f"rank {rank} zero {stage} {key}")
            assert run["lrs"] == {"lr-SGD/pg1": [0.1] * 4, "lr-SGD/pg2": [0.05] * 2}, (stage, run["lrs"])
            if resumed:
                assert resumed["directory"] and len(resumed["batches"]) == 2, (stage, resumed)
                for key, value in expected.items():
                    close(resumed["state"][key], value, f"rank {rank} zero {stage} resumed {key}")
                assert resumed["lrs"] == {"lr-SGD/pg1": [0.1] * 2, "lr-SGD/pg2": [0.05] * 2}, (stage, resumed["lrs"])


def test_trained_module_pickles(ranks):
    """torch.save(model) after fit (ZeRO 0 and 1; FSDP2's generated classes never pickle under ZeRO 2/3), and the
    whole trainer under ZeRO 0: no ProcessGroup is left in the gradient sync. (Under tp the module's torchmetrics
    keep their dp group after fit, so that a metric computed then counts each sample once: tests/test_tp_outputs.py;
    such a module does not pickle.)"""
    for got in _case(ranks, "pickle"):
        for stage in (0, 1):
            assert _ran(got[stage]) == {"model": "ok", "trainer": "ok"}, (stage, got[stage])
        assert _ran(got["tp"])["process_group"] != "None", got["tp"]  # kept, for the counts after fit


def test_missing_checkpoint_keeps_lightnings_words(ranks):
    for got in _case(ranks, "missing_checkpoint"):
        error = got["error"]
        assert error.startswith("FileNotFoundError: Checkpoint file not found: ") and "missing.ckpt" in error, error


def test_changing_accumulation_and_storage_options(ranks):
    """GradientAccumulationScheduler({1: 2, 2: 4}) over 3 epochs of 4 batches (7 steps) as one process replays it;
    `save_checkpoint(storage_options=...)` hands them to the CheckpointIO plugin for a single file (ZeRO-1), and a
    sharded directory (ZeRO-3) refuses them naming the setting that makes one file."""
    for got in _case(ranks, "accumulation"):
        for stage in (1, 3):
            run = _ran(got[stage])
            model = Recorded()
            model.load_state_dict(run["init"])
            expected = _replay(model, run["batches"], lambda i: 1 if i < 4 else 2 if i < 8 else 4)
            assert run["global_step"] == 7
            for key, value in expected.items():
                close(run["state"][key], value, f"zero {stage} {key}")
        zero1, zero3 = _ran(got[1]), _ran(got[3])
        assert zero1["save"] == "" and zero1["saved"], zero1["save"]
        assert "TypeError" in zero3["save"] and "save_distributed_checkpoint=False" in zero3["save"], zero3["save"]
    rank0, rank1 = _case(ranks, "accumulation")
    assert rank0[1]["io_options"] == [{"bucket": "b"}] and rank1[1]["io_options"] == []  # rank 0 writes the file


def test_lbfgs_steps_master_weights_in_every_evaluation():
    """bf16 parameters with fp32 masters: each LBFGS evaluation sees the masters it moved and hands back their
    gradients, as a hand-written fp32-master LBFGS does (one process, no loss scale)."""
    torch.manual_seed(0)
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    model = nn.Linear(4, 2).to(torch.bfloat16)
    ref_model = copy.deepcopy(model)
    masters = [nn.Parameter(p.detach().float()) for p in ref_model.parameters()]
    ref = torch.optim.LBFGS(masters, lr=0.5, max_iter=4)

    def ref_closure() -> torch.Tensor:
        with torch.no_grad():
            for p, m in zip(ref_model.parameters(), masters):
                p.copy_(m)
        ref_model.zero_grad()
        loss = (ref_model(x.bfloat16()).float() - y).pow(2).mean()
        loss.backward()
        for p, m in zip(ref_model.parameters(), masters):
            m.grad = p.grad.float()
        return loss

    ref.step(ref_closure)
    opt = MixedPrecisionOptimizer(torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4), master_weights=True)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = (model(x.bfloat16()).float() - y).pow(2).mean()
        loss.backward()
        return loss

    opt.step(closure)
    ours = opt.optimizer.param_groups[0]["params"]
    assert [p.dtype for p in ours] == [torch.float32, torch.float32]
    assert opt.optimizer.state[ours[0]]["func_evals"] == ref.state[masters[0]]["func_evals"] == 4
    for p, mine, m, before in zip(model.parameters(), ours, masters, ref_model.parameters()):
        torch.testing.assert_close(mine, m, rtol=RTOL, atol=ATOL)
        torch.testing.assert_close(p, mine.detach().bfloat16(), rtol=0, atol=0)  # the model shows the masters


def test_add_param_group_installs_masters():
    """bf16-true: a group added while training steps fp32 masters of its 16-bit parameters, as the first did."""
    torch.manual_seed(0)
    head, backbone = nn.Linear(4, 2).to(torch.bfloat16), nn.Linear(4, 4).to(torch.bfloat16)
    opt = MixedPrecisionOptimizer(torch.optim.SGD(head.parameters(), lr=0.1), master_weights=True)
    opt.add_param_group({"params": list(backbone.parameters()), "lr": 0.5})
    added = opt.optimizer.param_groups[1]["params"]
    assert [p.dtype for p in added] == [torch.float32, torch.float32] and len(opt.master_pairs) == 4
    masters = [m.detach().clone() for m in added]
    for p in backbone.parameters():
        p.grad = torch.ones_like(p)
    opt.prepare_grads()
    opt.step()
    for p, before in zip(backbone.parameters(), masters):
        torch.testing.assert_close(p, (before - 0.5).bfloat16(), rtol=0, atol=0)
