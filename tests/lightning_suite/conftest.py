"""Lightning's own tests (vendored from the 2.6.5 tag under ``tests_pytorch/``, Apache-2.0: see LICENSE) with every
CPU Trainer that asks for ``"auto"``, ``"ddp"``, ``"ddp_spawn"``, ``"ddp_fork"``/``"ddp_notebook"`` or a plain
`DDPStrategy` given ``NPUHybridStrategy(zero_stage=S)`` instead, at S = 1 and 3 (each test runs once per stage:
``[zero1]``, ``[zero3]``). A swapped Trainer keeps the launcher its strategy asked for (``start_method``).

Not collected by default (minutes on 2 cores): run it with ``LIGHTNING_NPU_SUITE=1`` or ``-m lightning_suite``,
e.g. ``LIGHTNING_NPU_SUITE=1 pytest tests/lightning_suite``. ``LIGHTNING_NPU_SUITE_STAGES=1`` runs one stage.
README.md lists the results and the expected differences (`EXPECTED` below marks them ``xfail``, with the reason).
"""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path
from typing import Any

import pytest
from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver

_HERE = Path(__file__).parent
if str(_HERE) not in sys.path:  # Lightning's tests import their helpers as `tests_pytorch.helpers...`
    sys.path.insert(0, str(_HERE))

_SWAPPED = {"auto": "popen", "ddp": "popen", "ddp_spawn": "spawn", "ddp_fork": "fork", "ddp_notebook": "fork"}
# "lightning": no swap (Lightning's own strategies: the baseline a difference is measured against)
# "ddp": Lightning's own DDPStrategy in the same places (what a DDP-family strategy changes, ours aside)
# "3file": ZeRO-3 with save_distributed_checkpoint=False (one Lightning file: what Lightning's checkpoint tests open)
STAGES = tuple(s if s in ("lightning", "ddp", "3file") else int(s)
               for s in os.environ.get("LIGHTNING_NPU_SUITE_STAGES", "1,3").split(","))

# test id (without the stage) -> why it differs under npu_hybrid; see README.md
EXPECTED: dict[str, str] = {
    "trainer/optimization/test_manual_optimization.py::test_step_with_optimizer_closure_with_different_frequencies": (
        "the user's `optimizer.step` gets no closure: HybridPrecision runs Lightning's closure, then unscales, checks "
        "and clips, then steps (as Lightning's own MixedPrecision steps through GradScaler.step without one); "
        "LBFGS-like optimizers, which need it, still get it"
    ),
    "callbacks/test_lr_monitor.py::test_multiple_optimizers_basefinetuning": (
        "its `finetune_function` picks optimizers by class (`isinstance(optimizer, torch.optim.SGD)`, `type(optimizer) "
        "is torch.optim.Adam`), but `trainer.optimizers` are the strategy's `MixedPrecisionOptimizer` wrappers (the "
        "user's optimizer is `optimizer.optimizer`); they share its param groups, and their `add_param_group` reaches "
        "the fp32 masters and ZeRO-1 buckets, so only the class test differs"
    ),
}
_MARKER = (
    "it lists the checkpoint directory or counts its files: every npu_hybrid checkpoint is committed with a marker "
    "beside it (`<name>.complete`: sizes and CRC32s, what makes a checkpoint trusted on load, docs/checkpoints.md)"
)
for _name in (
    "test_check_val_every_n_epochs_top_k_integration", "test_checkpoint_repeated_strategy",
    "test_ckpt_every_n_train_steps", "test_ckpt_version_after_rerun_new_trainer",
    "test_ckpt_version_after_rerun_same_trainer", "test_ckpt_version_counter_disabled_after_rerun_new_trainer",
    "test_default_checkpoint_behavior", "test_model_checkpoint_every_n_epochs", "test_model_checkpoint_file_extension",
    "test_model_checkpoint_save_last", "test_model_checkpoint_save_last_none_monitor",
    "test_model_checkpoint_topk_all", "test_model_checkpoint_topk_zero", "test_model_checkpoint_train_time_interval",
    "test_model_checkpoint_with_non_string_input", "test_none_monitor_not_alternating",
    "test_none_monitor_saves_correct_best_model_path", "test_resume_and_old_checkpoint_files_remain",
    "test_resume_training_preserves_old_ckpt_last", "test_save_last_saves_correct_last_model_path",
    "test_save_last_versioning", "test_val_check_interval_checkpoint_files", "test_ckpt_metric_names",
):
    EXPECTED[f"checkpointing/test_model_checkpoint.py::{_name}"] = _MARKER
