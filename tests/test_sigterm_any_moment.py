"""A SIGTERM at a seeded random moment around each stage boundary (the fit's last step and its epoch-end
validation, a validation mid-fit, between fit and test, the test, predict, a launched rank's start-up, after the
last agreement, after the job's end, while the straight run's interpreter exits, in the first seconds of every
entry point), to rank 0 or another rank, on ddp(2) and one process: the run ends with 143, ``last.ckpt``
(or none yet) and the one stop line, and the printed resume command ends with the straight run's weights. The
evaluation steps sleep (users_models.SlowEvalMLP), so each stage lasts at least as long as its steps' sleeps: a
delay shorter than the sleeps left after the hook lands before the run's end. Timing places the signal only; no
assertion depends on it."""

from __future__ import annotations

import atexit
import os
import random
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch
from conftest import QUIET, ROOT, child_env, compose_cfg, leftover, made_once, run_train, train_py_here
from hydra.experimental.callback import Callback

from dpddp.continuity.stop import RunScope
from dpddp.data.random_tensors import RandomTensorDataModule
from dpddp.errors import Preempted
from dpddp.run.training import train

SLEEP_S = 0.1  # per evaluation step; 4 steps per rank or more in each of validation, test and predict below
SETTINGS = ["accelerator=cpu", "data.num_samples=1005", "data.batch_size=30", "trainer.max_epochs=2", "model=mlp"]
SETTINGS += ["model._target_=users_models.SlowEvalMLP", f"+model.eval_sleep_s={SLEEP_S}", "predict=true"]
ENV = {"PYTHONPATH": str(ROOT / "tests")}

# hook -> the longest delay after it: less than the evaluation sleeps still due after the hook (4 steps each)
WINDOW_S = {
    "last_train_batch": 8 * SLEEP_S,  # the fit's last step, its epoch-end validation, the test (predict follows)
    "validation": 4 * SLEEP_S,  # the first epoch's validation, mid-fit (another epoch, test, predict follow)
    "fit_end": 6 * SLEEP_S,  # between fit and test, the test (predict follows)
    "test": 4 * SLEEP_S,  # the test (predict follows)
    "predict": 3 * SLEEP_S,  # predict, the run's last stage
    "predict_teardown": 0.0,  # at once (here): after predict's last agreement, before the run's last one
}


def _first(once: str) -> bool:
    """Whether this is the first time for the file ``once`` (made now): the resume command repeats the settings."""
    try:
        Path(once).touch(exist_ok=False)
    except FileExistsError:
        return False
    return True


class SigtermAfter(pl.Callback):
    """On global rank ``rank``, ``delay_s`` seconds after the first ``hook`` (see ``WINDOW_S``), this process gets
    SIGTERM (a timer thread: the signal lands wherever the main thread is then); once per file ``once``."""

    def __init__(self, hook: str, delay_s: float, rank: int, once: str) -> None:
        self.hook, self.delay_s, self.rank, self.once = hook, delay_s, rank, once

    def _arm(self, trainer: pl.Trainer, hook: str) -> None:
        if hook == self.hook and trainer.global_rank == self.rank and _first(self.once):
            pid = os.getpid()
            if self.delay_s == 0:
                os.kill(pid, signal.SIGTERM)
                return
            threading.Timer(self.delay_s, lambda: os.kill(pid, signal.SIGTERM)).start()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.current_epoch == trainer.max_epochs - 1 and batch_idx == trainer.num_training_batches - 1:
            self._arm(trainer, "last_train_batch")

    def on_validation_start(self, trainer, pl_module):
        if not trainer.sanity_checking and trainer.state.fn == "fit" and trainer.current_epoch == 0:
            self._arm(trainer, "validation")

    def on_train_end(self, trainer, pl_module):
        self._arm(trainer, "fit_end")

    def on_test_start(self, trainer, pl_module):
        self._arm(trainer, "test")

    def on_predict_start(self, trainer, pl_module):
        self._arm(trainer, "predict")

    def teardown(self, trainer, pl_module, stage):
        if stage == "predict":
            self._arm(trainer, "predict_teardown")


