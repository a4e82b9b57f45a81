"""DataLoader worker processes end with their run: every loader's workers, the user's own too, start from a fork
server (a process without threads), never forked from a rank that runs threads; they die with their rank; a
stuck worker ends the run with one line; and repeated stop-and-continue cycles with persistent workers on ddp(2)
leave no process behind and end with the straight run's weights."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from functools import partial
from pathlib import Path

import lightning.pytorch as pl
import psutil
import pytest
import torch
from conftest import QUIET, ROOT, child_env, cli_here, compose_cfg, made_once, max_diff, run_train, tagged, weights
from lightning.fabric.utilities.seed import pl_worker_init_function
from torch.utils.data import DataLoader, TensorDataset
from users_models import _Mapped, open_shard

from dpddp.continuity.stop import StepBoundaryStop
from dpddp.parallel.workers import (
    START_METHOD,
    WORKER_TIMEOUT_S,
    WorkerInitFailed,
    WorkerStart,
    loader_failed,
    start_workers_safely,
)
from dpddp.run.training import train


def _own_init(worker_id: int) -> None:
    pass


def test_a_loader_with_workers_gets_a_fork_server_a_timeout_and_a_worker_start_around_its_own_init(monkeypatch):
    data = TensorDataset(torch.arange(8.0))
    plain = start_workers_safely(DataLoader(data, num_workers=2, worker_init_fn=_own_init), rank=1)
    assert plain.multiprocessing_context.get_start_method() == START_METHOD == "forkserver"
    assert plain.timeout == WORKER_TIMEOUT_S == 60.0
    assert isinstance(plain.worker_init_fn, WorkerStart) and plain.worker_init_fn.then is _own_init
    assert plain.worker_init_fn.rank_pid == os.getpid()
    assert start_workers_safely(plain, rank=1).worker_init_fn.then is _own_init  # once, not wrapped twice

    own = start_workers_safely(DataLoader(data, num_workers=1, multiprocessing_context="spawn", timeout=5), 0)
    assert own.multiprocessing_context.get_start_method() == "spawn" and own.timeout == 5  # the user's choices

    monkeypatch.setenv("PL_SEED_WORKERS", "1")  # seed_everything(workers=True): Lightning's seeding, kept
    seeded = start_workers_safely(DataLoader(data, num_workers=1), rank=3).worker_init_fn.then
    assert isinstance(seeded, partial) and seeded.func is pl_worker_init_function and seeded.keywords == {"rank": 3}

    none = DataLoader(data)
    assert start_workers_safely(none, 0) is none and none.worker_init_fn is None and none.timeout == 0
    assert start_workers_safely([1, 2], 0) == [1, 2]


def test_a_worker_whose_rank_is_gone_exits_before_running_anything():
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # reaped: its pid names no process
    calls = []
    pid = os.fork()
    if pid == 0:
        WorkerStart(gone.pid, then=calls.append)(0)
        os._exit(0 if not calls else 3)  # not reached: WorkerStart exits 1
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 1
    WorkerStart(os.getpid(), then=calls.append)(7)  # a live rank: the loader's own init runs
    assert calls == [7]


class _StuckOrDead(torch.utils.data.Dataset):
    """In a DataLoader worker, item 0 blocks (``stuck``) or the worker exits (``dead``)."""

    def __init__(self, how: str) -> None:
        self.how = how

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        if self.how == "stuck":
            time.sleep(600)
        os._exit(9)


@pytest.mark.parametrize("how", ["stuck", "dead"])
def test_loader_failed_reads_torchs_errors_for_a_stuck_and_a_dead_worker(how):
    loader = torch.utils.data.DataLoader(_StuckOrDead(how), num_workers=1, timeout=1 if how == "stuck" else 0,
                                         multiprocessing_context="fork")  # fmt: skip
    with pytest.raises(RuntimeError) as err:
        next(iter(loader))
    what, _, advice = str(loader_failed(err.value, 1)).partition(" (data.num_workers > 0): ")
    if how == "stuck":
        assert what == "rank 1: a DataLoader worker sent no batch for 1 s"
    else:
        assert re.fullmatch(r"rank 1: a DataLoader worker \(pid\(s\) \d+\) exited unexpectedly", what), what
    assert advice.startswith("its data set's __getitem__ or the collate_fn hangs or crashed in a worker process")
    assert loader_failed(RuntimeError("another error"), 1) is None
    assert loader_failed(ValueError("DataLoader timed out after 1 seconds"), 1) is None


# -- real runs ------------------------------------------------------------------------------------------------

EPOCHS, BATCH = 12, 12
STEPS = EPOCHS * 8  # users_models.WorkerData: 101 training samples, 8 batches an epoch
DATA = ["data=sharded", "+data.module._target_=users_models.WorkerData", f"+data.module.batch_size={BATCH}"]
# Long enough that 3 SIGTERMs, each agreed within about a second, stop the fit before its end.
RUN = ["accelerator=cpu", f"trainer.max_epochs={EPOCHS}", "model.num_features=4", "model.num_classes=3", "logger=none"]
STRAIGHT = f"workers_straight_{EPOCHS}"  # made once for both tests that compare to it
SOAK_SIGNALS = 4  # the soak's signals (each stage, each signal on each rank: the seed below)


class PauseAtStep(pl.Callback):
    """Test helper: on global rank 0, after the training batch that takes global step ``step``, touches ``flag``
    and waits (up to 2 minutes) until this process has a SIGTERM to stop on, so a test can see every process of the
    run and then signal it at a known place."""

    def __init__(self, step: int, flag: str) -> None:
        self.step, self.flag = step, flag

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step != self.step or trainer.global_rank != 0:
            return
        Path(self.flag).touch()
        deadline = time.monotonic() + 120
        stop = next(cb for cb in trainer.callbacks if isinstance(cb, StepBoundaryStop))
        while not stop.requested and time.monotonic() < deadline:
            time.sleep(0.05)


def _tree(pid: int) -> list[psutil.Process]:
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


def _gone(procs: list[psutil.Process], wait_s: float = 10.0) -> list[int]:
    """The pids of ``procs`` still running after up to ``wait_s`` seconds, right after the run's command returned
    (its ranks stopped and reaped their fork servers and resource trackers; a worker they killed may take a moment
    to exit, longer on a loaded machine; one left behind lives on for minutes)."""
    deadline = time.monotonic() + wait_s
    while True:
        alive = []
        for p in procs:
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(p.pid)
            except psutil.NoSuchProcess:
                continue
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.2)


def _server_born(p: psutil.Process) -> bool:
    """Whether ``p`` runs from multiprocessing's fork server (the server itself, or a process it forked)."""
    try:
        return "multiprocessing.forkserver" in " ".join(p.cmdline())
    except psutil.Error:
        return False


