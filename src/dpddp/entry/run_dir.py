"""One run's directory rules, decided before Hydra writes into the directory (``StartChecks``) and again in the
job (``run_job``): whether the job continues what the directory holds, and when it must not start there."""

from __future__ import annotations

import json
import re
from pathlib import Path

from omegaconf import DictConfig

from dpddp.cluster import launch_id
from dpddp.continuity.io import checkpoint_launch
from dpddp.parallel.rendezvous import torchrun_restarted
from dpddp.run.training import METRIC_KEYS

__all__ = ["completed_metrics", "continues", "directory_problem", "hydra_value"]


def completed_metrics(output_dir: Path) -> dict | None:
    """The job's ``metrics.json`` if it holds every metric key and its predict (if any) did not fail, else
    ``None``."""
    path = output_dir / "metrics.json"
    try:
        metrics = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return metrics if all(k in metrics for k in METRIC_KEYS) and not metrics.get("predict_error") else None


def hydra_value(value: str) -> str:
    """``value`` written so that Hydra's override parser reads it back unchanged, as a string: as it is when it
    is a plain path (letters, digits, ``_ . / : + -`` and at least one ``/``), else single-quoted with its quotes
    and the backslashes before them escaped (Hydra 1.3's grammar for quoted values). Shell quoting comes on top
    (``shlex.join``)."""
    if "/" in value and re.fullmatch(r"[A-Za-z0-9_./:+-]+", value):  # a path: never read as a number or a bool
        return value
    # backslashes before a quote, or before the closing quote, are doubled; each quote gets one
    return (
        "'" + re.sub(r"(\\*)('|$)", lambda m: m.group(1) * 2 + ("\\" + m.group(2) if m.group(2) else ""), value) + "'"
    )


def continues(cfg: DictConfig, output_dir: Path, multirun: bool) -> bool:
    """Whether the job continues the run in ``output_dir``: a sweep job, ``resume=true``, or a launcher's (re)start
    of its own job (same directory: ``cluster.run_name``; its ``last.ckpt`` names the job): torchrun
    ``--max-restarts``, a membership change, a SLURM requeue, a pod restart."""
    last = output_dir / "checkpoints" / "last.ckpt"
    job = launch_id()
    own = job is not None and last.is_file() and checkpoint_launch(last) == job
    return bool(multirun or cfg.get("resume") or own or torchrun_restarted())


def directory_problem(cfg: DictConfig, output_dir: Path, resume: bool, named: bool, ckpt: str | None) -> str | None:
    """Why one run must not start in ``output_dir`` (one line ending with what to do), or ``None``: ``resume=true``
    without a directory named for it (``named``: ``hydra.run.dir`` given, or a cluster job's own name), or a
    directory holding another run (its ``last.ckpt`` or ``metrics.json``) that this one neither continues
    (``resume``) nor starts from (``ckpt``: its ``ckpt_path``, absolute): it would be overwritten."""
    if cfg.get("resume") and not named:
        return (
            "resume=true needs the run to resume: add hydra.run.dir=<its directory> (e.g. "
            "hydra.run.dir=outputs/2026-01-31/12-00-00)"
        )
    last = output_dir / "checkpoints" / "last.ckpt"
    held = [p.name for p in (last, output_dir / "metrics.json") if p.is_file()]
    if held and not resume and ckpt != str(last):
        return (
            f"the run directory {hydra_value(str(output_dir))} holds another run ({', '.join(held)}): "
            "continue it with resume=true, or give this run its own directory (hydra.run.dir=..., or "
            "torchrun --rdzv-id=<job id>)"
        )
    return None
