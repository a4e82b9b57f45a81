"""Loss and accuracy against epoch from ``metrics.csv``: one run, or one line per job of a sweep.

matplotlib is an optional extra (``pip install "dpddp[plot]"``) and is imported only inside ``write_plot``, so
that importing this module (which every run does) stays free."""

from __future__ import annotations

import csv
import importlib.util
from pathlib import Path

__all__ = ["PLOT_NAME", "can_plot", "curves", "write_plot"]

PLOT_NAME = "curves.png"


def can_plot() -> bool:
    """Whether matplotlib is installed."""
    return importlib.util.find_spec("matplotlib") is not None


def curves(path: str | Path) -> dict[str, dict[str, list[tuple[int, float]]]]:
    """The ``fit`` rows of the ``metrics.csv`` under ``path``: ``{label: {column: [(epoch, value), ...]}}`` for
    ``train/loss``, ``val/loss`` and ``val/acc``. ``path`` is a run directory (label: its name) or a sweep
    directory (one label per numbered job directory that has a ``metrics.csv``: ``"<job> <overrides>"``).

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
    found = {}
    for run in runs:
        series: dict[str, list[tuple[int, float]]] = {"train/loss": [], "val/loss": [], "val/acc": []}
        with open(run / "metrics.csv", newline="") as f:
            for row in csv.DictReader(f):
                if row["stage"] != "fit":
                    continue
                for key, points in series.items():
                    if row.get(key):
                        points.append((int(row["epoch"]), float(row[key])))
        found[_label(run, path)] = series
    return found


def _label(run: Path, root: Path) -> str:
    if run == root:
        return run.name
    overrides = run / ".hydra" / "overrides.yaml"
    text = overrides.read_text() if overrides.is_file() else ""
    given = " ".join(line[2:].strip() for line in text.splitlines() if line.startswith("- "))
    return f"{run.name} {given}".strip()


def write_plot(path: str | Path, out: str | Path | None = None) -> Path:
    """Draw loss (train dashed, validation solid) and validation accuracy against epoch for the run or sweep
    at ``path`` (see ``curves``) into a PNG; one colour per run. Returns the PNG's path (default
    ``<path>/curves.png``).

    Raises:
        FileNotFoundError: see ``curves``.
        ModuleNotFoundError: matplotlib is not installed (``pip install "dpddp[plot]"``).
    """
    data = curves(path)
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(10, 4), dpi=100)
    FigureCanvasAgg(fig)
    loss_ax, acc_ax = fig.subplots(1, 2)
    for i, (label, series) in enumerate(data.items()):
        colour = f"C{i % 10}"
        for key, style in (("train/loss", "--"), ("val/loss", "-")):
            if series[key]:
                xs, ys = zip(*series[key], strict=True)
                loss_ax.plot(xs, ys, style, color=colour, label=f"{label} {key}")
        if series["val/acc"]:
            xs, ys = zip(*series["val/acc"], strict=True)
            acc_ax.plot(xs, ys, "-", color=colour, label=label)
    for ax, title in ((loss_ax, "loss (train dashed, val solid)"), (acc_ax, "val/acc")):
        ax.set_xlabel("epoch")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_title(title)
        ax.grid(alpha=0.3)
    if acc_ax.lines:  # no validation ran: no legend (matplotlib warns about an empty one)
        acc_ax.legend(fontsize="small")
    fig.tight_layout()
    target = Path(out) if out is not None else Path(path) / PLOT_NAME
    fig.savefig(target)
    return target