def _straight(run: Path) -> None:
    """The straight run: one process without loader workers, trained in this process."""
    serial = ["+data.module.num_workers=0", "+data.module.persistent_workers=false"]
    train(compose_cfg(*RUN, *DATA, *serial, *QUIET), run)


def _stopped_at_a_paused_step(tmp_path: Path) -> Path:
    """ddp(2), every loader with 2 persistent workers, paused on rank 0 after a seeded step and sent SIGTERM there:
    asserts that it ends 143 at that step or later, that while it ran every rank's workers were forked by a fork
    server of that rank's (not by the rank), and that no process of its tree runs as it returns. Its last.ckpt."""
    pause, run, flag = random.Random(42).randint(3, 8), tmp_path / "paused", tmp_path / "paused.flag"
    env = child_env(PYTHONPATH=str(ROOT / "tests"))[0]
    more = ["+callbacks.pause._target_=test_loader_workers.PauseAtStep", f"+callbacks.pause.step={pause}",
            f"+callbacks.pause.flag={flag}"]  # fmt: skip
    cmd = [sys.executable, str(ROOT / "train.py"), *RUN, *DATA, "strategy=ddp", "devices=2", *more, *QUIET,
           f"hydra.run.dir={run}"]  # fmt: skip
    log = open(tmp_path / "paused.log", "w")  # a file: a pipe not read while it runs would fill and block
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 240
    while not flag.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert proc.poll() is None, (tmp_path / "paused.log").read_text()[-3000:]
    tree = _tree(proc.pid)
    born = [p for p in tree if _server_born(p)]
    workers = [p for p in born if p.ppid() in {s.pid for s in born}]
    ranks = [p for p in tree if p.ppid() == proc.pid and not _server_born(p) and "resource_tracker" not in
             " ".join(p.cmdline())]  # fmt: skip
    assert len(ranks) == 1 and len(born) - len(workers) == 2, [p.cmdline()[:3] for p in tree]  # a server each
    assert len(workers) >= 4  # the training loader's 2 persistent workers on each rank, at least
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=240)
    log.close()
    out = (tmp_path / "paused.log").read_text()
    assert proc.returncode == 143, out[-3000:]
    assert _gone(tree) == [], out[-3000:]  # the tree seen while it ran: all gone
    ckpt = run / "checkpoints" / "last.ckpt"
    assert torch.load(ckpt, weights_only=True)["global_step"] >= pause
    return ckpt


