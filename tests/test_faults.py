"""Sockets, ports and concurrent runs on one machine (port clashes, orphaned ranks), and failures that must end every
rank."""

import ipaddress
import os
import shlex
import signal
import socket
import subprocess
import sys
import time

import psutil
import pytest
from conftest import (
    QUIET,
    ROOT,
    child_env,
    cli_here,
    launched,
    leftover,
    made_once,
    metrics,
    tagged,
    train_py_here,
)

pytestmark = pytest.mark.slow
DDP = ["strategy=ddp", "devices=2", "accelerator=cpu", *QUIET]


ENTRIES = ["train.py", "cli"]


def _start(tmp_path, *args, **env):
    """Start ``train.py ARGS``, or ``python -m dpddp.cli ARGS`` when the first argument is a CLI subcommand."""
    full, tag = child_env(**env)
    prog = ["-m", "dpddp.cli"] if args and args[0] == "fit" else [str(ROOT / "train.py")]
    cmd = [sys.executable, *prog, *args]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=full, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.tag = tag
    return proc


def _args(entry: str, run: str, **settings) -> tuple[list[str], str]:
    """The same run for either entry point: ``settings`` in train.py's spelling (``strategy``, ``devices``,
    ``trainer.max_epochs``, ``model.lr``...). Returns the arguments and the run directory (relative)."""
    settings = {"accelerator": "cpu", **settings}
    if entry == "train.py":
        return [*(f"{k}={v}" for k, v in settings.items()), *QUIET, f"hydra.run.dir={run}"], run
    top = {"strategy", "devices", "accelerator", "num_nodes"}
    args = [f"--trainer.{k}={v}" if k in top else f"--{k}={v}" for k, v in settings.items()]
    quiet = "--trainer.enable_progress_bar=false"
    return ["fit", *args, quiet, f"--trainer.default_root_dir={run}"], f"{run}/lightning_logs/version_0"


def _listening(tag):
    addrs = set()
    for p in tagged(tag):
        try:
            addrs |= {(c.laddr.ip, c.laddr.port) for c in p.net_connections("inet") if c.status == psutil.CONN_LISTEN}
        except (psutil.Error, OSError):
            continue
    return addrs


def _wait_ranks(proc, n=2, timeout=180):
    """Wait until the run has n processes and at least n listening sockets (store + gloo)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if len(tagged(proc.tag)) >= n and len(_listening(proc.tag)) >= n:
            return
        time.sleep(0.2)
    raise AssertionError("ranks did not come up")


def test_a_busy_master_port_fails_fast_and_leaves_the_other_run_alone(tmp_path, monkeypatch, capfd):
    """A rendezvous port clash, for either entry point: each second run exits 2 with one line naming the port and
    starts no process (both in this process: the launcher refuses the port before it forks a rank); the first (held
    before its first step, so it runs, without training, until both are refused) finishes; no orphans."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        store_port = str(sock.getsockname()[1])
    held = tmp_path / "held"
    hold = ["+callbacks.hold._target_=conftest.HoldAt", "+callbacks.hold.step=0", f"+callbacks.hold.path={held}"]
    first = _start(tmp_path, *DDP, "trainer.max_epochs=1", *hold, "hydra.run.dir=first",
                   MASTER_PORT=store_port, PYTHONPATH=str(ROOT / "tests"))  # fmt: skip
    deadline = time.monotonic() + 180
    while not held.exists() and first.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert held.exists(), first.stderr.read()[-3000:] if first.poll() is not None else "not held"
    assert ("127.0.0.1", int(store_port)) in _listening(first.tag)  # rank 0's store took the port
    monkeypatch.setenv("MASTER_PORT", store_port)
    children = set(psutil.Process().children(recursive=True))
    for entry, here in (("train.py", train_py_here), ("cli", cli_here)):
        args, _ = _args(entry, f"second-{entry}", strategy="ddp", devices=2, **{"trainer.max_epochs": 1})
        assert here(*args, cwd=tmp_path, monkeypatch=monkeypatch) == 2, entry
        err = capfd.readouterr().err
        lines = [x for x in err.splitlines() if x.startswith("error:")]
        assert len(lines) == 1 and f"MASTER_PORT={store_port}" in lines[0] and "unset MASTER_PORT" in lines[0], err
        assert set(psutil.Process().children(recursive=True)) <= children  # no rank started, none left
    assert first.poll() is None  # the port was the running first run's
    held.unlink()
    first.communicate(timeout=240)
    assert first.returncode == 0
    assert metrics(tmp_path / "first")["world_size"] == 2
    assert leftover(first.tag) == []


