"""Processes started by a cluster: torchrun (2 nodes on loopback, standalone), simulated SLURM, mismatches."""

import shutil
import subprocess
import sys
import time
import uuid

import psutil
import pytest
from conftest import QUIET, ROOT, child_env, compose_cfg, free_port, leftover, metrics, train_py_here
from netns import netns_available

from dpddp.run.training import train

pytestmark = pytest.mark.slow
SMALL = ["accelerator=cpu", "data.num_samples=606", "trainer.max_epochs=2", *QUIET]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]


def _start(cmd, cwd, tag, **env):
    full, _ = child_env(**env, DPDDP_TEST_TAG=tag)
    return subprocess.Popen(cmd, cwd=cwd, env=full, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(procs, timeout):
    start, out = time.monotonic(), []
    for p in procs:
        out.append(p.communicate(timeout=max(1, timeout - (time.monotonic() - start)))[0])
    return [p.returncode for p in procs], out, time.monotonic() - start


FAST_S = 75
"""A refusal "before anything starts" ends well within this, however loaded the machine; a hang waits for
``strategy.timeout_s`` (180 s) or is killed at the call's timeout (150 s or more)."""


def _two_nodes(tmp_path, *args, timeout=180):
    port, tag = free_port(), uuid.uuid4().hex
    node = ["--nnodes=2", "--nproc_per_node=1", "--master_addr=127.0.0.1", f"--master_port={port}"]
    procs = [
        _start([*TORCHRUN, *node, f"--node_rank={r}", str(ROOT / "train.py"), *args], tmp_path, tag) for r in (0, 1)
    ]
    codes, out, seconds = _finish(procs, timeout)
    return codes, out, seconds, tag


@pytest.mark.skipif(netns_available() is None, reason="test_multinode runs these 2 nodes on 2 network namespaces")
def test_two_node_torchrun_on_loopback_trains_one_model(tmp_path):
    """Where no network namespaces can be made (not root): the 2-node torchrun run of ``test_multinode``, on
    loopback, with the same assertions."""
    codes, out, _, tag = _two_nodes(tmp_path, "strategy=ddp", "devices=1", "num_nodes=2", *SMALL)
    assert codes == [0, 0], out[0][-3000:] + out[1][-3000:]
    (run_dir,) = [p.parent for p in tmp_path.glob("outputs/*/metrics.json")]  # one run directory
    m = metrics(run_dir)
    assert (m["world_size"], m["num_nodes"], m["devices"]) == (2, 2, 1)
    assert run_dir.name.startswith("torchrun-")
    assert [p.name for p in run_dir.glob("*.log")] and (run_dir / "rank1.log").is_file()
    assert len(list(tmp_path.glob("outputs/**/.hydra"))) == 1  # rank 1 wrote no config copy
    single = train(compose_cfg(*SMALL, "logger=none"), tmp_path / "single")
    for key in ("val/loss", "val/acc", "test/loss", "test/acc"):
        assert m[key] == pytest.approx(single[key], abs=1e-6), key
    assert leftover(tag) == []


def test_num_nodes_mismatch_under_torchrun_fails_fast_on_every_node(tmp_path):
    codes, out, seconds, tag = _two_nodes(tmp_path, "strategy=ddp", "devices=1", "num_nodes=3", *SMALL, timeout=150)
    # Fast: a missed check would wait for the third process (strategy.timeout_s=180) until killed at 150 s; the
    # refusal comes after two torchrun agents and their workers start up (32 s once on a loaded 2-core CI run).
    assert all(code != 0 for code in codes) and seconds < FAST_S
    assert "devices=1 x num_nodes=3 = 3 processes, but the cluster started 2" in out[0] + out[1]
    assert leftover(tag) == []


def test_standalone_torchrun_two_processes(tmp_path):
    tag = uuid.uuid4().hex
    cmd = [*TORCHRUN, "--standalone", "--nproc_per_node=2", str(ROOT / "train.py"), "strategy=ddp", "devices=2"]
    codes, out, _ = _finish([_start([*cmd, *SMALL], tmp_path, tag)], 180)
    assert codes == [0], out[0][-3000:]
    (run_dir,) = [p.parent for p in tmp_path.glob("outputs/*/metrics.json")]
    assert metrics(run_dir)["world_size"] == 2
    assert leftover(tag) == []


def _slurm(tmp_path, ntasks, devices, job_id):
    tag, port = uuid.uuid4().hex, free_port()
    env = dict(SLURM_NTASKS=str(ntasks), SLURM_NTASKS_PER_NODE=str(ntasks), SLURM_NNODES="1", SLURM_JOB_NAME="train")
    env.update(SLURM_JOB_ID=job_id, SLURM_NODEID="0", SLURM_NODELIST="127.0.0.1", MASTER_PORT=str(port))
    cmd = [sys.executable, str(ROOT / "train.py"), "strategy=ddp", f"devices={devices}", *SMALL]
    procs = [_start(cmd, tmp_path, tag, SLURM_PROCID=str(r), SLURM_LOCALID=str(r), **env) for r in range(ntasks)]
    codes, out, seconds = _finish(procs, 180)
    assert leftover(tag) == []
    return codes, out, seconds


@pytest.mark.skipif(shutil.which("srun") is not None, reason="a real SLURM host")
def test_simulated_slurm_job_with_two_tasks(tmp_path):
    codes, out, _ = _slurm(tmp_path, ntasks=2, devices=2, job_id="4242")
    assert codes == [0, 0], out[0][-3000:] + out[1][-3000:]
    m = metrics(tmp_path / "outputs" / "slurm-4242")
    assert m["world_size"] == 2


def test_simulated_slurm_task_mismatch_is_refused(tmp_path, monkeypatch, capfd):
    """A cluster task count that disagrees with devices x num_nodes: one task started, devices=2 asked; train.py
    runs here (one task: the refusal before anything starts is the point, not a process)."""
    env = dict(SLURM_NTASKS="1", SLURM_NTASKS_PER_NODE="1", SLURM_NNODES="1", SLURM_JOB_NAME="train")
    env.update(SLURM_JOB_ID="4243", SLURM_NODEID="0", SLURM_NODELIST="127.0.0.1", MASTER_PORT=str(free_port()))
    for key, value in dict(env, SLURM_PROCID="0", SLURM_LOCALID="0").items():
        monkeypatch.setenv(key, value)
    start, children = time.monotonic(), set(psutil.Process().children(recursive=True))  # an earlier test's fork server
    code = train_py_here("strategy=ddp", "devices=2", *SMALL, cwd=tmp_path, monkeypatch=monkeypatch)
    assert code == 2 and time.monotonic() - start < FAST_S
    assert set(psutil.Process().children(recursive=True)) <= children  # no rank started, none left
    line = [x for x in "".join(capfd.readouterr()).splitlines() if x.startswith("error:")]
    assert line == [
        "error: devices=2 x num_nodes=1 = 2 processes, but the cluster started 1 (SLURM_NTASKS=1): "
        "make devices x num_nodes match the cluster's tasks"
    ]
