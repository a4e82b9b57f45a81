"""16-bit mixed precision (``trainer.precision=bf16-mixed``, ``16-mixed`` with its gradient scaler) over any number
of processes: the weights and the gradient all-reduce stay 32-bit, so promise 1 reads in 16 bits: what ddp adds
is of the order of what 16 bits cost one process: ``|w(16, ddp N) - w(16, 1)| <= 3 * max(1e-5, |w(16, 1) -
w(32, 1)|)`` on the same data and steps (each rank rounds its own share of the gradient to 16 bits before the
32-bit all-reduce, so a ddp run and one process are two roundings of the 32-bit run: measured 0.46-2.49 times the
one-process cost, docs/configuration.md). A stop and continue in 16 bits equals the straight run (1e-6), the
scaler's state included; ``metrics.json`` records the precision; a precision with 16-bit weights is refused over
replicas."""

import subprocess
import sys

import lightning.pytorch as pl
import pytest
import torch
from conftest import QUIET, ROOT, child_env, compose_cfg, global_step, leftover, max_diff, metrics, weights
from lightning.pytorch.plugins.precision import MixedPrecision
from omegaconf import OmegaConf

from dpddp.errors import ConfigError, Preempted
from dpddp.parallel.rules import world_of
from dpddp.run.config import check_precision
from dpddp.run.training import train

# 1005 samples: 805 train = 16 global batches of 48 an epoch, 48 steps in 3 epochs; 48 divides by 2 and 3.
BASE = [*QUIET, "accelerator=cpu", "data.num_samples=1005", "data.batch_size=48", "logger=none"]
BASE += ["model.optimizer=adam", "model.lr=0.01", "trainer.max_epochs=3"]
BF16 = "trainer.precision=bf16-mixed"
VARIANTS = {"plain": [], "accumulate": ["trainer.accumulate_grad_batches=2"], "executions": ["steps_per_execution=4"]}
JOBS = [("plain", 2), ("plain", 3), ("accumulate", 2), ("executions", 2), ("accumulate", 3)]


def _w(run):
    return weights(run / "checkpoints/last.ckpt")


@pytest.mark.slow
def test_16_bits_over_2_and_3_processes_add_at_most_three_times_what_16_bits_cost_one_process(tmp_path):
    """Each job of one sweep (ddp, bf16) against one bf16 process and one 32-bit process of its variant, run here
    meanwhile; ``16-mixed`` is bf16 on CPU (Lightning's choice), so one job runs it by that name."""
    rows = tmp_path / "conf" / "precision"
    rows.mkdir(parents=True)
    precision = ["trainer.precision=16-mixed" if i == 1 else BF16 for i in range(len(JOBS))]  # a job's own config
    for i, (variant, devices) in enumerate(JOBS):
        job = OmegaConf.from_dotlist([*VARIANTS[variant], f"devices={devices}", precision[i]])
        (rows / f"j{i}.yaml").write_text("# @package _global_\n" + OmegaConf.to_yaml(job))
    args = ["-m", *BASE, "strategy=ddp", f"hydra.searchpath=[file://{tmp_path}/conf]"]
    args += [f"+precision={','.join(f'j{i}' for i in range(len(JOBS)))}", f"hydra.sweep.dir={tmp_path}/sweep"]
    env, tag = child_env()
    cmd = [sys.executable, str(ROOT / "train.py"), *args]
    sweep = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for variant, extra in VARIANTS.items():
            train(compose_cfg(*BASE, *extra), tmp_path / f"f32/{variant}")
            train(compose_cfg(*BASE, *extra, BF16), tmp_path / f"bf16/{variant}")
        _, err = sweep.communicate(timeout=600)
    finally:
        sweep.kill()
    assert sweep.returncode == 0, err[-3000:]
    assert leftover(tag) == []
    for i, (variant, devices) in enumerate(JOBS):
        many, one, f32 = tmp_path / f"sweep/{i}", tmp_path / f"bf16/{variant}", tmp_path / f"f32/{variant}"
        cost = max_diff(_w(one), _w(f32))  # what 16 bits cost one process: about 1e-3 here
        added = max_diff(_w(many), _w(one))
        print(f"{variant} ddp({devices}) {precision[i]}: ddp adds {added:.2e}, 16 bits cost one process {cost:.2e}")
        assert metrics(many)["world_size"] == devices and metrics(many)["precision"] == "bf16-mixed"
        assert global_step(many) == global_step(one) == global_step(f32) == (48 if variant != "accumulate" else 24)
        assert 1e-5 < cost < 1e-2  # 16 bits did round: the bound is not vacuous
        assert added <= 3 * max(1e-5, cost), (variant, devices)


