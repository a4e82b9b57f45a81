"""Every stop kind continues exactly: the loop flags a callback latches, the global random state at an epoch-limit
stop, and a restored schedule that was built for another limit (said in one line). In-process, one process; the
same stops on several processes (every rank's random state, the latched flag): test_three_processes."""

from __future__ import annotations

import csv
import json
import logging
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import QUIET, checkpoint, compose_cfg, global_step, max_diff, weights
from lightning.pytorch.callbacks import EarlyStopping, Timer
from lightning.pytorch.callbacks.early_stopping import EarlyStoppingReason

from dpddp.continuity.state import ResumableState
from dpddp.errors import ConfigError, Preempted
from dpddp.run.config import check_config
from dpddp.run.training import train

BASE = ["model=mlp", "accelerator=cpu", "logger=none", "data.num_samples=1024", *QUIET]
# 1024 samples: 820 train, 12 global batches of 64 an epoch


def _apart(a: Path, b: Path) -> float:
    return max_diff(weights(a / "checkpoints/last.ckpt"), weights(b / "checkpoints/last.ckpt"))


def _stop_and_continue(tmp_path: Path, args: list[str], stop: list[str]) -> Path:
    """Run ``args`` stopped by ``stop`` (a limit, or a SIGTERM callback), then continue it with ``args`` alone."""
    try:
        train(compose_cfg(*args, *stop), tmp_path / "first")
    except Preempted:
        assert any("Sigterm" in s for s in stop)
    train(compose_cfg(*args, f"ckpt_path={tmp_path / 'first/checkpoints/last.ckpt'}"), tmp_path / "continued")
    return tmp_path / "continued"


# EarlyStopping that trips at epoch 1 (val/score worse once) before min_epochs, then sees it improve
LATCHED = [
    *BASE,
    "model._target_=users_models.ScriptedScoreMLP",  # val/score: 1.0, 2.0, 0.5, 0.4
    "+callbacks.es._target_=lightning.pytorch.callbacks.EarlyStopping",
    "+callbacks.es.monitor=val/score",
    "+callbacks.es.patience=1",
    "trainer.min_epochs=4",
    "trainer.max_epochs=8",
]


