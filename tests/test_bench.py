"""Smoke test of the benchmark (``bench/run.py --quick``): it runs and records both sides. No speed is asserted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import child_env

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_bench_quick(tmp_path: Path) -> None:
    """One project run and one plain run of the seed's size, and the in-memory and streaming runs of the scale
    workload, in one process and under ddp (tiny; about a minute on 2 cores)."""
    env, _ = child_env()
    cmd = [sys.executable, "bench/run.py", "--quick", "--workloads", "W1,W4", "--strategies", "single,ddp"]
    proc = subprocess.run(
        [*cmd, "--out", str(tmp_path)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=360
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = (tmp_path / "RESULTS.md").read_text()
    assert "samples/s" in results and "W4 single samples/s, streaming/in-memory" in results
    runs = json.loads((tmp_path / "results.json").read_text())["runs"]
    for impl in ("project", "plain", "project-streaming"):
        rows = [r for r in runs if r["impl"] == impl]
        assert rows, f"no {impl} row"
        assert all(r["samples_per_sec"] > 0 for r in rows)
        assert all(r["wall_s"] > 0 and r["peak_rss_bytes"] > 0 for r in rows)
