"""``dpddp.errors.shell``, the one shell every entry point's ``main`` runs in: each error to its exit status and
its one line, through the module's one table (in process: no subprocess)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from dpddp.errors import (
    ConfigError,
    LoaderFailed,
    Preempted,
    PromiseBroken,
    RankFailed,
    ReplicasDiverged,
    StepFailed,
    WriteFailed,
    shell,
)
from dpddp.plot import main as plot_main

CKPT = Path("runs/a/checkpoints/last.ckpt")


def _resume() -> str:
    return "python train.py resume=true"


# (the error, the shell's options, the exit status, the line on stderr)
TABLE = [
    (ConfigError("devices=0 is invalid: give 1 or more"), {}, 2, "error: devices=0 is invalid: give 1 or more"),
    (WriteFailed("cannot write last.ckpt in 'c': full"), {}, 1, "error: cannot write last.ckpt in 'c': full"),
    (RankFailed("rank 1 (pid 7) was killed by SIGKILL"), {}, 1, "error: rank 1 (pid 7) was killed by SIGKILL"),
    (LoaderFailed("rank 1: no batch for 60 s"), {}, 1, "error: rank 1: no batch for 60 s"),
    (StepFailed("rank 0: a parameter took no part"), {}, 1, "error: rank 0: a parameter took no part"),
    (ReplicasDiverged("rank 1's replica differs"), {}, 1, "error: rank 1's replica differs"),
    (PromiseBroken("promise 1 does not hold for this model"), {}, 1, "error: promise 1 does not hold for this model"),
    (
        Preempted(CKPT, 6),
        {"resume": _resume},
        143,
        f"error: stopped by SIGTERM after step 6; checkpoint: {CKPT}: resume with python train.py resume=true",
    ),
    (Preempted(None, 0), {}, 143, "error: stopped by SIGTERM before its first checkpoint"),
    (FileNotFoundError("no metrics.csv in d"), {"bad_input": (FileNotFoundError,)}, 2, "error: no metrics.csv in d"),
    (
        ModuleNotFoundError("No module named 'x'"),
        {"bad_input": (FileNotFoundError, ModuleNotFoundError)},
        2,
        "error: No module named 'x'",
    ),  # fmt: skip
    (RuntimeError("boom\nsecond line"), {"crash": "a check failed"}, 1, "error: a check failed: RuntimeError: boom"),
    (
        Preempted(None, 0),
        {"crash": "a check failed"},
        1,
        "error: a check failed: Preempted: stopped by SIGTERM before its first checkpoint",
    ),  # fmt: skip
    (ConfigError("--stops needs 2 epochs"), {"crash": "a check failed"}, 2, "error: --stops needs 2 epochs"),
    (PromiseBroken("weights: 0.1 apart"), {"crash": "a check failed"}, 1, "error: weights: 0.1 apart"),
]


@pytest.fixture(autouse=True)
def _node_rank_zero(monkeypatch):
    for name in ("LOCAL_RANK", "SLURM_LOCALID"):  # local rank 0: the one that says the line
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize(("err", "options", "status", "line"), TABLE, ids=lambda v: type(v).__name__)
def test_each_error_ends_with_its_status_and_one_line(err, options, status, line, capsys):
    with pytest.raises(SystemExit) as ended, shell(**options):
        raise err
    assert ended.value.code == status
    out, stderr = capsys.readouterr()
    assert (out, stderr) == ("", line + "\n")


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.seen: list[tuple[str, str, bool]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.append((record.levelname, record.getMessage(), record.exc_info is not None))


@pytest.fixture
def records():
    log = logging.getLogger("test_shell.run")
    handler = _Records()
    log.addHandler(handler)
    log.setLevel(logging.DEBUG)
    log.propagate = False
    yield log, handler.seen
    log.removeHandler(handler)


def test_a_lost_rank_s_line_goes_into_the_run_s_log_and_other_errors_to_stderr(records, capsys):
    log, seen = records
    with pytest.raises(SystemExit) as ended, shell(_resume, log):
        raise RankFailed("rank 1 (pid 7) exited with code 1")
    assert ended.value.code == 1
    assert seen == [("ERROR", "error: rank 1 (pid 7) exited with code 1", False)]
    with pytest.raises(SystemExit) as ended, shell(_resume, log):
        raise ConfigError("seed='a' is not an integer: give one")
    assert ended.value.code == 2
    assert len(seen) == 1 and capsys.readouterr().err == "error: seed='a' is not an integer: give one\n"


@pytest.mark.parametrize(
    ("err", "status", "logged"),
    [
        (
            ConfigError("data.batch_size=3 does not divide"),
            2,
            ("ERROR", "error: data.batch_size=3 does not divide", False),
        ),
        (StepFailed("rank 1: unused parameter"), 1, ("ERROR", "error: rank 1: unused parameter", False)),
        (Preempted(CKPT, 4), 143, ("DEBUG", f"stopped by SIGTERM after step 4; checkpoint: {CKPT}", False)),
        (RankFailed("rank 2 (pid 9) exited with code 1"), 1, ("ERROR", "rank failed", True)),
        (ZeroDivisionError("division by zero"), 1, ("ERROR", "rank failed", True)),
    ],
    ids=lambda v: type(v).__name__,
)
def test_a_launched_rank_says_each_error_in_its_log_only(err, status, logged, records, capsys):
    log, seen = records
    with pytest.raises(SystemExit) as ended, shell(rank=log):
        raise err
    assert ended.value.code == status
    assert seen == [logged]
    assert capsys.readouterr() == ("", "")


def test_other_errors_propagate_and_exits_and_success_pass():
    with pytest.raises(ValueError, match="not ours"), shell(_resume):
        raise ValueError("not ours")
    with pytest.raises(SystemExit) as ended, shell(crash="a check failed"):
        raise SystemExit(0)  # --help's exit is no crash
    assert ended.value.code == 0
    done = []
    with shell(_resume, bad_input=(FileNotFoundError,), crash="x"):
        done.append(1)
    assert done == [1]


def test_dpddp_plot_of_a_directory_without_metrics_is_one_line_and_exit_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as ended:
        plot_main([str(tmp_path)])
    assert ended.value.code == 2
    assert capsys.readouterr() == ("", f"error: no metrics.csv in {tmp_path} or in its job directories\n")