@pytest.fixture(scope="module")
def latched_straight(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("latched")
    train(compose_cfg(*LATCHED), run)
    return run


@pytest.mark.parametrize(
    "stop",
    [
        ["+callbacks.kill._target_=conftest.SigtermAtStep", "+callbacks.kill.step=30"],  # inside epoch 2
        ["trainer.max_steps=30"],
        ["trainer.max_steps=24"],  # epoch 1's end, after EarlyStopping tripped
    ],
)
def test_loop_flags_latched_by_a_callback_travel_in_the_checkpoint(tmp_path, caplog, latched_straight, stop):
    """``trainer.should_stop`` set by EarlyStopping before ``min_epochs`` is restored: the continued run stops at
    ``min_epochs`` as the straight run does (without it, EarlyStopping, now improving, trains on past
    ``min_epochs``: to step 60)."""
    assert global_step(latched_straight) == 4 * 12
    with caplog.at_level(logging.INFO, logger="dpddp.report.epochs"):
        continued = _stop_and_continue(tmp_path, LATCHED, stop)
    assert global_step(continued) == 4 * 12
    assert [r.getMessage() for r in caplog.records if "EarlyStopping" in r.getMessage()][-1] == (
        "EarlyStopping ended the run after epoch 3 (it tripped after epoch 1; trainer.min_epochs=4 held the run): "
        "Monitored metric val/score did not improve in the last 1 records. Best score: 1.000."
    )
    assert _apart(continued, latched_straight) <= 1e-6


def test_a_stop_latched_by_an_early_stopping_that_is_dropped_is_not_restored(tmp_path, caplog, latched_straight):
    """The flag travels with the callback that latched it: continued with the EarlyStopping, the fit it ended
    trains nothing more (as the straight run would); continued without it, the fit goes on to its limit, and one
    line says why."""
    last = f"ckpt_path={latched_straight / 'checkpoints/last.ckpt'}"
    train(compose_cfg(*LATCHED, last), tmp_path / "kept")
    assert global_step(tmp_path / "kept") == 4 * 12
    without = [a for a in LATCHED if not a.startswith("+callbacks.es") and not a.startswith("trainer.max_epochs")]
    with caplog.at_level(logging.WARNING, logger="dpddp.continuity.state"):
        train(compose_cfg(*without, "trainer.max_epochs=6", last), tmp_path / "dropped")
    assert global_step(tmp_path / "dropped") == 6 * 12
    assert [r.getMessage() for r in caplog.records if r.name == "dpddp.continuity.state"] == [
        "the checkpoint's fit was stopped by EarlyStopping{'monitor': 'val/score', 'mode': 'min'}, which this run "
        "does not have: training goes on to this run's limits"
    ]


def test_a_checkpoint_inside_an_epoch_continued_with_another_batch_size_is_one_line(tmp_path):
    """The epoch's remaining batches are the saved batch size's: another is refused before the fit (it crashed
    at the epoch's next batch: the sampler's ids and Lightning's batch count disagreed, the new-user trial); from
    an epoch's end it is a new epoch, and taken."""
    train(compose_cfg(*BASE, "trainer.max_steps=18"), tmp_path / "cut")
    train(compose_cfg(*BASE, "trainer.max_steps=12"), tmp_path / "whole")  # epoch 0's end
    cut, whole = (f"ckpt_path={tmp_path / run / 'checkpoints/last.ckpt'}" for run in ("cut", "whole"))
    with pytest.raises(ConfigError) as refused:
        check_config(compose_cfg(*BASE, cut, "data.batch_size=32"), "fit")
    assert str(refused.value) == (
        f"ckpt_path={str(tmp_path / 'cut/checkpoints/last.ckpt')!r} stopped inside an epoch with data.batch_size=64: "
        "continue it with data.batch_size=64, or change it from a checkpoint written at an epoch's end"
    )
    check_config(compose_cfg(*BASE, whole, "data.batch_size=32"), "fit")
    check_config(compose_cfg(*BASE, cut), "fit")


def test_an_epoch_a_limit_cuts_is_not_checked_by_early_stopping_on_the_validation_before_it(tmp_path):
    """val/score improves every epoch; ``max_steps=18`` cuts epoch 1, whose end hooks Lightning still calls:
    EarlyStopping checked epoch 0's value again there and tripped (patience 1), so the continued run stopped at
    step 18. Its state and the flag travel as they were before that check: the straight run's step and state."""
    args = [*BASE, "model._target_=users_models.ScriptedScoreMLP", "+model.scores=[1.0,0.9,0.8,0.7]"]
    args += ["+callbacks.es._target_=lightning.pytorch.callbacks.EarlyStopping", "+callbacks.es.monitor=val/score"]
    args += ["+callbacks.es.patience=1", "trainer.max_epochs=4"]
    train(compose_cfg(*args), tmp_path / "straight")
    continued = _stop_and_continue(tmp_path, args, ["trainer.max_steps=18"])
    assert global_step(continued) == global_step(tmp_path / "straight") == 4 * 12
    states = [
        {k: v for k, v in checkpoint(run)["callbacks"].items() if k.startswith("EarlyStopping")}
        for run in (continued, tmp_path / "straight")
    ]
    assert states[0] == states[1] and len(states[0]) == 1
    assert _apart(continued, tmp_path / "straight") <= 1e-6


def test_a_stop_flag_set_by_a_timer_run_out_is_not_latched_and_early_stoppings_is():
    """``max_time`` is a limit a continued run may raise: the flag its ``Timer`` set does not travel; with the
    time run out an EarlyStopping that has stopped still latches it, and with time left any callback's flag does."""
    es = EarlyStopping(monitor="val/loss")
    trainer = SimpleNamespace(should_stop=True, callbacks=[Timer(timedelta(0)), es], early_stopping_callbacks=[es])
    assert ResumableState._latched_stop(trainer) is False  # type: ignore[arg-type]
    es.stopping_reason = EarlyStoppingReason.PATIENCE_EXHAUSTED
    assert ResumableState._latched_stop(trainer) is True  # type: ignore[arg-type]
    es.stopping_reason = EarlyStoppingReason.NOT_STOPPED
    trainer.callbacks = [Timer(timedelta(hours=1)), es]
    assert ResumableState._latched_stop(trainer) is True  # type: ignore[arg-type]
    trainer.should_stop = False
    assert ResumableState._latched_stop(trainer) is False  # type: ignore[arg-type]


@pytest.mark.parametrize("every", ["trainer.check_val_every_n_epoch=1", "trainer.check_val_every_n_epoch=2"])
def test_random_state_saved_at_one_kind_of_stop_is_restored_at_every_kind(tmp_path, every):
    """``nn.Dropout`` and ``torch.rand`` in a step (the global stream), stopped at an epoch's end by the epoch
    limit or the step limit and continued to 4 epochs: the straight run's weights. The continued fit's first
    loader iterator is made again from the restored state, as the straight run made that epoch's (0.04 apart
    without it), where Lightning does not make it: validating every 2 epochs, last.ckpt is written before the
    epoch's end, which the continued run replays before the next epoch makes its iterator."""
    args = [*BASE, "model._target_=users_models.GlobalDropoutMLP", "trainer.max_epochs=4", every]
    train(compose_cfg(*args), tmp_path / "straight")
    for i, stop in enumerate(["trainer.max_epochs=2", "trainer.max_steps=24"]):
        continued = _stop_and_continue(tmp_path / f"stop{i}", args, [stop])
        assert global_step(continued) == global_step(tmp_path / "straight") == 4 * 12
        assert _apart(continued, tmp_path / "straight") <= 1e-6, stop


def _scheduled(model: str) -> list[str]:
    return [*BASE, f"model._target_=users_models.{model}"]


@pytest.mark.parametrize(
    "model,line",
    [
        (
            "CosineMLP",
            "CosineAnnealingLR was built with T_max=2 for the limit the checkpoint's run had, and this run builds "
            "T_max=3: the continued run follows the first schedule, so it cannot equal a straight run to this limit "
            "(its learning rate from step 2: 0, 0.1, 0.2, 0.1; a straight run's: 0.05, 0, 0.05, 0.15); keep the first "
            "run's limit, or use a schedule that does not depend on it",
        ),
        (
            "OneCycleMLP",
            "OneCycleLR was built with total_steps=24 for the limit the checkpoint's run had, and this run builds "
            "total_steps=36: the continued run follows the first schedule, so it cannot equal a straight run to this "
            "limit (its learning rate from step 24: 0.00174, then its step raises ValueError: Tried to step 25 times. "
            "The specified number of total steps is 24; a straight run's: 0.0802, 0.0682, 0.0566, 0.0457); keep the "
            "first run's limit, or use a schedule that does not depend on it",
        ),
    ],
)
def test_a_continued_run_whose_restored_schedule_was_built_for_another_limit_says_so(tmp_path, caplog, model, line):
    """Continued from 2 epochs to 3: one line at the continue, naming the scheduler and what to do (the restored
    OneCycleLR then refuses its 25th step, as torch does)."""
    train(compose_cfg(*_scheduled(model), "trainer.max_epochs=2"), tmp_path / "first")
    ckpt = tmp_path / "first/checkpoints/last.ckpt"
    with caplog.at_level(logging.WARNING, logger="dpddp.continuity.state"):
        continued = compose_cfg(*_scheduled(model), "trainer.max_epochs=3", f"ckpt_path={ckpt}")
        if model == "OneCycleMLP":
            with pytest.raises(ValueError, match="Tried to step 25 times. The specified number of total steps is 24"):
                train(continued, tmp_path / "continued")
        else:
            train(continued, tmp_path / "continued")
    assert [r.getMessage() for r in caplog.records if r.name == "dpddp.continuity.state"] == [line]


@pytest.mark.parametrize(
    "model,first,then",
    [
        ("StepLRMLP", "trainer.max_epochs=2", "trainer.max_epochs=3"),  # a schedule that does not depend on it
        ("CosineMLP", "trainer.max_steps=20", "trainer.max_steps=-1"),  # the same max_epochs: built the same
    ],
)
def test_a_continued_run_whose_schedule_does_not_depend_on_the_limit_says_nothing(tmp_path, caplog, model, first, then):
    """No line where the continued run's schedule builds as the first one did; and it equals the straight run."""
    args = [*_scheduled(model), "trainer.max_epochs=3"]
    train(compose_cfg(*args, first), tmp_path / "first")
    ckpt = tmp_path / "first/checkpoints/last.ckpt"
    with caplog.at_level(logging.WARNING, logger="dpddp.continuity.state"):
        train(compose_cfg(*args, then, f"ckpt_path={ckpt}"), tmp_path / "continued")
    assert [r.getMessage() for r in caplog.records if r.name == "dpddp.continuity.state"] == []
    train(compose_cfg(*args, then), tmp_path / "straight")
    assert _apart(tmp_path / "continued", tmp_path / "straight") <= 1e-6


def _table(run: Path) -> list[dict[str, str]]:
    """``metrics.csv``'s rows without the columns of time and memory."""
    with open(run / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    kept = ("stage", "epoch", "step", "train/loss", "val/loss", "val/acc", "test/loss", "test/acc", "world_size")
    return [{k: row[k] for k in kept} for row in rows]


def test_outputs_of_a_continued_run_keep_what_was_measured_before_the_stop(tmp_path):
    """Validations every 5 steps (12 an epoch): a SIGTERM at step 11 comes after epoch 0's last validation (step
    10). The continued run's epoch table, from which the epoch lines and the curves come, is the straight run's
    (epoch 0's val columns were empty)."""
    args = [*BASE, "+trainer.val_check_interval=5", "trainer.check_val_every_n_epoch=null", "trainer.max_epochs=3"]
    train(compose_cfg(*args), tmp_path / "straight")
    kill = ["+callbacks.kill._target_=conftest.SigtermAtStep", "+callbacks.kill.step=10"]
    continued = _stop_and_continue(tmp_path, args, kill)
    assert global_step(tmp_path / "first") == 11
    table, straight = _table(continued), _table(tmp_path / "straight")
    assert [r["epoch"] for r in straight] == ["0", "1", "2", "2"] and straight[0]["val/loss"] != ""
    assert len(table) == len(straight)
    for row, expected in zip(table, straight, strict=True):
        assert row.keys() == expected.keys()
        for k, v in expected.items():
            assert row[k] == v or float(row[k]) == pytest.approx(float(v), abs=1e-6), (k, row, expected)


# val/loss with min_delta=0.5: no later epoch improves on epoch 0 by that much, so it ends the run after epoch 1;
# with patience=5 it never ends the run (max_epochs=3)
LIMIT_CUT_ES = [
    *BASE,
    "trainer.max_epochs=3",
    "+callbacks.es._target_=lightning.pytorch.callbacks.EarlyStopping",
    "+callbacks.es.monitor=val/loss",
    "+callbacks.es.min_delta=0.5",
]


@pytest.mark.parametrize(
    ("patience", "stop_step", "straight_step"),
    [(0, 13, 2 * 12), (0, 20, 2 * 12), (5, 13, 3 * 12), (5, 30, 3 * 12)],  # inside epochs 1 and 2
)
def test_a_limit_stop_inside_an_epoch_with_early_stopping_continues_to_the_straight_runs_step_and_weights(
    tmp_path, patience, stop_step, straight_step
):
    """``max_steps`` inside an epoch, then continued: the step and weights of the straight run, with an
    EarlyStopping that ends the straight run early (patience 0) and one that does not (patience 5)."""
    args = [*LIMIT_CUT_ES, f"+callbacks.es.patience={patience}"]
    train(compose_cfg(*args), tmp_path / "straight")
    assert global_step(tmp_path / "straight") == straight_step
    continued = _stop_and_continue(tmp_path, args, [f"trainer.max_steps={stop_step}"])
    assert global_step(tmp_path / "first") == stop_step
    assert global_step(continued) == straight_step
    assert _apart(continued, tmp_path / "straight") <= 1e-6


def test_a_max_steps_stop_inside_epoch_0_with_a_strict_early_stopping_ends_0_and_continues_exactly(tmp_path):
    """``max_steps=5`` cuts epoch 0 before its validation: Lightning's epoch-end check of a strict EarlyStopping
    on val/loss raised (no val/loss yet). The check of a cut epoch is skipped: the run ends with its outputs
    (val/* of the final weights), its checkpoint holds EarlyStopping as it started, and the continued run ends
    at the straight run's step, weights and EarlyStopping state."""
    args = [*BASE, "trainer.max_epochs=3", "+callbacks.es._target_=lightning.pytorch.callbacks.EarlyStopping"]
    args += ["+callbacks.es.monitor=val/loss", "+callbacks.es.strict=true"]
    train(compose_cfg(*args), tmp_path / "straight")
    continued = _stop_and_continue(tmp_path, args, ["trainer.max_steps=5"])
    assert global_step(tmp_path / "first") == 5
    assert {"val/loss", "val/acc", "test/loss"} <= json.loads((tmp_path / "first/metrics.json").read_text()).keys()
    first_es = [v for k, v in checkpoint(tmp_path / "first")["callbacks"].items() if k.startswith("EarlyStopping")]
    assert first_es[0]["wait_count"] == 0 and first_es[0]["best_score"].item() == float("inf")
    assert global_step(continued) == global_step(tmp_path / "straight") == 3 * 12
    states = [
        {k: v for k, v in checkpoint(run)["callbacks"].items() if k.startswith("EarlyStopping")}
        for run in (continued, tmp_path / "straight")
    ]
    assert states[0] == states[1] and len(states[0]) == 1
    assert _apart(continued, tmp_path / "straight") <= 1e-6
