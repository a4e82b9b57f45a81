"""``data.micro_batch_size=N|auto`` (``dpddp.run.executions``): each rank's share of a step runs in micro-batches
whose gradients accumulate into one optimizer step, so the weights equal the unsplit run's (1e-5) with the same
global step, SampleDropout's masks included; ``auto`` halves the split when any rank runs out of memory (a model
that raises torch's ``OutOfMemoryError`` above a sample count), every rank agreeing, and records its choice; a stop
inside a split step continues exactly; BatchNorm and what cannot keep the promises are refused in one line."""

import logging
import subprocess
import sys

import lightning.pytorch as pl
import pytest
import torch
from conftest import QUIET, ROOT, child_env, compose_cfg, leftover, metrics, run_train
from omegaconf import OmegaConf

from dpddp.errors import ConfigError, Preempted
from dpddp.run.training import train

# 1005 samples: 805 train = 16 global batches of 48 an epoch (48 steps in 3 epochs); shares of 24 on 2 processes.
BASE = [*QUIET, "accelerator=cpu", "data.num_samples=1005", "data.batch_size=48", "logger=none", "model=mlp"]
BASE += ["model.hidden=[32]", "model.optimizer=adam", "model.lr=0.01", "trainer.max_epochs=3"]
OOM = "model._target_=users_models.MemoryBoundMLP"
DROPOUT = "model.dropout=0.5"


def _state(run) -> dict[str, torch.Tensor]:
    return torch.load(run / "checkpoints/last.ckpt", map_location="cpu", weights_only=True)["state_dict"]


def _same(a, b, tol):
    ca, cb = (torch.load(r / "checkpoints/last.ckpt", weights_only=True) for r in (a, b))
    assert ca["global_step"] == cb["global_step"]
    sa, sb = ca["state_dict"], cb["state_dict"]
    diff = max((sa[k] - sb[k]).abs().max().item() for k in sa)
    assert diff <= tol, diff
    return diff


@pytest.fixture(scope="module")
def unsplit(tmp_path_factory):
    """One process, no split, without and with SampleDropout: run directories by name."""
    root = tmp_path_factory.mktemp("unsplit")
    for name, extra in (("plain", []), ("dropout", [DROPOUT])):
        train(compose_cfg(*BASE, OOM, *extra), root / name)
    return root


@pytest.mark.parametrize("extra", [[], [DROPOUT]], ids=["plain", "dropout"])
@pytest.mark.parametrize("micro", [8, 10, 48])  # 10: micro-batches of 10, 10, 10, 10 and 8
def test_micro_batches_of_n_equal_the_unsplit_run(tmp_path, unsplit, micro, extra):
    run = train(compose_cfg(*BASE, OOM, *extra, f"data.micro_batch_size={micro}"), tmp_path / "split")
    _same(tmp_path / "split", unsplit / ("dropout" if extra else "plain"), 1e-5)
    assert run["micro_batch_size"] == micro and metrics(tmp_path / "split")["micro_batch_size"] == micro
    assert run["train/loss"] == pytest.approx(metrics(unsplit / ("dropout" if extra else "plain"))["train/loss"])


@pytest.mark.parametrize("extra", [[], [DROPOUT]], ids=["plain", "dropout"])
def test_auto_splits_when_out_of_memory_keeps_the_split_and_equals_the_unsplit_run(tmp_path, unsplit, extra, caplog):
    caplog.set_level(logging.WARNING, logger="dpddp.run.executions")
    run = train(compose_cfg(*BASE, OOM, *extra, "+model.limits=[20]", "data.micro_batch_size=auto"), tmp_path / "a")
    _same(tmp_path / "a", unsplit / ("dropout" if extra else "plain"), 1e-5)
    assert run["micro_batch_size"] == 12  # 48 and 24 ran out of memory
    lines = [r.getMessage() for r in caplog.records if "micro_batch_size=auto" in r.getMessage()]
    assert len(lines) == 2 and "micro-batches of 12 (kept)" in lines[-1]  # the first step only: the split is kept
    assert run["train/loss"] == pytest.approx(metrics(unsplit / ("dropout" if extra else "plain"))["train/loss"])


