"""Where memory and time go: peak memory per process (the largest over ranks) and, under ddp, the share of the
training steps spent waiting on the gradient all-reduce and each rank's compute and wait seconds with the slowest
rank, in metrics.json, metrics.csv and the epoch line, and the warning that names a straggler."""

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

from dpddp.diagnostics.allreduce import AllReduceTimer
from dpddp.diagnostics.costs import slowest, straggler_line
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
    assert not {"compute_s_per_rank", "allreduce_wait_s_per_rank", "slowest_rank", "slowest_ratio"} & set(saved)
    rows = _rows(tmp_path)
    peaks = [float(r["peak_mem_mib"]) for r in rows]
    assert len(rows) == 2 and peaks == sorted(peaks) and peaks[-1] <= result["peak_mem_mib"]
    assert [(r["allreduce_share"], r["slowest_rank"], r["slowest_ratio"]) for r in rows] == [("", "", "")] * 2


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
    line = r"epoch \d/1: .* samples/s, peak ([\d,]+) MiB, all-reduce (\d+)% of step time, slowest rank \d x[\d.]+\)"
    lines = re.findall(line, ddp.stdout + ddp.stderr)
    assert len(lines) == 2 and all(float(p.replace(",", "")) > m1["peak_mem_mib"] + 256 for p, _ in lines)


@pytest.mark.parametrize(
    ("compute", "rank", "ratio"),
    [([1.0, 3.0], 1, 1.5), ([2.0, 2.0], 0, 1.0), ([1.0, 1.0, 4.0], 2, 4.0), ([5.0, 1.0, 1.0, 1.0], 0, 5.0)],
)
def test_the_slowest_rank_and_its_ratio_to_the_median(compute, rank, ratio):
    assert slowest(compute) == (rank, pytest.approx(ratio))


def test_a_straggler_is_named_at_one_and_a_half_times_the_median_and_not_below():
    assert straggler_line([1.0, 2.9], epoch=0) is None  # 2.9 / 1.95 < 1.5
    assert straggler_line([0.0, 0.0], epoch=0) is None  # no median to compare with
    line = straggler_line([0.1, 0.2, 0.1, 0.45], epoch=3, hosts=["a", "a", "b", "b"])
    assert line is not None and line.startswith(
        "straggler: rank 3 (host b) took 3.00x the median compute time in epoch 3"
    )
    assert straggler_line([1.0, 3.0], epoch=1) == (
        "straggler: rank 1 took 1.50x the median compute time in epoch 1 (3.000 s against 2.000 s; the other ranks "
        "waited for it in the gradient all-reduce)"
    )
    with pytest.raises(ValueError):
        slowest([])


STRAGGLER = r"straggler: rank (\d) \(host [^)]+\) took ([\d.]+)x the median compute time in epoch (\d)"
SLOWEST = r"epoch (\d)/1: .*, slowest rank (\d) x([\d.]+)\)"
STRAGGLER_RUN = [*SMALL[:1], "data.num_samples=400", *SMALL[2:], "strategy=ddp", "devices=2", "epoch_lines=true"]


@pytest.mark.slow
def test_a_rank_slowed_on_purpose_is_named_in_metrics_the_epoch_lines_and_one_warning_per_epoch(tmp_path):
    """ddp(2), 10 steps an epoch of about 1 ms each, rank 1 sleeping 0.1 s in each: rank 1 is the slowest, at least
    1.5x the median (of 2 ranks: their mean) in metrics.json, each metrics.csv row and each epoch line, and warned
    once per epoch; rank 0 waited the longer in the all-reduce."""
    slow = ["+callbacks.slow._target_=slow_rank.SlowRank", "+callbacks.slow.sleep_s=0.1", "data.batch_size=32"]
    proc = run_train(
        *STRAGGLER_RUN,
        "trainer.max_epochs=2",
        *slow,
        "hydra.run.dir=slow",
        cwd=tmp_path,
        env={"PYTHONPATH": str(ROOT / "tests")},
        check=True,
    )
    out = proc.stdout + proc.stderr
    m = json.loads((tmp_path / "slow/metrics.json").read_text())
    compute, wait = m["compute_s_per_rank"], m["allreduce_wait_s_per_rank"]
    assert m["slowest_rank"] == 1 and m["slowest_ratio"] >= 1.5, m
    assert compute[1] >= 1.0 and wait[0] > wait[1] > 0 and compute[0] > 0, m  # 10 sleeps of 0.1 s on rank 1
    rows = _rows(tmp_path / "slow")
    assert [(r["slowest_rank"], float(r["slowest_ratio"]) >= 1.5) for r in rows] == [("1", True)] * 2
    warned = re.findall(STRAGGLER, out)
    assert [(rank, epoch) for rank, _, epoch in warned] == [("1", "0"), ("1", "1")], out[-3000:]
    assert all(float(ratio) >= 1.5 for _, ratio, _ in warned)
    lines = re.findall(SLOWEST, out)
    assert [(epoch, rank) for epoch, rank, _ in lines] == [("0", "1"), ("1", "1")]


@pytest.mark.slow
def test_a_balanced_run_warns_of_no_straggler_and_its_figures_survive_a_continue(tmp_path):
    """ddp(2) with both ranks sleeping the same 30 ms a step (so the machine's noise cannot make a 3x
    difference): no warning; both ranks' compute and wait seconds positive. One epoch, then continued to two: the
    checkpoint holds the epoch's per-rank figures, the continued run reports its own epoch's and warns of none."""
    even = ["+callbacks.slow._target_=slow_rank.SlowRank", "+callbacks.slow.rank=null", "+callbacks.slow.sleep_s=0.03"]
    args = [*STRAGGLER_RUN, *even, "hydra.run.dir=even"]
    env = {"PYTHONPATH": str(ROOT / "tests")}
    first = run_train(*args, "trainer.max_epochs=1", cwd=tmp_path, env=env, check=True)
    saved = torch.load(tmp_path / "even/checkpoints/last.ckpt", weights_only=True)["dpddp"]["throughput"]
    assert len(saved["compute_s_per_rank"]) == 2 and saved["ranks_epoch"] == 0
    second = run_train(*args, "trainer.max_epochs=2", "resume=true", cwd=tmp_path, env=env, check=True)
    out = first.stdout + first.stderr + second.stdout + second.stderr
    assert "straggler" not in out
    m = json.loads((tmp_path / "even/metrics.json").read_text())
    assert m["segments"] == 2 and m["slowest_rank"] in (0, 1) and 1 <= m["slowest_ratio"] < 1.5, m
    assert all(s > 0 for s in m["compute_s_per_rank"] + m["allreduce_wait_s_per_rank"]), m
    assert m["compute_s_per_rank"] != saved["compute_s_per_rank"]  # the continued run's epoch
    assert [r["epoch"] for r in _rows(tmp_path / "even")] == ["0", "1"]
