"""Elastic training under torchrun (c10d rendezvous, ``--nnodes=1:2``, ``num_nodes=auto``), one node per network
namespace (``scripts/netns_bed.py``): a node that leaves gracefully or abruptly, and one that joins. Each run
must end with the weights and global step of an uninterrupted one-process run, in one run directory, with
nothing left running; and a world size the global batch does not divide is one line before any collective."""

import csv
import random
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import QUIET, ROOT, child_env, compose_cfg, made_once, max_diff, metrics, train_py_here, weights
from netns import bed_fixture, netns_available, netns_bed, pids_in, run_in

from dpddp.run.training import train

pytestmark = pytest.mark.slow
bed2 = bed_fixture(2)
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
RDZV_PORT = 29400  # every namespace has its own ports
# 410 training samples: 25 steps an epoch, 50 in all.
ARGS = ["accelerator=cpu", "data.num_samples=512", "data.batch_size=16", "trainer.max_epochs=2", *QUIET]


def _node(bed, node: int, cwd: Path, *extra: str) -> subprocess.Popen:
    """Start node ``node``'s torchrun agent: c10d rendezvous on node 0, 1 to 2 nodes of one process, restarts."""
    conf = f"is_host={int(node == 0)},last_call_timeout=5,keep_alive_interval=1,keep_alive_max_attempt=3"
    rdzv = [
        "--nnodes=1:2", "--nproc_per_node=1", "--rdzv-backend=c10d", f"--rdzv-endpoint={bed.master_addr}:{RDZV_PORT}",
        f"--rdzv-conf={conf}", f"--local-addr={bed.addresses[node]}", "--rdzv-id=elastic", "--max-restarts=2",
        "--monitor-interval=0.2",
    ]  # fmt: skip
    cmd = [*TORCHRUN, *rdzv, str(ROOT / "train.py"), "strategy=ddp", "devices=1", "num_nodes=auto", *ARGS, *extra]
    env, _ = child_env(PYTHONPATH=str(ROOT / "tests"), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        env.pop(var, None)
    out = open(cwd / f"node{node}.out", "w")
    return run_in(bed.nodes[node], cmd, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT)


def _outputs(cwd: Path) -> str:
    return "\n".join((cwd / f"node{i}.out").read_text()[-4000:] for i in (0, 1))


def _single(shared_dir: Path) -> Path:
    """``ARGS`` on one process (trained in this process), made once a session: what every run here ends as."""
    return made_once(shared_dir, "elastic_single", lambda path: train(compose_cfg(*ARGS, "logger=none"), path))


def _check(tmp_path: Path, sizes: list[int], shared_dir: Path) -> tuple[Path, float]:
    """One run directory, segments of ``sizes`` processes, the one-process run's step and weights (1e-5); returns
    the run directory and the weight difference."""
    runs = [p.parent for p in tmp_path.glob("outputs/*/metrics.json")]
    assert [r.name for r in runs] == ["torchrun-elastic"], _outputs(tmp_path)
    (run_dir,) = runs
    assert [p.name for p in (tmp_path / "outputs").iterdir()] == ["torchrun-elastic"]
    result = metrics(run_dir)
    assert result["segment_world_sizes"] == sizes, result
    single = _single(shared_dir)
    assert result["world_size"] == sizes[-1] and result["num_nodes"] == sizes[-1]
    diff = max_diff(weights(run_dir / "checkpoints/last.ckpt"), weights(single / "checkpoints/last.ckpt"))
    assert diff <= 1e-5
    assert result["segments"] == len(sizes) and metrics(single)["segments"] == 1
    steps = [torch.load(d / "checkpoints/last.ckpt", weights_only=True)["global_step"] for d in (run_dir, single)]
    assert steps == [50, 50]
    return run_dir, diff


def _left(bed) -> list[list[int]]:
    """The processes still running in each node's namespace, half a second after the run ended."""
    time.sleep(0.5)
    return [pids_in(ns) for ns in bed.nodes]


def _figures(tmp_path: Path, run_dir: Path, since: str) -> float:
    """Seconds from the mark ``since`` (the loss, or the join) to the first step of the last start."""
    return metrics(run_dir)["first_step_unix_s"] - float((tmp_path / since).read_text())


@pytest.fixture(scope="module")
def left_and_rejoined(tmp_path_factory) -> dict:
    """One run on two nodes that the leave's test and the join's test share: SIGTERM to node 1's agent at step 10
    (mid-epoch 0); node 0 continues alone; held at step 30, node 1 starts again and both continue on world size 2.
    Returns the working directory, the exit statuses (node 0, node 1's first agent, its second), node 1's first
    output and the processes left in each namespace."""
    reason = netns_available()
    if reason is not None:
        pytest.skip(reason)
    cwd = tmp_path_factory.mktemp("rejoined")
    term = ["+callbacks.term._target_=elastic_kill.TermAgentAt", "+callbacks.term.step=10"]
    hold = ["+callbacks.hold._target_=elastic_kill.HoldAlone", "+callbacks.hold.step=30"]
    with netns_bed(2) as bed:
        first = [_node(bed, node, cwd, *term, *hold) for node in (0, 1)]
        left = first[1].wait(timeout=240)
        first_out = (cwd / "node1.out").read_text()
        deadline = time.monotonic() + 120
        while not (cwd / "held").exists() and time.monotonic() < deadline:
            assert first[0].poll() is None, _outputs(cwd)
            time.sleep(0.2)
        (cwd / "joined").write_text(f"{time.time()}\n")
        second = _node(bed, 1, cwd, *term, *hold)
        codes = [p.wait(timeout=240) for p in (first[0], second)]
        return {"cwd": cwd, "codes": [codes[0], left, codes[1]], "node1_first": first_out, "left": _left(bed)}


def test_node_leaving_gracefully_stops_every_rank_at_one_step_and_the_other_continues(left_and_rejoined, shared_dir):
    """SIGTERM to node 1's agent at step 10 (mid-epoch 0): both ranks stop at step 10 with last.ckpt there, node
    1's agent ends, node 0's restarts its worker alone (world size 1) from step 10, to the join at step 30 (the
    next test's) and the end: nothing retrained, nothing left running."""
    run, cwd = left_and_rejoined, left_and_rejoined["cwd"]
    node0, node1_first, _ = run["codes"]
    assert node0 == 0 and node1_first != 0, _outputs(cwd)
    run_dir, diff = _check(cwd, [2, 1, 2], shared_dir)
    assert run["left"] == [[], []]
    for out in (run["node1_first"], (cwd / "node0.out").read_text()):  # every rank stopped at the same step
        assert "error: stopped by SIGTERM after step 10; checkpoint: " in out
    log = (run_dir / "train.log").read_text()
    assert "world size 2: 2 nodes x 1 process (torchrun WORLD_SIZE=2)" in log, log[-3000:]
    assert "resuming interrupted job from" in log and "world size 1: 1 node x 1 process" in log
    print(f"graceful then join: weight difference {diff:.1e}")


def test_node_joining_continues_on_the_larger_world_size(left_and_rejoined, shared_dir):
    """node 0 runs alone (the previous test's leave) and holds at step 30; node 1 starts; node 0's agent stops its
    worker (SIGTERM: step 30, last.ckpt there) and both continue on world size 2 from it: nothing retrained,
    nothing left running."""
    run, cwd = left_and_rejoined, left_and_rejoined["cwd"]
    assert [run["codes"][0], run["codes"][2]] == [0, 0], _outputs(cwd)
    run_dir, diff = _check(cwd, [2, 1, 2], shared_dir)
    assert run["left"] == [[], []]
    assert "error: stopped by SIGTERM after step 30; checkpoint: " in (cwd / "node0.out").read_text()
    log = (run_dir / "train.log").read_text()
    assert "world size 1: 1 node x 1 process" in log and "world size 2: 2 nodes x 1 process" in log, log[-3000:]
    print(f"join: continued on 2 nodes {_figures(cwd, run_dir, 'joined'):.1f} s after node 1 started, 0 steps "
          f"retrained, weight difference {diff:.1e}")  # fmt: skip


def test_node_killed_the_other_continues_from_last_ckpt(bed2, tmp_path, shared_dir):
    """node 1's agent and worker SIGKILLed at a seeded random step of epoch 1, with ``checkpoint.every_n_steps=5``:
    node 0's rank ends (the lost node named), its agent restarts it alone from the step-interval last.ckpt, and at
    most 5 steps are trained again."""
    every, kill_step = 5, random.Random(39).randint(26, 49)
    kill = ["+callbacks.kill._target_=elastic_kill.KillNodeAt", f"+callbacks.kill.step={kill_step}"]
    kill += ["+callbacks.starts._target_=elastic_kill.StartSteps", f"checkpoint.every_n_steps={every}"]
    procs = [_node(bed2, node, tmp_path, *kill, "strategy.timeout_s=30") for node in (0, 1)]
    codes = [p.wait(timeout=240) for p in procs]
    out = _outputs(tmp_path)
    assert codes[0] == 0 and codes[1] == -9, out
    assert "error: node 1 (rank 1) lost" in out, out
    run_dir, diff = _check(tmp_path, [2, 1], shared_dir)
    assert _left(bed2) == [[], []]
    log = (run_dir / "train.log").read_text()
    assert "resuming interrupted job from" in log, log[-3000:]
    rows = list(csv.DictReader((run_dir / "metrics.csv").open()))
    assert [r["world_size"] for r in rows] == ["2", "1", "1"]  # epoch 0 on 2 processes, epoch 1 and test on 1
    first, resumed = map(int, (tmp_path / "starts").read_text().split())
    assert first == 0 and 0 <= kill_step - resumed <= every, (kill_step, resumed)
    print(f"abrupt: continued {_figures(tmp_path, run_dir, 'lost'):.1f} s after the SIGKILL at step {kill_step}, "
          f"{kill_step - resumed} steps retrained, weight difference {diff:.1e}")  # fmt: skip


def test_world_size_the_global_batch_does_not_divide_is_one_line(tmp_path, monkeypatch, capfd):
    """A launcher's WORLD_SIZE of 3 with data.batch_size=64, num_nodes=auto: one line naming both, exit 2, before
    any collective (the rendezvous address answers nothing). train.py's calls in this process."""
    launcher = dict(
        TORCHELASTIC_RUN_ID="job", WORLD_SIZE="3", RANK="0", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
        GROUP_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="9", TORCHELASTIC_RESTART_COUNT="0",
    )  # fmt: skip
    for key, value in launcher.items():
        monkeypatch.setenv(key, value)
    code = train_py_here("strategy=ddp", "devices=1", "num_nodes=auto", cwd=tmp_path, monkeypatch=monkeypatch)
    out, err = capfd.readouterr()
    errors = [line for line in (out + err).splitlines() if "error:" in line]
    assert code == 2, err[-3000:]
    assert errors == [
        "error: data.batch_size=64 (global) does not divide by the world size 3 (torchrun WORLD_SIZE=3): use a "
        "multiple of 3"
    ], err[-3000:]


def test_a_requeued_slurm_job_continues_its_run_and_another_job_is_refused_there(
    tmp_path, shared_dir, monkeypatch, capfd
):
    """A SLURM job (simulated, one task) killed at step 31 is requeued under its job id: the same command continues
    its outputs/slurm-<id> from last.ckpt without resume=true, to the weights of a straight run; a job with another
    id pointed at that directory is refused in one line (train.py's calls in this process: a refusal is made before
    anything starts)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    slurm = dict(SLURM_NTASKS="1", SLURM_NTASKS_PER_NODE="1", SLURM_NNODES="1", SLURM_JOB_NAME="train")
    slurm.update(SLURM_NODEID="0", SLURM_NODELIST="127.0.0.1", SLURM_PROCID="0", SLURM_LOCALID="0")
    slurm.update(MASTER_PORT=str(port), PYTHONPATH=str(ROOT / "tests"))
    cmd = [sys.executable, str(ROOT / "train.py"), "strategy=ddp", "devices=1", "num_nodes=auto", *ARGS]
    kill = ["+callbacks.kill._target_=conftest.SigkillAt", "+callbacks.kill.at=30"]

    def job(job_id: str, *extra: str) -> subprocess.CompletedProcess:
        env, _ = child_env(**slurm, SLURM_JOB_ID=job_id)
        return subprocess.run([*cmd, *extra], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)

    assert job("71", *kill).returncode == -9
    run_dir = tmp_path / "outputs" / "slurm-71"
    requeued = job("71", *kill)  # the same script again: it resumes at step 25, so the kill's batch never comes
    assert requeued.returncode == 0, requeued.stderr[-3000:]
    assert "resuming interrupted job from" in (run_dir / "train.log").read_text()
    assert metrics(run_dir)["segment_world_sizes"] == [1, 1]
    single = _single(shared_dir)
    assert max_diff(weights(run_dir / "checkpoints/last.ckpt"), weights(single / "checkpoints/last.ckpt")) <= 1e-6
    for key, value in {**slurm, "SLURM_JOB_ID": "72"}.items():
        monkeypatch.setenv(key, value)
    capfd.readouterr()
    code = train_py_here(*cmd[2:], f"hydra.run.dir={run_dir}", cwd=tmp_path, monkeypatch=monkeypatch)
    err = capfd.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code == 2 and len(errors) == 1 and "holds another run" in errors[0], err[-3000:]
