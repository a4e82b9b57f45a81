"""Hang attribution: a collective that times out ends the run with one line naming the ranks that did not reach
it, where they were instead, and the stage and step (``dpddp.diagnostics.whereabouts``)."""

from __future__ import annotations

import re
import time

import pytest
from conftest import ROOT, leftover, run_train

from dpddp.continuity.stop import agreed
from dpddp.diagnostics import whereabouts
from dpddp.diagnostics.whereabouts import AGREEMENT, BATCHNORM, GRADIENTS, describe, entering
from dpddp.errors import first_line


def test_the_line_names_the_ranks_that_did_not_arrive_and_where_they_were():
    mine = ("train", 5, GRADIENTS)
    line = describe(0, mine, {1: ("train", 5, "")})
    assert line == (
        "rank 1 did not reach the gradient all-reduce (training, step 5): rank 1 is in training, step 5, outside "
        "any collective (rank 0 waited in it)"
    )


def test_ranks_in_another_collective_are_named_with_it_and_the_waiting_ranks_are_listed():
    mine = ("validate", 40, AGREEMENT)
    others = {1: mine, 2: ("validate", 40, BATCHNORM), 3: None}
    assert describe(0, mine, others) == (
        "ranks 2, 3 did not reach the stop agreement (validation, step 40): rank 2 is in validation, step 40, in "
        "BatchNorm's sums; rank 3 published no whereabouts (ranks 0, 1 waited in it)"
    )


def test_a_rank_one_step_ahead_counts_as_elsewhere_and_nobody_is_blamed_when_all_are_there():
    mine = ("train", 7, GRADIENTS)
    assert "rank 1 is in training, step 8, in the gradient all-reduce" in describe(
        0, mine, {1: ("train", 8, GRADIENTS)}
    )
    assert describe(1, mine, {0: mine}) is None


def test_a_collective_that_raises_stays_marked_and_one_that_ends_well_is_unmarked():
    whereabouts.mark(None)
    with entering(AGREEMENT):
        assert whereabouts.current() == AGREEMENT
    assert whereabouts.current() is None
    with pytest.raises(RuntimeError), entering(BATCHNORM):
        raise RuntimeError("timed out")
    assert whereabouts.current() == BATCHNORM
    whereabouts.mark(None)


def test_without_a_process_group_the_agreement_is_the_flag_itself_and_marks_nothing():
    whereabouts.mark(None)
    assert agreed(1, device=None, pace=None, interval_s=1.0) == 1  # type: ignore[arg-type]
    assert whereabouts.current() is None


@pytest.mark.slow
def test_a_rank_that_never_reaches_the_gradient_all_reduce_is_named_within_the_timeout(tmp_path):
    """ddp(2): rank 1 sleeps before the backward of step 5, so rank 0 waits in the gradient all-reduce. The run
    ends within ``strategy.timeout_s`` (10 s) plus the start and the rank's kill, exit status 1, with one line
    naming rank 1, the collective, the stage and the step; no process is left."""
    args = ["accelerator=cpu", "strategy=ddp", "devices=2", "logger=none", "data.num_samples=2000"]
    args += ["strategy.timeout_s=10", "+callbacks.hang._target_=slow_rank.NeverArrives", "+callbacks.hang.at_step=5"]
    began = time.monotonic()
    proc = run_train(*args, "hydra.run.dir=hang", cwd=tmp_path, env={"PYTHONPATH": str(ROOT / "tests")})
    took = time.monotonic() - began
    errors = re.findall(r"\berror: .*", proc.stdout + proc.stderr)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert len(errors) == 1, proc.stderr[-3000:]
    expected = (
        "error: rank 1 did not reach the gradient all-reduce (training, step 5): rank 1 is in training, step 5, "
        "outside any collective (rank 0 waited in it); ending the run (this rank: RuntimeError: Timed out waiting "
        "10000ms for recv operation to complete)"
    )
    assert errors[0] == expected, errors[0]
    assert took < 10 + 60, took  # the timeout, the ranks' start and the kill of rank 1, on a loaded machine
    assert leftover(proc.tag) == []


def test_the_timed_out_collective_s_message_loses_torch_s_callback_wrapping_and_gloo_s_source_location():
    """The message a CPU DDP backward raises when gloo's all-reduce times out (torch 2.13), as one line."""
    wrap = "Got the following error when running the callback: RuntimeError: "
    gloo = "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 10000ms"
    err = RuntimeError(f"{wrap}{wrap}{gloo} for recv operation to complete")
    assert first_line(err) == "RuntimeError: Timed out waiting 10000ms for recv operation to complete"


def test_a_rank_lost_in_the_cost_gather_is_named_in_the_cost_gather(monkeypatch):
    from types import SimpleNamespace

    import torch
    from lightning.pytorch.strategies import DDPStrategy as LightningDDPStrategy

    from dpddp.diagnostics.costs import Costs
    from dpddp.parallel.ddp import DDPStrategy
    from dpddp.report.throughput import ThroughputCounts

    seen = []

    def gather(self, tensor, group=None, sync_grads=False):
        seen.append(whereabouts.current())
        return tensor

    monkeypatch.setattr(LightningDDPStrategy, "all_gather", gather)
    strategy = DDPStrategy(parallel_devices=[torch.device("cpu")])
    whereabouts.mark(None)
    costs = Costs(ThroughputCounts())
    costs._over_ranks(SimpleNamespace(strategy=strategy), waited=None, stepped=1.0)  # type: ignore[arg-type]
    strategy.all_gather(torch.zeros(1))
    assert seen == ["the cost gather", "Lightning's all_gather"]
    assert whereabouts.current() is None
