"""Shared helpers: compose configs in-process, run train.py in subprocesses, find leftover processes."""

from __future__ import annotations

import fcntl
import gc
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import lightning.pytorch as pl
import psutil
import pytest
import torch
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from omegaconf import DictConfig

from dpddp.cluster import register_resolvers
from dpddp.continuity import stop as sweep_stop

# One intra-op thread per test process: pytest-xdist runs one worker per core, and two busy multi-threaded
# torch processes on shared cores slow each other down many times over.
torch.set_num_threads(1)
register_resolvers()  # the packaged hydra/ config uses them (train.py registers them through dpddp.entry.hydra)

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "src" / "dpddp" / "conf"
# Rank and rendezvous variables a test must never inherit (they make Lightning think a cluster launched it).
RANK_VARS = ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT", "PL_GLOBAL_SEED")
# What every test run of train.py adds unless it sets the key: no progress bar, no curves.png (matplotlib's import
# and a drawing, most of a second of CPU per run; tests that look at the picture set curves=true).
QUIET = ["trainer.enable_progress_bar=false", "curves=false"]


def compose_cfg(*overrides: str) -> DictConfig:
    """The config ``train.py`` would get for these overrides (Hydra's compose API), with ``curves=false`` unless
    they set ``curves``: an in-process run draws no picture (a quarter of a tiny fit's time); train.py's runs do."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=[*unset(["curves=false"], overrides), *overrides])


def unset(defaults: list[str], args: Sequence[str]) -> list[str]:
    """The ``key=value`` overrides of ``defaults`` whose key ``args`` do not set (``+key``, ``~key`` included)."""
    given = {a.split("=")[0].lstrip("+~") for a in args}
    return [d for d in defaults if d.split("=")[0] not in given]


def _loggers() -> dict[str, tuple]:
    """Every logger's level, disabled flag, propagation and handlers (root's too)."""
    made = [v for v in logging.root.manager.loggerDict.values() if isinstance(v, logging.Logger)]
    return {lg.name: (lg, lg.level, lg.disabled, lg.propagate, lg.handlers[:]) for lg in [logging.getLogger(), *made]}


@pytest.fixture(autouse=True)
def _restore_env():
    """The environment, torch's threads and every logger as they were before the test (an entry's ``main`` run
    in-process gets Hydra's logging config, whose handlers write to the test's captured streams; a check's ``main``
    sets loggers' levels)."""
    saved = dict(os.environ)
    threads = torch.get_num_threads()
    loggers, disabled = _loggers(), logging.root.manager.disable
    yield
    os.environ.clear()
    os.environ.update(saved)
    torch.set_num_threads(threads)
    logging.disable(disabled)
    for logger, level, off, propagate, handlers in loggers.values():
        for made in logger.handlers:
            if made not in handlers:
                made.close()
        logger.handlers[:], logger.disabled, logger.propagate = handlers, off, propagate
        logger.setLevel(level)  # and the loggers' cached levels cleared
    for name, (logger, *_) in _loggers().items():  # made during the test: a logging config may have disabled one
        if name not in loggers:  # (dpddp's own are reset where an entry run starts: _entry_here)
            logger.disabled = False


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The slow (multi-process) tests first, each file's in its order: pytest-xdist's load scheduling hands each
    worker consecutive tests, so the long ones start at once on every core and the short ones fill the end (no
    core waits through one long last test)."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def child_env(**extra: str) -> tuple[dict[str, str], str]:
    """The environment for a subprocess under test and its tag: no inherited rank variables, one intra-op thread,
    and ``DPDDP_TEST_TAG`` (inherited by every process it starts, so ``tagged`` finds them all)."""
    tag = uuid.uuid4().hex
    env = {k: v for k, v in os.environ.items() if k not in RANK_VARS}
    env.update({"OMP_NUM_THREADS": "1", "DPDDP_TEST_TAG": tag, **extra})  # extra may set the tag itself
    return env, env["DPDDP_TEST_TAG"]


