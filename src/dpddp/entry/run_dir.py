"""One run's directory rules: whether the job continues what the directory holds, and when it must not start."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from dpddp.cluster import launch_id
from dpddp.continuity.io import CheckpointFacts
from dpddp.parallel.peers import torchrun_restarted
from dpddp.run.training import METRIC_KEYS

# The overrides (and sub-keys) that say what a run trains; of those a continue may change the limits and the bar.
WEIGHTS = ("model", "data", "trainer", "seed")
LIMITS = ("max_epochs", "max_steps", "max_time")
CONTINUE_MAY_CHANGE = (*(f"trainer.{k}" for k in LIMITS), "trainer.enable_progress_bar")


def completed_metrics(output_dir: Path) -> dict | None:
    """The job's ``metrics.json`` if it holds every metric key and no predict error, else ``None``."""
    path = output_dir / "metrics.json"
    try:
        metrics = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return metrics if all(k in metrics for k in METRIC_KEYS) and not metrics.get("predict_error") else None


def hydra_value(value: str) -> str:
    """``value`` as Hydra 1.3's override parser reads it back, as a string: a plain path as it is, else quoted."""
    if "/" in value and re.fullmatch(r"[A-Za-z0-9_./:+-]+", value):  # a path: never read as a number or a bool
        return value
    # backslashes before a quote, or before the closing quote, are doubled; each quote gets one
    escaped = re.sub(r"(\\*)('|$)", lambda m: m.group(1) * 2 + ("\\" + m.group(2) if m.group(2) else ""), value)
    return f"'{escaped}'"


def reached_limit(trainer: DictConfig, last: CheckpointFacts) -> str | None:
    """The limit of ``trainer`` that the checkpoint ``last`` has reached (``trainer.max_epochs=40``), else ``None``."""
    epochs, steps = trainer.get("max_epochs"), trainer.get("max_steps")
    if epochs not in (None, -1) and last.epochs_done is not None and last.epochs_done >= epochs:
        return f"trainer.max_epochs={epochs}"
    if steps not in (None, -1) and last.global_step >= steps:
        return f"trainer.max_steps={steps}"
    return None


def continues(cfg: DictConfig, multirun: bool, last: CheckpointFacts) -> bool:
    """Whether the job continues ``last``'s run: a sweep job, ``resume=true``, or a launcher's restart of it."""
    own = (job := launch_id()) is not None and last.launch == job
    return bool(multirun or cfg.get("resume") or own or torchrun_restarted())


def directory_problem(cfg: DictConfig, output_dir: Path, resume: bool, named: bool, ckpt: str | None) -> str | None:
    """Why one run must not start in ``output_dir`` (another run's, or ``resume=true`` unnamed), or ``None``."""
    if cfg.get("resume") and not named:
        fix = "add hydra.run.dir=<its directory> (e.g. hydra.run.dir=outputs/2026-01-31/12-00-00)"
        return f"resume=true needs the run to resume: {fix}"
    last = output_dir / "checkpoints" / "last.ckpt"
    held = [p.name for p in (last, output_dir / "metrics.json") if p.is_file()]
    if held and not resume and ckpt != str(last):
        held_by = f"the run directory {hydra_value(str(output_dir))} holds another run ({', '.join(held)})"
        fix = "give this run its own directory (hydra.run.dir=..., or torchrun --rdzv-id=<job id>)"
        return f"{held_by}: continue it with resume=true, or {fix}"
    return None


def _settings(overrides: Iterable) -> dict[str, str]:
    """``key: value`` of the overrides under ``WEIGHTS`` but not ``CONTINUE_MAY_CHANGE`` (a deletion's: ``~``)."""
    found = {}
    for override in overrides:
        key, sep, value = str(override).partition("=")
        parts = key.lstrip("+~").split(".")
        if parts[0] in WEIGHTS and ".".join(parts[:2]) not in CONTINUE_MAY_CHANGE and parts != ["trainer"]:
            found[".".join(parts)] = value if sep and not key.startswith("~") else "~"
    return found


def _first_apart(before: Iterable, now: list[str]) -> str | None:
    old, new = _settings(before), _settings(now)
    for key in [*new, *(k for k in old if k not in new)]:
        if old.get(key) != new.get(key):
            had = f"{key}={old[key]}" if key in old else f"the config's {key}"
            return f"{key}={new[key]} where it had {had}" if key in new else f"the config's {key} where it had {had}"
    return None


def other_run(output_dir: Path, overrides: list[str], first: Path | None) -> str | None:
    """The first of ``WEIGHTS`` where ``overrides`` differ from the run in ``output_dir`` (``first``), or ``None``."""
    typed = first / "overrides.yaml" if first is not None else None
    if typed is None or not typed.is_file() or not (apart := _first_apart(OmegaConf.load(typed), overrides)):
        return None
    where = hydra_value(str(output_dir))
    why = f"this one gives {apart}, and a continue changes no setting of its model, data, Trainer or seed but a limit"
    fix = f"give this run its own directory (hydra.run.dir={where}-2)"
    return f"the run directory {where} holds a run with other settings: {why}: {fix}"


def other_sweep(sweep_dir: Path, overrides: list[str]) -> str | None:
    """``other_run``'s line for a sweep given ``overrides`` and the jobs of the sweep in ``sweep_dir``."""
    record = sweep_dir / "multirun.yaml"
    held = any(sweep_dir.glob("*/checkpoints/last.ckpt")) or any(sweep_dir.glob("*/metrics.json"))
    given = OmegaConf.load(record).hydra.overrides.task if record.is_file() and held else None
    if given is None or not (apart := _first_apart(given, overrides)):
        return None
    where = hydra_value(str(sweep_dir))
    why = f"this one gives {apart}, and a job continues only with its own model, data, Trainer and seed settings"
    fix = f"give this sweep its own directory (hydra.sweep.dir={where}-2)"
    return f"hydra.sweep.dir={where} holds the jobs of a sweep with other settings: {why} (a limit aside): {fix}"
