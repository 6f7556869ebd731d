"""Lightning's own tests (vendored from the 2.6.5 tag under ``tests_pytorch/``, Apache-2.0: see LICENSE) with every
CPU Trainer that asks for ``"auto"``, ``"ddp"``, ``"ddp_spawn"``, ``"ddp_fork"``/``"ddp_notebook"`` or a plain
`DDPStrategy` given ``NPUHybridStrategy(zero_stage=S)`` instead, at S = 1 and 3 (each test runs once per stage:
``[zero1]``, ``[zero3]``). A swapped Trainer keeps the launcher its strategy asked for (``start_method``).

Not collected by default (minutes on 2 cores): run it with ``LIGHTNING_NPU_SUITE=1`` or ``-m lightning_suite``,
e.g. ``LIGHTNING_NPU_SUITE=1 pytest tests/lightning_suite``. ``LIGHTNING_NPU_SUITE_STAGES=1`` runs one stage.
README.md lists the results and the expected differences (`EXPECTED` below marks them ``xfail``, with the reason).
"""

from __future__ import annotations

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
STAGES = tuple(s if s == "lightning" else int(s) for s in os.environ.get("LIGHTNING_NPU_SUITE_STAGES", "1,3").split(","))

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


def _enabled(config: pytest.Config) -> bool:
    return os.environ.get("LIGHTNING_NPU_SUITE") == "1" or "lightning_suite" in (config.option.markexpr or "")


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    if not _enabled(config) and _HERE in collection_path.parents:
        return True
    return None


def pytest_collection_modifyitems(items: list[pytest.Item], config: pytest.Config) -> None:
    for item in items:
        if _HERE not in Path(str(item.fspath)).parents:
            continue
        item.add_marker(pytest.mark.lightning_suite)
        base = item.nodeid.split("tests_pytorch/", 1)[-1].replace("[zero1]", "").replace("[zero3]", "")
        base = base.replace("-zero1]", "]").replace("-zero3]", "]")
        reason = EXPECTED.get(base) or EXPECTED.get(base.split("[", 1)[0])
        if reason is not None:
            item.add_marker(pytest.mark.xfail(reason=reason, strict=False))


def _swap(stage: int, kwargs: dict[str, Any]) -> dict[str, Any]:
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
    return {**kwargs, "strategy": NPUHybridStrategy(zero_stage=stage, start_method=start_method)}


@pytest.fixture(autouse=True, params=STAGES, ids=[s if s == "lightning" else f"zero{s}" for s in STAGES])
def npu_hybrid_trainer(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Any:
    """Every Trainer built by the test gets NPUHybridStrategy at this stage where it asked for a CPU DDP/auto one."""
    from lightning.pytorch import Trainer

    stage, init = request.param, Trainer.__init__
    if stage == "lightning":
        return stage
    # A swapped one-device Trainer gets the popen launcher (Lightning's own "auto" has none), whose child-process
    # observer polls every 5 s; Lightning's thread police joins it after each test. Poll fast: 5 s per test saved.
    monkeypatch.setattr(_ChildProcessObserver.__init__, "__defaults__", (0.1,))

    def __init__(self: Trainer, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **_swap(stage, kwargs))

    monkeypatch.setattr(Trainer, "__init__", __init__)
    return stage


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "lightning_suite: Lightning's own tests under npu_hybrid (tests/lightning_suite)")
