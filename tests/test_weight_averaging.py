"""Weight-averaging callbacks (Lightning's StochasticWeightAveraging, EMAWeightAveraging): the averaged model is the
final one (last.ckpt, val/* and test/* belong to it), and a stop inside the averaging window (a limit, a SIGTERM)
continues to the straight run's average."""

import pytest
import torch
from conftest import QUIET, compose_cfg, max_diff, metrics, weights

from dpddp.errors import Preempted
from dpddp.run.training import train

BASE = [*QUIET, "accelerator=cpu", "data.num_samples=1005", "logger=none", "model.optimizer=adam", "model.lr=0.01"]
SWA = (
    "+callbacks.swa._target_=lightning.pytorch.callbacks.StochasticWeightAveraging",
    "+callbacks.swa.swa_lrs=0.05",  # not the optimizer's 0.01: SWALR's annealing moves the learning rate
    "+callbacks.swa.swa_epoch_start=2",
)
EMA = (
    "+callbacks.ema._target_=lightning.pytorch.callbacks.weight_averaging.EMAWeightAveraging",
    "+callbacks.ema.decay=0.9",
)


def _last(run):
    return run / "checkpoints" / "last.ckpt"


@pytest.mark.parametrize("averaging", [SWA, EMA], ids=["swa", "ema"])
def test_the_averaged_model_is_the_final_one(tmp_path, averaging):
    args = [*BASE, "trainer.max_epochs=4", *averaging]
    result = train(compose_cfg(*args), tmp_path / "straight")
    ckpt = f"ckpt_path={_last(tmp_path / 'straight')}"
    tested = train(compose_cfg(*args, ckpt), tmp_path / "test", stage="test")
    validated = train(compose_cfg(*args, ckpt), tmp_path / "validate", stage="validate")
    assert abs(result["test/loss"] - tested["test/loss"]) <= 1e-6
    assert abs(result["val/loss"] - validated["val/loss"]) <= 1e-6
    assert metrics(tmp_path / "straight")["test/loss"] == result["test/loss"]


@pytest.mark.parametrize("stop_kind", ["max_steps", "sigterm"])
@pytest.mark.parametrize("averaging", [SWA, EMA], ids=["swa", "ema"])
def test_a_stop_inside_the_averaging_window_continues_to_the_straight_average(tmp_path, averaging, stop_kind):
    """Inside an epoch: SWA's annealing schedule, set up at the epoch's start (which Lightning skips on a continue
    inside it), and EMA's update of the stop's own step (the stop's checkpoint comes after it) are the straight
    run's: the weights and, beside them, SWA's average or the raw weights under EMA's."""
    args = [*BASE, "trainer.max_epochs=5", *averaging]  # SWA's window: epochs 2 to 4, averaged at their starts
    train(compose_cfg(*args), tmp_path / "straight")
    steps = torch.load(_last(tmp_path / "straight"), weights_only=True)["global_step"]
    stop = steps // 2  # in epoch 2, whose end's annealing step sets epoch 3's learning rate
    if stop_kind == "max_steps":
        train(compose_cfg(*args, f"trainer.max_steps={stop}"), tmp_path / "first")
    else:
        kill = ["+callbacks.kill._target_=conftest.SigtermAt", f"+callbacks.kill.at={stop - 1}"]
        with pytest.raises(Preempted) as stopped:
            train(compose_cfg(*args, *kill), tmp_path / "first")
        assert stopped.value.step == stop
    train(compose_cfg(*args, f"ckpt_path={_last(tmp_path / 'first')}"), tmp_path / "continued")
    a, b = weights(_last(tmp_path / "continued")), weights(_last(tmp_path / "straight"))
    assert max_diff(a, b) <= 1e-6
    assert max_diff(*(_other_weights(_last(tmp_path / run)) for run in ("continued", "straight"))) <= 1e-6


def _other_weights(ckpt) -> dict[str, torch.Tensor]:
    """The weights a checkpoint holds beside its ``state_dict``: SWA's average (in its callback state), or the raw
    weights under EMA's average (Lightning's ``current_model_state``), as float64."""
    checkpoint = torch.load(ckpt, weights_only=False)
    (swa,) = [s for k, s in checkpoint["callbacks"].items() if "StochasticWeightAveraging" in k] or [None]
    state = swa["average_model_state"] if swa is not None else checkpoint["current_model_state"]
    return {k: v.double() for k, v in state.items() if v.is_floating_point()}


def test_a_run_swa_ended_continued_to_a_later_max_epochs_is_refused_in_one_line(tmp_path):
    """SWA swaps its average (epochs 1 to 3) into the weights as the fit ends at 4 epochs, and also at a
    ``max_steps`` stop inside the window's last epoch: continued to more epochs neither can equal a straight run
    (the window follows max_epochs), so the check refuses both before anything starts. The ended run to its own
    limit passes; a stop in an earlier epoch of the window (raw weights) continues, in the test above."""
    from dpddp.errors import ConfigError
    from dpddp.run.config import check_config

    args, four = [*BASE, *SWA], "trainer.max_epochs=4"
    for name, stop, done, averaged in (("ended", [], 4, 3), ("last", ["trainer.max_steps=40"], 3, 3)):
        train(compose_cfg(*args, four, *stop), tmp_path / name)
        with pytest.raises(ConfigError) as err:
            check_config(compose_cfg(*args, "trainer.max_epochs=6", f"ckpt_path={_last(tmp_path / name)}"))
        line = str(err.value)
        assert "\n" not in line and f"swapped in as its fit ended ({done} epochs done, {averaged} averaged)" in line
        assert line.endswith("start a new run with trainer.max_epochs=6"), line
    check_config(compose_cfg(*args, four, f"ckpt_path={_last(tmp_path / 'ended')}"))
