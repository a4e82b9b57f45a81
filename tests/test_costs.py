"""Where memory and time go: peak memory per process (the largest over ranks) and, under ddp, the share of the
training steps spent waiting on the gradient all-reduce, in metrics.json, metrics.csv and the epoch line."""

from __future__ import annotations

import csv
import json
import re
import resource

import pytest
import torch
import torch.distributed as dist
from conftest import ROOT, compose_cfg, run_train
from torch import nn

from dpddp.parallel.allreduce import AllReduceTimer
from dpddp.run.training import train

SMALL = ["accelerator=cpu", "data.num_samples=1005", "logger=none", "trainer.enable_progress_bar=false"]


def _rows(run_dir):
    with open(run_dir / "metrics.csv", newline="") as f:
        return [r for r in csv.DictReader(f) if r["stage"] == "fit"]


def test_one_process_reports_its_peak_rss_and_no_all_reduce_share(tmp_path):
    result = train(compose_cfg(*SMALL, "trainer.max_epochs=2"), tmp_path)
    now_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    saved = json.loads((tmp_path / "metrics.json").read_text())
    assert saved["peak_mem_of"] == "rss" and 50 < saved["peak_mem_mib"] <= now_mib
    assert "allreduce_share" not in saved and "missing" not in saved  # ddp only
    rows = _rows(tmp_path)
    peaks = [float(r["peak_mem_mib"]) for r in rows]
    assert len(rows) == 2 and peaks == sorted(peaks) and peaks[-1] <= result["peak_mem_mib"]
    assert [r["allreduce_share"] for r in rows] == ["", ""]


def test_the_timing_hook_passes_the_gradients_through_unchanged(tmp_path):
    """DDP with the timer's hook gives bit-for-bit the gradients of DDP without one (a 1-process gloo group,
    0.5 MB buckets: more than one bucket a backward), and times the waits."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 3))
        x, y = torch.randn(32, 64), torch.randint(0, 3, (32,))
        grads = []
        for hooked in (False, True):
            model = nn.parallel.DistributedDataParallel(nn.Sequential(*[m for m in net]), bucket_cap_mb=0.5)
            timer = AllReduceTimer()
            if hooked:
                model.register_comm_hook(None, timer.hook)
            model.zero_grad()
            for _ in range(2):
                nn.functional.cross_entropy(model(x), y).backward()
            grads.append([p.grad.clone() for p in model.parameters()])
        assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
        assert timer.buckets > 2  # two backwards, more than one bucket
        assert timer.seconds > 0
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_ddp_reports_the_all_reduce_share_and_the_largest_peak_over_ranks(tmp_path):
    """ddp(2) with a model that holds 1 GiB more on rank 1: metrics.json's peak is rank 1's (at least 256 MiB
    above a one-process run of the same model, whose base is larger than a launched rank's); the share is in
    (0, 1) in metrics.json, each metrics.csv row and each epoch line."""
    model = ["model=mlp", "model._target_=users_models.RankOneBallastMLP", "epoch_lines=true"]
    args = [*SMALL, *model, "trainer.max_epochs=2"]
    env = {"PYTHONPATH": str(ROOT / "tests")}
    one = run_train(*args, "hydra.run.dir=one", cwd=tmp_path, env=env)
    ddp = run_train(*args, "strategy=ddp", "devices=2", "hydra.run.dir=ddp", cwd=tmp_path, env=env)
    assert one.returncode == 0 and ddp.returncode == 0, (one.stderr + ddp.stderr)[-3000:]
    m1, m2 = (json.loads((tmp_path / d / "metrics.json").read_text()) for d in ("one", "ddp"))
    assert m2["peak_mem_mib"] - m1["peak_mem_mib"] > 256
    assert 0 < m2["allreduce_share"] < 1 and "allreduce_share" not in m1
    shares = [float(r["allreduce_share"]) for r in _rows(tmp_path / "ddp")]
    assert len(shares) == 2 and all(0 < s < 1 for s in shares)
    line = r"epoch \d/1: .* samples/s, peak ([\d,]+) MiB, all-reduce (\d+)% of step time\)"
    lines = re.findall(line, ddp.stdout + ddp.stderr)
    assert len(lines) == 2 and all(float(p.replace(",", "")) > m1["peak_mem_mib"] + 256 for p, _ in lines)
