"""dpddp on one GPU machine: first the checks of its promises one lent machine can show (``bench/gpu_checks.py``:
one GPU against CPU, dp on one device, ddp with 2 ranks sharing one GPU over gloo, bf16-mixed and 16-mixed within
the 16-bit tolerance, a 16-mixed stop continued exactly, peak GPU memory per process; with 2 or more GPUs dp and
ddp over NCCL), then one GPU, ``strategy=dp`` over all GPUs and ``strategy=ddp`` over all GPUs against plain
PyTorch: docs/performance.md's "DP or DDP" table, measured.

Each run is a fresh subprocess measured like ``bench/run.py`` does (samples/s in steady state, whole wall time
and start to first step in s, peak RSS of one process in MiB): the project lean (``python train.py
accelerator=gpu`` with ``strategy=auto``, ``strategy=dp devices=N`` or ``strategy=ddp devices=N``, logger,
checkpoints, progress bar and sanity validation off) and ``bench/plain.py`` (``single --device cuda``, ``dp``,
``ddp --device cuda`` with nccl), alternating. The workload is W2 of ``bench/run.py`` (262,144 samples x 1024
features -> 10 classes, one epoch), with the global batch the largest multiple of the GPU count up to 1024.
One warm-up run (CUDA and file caches, not counted), then rounds of every strategy and side until ``--reps``
rounds are done or ``--budget-s`` seconds have passed (no run starts after that; each run is killed after
``--run-timeout-s``): under 5 minutes in all. A run that fails leaves its cells empty and the others go on
(its log tail is in ``gpu.json``).

Every run lists the checks first, with the GPUs each needs; a check this machine cannot run is reported as not
run. ``--checks-only`` skips the throughput table. Exit status 1 when a check fails.

``--dry-run``: the checks on CPU, then the same throughput code path on CPU at tiny sizes (``accelerator=cpu``:
one process for each side, ddp on 2 processes for dpddp; dp on one CPU is the checks' ``dp1`` run), for
``tests/test_bench.py``.

Writes ``GPU.md`` (the table) and ``gpu.json`` (every run) into ``--out`` (default ``bench/``).

Usage: ``python bench/gpu.py [--reps 2] [--budget-s 200] [--run-timeout-s 90] [--checks-only] [--dry-run]
[--out DIR]``
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import gpu_checks
import run as bench  # bench/run.py: this script's own directory is on sys.path

SIZES = (262144, 1024, 10, 1024)  # W2: (num_samples, num_features, num_classes, global batch up to)
DRY_SIZES = (2048, 16, 4, 64)
ROWS = [  # (metric key, label, unit scale)
    ("samples_per_sec", "samples/s (steady state)", 1.0),
    ("wall_s", "whole wall time (s)", 1.0),
    ("start_to_first_step_s", "start to first step (s)", 1.0),
    ("peak_rss_bytes", "peak RSS of one process (MiB)", 1 / 2**20),
]
MACHINE_CODE = """import json, torch
n = torch.cuda.device_count() if torch.cuda.is_available() else 0
print(json.dumps({"gpus": n, "name": torch.cuda.get_device_name(0) if n else None, "torch": torch.__version__,
                  "cuda": torch.version.cuda}))"""


def machine() -> dict[str, Any]:
    """The GPU count and name, torch and CUDA versions, asked of a child (this process does not import torch)."""
    out = subprocess.run([sys.executable, "-c", MACHINE_CODE], capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def plan(gpus: int, dry_run: bool) -> list[tuple[str, str, int, list[str]]]:
    """``(column label, mode, devices, sides)`` per strategy: one device, dp over all, ddp over all."""
    if dry_run:  # CPU: dp on one CPU is the checks' dp1 run; plain's ddp command is bench/run.py's (test_bench_quick)
        return [
            ("one CPU process", "single", 1, ["project", "plain"]),
            ("`strategy=ddp` (2 CPU processes)", "ddp", 2, ["project"]),
        ]
    return [
        ("one GPU", "single", 1, ["project", "plain"]),
        (f"`strategy=dp` ({gpus} GPUs, 1 process)", "dp", gpus, ["project", "plain"]),
        (f"`strategy=ddp` ({gpus} GPUs, {gpus} processes)", "ddp", gpus, ["project", "plain"]),
    ]


def run_one(
    side: str, sizes: tuple[int, ...], mode: str, devices: int, dry_run: bool, env: dict[str, str], timeout_s: float
) -> dict[str, Any]:
    """One fresh subprocess of the project or plain PyTorch, measured by ``bench.measure``."""
    tmp = Path(tempfile.mkdtemp(prefix="dpddp-gpu-"))
    try:
        if side == "plain":
            result_file = tmp / "plain.json"
            options = [] if dry_run or mode == "dp" else ["--device", "cuda"]
            cmd = bench.peer_cmd("plain", sizes, mode, devices, result_file, *options)
        else:
            result_file = tmp / "run" / "metrics.json"
            accelerator = "cpu" if dry_run else "gpu"
            cmd = bench.project_cmd(sizes, mode, devices, tmp / "run", False, [], accelerator)
        return bench.measure(cmd, result_file, tmp / "log.txt", env, timeout_s)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run_all(args: argparse.Namespace, gpus: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The runs (a warm-up as ``rep`` -1 unless ``--dry-run``, then rounds) and the failures, in order."""
    env = {k: v for k, v in os.environ.items() if k not in bench.RANK_VARS}
    deadline = time.monotonic() + args.budget_s
    runs, failed = [], []
    steps = [("project", "single", 1, -1, "warm-up")] if not args.dry_run else []
    for rep in range(args.reps):
        steps += [(side, mode, n, rep, label) for label, mode, n, sides in plan(gpus, args.dry_run) for side in sides]
    for side, mode, devices, rep, label in steps:
        if time.monotonic() > deadline:
            print(f"budget of {args.budget_s:g} s spent: stopping before round {rep}", flush=True)
            break
        try:
            record = run_one(side, args.sizes, mode, devices, args.dry_run, env, args.run_timeout_s)
        except RuntimeError as err:
            print(f"{label} {side} rep {rep} failed: {str(err)[-1500:]}", flush=True)
            failed.append({"strategy": label, "impl": side, "rep": rep, "error": str(err)[-3000:]})
            continue
        record.update(workload="GPU", strategy=label, impl=side, rep=rep)
        print(
            f"{label:40} {side:8} rep {rep:2}: {record['samples_per_sec']:12.1f} samples/s,"
            f" wall {record['wall_s']:6.2f} s, first step at {record['start_to_first_step_s']:6.2f} s",
            flush=True,
        )
        runs.append(record)
    return runs, failed


