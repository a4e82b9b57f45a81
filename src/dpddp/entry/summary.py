"""The sweep summary (one table of all jobs at a multirun's end) and the end of a sweep stopped by SIGTERM."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback as HydraCallback
from omegaconf import DictConfig
from typing_extensions import override

from dpddp._compat import HYDRA_BASIC_LAUNCHER
from dpddp.continuity import stop as sweep_stop
from dpddp.entry.hydra import sweep_resume_command
from dpddp.errors import EXIT_CRASH, EXIT_PREEMPTED, fail
from dpddp.report.curves import job_overrides, varying, write_plot

# The launchers whose jobs run under the sweep's process: a SIGTERM stops their sweep as one.
LOCAL_LAUNCHERS = (
    HYDRA_BASIC_LAUNCHER,
    "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher",
    "hydra_plugins.hydra_submitit_launcher.submitit_launcher.LocalLauncher",
)

SUMMARY_COLUMNS: tuple[str, ...] = ("job", "overrides", "status", "val/loss", "val/acc", "test/acc")
SUMMARY_COLUMNS += ("samples_per_sec", "world_size", "wall_time_s", "train_time_s", "segments")


def _job_row(job_dir: Path) -> dict[str, Any]:
    """One summary row from a job directory: its ``metrics.json`` (and objective), or its ``error.txt`` line."""
    row: dict[str, Any] = {"job": job_dir.name, "overrides": job_overrides(job_dir)}
    metrics_file, error_file = job_dir / "metrics.json", job_dir / "error.txt"
    metrics = json.loads(metrics_file.read_text()) if metrics_file.is_file() else None
    if error_file.is_file():
        row["status"] = "failed: " + error_file.read_text().strip()
    elif metrics is not None:
        row["status"] = "ok"
    elif (job_dir / "checkpoints" / "last.ckpt").is_file():
        row["status"] = "incomplete: resumes from checkpoints/last.ckpt"
    else:
        row["status"] = "not started"
    if metrics is not None and (row["status"] == "ok" or metrics.get("predict_error")):  # a failed predict: the
        row.update({k: metrics.get(k) for k in SUMMARY_COLUMNS[3:]})  # fit's and test's metrics stand beside it
        if metrics.get("objective"):  # a name of the user's (callbacks.model_checkpoint.monitor=val_loss)
            row[metrics["objective"]] = metrics.get(metrics["objective"])
        if metrics.get("overrides") is not None:  # the invocation that wrote the metrics, not the first one
            row["overrides"] = list(metrics["overrides"])
    return row


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return "" if value is None else str(value).replace("|", "\\|")


def objective_of(config: DictConfig) -> tuple[str, bool]:
    """The metric a sweep's jobs return and whether higher is better (``direction``, else the checkpoint's mode)."""
    name = str(config.get("objective") or "val/loss")
    direction = config.hydra.sweeper.get("direction") if "hydra" in config else None
    if isinstance(direction, str):
        return name, direction == "maximize"
    mode = ((config.get("callbacks") or {}).get("model_checkpoint") or {}).get("mode")
    return name, mode == "max"


def best_row(rows: list[dict[str, Any]], objective: tuple[str, bool]) -> dict[str, Any] | None:
    """The finished row with the best finite ``objective`` (the first of equals), or ``None``."""
    name, maximize = objective
    scored = [r for r in rows if r["status"] == "ok" and isinstance(r.get(name), (int, float)) and r[name] == r[name]]
    if not scored:
        return None
    return (max if maximize else min)(scored, key=lambda r: r[name])


def write_summary(sweep_dir: Path, objective: tuple[str, bool] = ("val/loss", False)) -> list[dict[str, Any]]:
    """Write ``summary.csv`` and ``summary.md`` (a row per job directory: the overrides that differ, a ``best``
    column by ``objective``), print the table, draw ``curves.png``; return the rows."""
    job_dirs = sorted((p for p in sweep_dir.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))
    rows = [_job_row(p) for p in job_dirs]
    best = best_row(rows, objective)
    for row in rows:
        row["best"] = row is best
    given, common = varying([row["overrides"] for row in rows])
    for row, job in zip(rows, given, strict=True):
        row["overrides"] = " ".join(job)
    columns = [*SUMMARY_COLUMNS, *dict.fromkeys(k for row in rows for k in row if k not in SUMMARY_COLUMNS)]
    with open(sweep_dir / "summary.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    marked = [{**row, "best": "best" if row["best"] else ""} for row in rows]
    lines += ["| " + " | ".join(_cell(row.get(c)) for c in columns) + " |" for row in marked]
    if common:
        lines = [f"overrides of every job: {' '.join(common)}", "", *lines]
    table = "\n".join(lines) + "\n"
    (sweep_dir / "summary.md").write_text(table)
    print(f"\nsweep summary ({sweep_dir / 'summary.md'}):\n{table}")
    if best is not None:
        name, maximize = objective
        print(f"best: job {best['job']} ({name}={_cell(best[name])}, the {'highest' if maximize else 'lowest'})")
    if any((p / "metrics.csv").is_file() for p in job_dirs):
        print(f"curves: {write_plot(sweep_dir)}")
    return rows


def end_sweep(sweep_dir: Path, cut_short: bool = False, objective: tuple[str, bool] = ("val/loss", False)) -> None:
    """Write the summary; exit 143 with the resume command if SIGTERM stopped the sweep before every job finished
    (``cut_short``: more jobs were to launch), or 1 with one line if a job failed or did not finish."""
    rows = write_summary(sweep_dir, objective)
    stopped = sweep_stop.active() and sweep_stop.requested()
    sweep_stop.clear()
    unfinished = [row["job"] for row in rows if row["status"] != "ok" and not row["status"].startswith("failed")]
    if stopped and (unfinished or cut_short):
        jobs: dict[str, list[str]] = {}
        for row in rows:
            jobs.setdefault(row["status"].split(":")[0], []).append(row["job"])
        kinds = (("incomplete", "stopped with a checkpoint"), ("not started", "not started"), ("failed", "failed"))
        parts = [f"{len(jobs.get('ok', []))} of {len(rows)} jobs finished"]
        parts += [f"{what}: {_jobs(jobs[key])}" for key, what in kinds if key in jobs]
        command = sweep_resume_command(sweep_dir)
        fail(f"the sweep was stopped by SIGTERM ({'; '.join(parts)}): resume with {command}", EXIT_PREEMPTED)
    failed = [row["job"] for row in rows if row["status"] != "ok"]
    if failed:
        fail(f"{len(failed)} of {len(rows)} jobs failed: {_jobs(failed)}", EXIT_CRASH)


def _jobs(names: list[str]) -> str:
    """``job 3`` or ``jobs 1, 2``: job numbers that do not read as counts."""
    return f"job {names[0]}" if len(names) == 1 else f"jobs {', '.join(names)}"


class SweepSummary(HydraCallback):
    """Hydra callback: a SIGTERM stops a ``LOCAL_LAUNCHERS`` sweep as one; at its end, ``end_sweep``."""

    @override
    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        if config.hydra.launcher.get("_target_") in LOCAL_LAUNCHERS:
            sweep_stop.start(Path(config.hydra.sweep.dir))

    @override
    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        end_sweep(Path(config.hydra.sweep.dir), objective=objective_of(config))
