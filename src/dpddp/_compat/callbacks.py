"""Lightning callbacks' checkpoint entries dpddp reads: ``StochasticWeightAveraging.state_dict``'s ``n_averaged``
and ``average_model_state`` (Lightning 2.6.6, ``CHECKED``); ``tests/test_compat.py`` fails if they move."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["swapped_average"]


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
