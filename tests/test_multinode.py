"""Multi-node for real: one node per network namespace (``scripts/netns_bed.py``, addresses 198.18.0.<i+1>), no
``GLOO_SOCKET_IFNAME`` given; a lost node; listening sockets; a torchrun restart that resumes."""

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import QUIET, ROOT, child_env, compose_cfg, leftover, made_once, max_diff, metrics, weights
from netns import IFNAME, bed_fixture, listening, pids_in, run_in

from dpddp.run.training import train

pytestmark = pytest.mark.slow
bed2 = bed_fixture(2)
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
PORT = 29555  # every namespace has its own ports
TIMEOUT_S = 15  # strategy.timeout_s of the lost-node tests: a heartbeat thread's, so load does not trip it
SMALL = ["accelerator=cpu", "data.num_samples=608", "trainer.max_epochs=2", *QUIET]


def _env(**extra: str) -> dict[str, str]:
    env, _ = child_env(**extra)
    for var in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
        env.pop(var, None)
    return env


def _node_cmd(how: str, bed, node: int, devices: int, run_dir: Path, *args: str) -> tuple[list[str], dict]:
    """The command (and extra environment) that starts node ``node`` of a 2-node run, by torchrun or by hand."""
    train_args = [str(ROOT / "train.py"), "strategy=ddp", f"devices={devices}", "num_nodes=2", *args]
    if how == "torchrun":
        rdzv = [f"--master_addr={bed.master_addr}", f"--master_port={PORT}", "--nnodes=2", f"--node_rank={node}"]
        return [*TORCHRUN, *rdzv, f"--nproc_per_node={devices}", *train_args], {}
    extra = {"MASTER_ADDR": bed.master_addr, "MASTER_PORT": str(PORT), "NODE_RANK": str(node)}
    return [sys.executable, *train_args, f"hydra.run.dir={run_dir}"], extra


class _Listeners(threading.Thread):
    """Collects the listening sockets of every node namespace while a run goes on."""

    def __init__(self, bed) -> None:
        super().__init__(daemon=True)
        self.bed, self.seen, self.done = bed, {}, threading.Event()

    def run(self) -> None:
        while not self.done.wait(0.3):
            for ns in self.bed.nodes:
                for sock in listening(ns):
                    self.seen[(ns, sock.address, sock.port)] = sock


def _start(bed, how, devices, cwd, *args):
    procs = []
    for node, ns in enumerate(bed.nodes):
        cmd, extra = _node_cmd(how, bed, node, devices, cwd / "outputs" / "by-hand", *args)
        out = open(cwd / f"node{node}.out", "w")
        procs.append(run_in(ns, cmd, env=_env(**extra), cwd=cwd, stdout=out, stderr=subprocess.STDOUT))
    return procs


# torchrun with one rank per node: torchrun's two ranks per node reach each of its paths (local rank 0 and 1)
@pytest.mark.parametrize(("how", "devices"), [("torchrun", 2), ("by-hand", 2)])
def test_two_nodes_on_separate_interfaces_train_one_model(bed2, tmp_path, shared_dir, how, devices):
    watch = _Listeners(bed2)
    watch.start()
    procs = _start(bed2, how, devices, tmp_path, *SMALL)
    codes = [p.wait(timeout=120) for p in procs]
    watch.done.set()
    watch.join()
    out = [(tmp_path / f"node{i}.out").read_text() for i in (0, 1)]
    assert codes == [0, 0], out[0][-3000:] + out[1][-3000:]
    (run_dir,) = [p.parent for p in tmp_path.glob("outputs/*/metrics.json")]  # one run directory
    m = metrics(run_dir)
    assert (m["world_size"], m["num_nodes"], m["devices"]) == (2 * devices, 2, devices)
    assert len(list(tmp_path.glob("outputs/**/.hydra"))) == 1  # global rank 0's
    assert "network: GLOO_SOCKET_IFNAME=dpddp0 (routes to MASTER_ADDR=198.18.0.1 from 198.18.0.2)" in out[1]
    if how == "torchrun":  # torchrun's run id names the directory; each rank logs to its own file
        assert run_dir.name.startswith("torchrun-") and (run_dir / f"rank{2 * devices - 1}.log").is_file()
    single = made_once(shared_dir, "multinode_single", lambda path: train(compose_cfg(*SMALL, "logger=none"), path))
    one, last = metrics(single), "checkpoints/last.ckpt"
    assert max_diff(weights(run_dir / last), weights(single / last)) <= 1e-5
    for key in ("val/loss", "val/acc", "test/loss", "test/acc"):
        assert m[key] == pytest.approx(one[key], abs=1e-6), key
    # No wildcard listener but torchrun's own agent store (owned by the torchrun process we started).
    torchrun_pids = {p.pid for p in procs} if how == "torchrun" else set()
    wildcard = [s for s in watch.seen.values() if s.wildcard and not {pid for _, pid in s.owners} <= torchrun_pids]
    assert wildcard == [], watch.seen
    assert any(not s.wildcard for s in watch.seen.values())  # the project's own sockets were seen
    if how == "by-hand":  # rank 0's own store, on node 0's address
        assert (bed2.nodes[0], bed2.master_addr, PORT) in watch.seen