def test_two_ddp_runs_at_once_both_succeed_and_listen_on_loopback_only(tmp_path):
    """Two one-machine ddp(2) runs at once (train.py; the CLI's run goes through the same ``train`` and launcher,
    which choose the addresses): both end 0 with the same loss, and every socket either listens on is loopback."""
    runs = [_start(tmp_path, *DDP, "trainer.max_epochs=3", f"hydra.run.dir=run{i}") for i in range(2)]
    seen: list[set] = [set(), set()]
    while any(run.poll() is None for run in runs):  # both sampled from their start: a fast run ends in ~2 s
        for run, addrs in zip(runs, seen, strict=True):
            addrs |= _listening(run.tag)
        time.sleep(0.1)
    for run, addrs in zip(runs, seen, strict=True):
        _, err = run.communicate(timeout=240)
        assert run.returncode == 0, err[-3000:]
        assert leftover(run.tag) == []
        assert len(addrs) >= 3  # rank 0's store, and a gloo listener per rank
        assert all(ipaddress.ip_address(ip).is_loopback for ip, _ in addrs), addrs
    assert metrics(tmp_path / "run0")["val/loss"] == pytest.approx(metrics(tmp_path / "run1")["val/loss"])


@pytest.mark.parametrize("entry", ENTRIES)
def test_killing_rank_1_ends_the_run(tmp_path, entry):
    args, _ = _args(entry, "run", strategy="ddp", devices=2, **{"trainer.max_epochs": 200})
    proc = _start(tmp_path, *args)
    _wait_ranks(proc)
    (rank1,) = launched(proc.tag)
    rank1.send_signal(signal.SIGKILL)
    start = time.monotonic()
    out, err = proc.communicate(timeout=60)
    assert proc.returncode != 0 and time.monotonic() - start < 15
    assert "rank 1 (pid " in out + err and "was killed by SIGKILL; ending the run" in out + err
    time.sleep(0.5)
    assert leftover(proc.tag) == []


def test_killing_the_launching_process_leaves_no_orphan(tmp_path):
    """(train.py only: what ends the orphaned ranks is the launched ranks' own, the same under the CLI's ``train``.)"""
    args, _ = _args("train.py", "run", strategy="ddp", devices=2, **{"trainer.max_epochs": 200})
    proc = _start(tmp_path, *args)
    _wait_ranks(proc)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=30)
    deadline = time.monotonic() + 30
    while leftover(proc.tag) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert leftover(proc.tag) == []


def _forked_train(cwd, log, *args: str) -> int:
    """``python train.py ARGS`` in a child forked from this process (its imports done), its output into ``log``:
    the child's pid. The child ends with the run's exit status (1 on an error that escapes it)."""
    pid = os.fork()
    if pid:
        return pid
    code = 1
    try:
        out = open(log, "a")
        os.dup2(out.fileno(), 1)
        os.dup2(out.fileno(), 2)
        sys.stdout = sys.stderr = out
        code = train_py_here(*args, cwd=cwd, monkeypatch=pytest.MonkeyPatch())
    finally:
        os._exit(code)


