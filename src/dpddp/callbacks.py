"""Callbacks: training throughput (Lightning) and the sweep summary (Hydra)."""

from __future__ import annotations

import csv
import json
import sys
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from hydra.experimental.callback import Callback as HydraCallback
from omegaconf import DictConfig, OmegaConf

__all__ = ["SweepSummary", "Throughput"]


class Throughput(pl.Callback):
    """Steady-state training throughput in samples/s over all processes.

    Counts the intervals between consecutive ``on_train_batch_end`` calls within an epoch (so data loading and
    the step are in, while start-up, the first step of each epoch and validation are out), each worth one
    global batch (``datamodule.batch_size`` samples). With a single step per epoch it falls back to the step
    times alone. Cheap: one ``time.perf_counter()`` per step, no sync.
    """

    def __init__(self) -> None:
        self.samples = 0
        self.seconds = 0.0
        self.fallback = [0, 0.0]
        self._last: float | None = None
        self._batch_start = 0.0

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last = None

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._batch_start = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        now = time.perf_counter()
        batch = trainer.datamodule.batch_size
        if self._last is not None:
            self.samples += batch
            self.seconds += now - self._last
        self.fallback[0] += batch
        self.fallback[1] += now - self._batch_start
        self._last = now

    @property
    def samples_per_sec(self) -> float:
        """Samples per second (``nan`` before any step)."""
        samples, seconds = (self.samples, self.seconds) if self.samples else self.fallback
        return samples / seconds if seconds > 0 else float("nan")


SUMMARY_COLUMNS = ("job", "overrides", "status", "val/loss", "val/acc", "test/acc", "samples_per_sec", "world_size")
SUMMARY_COLUMNS += ("wall_time_s",)


def _job_row(job_dir: Path) -> dict[str, Any]:
    """One summary row from a job directory: its ``metrics.json``, or its ``error.txt`` line."""
    overrides_file = job_dir / ".hydra" / "overrides.yaml"
    overrides = OmegaConf.to_container(OmegaConf.load(overrides_file)) if overrides_file.is_file() else []
    row: dict[str, Any] = {"job": job_dir.name, "overrides": " ".join(overrides)}
    metrics_file, error_file = job_dir / "metrics.json", job_dir / "error.txt"
    if error_file.is_file():
        row["status"] = "failed: " + error_file.read_text().strip()
    elif metrics_file.is_file():
        metrics = json.loads(metrics_file.read_text())
        row.update({k: metrics.get(k) for k in SUMMARY_COLUMNS[3:]}, status="ok")
    else:
        row["status"] = "incomplete"
    return row


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return "" if value is None else str(value).replace("|", "\\|")


class SweepSummary(HydraCallback):
    """Hydra callback: at the end of a multirun, writes ``summary.csv`` and ``summary.md`` at the sweep root,
    one row per job directory (jobs of an earlier, resumed run of the same sweep included), prints the table,
    and exits with status 1 if any job failed or did not finish."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        job_dirs = sorted(
            (p for p in sweep_dir.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name)
        )
        rows = [_job_row(p) for p in job_dirs]
        with open(sweep_dir / "summary.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=SUMMARY_COLUMNS)
            writer.writeheader()
            writer.writerows(rows)
        lines = ["| " + " | ".join(SUMMARY_COLUMNS) + " |", "|" + " --- |" * len(SUMMARY_COLUMNS)]
        lines += ["| " + " | ".join(_cell(row.get(c)) for c in SUMMARY_COLUMNS) + " |" for row in rows]
        table = "\n".join(lines) + "\n"
        (sweep_dir / "summary.md").write_text(table)
        print(f"\nsweep summary ({sweep_dir / 'summary.md'}):\n{table}")
        failed = [row["job"] for row in rows if row["status"] != "ok"]
        if failed:
            print(f"error: {len(failed)} of {len(rows)} jobs failed: {', '.join(failed)}", file=sys.stderr)
            sys.exit(1)
