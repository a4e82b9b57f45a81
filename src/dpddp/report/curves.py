"""Loss and accuracy against epoch from ``metrics.csv``: one run, or one line per job of a sweep.

matplotlib is an optional extra (``pip install "dpddp[plot]"``) and is imported only inside ``write_plot``, so
that importing this module (which every run does) stays free."""

from __future__ import annotations

import csv
import importlib.util
import textwrap
from pathlib import Path

__all__ = ["PLOT_NAME", "can_plot", "curves", "job_overrides", "varying", "write_plot"]

PLOT_NAME = "curves.png"


def can_plot() -> bool:
    """Whether matplotlib is installed."""
    return importlib.util.find_spec("matplotlib") is not None


def job_overrides(job_dir: Path) -> list[str]:
    """The command-line overrides of the job in ``job_dir`` (its ``.hydra/overrides.yaml``; none without one)."""
    path = job_dir / ".hydra" / "overrides.yaml"
    text = path.read_text() if path.is_file() else ""
    return [line[2:].strip() for line in text.splitlines() if line.startswith("- ")]


def varying(overrides: list[list[str]]) -> tuple[list[list[str]], list[str]]:
    """Each job's overrides without those every job has, and those common ones (with fewer than two jobs nothing
    is common): what tells a sweep's jobs apart."""
    if len(overrides) < 2:
        return overrides, []
    common = [o for o in overrides[0] if all(o in other for other in overrides[1:])]
    return [[o for o in job if o not in common] for job in overrides], common


def curves(path: str | Path) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """The ``fit`` rows of the ``metrics.csv`` under ``path``: ``{label: {column: [(epoch, value), ...]}}`` for
    ``train/loss``, ``val/loss`` and ``val/acc``. ``path`` is a run directory (label: its name) or a sweep
    directory (one label per numbered job directory that has a ``metrics.csv``: ``"<job> <overrides>"``, only the
    overrides that differ between those jobs: ``varying``).

    Raises:
        FileNotFoundError: no ``metrics.csv`` in ``path`` or in a job directory under it.
    """
    path = Path(path)
    runs = [path] if (path / "metrics.csv").is_file() else sorted(
        (p for p in path.iterdir() if p.is_dir() and p.name.isdigit() and (p / "metrics.csv").is_file()),
        key=lambda p: int(p.name),
    )  # fmt: skip
    if not runs:
        raise FileNotFoundError(f"no metrics.csv in {path} or in its job directories")
    labels = [path.name]
    if runs != [path]:
        given, _ = varying([job_overrides(run) for run in runs])
        labels = [" ".join([run.name, *job]) for run, job in zip(runs, given, strict=True)]
    found = {}
    for run, label in zip(runs, labels, strict=True):
        series: dict[str, list[tuple[int, float]]] = {"train/loss": [], "val/loss": [], "val/acc": []}
        with open(run / "metrics.csv", newline="") as f:
            for row in csv.DictReader(f):
                if row["stage"] != "fit":
                    continue
                for key, points in series.items():
                    if row.get(key):
                        points.append((int(row["epoch"]), float(row[key])))
        found[label] = series
    return found


def write_plot(path: str | Path, out: str | Path | None = None) -> Path:
    """Draw loss (train dashed, validation solid) and validation accuracy against epoch (from 0, as
    ``metrics.csv``) for the run or sweep at ``path`` (see ``curves``) into a PNG; one colour per run, named in
    one legend under the plots (several runs), which the PNG grows to hold. Returns the PNG's path (default
    ``<path>/curves.png``).

    Raises:
        FileNotFoundError: see ``curves``.
        ModuleNotFoundError: matplotlib is not installed (``pip install "dpddp[plot]"``).
    """
    data = curves(path)
    if not can_plot():
        raise ModuleNotFoundError('matplotlib is not installed: pip install "dpddp[plot]"', name="matplotlib")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(10, 4), dpi=100)
    FigureCanvasAgg(fig)
    loss_ax, acc_ax = fig.subplots(1, 2)
    for i, series in enumerate(data.values()):
        colour = f"C{i % 10}"
        for key, style in (("train/loss", "--"), ("val/loss", "-")):
            if series[key]:
                xs, ys = zip(*series[key], strict=True)
                loss_ax.plot(xs, ys, style, color=colour)
        if series["val/acc"]:
            xs, ys = zip(*series["val/acc"], strict=True)
            acc_ax.plot(xs, ys, "-", color=colour)
    for ax, title in ((loss_ax, "loss (train dashed, val solid)"), (acc_ax, "val/acc")):
        ax.set_xlabel("epoch")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(title)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    if len(data) > 1:  # one run: its lines need no names
        labels = [textwrap.fill(label, 60) for label in data]
        handles = [Line2D([], [], color=f"C{i % 10}") for i in range(len(labels))]
        columns = 1 if max(len(label) for label in data) > 40 else min(len(labels), 3)
        fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=columns, fontsize="small")
    target = Path(out) if out is not None else Path(path) / PLOT_NAME
    fig.savefig(target, bbox_inches="tight")  # the PNG holds the legend under the plots, whatever its size
    return target