def table(runs: list[dict[str, Any]], columns: list[tuple[str, str, int, list[str]]]) -> list[str]:
    """The markdown table: a column per strategy, rows per metric for dpddp and plain, ratios dpddp/plain (per
    round) and dpddp's samples/s against one device (of the medians)."""
    counted = [r for r in runs if r["rep"] >= 0]
    labels = [label for label, *_ in columns]
    lines = ["| | " + " | ".join(labels) + " |", "| --- |" + " --- |" * len(labels)]
    lines.append("| processes | " + " | ".join(str(n if mode == "ddp" else 1) for _, mode, n, _ in columns) + " |")

    def row(name: str, cells: list[str]) -> None:
        lines.append(f"| {name} | " + " | ".join(cells) + " |")

    for key, metric, scale in ROWS:
        for side, name in (("project", "dpddp"), ("plain", "plain PyTorch")):
            row(f"{metric}, {name}", [bench._stat(bench._values(counted, "GPU", c, side, key), scale) for c in labels])
        if key == "samples_per_sec":
            ratios = [bench.paired(counted, "GPU", c, key, "project", "plain") for c in labels]
            row(f"{metric}, dpddp/plain", [bench._stat(r) for r in ratios])
            medians = [bench._values(counted, "GPU", c, "project", key) for c in labels]
            base = statistics.median(medians[0]) if medians[0] else None
            cells = [f"{statistics.median(v) / base:.3g}" if v and base else "-" for v in medians]
            row(f"{metric}, dpddp against {labels[0]}", cells)
    return lines


