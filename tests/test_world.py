"""The run's facts that every room reads from one function: the process that writes the outputs, and a launched
rank's global rank (its log file's name)."""

import json
import subprocess
import sys

import pytest
import torch
from conftest import QUIET, ROOT, child_env, compose_cfg, global_step

from dpddp import cluster, errors
from dpddp.cluster import LAUNCHED_ENV, writes_outputs
from dpddp.parallel.rules import world_of


@pytest.mark.parametrize(
    ("env", "writes"),
    [
        ({}, True),  # one process, or rank 0 before it launches the others
        ({"RANK": "0"}, True),  # torchrun's global rank 0
        ({"RANK": "3"}, False),
        ({"SLURM_PROCID": "1"}, False),
        ({LAUNCHED_ENV: "1"}, False),  # a rank that dpddp's launcher started: never rank 0's outputs
    ],
)
def test_one_process_writes_the_outputs(monkeypatch, env, writes):
    for key in ("RANK", "SLURM_PROCID", LAUNCHED_ENV):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert writes_outputs() is writes


def test_a_launched_ranks_global_rank_counts_the_visible_gpus_for_devices_minus_one(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    monkeypatch.setenv(LAUNCHED_ENV, "1")
    for (node, local, devices), rank in {(1, 2, -1): 6, (2, 1, 3): 7, (None, 1, 2): 1}.items():  # 6: not 1 * -1 + 2
        monkeypatch.delenv("NODE_RANK", raising=False)  # one node: no NODE_RANK
        if node is not None:
            monkeypatch.setenv("NODE_RANK", str(node))
        monkeypatch.setenv("LOCAL_RANK", str(local))
        config = compose_cfg("strategy=ddp", f"devices={devices}", "accelerator=cpu")
        assert world_of(config).global_rank == rank
        assert not world_of(config).writes_outputs


@pytest.mark.parametrize(
    ("env", "local"),
    [({}, 0), ({"LOCAL_RANK": "2"}, 2), ({"SLURM_LOCALID": "3"}, 3), ({"LOCAL_RANK": "1", "SLURM_LOCALID": "3"}, 1)],
)
def test_one_local_rank_for_every_room(monkeypatch, env, local):
    """The local rank (a GPU's index, who says a stop's line) is one function: torchrun's, then SLURM's."""
    for key in ("LOCAL_RANK", "SLURM_LOCALID"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert cluster.local_rank is errors.local_rank
    assert world_of(compose_cfg("accelerator=cpu")).local_rank == local


COUNTING = """
import atexit, json, runpy, sys, torch
import dpddp.run.config as config
calls, loads, out = [], [], sys.argv.pop(1)
for name in ("_check_settings", "check_checkpoint"):
    check = getattr(config, name)
    setattr(config, name, lambda *a, _check=check, _name=name, **k: (calls.append(_name), _check(*a, **k))[1])
load = torch.load
def counted(path, *a, **k):
    loads.append([str(getattr(path, "path", path)), sys._getframe(1).f_globals.get("__name__", "")])
    return load(path, *a, **k)
torch.load = counted
atexit.register(lambda: open(out, "w").write(json.dumps({"checks": calls, "loads": loads})))
sys.argv[0] = sys.argv[1] = sys.argv[1]
sys.argv.pop(1)
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _counted_run(tmp_path, *args: str) -> dict:
    out = tmp_path / "counts.json"
    env, _ = child_env()
    cmd = [sys.executable, "-c", COUNTING, str(out), str(ROOT / "train.py"), *args, *QUIET]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_a_continued_run_checks_its_config_once_and_opens_last_ckpt_once_before_training(tmp_path):
    """``python train.py resume=true``: Hydra's start checks check the settings once and ``last.ckpt`` once, the job
    takes their decision (no check of its own) and reads ``last.ckpt``'s facts once; the next load is Lightning's
    restore, as training starts."""
    args = ["trainer.max_epochs=1", "data.num_samples=256", f"hydra.run.dir={tmp_path / 'run'}"]
    assert _counted_run(tmp_path, *args)["checks"] == ["_check_settings", "check_checkpoint"]
    one_epoch = global_step(tmp_path / "run")
    counts = _counted_run(tmp_path, *args[1:], "trainer.max_epochs=2", "resume=true")
    assert counts["checks"] == ["_check_settings", "check_checkpoint", "check_checkpoint"]  # none, then last.ckpt
    last = [who for path, who in counts["loads"] if path.endswith("last.ckpt")]
    # the start callback's read (its decision and check), the job's (its plan's facts: Hydra hands it the config
    # only), then Lightning's restore (an fsspec file)
    assert last[:3] == ["dpddp.continuity.io", "dpddp.continuity.io", "lightning.fabric.utilities.cloud_io"]
    assert global_step(tmp_path / "run") == 2 * one_epoch > 0