class SigtermRankInInit(RandomTensorDataModule):
    """A data module whose construction gets a SIGTERM on local rank ``rank`` only (a launched rank's start-up,
    while rank 0 waits for it in the process group's set-up); once per file ``once``."""

    def __init__(self, rank: int, once: str, **kwargs) -> None:
        if int(os.environ.get("LOCAL_RANK", 0)) == rank and _first(once):
            os.kill(os.getpid(), signal.SIGTERM)
        super().__init__(**kwargs)


def _world(strategy: str, devices: int) -> list[str]:
    return [f"strategy={strategy}", f"devices={devices}"]


def _straight(shared_dir) -> Path:
    """The straight ddp(2) run's ``last.ckpt``, made once a session. It gets a SIGTERM while its interpreter exits
    (``SigtermAtExit``; ``stop.command``'s ``at_exit`` answers, on any strategy): 143, the one line naming its final
    checkpoint, its outputs whole."""

    def make(path):
        kill = ["+callbacks.kill._target_=test_sigterm_any_moment.SigtermAtExit", "+callbacks.kill.wait_s=1"]
        proc = run_train(*_world("ddp", 2), *SETTINGS, *kill, f"hydra.run.dir={path}", cwd=path.parent, env=ENV)
        assert proc.returncode == 143, proc.stderr[-3000:]
        lines = [x for x in proc.stderr.splitlines() if "stopped by SIGTERM" in x]
        last = path / "checkpoints/last.ckpt"
        step = torch.load(last, weights_only=True)["global_step"]
        said = f"error: stopped by SIGTERM after step {step}; checkpoint: {last}: resume with "
        assert len(lines) == 1 and lines[0].startswith(said) and (path / "metrics.json").is_file(), lines

    return made_once(shared_dir, "sigterm-straight-ddp-2", make) / "checkpoints" / "last.ckpt"


def _state(ckpt) -> dict[str, torch.Tensor]:
    return torch.load(ckpt, map_location="cpu", weights_only=True)["state_dict"]


def _stops(tmp_path, args: list[str], first_checkpoint: bool = False, whole: bool = False) -> list[str]:
    """Run ``train.py ARGS`` into ``tmp_path/run``; assert the stop (143, the one line, ``last.ckpt`` at its step,
    or none before the ``first_checkpoint``, no process left; ``metrics.json`` there only if the run was ``whole``;
    after a checkpoint, within 120 s: gloo's 180 s timeout, where a rank left waiting alone would end, is not
    waited out). Returns the printed command's arguments (after ``python train.py``)."""
    started = time.monotonic()
    proc = run_train(*args, cwd=tmp_path, env=ENV)
    assert first_checkpoint or time.monotonic() - started < 120, proc.stderr[-3000:]
    assert proc.returncode == 143, proc.stderr[-3000:]
    lines = [x for x in (proc.stderr + proc.stdout).splitlines() if "stopped by SIGTERM" in x]  # the console
    assert len(lines) == 1, proc.stderr[-3000:]  # not a launched rank's too
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    if first_checkpoint:
        assert not last.exists() and lines[0].startswith("error: stopped by SIGTERM before its first checkpoint: ")
    else:
        step = torch.load(last, weights_only=True)["global_step"]
        assert lines[0].startswith(f"error: stopped by SIGTERM after step {step}; checkpoint: {last}: resume with ")
    assert (tmp_path / "run" / "metrics.json").exists() == whole and leftover(proc.tag) == []
    return shlex.split(lines[0].split("resume with ", 1)[1])[2:]


def _same_weights(straight: Path, last: Path) -> None:
    """``last`` holds the weights of the straight run's ``straight`` (1e-5)."""
    expected, ended = _state(straight), _state(last)
    assert expected.keys() == ended.keys()
    assert max((expected[k] - ended[k]).abs().max().item() for k in expected) <= 1e-5


