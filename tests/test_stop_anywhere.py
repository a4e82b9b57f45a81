"""A SIGTERM outside the training loop (start-up, the test after the fit) ends the run with ``Preempted``, its
last checkpoint and step, which every entry point prints as one line with the resume command (exit 143), not a
silent exit; the resumed run ends with the straight run's weights and a whole ``metrics.json``."""

import io
import logging
import os
import shlex
import signal
import sys

import lightning.pytorch as pl
import psutil
import pytest
from conftest import (
    QUIET,
    ROOT,
    compose_cfg,
    global_step,
    leftover,
    max_diff,
    metrics,
    run_train,
    train_py_here,
    weights,
)

from dpddp.continuity.stop import ON_SIGTERM, TRANSITIONS, Action, Phase, RunScope, run_stops, starting_up
from dpddp.data.random_tensors import RandomTensorDataModule
from dpddp.errors import Preempted, exit_on, rank_status
from dpddp.run.training import train

BASE = [*QUIET, "accelerator=cpu", "data.num_samples=1005", "logger=none", "trainer.max_epochs=2"]


class SigtermOn(pl.Callback):
    """Sends this process SIGTERM in hook ``hook`` (``setup``: the fit's start-up; ``on_test_start``)."""

    def __init__(self, hook: str) -> None:
        self.hook = hook

    def setup(self, trainer, pl_module, stage):
        if self.hook == "setup" and stage == "fit":
            os.kill(os.getpid(), signal.SIGTERM)

    def on_test_start(self, trainer, pl_module):
        if self.hook == "on_test_start":
            os.kill(os.getpid(), signal.SIGTERM)


def _kill(hook):
    return ["+callbacks.kill._target_=test_stop_anywhere.SigtermOn", f"+callbacks.kill.hook={hook}"]


def test_a_sigterm_while_testing_stops_with_the_final_checkpoint_and_resumes_to_whole_outputs(tmp_path):
    with pytest.raises(Preempted) as stop:
        train(compose_cfg(*BASE, *_kill("on_test_start")), tmp_path / "run")
    assert stop.value.step == 24 and stop.value.path == tmp_path / "run" / "checkpoints" / "last.ckpt"
    assert str(stop.value).startswith("stopped by SIGTERM after step 24; checkpoint: ")
    assert not (tmp_path / "run" / "metrics.json").exists()
    straight = train(compose_cfg(*BASE), tmp_path / "straight")
    resumed = train(compose_cfg(*BASE, f"ckpt_path={stop.value.path}"), tmp_path / "resumed")
    assert max_diff(weights(tmp_path / "resumed/checkpoints/last.ckpt"), weights(stop.value.path)) == 0
    assert max_diff(weights(stop.value.path), weights(tmp_path / "straight/checkpoints/last.ckpt")) <= 1e-6
    for key in ("val/loss", "test/loss", "test/acc"):
        assert resumed[key] == pytest.approx(straight[key], abs=1e-6), key
    assert metrics(tmp_path / "resumed")["test/acc"] == pytest.approx(straight["test/acc"], abs=1e-6)


def test_a_sigterm_during_start_up_stops_before_any_checkpoint(tmp_path):
    with pytest.raises(Preempted) as stop:
        train(compose_cfg(*BASE, *_kill("setup")), tmp_path / "run")
    assert stop.value.path is None and str(stop.value) == "stopped by SIGTERM before its first checkpoint"
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # the run's handler is gone with it


class SigtermInInit(RandomTensorDataModule):
    """A data module whose construction gets a SIGTERM (``instantiate`` would wrap an exception raised there)."""

    def __init__(self, **kwargs) -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        super().__init__(**kwargs)


def test_a_sigterm_while_building_the_data_is_preempted_not_a_failure_of_that_step(tmp_path):
    """Not ``instantiate``'s wrapped error (exit 1), nor a config error naming the class (exit 2)."""
    with pytest.raises(Preempted) as stop:
        train(compose_cfg(*BASE, "data._target_=test_stop_anywhere.SigtermInInit"), tmp_path / "run")
    assert stop.value.path is None and str(stop.value) == "stopped by SIGTERM before its first checkpoint"


def test_a_sigterm_during_start_up_is_held_to_its_end(tmp_path):
    with pytest.raises(Preempted), run_stops(tmp_path) as scope, starting_up(scope):
        os.kill(os.getpid(), signal.SIGTERM)
        assert scope.held  # still running: the import or build in progress is not interrupted
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL


def test_a_sigterm_while_testing_under_a_sweeps_handler_is_preempted_not_a_silent_exit(tmp_path):
    """In a sweep the sweep's handler keeps the signal (it stops the sweep) and Lightning's evaluation loop ends
    the test with its SIGTERMException, a SystemExit of status 0 that would end the sweep with no summary: the run
    ends with ``Preempted`` instead, and the sweep's handler was called."""
    calls = []
    before = signal.signal(signal.SIGTERM, lambda signum, frame: calls.append(signum))
    try:
        with pytest.raises(Preempted) as stop:
            train(compose_cfg(*BASE, *_kill("on_test_start")), tmp_path / "run")
    finally:
        signal.signal(signal.SIGTERM, before)
    assert calls == [signal.SIGTERM]
    assert stop.value.step == 24 and stop.value.path == tmp_path / "run" / "checkpoints" / "last.ckpt"
    assert not (tmp_path / "run" / "metrics.json").exists()


