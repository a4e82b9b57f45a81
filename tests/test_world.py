"""The run's facts that every room reads from one function: the process that writes the outputs, and a launched
rank's global rank (its log file's name)."""

import pytest
import torch

from dpddp.cluster import LAUNCHED_ENV, writes_outputs
from dpddp.parallel.rank import global_rank


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
    for (node, local, devices), rank in {(1, 2, -1): 6, (2, 1, 3): 7, (None, 1, 2): 1}.items():  # 6: not 1 * -1 + 2
        monkeypatch.delenv("NODE_RANK", raising=False)  # one node: no NODE_RANK
        if node is not None:
            monkeypatch.setenv("NODE_RANK", str(node))
        monkeypatch.setenv("LOCAL_RANK", str(local))
        assert global_rank({"devices": devices}) == rank