def _sigterm_after(tmp_path, strategy: str, devices: int, hook: str, rank: int) -> list[str]:
    """``SigtermAfter`` at ``hook`` on ``rank``, at a moment seeded by the row, as the callback ``kill_<hook>``."""
    delay = random.Random(f"{strategy}{devices}{hook}{rank}").uniform(0, WINDOW_S[hook])
    key = f"+callbacks.kill_{hook}"
    kill = [f"{key}._target_=test_sigterm_any_moment.SigtermAfter", f"{key}.hook={hook}", f"{key}.rank={rank}"]
    return [*kill, f"{key}.delay_s={delay:.3f}", f"{key}.once={tmp_path}/sent-{hook}"]


# ddp(2)'s stops in the order a run meets them: a launched rank's, at a seeded moment of each stage; rank 0 of ddp(2)
# at fit_end and predict: the entry points' cases; a launched rank of ddp(3) stopped in validation: ddp(2)'s rank 1
# here, 3 ranks in test_three_processes
DDP_STOPS = [("validation", 1), ("last_train_batch", 1), ("test", 1), ("predict_teardown", 1)]


@pytest.mark.slow
def test_a_sigterm_at_a_random_moment_of_any_stage_stops_every_ddp_rank_and_each_command_continues_to_the_next(
    tmp_path, shared_dir
):
    """One ddp(2) run stopped six times, each printed command run with the next stop added, the last one to the
    straight run's weights (a wrong continue at any stop carries into them): in a launched rank's start-up (held
    to its end, then the first agreement stops every rank before any checkpoint); at a seeded moment of each stage
    of ``DDP_STOPS``; after the ranks' last agreement, to a launched rank (no outputs; the command makes them)."""
    data = ["data._target_=test_sigterm_any_moment.SigtermRankInInit", "+data.rank=1", f"+data.once={tmp_path}/sent"]
    command = _stops(tmp_path, [*_world("ddp", 2), *SETTINGS, *data, "hydra.run.dir=run"], first_checkpoint=True)
    for hook, rank in DDP_STOPS:
        command = _stops(tmp_path, [*command, *_sigterm_after(tmp_path, "ddp", 2, hook, rank)])
    delay = random.Random("afterddp21").uniform(0, 0.4)
    kill = ["+callbacks.kill._target_=test_sigterm_any_moment.SigtermAfterTheRun", "+callbacks.kill.rank=1"]
    kill += [
        f"+callbacks.kill.delay_s={delay:.3f}",
        "+callbacks.kill.wait_s=0.5",
        f"+callbacks.kill.once={tmp_path}/sent-run",
    ]
    command = _stops(tmp_path, [*command, *kill])
    resumed = run_train(*command, cwd=tmp_path, env=ENV)
    assert resumed.returncode == 0 and (tmp_path / "run" / "metrics.json").is_file(), resumed.stderr[-3000:]
    _same_weights(_straight(shared_dir), tmp_path / "run" / "checkpoints" / "last.ckpt")


@pytest.mark.slow
def test_a_sigterm_mid_fit_then_after_the_jobs_end_stops_one_process_and_continues_to_the_straight_weights(
    tmp_path, monkeypatch
):
    """One process stopped at a seeded moment of its first validation; its command stopped at a seeded moment
    after the job's end (the outputs written and kept); that command (run here) ends without a step more, with the
    straight run's weights."""
    command = [
        *_world("auto", 1),
        *SETTINGS,
        *_sigterm_after(tmp_path, "auto", 1, "validation", 0),
        "hydra.run.dir=run",
    ]
    command = _stops(tmp_path, command)
    delay = random.Random("afterauto10").uniform(0, 0.4)
    kill = ["+hydra.callbacks.kill._target_=test_sigterm_any_moment.SigtermAfterTheJob"]
    kill += [f"+hydra.callbacks.kill.delay_s={delay:.3f}", "+hydra.callbacks.kill.wait_s=0.5"]
    command = _stops(tmp_path, [*command, *kill], whole=True)
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    step = torch.load(last, weights_only=True)["global_step"]
    assert train_py_here(*command, cwd=tmp_path, monkeypatch=monkeypatch) == 0
    assert torch.load(last, weights_only=True)["global_step"] == step
    train(compose_cfg(*QUIET, *_world("auto", 1), *SETTINGS), tmp_path / "straight")  # here: the weights only
    _same_weights(tmp_path / "straight" / "checkpoints" / "last.ckpt", last)


