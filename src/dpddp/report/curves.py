"""Loss, accuracy, throughput and memory per epoch from ``metrics.csv``, for a run or a sweep's jobs."""

from __future__ import annotations

import csv
import textwrap
from pathlib import Path

PLOT_NAME = "curves.png"
SERIES = ("train/loss", "val/loss", "val/acc", "samples_per_sec", "peak_mem_mib")
"""The ``metrics.csv`` columns drawn, per epoch of the fit."""


def job_overrides(job_dir: Path) -> list[str]:
    """The command-line overrides of the job in ``job_dir`` (its ``.hydra/overrides.yaml``; none without one)."""
    path = job_dir / ".hydra" / "overrides.yaml"
    text = path.read_text() if path.is_file() else ""
    return [line[2:].strip() for line in text.splitlines() if line.startswith("- ")]


def varying(overrides: list[list[str]]) -> tuple[list[list[str]], list[str]]:
    """Each job's overrides without those every job has (none with fewer than two jobs), and the common ones."""
    if len(overrides) < 2:
        return overrides, []
    common = [o for o in overrides[0] if all(o in other for other in overrides[1:])]
    return [[o for o in job if o not in common] for job in overrides], common


def curves(path: str | Path) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """``{label: {column: [(epoch, value)]}}`` of a run's or sweep's ``metrics.csv`` (``FileNotFoundError``: none)."""
    path = Path(path)
    jobs = (p for p in path.iterdir() if p.is_dir() and p.name.isdigit() and (p / "metrics.csv").is_file())
    runs = [path] if (path / "metrics.csv").is_file() else sorted(jobs, key=lambda p: int(p.name))
    if not runs:
        raise FileNotFoundError(f"no metrics.csv in {path} or in its job directories")
    given = varying([job_overrides(run) for run in runs])[0] if runs != [path] else [[]]  # a run: its name
    found = {}
    for run, job in zip(runs, given, strict=True):
        with open(run / "metrics.csv", newline="") as f:
            rows = [row for row in csv.DictReader(f) if row["stage"] == "fit"]
        series = {k: [(int(r["epoch"]), float(r[k])) for r in rows if r.get(k)] for k in SERIES}
        found[" ".join([run.name, *job])] = series
    return found


def drawable(path: str | Path) -> bool:
    """Whether the run or sweep at ``path`` has epochs of a fit to draw (an evaluation run has none)."""
    try:
        return any(points for series in curves(path).values() for points in series.values())
    except FileNotFoundError:
        return False


def write_plot(path: str | Path, out: str | Path | None = None) -> Path:
    """Draw ``curves(path)`` into a PNG (default ``<path>/curves.png``), one colour per run; return its path."""
    data = curves(path)
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(10, 7), dpi=100)  # no pyplot: no global state, no GUI backend
    (loss_ax, acc_ax), (speed_ax, memory_ax) = fig.subplots(2, 2)
    panels = [("train/loss", loss_ax, "--"), ("val/loss", loss_ax, "-"), ("val/acc", acc_ax, "-")]
    panels += [("samples_per_sec", speed_ax, "-"), ("peak_mem_mib", memory_ax, "-")]
    for i, series in enumerate(data.values()):
        for key, ax, style in panels:
            if series[key]:
                xs, ys = zip(*series[key], strict=True)
                ax.plot(xs, ys, style, color=f"C{i % 10}", marker="." if len(xs) < 3 else None)
    titles = ("loss (train dashed, val solid)", "val/acc", "training samples/s", "peak memory (MiB)")
    last = max((x for series in data.values() for points in series.values() for x, _ in points), default=0)
    for ax, title in zip((loss_ax, acc_ax, speed_ax, memory_ax), titles, strict=True):
        ax.set(xlim=(-0.2, max(last, 1) + 0.2), xlabel="epoch", title=title)  # whole epochs, even for one
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    fig.subplots_adjust(left=0.07, right=0.98, bottom=0.08, top=0.95, hspace=0.3, wspace=0.2)  # tight_layout: 2x
    if len(data) > 1:  # one run: its lines need no names
        labels = [textwrap.fill(label, 60) for label in data]
        handles = [Line2D([], [], color=f"C{i % 10}") for i in range(len(labels))]
        columns = 1 if max(len(label) for label in data) > 40 else min(len(labels), 3)
        fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=columns, fontsize="small")
    target = Path(out) if out is not None else Path(path) / PLOT_NAME
    fig.savefig(target, bbox_inches="tight" if len(data) > 1 else None)  # the PNG grows to hold the legend
    return target