def test_six_random_kills_each_resume_to_completion(tmp_path, monkeypatch, capfd):
    """Kill a run at 6 random moments (SIGKILL: no handler runs), resuming each time with resume=true; every
    resume must load last.ckpt (atomic writes), and the chain must end where an uninterrupted run ends. Each
    killed run is train.py's calls in a child forked from this process (imports done), killed 0 to 3 epochs on,
    whatever the machine's speed; the last run in this process."""
    import random

    import torch

    rng = random.Random(0)
    args = ["accelerator=cpu", "data.num_samples=20000", "trainer.max_epochs=20", "resume=true", "hydra.run.dir=run"]
    log = tmp_path / "killed.log"
    log.touch()
    for _ in range(6):  # each run ends 0 to 3 epochs on (18 at most of the 20): every kill lands in a run
        epochs = log.read_text().count(" - epoch ") + rng.randint(0, 3)
        pid = _forked_train(tmp_path, log, *args)
        deadline, ended = time.monotonic() + 120, 0
        while log.read_text().count(" - epoch ") < epochs and time.monotonic() < deadline:
            ended, status = os.waitpid(pid, os.WNOHANG)
            assert not ended, log.read_text()[-2000:]
            time.sleep(0.01)
        time.sleep(rng.uniform(0.0, 0.1))  # a moment into the next epoch, or into its start (last.ckpt read, checks)
        os.kill(pid, signal.SIGKILL)
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        # killed; never refused (exit 2: unreadable last.ckpt), crashed (exit 1) or ended
        assert code == -signal.SIGKILL, log.read_text()[-2000:]
    assert train_py_here(*args, cwd=tmp_path, monkeypatch=monkeypatch) == 0, capfd.readouterr().err[-3000:]
    assert torch.load(tmp_path / "run/checkpoints/last.ckpt", weights_only=True)["global_step"] == 20 * (16000 // 64)
    assert metrics(tmp_path / "run")["val/acc"] >= 0.9


SIGTERM_RUN = {"data.num_samples": 20000, "trainer.max_epochs": 3, "model.optimizer": "adam"}


@pytest.fixture
def ddp_straight(shared_dir):
    """The uninterrupted 2-process run that the stopped ddp run is compared to, run once a session: its run
    directory."""

    def make(run):
        straight = _start(run.parent, *_args("train.py", run.name, **SIGTERM_RUN, strategy="ddp", devices=2)[0])
        _, err = straight.communicate(timeout=240)
        assert straight.returncode == 0, err[-2000:]

    return made_once(shared_dir, "sigterm_ddp_straight", make)


@pytest.mark.parametrize(
    "strategy,target",
    [("auto", "rank 0"), ("ddp", "rank 1")],  # ddp_spawn, torchrun, the CLI: test_sigterm_any_moment's entry points
)
def test_sigterm_stops_with_a_checkpoint_and_resume_equals_uninterrupted(
    tmp_path, request, monkeypatch, strategy, target
):
    import torch
    from conftest import compose_cfg, max_diff, weights

    from dpddp.run.training import train

    settings = {**SIGTERM_RUN, "strategy": strategy, "devices": 2 if strategy.startswith("ddp") else 1}
    args, run = _args("train.py", "run", **settings)
    held, rank = tmp_path / "held", 1 if target == "rank 1" else 0
    hold = ["+callbacks.hold._target_=conftest.HoldAt", "+callbacks.hold.step=300", f"+callbacks.hold.path={held}"]
    env = {"PYTHONPATH": str(ROOT / "tests")}
    proc = _start(tmp_path, *args, *hold, f"+callbacks.hold.rank={rank}", **env)
    last = tmp_path / run / "checkpoints/last.ckpt"
    deadline = time.monotonic() + 120
    while not held.exists() and time.monotonic() < deadline:  # the target rank waits before step 301
        time.sleep(0.05)
    ranks = tagged(proc.tag)
    victim = launched(proc.tag)[0] if target == "rank 1" else [p for p in ranks if p not in launched(proc.tag)][0]
    victim.send_signal(signal.SIGTERM)
    time.sleep(0.2)  # the handler has run: the flag is up before the next step
    held.unlink()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    line = [x for x in err.splitlines() if x.startswith("error: stopped by SIGTERM after step")]
    assert len(line) == 1, err[-2000:]
    command = shlex.split(line[0].split("resume with ", 1)[1])  # the printed command, run as it is
    assert command[:2] == ["python", str(ROOT / "train.py")] and "model.optimizer=adam" in command
    assert "resume=true" in command
    command = command[2:]
    step = torch.load(last, weights_only=True)["global_step"]
    assert 300 < step < 2 * (16000 // 64) or step == 2 * (16000 // 64) + 1  # mid-epoch, after the signal
    assert line[0].startswith(f"error: stopped by SIGTERM after step {step}; checkpoint: {last}")  # its step
    if strategy == "auto":  # one process checks for a SIGTERM after every step; ranks agree about once a second
        assert step == 301
    assert leftover(proc.tag) == []
    if strategy == "auto":  # one process: train.py's calls in this process (conftest.HoldAt imported already)
        assert train_py_here(*command, cwd=tmp_path, monkeypatch=monkeypatch) == 0
    else:
        resumed = _start(tmp_path, *command, **env)
        _, err = resumed.communicate(timeout=240)
        assert resumed.returncode == 0, err[-2000:]
    # the same run uninterrupted: in-process for one process; DDP ranks must be real processes
    if strategy == "auto":
        overrides = [a for a in _args("train.py", "x", **settings)[0] if not a.startswith("hydra.")]
        straight = tmp_path / "straight"
        train(compose_cfg(*overrides, "logger=none"), straight)
    else:
        straight = request.getfixturevalue("ddp_straight")
    assert max_diff(weights(last), weights(straight / "checkpoints/last.ckpt")) <= 1e-6
    # a reported metric's state is in the checkpoint: the resumed epoch's train/loss counts the steps before the
    # stop too (its sum is in the checkpoint)
    assert abs(metrics(tmp_path / run)["train/loss"] - metrics(straight)["train/loss"]) <= 1e-6


def test_a_rank_killed_in_one_sweep_job_does_not_end_the_sweep(tmp_path):
    args = ["-m", "strategy=ddp", "devices=2", "accelerator=cpu", "seed=0,1", "data.num_samples=20000"]
    proc = _start(tmp_path, *args, "trainer.max_epochs=4", *QUIET, "hydra.sweep.dir=sweep")
    deadline = time.monotonic() + 120
    while not (tmp_path / "sweep/0/checkpoints/last.ckpt").exists() and time.monotonic() < deadline:
        time.sleep(0.1)  # training (a rank lost while connecting leaves rank 0 in a wait only an exit ends)
    (rank1,) = launched(proc.tag)
    rank1.send_signal(signal.SIGKILL)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 1, err[-3000:]  # job 0 failed, recorded; job 1 ran to the end
    assert (tmp_path / "sweep/0/error.txt").is_file()
    assert metrics(tmp_path / "sweep/1")["world_size"] == 2
    assert "failed" in (tmp_path / "sweep/summary.md").read_text()
    assert leftover(proc.tag) == []


def test_a_master_addr_that_is_not_this_machines_is_named_not_the_port(tmp_path, monkeypatch, capfd):
    """An address variable left in the shell: one line naming MASTER_ADDR (not MASTER_PORT), exit 2, no rank
    started, no process left (train.py's calls in this process). (The config check's refusal, parallel.rules: the
    CLI's check of the same config is test_cli.py's test_the_cli_applies_the_checks_of_train_py.)"""
    args, _ = _args("train.py", "run", strategy="ddp", devices=2, **{"trainer.max_epochs": 1})
    monkeypatch.setenv("MASTER_ADDR", "198.18.255.1")
    children = set(psutil.Process().children(recursive=True))
    assert train_py_here(*args, cwd=tmp_path, monkeypatch=monkeypatch) == 2
    err = capfd.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("error:")]
    assert lines == [
        "error: MASTER_ADDR=198.18.255.1 (environment) is not an address of this machine, but a one-machine run "
        "(num_nodes=1) starts every rank here: unset MASTER_ADDR (env -u MASTER_ADDR python train.py ...), or run "
        "under a launcher (torchrun, SLURM) to use several machines"
    ]
    assert "MASTER_PORT" not in err and set(psutil.Process().children(recursive=True)) <= children