def test_a_sigterm_in_bf16_then_continued_equals_the_straight_bf16_run(tmp_path):
    args = [*BASE, BF16]
    straight = train(compose_cfg(*args), tmp_path / "straight")
    kill = ["+callbacks.kill._target_=conftest.SigtermAt", "+callbacks.kill.at=20"]
    with pytest.raises(Preempted) as stop:
        train(compose_cfg(*args, *kill), tmp_path / "run")
    assert stop.value.step == 21  # the stop's check runs after the helper: this step's end, mid-epoch 2
    resumed = train(compose_cfg(*args, f"ckpt_path={tmp_path}/run/checkpoints/last.ckpt"), tmp_path / "resumed")
    assert global_step(tmp_path / "resumed") == global_step(tmp_path / "straight") == 48
    assert max_diff(_w(tmp_path / "resumed"), _w(tmp_path / "straight")) <= 1e-6
    assert resumed["train/loss"] == pytest.approx(straight["train/loss"], abs=1e-6)
    assert straight["precision"] == metrics(tmp_path / "resumed")["precision"] == "bf16-mixed"


class Float16OnCpu(pl.Callback):
    """Test helper: the run's precision becomes Lightning's ``MixedPrecision("16-mixed")`` with a real gradient
    scaler on CPU (Lightning turns ``16-mixed`` into bf16 there); the scale starts high and grows every 4 steps,
    so it backs off and grows during the run."""

    def setup(self, trainer, pl_module, stage):
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**20, growth_interval=4)
        trainer.strategy.precision_plugin = MixedPrecision("16-mixed", "cpu", scaler)


def _scaler(run) -> dict:
    return torch.load(run / "checkpoints/last.ckpt", weights_only=True)["MixedPrecision"]


def test_the_gradient_scalers_state_travels_in_the_checkpoint_and_a_stop_continues_exactly(tmp_path):
    args = [*BASE, "+callbacks.fp16._target_=test_precision.Float16OnCpu"]
    straight = train(compose_cfg(*args), tmp_path / "straight")
    assert straight["precision"] == "16-mixed"
    train(compose_cfg(*args, "trainer.max_steps=21"), tmp_path / "first")
    first = _scaler(tmp_path / "first")
    assert first["scale"] != 2.0**20 and first["growth_interval"] == 4  # it backed off and grew: real state
    train(compose_cfg(*args, f"ckpt_path={tmp_path}/first/checkpoints/last.ckpt"), tmp_path / "continued")
    assert _scaler(tmp_path / "continued") == _scaler(tmp_path / "straight")
    assert global_step(tmp_path / "continued") == global_step(tmp_path / "straight") == 48
    assert max_diff(_w(tmp_path / "continued"), _w(tmp_path / "straight")) <= 1e-6


def test_metrics_json_records_the_precision(tmp_path):
    assert train(compose_cfg(*BASE, "trainer.max_steps=2"), tmp_path / "a")["precision"] == "32-true"
    assert metrics(tmp_path / "a")["precision"] == "32-true"


def _cfg(precision, strategy, devices):
    cfg = {"trainer": {"precision": precision}, "strategy": {"name": strategy}, "devices": devices, "num_nodes": 1}
    cfg = {**cfg, "accelerator": "cpu", "cluster": "auto"}
    return cfg, world_of(cfg)


@pytest.mark.parametrize("precision", ["bf16-true", "16-true", "transformer-engine"])
def test_16_bit_weights_over_replicas_are_refused_in_one_line(precision):
    """A config mapping (dp over GPUs needs none here): 16-bit weights sum 16-bit gradients."""
    line = f"^trainer.precision={precision} with 4 processes: the weights and the gradient all-reduce would be 16-bit"
    with pytest.raises(ConfigError, match=line):
        check_precision(*_cfg(precision, "ddp_spawn", 4))
    with pytest.raises(ConfigError, match=f"^trainer.precision={precision} with 2 GPUs under strategy=dp: the weights"):
        check_precision(*_cfg(precision, "dp", 2))
    check_precision(*_cfg(precision, "auto", 1))


REPLICAS = (("dp", 2), ("ddp", 3), ("ddp_spawn", 2), ("auto", 1))


def _accepted(precision) -> list[tuple[str, int]]:
    """The replica kinds of ``REPLICAS`` whose config ``check_precision`` lets through for ``precision``."""
    accepted = []
    for strategy, devices in REPLICAS:
        try:
            check_precision(*_cfg(precision, strategy, devices))
        except ConfigError:
            continue
        accepted.append((strategy, devices))
    return accepted


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed", "bf16", "16", "32-true", None])
def test_mixed_precision_is_offered_on_every_kind_of_replica(precision):
    assert _accepted(precision) == list(REPLICAS)


@pytest.mark.parametrize("precision", ["bf16-true", "16-true"])
def test_16_bit_weights_are_offered_on_one_replica_only(precision):
    assert _accepted(precision) == [("auto", 1)]
