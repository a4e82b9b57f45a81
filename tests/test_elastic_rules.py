"""``num_nodes=auto``: the world size a launcher gives, the checks it must pass, and the launch id that lets every
(re)start of one job find its run (the elastic runs themselves: tests/test_elastic.py)."""

import pytest
from conftest import compose_cfg

from dpddp.cluster import launch_id, run_name
from dpddp.errors import ConfigError
from dpddp.run.config import check_config
from dpddp.run.training import _log_world

TORCHRUN = dict(TORCHELASTIC_RUN_ID="job7", RANK="0", LOCAL_RANK="0", GROUP_RANK="0", MASTER_ADDR="10.9.9.9")


def _env(monkeypatch, **env: str) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)


@pytest.mark.parametrize(("world", "devices", "expected"), [("1", 1, 1), ("2", 1, 2), ("4", 2, 2), ("6", 3, 2)])
def test_auto_takes_the_torchrun_world_size(monkeypatch, world, devices, expected):
    _env(monkeypatch, **TORCHRUN, WORLD_SIZE=world, LOCAL_WORLD_SIZE=str(devices), MASTER_PORT="29500")
    cfg = compose_cfg("strategy=ddp", f"devices={devices}", "num_nodes=auto", "accelerator=cpu", "data.batch_size=48")
    got = check_config(cfg).world
    assert (got.nodes, got.world_size) == (expected, int(world))
    assert got.world_size_source == f"torchrun WORLD_SIZE={world}"


def test_auto_takes_the_slurm_task_count(monkeypatch):
    env = dict(SLURM_NTASKS="4", SLURM_NTASKS_PER_NODE="2", SLURM_NNODES="2", SLURM_JOB_NAME="train")
    _env(monkeypatch, **env, SLURM_JOB_ID="55", SLURM_PROCID="0", SLURM_LOCALID="0", SLURM_NODEID="0")
    cfg = compose_cfg("strategy=ddp", "devices=2", "num_nodes=auto", "accelerator=cpu")
    world = check_config(cfg).world
    assert (world.nodes, world.world_size, world.world_size_source) == (2, 4, "SLURM_NTASKS=4")
    assert launch_id() == "slurm:55"  # a requeue keeps the job id, and so the run


def test_auto_outside_a_launcher_is_one_node():
    cfg = compose_cfg("strategy=ddp", "devices=2", "num_nodes=auto", "accelerator=cpu")
    world = check_config(cfg).world
    assert (world.nodes, world.world_size, world.world_size_source) == (1, 2, "devices x num_nodes")
    assert launch_id() is None


@pytest.mark.parametrize(
    ("env", "args", "message"),
    [
        (dict(WORLD_SIZE="3", LOCAL_WORLD_SIZE="1"), ["devices=1"],
         "data.batch_size=64 (global) does not divide by the world size 3 (torchrun WORLD_SIZE=3): use a multiple "
         "of 3"),
        (dict(WORLD_SIZE="3", LOCAL_WORLD_SIZE="2"), ["devices=2"],
         "num_nodes=auto: the cluster started 3 processes (torchrun WORLD_SIZE=3), which devices=2 per node does not "
         "divide: set devices to the processes per node"),
        (dict(WORLD_SIZE="4", LOCAL_WORLD_SIZE="2"), ["devices=1"],
         "devices=1 but torchrun started 2 processes on this node (LOCAL_WORLD_SIZE=2): set devices=2, or torchrun "
         "--nproc_per_node=1"),
        (dict(WORLD_SIZE="2", LOCAL_WORLD_SIZE="1", TORCHELASTIC_RUN_ID="none"), ["devices=1"],
         "num_nodes=auto under torchrun without --rdzv-id: every start of an elastic job finds its run directory and "
         "last.ckpt by the job's id: add torchrun --rdzv-id=<job id>"),
    ],
)  # fmt: skip
def test_auto_refusals_are_one_line(monkeypatch, env, args, message):
    _env(monkeypatch, **{**TORCHRUN, "MASTER_PORT": "29500", **env})
    with pytest.raises(ConfigError) as err:
        check_config(compose_cfg("strategy=ddp", *args, "num_nodes=auto", "accelerator=cpu"))
    assert str(err.value) == message


def test_an_explicit_num_nodes_must_still_match(monkeypatch):
    _env(monkeypatch, **TORCHRUN, WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_PORT="29500")
    with pytest.raises(ConfigError, match=r"devices=1 x num_nodes=2 = 2 processes, but the cluster started 1"):
        check_config(compose_cfg("strategy=ddp", "devices=1", "num_nodes=2", "accelerator=cpu"))


def test_launch_ids_and_run_names_are_alike_on_every_start(monkeypatch):
    _env(monkeypatch, **TORCHRUN, WORLD_SIZE="2", MASTER_PORT="41234")
    assert (launch_id(), run_name()) == ("torchrun:job7", "torchrun-job7")  # the port changes with each round
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")
    assert launch_id() is None
    for key in ("TORCHELASTIC_RUN_ID", "LOCAL_RANK", "GROUP_RANK"):
        monkeypatch.delenv(key)
    monkeypatch.setenv("MASTER_ADDR", "myjob-master-0")  # a PyTorchJob: the master's service names the job
    assert (launch_id(), run_name()) == ("job:myjob-master-0:41234", "job-myjob-master-0-port41234")


@pytest.mark.parametrize(("shared", "warned"), [("True", True), ("False", False)])
def test_each_start_logs_its_world_and_warns_when_a_joining_node_could_not_start(monkeypatch, caplog, shared, warned):
    """torchrun sharing its store with the workers (TORCHELASTIC_USE_AGENT_STORE=True) cannot take a node that joins
    later (torch 2.13): under num_nodes=auto rank 0 says so, with the variable that fixes it."""
    _env(monkeypatch, **TORCHRUN, WORLD_SIZE="4", LOCAL_WORLD_SIZE="2", MASTER_PORT="29500")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", shared)
    cfg = compose_cfg("strategy=ddp", "devices=2", "num_nodes=auto", "accelerator=cpu")
    world = check_config(cfg).world
    with caplog.at_level("INFO", logger="dpddp.run.training"):
        _log_world(world, True)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0] == "world size 4: 2 nodes x 2 processes (torchrun WORLD_SIZE=4)"
    assert any("TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in line for line in lines[1:]) == warned