def test_auto_without_memory_trouble_runs_the_whole_share(tmp_path, unsplit):
    run = train(compose_cfg(*BASE, OOM, "data.micro_batch_size=auto"), tmp_path / "a")
    assert run["micro_batch_size"] == 48
    _same(tmp_path / "a", unsplit / "plain", 1e-6)


def test_out_of_memory_at_one_sample_or_with_a_fixed_split_is_raised(tmp_path):
    with pytest.raises(torch.OutOfMemoryError, match="out of memory: 1 samples"):
        train(compose_cfg(*BASE, OOM, "+model.limits=[0]", "data.micro_batch_size=auto"), tmp_path / "a")
    with pytest.raises(torch.OutOfMemoryError, match="out of memory: 8 samples"):
        train(compose_cfg(*BASE, OOM, "+model.limits=[5]", "data.micro_batch_size=8"), tmp_path / "b")


class SigtermInBackward(pl.Callback):
    """Test helper: SIGTERM to this process before the ``at``-th backward of the run (inside a split step)."""

    def __init__(self, at: int) -> None:
        self.at, self.seen = at, 0

    def on_before_backward(self, trainer, pl_module, loss):
        self.seen += 1
        if self.seen == self.at:
            import os
            import signal

            os.kill(os.getpid(), signal.SIGTERM)


def test_a_stop_inside_a_split_step_continues_exactly(tmp_path, unsplit):
    """SIGTERM at the 2nd micro-batch of step 21 (auto, split 48 -> 12 after running out of memory); the continued
    run splits afresh and ends with the straight run's weights."""
    args = [*BASE, OOM, DROPOUT, "+model.limits=[20]", "data.micro_batch_size=auto"]
    train(compose_cfg(*args), tmp_path / "straight")
    kill = ["+callbacks.kill._target_=test_micro_batches.SigtermInBackward", f"+callbacks.kill.at={20 * 4 + 2}"]
    with pytest.raises(Preempted) as stop:
        train(compose_cfg(*args, *kill), tmp_path / "run")
    assert stop.value.step == 21  # the step it arrived in ended whole
    resumed = train(compose_cfg(*args, f"ckpt_path={tmp_path}/run/checkpoints/last.ckpt"), tmp_path / "resumed")
    _same(tmp_path / "resumed", tmp_path / "straight", 1e-6)
    assert resumed["micro_batch_size"] == 12


@pytest.mark.parametrize(("first", "then"), [(["data.micro_batch_size=8"], []), ([], ["data.micro_batch_size=8"])])
def test_a_stop_continued_with_or_without_micro_batches_keeps_its_global_step(tmp_path, unsplit, first, then):
    """Micro-batches step under manual optimization, which counts steps in another loop counter than automatic
    optimization: stopped at step 7 (trainer.max_steps) and continued in the other mode, the run ends at the
    straight run's 48 steps with its weights (it ended at 41 before)."""
    train(compose_cfg(*BASE, OOM, *first, "trainer.max_steps=7"), tmp_path / "run")
    assert torch.load(tmp_path / "run/checkpoints/last.ckpt", weights_only=True)["global_step"] == 7
    train(compose_cfg(*BASE, OOM, *then, f"ckpt_path={tmp_path}/run/checkpoints/last.ckpt"), tmp_path / "resumed")
    assert torch.load(tmp_path / "resumed/checkpoints/last.ckpt", weights_only=True)["global_step"] == 48
    _same(tmp_path / "resumed", unsplit / "plain", 1e-5)


