"""torch's PowerSGD hook state as plain data (loadable with ``weights_only=True``) and DDP's bucket assignment,
checked in torch ``CHECKED``; tests/test_compat.py fails if they move."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

CHECKED = "2.13.0"
"""The torch version every entry below was read in and tested against."""

POWERSGD_FIELDS = ("rng", "error_dict", "p_memory_dict", "q_memory_dict", "iter")
"""``PowerSGDState``'s fields that change as training runs (pickled by its ``__getstate__``)."""


def powersgd_state(state: PowerSGDState) -> dict[str, Any]:
    """``POWERSGD_FIELDS`` of ``state``, tensors on the CPU, the numpy generator's keys as a tensor."""
    kind, keys, pos, has_gauss, gauss = state.rng.get_state(legacy=True)
    out: dict[str, Any] = {"rng": [kind, torch.from_numpy(np.asarray(keys, dtype=np.int64)), pos, has_gauss, gauss]}
    for name in ("error_dict", "p_memory_dict", "q_memory_dict"):
        out[name] = {int(k): v.detach().cpu().clone() for k, v in getattr(state, name).items()}
    out["iter"] = int(state.iter)
    return out


def load_powersgd_state(state: PowerSGDState, saved: dict[str, Any], device: torch.device) -> None:
    """Put a ``powersgd_state`` back into ``state`` (its tensors on ``device``)."""
    kind, keys, pos, has_gauss, gauss = saved["rng"]
    state.rng.set_state((kind, keys.numpy().astype(np.uint32), int(pos), int(has_gauss), float(gauss)))
    for name in ("error_dict", "p_memory_dict", "q_memory_dict"):
        setattr(state, name, {int(k): v.to(device) for k, v in saved[name].items()})
    state.iter = int(saved["iter"])


@contextmanager
def bucket_assignment(layout: list[list[int]] | None) -> Iterator[list[torch.Tensor]]:
    """Inside it, a DDP built starts with the buckets ``layout`` (``None``: its own; DDP calls
    ``dist._compute_bucket_assignment_by_size`` once); yields its parameter list, filled once built."""
    real = dist._compute_bucket_assignment_by_size
    seen: list[torch.Tensor] = []

    def assign(parameters: list[torch.Tensor], limits: list[int], *args: Any, **kwargs: Any) -> Any:
        seen[:] = parameters
        indices, per_bucket = real(parameters, limits, *args, **kwargs)
        if layout is None or sorted(i for b in layout for i in b) != list(range(len(parameters))):
            return indices, per_bucket
        return list(reversed(layout)), [max(per_bucket)] * len(layout)

    setattr(dist, "_compute_bucket_assignment_by_size", assign)  # noqa: B010
    try:
        yield seen
    finally:
        setattr(dist, "_compute_bucket_assignment_by_size", real)  # noqa: B010
