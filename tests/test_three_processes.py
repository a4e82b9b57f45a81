"""Cases 46, 47, 48 and 55 on ddp(3), in one setup: a model drawing from the global random stream, a data set
augmenting from the global streams in ``__getitem__``, an EarlyStopping that trips before ``min_epochs`` and a
validation inside each epoch. An epoch-limit stop (with loader workers) and a SIGTERM after an epoch's last
validation (without), each resumed, end with the straight ddp(3) run's step, weights and epoch table. Cases 45
(StochasticWeightAveraging's average is the final model) and 57 (a schedule built for the first limit, said in one
line) on ddp(3). The other stop kinds of issue 36 on ddp(3): a ``max_steps`` stop inside an epoch, and a SIGKILL of
every process after a step-interval checkpoint, each continued, end as the straight run too."""

from __future__ import annotations

import os
import random
import signal
from pathlib import Path

import lightning.pytorch as pl
import psutil
import pytest
from conftest import (
    QUIET,
    SigtermAtStep,
    compose_cfg,
    global_step,
    leftover,
    made_once,
    max_diff,
    metrics,
    run_train,
    weights,
)
from elastic_kill import _StopEachStep
from test_predictions import _rows
from test_randomness import AUG
from test_stop_kinds import BASE, LATCHED, _apart, _table
from test_weight_averaging import BASE as SWA_BASE
from test_weight_averaging import SWA, _other_weights
from users_models import GlobalDropoutMLP, ScriptedScoreMLP

from dpddp.run.training import train

ENV = {"PYTHONPATH": str(Path(__file__).parent)}
DDP3 = ["accelerator=cpu", "strategy=ddp", "devices=3"]
# AugBlobs (600 samples: 480 train) in global batches of 48: 10 steps an epoch. Validations at global steps 7, 14,
# 21, 28, 35, 42, ... (epochs 0, 1, 2, 2, 3, 4, ...); val/score by epoch 1.0, 2.0, 0.5, 0.4 (then 0.4), patience 1:
# EarlyStopping trips at step 14 (epoch 1) and again at 28; min_epochs=4 holds the run to step 40. A continued run
# that lost the latched flag trips again at step 42 only, and stops there.
ARGS = [a for a in AUG if a not in QUIET and not a.startswith(("data.batch_size", "trainer.max_epochs"))]
ARGS += ["model._target_=test_three_processes.ScriptedDropoutMLP", "data.batch_size=48"]
ARGS += [a for a in LATCHED if a.startswith(("+callbacks.es", "trainer.min_epochs", "trainer.max_epochs"))]
ARGS += ["+trainer.val_check_interval=7", "trainer.check_val_every_n_epoch=null"]
STRAIGHT_STEP = 4 * 10


class ScriptedDropoutMLP(ScriptedScoreMLP, GlobalDropoutMLP):
    """``ScriptedScoreMLP``'s val/score course with ``GlobalDropoutMLP``'s ``nn.Dropout`` and ``torch.rand``."""


class SigtermAtStepEveryRankAgreeing(_StopEachStep, SigtermAtStep):
    """``conftest.SigtermAtStep`` (every rank signals itself) with the ranks agreeing on a stop at each step: the
    run stops at ``step + 1``, not at the next paced agreement (about a second later)."""