class SigtermRankAt(pl.Callback):
    """Sends this process SIGTERM at the end of training batch ``at`` (counted over the run) on global rank ``rank``
    only: with ``at`` the fit's last batch, the signal lands after the last agreement the ranks would have made."""

    def __init__(self, at: int, rank: int) -> None:
        self.at, self.rank, self.seen = at, rank, 0

    def on_train_batch_end(self, trainer, *args):
        if self.seen == self.at and trainer.global_rank == self.rank:
            os.kill(os.getpid(), signal.SIGTERM)
        self.seen += 1


class SigtermRankOnTest(pl.Callback):
    """Sends this process SIGTERM at the start of the test after the fit, on global rank ``rank`` only."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def on_test_start(self, trainer, pl_module):
        if trainer.global_rank == self.rank:
            os.kill(os.getpid(), signal.SIGTERM)


def _said_stop(status: int, stderr: str, left: list[int], run_dir) -> str:
    """Assert a stop: exit 143, the one line at ``last.ckpt``'s step, no ``metrics.json``, nothing left. Its line."""
    assert status == 143, stderr[-3000:]
    last = run_dir / "checkpoints" / "last.ckpt"
    lines = [x for x in stderr.splitlines() if x.startswith("error: stopped by SIGTERM")]
    said = f"error: stopped by SIGTERM after step {global_step(last)}; checkpoint: {last}: resume with "
    assert len(lines) == 1 and lines[0].startswith(said), stderr[-3000:]
    assert not (run_dir / "metrics.json").exists() and left == []
    return lines[0]


def _stops_at_the_fit_end_then_continues(tmp_path, strategy: str, devices: int, rank: int, run, then=()) -> None:
    """Rank ``rank`` signalled in the fit's last batch stops (``_said_stop``) at the final step; the printed
    command (with ``then``) trains no step more and ends with whole outputs, or, with ``then`` (a SIGTERM in the
    test), stops. ``run(args)`` runs ``train.py ARGS`` in ``tmp_path``: its exit status, stderr, processes left."""
    settings = [f"strategy={strategy}", f"devices={devices}", "accelerator=cpu", "data.num_samples=1005"]
    settings += ["data.batch_size=60", "trainer.max_epochs=2", "model.optimizer=adam"]
    steps = 2 * (1005 - 2 * round(1005 * 0.1)) // 60  # the fit's steps: two epochs of whole global batches
    kill = ["+callbacks.kill._target_=test_stop_anywhere.SigtermRankAt", f"+callbacks.kill.at={steps - 1}"]
    kill.append(f"+callbacks.kill.rank={rank}")
    line = _said_stop(*run([*settings, *kill, "hydra.run.dir=run"]), tmp_path / "run")
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    step, stopped = global_step(last), weights(last)
    assert step == steps
    status, stderr, left = run([*shlex.split(line.split("resume with ", 1)[1])[2:], *then])
    if then:
        _said_stop(status, stderr, left, tmp_path / "run")
    else:
        assert status == 0 and left == [], stderr[-3000:]
        assert metrics(tmp_path / "run")["test/acc"] is not None
    assert global_step(last) == step  # nothing left to train: the fit had ended
    assert max_diff(weights(last), stopped) == 0


@pytest.mark.slow  # the row was slow as a process; the fast tier keeps its time
def test_a_sigterm_in_the_last_step_of_fit_on_one_process_stops_with_the_final_checkpoint(tmp_path, monkeypatch, capfd):
    """One process signalled in the fit's last batch stops at the fit's end; train.py runs here (no rank to agree
    with: the stop is not about a process)."""

    def here(args: list[str]) -> tuple[int, str, list[int]]:
        before = set(psutil.Process().children(recursive=True))  # an earlier test's fork server stays
        status = train_py_here(*args, cwd=tmp_path, monkeypatch=monkeypatch)
        return status, capfd.readouterr().err, [p.pid for p in set(psutil.Process().children(recursive=True)) - before]

    _stops_at_the_fit_end_then_continues(tmp_path, "auto", 1, 0, here)