class SigtermInValidation(pl.Callback):
    """This process gets SIGTERM at the start of validation batch 1 of epoch ``epoch`` (mid-fit), once per file
    ``once``."""

    def __init__(self, epoch: int, once: str) -> None:
        self.epoch, self.once = epoch, once

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        fitting = trainer.state.fn == "fit" and not trainer.sanity_checking
        if fitting and trainer.current_epoch == self.epoch and batch_idx == 1 and _first(self.once):
            os.kill(os.getpid(), signal.SIGTERM)


PLATEAU = [*QUIET, "accelerator=cpu", "data.num_samples=1005", "logger=none", "trainer.max_epochs=3"]
PLATEAU += ["model=mlp", "model._target_=users_models.PlateauMLP", "data.batch_size=30"]


def test_a_sigterm_mid_validation_lets_a_plateau_scheduler_see_the_whole_validation_before_the_stop(tmp_path):
    """The validation inside the fit runs to its end, and the epoch too, before the stop at the next step, so
    ``ReduceLROnPlateau`` on ``val/loss`` (users_models.PlateauMLP) steps on the whole epoch's value: stopped in
    epoch 0's validation, continued and stopped in epoch 1's, continued again, the run ends with the straight
    run's weights exactly (stopped at validation batch 1 and continued from there, they differed by up to 0.052)."""
    args, resume = list(PLATEAU), []
    for epoch in (0, 1):
        key = f"+callbacks.kill_{epoch}"
        args += [f"{key}._target_=test_sigterm_any_moment.SigtermInValidation", f"{key}.epoch={epoch}"]
        args.append(f"{key}.once={tmp_path}/sent-{epoch}")
        with pytest.raises(Preempted) as stop:
            train(compose_cfg(*args, *resume), tmp_path / f"run{epoch}")
        assert stop.value.step == 26 * (epoch + 1) + 1  # the next step: 805 training samples / 30 a step
        resume = [f"ckpt_path={stop.value.path}"]
    resumed = train(compose_cfg(*args, *resume), tmp_path / "resumed")
    measured = train(compose_cfg(*PLATEAU), tmp_path / "straight")
    ended, expected = (
        _state(tmp_path / "resumed/checkpoints/last.ckpt"),
        _state(tmp_path / "straight/checkpoints/last.ckpt"),
    )
    assert max((ended[k] - expected[k]).abs().max().item() for k in expected) == 0
    assert resumed["val/loss"] == pytest.approx(measured["val/loss"], abs=1e-6)


class SigtermAfterTheRun(pl.Callback):
    """On global rank ``rank``, once its run's last agreement has passed (``RunScope.finish`` returned, at the end
    of its last stage), this process gets SIGTERM ``delay_s`` seconds later, while the run's tail waits
    ``wait_s`` (longer): the signal lands after every agreement; once per file ``once``."""

    def __init__(self, rank: int, delay_s: float, wait_s: float, once: str) -> None:
        self.rank, self.delay_s, self.wait_s, self.once = rank, delay_s, wait_s, once

    def teardown(self, trainer, pl_module, stage):
        if stage != "predict" or trainer.global_rank != self.rank or not _first(self.once):
            return
        finish, pid = RunScope.finish, os.getpid()

        def finish_then_sigterm(scope):
            finish(scope)
            threading.Timer(self.delay_s, lambda: os.kill(pid, signal.SIGTERM)).start()
            time.sleep(self.wait_s)

        RunScope.finish = finish_then_sigterm


class SigtermAfterTheJob(Callback):
    """A Hydra callback: ``delay_s`` seconds after the job's end (``train`` returned, its outputs written), this
    process gets SIGTERM while the callback waits ``wait_s`` (longer): Hydra ends the job, then the command."""

    def __init__(self, delay_s: float, wait_s: float) -> None:
        self.delay_s, self.wait_s = delay_s, wait_s

    def on_job_end(self, config, job_return, **kwargs) -> None:
        pid = os.getpid()
        threading.Timer(self.delay_s, lambda: os.kill(pid, signal.SIGTERM)).start()
        time.sleep(self.wait_s)


