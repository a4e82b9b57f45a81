"""What the bench's scripts share: the workloads' sizes and the overrides of dpddp's lean run (``bench/run.py``,
``bench/startup.py``, ``bench/step_profile.py``). A leaf module of the standard library alone: ``startup.py``
imports it into the start-up it times. The scripts import it from their own directory (``sys.path[0]`` when
run as ``python bench/<script>.py``)."""

from __future__ import annotations

import compileall
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# (num_samples, num_features, num_classes, global batch size); one epoch each.
WORKLOADS = {
    "W1": (100, 10, 2, 32),  # the seed's size: start-up dominates, whole wall time matters
    "W2": (262144, 1024, 10, 1024),  # compute-heavy steps
    "W3": (65536, 10, 2, 32),  # many small steps: steps/s
    "W4": (50_000_000, 10, 2, 256),  # scale: the project in memory vs streaming (no plain side)
}
QUICK_WORKLOADS = {"W1": (100, 10, 2, 32), "W2": (4096, 64, 10, 256), "W3": (2048, 10, 2, 32), "W4": (20000, 10, 2, 64)}
# What dpddp's defaults add that its peers lack: the CSV logger, two checkpoint callbacks, Lightning's own
# ModelCheckpoint (epoch=0-step=N.ckpt) and the progress bar. The lean run turns them off.
QUIET = [
    "logger=none",
    "callbacks.model_checkpoint=null",
    "callbacks.last_checkpoint=null",
    "trainer.enable_checkpointing=false",
    "trainer.enable_progress_bar=false",
]


def train_overrides(sizes: tuple[int, ...], lean: bool = True, accelerator: str = "cpu") -> list[str]:
    """The overrides of ``python train.py`` for one epoch of a workload's ``sizes`` (``WORKLOADS``' tuples),
    without sanity validation; ``lean``: with ``QUIET``. The strategy, devices and run directory are the
    caller's."""
    num_samples, num_features, num_classes, batch_size = sizes
    data = {"num_samples": num_samples, "num_features": num_features}
    data |= {"num_classes": num_classes, "batch_size": batch_size}
    overrides = [f"accelerator={accelerator}", *(f"data.{key}={value}" for key, value in data.items())]
    overrides += ["trainer.max_epochs=1", "trainer.num_sanity_val_steps=0"]
    return overrides + (QUIET if lean else [])


def compile_bytecode() -> None:
    """Write the bytecode of the project's and the bench's sources (``src/``, ``bench/``), as ``pip install``
    does for an installed package, so that every measured process loads compiled modules like torch's and
    Lightning's, also where ``PYTHONDONTWRITEBYTECODE`` keeps Python from writing it on import."""
    for folder in ("src", "bench"):
        compileall.compile_dir(ROOT / folder, quiet=1)
