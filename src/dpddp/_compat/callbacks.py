"""Lightning 2.6.6 callbacks' internals dpddp reads or mends; tests/test_compat.py fails when they move."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.callbacks import BaseFinetuning, StochasticWeightAveraging


def swapped_average(checkpoint: dict[str, Any]) -> tuple[str, int] | None:
    """``(state key, epochs averaged)`` of the SWA whose average of 2+ epochs ``checkpoint``'s weights are, or None."""
    weights = checkpoint.get("state_dict") or {}
    for key, state in (checkpoint.get("callbacks") or {}).items():
        if not isinstance(state, dict) or not {"n_averaged", "average_model_state"} <= state.keys():
            continue
        average, count = state["average_model_state"] or {}, int(state["n_averaged"] or 0)
        tensors = {k: v for k, v in average.items() if isinstance(v, torch.Tensor)}
        if count >= 2 and tensors and all(k in weights and torch.equal(weights[k], v) for k, v in tensors.items()):
            return key, count
    return None


def mend_finetuning(callback: BaseFinetuning) -> None:
    """Make a continued fit unfreeze again the modules of the param groups ``callback`` had added (``_restarting``)."""
    restore = callback.on_fit_start

    def on_fit_start(trainer: Any, pl_module: Any) -> None:
        own = [len(optimizer.param_groups) for optimizer in trainer.optimizers]
        restarting = bool(callback._restarting)
        restore(trainer, pl_module)
        if not restarting:
            return
        groups = [group for n, o in zip(own, trainer.optimizers, strict=True) for group in o.param_groups[n:]]
        added = {id(p) for group in groups for p in group["params"]}
        owners = [m for m in pl_module.modules() if any(id(p) in added for p in m.parameters(recurse=False))]
        BaseFinetuning.make_trainable(owners)

    callback.on_fit_start = on_fit_start  # type: ignore[method-assign]


def mend_swa(callback: StochasticWeightAveraging) -> None:
    """Run ``callback``'s ``SWALR`` set-up when a fit continues mid-epoch in its window (Lightning skips it)."""
    own = callback.on_train_start

    def on_train_start(trainer: Any, pl_module: Any) -> None:
        own(trainer, pl_module)
        in_window = callback.swa_start <= trainer.current_epoch <= callback.swa_end
        if trainer.fit_loop.restarted_mid_epoch and in_window:
            callback.on_train_epoch_start(trainer, pl_module)

    callback.on_train_start = on_train_start  # type: ignore[method-assign]