def run_train(*args: str, cwd: Path, timeout: float = 240, env: dict | None = None, check: bool = False):
    """Run ``train.py`` with one intra-op thread per process and ``QUIET`` (what ``args`` do not set); return the
    CompletedProcess (``.tag`` marks its process tree for ``leftover``). ``check``: assert exit 0 and no process of
    the run left."""
    full_env, tag = child_env(**(env or {}))
    cmd = [sys.executable, str(ROOT / "train.py"), *args, *unset(QUIET, args)]
    proc = subprocess.run(cmd, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)
    proc.tag = tag
    if check:
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        assert leftover(tag) == []
    return proc


def run_cli(
    *args: str, cwd: Path, script: bool = False, env: dict | None = None, timeout: float = 240, check: bool = False
):
    """Run ``python -m dpddp.cli ARGS`` (``script``: the ``dpddp`` console script) with one intra-op thread per
    process; return the CompletedProcess (``.tag`` for ``leftover``). ``check``: assert exit 0 and nothing left."""
    full_env, tag = child_env(**(env or {}))
    cmd = [str(Path(sys.executable).parent / "dpddp")] if script else [sys.executable, "-m", "dpddp.cli"]
    proc = subprocess.run([*cmd, *args], cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)
    proc.tag = tag
    if check:
        assert proc.returncode == 0, f"{' '.join(args)}\n{proc.stderr[-3000:]}"
        assert leftover(tag) == []
    return proc


