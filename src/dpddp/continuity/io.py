"""Checkpoints that survive a kill at any moment, at intervals too, and a clean refusal of one that cannot be read."""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO
from lightning_utilities.core.apply_func import apply_to_collection
from omegaconf import DictConfig, OmegaConf
from typing_extensions import override

from dpddp._compat import processed_epochs, swapped_average
from dpddp.cluster import cluster_world_size
from dpddp.errors import WriteFailed, checked_float, checked_int, first_line

BACKGROUND = {"dpddp": "background"}  # storage_options: AtomicCheckpointIO writes in its background thread


class AtomicCheckpointIO(TorchCheckpointIO):
    """``TorchCheckpointIO`` writing ``<name>.tmp``, then ``os.replace``; ``BACKGROUND``: in a thread, one at a time."""

    def __init__(self) -> None:
        super().__init__()
        self.saved_steps: dict[str, int] = {}  # file name -> global step of its last write by this process
        self._executor: ThreadPoolExecutor | None = None
        self._pending: Future[None] | None = None

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | Path, storage_options: Any = None) -> None:
        """Write ``checkpoint`` to ``path`` atomically; ``WriteFailed``: this or the last background write failed."""
        self.wait()
        if storage_options == BACKGROUND:
            copy = apply_to_collection(checkpoint, torch.Tensor, lambda t: t.detach().to("cpu", copy=True))
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dpddp-checkpoint")
            self._pending = self._executor.submit(self._write, copy, Path(path), None)
        else:
            self._write(checkpoint, Path(path), storage_options)

    def wait(self) -> None:
        """Wait for the background write in flight, if any (``WriteFailed``: it failed)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    @override
    def teardown(self) -> None:
        """Wait for the background write and end its thread (``WriteFailed``: it failed)."""
        try:
            self.wait()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
                self._executor = None

    def _write(self, checkpoint: dict[str, Any], path: Path, storage_options: Any) -> None:
        tmp = path.with_name(path.name + ".tmp")
        try:
            super().save_checkpoint(checkpoint, tmp, storage_options)
            os.replace(tmp, path)
        except OSError as err:
            with contextlib.suppress(OSError):  # a read-only directory refuses the clean-up too: report the write
                tmp.unlink(missing_ok=True)
            why = err.strerror or str(err)
            kept = f" (the earlier {path.name} is whole)" if path.is_file() else ""
            fix = f"free space or make it writable, then resume{kept}"
            raise WriteFailed(f"cannot write {path.name} in {str(path.parent)!r}: {why}: {fix}") from err
        self.saved_steps[path.name] = int(checkpoint.get("global_step", -1))


CHECKPOINT_KEYS = ("every_n_steps", "every_seconds")


def checkpoint_intervals(cfg: Mapping) -> tuple[int | None, float | None]:
    """``(checkpoint.every_n_steps, checkpoint.every_seconds)``, ``None`` when off; raises ``ConfigError``."""
    section = cfg.get("checkpoint") or {}
    steps, seconds = section.get("every_n_steps"), section.get("every_seconds")
    if steps is not None:
        checked_int("checkpoint.every_n_steps", steps, 1, "use a positive number of optimizer steps, or null (off)")
    if seconds == "auto":
        seconds = 600.0 if cluster_world_size(cfg.get("cluster", "auto")) is not None else None
    elif seconds is not None:
        fix = "use a positive number of seconds, auto (600 under torchrun, SLURM, a PyTorchJob) or null (off)"
        checked_float("checkpoint.every_seconds", seconds, math.nextafter(0.0, 1.0), math.inf, fix)
    if (cfg.get("trainer") or {}).get("enable_checkpointing") is False:
        return None, None
    return steps, seconds


@dataclass
class IntervalCheckpoints:
    """Writes ``<dirpath>/last.ckpt`` in the background every ``every_n_steps`` steps or ``every_s`` seconds."""

    dirpath: Path
    every_n_steps: int | None = None
    every_s: float | None = None
    step: int = 0
    at: float = field(default_factory=time.monotonic)
    due: bool = False

    def start(self, step: int) -> None:
        """A fit starts at ``step``: the intervals count from here."""
        self.step, self.at, self.due = step, time.monotonic(), False

    def time_due(self) -> bool:
        """Whether ``every_s`` has passed on this rank."""
        return self.every_s is not None and time.monotonic() - self.at >= self.every_s

    def at_step_boundary(self, trainer: pl.Trainer) -> None:
        """After an optimizer step: write when a step or time interval is due."""
        every, step = self.every_n_steps, trainer.global_step
        if step > self.step and (self.due or (every and step // every > self.step // every)):
            self.step, self.due = step, False
            background = BACKGROUND if isinstance(trainer.strategy.checkpoint_io, AtomicCheckpointIO) else None
            trainer.save_checkpoint(self.dirpath / "last.ckpt", weights_only=False, storage_options=background)
            self.at = time.monotonic()


def read_checkpoint(path: str | Path) -> Any:
    """The checkpoint at ``path``, loaded ``weights_only`` and mapped (``mmap``). Raises what ``torch.load`` raises."""
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


def readable(path: str | Path) -> dict | None:
    """``read_checkpoint(path)`` when it gives a dict, else ``None`` (the check says why)."""
    try:
        ckpt = read_checkpoint(path)
    except Exception:
        return None
    return ckpt if isinstance(ckpt, dict) else None


@dataclass(frozen=True)
class CheckpointFacts:
    """What a continued run takes from its checkpoint, read once: launch id, ``steps_per_execution``, epochs, step."""

    path: str
    launch: str | None = None
    steps_per_execution: int = 1
    epochs_done: int | None = None
    global_step: int = -1

    @classmethod
    def of(cls, path: str | Path, ckpt: dict | None) -> CheckpointFacts:
        """The facts of ``ckpt``, read from ``path`` (``None``: unreadable)."""
        if ckpt is None:
            return cls(str(path))
        entry = ckpt["dpddp"] if isinstance(ckpt.get("dpddp"), dict) else {}
        k = entry.get("steps_per_execution", 1)
        k = k if isinstance(k, int) and k >= 1 else 1
        return cls(str(path), entry.get("launch"), k, processed_epochs(ckpt), int(ckpt.get("global_step", -1)))


class ConfiguredModel(NamedTuple):
    """The configured model's ``state_dict`` shapes, ``strict_loading``, ``{hparam: (setting, value)}``."""

    shapes: dict[str, tuple[int, ...]]
    strict: bool
    settings: dict[str, tuple[str, Any]]


