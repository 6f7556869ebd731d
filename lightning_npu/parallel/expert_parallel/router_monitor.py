"""How a mixture-of-experts model routes its tokens, logged, with a warning when a router collapses.

A router that sends most tokens to one expert trains that expert alone and wastes the rest; the loss hides it for
a long time. The counts are read where every `transformers` 5 MoE block hands its routing to its experts module
(``experts(hidden_states, top_k_index, top_k_weights)``), so any layout sees them: expert tensor parallelism,
replicated experts; under pipeline parallelism the loggers (on global rank 0) see the first stage's layers.
The load-balancing (aux) loss is read from the model's output where a transformers MoE model returns one
(``output_router_logits=True``); not under pipeline parallelism, where each stage sees only its own layers' routing.
"""

from __future__ import annotations

from typing import Any, Optional

import lightning as L
import torch
import torch.distributed as dist
import torch.nn as nn
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_npu.validate import check_fraction, check_int


def experts_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The modules that take ``(hidden_states, top_k_index, top_k_weights)``: `transformers`' 3-D experts."""
    return {name: m for name, m in model.named_modules()
            if isinstance(getattr(m, "num_experts", None), int) and isinstance(getattr(m, "gate_up_proj", None),
                                                                              torch.Tensor)}


_AUX = "__aux_loss__"