def test_killed_node_ends_the_run_on_the_other_node(bed2, tmp_path):
    args = [*SMALL[:2], *QUIET, "trainer.max_epochs=100000", f"strategy.timeout_s={TIMEOUT_S}"]
    procs = _start(bed2, "torchrun", 1, tmp_path, *args)
    deadline = time.monotonic() + 90
    while not list(tmp_path.glob("outputs/*/checkpoints/last.ckpt")) and time.monotonic() < deadline:
        assert procs[0].poll() is None, (tmp_path / "node0.out").read_text()[-3000:]
        time.sleep(0.2)
    time.sleep(1.0)  # training
    for pid in pids_in(bed2.nodes[1]):
        os.kill(pid, signal.SIGKILL)
    start = time.monotonic()
    code = procs[0].wait(timeout=60)
    seconds = time.monotonic() - start
    out = (tmp_path / "node0.out").read_text()
    assert code != 0 and seconds <= TIMEOUT_S + 10, (code, seconds)
    assert "error: node 1 (rank 1) lost" in out, out[-3000:]
    time.sleep(0.5)
    assert pids_in(bed2.nodes[0]) == [] and pids_in(bed2.nodes[1]) == []


def test_silent_node_ends_the_run_on_the_other_node(bed2, tmp_path):
    """Node 1 loses its link (its interface set down): its processes do not exit, nothing answers. Node 0 ends
    within ``strategy.timeout_s`` + 10 s, non-zero, with one line naming node 1; node 1 ends by itself on its own
    timeout; nothing is left in either namespace. A node that stops answering with its link up (``SIGSTOP``) takes
    the same branches: on node 0 node 1's heartbeat goes stale (``PeerWatch._lost``), and node 1, run again, finds
    the store silent past its timeout (the same ``_lost``) or its connections reset (the killed node's path)."""
    args = [*SMALL[:2], *QUIET, "trainer.max_epochs=100000", f"strategy.timeout_s={TIMEOUT_S}"]
    procs = _start(bed2, "torchrun", 1, tmp_path, *args)
    deadline = time.monotonic() + 90
    while not list(tmp_path.glob("outputs/*/checkpoints/last.ckpt")) and time.monotonic() < deadline:
        assert procs[0].poll() is None, (tmp_path / "node0.out").read_text()[-3000:]
        time.sleep(0.2)
    subprocess.run(["ip", "-n", bed2.nodes[1], "link", "set", IFNAME, "down"], check=True)
    start = time.monotonic()
    code = procs[0].wait(timeout=60)
    seconds = time.monotonic() - start
    out = (tmp_path / "node0.out").read_text()
    assert code != 0 and seconds <= TIMEOUT_S + 10, (code, seconds, out[-3000:])
    lines = [line for line in out.splitlines() if "error: node 1 (rank 1) lost" in line]
    assert len(lines) == 1, out[-3000:]
    assert procs[1].wait(timeout=30) != 0
    time.sleep(0.5)
    assert pids_in(bed2.nodes[0]) == [] and pids_in(bed2.nodes[1]) == []


def test_torchrun_restart_resumes_from_last_ckpt(tmp_path):
    """``--max-restarts=1``, rank 1 killed (SIGKILL) in the middle of epoch 2: torchrun restarts both workers in
    the same run directory; they meet in a fresh key prefix of the agent's store (which keeps the failed attempt's
    keys) and continue from ``last.ckpt`` to the weights of an uninterrupted run."""
    args = ["accelerator=cpu", "data.num_samples=512", "data.batch_size=16", "trainer.max_epochs=3", *QUIET]
    env, tag = child_env(PYTHONPATH=str(ROOT / "tests"))
    kill = ["+callbacks.kill._target_=elastic_kill.KillAt", "+callbacks.kill.step=40"]
    cmd = [*TORCHRUN, "--standalone", "--nproc_per_node=2", "--max-restarts=1", "--monitor-interval=0.2"]
    cmd += [str(ROOT / "train.py"), "strategy=ddp", "devices=2", "strategy.timeout_s=30", *args, *kill]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=150)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    # torchrun saw the attempt fail: rank 1 killed (-9), or rank 0 ending 1 on its lost peer when torchrun's
    # monitor polls after rank 0 has seen the loss (either is first on a loaded machine)
    assert re.search(r"failed \(exitcode: (-9|1)\) local_rank", out), out[-3000:]
    (run_dir,) = [p.parent for p in tmp_path.glob("outputs/*/metrics.json")]  # one run directory
    assert "resuming interrupted job from" in (run_dir / "train.log").read_text()
    single = tmp_path / "single"
    train(compose_cfg(*args, "logger=none"), single)
    assert max_diff(weights(run_dir / "checkpoints/last.ckpt"), weights(single / "checkpoints/last.ckpt")) <= 1e-5
    assert leftover(tag) == []
