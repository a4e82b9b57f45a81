"""``python -m dpddp.check --network``: all-reduce latency and bus bandwidth between processes started here or by
torchrun, the ring bound for the model's gradient, the predicted ddp step and the recommendation."""

from __future__ import annotations

import logging
import re
import subprocess
import sys

import pytest
from conftest import child_env
from hydra.utils import instantiate

from dpddp.check import _compose, main
from dpddp.diagnostics.bandwidth import bus_bandwidth, recommend, ring_seconds


def test_the_ring_bound_and_the_bus_bandwidth():
    assert bus_bandwidth(1000, 1.0, 4) == pytest.approx(1500.0)  # 2(N-1)/N x bytes / seconds
    assert bus_bandwidth(1000, 1.0, 2) == pytest.approx(1000.0)
    assert ring_seconds(1000, 4, 0.001, 1500.0) == pytest.approx(1.001)  # the inverse, plus the latency
    with pytest.raises(ValueError, match="over 1 rank"):
        bus_bandwidth(1000, 1.0, 1)


def test_the_recommendation_follows_the_all_reduce_share():
    assert recommend(0.1, compressible=True).startswith("ddp: ")
    assert "comm hook" in recommend(0.3, compressible=True) and recommend(0.3, compressible=False).startswith("ddp,")
    assert "comm hook" not in recommend(0.3, compressible=False)
    assert recommend(0.6, compressible=True).startswith("one process")


def test_too_few_processes_is_one_line_and_exit_2(capsys):
    with pytest.raises(SystemExit) as ended:
        main(["--network", "--processes=1"])
    assert ended.value.code == 2
    assert capsys.readouterr().err.strip() == (
        "error: --processes=1 is too few: an all-reduce needs 2 or more, e.g. --processes=2"
    )


def _figures(stdout: str) -> dict[str, float]:
    patterns = {
        "latency_us": r"latency ([\d,]+) us",
        "bus_gbs": r"bus bandwidth ([\d.]+) GB/s",
        "grad_bytes": r"gradient: ([\d,]+) bytes",
        "measured_ms": r"all-reduce ([\d.]+) ms measured",
        "bound_ms": r"([\d.]+) ms ring bound",
        "compute_ms": r"predicted ([\d.]+) ms compute",
        "share": r"all-reduce share (\d+)%",
    }
    found = {}
    for key, pattern in patterns.items():
        m = re.search(pattern, stdout)
        assert m, f"{key} missing:\n{stdout}"
        found[key] = float(m.group(1).replace(",", ""))
    return found


@pytest.mark.slow
def test_the_network_check_measures_two_processes_and_forecasts_the_models_step(capsys):
    """The check's ``main`` here (it spawns its 2 ranks; ``python -m dpddp.check`` as a process: the torchrun test)."""
    loggers = [logging.getLogger(n) for n in ("lightning", "lightning.pytorch", "lightning.fabric", "dpddp")]
    levels = [logger.level for logger in loggers]
    try:
        main(["--network", "--model", "mlp"])  # exit 0: returns
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)  # main quiets them for its process
    out = capsys.readouterr().out
    figures = _figures(out)
    model = instantiate(_compose(["model=mlp"], None).model, _convert_="all")
    assert figures["grad_bytes"] == sum(p.numel() * p.element_size() for p in model.parameters())
    assert "all-reduce over 2 processes (gloo)" in out
    assert figures["latency_us"] > 0 and figures["bus_gbs"] > 0
    bound = ring_seconds(int(figures["grad_bytes"]), 2, figures["latency_us"] * 1e-6, figures["bus_gbs"] * 1e9)
    assert figures["bound_ms"] == pytest.approx(bound * 1e3, rel=0.05, abs=2e-3)  # the printed figures' rounding
    share = figures["measured_ms"] / (figures["compute_ms"] + figures["measured_ms"])
    assert figures["share"] == pytest.approx(100 * share, abs=1.5)
    (line,) = [x for x in out.splitlines() if x.startswith("recommendation: ")]
    assert line == f"recommendation: {recommend(figures['share'] / 100, compressible=figures['grad_bytes'] >= 2**20)}"


@pytest.mark.slow
def test_the_network_check_measures_torchruns_ranks_and_rank_0_reports():
    env, _ = child_env()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "dpddp.check"]
    proc = subprocess.run([*cmd, "--network"], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("all-reduce over 2 processes (gloo)") == 1  # rank 0 only
    assert "TORCHELASTIC_RUN_ID=" in proc.stdout  # the launcher's variables, as rank 0 saw them
    assert _figures(proc.stdout)["grad_bytes"] > 0
