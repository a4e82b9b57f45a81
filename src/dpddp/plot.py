"""``dpddp-plot RUN_OR_SWEEP_DIR [-o OUT.png]``: the curves per epoch as a PNG; exit 2 when there are none."""

from __future__ import annotations

import argparse
from pathlib import Path

from dpddp.errors import fail, shell
from dpddp.report.curves import PLOT_NAME, curves, drawable, write_plot


def main(argv: list[str] | None = None) -> None:
    """Parse ``argv`` (default ``sys.argv[1:]``), write the PNG and print its path."""
    parser = argparse.ArgumentParser(prog="dpddp-plot", description=__doc__)
    parser.add_argument("path", help="a run directory or a sweep directory (with metrics.csv files)")
    parser.add_argument("-o", "--out", default=None, help=f"the PNG to write (default: <path>/{PLOT_NAME})")
    args = parser.parse_args(argv)
    path = Path(args.path)
    with shell(bad_input=(FileNotFoundError,)):  # nothing to plot: exit 2
        if not path.is_dir():
            what = "is not a directory" if path.exists() else "does not exist"
            fail(f"{args.path} {what}: give a run directory or a sweep directory (with metrics.csv files)")
        if not drawable(path):
            curves(path)  # no metrics.csv: its line
            fail(
                f"nothing to plot in {path}: its metrics.csv has no epoch of a fit (an evaluation run's has none): "
                "give a run or sweep directory that trained"
            )
        print(write_plot(path, args.out))


if __name__ == "__main__":
    main()