def _other_model(saved: dict, shapes: dict[str, tuple[int, ...]], strict: bool) -> str | None:
    """How ``saved`` differs from ``shapes`` for Lightning's load (``strict`` or not); ``None`` when it loads."""
    resized = [
        f"{k} is {list(v.shape)} there, {list(shapes[k])} here"
        for k, v in saved.items()
        if k in shapes and hasattr(v, "shape") and tuple(v.shape) != shapes[k]
    ]
    missing = [k for k in shapes if k not in saved] if strict else []
    unexpected = [k for k in saved if k not in shapes] if strict else []
    found = [*resized[:2], *([f"no {', '.join(missing[:3])}"] if missing else [])]
    found += [f"an unknown {', '.join(unexpected[:3])}"] if unexpected else []
    return "; ".join(found) or None


SPLIT_SETTINGS = frozenset(
    ["_target_", "num_samples", "num_features", "num_classes", "seed", "val_fraction", "test_fraction", "label_noise"]
)
"""The data settings an evaluation must share with the run: they change the samples or the splits."""


def _run_data(path: str | Path) -> dict:
    """The ``data`` settings in ``.hydra/config.yaml`` beside ``path``'s ``checkpoints/`` (``{}``: none there)."""
    config = Path(path).resolve().parent.parent / ".hydra" / "config.yaml"
    if not config.is_file():
        return {}
    run = OmegaConf.load(config)
    data = OmegaConf.to_container(run["data"], resolve=True) if isinstance(run, DictConfig) and "data" in run else {}
    return data if isinstance(data, dict) else {}


def other_steps_problem(ckpt: dict, steps_per_execution: int) -> str | None:
    """Why ``ckpt`` cannot go on with ``steps_per_execution`` (another K: only from an epoch's end), or ``None``."""
    entry = ckpt.get("dpddp") or {}
    k = entry.get("steps_per_execution", 1)  # the resumable state's entry; none: 1
    if k == steps_per_execution or not entry.get("mid_epoch"):
        return None
    end = f"to the epoch's end (trainer.max_epochs={int(ckpt.get('epoch', 0)) + 1})"
    fix = f"continue it with steps_per_execution={k} (and the callbacks it ran with) {end}"
    return f"stopped inside an epoch with steps_per_execution={k}: {fix}, then with {steps_per_execution=}"