@pytest.mark.parametrize(
    ("overrides", "line"),
    [
        (["data.micro_batch_size=0"], "data.micro_batch_size=0 is invalid: use null, auto, or a positive number"),
        (["data.micro_batch_size=big"], "data.micro_batch_size='big' is not an integer: use null, auto"),
        (
            ["data.micro_batch_size=8", "trainer.accumulate_grad_batches=2"],
            "trainer.accumulate_grad_batches=2 cannot be kept with data.micro_batch_size=8",
        ),
        (["data.micro_batch_size=8", "strategy=dp"], "strategy='dp' cannot be kept with data.micro_batch_size=8"),
        (
            ["data.micro_batch_size=8", "model._target_=users_models.BatchNormMLP"],
            "data.micro_batch_size=8 with BatchNorm (model.net.1): a micro-batch's statistics are not the share's",
        ),
    ],
)
def test_what_cannot_keep_the_promises_is_one_line(tmp_path, overrides, line):
    with pytest.raises(ConfigError) as err:
        train(compose_cfg(*BASE, *overrides), tmp_path / "run")
    assert str(err.value).startswith(line) and "\n" not in str(err.value)
    assert not (tmp_path / "run" / "checkpoints").exists()


JOBS = {  # name: overrides of a ddp(2) job; each equals the one-process unsplit run of its model
    "unsplit": [],
    "n8": ["data.micro_batch_size=8"],
    "auto": ["+model.limits=[30,10]", "data.micro_batch_size=auto"],  # rank 1 alone runs out: 24 -> 12 -> 6
    "auto_dropout": [DROPOUT, "+model.limits=[30,10]", "data.micro_batch_size=auto"],
    "n8_executions": ["data.micro_batch_size=8", "steps_per_execution=4"],
}


@pytest.mark.slow
def test_ddp_two_processes_split_equal_one_unsplit_process(tmp_path, unsplit):
    rows = tmp_path / "conf" / "micro"
    rows.mkdir(parents=True)
    for name, job in JOBS.items():
        values = OmegaConf.from_dotlist([o.lstrip("+") for o in job])
        (rows / f"{name}.yaml").write_text("# @package _global_\n" + OmegaConf.to_yaml(values))
    args = ["-m", *BASE, OOM, "strategy=ddp", "devices=2", f"hydra.searchpath=[file://{tmp_path}/conf]"]
    args += [f"+micro={','.join(JOBS)}", f"hydra.sweep.dir={tmp_path}/sweep"]
    env, tag = child_env(PYTHONPATH=str(ROOT / "tests"))
    done = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert leftover(tag) == []
    for i, (name, job) in enumerate(JOBS.items()):
        run = tmp_path / f"sweep/{i}"
        one = unsplit / ("dropout" if DROPOUT in job else "plain")
        print(name, _same(run, one, 1e-5))
        assert metrics(run)["world_size"] == 2
        expected = {"unsplit": None, "n8": 8, "n8_executions": 8}.get(name, 6)
        assert metrics(run)["micro_batch_size"] == expected, name
    log = (tmp_path / "sweep/2/train.log").read_text()
    assert "micro-batches of 12 (kept)" in log and "micro-batches of 6 (kept)" in log


class TinyTransformer(pl.LightningModule):
    """The standard Transformer recipe, small: an encoder layer (no dropout), AdamW, a linear warm-up then cosine
    decay stepped every 2 optimizer steps, a decay each epoch; each sample's 16 features a sequence of 4 tokens."""

    def __init__(self, num_features: int = 16, num_classes: int = 4) -> None:
        super().__init__()
        self.embed = torch.nn.Linear(4, 16)
        self.encoder = torch.nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True)
        self.head = torch.nn.Linear(16, num_classes)

    def training_step(self, batch, batch_idx):
        x, y = batch
        hidden = self.encoder(self.embed(x.view(len(x), -1, 4)))
        return torch.nn.functional.cross_entropy(self.head(hidden.mean(1)) * 10, y)  # gradient norms above 1

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=0.01)
        total = self.trainer.estimated_stepping_batches

        def warmup_cosine(step: int) -> float:
            return min(1.0, (step + 1) / 4) * 0.5 * (1 + torch.cos(torch.tensor(torch.pi * step / total)).item())

        schedules = [torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine), torch.optim.lr_scheduler.StepLR(opt, 1)]
        return [opt], [{"scheduler": schedules[0], "interval": "step", "frequency": 2}, schedules[1]]