def _cli(args: list[str]) -> list[str]:
    """``SETTINGS`` (and ``+callbacks.kill.*``) in the Lightning CLI's spelling; the CLI's fit does not predict."""
    out = ["fit", "--trainer.strategy=ddp", "--trainer.devices=2", "--trainer.accelerator=cpu"]
    out += ["--model=users_models.SlowEvalMLP", f"--model.eval_sleep_s={SLEEP_S}", "--model.num_features=16"]
    out += ["--model.num_classes=4", "--data.num_samples=1005"]
    out += ["--data.batch_size=30", "--trainer.max_epochs=2", "--trainer.enable_progress_bar=false"]
    out.append("--trainer.callbacks+=test_sigterm_any_moment.SigtermAfter")
    out += [
        f"--trainer.callbacks.{a.split('.', 2)[2]}"
        for a in args
        if a.startswith("+callbacks.kill.") and "_target_" not in a
    ]
    return [*out, "--trainer.default_root_dir=run"]


ENTRY_POINTS = {  # entry -> (the command before the settings, its exit status on a stop)
    "ddp_spawn": ([str(ROOT / "train.py"), "strategy=ddp_spawn", "devices=2"], 143),
    # torchrun's own status when a worker fails (exit 143): elastic_launch raises ChildFailedError, which its
    # @record main re-raises (torch/distributed/run.py, elastic/multiprocessing/errors)
    "torchrun": (
        ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(ROOT / "train.py")]
        + ["strategy=ddp", "devices=2"],
        1,
    ),
    "cli": (["-m", "dpddp.cli"], 143),
}


@pytest.mark.slow
@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
def test_a_sigterm_at_a_random_moment_stops_every_entry_point_and_continues_to_the_straight_weights(
    tmp_path, shared_dir, entry
):
    """ddp_spawn, torchrun and the Lightning CLI: a seeded random stage and rank (the CLI's fit does not predict),
    143 (torchrun: its own 1, its workers' 143 in its report), the one line, no process left, and the printed
    command (run as printed: under torchrun, dpddp's own launcher) ends with the straight ddp(2) run's weights."""
    rng = random.Random(entry)
    hook = rng.choice([h for h in WINDOW_S if entry != "cli" or not h.startswith("predict")])
    rank, delay = rng.randrange(2), rng.uniform(0, WINDOW_S[hook])
    kill = ["+callbacks.kill._target_=test_sigterm_any_moment.SigtermAfter", f"+callbacks.kill.hook={hook}"]
    kill += [
        f"+callbacks.kill.delay_s={delay:.3f}",
        f"+callbacks.kill.rank={rank}",
        f"+callbacks.kill.once={tmp_path}/sent",
    ]
    prefix, status = ENTRY_POINTS[entry]
    args = _cli(kill) if entry == "cli" else [*SETTINGS, *kill, *QUIET, "hydra.run.dir=run"]
    full_env, tag = child_env(**ENV)
    cmd = [sys.executable, *prefix, *args]
    proc = subprocess.run(cmd, cwd=tmp_path, env=full_env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == status, proc.stderr[-3000:]
    lines = [x for x in (proc.stderr + proc.stdout).splitlines() if "stopped by SIGTERM" in x]  # the console
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]  # not a launched rank's too
    last = tmp_path / "run" / ("lightning_logs/version_0/" if entry == "cli" else "") / "checkpoints" / "last.ckpt"
    step = torch.load(last, weights_only=True)["global_step"]
    where, command = lines[0].split(": resume with ", 1)
    assert where.startswith(f"error: stopped by SIGTERM after step {step}; checkpoint: ")
    assert (tmp_path / where.split("checkpoint: ", 1)[1]).resolve() == last.resolve() and leftover(tag) == []
    printed = shlex.split(command)
    resumed_cmd = (
        [sys.executable, "-m", "dpddp.cli", *printed[1:]] if entry == "cli" else [sys.executable, *printed[1:]]
    )
    resumed = subprocess.run(resumed_cmd, cwd=tmp_path, env=full_env, capture_output=True, text=True, timeout=240)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    _same_weights(_straight(shared_dir), last)


