"""``steps_per_execution=K`` (``dpddp.run.executions``): K optimizer steps per Lightning loop iteration keep the
promises: the weights, metrics and ``global_step`` of K=1; ``max_steps`` exact; a stop anywhere (a limit cutting an
execution, SIGTERM) continued ends with a straight run's weights; ddp equals one process; what cannot keep them is
refused in one line. The speed is the bench's (bench/RESULTS.md), not a test's."""

import random
import re

import lightning.pytorch as pl
import pytest
import torch
from conftest import QUIET, SigtermAt, compose_cfg, max_diff, metrics, run_train, weights
from torch import nn

from dpddp.data.global_batch import GlobalBatchSampler
from dpddp.data.random_tensors import RandomTensorDataModule
from dpddp.errors import ConfigError, Preempted
from dpddp.models.linear import LinearClassifier
from dpddp.run import executions
from dpddp.run.training import train

# 1005 samples: 804 train = 12 global batches of 64 an epoch; K=5 makes executions of 5, 5 and 2 steps.
BASE = [*QUIET, "accelerator=cpu", "data.num_samples=1005", "logger=none", "model.optimizer=adam", "model.lr=0.01"]
KEYS = ("train/loss", "val/loss", "val/acc", "test/loss", "test/acc")


def _ckpt(run):
    return torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)


def _same_run(a, b, tol=1e-6):
    """Two run directories ended at the same global step with the same weights (``tol``)."""
    assert _ckpt(a)["global_step"] == _ckpt(b)["global_step"]
    assert max_diff(weights(a / "checkpoints/last.ckpt"), weights(b / "checkpoints/last.ckpt")) <= tol


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """One process, k=1, 3 epochs (36 steps): ``(run dir, metrics)``; every k ends here bit for bit
    (``test_k_steps_per_execution_equal_one``), so the continued runs below are compared with it."""
    run = tmp_path_factory.mktemp("straight")
    return run, train(compose_cfg(*BASE, "trainer.max_epochs=3"), run)


def test_the_sampler_yields_aligned_executions_and_the_rest_of_a_cut_one_first():
    sampler = GlobalBatchSampler(804, 64, rank=1, world_size=2, train=True, steps_per_execution=5)
    plain = GlobalBatchSampler(804, 64, rank=1, world_size=2, train=True)
    assert len(sampler) == 3 and len(plain) == 12
    executions = list(sampler)
    assert [e.shape for e in executions] == [(5, 32), (5, 32), (2, 32)]
    assert torch.equal(torch.cat(executions), torch.stack(list(plain)))  # the same chunks, in the same order
    sampler.position = lambda: (0, 7)  # 7 global batches trained: the rest of the second execution first
    assert [e.shape[0] for e in sampler] == [3, 2]


@pytest.mark.parametrize("k", [5, 16])  # 16: one execution is more than an epoch (12 steps)
def test_k_steps_per_execution_equal_one(tmp_path, straight, k):
    one_dir, one = straight
    fused = train(compose_cfg(*BASE, "trainer.max_epochs=3", f"steps_per_execution={k}"), tmp_path / "fused")
    _same_run(one_dir, tmp_path / "fused", tol=0.0)
    assert _ckpt(tmp_path / "fused")["global_step"] == 36
    for key in KEYS:
        assert fused[key] == one[key], key
    assert fused["samples_per_sec"] > 0


class CountSteps(pl.Callback):
    """Overrides a per-step hook, so every step goes through Lightning's full wrappers (not the lean path)."""

    calls = 0

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        CountSteps.calls += 1


@pytest.fixture
def instruments(monkeypatch):
    """The tests' own callbacks with batch or step hooks, known as dpddp's are (a user's are refused with K)."""
    monkeypatch.setattr(executions, "KNOWN", (*executions.KNOWN, CountSteps, SigtermAt, BatchKinds))


def test_the_full_wrapped_path_equals_one_and_calls_the_step_hooks(tmp_path, straight, instruments):
    args = [*BASE, "trainer.max_epochs=3", "+callbacks.count._target_=test_executions.CountSteps"]
    CountSteps.calls = 0
    train(compose_cfg(*args, "steps_per_execution=5"), tmp_path / "fused")
    assert CountSteps.calls == 36  # once per optimizer step, as with automatic optimization
    _same_run(straight[0], tmp_path / "fused", tol=0.0)