@contextmanager
def _entry_here(cwd: Path, monkeypatch: pytest.MonkeyPatch, argv: list[str]) -> Iterator[list[int]]:
    """An entry point's run in this process, in ``cwd`` with ``sys.argv`` = ``argv``: yields a list that gets its
    exit status (0 unless it raises ``SystemExit``). The SIGTERM handler and signal mask, Hydra's global state and
    the root logger's handlers are put back after, and what ``main``'s ``gc.freeze`` froze is unfrozen."""
    monkeypatch.chdir(cwd)
    monkeypatch.setattr(sys, "argv", argv)
    handler, root = signal.getsignal(signal.SIGTERM), logging.getLogger()
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    handlers, level = root.handlers[:], root.level
    for name, (logger, *_) in _loggers().items():  # dpddp's loggers as a fresh process has them (_restore_env
        if name.split(".")[0] == "dpddp":  # puts them back): an earlier run's logging config may have changed one
            logger.disabled, logger.propagate, logger.handlers[:] = False, True, []
            logger.setLevel(logging.NOTSET)
    status = [0]
    try:
        yield status
    except SystemExit as stop:
        status[0] = stop.code if isinstance(stop.code, int) else int(stop.code is not None)
    finally:
        signal.signal(signal.SIGTERM, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        gc.unfreeze()
        GlobalHydra.instance().clear()
        for made in root.handlers:
            if made not in handlers:
                made.close()
        root.handlers[:] = handlers
        root.setLevel(level)


def train_py_here(*args: str, cwd: Path, monkeypatch: pytest.MonkeyPatch) -> int:
    """``python train.py ARGS`` (and ``QUIET``, where ARGS do not set it) in this process and in ``cwd``: train.py's
    two calls, ``refuse_non_integer_variables`` then ``main``. Returns the exit status. For a run whose ranks are not
    the point."""
    from dpddp.cluster import refuse_non_integer_variables
    from dpddp.entry import hydra as hydra_entry

    argv = [*args, *unset(QUIET, args)]
    with _entry_here(cwd, monkeypatch, [str(ROOT / "train.py"), *argv]) as status:
        refuse_non_integer_variables()
        hydra_entry.main()
    return status[0]


def cli_here(*args: str, cwd: Path, monkeypatch: pytest.MonkeyPatch) -> int:
    """``python -m dpddp.cli ARGS`` in this process and in ``cwd`` (its ``main``). Returns the exit status."""
    from dpddp.entry.lightning_cli import main

    with _entry_here(cwd, monkeypatch, [sys.executable, "-m", "dpddp.cli", *args]) as status:
        main(list(args))
    return status[0]


def cli_config(*args: str) -> DictConfig:
    """The run config the Lightning CLI makes of ``args`` (``--trainer.devices=2``, no subcommand), in this process:
    parsed, nothing instantiated or run."""
    from dpddp.entry.lightning_cli import DPDDPCLI, run_config, trainer_defaults, with_default_classes

    cli = DPDDPCLI(
        None, None, args=with_default_classes(list(args)), trainer_defaults=trainer_defaults(),
        seed_everything_default=0, save_config_callback=None, auto_configure_optimizers=False, run=False,
    )  # fmt: skip
    return run_config(cli.config, cli.parser.get_defaults())


def run_project(
    project: Path, *args: str, command: list[str] | None = None, pythonpath=(), check: bool = False, timeout=240
):
    """Run a user's project as its README says: ``python train.py ARGS`` (or ``command`` + ARGS) in ``project``,
    with ``project`` (then ``pythonpath``) on ``PYTHONPATH``; assert no process of it is left (``check``: and exit 0);
    return the CompletedProcess."""
    env, tag = child_env(PYTHONPATH=os.pathsep.join([str(project), *map(str, pythonpath)]))
    cmd = [*(command or [sys.executable, "train.py"]), *args]
    proc = subprocess.run(cmd, cwd=project, env=env, capture_output=True, text=True, timeout=timeout)
    proc.tag = tag
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    assert leftover(tag) == []
    return proc


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def checkpoint(path: Path) -> dict:
    """The checkpoint at ``path`` (a ``.ckpt`` file, or a run directory: its ``checkpoints/last.ckpt``), loaded on
    the CPU with ``weights_only=True``."""
    path = Path(path)
    ckpt = path / "checkpoints" / "last.ckpt" if path.is_dir() else path
    return torch.load(ckpt, map_location="cpu", weights_only=True)


def global_step(path: Path) -> int:
    """The ``global_step`` of ``checkpoint(path)``."""
    return checkpoint(path)["global_step"]


def tagged(tag: str) -> list[psutil.Process]:
    """Live (non-zombie) processes started under ``tag``."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("DPDDP_TEST_TAG") == tag and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except (psutil.Error, OSError):
            continue
    return found


def launched(tag: str) -> list[psutil.Process]:
    """The ranks a run's launcher started (forked or exec'd): tagged processes whose parent is tagged too."""
    procs = tagged(tag)
    pids = {p.pid for p in procs}
    found = []
    for p in procs:
        try:
            if p.ppid() in pids:
                found.append(p)
        except psutil.Error:
            continue
    return found


def leftover(tag: str) -> list[int]:
    """PIDs of live processes started under ``tag``."""
    return [p.pid for p in tagged(tag)]


@pytest.fixture(scope="session")
def shared_dir(tmp_path_factory) -> Path:
    """A directory every xdist worker of this session sees (the parent of each worker's base temp directory)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def made_once(shared: Path, name: str, make: Callable[[Path], None]) -> Path:
    """``shared/name``, made by ``make(shared/name)`` for the first test of any worker that asks, while the others
    wait on a lock: a run that several tests compare to, run once a session (an xdist group would do it, but
    pytest-xdist's loadgroup does not group on pytest 9.2)."""
    path, done = shared / name, shared / f"{name}.done"
    with open(shared / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            shutil.rmtree(path, ignore_errors=True)
            make(path)
            done.touch()
    return path


def metrics(run_dir: Path) -> dict:
    return json.loads((run_dir / "metrics.json").read_text())


def weights(ckpt: Path) -> dict[str, torch.Tensor]:
    """Every entry of the checkpoint's ``state_dict``: parameters and buffers (BatchNorm's running statistics and
    batch count included), as float64."""
    state = torch.load(ckpt, map_location="cpu", weights_only=True)["state_dict"]
    return {k: v.double() for k, v in state.items()}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The largest absolute difference over the entries of two ``weights``; their keys must be the same."""
    assert a and a.keys() == b.keys(), (sorted(a), sorted(b))
    return max((a[k] - b[k]).abs().max().item() for k in a)


class SigtermAt(pl.Callback):
    """Test helper: sends this process SIGTERM at the end of training batch ``at`` (counted over the run)."""

    def __init__(self, at: int) -> None:
        self.at, self.seen = at, 0

    def on_train_batch_end(self, trainer, *args) -> None:
        if self.seen == self.at:
            os.kill(os.getpid(), signal.SIGTERM)
        self.seen += 1


class SigtermAtStep(pl.Callback):
    """Test helper: sends this process SIGTERM before the training batch that takes global step ``step + 1``, so a
    run continued past it (by a printed resume command that keeps this callback) is not stopped again."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer, *args) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


class SigkillAt(SigtermAt):
    """Test helper: this process SIGKILLs itself at the end of training batch ``at`` (counted over the run)."""

    def on_train_batch_end(self, trainer, *args) -> None:
        if self.seen == self.at:
            os.kill(os.getpid(), signal.SIGKILL)
        self.seen += 1


class PredictFails(pl.Callback):
    """Test helper: raises ``RuntimeError`` at the first predict batch (a failure injected in predict)."""

    def on_predict_batch_start(self, *args) -> None:
        raise RuntimeError("injected failure in predict")


class StopWhenFile(pl.Callback):
    """Test helper (``+callbacks.stop._target_=conftest.StopWhenFile +callbacks.stop.path=...``, with ``tests/`` on
    ``PYTHONPATH``): ends the fit as a limit would (exit 0, outputs written) at the end of the first training batch
    after the file ``path`` exists, on every rank at the same step. A run a test needs alive only until it has
    looked at it."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.strategy.reduce_boolean_decision(Path(self.path).exists(), all=False):
            trainer.should_stop = True


class HoldAt(pl.Callback):
    """Test helper (``+callbacks.hold._target_=conftest.HoldAt``, with ``tests/`` on ``PYTHONPATH``): before the
    training batch that takes global step ``step + 1``, on global rank ``rank``, once per file ``path``: creates
    ``path`` and waits (up to 120 s) until the test removes it. A signal sent while ``path`` exists lands at that
    step, whatever the machine's speed."""

    def __init__(self, step: int, path: str, rank: int = 0) -> None:
        self.step, self.path, self.rank = step, Path(path), rank

    def on_train_batch_start(self, trainer, *args) -> None:
        held = self.path.with_suffix(".held")
        if trainer.global_step != self.step or trainer.global_rank != self.rank or held.exists():
            return
        held.touch()
        self.path.touch()
        deadline = time.monotonic() + 120
        while self.path.exists() and time.monotonic() < deadline:
            time.sleep(0.02)


class SigtermSweepAt(pl.Callback):
    """Test helper for sweeps (``+callbacks.stop._target_=conftest.SigtermSweepAt``, with ``tests/`` on
    ``PYTHONPATH``): before the training batch that takes global step ``step + 1`` (never in a run resumed past
    it), once the file ``after`` exists, sends SIGTERM to the sweep's own process (the topmost process of this
    test's tag) and waits until the sweep is stopping. With ``step=0`` the stop lands at the end of the first
    batch, where every rank checks for a SIGTERM (later checks come about once a second)."""

    def __init__(self, step: int, after: str | None = None) -> None:
        self.step, self.after = step, after

    def on_train_batch_start(self, trainer, *args) -> None:
        if trainer.global_step != self.step:
            return
        deadline = time.monotonic() + 300
        while self.after and not Path(self.after).exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        me = psutil.Process()
        tag = os.environ["DPDDP_TEST_TAG"]  # this process's own (a test's sweep run in-process sets it)
        ours = [me, *(p for p in me.parents() if _environ(p).get("DPDDP_TEST_TAG") == tag)]
        ours[-1].send_signal(signal.SIGTERM)
        while not sweep_stop.requested() and time.monotonic() < deadline:
            time.sleep(0.05)


def _environ(proc: psutil.Process) -> dict[str, str]:
    try:
        return proc.environ()
    except (psutil.Error, OSError):
        return {}
