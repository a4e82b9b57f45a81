"""Lightning callbacks' checkpoint entries dpddp reads: ``StochasticWeightAveraging.state_dict``'s ``n_averaged``
and ``average_model_state``; ``BaseFinetuning``'s restart (its private ``_restarting``, set by
``load_state_dict``), which re-freezes on a continued fit the modules it had unfrozen before the stop; and the fit
loop's ``restarted_mid_epoch`` (its private ``_restart_stage``), where Lightning skips ``on_train_epoch_start``
(Lightning 2.6.6, ``CHECKED``); ``tests/test_compat.py`` fails if they move, or if Lightning mends the restarts
itself."""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch.callbacks import BaseFinetuning, StochasticWeightAveraging

__all__ = ["mend_finetuning", "mend_swa", "swapped_average"]


def swapped_average(checkpoint: dict[str, Any]) -> tuple[str, int] | None:
    """``(state key, epochs averaged)`` of a ``StochasticWeightAveraging`` in ``checkpoint`` whose average of 2 or
    more epochs its weights are (swapped in at its fit's end, ``on_train_end``), else ``None``."""
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
    """Make a continued fit keep what ``callback`` had unfrozen before its stop, as the straight fit does.

    Lightning's ``BaseFinetuning`` freezes in ``setup`` on every fit, then, continued from a checkpoint, puts back
    the parameter groups it had added in ``on_fit_start``, but not ``requires_grad``: the modules it unfroze stay
    frozen and never train again (``BackboneFinetuning`` unfreezes at one epoch only). After that restore, the
    modules owning the parameters of the added groups (those beyond ``configure_optimizers``' own) are made
    trainable again, as ``BaseFinetuning.make_trainable`` made them when they were unfrozen."""
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
    """Make a fit continued inside ``callback``'s window anneal as the straight fit does.

    Lightning's ``StochasticWeightAveraging`` sets up its ``SWALR`` (from its saved state) and puts it among the
    trainer's schedulers in ``on_train_epoch_start``, which a fit continued from a checkpoint written inside an
    epoch skips for that epoch: the epoch's ``SWALR`` step is lost and the continued run trains on another learning
    rate. On such a restart in the window, its ``on_train_epoch_start`` runs once at ``on_train_start`` (its update
    of the average for the epoch is not made again: ``latest_update_epoch`` travels in its state)."""
    own = callback.on_train_start

    def on_train_start(trainer: Any, pl_module: Any) -> None:
        own(trainer, pl_module)
        in_window = callback.swa_start <= trainer.current_epoch <= callback.swa_end
        if trainer.fit_loop.restarted_mid_epoch and in_window:
            callback.on_train_epoch_start(trainer, pl_module)

    callback.on_train_start = on_train_start  # type: ignore[method-assign]