def checkpoint_problem(
    path: str | Path,
    max_epochs: int | None = None,
    data: dict | None = None,
    steps_per_execution: int | None = None,
    *,
    fit: bool = False,
    whole: bool = False,
    model: ConfiguredModel | None = None,
    batch_size: int | None = None,
    loaded: dict | None = None,
) -> str | None:
    """Why ``path`` (``loaded``: read) cannot be continued (``fit``) or evaluated (``whole``) so, or ``None``."""
    written = "give a last.ckpt or best.ckpt written by dpddp"
    try:
        ckpt = read_checkpoint(path) if loaded is None else loaded
    except Exception as err:  # a truncated zip, a pickle, not a checkpoint at all: all one answer to the user
        return f"cannot be read as a checkpoint ({first_line(err, 120)}): {written}"
    if isinstance(ckpt, dict) and ckpt and all(isinstance(v, torch.Tensor) for v in ckpt.values()):
        return (
            "is a bare state dict (weights only: torch.save(model.state_dict())), not a Lightning checkpoint: give "
            "its run's checkpoints/last.ckpt, or load the weights into the model yourself and start without ckpt_path"
        )
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt:
        return f"is not a Lightning checkpoint (no state_dict): {written}"
    done = processed_epochs(ckpt)
    if fit and max_epochs not in (None, -1) and isinstance(done, int) and done > max_epochs:
        return f"has finished {done} epochs, more than trainer.max_epochs={max_epochs}: raise trainer.max_epochs"
    later = fit and max_epochs not in (None, -1) and isinstance(done, int) and max_epochs > done
    if later and (swa := swapped_average(ckpt)):
        ended = f"holds the average {swa[0]} swapped in as its fit ended ({done} epochs done, {swa[1]} averaged)"
        fix = f"start a new run with trainer.max_epochs={max_epochs}"
        return f"{ended}: a fit continued from it cannot equal a straight run; {fix}"
    if steps_per_execution is not None and (problem := other_steps_problem(ckpt, steps_per_execution)):
        return problem
    entry = ckpt.get("dpddp") or {}
    was = entry.get("batch_size")
    if fit and entry.get("mid_epoch") and batch_size is not None and was is not None and was != batch_size:
        fix = f"continue it with data.batch_size={was}, or change it from a checkpoint written at an epoch's end"
        return f"stopped inside an epoch with data.batch_size={was}: {fix}"
    saved = {**(_run_data(path) if whole else {}), **(ckpt.get("datamodule_hyper_parameters") or {})}
    data = {k: v for k, v in (data or {}).items() if k in SPLIT_SETTINGS or not whole}
    changed = [k for k in data if k in saved and saved[k] != data[k]]
    if changed:
        said = ", ".join(f"data.{k}={data[k]!r} (was {saved[k]!r})" for k in changed)
        fix = " ".join(f"data.{k}={saved[k]}" for k in changed)
        then = f"evaluate it on the run's data: {fix}" if whole else "resume with the run's own data settings"
        return f"was trained with other data: {said}: {then}"
    if model is not None and (other := _other_model(ckpt["state_dict"], model.shapes, model.strict)):
        same_layers = set(ckpt["state_dict"]) == set(model.shapes)  # other sizes: name the settings that give them
        trained = (ckpt.get("hyper_parameters") or {}) if same_layers else {}
        given = model.settings.items()
        was = [f"{name}={trained[k]!r}" for k, (name, value) in given if k in trained and trained[k] != value]
        fix = "give a checkpoint of this model, or the model settings it was trained with"
        return f"holds another model's weights ({other}): {fix}" + (f" ({' '.join(was)})" if was else "")
    if (fit or whole) and "optimizer_states" not in ckpt:
        last = Path(path).parent / "last.ckpt"
        beside = last.name != Path(path).name and "optimizer_states" in (readable(last) or {})
        instead = f"ckpt_path={last}" if beside else "a full checkpoint (its run's checkpoints/last.ckpt)"
        only = "holds the model's weights only (no optimizer_states or callback states: saved with weights_only=True)"
        if not fit:
            return f"{only}, so eval.py cannot restore the run it came from: give {instead}"
        fix = f"continue from {instead}, or load the weights in the model yourself and start without ckpt_path"
        return f"{only}, so a fit cannot continue from it: {fix}"
    return None
