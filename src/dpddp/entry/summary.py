"""The sweep summary: a Hydra callback that writes one table of all jobs at the end of a multirun."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback as HydraCallback
from omegaconf import DictConfig, OmegaConf
from typing_extensions import override

from dpddp.run.plot import can_plot, write_plot

__all__ = ["SUMMARY_COLUMNS", "SweepSummary"]

SUMMARY_COLUMNS: tuple[str, ...] = ("job", "overrides", "status", "val/loss", "val/acc", "test/acc")
SUMMARY_COLUMNS += ("samples_per_sec", "world_size", "wall_time_s", "train_time_s", "segments")


def _job_row(job_dir: Path) -> dict[str, Any]:
    """One summary row from a job directory: its ``metrics.json``, or its ``error.txt`` line."""
    overrides_file = job_dir / ".hydra" / "overrides.yaml"
    overrides: Any = OmegaConf.load(overrides_file) if overrides_file.is_file() else []
    row: dict[str, Any] = {"job": job_dir.name, "overrides": " ".join(str(o) for o in overrides)}
    metrics_file, error_file = job_dir / "metrics.json", job_dir / "error.txt"
    if error_file.is_file():
        row["status"] = "failed: " + error_file.read_text().strip()
    elif metrics_file.is_file():
        metrics = json.loads(metrics_file.read_text())
        row.update({k: metrics.get(k) for k in SUMMARY_COLUMNS[3:]}, status="ok")
        if metrics.get("overrides") is not None:  # the invocation that wrote the metrics, not the first one
            row["overrides"] = " ".join(metrics["overrides"])
    else:
        row["status"] = "incomplete"
    return row


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return "" if value is None else str(value).replace("|", "\\|")


class SweepSummary(HydraCallback):
    """Hydra callback: at the end of a multirun, writes ``summary.csv`` and ``summary.md`` at the sweep root,
    one row per job directory (jobs of an earlier, resumed run of the same sweep included; ``wall_time_s``: the
    job's last invocation, ``train_time_s`` and ``segments``: its training over all of them), prints the table,
    writes ``curves.png`` (one colour per job) when matplotlib is installed, and exits with status 1 if any
    job failed or did not finish."""

    @override
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
        if can_plot() and any((p / "metrics.csv").is_file() for p in job_dirs):
            print(f"curves: {write_plot(sweep_dir)}")
        failed = [row["job"] for row in rows if row["status"] != "ok"]
        if failed:
            print(f"error: {len(failed)} of {len(rows)} jobs failed: {', '.join(failed)}", file=sys.stderr)
            sys.exit(1)
