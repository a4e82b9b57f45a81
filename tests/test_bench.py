"""Tests of the benchmark: ``bench/run.py --quick`` runs and records the three peers, the strong stock-Lightning
one doing plain PyTorch's job; ``bench/gpu.py --dry-run``
runs the project and plain PyTorch and writes its table; the report generator on made-up runs. No speed is
asserted."""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import child_env

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
KEYS = ("samples_per_sec", "steps_per_sec", "wall_s", "start_to_first_step_s", "peak_rss_bytes")


def load_bench(name: str = "run"):
    """``bench/<name>.py`` as a module, with ``bench/`` on ``sys.path`` for its own imports (``workloads``), as
    when it runs as a script."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def number(cell: str) -> float:
    """The median of a ``median [min-max]`` cell (``1,234 [..]`` or ``0.5 [..]``)."""
    return float(cell.split(" [")[0].replace(",", ""))


@pytest.mark.slow
def test_bench_quick(tmp_path: Path) -> None:
    """``bench/run.py --quick`` end to end on the strongest peers at the seed's size under ddp: plain DDP and the
    strong stock-Lightning program under Lightning's own ddp (the subprocess launcher re-running the script), one
    real run each with positive measurements, RESULTS.md with their rows, and the strong stock program doing
    plain's job: the same test loss to float rounding. The naive stock program shares its command line and
    ``Trainer`` (``stock.run_peer``); the project
    runs through the same ``measure`` in ``test_gpu_dry_run``; the ratios and targets are checked in
    ``test_results_report``."""
    env, _ = child_env()
    cmd = [sys.executable, "bench/run.py", "--quick", "--workloads", "W1", "--strategies", "ddp"]
    cmd += ["--impls", "plain,stock-strong"]
    proc = subprocess.run(
        [*cmd, "--out", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = {run["impl"]: run for run in json.loads((tmp_path / "results.json").read_text())["runs"]}
    assert sorted(runs) == ["plain", "stock-strong"]
    for run in runs.values():
        assert (run["strategy"], run["workload"]) == ("ddp(2)", "W1")
        assert all(run[key] > 0 for key in KEYS), run
        assert 0 < run["test_loss"] < 10, run
    assert abs(runs["stock-strong"]["test_loss"] - runs["plain"]["test_loss"]) < 1e-6, runs
    results = (tmp_path / "RESULTS.md").read_text()
    header = "| strategy | metric | dpddp | plain | strong stock | naive stock | dpddp/plain | dpddp/strong stock |"
    assert header + " dpddp/naive stock |" in results
    for _, label, _ in load_bench().METRICS:
        row = next(line for line in results.splitlines() if line.startswith(f"| ddp(2) | {label} |"))
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[2] == "-" and all(number(c) > 0 for c in cells[3:5]) and cells[5:] == ["-"] * 4, row
    assert "| W1 ddp(2) whole wall time (s), dpddp/strong stock | <= 1 | - | not measured |" in results
    assert "Check, the same job: max |test/loss strong stock - plain| over the rounds = " in results


@pytest.mark.slow
def test_gpu_dry_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture) -> None:
    """``bench/gpu.py --dry-run`` lists every check with the GPUs it needs, runs each on CPU (where each holds),
    then takes the throughput code path on CPU (one process, dpddp and plain; ddp on 2 processes, dpddp: plain's
    ddp command is ``bench/run.py``'s, run in ``test_bench_quick``) and writes a well-formed table with positive
    numbers, and ``-`` in the cells of the run not made. Its ``main`` in this process; its runs are fresh ones."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert load_bench("gpu").main(["--dry-run", "--out", str(tmp_path)]) == 0
    stdout = capsys.readouterr().out
    record = json.loads((tmp_path / "gpu.json").read_text())
    from gpu_checks import CHECKS, EXTRA_NEEDS  # bench/ is on sys.path (load_bench)

    for check in CHECKS:
        assert f"[{check.gpus} GPU{'s' if check.gpus > 1 else ''}] {check.name}: " in stdout, check.name
    assert all(f"] {what}" in stdout for what, _ in EXTRA_NEEDS)
    checks, peaks = record["checks"][:-1], record["checks"][-1]["peaks"]
    assert [c["name"] for c in checks] == [c.name for c in CHECKS]
    assert all(c["ok"] is True and c["measured"] <= c["bound"] for c in checks), checks
    assert all(c["cost"] > 1e-5 for c in checks if "cost" in c)  # 16 bits rounded: the tolerance is not vacuous
    assert peaks and all(mib > 0 and kind == "rss" for mib, kind, _ in peaks.values())
    assert "## Checks" in (tmp_path / "GPU.md").read_text() and "dry run on CPU" in (tmp_path / "GPU.md").read_text()
    assert record["failed"] == []
    assert [(r["impl"], r["strategy"]) for r in record["runs"]] == [
        ("project", "one CPU process"),
        ("plain", "one CPU process"),
        ("project", "`strategy=ddp` (2 CPU processes)"),
    ]
    assert all(r[key] > 0 for r in record["runs"] for key in KEYS if key != "steps_per_sec")
    lines = (tmp_path / "GPU.md").read_text().splitlines()
    header = next(line for line in lines if line.startswith("| |"))
    assert header.count("|") == 4 and "one CPU process" in header and "ddp" in header
    body = [line.strip("|").split("|") for line in lines if line.startswith("| ") and line != header]
    rows = {cells[0].strip(): [c.strip() for c in cells[1:]] for cells in body}
    assert rows["processes"] == ["1", "2"]
    for name in ("samples/s (steady state)", "whole wall time (s)", "start to first step (s)"):
        assert all(number(c) > 0 for c in rows[f"{name}, dpddp"]), rows[f"{name}, dpddp"]
        plain = rows[f"{name}, plain PyTorch"]  # a side's run missing from a column: its cells are "-"
        assert number(plain[0]) > 0 and plain[1] == "-", plain
    ratio = rows["samples/s (steady state), dpddp/plain"]
    assert number(ratio[0]) > 0 and ratio[1] == "-", ratio
    assert rows["samples/s (steady state), dpddp against one CPU process"][0] == "1"


def test_results_report(tmp_path: Path) -> None:
    """The RESULTS.md generator on made-up runs of every workload, the K variant included: each target with its
    bound, measured value and verdict; the ratio to each peer per workload and strategy; the W4 lines."""
    bench = load_bench()
    runs = []
    for workload in ("W1", "W2", "W3", "W4"):
        for strategy, mode in (("single", "single"), ("ddp(2)", "ddp")):
            for rep in (0, 1):
                for impl in bench.impls_for(workload, mode, True):
                    speed = {"project": 900.0, "stock": 1000.0, "stock-strong": 1200.0, "plain": 2000.0}.get(
                        impl, 1800.0
                    )
                    record = dict.fromkeys(KEYS, 1.0) | {"samples_per_sec": speed, "test_loss": 0.5}
                    record |= {"start_to_first_step_s": 4.0 if impl == "project" else 3.8, "wall_s": 5.0}
                    runs.append(record | {"workload": workload, "strategy": strategy, "impl": impl, "rep": rep})
    workloads = ["W1", "W2", "W3", "W4"]
    args = argparse.Namespace(quick=False, threads=1, reps=2, load=(1.0, 1.0), workloads=workloads, out=tmp_path)
    args.date = "2026-01-31"
    bench.write_results(runs, args, "python bench/run.py")
    text = (tmp_path / "RESULTS.md").read_text()
    assert "Date: 2026-01-31;" in text and "load average 1.00 at the start" in text
    (tmp_path / "RESULTS.md").unlink()
    bench.render(tmp_path)  # --render: the same report from results.json alone
    assert (tmp_path / "RESULTS.md").read_text() == text
    assert "| W2 single samples/s (steady state), dpddp/plain | >= 0.95 | 0.45 [0.45-0.45] | no |" in text
    assert "| W2 single samples/s (steady state), dpddp/strong stock | >= 1 | 0.75 [0.75-0.75] | no |" in text
    assert "| W3 ddp(2) samples/s (steady state), dpddp/strong stock | >= 0.95 | 0.75 [0.75-0.75] | no |" in text
    assert "| W1 ddp(2) start to first step (s), dpddp - strong stock | <= 0.3 | 0.2 [0.2-0.2] | yes |" in text
    assert "| W3 single K=16 samples/s (steady state), dpddp/plain | >= 0.9 | 0.9 [0.9-0.9] | yes |" in text
    assert "| W2 ddp(2) K=16 samples/s (steady state), dpddp/plain | >= 0.9 | 0.9 [0.9-0.9] | yes |" in text
    assert "| W2 single samples/s (steady state), defaults on/off | >= 0.95 | 2 [2-2] | yes |" in text
    assert text.count("| target |") == 1 and "not measured" not in text
    ratios = "dpddp/plain **0.45 [0.45-0.45]**, dpddp/strong stock **0.75 [0.75-0.75]**, dpddp/naive stock **0.9"
    assert f"- W3 ddp(2) samples/s: {ratios} [0.9-0.9]**" in text
    ratios = "dpddp/plain **0.9 [0.9-0.9]**, dpddp/strong stock **1.5 [1.5-1.5]**, dpddp/naive stock **1.8 [1.8-1.8]**"
    assert f"- W3 ddp(2) K=16 samples/s: {ratios}" in text
    assert "| ddp(2) K=16 | samples/s (steady state) |" in text
    assert "- W4 ddp(2) samples/s, streaming/in-memory: **2 [2-2]**" in text
    assert "max |test/loss dpddp - plain| over the rounds = 0" in text
    assert "max |test/loss strong stock - plain| over the rounds = 0" in text


def test_the_performance_page_numbers_are_the_committed_results() -> None:
    """docs/performance.md's numbers are ``bench/run.py --readme`` of ``bench/results.json``: no hand-copied number."""
    bench = load_bench()
    readme = (ROOT / "docs" / "performance.md").read_text()
    start, end = readme.index(bench.README_START), readme.index(bench.README_END) + len(bench.README_END)
    results = json.loads((ROOT / "bench" / "results.json").read_text())
    assert readme[start:end] == bench.readme_section(results)
    assert "| target |" in readme[start:end]
    # the same numbers as RESULTS.md, which counts no warm-up round
    targets = [line for line in readme[start:end].splitlines() if line.startswith("| W")]
    report = (ROOT / "bench" / "RESULTS.md").read_text().splitlines()
    assert targets and all(line in report for line in targets)


def test_startup_report() -> None:
    """``STARTUP.md`` on made-up phases: a row per phase (``-`` where stock Lightning has none), the medians, and
    the sums after ``import lightning`` and from the start."""
    startup = load_bench("startup")
    project = dict.fromkeys(startup.PHASES["project"], 0.1) | {"import lightning": 3.0}
    stock = dict.fromkeys(startup.PHASES["stock"], 0.2) | {"import lightning": 3.0}
    slower = {k: v + 0.2 for k, v in project.items()}
    text = startup.report({"project": [project, slower, project], "stock": [stock, stock, stock]}, "cmd")
    assert "| Hydra composition | 0.10 [0.10-0.30] | - |" in text
    assert "| import lightning | 3.00 [3.00-3.20] | 3.00 [3.00-3.00] |" in text
    assert "| **after import lightning** | 0.50 [0.50-1.50] | 0.20 [0.20-0.20] |" in text
    assert "| **start to first step** | 3.70 [3.70-5.30] | 3.60 [3.60-3.60] |" in text


def test_startup_answers_report() -> None:
    """The answers' section of ``STARTUP.md`` on made-up times: a row per command, its median [min-max] seconds
    and its per-round ratio to importing Lightning."""
    startup = load_bench("startup")
    times = {label: [0.5, 0.6, 0.4] for label in startup.ANSWERS} | {startup.BASE: [5.0, 6.0, 4.0]}
    text = startup.answers_report(times)
    assert "| `python train.py devises=2` | 0.50 [0.40-0.60] | 0.10 [0.10-0.10] |" in text
    assert f"| `{startup.BASE}` | 5.00 [4.00-6.00] | 1.00 [1.00-1.00] |" in text


@pytest.mark.slow
def test_startup_runs(tmp_path: Path) -> None:
    """``bench/startup.py --runs 1``: one real run of each program, every phase timed (positive, summing to a
    start no longer than the whole run), STARTUP.md written, and the sources' bytecode there to load."""
    env, _ = child_env()
    cmd = [sys.executable, "bench/startup.py", "--runs", "1", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {
        line.split("|")[1].strip(): line.split("|")[2:4]
        for line in (tmp_path / "STARTUP.md").read_text().splitlines()
        if line.startswith("| ") and "---" not in line
    }
    for phase in load_bench("startup").PHASES["project"]:
        assert number(rows[phase][0].strip()) > 0, (phase, rows[phase])
    assert rows["Hydra composition"][1].strip() == "-" and number(rows["import lightning"][1].strip()) > 0
    assert number(rows["**start to first step**"][0].strip()) > number(rows["**after import lightning**"][0].strip())
    for source in (ROOT / "src" / "dpddp" / "entry" / "hydra.py", BENCH / "stock_strong.py"):  # as installed
        assert Path(importlib.util.cache_from_source(str(source))).is_file(), source


def test_step_profile_report() -> None:
    """``PROFILE.md`` on made-up runs: a column per program, the step's median microseconds, and per bucket the
    median microseconds and share of the step."""
    profile = load_bench("step_profile")
    runs = []
    for impl, step in (("plain", 100.0), ("project", 400.0), ("project-defaults", 500.0), ("project-k16", 200.0)):
        for scale in (1.0, 1.2, 0.9):
            us = {"loop and hooks": 0.4 * step, "gather": 0.1 * step, "forward": 0.1 * step}
            us |= {"backward": 0.2 * step, "optimizer": 0.2 * step}
            record = {"step_us": step * scale, "us": {k: v * scale for k, v in us.items()}, "steps": 9}
            runs.append(record | {"impl": impl, "workload": "W3", "rep": 0})
    text = profile.report(runs, "cmd", profile.WORKLOADS, "meta")
    assert "## W3: 65536 samples x 10 features -> 2 classes, global batch 32, one process" in text
    assert "| per step | plain PyTorch | dpddp K=1 | dpddp K=1, defaults | dpddp K=16 |" in text
    assert "| **step (us)** | **100.0** | **400.0** | **500.0** | **200.0** |" in text
    assert "| loop and hooks | 40.0 (40%) | 160.0 (40%) | 200.0 (40%) | 80.0 (40%) |" in text
    assert "| backward | 20.0 (20%) | 80.0 (20%) | 100.0 (20%) | 40.0 (20%) |" in text


@pytest.mark.slow
def test_step_profile_runs(tmp_path: Path) -> None:
    """``bench/step_profile.py --quick --workloads W3``: one real run of plain PyTorch, dpddp K=1 (lean and with
    its defaults: progress bar, CSV logger, checkpoints) and K=16, each bucket's wrappers catching the calls of both
    programs (gather, forward, backward and optimizer time in each; K=16 gathers once per execution, also counted),
    the rows summing to the step."""
    env, _ = child_env()
    cmd = [sys.executable, "bench/step_profile.py", "--quick", "--workloads", "W3", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    runs = json.loads((tmp_path / "profile.json").read_text())["runs"]
    assert sorted(r["impl"] for r in runs) == ["plain", "project", "project-defaults", "project-k16"]
    for run in runs:
        assert run["steps"] == 2048 * 8 // 10 // 32 - 1, run  # the steps after the first
        assert all(run["us"][bucket] > 0 for bucket in ("gather", "forward", "backward", "optimizer")), run
        assert abs(sum(run["us"].values()) - run["step_us"]) < 1e-6 * run["step_us"], run
    header = "| per step | plain PyTorch | dpddp K=1 | dpddp K=1, defaults | dpddp K=16 |"
    assert header in (tmp_path / "PROFILE.md").read_text()