@pytest.mark.slow
def test_a_stuck_worker_ends_the_run_with_one_line_naming_the_setting(tmp_path):
    """Every training worker of ddp(2) blocks in its first item, with the loaders' own timeout of 3 s: the run
    ends with exit 1, its last line the one ``error:`` line naming data.num_workers, and no process left."""
    hang = ["+data.module.hang=true", "+data.module.timeout=3"]
    env = {"PYTHONPATH": str(ROOT / "tests")}
    ddp = ["strategy=ddp", "devices=2"]
    proc = run_train(*RUN, *DATA, *ddp, *hang, f"hydra.run.dir={tmp_path}/run", cwd=tmp_path, env=env)
    assert proc.returncode == 1, proc.stderr[-3000:]
    errors = [line.split("error: ", 1)[1] for line in proc.stderr.splitlines() if "error: " in line]
    assert errors, proc.stderr[-3000:]
    last = errors[-1]  # rank 0's, the run's last word
    assert "a DataLoader worker sent no batch for 3 s (data.num_workers > 0)" in last, last
    assert "set data.num_workers=0" in last and last.startswith("rank "), last
    assert _gone(tagged(proc.tag)) == []


class StageMark(pl.Callback):
    """Test helper: on global rank 0, writes the stage running now into the file ``path`` (``fit``, ``validate``,
    ``test``, ``predict``; ``done`` once predict has ended)."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def _mark(self, trainer, what: str) -> None:
        if trainer.global_rank == 0:
            self.path.write_text(what)

    def on_train_start(self, trainer, *args) -> None:
        self._mark(trainer, "fit")

    def on_validation_start(self, trainer, *args) -> None:
        self._mark(trainer, "validate")

    def on_validation_end(self, trainer, *args) -> None:
        if trainer.training or trainer.state.fn == "fit":
            self._mark(trainer, "fit")

    def on_test_start(self, trainer, *args) -> None:
        self._mark(trainer, "test")

    def on_predict_start(self, trainer, *args) -> None:
        self._mark(trainer, "predict")

    def on_predict_end(self, trainer, *args) -> None:
        self._mark(trainer, "done")


def _stage(mark: Path) -> str:
    try:
        return mark.read_text() or "start-up"
    except FileNotFoundError:
        return "start-up"


def _signal(proc: subprocess.Popen, rank: int, signum: int) -> int:
    """Send ``signum`` to global rank ``rank`` of the run ``proc`` (rank 0 is ``proc``); the pid signalled."""
    target = proc.pid
    if rank:
        ranks = [p for p in psutil.Process(proc.pid).children() if not _server_born(p)]
        ranks = [p for p in ranks if "resource_tracker" not in " ".join(p.cmdline())]
        target = ranks[0].pid
    os.kill(target, signum)
    return target


@pytest.mark.slow
def test_soak_seeded_sigterms_and_sigkills_at_random_moments_on_ddp_with_workers(tmp_path, shared_dir):
    """Stop-and-continue cycles on ddp(2) with 2 persistent workers per loader. First a SIGTERM at a paused step
    (``_stopped_at_a_paused_step``: 143, every rank's workers from its own fork server, nothing left). Then, each
    run continuing the last checkpoint, ``SOAK_SIGNALS`` seeded signals (SIGTERM or SIGKILL, to rank 0 or rank 1)
    at a random moment of a random stage, through fit, validation, test and predict: a SIGTERM ends 143 with the
    stop line, a SIGKILL of rank 1 ends 1 with the line naming it (of rank 0: its ranks die with it); no process of
    the run left as it returns; each chain of continues that finishes (the first: continued from the paused stop)
    ends with the weights of a straight run on one process without workers (1e-5). The counts are printed."""
    straight = made_once(shared_dir, STRAIGHT, _straight)
    first = _stopped_at_a_paused_step(tmp_path)
    # seed 44: its 4 signals aim at each stage once, and SIGTERM and SIGKILL each reach both ranks (TERM to rank 0 in
    # validation, KILL to rank 0 in fit, KILL to rank 1 in predict, TERM to rank 1 in test)
    rng, ckpt, env = random.Random(44), first, child_env(PYTHONPATH=str(ROOT / "tests"))[0]
    landed: Counter[str] = Counter()
    finished, lags = 0, []
    for i in range(SOAK_SIGNALS + 1):
        env["DPDDP_TEST_TAG"] = tag = f"soak{i}-{os.getpid()}"
        run, mark = tmp_path / f"run{i}", tmp_path / f"stage{i}"
        signum = signal.SIGKILL if rng.random() < 0.3 else signal.SIGTERM
        rank, target, delay = rng.randint(0, 1), rng.choice(["fit", "validate", "test", "predict"]), rng.uniform(0, 0.5)
        resume = [f"ckpt_path={ckpt}"] if ckpt else []
        cmd = [sys.executable, str(ROOT / "train.py"), *RUN, *DATA, "strategy=ddp", "devices=2", "predict=true",
               "+callbacks.mark._target_=test_loader_workers.StageMark", f"+callbacks.mark.path={mark}", *resume,
               *QUIET, f"hydra.run.dir={run}"]  # fmt: skip
        log = open(tmp_path / f"{run.name}.log", "w")  # a file: a pipe not read while it runs would fill and block
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
        if i < SOAK_SIGNALS:
            deadline = time.monotonic() + 240
            while _stage(mark) != target and proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.005)
            time.sleep(delay if target == "fit" else delay / 10)  # a moment in the stage (a validation is short)
            stage = _stage(mark)
            sent = time.monotonic()
            if proc.poll() is None:
                _signal(proc, rank, signum)
            landed[f"{stage}/{signum.name}/rank {rank}"] += 1
        proc.wait(timeout=120)
        log.close()
        out = (tmp_path / f"{run.name}.log").read_text()
        if i < SOAK_SIGNALS:
            lags.append(time.monotonic() - sent)
        lines = [line for line in out.splitlines() if "error: " in line]
        assert _gone(tagged(tag)) == [], (i, out[-3000:])  # a SIGKILLed rank's fork server exits as it sees it gone
        if proc.returncode == 0:  # the run ended before the signal (or no signal): a finished chain
            finished += 1
            last = run / "checkpoints" / "last.ckpt"
            assert max_diff(weights(last), weights(straight / "checkpoints/last.ckpt")) <= 1e-5, i
            ckpt = None
            continue
        if signum == signal.SIGTERM:
            assert proc.returncode == 143 and "stopped by SIGTERM" in lines[-1], (i, stage, out[-3000:])
        elif rank == 1:
            assert proc.returncode == 1 and "was killed by SIGKILL" in lines[-1], (i, stage, out[-3000:])
        else:
            assert proc.returncode == -signal.SIGKILL, (i, stage, out[-3000:])
        last = run / "checkpoints" / "last.ckpt"
        ckpt = last if last.exists() else ckpt
    assert finished >= 1  # the last run continues to the end
    print(f"soak: {dict(sorted(landed.items()))}; finished chains {finished}; exit within {max(lags):.1f} s")


class WorkerCensus(pl.Callback):
    """Test helper: after the training batch that takes global step ``step``, writes into ``path`` (JSON) the
    training loader's start method, timeout and ``worker_init_fn`` class, and for each process under this one
    whether multiprocessing's fork server runs it (``server``) and its parent's pid."""

    def __init__(self, step: int, path: str) -> None:
        self.step, self.path = step, Path(path)

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step != self.step:
            return
        loader = trainer.train_dataloader
        under = [{"pid": p.pid, "ppid": p.ppid(), "server": _server_born(p), "cmd": " ".join(p.cmdline())}
                 for p in psutil.Process().children(recursive=True)]  # fmt: skip
        census = {
            "context": loader.multiprocessing_context.get_start_method() if loader.multiprocessing_context else None,
            "timeout": loader.timeout,
            "init": type(loader.worker_init_fn).__name__,
            "me": os.getpid(),
            "under": under,
        }
        self.path.write_text(json.dumps(census))


@pytest.mark.slow
def test_the_lightning_cli_on_one_process_starts_a_users_loader_workers_from_a_fork_server(tmp_path, monkeypatch):
    """``dpddp fit`` on one process (no ddp) with a user's LightningDataModule whose loaders have 2 workers: its
    training loader gets the fork server, the 60 s timeout and the ``WorkerStart``; every process under the run
    while it trains is the fork server, a worker it forked or multiprocessing's resource tracker (none forked by
    the training process); after the run, none is left; the weights equal a ``num_workers=0`` run's (that one in
    this process). (Not persistent: torch draws a persistent iterator's worker seed from the loader's generator
    once, not each epoch, so its ``shuffle=True`` order differs from the second epoch on.)"""
    base = ["fit", "--data=users_models.WorkerData", "--data.persistent_workers=false", "--model.num_features=4",
            "--model.num_classes=3", "--trainer.accelerator=cpu", "--trainer.max_epochs=2", "--trainer.logger=false",
            "--trainer.enable_progress_bar=false"]  # fmt: skip
    census = tmp_path / "census.json"
    watch = ["--trainer.callbacks+=test_loader_workers.WorkerCensus", "--trainer.callbacks.step=3",
             f"--trainer.callbacks.path={census}"]  # fmt: skip
    env, tag = child_env(PYTHONPATH=str(ROOT / "tests"))
    cmd = [sys.executable, "-m", "dpddp.cli", *base, *watch, "--trainer.default_root_dir=workers"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert _gone(tagged(tag)) == []
    # the reference: the same command without workers, in this process (no process of its own to look at)
    assert cli_here(*base, "--data.num_workers=0", "--trainer.default_root_dir=serial", cwd=tmp_path,
                    monkeypatch=monkeypatch) == 0  # fmt: skip
    ends = {}
    for name in ("workers", "serial"):
        (ends[name],) = (tmp_path / name).glob("lightning_logs/version_*/checkpoints/last.ckpt")
    seen = json.loads(census.read_text())
    assert (seen["context"], seen["timeout"], seen["init"]) == ("forkserver", WORKER_TIMEOUT_S, "WorkerStart"), seen
    servers = {p["pid"] for p in seen["under"] if p["server"] and p["ppid"] == seen["me"]}
    workers = [p for p in seen["under"] if p["ppid"] in servers]
    assert len(servers) == 1 and len(workers) >= 2, seen["under"]  # the training loader's 2 workers, at least
    others = [p["cmd"] for p in seen["under"] if not p["server"]]
    assert all("multiprocessing.resource_tracker" in cmd for cmd in others), others
    assert max_diff(weights(ends["workers"]), weights(ends["serial"])) <= 1e-6


def test_loader_failed_reads_a_failed_worker_init_and_a_loader_the_fork_server_cannot_get():
    """A loader's own worker_init_fn that raises in the worker comes back from torch as ``WorkerInitFailed``,
    read as its one phrase; a data set holding a lambda fails to pickle while its worker starts, read as such;
    any other error is not a failed start."""
    data = TensorDataset(torch.arange(8.0))
    failing = DataLoader(data, num_workers=1, worker_init_fn=open_shard, multiprocessing_context="fork")
    with pytest.raises(WorkerInitFailed) as err:
        next(iter(start_workers_safely(failing, 0)))
    assert str(loader_failed(err.value, 0)) == (
        "rank 0: a DataLoader worker could not start (data.num_workers > 0): its worker_init_fn open_shard raised "
        "FileNotFoundError: shard-0.bin: no such file; fix it (it runs first in each worker process), or set "
        "data.num_workers=0 to load in the rank"
    )
    lambdas = start_workers_safely(DataLoader(_Mapped(data, lambda item: item), num_workers=1), 0)
    with pytest.raises(Exception) as err:
        next(iter(lambdas))
    start, _, what = str(loader_failed(err.value, 0)).partition(": ")
    assert start == "rank 0" and what.startswith("a DataLoader worker could not start (data.num_workers > 0): the "
                                                 "DataLoader cannot be pickled ("), what  # fmt: skip
    assert "lambda" in what and what.endswith("or set data.num_workers=0"), what
    assert loader_failed(RuntimeError("Can't pickle this"), 0) is None  # not raised while pickling


@pytest.mark.slow
def test_a_worker_that_cannot_start_ends_the_run_with_one_line_naming_the_setting(tmp_path):
    """ddp(2) with 2 workers per loader that cannot start: the data sets hold a lambda, which cannot be pickled
    for the fork server: the run ends with exit 1, no traceback, its last error line rank 0's one line naming
    data.num_workers and the cause, and no process left. (A worker_init_fn that raises in the worker ends the
    run through the same line: its reading is tested above, without a run, to keep CI short.)"""
    env = {"PYTHONPATH": str(ROOT / "tests")}
    proc = run_train(*RUN, *DATA, "strategy=ddp", "devices=2", "+data.module.lambda_transform=true",
                     f"hydra.run.dir={tmp_path}/run", cwd=tmp_path, env=env)  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-3000:]
    errors = [line.split("error: ", 1)[1] for line in proc.stderr.splitlines() if "error: " in line]
    assert errors and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = errors[-1]
    start = "rank 0: a DataLoader worker could not start (data.num_workers > 0): the DataLoader cannot be pickled ("
    assert last.startswith(start) and "lambda" in last, last
    assert "set data.num_workers=0" in last, last
    assert _gone(tagged(proc.tag)) == []