def test_max_steps_is_exact_and_a_cut_execution_continues_exactly(tmp_path, straight):
    """A limit that cuts an execution (13 = 5 + 5 + 2 + 1) stops at it; continued to 3 epochs, the run ends with
    a straight run's weights, global step and train loss."""
    args = [*BASE, "trainer.max_epochs=3", "steps_per_execution=5"]
    train(compose_cfg(*args, "trainer.max_steps=13"), tmp_path / "first")
    train(compose_cfg(*BASE, "trainer.max_epochs=3", "trainer.max_steps=13"), tmp_path / "first_k1")
    assert _ckpt(tmp_path / "first")["global_step"] == 13
    _same_run(tmp_path / "first", tmp_path / "first_k1", tol=0.0)
    ckpt = tmp_path / "first" / "checkpoints" / "last.ckpt"
    continued = train(compose_cfg(*args, f"ckpt_path={ckpt}"), tmp_path / "continued")
    _same_run(tmp_path / "continued", straight[0])
    assert continued["train/loss"] == pytest.approx(straight[1]["train/loss"], abs=1e-6)


@pytest.mark.parametrize("seed", [3])
def test_a_stop_at_a_random_step_then_continued_twice_equals_a_straight_run(tmp_path, straight, seed):
    """Two stops at seeded random steps (cuts anywhere, then a resume that starts inside an execution)."""
    args = [*BASE, "trainer.max_epochs=3", "steps_per_execution=4"]
    first, second = sorted(random.Random(seed).sample(range(1, 36), 2))
    train(compose_cfg(*args, f"trainer.max_steps={first}"), tmp_path / "a")
    train(
        compose_cfg(*args, f"trainer.max_steps={second}", f"ckpt_path={tmp_path}/a/checkpoints/last.ckpt"),
        tmp_path / "b",
    )
    assert _ckpt(tmp_path / "b")["global_step"] == second
    train(compose_cfg(*args, f"ckpt_path={tmp_path}/b/checkpoints/last.ckpt"), tmp_path / "c")
    _same_run(tmp_path / "c", straight[0])


def test_a_max_steps_stop_inside_an_epochs_last_execution_continues_exactly(tmp_path):
    """Dropout from the global stream: epochs of 12 steps run as executions of 8 and 4, and ``max_steps=10`` cuts the
    last one. K=1 stops there with no validation (whose loaders draw from the global stream), so must K=8."""
    args = [*BASE, "model=mlp", "model._target_=users_models.GlobalDropoutMLP", "trainer.max_epochs=2"]
    args += ["steps_per_execution=8"]
    train(compose_cfg(*args), tmp_path / "straight")
    train(compose_cfg(*args, "trainer.max_steps=10"), tmp_path / "a")
    train(compose_cfg(*args, f"ckpt_path={tmp_path}/a/checkpoints/last.ckpt"), tmp_path / "b")
    _same_run(tmp_path / "b", tmp_path / "straight", tol=0.0)


def test_sigterm_stops_on_a_step_boundary_and_resumes_exactly(tmp_path, straight, instruments):
    args = [*BASE, "trainer.max_epochs=3", "steps_per_execution=5"]
    # SIGTERM at the end of the 4th execution (step 17), before the stop's check, the last callback: it stops there
    kill = ["+callbacks.kill._target_=conftest.SigtermAt", "+callbacks.kill.at=3"]
    with pytest.raises(Preempted) as stop:
        train(compose_cfg(*args, *kill), tmp_path / "run")
    assert stop.value.step == 17  # epochs of 5 + 5 + 2 steps: 12 + 5, inside the second epoch
    resumed = train(compose_cfg(*args, f"ckpt_path={tmp_path}/run/checkpoints/last.ckpt"), tmp_path / "resumed")
    _same_run(tmp_path / "resumed", straight[0])
    assert resumed["train/loss"] == pytest.approx(straight[1]["train/loss"], abs=1e-6)