EXPECTED["checkpointing/test_trainer_checkpoint.py::test_finetuning_with_ckpt_path"] = _MARKER
EXPECTED["checkpointing/test_model_checkpoint.py::test_current_score"] = _MARKER + " (it `torch.load`s every file there)"
EXPECTED.update({
    "checkpointing/test_trainer_checkpoint.py::test_trainer_save_checkpoint_storage_options": (
        "it mocks the CheckpointIO's `save_checkpoint`, so nothing is written; the strategy's commit then refuses to "
        "mark a checkpoint that is not on disk (the call with `storage_options` itself reaches the plugin; ZeRO-3's "
        "sharded directory refuses `storage_options` with a TypeError naming the fix)"
    ),
    "models/test_hooks.py::test_load_from_checkpoint_hook_calls": (
        "the checkpoint dict the hooks see holds HybridPrecision's state under its class name (precision, skipped "
        "steps, the loss scale), as Lightning's MixedPrecision holds its GradScaler's"
    ),
    "strategies/test_ddp.py::test_ddp_configure_ddp": (
        "it asserts a DDP wrapper at one device: npu_hybrid wraps in DDP only with more than one replica (ZeRO 0/1)"
    ),
    "strategies/test_ddp.py::test_ddp_kwargs_from_registry": "it asserts DDPStrategy's registry entries' kwargs",
    "strategies/test_ddp.py::test_set_timeout": (
        "it mocks torch.distributed's init_process_group; the strategy then builds its device mesh, which needs a "
        "real process group"
    ),
    "strategies/test_ddp.py::test_device_id_passed_for_cuda_devices_pytorch": (
        "it mocks torch.distributed's init_process_group (CUDA device ids); the strategy then builds its device mesh, "
        "which needs a real process group"
    ),
})
for _name in ("test_trainer_model_hook_system_fit", "test_trainer_model_hook_system_fit_no_val_and_resume_max_epochs",
              "test_trainer_model_hook_system_fit_no_val_and_resume_max_steps"):
    EXPECTED[f"models/test_hooks.py::{_name}"] = EXPECTED["models/test_hooks.py::test_load_from_checkpoint_hook_calls"]

# what every DDP-family strategy changes at one device: Lightning's own DDPStrategy fails these the same
# (LIGHTNING_NPU_SUITE_STAGES=ddp), against the single-device strategy the test asked for ("auto")
_DDP_FAMILY = (
    "Lightning's own DDPStrategy fails it the same at one device (measured, LIGHTNING_NPU_SUITE_STAGES=ddp): a "
    "DDP-family strategy gives the loaders a DistributedSampler (seeded per epoch: the user's sampler gets no "
    "`set_epoch`, the global RNG is not consumed, a loader built on `batch_sampler=` is re-made unbatched) and has a "
    "read-only `world_size`"
)
for _t in ("loops/test_evaluation_loop.py::test_evaluation_loop_sampler_set_epoch_called",
           "loops/test_training_loop.py::test_training_starts_with_seed",
           "loops/test_loops.py::test_workers_are_shutdown",
           "loops/optimization/test_automatic_loop.py::test_skip_training_step_not_allowed"):
    EXPECTED[_t] = _DDP_FAMILY
# the same, for the loader object: Lightning's DDPStrategy fails these at one device too (measured)
_REMADE_LOADER = (
    "Lightning's own DDPStrategy fails it the same at one device (measured, LIGHTNING_NPU_SUITE_STAGES=ddp): a "
    "DDP-family strategy re-makes the training loader around a distributed sampler, so `trainer.train_dataloader` is "
    "not the user's object and `overfit_batches`' SequentialSampler for a RandomSampler is replaced"
)
for _name in ("test_train_dataloader_passed_to_fit", "test_mixing_of_dataloader_options",
              "test_multiple_dataloaders_with_random_sampler_overfit_batches"):
    EXPECTED[f"trainer/test_dataloaders.py::{_name}"] = _REMADE_LOADER
EXPECTED["models/test_restore.py::test_restarting_mid_epoch_raises_warning"] = (
    "it expects Lightning's warning that a mid-epoch resume restarts the epoch's data; npu_hybrid's training loaders "
    "are resumable (`ResumableDataLoader` is stateful: the checkpoint holds the sampler's position), and Lightning "
    "itself skips that warning for stateful loaders"
)
EXPECTED["loops/optimization/test_closure.py::test_optimizer_step_no_closure_raises"] = EXPECTED[
    "trainer/optimization/test_manual_optimization.py::test_step_with_optimizer_closure_with_different_frequencies"]
