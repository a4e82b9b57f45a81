"""Checkpoints that survive a kill at any moment, and a clean refusal of one that cannot be read."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

__all__ = ["AtomicCheckpointIO", "checkpoint_problem"]


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's ``TorchCheckpointIO``, writing ``<name>.tmp`` beside the target, then ``os.replace``: a
    process killed mid-write leaves the previous ``last.ckpt`` whole (Lightning writes the file in place)."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any = None) -> None:
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        super().save_checkpoint(checkpoint, tmp, storage_options)
        os.replace(tmp, path)


def checkpoint_problem(path: str | Path) -> str | None:
    """Why ``path`` cannot be resumed from (one line), or ``None``. Loads it with ``weights_only=True`` (no code
    runs from the file), as ``Trainer.fit(weights_only=True)`` will."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # a truncated zip, a pickle, not a checkpoint at all: all one answer to the user
        detail = (str(err).splitlines() or [""])[0][:120]
        return f"cannot be read as a checkpoint ({type(err).__name__}{': ' + detail if detail else ''})"
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt:
        return "is not a Lightning checkpoint (no state_dict)"
    return None