class SigkillRunAtStep(pl.Callback):
    """Rank 0, before the training batch that takes global step ``step + 1`` (once its background write is done):
    SIGKILL to every process of the run, its launched ranks and itself."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: pl.Trainer, *args: object) -> None:
        if trainer.is_global_zero and trainer.global_step == self.step:
            trainer.strategy.checkpoint_io.wait()
            for child in psutil.Process().children(recursive=True):
                child.send_signal(signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)


def _train(cwd: Path, *extra: str):
    return run_train(*DDP3, *ARGS, *extra, "hydra.run.dir=run", cwd=cwd, env=ENV)


def _continued_is_straight(tmp_path: Path, straight: Path, *args: str) -> None:
    """``resume=true`` into ``tmp_path/run`` with ``args`` ends like the straight run: exit 0, nothing left, step
    40, weights within 1e-6 and its epoch table."""
    continued = _train(tmp_path, *args, "resume=true")
    assert continued.returncode == 0 and leftover(continued.tag) == [], continued.stderr[-3000:]
    assert global_step(tmp_path / "run") == STRAIGHT_STEP
    assert _apart(tmp_path / "run", straight) <= 1e-6
    _same_table(tmp_path / "run", straight)


def _same_table(run: Path, straight: Path) -> None:
    """``metrics.csv``'s rows (every epoch's val columns, the test's) are the straight run's, values to 1e-6."""
    table, expected = _table(run), _table(straight)
    assert [r["epoch"] for r in expected] == ["0", "1", "2", "3", "3"] and all(r["val/loss"] for r in expected[:4])
    assert len(table) == len(expected), (table, expected)
    for row, want in zip(table, expected, strict=True):
        for k, v in want.items():
            assert row[k] == v or "" not in (row[k], v) and abs(float(row[k]) - float(v)) <= 1e-6, (k, row, want)


@pytest.fixture(scope="module")
def straight(shared_dir) -> Path:
    """The straight ddp(3) run, without loader workers, made once a session: EarlyStopping trips in epochs 1 and
    2, the run ends at ``min_epochs``."""

    def make(path: Path) -> None:
        proc = run_train(*DDP3, *ARGS, f"hydra.run.dir={path}", cwd=path.parent, env=ENV, check=True)
        lines = (proc.stdout + proc.stderr).splitlines()
        said = [line for line in lines if "EarlyStopping ended the run" in line]
        held = "EarlyStopping ended the run after epoch 3 (it tripped after epoch 2; trainer.min_epochs=4 held the run)"
        assert len(said) == 1 and held in said[0], said  # epoch 2: its last trip (step 28)

    run = made_once(shared_dir, "three-processes-straight", make)
    assert global_step(run) == STRAIGHT_STEP
    return run


VALIDATIONS = (7, 14, 21, 28, 35)  # last.ckpt at each validation too


def _interval_last(step: int, every: int, after: int) -> bool:
    """Whether the last ``last.ckpt`` written before ``step`` by a run continued from step ``after`` is an interval
    one (every ``every`` steps) inside an epoch: not an epoch's end, nor a validation's (``VALIDATIONS``)."""
    saved = step // every * every
    inside = step % 10 != 0 and saved % 10 != 0 and saved != step and saved > after
    return inside and not any(saved <= v <= step for v in VALIDATIONS)


@pytest.mark.slow
def test_an_epoch_limit_stop_with_loader_workers_resumed_on_three_processes_is_the_straight_run(tmp_path, straight):
    """Cases 48, 47 and 46: ``max_epochs=3`` (step 30, EarlyStopping tripped, ``min_epochs`` not reached) with one
    loader worker per rank, resumed to ``max_epochs=8``: every rank's random state and the latched flag travel
    (workers' draws are keyed by the sample): step 40 and the straight run's weights and epoch table."""
    workers = "data.num_workers=1"
    first = _train(tmp_path, workers, "trainer.max_epochs=3")
    assert first.returncode == 0 and leftover(first.tag) == [], first.stderr[-3000:]
    assert global_step(tmp_path / "run") == 30
    _continued_is_straight(tmp_path, straight, workers)


@pytest.mark.slow
def test_a_max_steps_stop_a_sigterm_and_a_sigkill_after_a_step_interval_checkpoint_continue_exactly(tmp_path, straight):
    """One run stopped three ways, each continued (``resume=true``) into the next: ``max_steps`` at a seeded step
    inside an epoch (24: epoch 2, after the trip at 14 and the validation at 21; the cut epoch's rows); a SIGTERM
    to every rank before step 29, after epoch 2's last validation (step 28; cases 55, 46 and 47): exit 143 at step
    29; with ``checkpoint.every_n_steps=4`` (which writes ``last.ckpt`` and changes nothing else), every process
    SIGKILLed at a seeded step inside epoch 3 after an interval write (not the validation's). The last continue
    starts from that interval ``last.ckpt`` and ends at step 40 with the straight run's weights and epoch table
    (the cut epoch's row, written at each stop, is made again; epoch 2's row keeps the val columns measured before
    the stop)."""
    stop = random.Random(36).choice([s for s in range(1, STRAIGHT_STEP) if s % 10])
    first = _train(tmp_path, f"trainer.max_steps={stop}")
    assert first.returncode == 0 and leftover(first.tag) == [], first.stderr[-3000:]
    assert global_step(tmp_path / "run") == stop == 24
    rows = [(e, min(10 * e + 10, stop)) for e in range(stop // 10 + 1)]  # the cut epoch's row too, then the test's
    assert [(r["stage"], r["epoch"], r["step"]) for r in _table(tmp_path / "run")] == [
        *(("fit", str(e), str(step)) for e, step in rows),
        ("test", str(stop // 10), str(stop)),
    ]
    term = ["+callbacks.term._target_=test_three_processes.SigtermAtStepEveryRankAgreeing", "+callbacks.term.step=28"]
    stopped = _train(tmp_path, *term, "resume=true")
    assert stopped.returncode == 143 and leftover(stopped.tag) == [], stopped.stderr[-3000:]
    assert global_step(tmp_path / "run") == 29
    every = 4
    kill = random.Random(36).choice([s for s in range(30, STRAIGHT_STEP) if _interval_last(s, every, 29)])
    interval = f"checkpoint.every_n_steps={every}"
    kill_at = ["+callbacks.kill._target_=test_three_processes.SigkillRunAtStep", f"+callbacks.kill.step={kill}"]
    killed = _train(tmp_path, *term, interval, *kill_at, "resume=true")
    assert killed.returncode == -signal.SIGKILL and leftover(killed.tag) == [], killed.stderr[-3000:]
    saved = global_step(tmp_path / "run")
    assert saved == kill // every * every and 0 < kill - saved < every, (kill, saved)
    assert not (tmp_path / "run/checkpoints/last.ckpt.tmp").exists()
    _continued_is_straight(tmp_path, straight, *term, interval)


@pytest.mark.slow
def test_the_swa_average_is_the_final_model_on_three_processes(tmp_path):
    """Case 45 and promise 1: on ddp(3), ``last.ckpt`` holds SWA's average (0.28 from the raw weights), ``val/*``,
    ``test/*`` and ``predictions.csv`` are its own (one process validating, testing and predicting from it), and the
    run ends with one process's step, weights and metrics (1e-5, as ``test_surface``'s ddp rows)."""
    args = [a for a in SWA_BASE if a not in QUIET] + ["trainer.max_epochs=4", *SWA, "data.batch_size=48"]
    args += ["predict=true"]
    run_train(*DDP3, *args, "hydra.run.dir=run", cwd=tmp_path, env=ENV, check=True)
    run, one = tmp_path / "run", tmp_path / "one"
    train(compose_cfg(*args), one)
    assert metrics(run)["world_size"] == 3 and global_step(run) == global_step(one) == 4 * 16  # 804 train samples
    last = weights(run / "checkpoints/last.ckpt")
    assert max_diff(last, _other_weights(run / "checkpoints/last.ckpt")) == 0.0
    assert max_diff(last, weights(one / "checkpoints/last.ckpt")) <= 1e-5
    for key in ("train/loss", "val/loss", "val/acc", "test/loss", "test/acc"):
        assert metrics(run)[key] == pytest.approx(metrics(one)[key], abs=1e-5), key
    ckpt = f"ckpt_path={run / 'checkpoints/last.ckpt'}"
    for stage in ("validate", "test", "predict"):
        measured = train(compose_cfg(*args, ckpt), tmp_path / stage, stage=stage)
        for key in [k for k in ("val/loss", "val/acc", "test/loss", "test/acc") if k.startswith(stage[:3])]:
            assert metrics(run)[key] == pytest.approx(measured[key], abs=1e-5), key
    rows, own = _rows(run / "predictions.csv"), _rows(tmp_path / "predict/predictions.csv")
    assert len(rows) == len(own) == 100
    assert [[r["index"], r["pred"]] for r in rows] == [[r["index"], r["pred"]] for r in own]
    probs = [(float(a[k]), float(b[k])) for a, b in zip(rows, own, strict=True) for k in a if k.startswith("prob_")]
    assert len(probs) == 400 and max(abs(a - b) for a, b in probs) <= 1e-5


@pytest.mark.slow
def test_a_schedule_built_for_the_first_limit_says_so_once_on_three_processes(tmp_path):
    """Case 57: ``CosineAnnealingLR(T_max=max_epochs)`` stopped at ``max_epochs=2`` and resumed to 4 on ddp(3): one
    line (once, in rank 0's log format) names the scheduler and both builds; the run ends at epoch 4's step."""
    args = [a for a in BASE if a not in QUIET] + ["model._target_=users_models.CosineMLP", "data.batch_size=48"]
    said = []
    for limit, step in (("trainer.max_epochs=2", 2 * 17), ("trainer.max_epochs=4", 4 * 17)):  # 820 train samples
        resume = ["resume=true"] if said else []
        proc = run_train(*DDP3, *args, limit, *resume, "hydra.run.dir=run", cwd=tmp_path, env=ENV, check=True)
        assert global_step(tmp_path / "run") == step
        said.append([line for line in (proc.stdout + proc.stderr).splitlines() if "the continued run" in line])
    line = (
        "CosineAnnealingLR was built with T_max=2 for the limit the checkpoint's run had, and this run builds "
        "T_max=4: the continued run follows the first schedule, so it cannot equal a straight run to this limit "
        "(its learning rate from step 2: 0, 0.1, 0.2, 0.1; a straight run's: 0.1, 0.0293, 0, 0.0293); keep the first "
        "run's limit, or use a schedule that does not depend on it"
    )
    assert said[0] == [] and len(said[1]) == 1 and said[1][0].endswith(f"[dpddp.continuity.state][WARNING] - {line}")