EXPECTED["loops/test_loops.py::test_loop_state_on_exception"] = (
    "the fit loop's state holds the resumable sampler's position (`combined_loader`: epoch, consumed samples, "
    "dataset size), so that a mid-epoch resume continues at the next sample; Lightning's has none"
)

# ZeRO-3 only: the default checkpoint form there is a sharded DCP directory (save_distributed_checkpoint=None)
_SHARDED = (
    "at ZeRO-3 a checkpoint is a sharded DCP directory by default, which it opens as one file (`torch.load`, "
    "`os.path.isfile`) or whose writes it counts through a mocked `torch.save`; `save_distributed_checkpoint=False` "
    "gives one file"
)
EXPECTED_AT: dict[int, dict[str, str]] = {3: {f"checkpointing/{t}": _SHARDED for t in (
    "test_checkpoint_callback_frequency.py::test_default_checkpoint_freq",
    "test_checkpoint_callback_frequency.py::test_top_k",
    "test_model_checkpoint.py::test_current_score",
    "test_model_checkpoint.py::test_model_checkpoint_no_extraneous_invocations",
    "test_model_checkpoint.py::test_model_checkpoint_on_exception_in_other_callbacks",
    "test_model_checkpoint.py::test_model_checkpoint_on_exception_parametrized",
    "test_model_checkpoint.py::test_model_checkpoint_on_exception_run_condition_on_train_batch_start",
    "test_model_checkpoint.py::test_model_checkpoint_save_last_checkpoint_contents",
    "test_model_checkpoint.py::test_model_checkpoint_score_and_ckpt",
    "test_model_checkpoint.py::test_model_checkpoint_score_and_ckpt_val_check_interval",
)}}
for _t in ("test_fit_can_fail_during_validation", "test_fit_loop_reset", "test_fit_loop_save_and_restore_dataloaders",
           "test_loop_restart_progress_multiple_dataloaders", "test_loop_state_on_complete_run",
           "test_loop_state_on_exception", "test_restart_from_last_parity", "test_restart_from_last_with_val_parity",
           "test_restart_parity", "test_restart_with_val_parity", "test_validation_during_gradient_accumulation_window"):
    EXPECTED_AT[3][f"loops/test_loops.py::{_t}"] = _SHARDED
for _t in ("test_correct_step_and_epoch", "test_load_model_from_checkpoint"):
    EXPECTED_AT[3][f"models/test_restore.py::{_t}"] = _SHARDED
EXPECTED_AT[3]["checkpointing/test_torch_saving.py::test_model_torch_save"] = (
    "`torch.save(trainer.model)` after ZeRO-3 training: FSDP2 makes each sharded module's class a generated subclass "
    "(`FSDPLinear`), which pickle cannot find by name; ZeRO 0/1 modules pickle"
)
# ZeRO-3 (FSDP2) itself, whatever the checkpoint's form
_MID_WINDOW = (
    "it reads `p.grad` inside a gradient-accumulation window: under ZeRO-3 the accumulating micro-batches' gradients "
    "stay in FSDP2's unsharded buffers (no communication until the stepping micro-batch reduce-scatters them), so the "
    "sharded parameter's `.grad` is None until then"
)
EXPECTED_AT[3]["loops/test_loops.py::test_validation_during_gradient_accumulation_window"] = _MID_WINDOW
EXPECTED_AT["3file"] = {
    "checkpointing/test_torch_saving.py::test_model_torch_save":
        EXPECTED_AT[3]["checkpointing/test_torch_saving.py::test_model_torch_save"],
    "loops/test_loops.py::test_validation_during_gradient_accumulation_window": _MID_WINDOW,
    "models/test_restore.py::test_load_model_from_checkpoint": (
        "it compares the trained module's parameters with a loaded plain module's by `torch.eq`: under ZeRO-3 they are "
        "FSDP2's DTensor shards, and torch refuses `eq` on a DTensor and a plain tensor"
    ),
}

# Lightning's own tests that need TensorBoard (not installed here): skipped, as they would fail without the swap too
NEEDS_TENSORBOARD = {
    "checkpointing/test_model_checkpoint.py::test_checkpoint_repeated_strategy_extended",
    "checkpointing/test_model_checkpoint.py::test_model_checkpoint_path",
    "trainer/logging_/test_eval_loop_logging.py::test_eval_step_logging",
    "trainer/logging_/test_eval_loop_logging.py::test_logging_multi_dataloader_on_epoch_end",
    "trainer/logging_/test_eval_loop_logging.py::test_validation_step_log_with_tensorboard",
    "trainer/logging_/test_train_loop_logging.py::test_log_metrics_epoch_step_values",
    "trainer/logging_/test_train_loop_logging.py::test_log_on_train_start",
    "models/test_restore.py::test_model_saving_loading",  # the default logger: TensorBoardLogger
    "models/test_restore.py::test_strict_model_load_more_params",
    "models/test_restore.py::test_strict_model_load_less_params",
}