def _held(pid: int) -> bool:
    """Whether process ``pid`` answers SIGTERM: it blocks it (held from its first line) or has a handler for it."""
    status = Path(f"/proc/{pid}/status").read_text()
    masks = dict(line.split(":\t") for line in status.splitlines() if line.startswith(("SigBlk", "SigCgt")))
    return any(int(masks[key], 16) >> (signal.SIGTERM - 1) & 1 for key in ("SigBlk", "SigCgt"))


EARLY = {  # entry -> the command (the settings in its spelling), the program its printed command starts with
    # (train.py with strategy=ddp devices=2: its seeded moment, 1.6 s in, lands in the imports as train.py's, 1.8 s
    # in, does, before any setting is read: the same path)
    "train.py": ([sys.executable, str(ROOT / "train.py"), "accelerator=cpu", *QUIET, "hydra.run.dir=run"], "python"),
    "dpddp fit": (
        [str(Path(sys.executable).with_name("dpddp")), "fit", "--trainer.accelerator=cpu"]
        + ["--trainer.enable_progress_bar=false", "--trainer.default_root_dir=run"],
        "dpddp",
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("entry", list(EARLY))
def test_a_sigterm_in_the_first_seconds_of_every_entry_point_stops_with_143_and_the_line(tmp_path, entry):
    """A SIGTERM at a seeded random moment of the first seconds (imports, Hydra's composition or the CLI's parse,
    start-up), once the process is past its first line: 143, exactly one stop line (none at a rank's ERROR level),
    its command the given one (or, after a checkpoint, the resume command), no process left; the CLI leaves no
    version directory before its first checkpoint (the given command run again makes it)."""
    cmd, program = EARLY[entry]
    full_env, tag = child_env()
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=full_env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    while not _held(proc.pid):
        time.sleep(0.01)
    time.sleep(random.Random(entry).uniform(0, 3.0))
    proc.send_signal(signal.SIGTERM)
    stderr = proc.communicate(timeout=240)[1].decode()
    assert proc.returncode == 143, stderr[-3000:]
    lines = [x for x in stderr.splitlines() if "stopped by SIGTERM" in x and (x.startswith("error:") or "ERROR" in x)]
    assert len(lines) == 1 and lines[0].startswith("error: stopped by SIGTERM "), stderr[-3000:]
    where, command = lines[0].split(": resume with ", 1)
    saved = sorted(tmp_path.glob("run/**/checkpoints/last.ckpt"))  # the line says what the directory holds
    if saved:
        step = torch.load(saved[-1], map_location="cpu", weights_only=True)["global_step"]
        assert f"error: stopped by SIGTERM after step {step}; checkpoint: " in where, (where, saved)
    else:
        assert where == "error: stopped by SIGTERM before its first checkpoint", where
    given = [a for a in cmd[2 if program == "python" else 1 :] if not a.startswith(("hydra.run.dir=", "--trainer.def"))]
    assert shlex.split(command)[0] == program and set(given) <= set(shlex.split(command)), command
    if program == "dpddp":  # the CLI: no version directory without a checkpoint (the command makes it anew)
        versions = list((tmp_path / "run" / "lightning_logs").glob("version_*"))
        checkpointed = [v / "checkpoints" / "last.ckpt" for v in versions if " after step " in where]
        assert len(versions) == len(checkpointed) <= 1 and all(c.is_file() for c in checkpointed), versions
    assert leftover(tag) == []


class SigtermAtExit(pl.Callback):
    """At the run's end, registers an exit function that sends this process SIGTERM and waits ``wait_s`` in it:
    the signal lands while the interpreter exits, after the command has ended (``atexit`` runs it first)."""

    def __init__(self, wait_s: float) -> None:
        self.wait_s = wait_s

    def teardown(self, trainer, pl_module, stage):
        def sigterm_then_wait() -> None:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(self.wait_s)

        if stage == "fit" and trainer.is_global_zero:
            atexit.register(sigterm_then_wait)
