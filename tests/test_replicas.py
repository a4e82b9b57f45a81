"""The replica-consistency guard (``check_replicas``): a rank whose weights drift from the others' ends the run on
every rank, in one line naming the rank, the step and the tensor, and no checkpoint of it is written."""

from __future__ import annotations

import pytest
import torch
from conftest import ROOT, compose_cfg, global_step, leftover, run_train

from dpddp.continuity.replicas import checksums, divergent
from dpddp.errors import ConfigError
from dpddp.run.config import check_config

LINE = (
    "rank 1's replica differs from the others' at step 6, first in linear.weight: a fault on that rank's device, a "
    "non-deterministic kernel, or code that changes one rank's weights; no checkpoint is written from it "
    "(last.ckpt holds the last agreed weights)"
)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("checks", "saved", "devices"),
    [
        (["check_replicas=100", "checkpoint.every_n_steps=2"], 4, 2),
        (["check_replicas=3", "checkpoint.every_n_steps=4"], 4, 2),
        (["check_replicas=100", "checkpoint.every_n_steps=2", "data.batch_size=48"], 4, 3),
    ],
    ids=["before-a-checkpoint", "every-3-steps", "three-processes"],
)
def test_a_rank_whose_weights_drift_ends_the_run_in_one_line_before_its_checkpoint(tmp_path, checks, saved, devices):
    """Rank 1 changes a weight after step 5 (12 or 16 steps an epoch); the check at step 6 finds it: before that
    step's checkpoint (``last.ckpt`` every 2 steps), or as every third step's. Every rank exits 1 with the line, and
    ``last.ckpt`` is step 4's: the agreed weights (on 3 processes, the majority's)."""
    args = ["accelerator=cpu", "strategy=ddp", f"devices={devices}", "data.num_samples=1005", "trainer.max_epochs=1"]
    args += ["model._target_=users_models.RankOneDrifts", "+model.at_step=5", *checks]
    failed = run_train(
        *args, f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path, env={"PYTHONPATH": str(ROOT / "tests")}
    )
    said = (failed.stdout + failed.stderr).splitlines()
    lines = [line[line.index("error: ") :] for line in said if "error: " in line]
    assert failed.returncode == 1 and "Traceback" not in failed.stderr, failed.stderr[-3000:]
    assert lines == [f"error: {LINE}"] * devices, lines  # each launched rank's own (its log line), then the run's
    assert leftover(failed.tag) == []
    assert global_step(tmp_path / "run") == saved


def test_the_first_tensor_that_differs_names_the_rank_apart_from_the_majority():
    assert divergent([[1, 2, 3], [1, 2, 3]]) is None
    assert divergent([[1, 2, 3], [1, 5, 4]]) == (1, 1)  # two ranks: rank 0's value is taken as right
    assert divergent([[1, 2, 3], [1, 2, 3], [1, 2, 9]]) == (2, 2)
    assert divergent([[7, 2], [1, 2], [1, 2]]) == (0, 0)  # rank 0 is the one apart


def test_the_checksums_cover_parameters_and_optimizer_state_and_see_one_changed_element():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.randn(5, 4)).sum().backward()
    optimizer.step()
    names, sums = checksums(model, [optimizer])
    assert names[:2] == ["weight", "bias"]
    assert "optimizer 0 exp_avg of weight" in names and "optimizer 0 exp_avg_sq of bias" in names
    with torch.no_grad():
        model.weight[2, 1] = torch.nextafter(model.weight[2, 1], torch.tensor(1.0))  # one bit
    changed = checksums(model, [optimizer])[1]
    assert (changed != sums).tolist() == [name == "weight" for name in names]


@pytest.mark.parametrize("value", [0, -3, "often"])
def test_a_bad_check_replicas_is_one_config_line(value):
    with pytest.raises(ConfigError) as err:
        check_config(compose_cfg(f"check_replicas={value}"))
    assert str(err.value).startswith(f"check_replicas={value!r} is ") and "null (off)" in str(err.value)