@pytest.mark.slow
# (a launched rank of ddp(3): ddp(2)'s rank 1 row; a SIGTERM stop on 3 processes: test_three_processes)
@pytest.mark.parametrize("rank", [0, 1])
def test_a_sigterm_in_the_last_steps_of_fit_stops_every_ddp_rank_with_the_final_checkpoint(tmp_path, rank):
    """A signal between the ranks' last agreement and the fit's end (its last batch) is agreed on when the fit
    ends: every rank stops with ``last.ckpt`` at the final step, exit 143 and the one line, before the test. The
    printed command trains no step more: to whole outputs (rank 1), or stopped by a SIGTERM to rank 0 in the test
    (rank 0; the ranks agree on it at a test batch; a launched rank's: test_sigterm_any_moment)."""
    then = ["+callbacks.kill_test._target_=test_stop_anywhere.SigtermRankOnTest", "+callbacks.kill_test.rank=0"]

    def process(args: list[str]) -> tuple[int, str, list[int]]:
        proc = run_train(*args, cwd=tmp_path, env={"PYTHONPATH": str(ROOT / "tests")}, timeout=240)
        return proc.returncode, proc.stderr, leftover(proc.tag)

    _stops_at_the_fit_end_then_continues(tmp_path, "ddp", 2, rank, process, then if rank == 0 else ())


@pytest.mark.parametrize("local_rank", ["0", "1"])
def test_a_stop_line_is_said_once_per_node_and_a_launched_ranks_stop_goes_to_its_log_file_only(
    tmp_path, monkeypatch, capsys, local_rank
):
    """Under torchrun (``LOCAL_RANK``) each node's first process says the stop line, the others exit 143 too
    (every entry point ends through ``exit_on``) and, as a launched rank (``rank_status``), write the stop at INFO
    into their log file, not the console (a console handler and a file handler, as ``log_to`` sets up): the one
    line on the console is the node's first process's. With no log file, the stop is at DEBUG."""
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    stop = Preempted(None, 0)
    log = logging.getLogger("dpddp.test.rank")
    log.propagate, log.handlers = False, [logging.StreamHandler(sys.stderr), logging.FileHandler(tmp_path / "r.log")]
    log.setLevel(logging.INFO)
    with pytest.raises(SystemExit) as exit_:
        exit_on(stop, lambda: "python train.py", log if local_rank == "1" else None)
    said = "error: stopped by SIGTERM before its first checkpoint: resume with python train.py\n"
    assert exit_.value.code == 143 and capsys.readouterr().err == (said if local_rank == "0" else "")
    assert rank_status(stop, log) == 143
    console = capsys.readouterr()
    assert console.err + console.out == ""
    logged = (tmp_path / "r.log").read_text().splitlines()
    assert logged == [str(stop)] * (2 if local_rank == "1" else 1)
    log.handlers = [logging.StreamHandler(shown := io.StringIO())]
    log.handlers[0].setFormatter(logging.Formatter("%(levelname)s %(message)s"))
    log.setLevel(logging.DEBUG)
    assert rank_status(stop, log) == 143
    log.handlers, log.propagate = [], True
    assert shown.getvalue() == f"DEBUG {stop}\n"


REACH = {Phase.OPEN: [], Phase.STARTING: ["start"], Phase.RUNNING: ["start", "started"]}
REACH[Phase.TAIL] = ["start", "started", "finish"]


@pytest.mark.parametrize("phase", list(Phase), ids=lambda p: p.value)
def test_a_sigterm_does_what_the_table_says_for_its_phase(tmp_path, phase):
    """The run's handler, reached by a real SIGTERM in each phase: ``RAISE`` raises ``Preempted``, ``HOLD``
    marks it held, ``REQUEST`` asks the step-boundary stop (the ranks agree on it)."""
    requests, raised = [], False
    with run_stops(tmp_path) as scope:
        for event in REACH[phase]:
            scope.go(event)
        scope.stop = type("Stop", (), {"request": lambda self: requests.append(phase)})()
        if phase is not Phase.RUNNING:
            scope.stop = None  # the trainer's stop exists while running only
        try:
            os.kill(os.getpid(), signal.SIGTERM)
        except Preempted:
            raised = True
        held, scope.held = scope.held, False  # the scope's end would raise a held one
    seen = {Action.RAISE: raised, Action.HOLD: held, Action.REQUEST: requests == [phase]}
    assert [a for a, happened in seen.items() if happened] == [ON_SIGTERM[phase]]


def test_a_run_goes_through_the_phases_in_the_tables_order_and_a_failed_start_reopens(tmp_path, monkeypatch):
    seen = []
    go = RunScope.go
    monkeypatch.setattr(RunScope, "go", lambda self, event: (go(self, event), seen.append(self.phase)))
    train(compose_cfg(*BASE, "trainer.max_epochs=1"), tmp_path / "run")
    assert seen == [Phase.STARTING, Phase.RUNNING, Phase.TAIL]
    seen.clear()
    with pytest.raises(Exception, match="data.num_samples"):
        train(compose_cfg(*BASE, "data.num_samples=-1"), tmp_path / "bad")
    assert seen == [Phase.STARTING, Phase.OPEN]
    assert sorted(e for _, e in TRANSITIONS) == ["failed", "finish", "start", "started"]
    with pytest.raises(RuntimeError, match="no transition from tail on 'start'"):
        RunScope(tmp_path, phase=Phase.TAIL).go("start")