def main(argv: list[str] | None = None) -> int:
    """Parse the options, measure, write ``GPU.md`` and ``gpu.json``; return the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=2, help="counted rounds (default 2)")
    parser.add_argument("--budget-s", type=float, default=200, help="no run starts after this many seconds")
    parser.add_argument("--run-timeout-s", type=float, default=90, help="a run is killed after this many seconds")
    parser.add_argument("--dry-run", action="store_true", help="the same code path on CPU at tiny sizes, 1 round")
    parser.add_argument("--checks-only", action="store_true", help="the checks, not the throughput table")
    parser.add_argument("--out", type=Path, default=bench.ROOT / "bench", help="output directory (default bench/)")
    args = parser.parse_args(argv)
    found = {"gpus": 0, "name": None, "torch": importlib.metadata.version("torch"), "cuda": None}
    found = found if args.dry_run else machine()
    gpus = found["gpus"]
    if not gpus and not args.dry_run:
        print("error: no CUDA GPU here; --dry-run runs the same code path on CPU", file=sys.stderr)
        return 2
    if args.dry_run:
        args.reps, args.sizes = 1, DRY_SIZES
    else:
        args.sizes = (*SIZES[:3], SIZES[3] // gpus * gpus)
    command = " ".join(["python bench/gpu.py", *(sys.argv[1:] if argv is None else argv)])
    start = time.monotonic()
    print("\n".join(gpu_checks.listing()), flush=True)
    checks = gpu_checks.run_checks(gpus, args.dry_run)
    print("\n".join(gpu_checks.report(checks, args.dry_run)), flush=True)
    runs, failed = run_all(args, gpus) if not args.checks_only else ([], [])
    rounds = len({r["rep"] for r in runs if r["rep"] >= 0})
    num_samples, num_features, num_classes, batch = args.sizes
    where = "CPU (dry run)" if args.dry_run else f"{gpus} x {found['name']}, CUDA {found['cuda']}"
    lines = [
        "# dpddp on GPUs: one device, dp, ddp",
        "",
        f"Command: `{command}`  ",
        f"Date: {datetime.date.today().isoformat()}; machine: {where}, `nproc` = {os.cpu_count()}, torch "
        f"{found['torch']}, lightning {importlib.metadata.version('lightning')}; {time.monotonic() - start:.0f} s "
        "in all  ",
        f"Workload: {num_samples} samples x {num_features} features -> {num_classes} classes, global batch {batch}, "
        f"1 epoch; {rounds} counted round(s) of fresh processes, dpddp (lean: no logger, checkpoints or progress "
        "bar) and plain PyTorch (`bench/plain.py`) alternating. Cells: median [min-max]; dpddp/plain: median "
        "[min-max] of the per-round ratios.",
        *([f"Failed runs: {len(failed)} (see gpu.json)."] if failed else []),
        "",
        *table(runs, plan(gpus, args.dry_run)),
        "",
        *gpu_checks.report(checks, args.dry_run),
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "GPU.md").write_text("\n".join(lines) + "\n")
    record = {"command": command, "machine": found, "checks": checks, "runs": runs, "failed": failed}
    (args.out / "gpu.json").write_text(json.dumps(record, indent=1) + "\n")
    print("\n".join(lines))
    return 1 if any(c.get("ok") is False for c in checks) else 0


if __name__ == "__main__":
    sys.exit(main())