def test_another_k_continues_from_an_epochs_end_and_the_refusal_inside_one_leads_there(tmp_path, straight):
    """K=5 stopped inside epoch 1 (step 13) cannot continue with K=1 (the loop counted executions there): one line
    says to finish the epoch with K=5 (trainer.max_epochs=2); done so, K=1 continues from step 24, and from the
    epoch's end at step 12 too, to the straight run's 36 steps and weights (bit for bit)."""
    args = [*BASE, "trainer.max_epochs=3"]
    train(compose_cfg(*args, "trainer.max_steps=13", "steps_per_execution=5"), tmp_path / "run")
    ckpt = tmp_path / "run" / "checkpoints" / "last.ckpt"
    line = (
        "stopped inside an epoch with steps_per_execution=5: continue it with steps_per_execution=5 (and the "
        "callbacks it ran with) to the epoch's end (trainer.max_epochs=2), then with steps_per_execution=1"
    )
    with pytest.raises(ConfigError, match=re.escape(line)):
        train(compose_cfg(*args, f"ckpt_path={ckpt}", "steps_per_execution=1"), tmp_path / "again")
    test_only = train(compose_cfg(*BASE, f"ckpt_path={ckpt}"), tmp_path / "test", stage="test")  # any k evaluates
    assert 0 < test_only["test/acc"] <= 1
    k5 = ["steps_per_execution=5", "trainer.max_epochs=2"]
    train(compose_cfg(*BASE, *k5, f"ckpt_path={ckpt}"), tmp_path / "end")  # the advice, applied
    assert _ckpt(tmp_path / "end")["global_step"] == 24
    train(compose_cfg(*args, f"ckpt_path={tmp_path}/end/checkpoints/last.ckpt"), tmp_path / "k1")
    _same_run(tmp_path / "k1", straight[0], tol=0.0)
    train(compose_cfg(*args, "trainer.max_steps=12", "steps_per_execution=5"), tmp_path / "at12")
    train(compose_cfg(*args, f"ckpt_path={tmp_path}/at12/checkpoints/last.ckpt"), tmp_path / "k1_12")
    _same_run(tmp_path / "k1_12", straight[0], tol=0.0)


ONE = "use steps_per_execution=1"


@pytest.mark.parametrize(
    ("override", "line", "fix"),
    [
        ("steps_per_execution=0", "steps_per_execution=0 is invalid: use a positive number", "e.g. 16, or auto"),
        (
            "trainer.accumulate_grad_batches=2",
            "trainer.accumulate_grad_batches=2 cannot be kept with steps_per_execution=4",
            ONE,
        ),
        ("trainer.profiler=simple", "trainer.profiler='simple' cannot be kept with steps_per_execution=4", ONE),
        # a user's hook that sees each step (its logs would be lost): on any object not known by exact type
        (
            "model._target_=test_fused_cases.GradNormLinear",
            "steps_per_execution=4: GradNormLinear.on_before_optimizer_step would see executions of 4 steps",
            ONE,
        ),
        (
            "model._target_=test_fused_cases.MonitoredLinear logger=csv",  # its monitor needs a logger
            "steps_per_execution=4: LearningRateMonitor.on_train_batch_start would see executions of 4 steps",
            ONE,
        ),
        (
            "+callbacks.es={_target_:test_fused_cases.EarlyStoppingOrLowLoss,monitor:val/loss}",
            "steps_per_execution=4: EarlyStoppingOrLowLoss.on_train_batch_end would see executions of 4 steps",
            ONE,
        ),
        (
            "+trainer.val_check_interval=3",
            "trainer.val_check_interval=3 cannot be kept with steps_per_execution=4",
            ONE,
        ),
        (
            "trainer.limit_train_batches=5",
            "trainer.limit_train_batches=5 cannot be kept with steps_per_execution=4",
            ONE,
        ),
        ("strategy=dp", "strategy='dp' cannot be kept with steps_per_execution=4", ONE),
        ("data=sharded", "steps_per_execution=4 with data._target_=dpddp.data.sharded.ShardedDataModule", ONE),
        (
            "model._target_=test_auto_executions.WarmupClassifier",
            "steps_per_execution=4 skips WarmupClassifier.optimizer_step, which automatic optimization calls each step",
            ONE,
        ),
        (
            "+callbacks.swa={_target_:lightning.pytorch.callbacks.StochasticWeightAveraging,swa_lrs:0.01}",
            "steps_per_execution=4 with callbacks.swa._target_=lightning.pytorch.callbacks.StochasticWeightAveraging: "
            "its learning-rate schedule steps only under automatic optimization",
            ONE,
        ),
    ],
)
def test_what_cannot_keep_the_promises_is_one_line(tmp_path, override, line, fix):
    args = [*BASE, "steps_per_execution=4", *override.split(" ")]
    if override == "data=sharded":  # a user's own loaders, sharded by dpddp
        args = [a for a in args if not a.startswith("data.")]
        args += ["+data.module._target_=lightning.pytorch.demos.boring_classes.BoringDataModule"]
        args += ["model.num_features=32", "model.num_classes=2"]  # sizes of its own: nothing to follow
    with pytest.raises(ConfigError) as err:
        train(compose_cfg(*args), tmp_path / "run")
    assert str(err.value).startswith(line) and "\n" not in str(err.value)
    assert str(err.value).endswith(fix), str(err.value)