TRANSFORMER = [*QUIET, "accelerator=cpu", "data.num_samples=300", "data.batch_size=48", "logger=none"]
TRANSFORMER += ["model._target_=test_micro_batches.TinyTransformer", "callbacks.metric_contract=null"]
TRANSFORMER += [f"~model.{key}" for key in ("optimizer", "lr", "momentum", "weight_decay")]
TRANSFORMER += ["trainer.precision=64-true", "trainer.max_epochs=2", "trainer.gradient_clip_val=1.0"]


def test_the_transformer_recipe_in_micro_batches_equals_the_unsplit_run_in_64_bits(tmp_path):
    """Clipping of the whole global batch's gradient before its step, and the LR schedulers stepped once per
    optimizer step (``interval: step`` every 2, ``epoch``), under micro-batches: 1e-10 of Lightning's automatic
    optimization, Adam's state too; unclipped, the run differs (the clip is at work)."""
    runs = {"unsplit": ["steps_per_execution=1"], "micro": ["data.micro_batch_size=7", "steps_per_execution=1"]}
    runs |= {"unclipped": ["steps_per_execution=1", "trainer.gradient_clip_val=0"]}
    for name, extra in runs.items():
        train(compose_cfg(*TRANSFORMER, *extra), tmp_path / name)
    ckpt = {name: torch.load(tmp_path / name / "checkpoints/last.ckpt", weights_only=True) for name in runs}
    assert ckpt["unsplit"]["global_step"] == 10 and ckpt["unsplit"]["lr_schedulers"][0]["last_epoch"] == 4  # 2 an epoch
    for name in ("micro",):
        assert ckpt[name]["global_step"] == 10 and ckpt[name]["lr_schedulers"] == ckpt["unsplit"]["lr_schedulers"]
        print(name, _same(tmp_path / "unsplit", tmp_path / name, tol=1e-10))
        a, b = (ckpt[run]["optimizer_states"][0]["state"] for run in ("unsplit", name))
        assert max((a[i]["exp_avg_sq"] - b[i]["exp_avg_sq"]).abs().max().item() for i in a) <= 1e-12
    assert _same(tmp_path / "unsplit", tmp_path / "unclipped", tol=1.0) > 1e-6


def test_the_transformer_recipe_in_micro_batches_in_32_bits_is_within_its_rounding_scale(tmp_path):
    """In 32 bits, micro-batches of 7 end within ``dpddp.check``'s bound of the unsplit run: ``BOUND`` x max
    (``TOLERANCE``, the scale), the scale being the drift of the same run summed in 2 micro-batches."""
    from dpddp.check import BOUND, TOLERANCE

    fp32 = [o for o in TRANSFORMER if not o.startswith("trainer.precision")]
    for name, extra in {
        "unsplit": [],
        "halves": ["data.micro_batch_size=24"],
        "sevens": ["data.micro_batch_size=7"],
    }.items():
        train(compose_cfg(*fp32, "steps_per_execution=1", *extra), tmp_path / name)
    scale = _same(tmp_path / "unsplit", tmp_path / "halves", tol=1.0)
    drift = _same(tmp_path / "unsplit", tmp_path / "sevens", tol=BOUND * max(TOLERANCE, scale))
    print("fp32 scale", scale, "drift", drift)


@pytest.mark.slow
def test_the_transformer_recipe_in_micro_batches_on_two_processes_equals_one_unsplit_process(tmp_path):
    train(compose_cfg(*TRANSFORMER, "steps_per_execution=1"), tmp_path / "one")
    args = [*TRANSFORMER, "strategy=ddp", "devices=2", "data.micro_batch_size=7", "hydra.run.dir=two"]
    run_train(*args, cwd=tmp_path, env={"PYTHONPATH": str(ROOT / "tests")}, timeout=300, check=True)
    assert metrics(tmp_path / "two")["world_size"] == 2
    print("ddp(2) micro", _same(tmp_path / "one", tmp_path / "two", tol=1e-10))
