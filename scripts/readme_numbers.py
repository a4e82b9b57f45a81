"""Print the figures the README quotes about a default run on this machine: which torch build is installed and its
size on disk, the wall time, peak memory (RSS) and training samples/s of ``python train.py`` with and without
``OMP_NUM_THREADS=1``; with ``--tests``, the wall time of the unit tests (``python -m pytest -m "not slow"``).

    python scripts/readme_numbers.py [--reps 3] [--tests]

Each run is a fresh ``python train.py`` (the default config) in a temporary directory; its wall time is from
start to exit (imports included), peak RSS the process's own ``ru_maxrss`` (``os.wait4``), samples/s the run's
``metrics.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from importlib.metadata import distributions
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def torch_build() -> tuple[str, float]:
    """The installed torch version (``+cpu`` for the CPU build) and the GiB on disk of torch and the NVIDIA
    packages the CUDA build pulls in."""
    import torch

    total = 0
    for dist in distributions():
        name = (dist.metadata["Name"] or "").lower()
        if name == "torch" or name.startswith(("nvidia-", "triton")):
            total += sum((f.size or 0) for f in dist.files or [])
    return torch.__version__, total / 2**30


def default_run(threads: str | None) -> tuple[float, float, float]:
    """One ``python train.py``: (peak RSS in MiB, training samples/s, wall seconds from start to exit)."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if threads is not None:
        env["OMP_NUM_THREADS"] = threads
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, str(ROOT / "train.py"), "hydra.run.dir=run"]
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, cwd=tmp, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - start
        if status != 0:
            raise SystemExit(f"python train.py failed (status {status})")
        metrics = json.loads((Path(tmp) / "run" / "metrics.json").read_text())
    return usage.ru_maxrss / 1024, metrics["samples_per_sec"], wall


def unit_tests() -> float:
    """Wall seconds of the README's unit-test command, ``python -m pytest -m "not slow"``, in the checkout."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-m", "not slow", "-q"], cwd=ROOT, capture_output=True)
    if proc.returncode != 0:
        raise SystemExit(f"the unit tests failed (status {proc.returncode}):\n{proc.stdout.decode()[-3000:]}")
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--tests", action="store_true", help='also time python -m pytest -m "not slow"')
    args = parser.parse_args()
    version, gib = torch_build()
    print(f"torch {version}: {gib:.2f} GiB on disk (torch, nvidia-*, triton)")
    for threads in ("1", None):
        runs = [default_run(threads) for _ in range(args.reps)]
        rss = [r for r, _, _ in runs]
        speed = sorted(s for _, s, _ in runs)
        wall = sorted(w for _, _, w in runs)
        label = f"OMP_NUM_THREADS={threads}" if threads else "OMP_NUM_THREADS unset"
        print(
            f"python train.py, {label}, {args.reps} runs: {wall[0]:.1f}-{wall[-1]:.1f} s wall time (median "
            f"{statistics.median(wall):.1f}), peak RSS {statistics.median(rss):.0f} MiB (median), "
            f"{speed[0]:,.0f}-{speed[-1]:,.0f} samples/s (median {statistics.median(speed):,.0f})"
        )
    if args.tests:
        print(f'python -m pytest -m "not slow": {unit_tests():.0f} s wall time ({os.cpu_count()} cores)')


if __name__ == "__main__":
    main()