class ScheduledModel(pl.LightningModule):
    """A user's model with an LR scheduler: manual optimization would not step it."""

    def __init__(self, num_features: int = 16, num_classes: int = 4) -> None:
        super().__init__()
        self.layer = nn.Linear(num_features, num_classes)

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.cross_entropy(self.layer(x), y)

    def configure_optimizers(self):
        opt = torch.optim.SGD(self.parameters(), lr=0.1)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1)}


class DictLossModel(ScheduledModel):
    """A user's model that returns ``{"loss": ...}`` and has no scheduler: it opts in by the setting alone."""

    def training_step(self, batch, batch_idx):
        return {"loss": super().training_step(batch, batch_idx)}

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


def test_a_users_model_runs_fused_and_one_with_a_scheduler_is_refused(tmp_path):
    user = [
        *BASE,
        "trainer.max_epochs=1",
        "callbacks.metric_contract=null",
        "model._target_=test_executions.DictLossModel",
    ]
    user += [f"~model.{key}" for key in ("optimizer", "lr", "momentum", "weight_decay")]
    train(compose_cfg(*user), tmp_path / "one")
    train(compose_cfg(*user, "steps_per_execution=5"), tmp_path / "fused")
    a, b = (torch.load(p / "checkpoints/last.ckpt", weights_only=True) for p in (tmp_path / "one", tmp_path / "fused"))
    assert a["global_step"] == b["global_step"] == 12
    assert all(torch.equal(a["state_dict"][n], b["state_dict"][n]) for n in a["state_dict"])
    written = metrics(tmp_path / "fused")  # no validation_step or test_step: null, with the reason
    assert written["test/acc"] is None and written["missing"]["test/acc"] == "no test ran"
    assert written["val/loss"] is None and written["train/loss"] is None
    scheduled = [u.replace("DictLossModel", "ScheduledModel") for u in user]
    with pytest.raises(ConfigError, match=r"ScheduledModel has an LR scheduler, and trainer.estimated_stepping_batch"):
        train(compose_cfg(*scheduled, "steps_per_execution=5"), tmp_path / "scheduled")