def _has_tensorboard() -> bool:
    import importlib.util

    return any(importlib.util.find_spec(m) is not None for m in ("tensorboard", "tensorboardX"))


def _enabled(config: pytest.Config) -> bool:
    return os.environ.get("LIGHTNING_NPU_SUITE") == "1" or "lightning_suite" in (config.option.markexpr or "")


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if not _enabled(config) and _HERE in collection_path.parents:
        return True
    return None


def pytest_collection_modifyitems(items: list[pytest.Item], config: pytest.Config) -> None:
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.utilities import CombinedLoader

    stateful = (Callback, CombinedLoader)
    for item in items:
        if _HERE not in Path(str(item.fspath)).parents:
            continue
        # each stage runs with its own copies of parametrized callbacks and CombinedLoaders (Lightning's tests build
        # them at collection and run once; a second run with the same EarlyStopping objects would start from the
        # first one's state, and the data connector swaps a CombinedLoader's loaders in place for sampler-wrapped ones)
        callspec = getattr(item, "callspec", None)
        for key, value in list(getattr(callspec, "params", {}).items()):
            if isinstance(value, stateful) or (isinstance(value, (list, tuple))
                                               and any(isinstance(v, stateful) for v in value)):
                callspec.params[key] = copy.deepcopy(value)
        item.add_marker(pytest.mark.lightning_suite)
        base = item.nodeid.split("tests_pytorch/", 1)[-1]
        for stage_id in ("zero3file", "zero1", "zero3"):
            base = base.replace(f"[{stage_id}]", "").replace(f"-{stage_id}]", "]")
        stage = ("3file" if "zero3file" in item.nodeid else 3 if "zero3" in item.nodeid
                 else 1 if "zero1" in item.nodeid else None)
        at = EXPECTED_AT.get(stage, {})
        short = base.split("[", 1)[0]
        if short in NEEDS_TENSORBOARD and not _has_tensorboard():
            item.add_marker(pytest.mark.skip(reason="needs tensorboard or tensorboardX (Lightning's own test)"))
        reason = EXPECTED.get(base) or EXPECTED.get(short) or at.get(base) or at.get(short)
        if reason is not None:
            item.add_marker(pytest.mark.xfail(reason=reason, strict=False))


def _swap(stage: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_npu import NPUHybridStrategy

    if kwargs.get("accelerator", "auto") not in ("auto", "cpu"):
        return kwargs
    strategy = kwargs.get("strategy", "auto")
    if isinstance(strategy, str) and strategy in _SWAPPED:
        start_method = _SWAPPED[strategy]
    elif type(strategy) is DDPStrategy:
        start_method = strategy._start_method
    else:
        return kwargs
    if stage == "ddp":
        return {**kwargs, "strategy": DDPStrategy(start_method=start_method)}
    if stage == "3file":
        return {**kwargs, "strategy": NPUHybridStrategy(zero_stage=3, save_distributed_checkpoint=False,
                                                        start_method=start_method)}
    return {**kwargs, "strategy": NPUHybridStrategy(zero_stage=stage, start_method=start_method)}


@pytest.fixture(autouse=True, params=STAGES,
                ids=[f"zero{s}" if isinstance(s, int) or s == "3file" else s for s in STAGES])
def npu_hybrid_trainer(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Every Trainer built by the test gets NPUHybridStrategy at this stage where it asked for a CPU DDP/auto one."""
    from lightning.pytorch import Trainer

    stage, init = request.param, Trainer.__init__
    if stage == "lightning":
        return stage
    # A swapped one-device Trainer gets the popen launcher (Lightning's own "auto" has none), whose child-process
    # observer polls every 5 s; Lightning's thread police joins it after each test. Poll fast: 5 s per test saved.
    monkeypatch.setattr(_ChildProcessObserver.__init__, "__defaults__", (0.1,))
    # Lightning's conftest makes every LightningDeprecationWarning an error; HybridPrecision's one (the bare metric
    # names, once per process, first logged under gradient clipping) is the project's own, announced in CHANGELOG
    monkeypatch.setattr("lightning_npu.precision.hybrid._legacy_warned", True)

    def __init__(self: Trainer, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **_swap(stage, kwargs))

    monkeypatch.setattr(Trainer, "__init__", __init__)
    return stage


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "lightning_suite: Lightning's own tests under npu_hybrid (tests/lightning_suite)")