class RouterMonitor(L.Callback):
    """Per MoE layer, every `log_every_n_steps` training steps: ``moe/<layer>/max_load`` (the largest fraction of the
    tokens routed to one expert; 1/num_experts x top_k is perfectly balanced), ``moe/<layer>/experts_used`` and
    ``moe/<layer>/load_cv`` (the coefficient of variation of the experts' token counts), over all data-parallel
    ranks. A layer whose max load stays above `collapse_load` for `patience` logged windows is warned about once.
    """

    def __init__(self, log_every_n_steps: int = 10, collapse_load: float = 0.9, patience: int = 5) -> None:
        check_int("log_every_n_steps", log_every_n_steps, owner="RouterMonitor")
        check_fraction("collapse_load", collapse_load, example=0.9, owner="RouterMonitor")
        check_int("patience", patience, owner="RouterMonitor")
        self.log_every_n_steps, self.collapse_load, self.patience = log_every_n_steps, collapse_load, patience
        self._counts: dict[str, torch.Tensor] = {}
        self._counts_width: dict[str, int] = {}
        self._tokens: dict[str, int] = {}
        self._over: dict[str, int] = {}
        self._warned: set[str] = set()
        self._handles: list[Any] = []
        self._aux = [0.0, 0]  # the window's aux-loss sum and count on this rank
        self.last: dict[str, dict[str, float]] = {}
        self._active = False
        self.collapse_events: list[dict[str, Any]] = []

    def on_fit_start(self, trainer: Any, pl_module: L.LightningModule) -> None:
        layers = experts_modules(pl_module)
        # a pipeline stage may hold no MoE layer while another does: the stages decide together whether to log
        self._active = any(_merge_over_pp(trainer, {"found": [bool(layers)]}, concat=True)["found"])
        if not self._active:
            rank_zero_warn("RouterMonitor: the model has no mixture-of-experts layers (transformers' experts "
                           "modules taking top_k_index); nothing to monitor.")
        for name, module in layers.items():
            self._handles.append(module.register_forward_pre_hook(self._counter(name), with_kwargs=True))
        if getattr(trainer.strategy, "pipeline_plan", None) is None:
            for module in _aux_loss_sources(pl_module):
                self._handles.append(module.register_forward_hook(self._aux_reader))

    def on_fit_end(self, trainer: Any, pl_module: L.LightningModule) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _aux_reader(self, module: nn.Module, args: Any, output: Any) -> None:
        aux = getattr(output, "aux_loss", None)
        if module.training and isinstance(aux, torch.Tensor):
            self._aux[0] += float(aux.detach())
            self._aux[1] += 1

    def _counter(self, name: str) -> Any:
        def count(module: nn.Module, args: tuple, kwargs: dict) -> None:
            index = args[1] if len(args) > 1 else kwargs.get("top_k_index")
            if not module.training or not isinstance(index, torch.Tensor):
                return
            counts = torch.bincount(index.detach().reshape(-1), minlength=module.num_experts)[:module.num_experts]
            self._counts_width[name] = module.num_experts
            prev = self._counts.get(name)
            self._counts[name] = counts if prev is None else prev + counts
            self._tokens[name] = self._tokens.get(name, 0) + index.shape[0]
        return count

    def on_train_batch_end(self, trainer: Any, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        if (trainer.global_step % self.log_every_n_steps) or not self._active:
            return
        aux = self._aux
        loads = self._reduce_over_dp(trainer)
        self._counts.clear()
        self._tokens.clear()
        self._aux = [0.0, 0]
        loads = _merge_over_pp(trainer, loads)  # rank 0 logs: it needs every stage's layers
        aux = loads.pop(_AUX, aux)
        if aux[1] > 0:
            pl_module.log("moe/aux_loss", float(aux[0] / aux[1]), rank_zero_only=True)
        for name in sorted(loads):
            counts, tokens = loads[name]
            total = float(tokens) or 1.0
            stats = {"max_load": float(counts.max()) / total, "experts_used": float((counts > 0).sum()),
                     "load_cv": float(counts.std(unbiased=False) / counts.mean().clamp(min=1e-12))}
            self.last[name] = stats
            for key, value in stats.items():
                pl_module.log(f"moe/{name}/{key}", value, rank_zero_only=True)
            self._check_collapse(name, stats["max_load"], trainer.global_step)

    def _reduce_over_dp(self, trainer: Any) -> dict[str, Any]:
        """{layer: (expert token counts, tokens)} of this rank's stage, summed over the data-parallel ranks (tp peers
        of a dp rank routed the same tokens), and the aux loss window under `_AUX`."""
        names = sorted(self._counts)
        if not names:
            return {}
        packed = torch.cat([self._counts[n].double() for n in names] +
                           [torch.tensor([float(self._tokens[n]) for n in names] + self._aux, dtype=torch.float64,
                                         device=self._counts[names[0]].device)])
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(packed, group=_mesh_group(trainer, "dp"))
        packed = packed.cpu()
        out: dict[str, Any] = {_AUX: [float(packed[-2]), int(packed[-1])]}
        offset, tokens = 0, packed[-2 - len(names):-2]
        for i, name in enumerate(names):
            n = self._counts_width[name]
            out[name] = (packed[offset:offset + n], float(tokens[i]))
            offset += n
        return out

    def _check_collapse(self, name: str, load: float, step: int) -> None:
        self._over[name] = self._over.get(name, 0) + 1 if load > self.collapse_load else 0
        if self._over[name] >= self.patience:
            self.collapse_events.append({"step": step, "layer": name, "max_load": load, "windows": self._over[name]})
        if self._over[name] >= self.patience and name not in self._warned:
            self._warned.add(name)
            rank_zero_warn(
                f"RouterMonitor: step {step}: the router of {name} sent {load:.0%} of its tokens to one expert for "
                f"{self._over[name]} logged windows (collapse_load={self.collapse_load}); the other experts barely "
                "train. Check the load-balancing (aux) loss coefficient (e.g. `router_aux_loss_coef` with "
                "`output_router_logits=True` in transformers) and the router's learning rate.")

    def state_dict(self) -> dict[str, Any]:
        return {"over": dict(self._over), "warned": sorted(self._warned)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._over, self._warned = dict(state.get("over", {})), set(state.get("warned", ()))


def _aux_loss_sources(model: nn.Module) -> list[nn.Module]:
    """The outermost transformers MoE models under `model` (their config has ``output_router_logits``): their output
    carries the load-balancing loss when that flag is on."""
    found = [name for name, m in model.named_modules()
             if hasattr(getattr(m, "config", None), "output_router_logits")]
    outer = [n for n in found if not any(n != o and n.startswith(o + ".") for o in found if o)]
    return [model.get_submodule(n) for n in outer]


def _mesh_group(trainer: Any, dim: str) -> Optional[Any]:
    mesh = getattr(trainer.strategy, "device_mesh", None)
    if mesh is not None and dim in (getattr(mesh, "mesh_dim_names", None) or ()):
        return mesh[dim].get_group()
    return None


def _merge_over_pp(trainer: Any, loads: dict[str, Any], concat: bool = False) -> dict[str, Any]:
    """Every pipeline stage's layers on every rank of a pp line (each stage routes only its own blocks' tokens). Every
    rank takes part on a logging step, a stage without MoE layers with nothing to add. Values under one key from
    several stages are added (the aux loss window) or, with `concat`, joined."""
    group = _mesh_group(trainer, "pp")
    if group is None or dist.get_world_size(group) == 1:
        return loads
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, loads, group=group)
    merged: dict[str, Any] = {}
    for part in gathered:
        for name, value in part.items():
            if name in merged and concat:
                merged[name] = merged[name] + value
            elif name == _AUX and name in merged:
                merged[name] = [merged[name][0] + value[0], merged[name][1] + value[1]]
            else:
                merged[name] = value
    return merged