@pytest.mark.slow
def test_ddp_two_processes_with_k_equal_one_process(tmp_path):
    args = [*BASE, "trainer.max_epochs=2", "steps_per_execution=5", "trainer.max_steps=20"]
    one = train(compose_cfg(*args), tmp_path / "one")
    done = run_train(*args, "strategy=ddp", "devices=2", "hydra.run.dir=two", cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    _same_run(tmp_path / "two", tmp_path / "one", tol=1e-5)
    two = metrics(tmp_path / "two")
    assert two["world_size"] == 2
    for key in KEYS:
        assert two[key] == pytest.approx(one[key], abs=1e-5), key


@pytest.mark.parametrize("k", [1, 5])
def test_the_train_loss_of_an_epoch_a_limit_cut_is_whole_when_continued(tmp_path, straight, k):
    """A reported metric whose state must be in the checkpoint: a run stopped by max_steps inside its last epoch (35 of
    36 steps; with k=5 inside that epoch's last execution), continued, reports the straight run's train/loss for that
    epoch, not the rest's."""
    args = [*BASE, "trainer.max_epochs=3", f"steps_per_execution={k}"]
    train(compose_cfg(*args, "trainer.max_steps=35"), tmp_path / "first")
    continued = train(compose_cfg(*args, f"ckpt_path={tmp_path}/first/checkpoints/last.ckpt"), tmp_path / "continued")
    _same_run(tmp_path / "continued", straight[0])
    assert continued["train/loss"] == pytest.approx(straight[1]["train/loss"], abs=1e-6)


class BatchKinds(pl.Callback):
    """Records what each training batch's inputs are: ``DeferredRows`` or a gathered tensor."""

    kinds: list = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        BatchKinds.kinds.append(type(batch[0]).__name__)


# 4 executions of 4 steps of 128 x 1024 features (2 MiB of rows each): above DEFER_BYTES, gathered step by step.
WIDE = [*QUIET, "accelerator=cpu", "logger=none", "data.num_samples=2560", "data.num_features=1024"]
WIDE += ["data.batch_size=128", "trainer.max_epochs=1", "+callbacks.kinds._target_=test_executions.BatchKinds"]


def test_wide_rows_are_gathered_step_by_step_and_equal_one_step_per_iteration(tmp_path, instruments):
    BatchKinds.kinds = []
    one = train(compose_cfg(*WIDE, "steps_per_execution=1"), tmp_path / "one")
    assert BatchKinds.kinds == ["Tensor"] * 16
    BatchKinds.kinds = []
    fused = train(compose_cfg(*WIDE, "steps_per_execution=4"), tmp_path / "fused")
    assert BatchKinds.kinds == ["DeferredRows"] * 4
    _same_run(tmp_path / "one", tmp_path / "fused", tol=0.0)
    assert [fused[key] for key in KEYS] == [one[key] for key in KEYS]


def test_wide_rows_are_gathered_whole_where_a_worker_or_a_batch_hook_would_see_them(tmp_path, instruments):
    BatchKinds.kinds = []
    workers = ["data._target_=test_executions.OneWorkerTensors", "steps_per_execution=4"]
    train(compose_cfg(*WIDE, *workers), tmp_path / "workers")
    assert BatchKinds.kinds == ["Tensor"] * 4
    BatchKinds.kinds = []
    hooked = ["model._target_=test_executions.TransferHookLinear", "steps_per_execution=4"]
    train(compose_cfg(*WIDE, *hooked), tmp_path / "hooked")
    assert BatchKinds.kinds == ["Tensor"] * 4


class OneWorkerTensors(RandomTensorDataModule):
    """The built-in random tensors, fetched by one DataLoader worker."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.num_workers = 1


class TransferHookLinear(LinearClassifier):
    """The built-in linear model with an ``on_after_batch_transfer`` of its own (the identity)."""

    def on_after_batch_transfer(self, batch, dataloader_idx):
        return batch


def test_deferred_rows_gather_one_step_on_its_device_and_count_the_steps():
    from lightning.pytorch.utilities.data import extract_batch_size

    from dpddp.data.batches import DEFER_BYTES, DeferredRows, rows_of

    x, ids = torch.randn(50, 3), torch.randint(0, 50, (4, 6))
    assert isinstance(rows_of(x, ids, defer=True), torch.Tensor)  # 288 bytes: under DEFER_BYTES
    wide = torch.randn(50, DEFER_BYTES // (4 * 24) + 1)
    rows = rows_of(wide, ids, defer=True)
    assert isinstance(rows, DeferredRows) and isinstance(rows_of(wide, ids, defer=False), torch.Tensor)
    moved = rows.to("cpu")
    assert moved.device == torch.device("cpu") and torch.equal(moved[2], wide[ids[2]])
    assert extract_batch_size((rows, ids)) == 4
