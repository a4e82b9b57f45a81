"""``steps_per_execution=auto`` (``dpddp.run.auto_steps``): K is a power of two within its bounds, chosen from the
timed step of the run's model; the run equals K=1's bit for bit (one process) and within ddp's tolerance (2
processes, dpddp's launcher and torchrun); what refuses K > 1 falls back to 1 in one line; a continued fit takes
its checkpoint's K without timing; ``metrics.json`` holds K."""

import logging
import subprocess
import sys
from dataclasses import replace
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from conftest import (
    QUIET,
    ROOT,
    checkpoint,
    child_env,
    cli_here,
    compose_cfg,
    leftover,
    max_diff,
    metrics,
    run_train,
    weights,
)
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint, ModelSummary, RichModelSummary
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from lightning.pytorch.loggers.logger import DummyLogger
from test_cli import FAST
from test_executions import ScheduledModel

from dpddp.data.random_tensors import RandomTensorDataModule
from dpddp.data.tables import TableDataModule
from dpddp.errors import ConfigError
from dpddp.models.linear import LinearClassifier
from dpddp.models.mlp import MLPClassifier
from dpddp.parallel.rules import world_of
from dpddp.report.contract import MetricContract
from dpddp.run import auto_steps
from dpddp.run.auto_steps import LOOP_OVERHEAD_S, MAX_AUTO_STEPS, OVERHEAD_SHARE, resolve_steps
from dpddp.run.build import build
from dpddp.run.config import Plan
from dpddp.run.executions import StepsPerExecution
from dpddp.run.training import train

# 1005 samples: 804 train = 12 global batches of 64 an epoch, so auto's K is at most 8.
BASE = [*QUIET, "accelerator=cpu", "data.num_samples=1005", "logger=none", "model.optimizer=adam", "model.lr=0.01"]
KEYS = ("train/loss", "val/loss", "val/acc", "test/loss", "test/acc")
AUTO = "steps_per_execution=auto"


def _plan(cfg) -> Plan:
    """A fit's plan of ``cfg`` as ``check_config`` makes it, with no checkpoint."""
    return Plan(cfg, "fit", world_of(cfg))


def _lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.getMessage().startswith("steps_per_execution=auto:")]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """One process, K=1, 3 epochs (36 steps): ``(run dir, metrics)``."""
    run = tmp_path_factory.mktemp("straight")
    return run, train(compose_cfg(*BASE, "trainer.max_epochs=3", "steps_per_execution=1"), run)


@pytest.mark.parametrize(
    ("step_s", "per_epoch", "k"),
    [
        (LOOP_OVERHEAD_S / OVERHEAD_SHARE, 100, 1),  # the loop is 5% of one step already
        (1.0, 100, 1),
        (LOOP_OVERHEAD_S / OVERHEAD_SHARE / 3, 100, 4),  # needs 3: the next power of two
        (LOOP_OVERHEAD_S / OVERHEAD_SHARE / 8, 100, 8),
        (1e-6, 10**6, MAX_AUTO_STEPS),
        (LOOP_OVERHEAD_S / OVERHEAD_SHARE / 200, 10**6, 256),  # W3's 0.1 ms step: an execution of 26 ms
        (1e-6, 12, 8),  # within an epoch
        (1e-6, 1, 1),
        (float("nan"), 100, 1),
        (0.0, 100, 1),
    ],
)
def test_k_is_the_smallest_power_of_two_that_keeps_the_loop_within_its_share(step_s, per_epoch, k):
    assert auto_steps.auto_steps(step_s, per_epoch) == k


def test_auto_equals_one_bit_for_bit_and_its_k_is_in_metrics(tmp_path, straight, caplog):
    caplog.set_level(logging.INFO, logger="dpddp.run.auto_steps")
    one_dir, one = straight
    fused = train(compose_cfg(*BASE, "trainer.max_epochs=3", AUTO), tmp_path / "auto")
    (line,) = _lines(caplog)
    k = fused["steps_per_execution"]
    assert k in (2, 4, 8), line  # a step of this model is well under the 20 ms that makes K=1
    assert line.startswith(f"steps_per_execution=auto: {k} (a step ") and "needs K >= " in line, line
    assert metrics(tmp_path / "auto")["steps_per_execution"] == k and one["steps_per_execution"] == 1
    assert checkpoint(tmp_path / "auto")["dpddp"]["steps_per_execution"] == k
    assert checkpoint(tmp_path / "auto")["global_step"] == 36
    assert max_diff(weights(one_dir / "checkpoints/last.ckpt"), weights(tmp_path / "auto/checkpoints/last.ckpt")) == 0
    for key in KEYS:
        assert fused[key] == one[key], key


def test_the_probe_leaves_the_random_streams_and_the_model_as_they_were():
    cfg = compose_cfg(*BASE, AUTO)
    pl.seed_everything(0, verbose=False)
    data, model = build(cfg.data, "data", _convert_="all"), build(cfg.model, "model", _convert_="all")
    before, state = torch.get_rng_state(), {k: v.clone() for k, v in model.state_dict().items()}
    k = resolve_steps(_plan(cfg), model, data)
    assert k in (1, 2, 4, 8)
    assert torch.equal(torch.get_rng_state(), before)
    assert all(torch.equal(v, state[n]) for n, v in model.state_dict().items())
    assert model._step_losses == []  # the copy's step kept its loss


class ManualModel(ScheduledModel):
    """A user's model that steps its optimizer itself."""

    def __init__(self, num_features: int = 16, num_classes: int = 4) -> None:
        super().__init__(num_features, num_classes)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        loss = super().training_step(batch, batch_idx)
        self.manual_backward(loss)
        opt.step()

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


class WarmupClassifier(LinearClassifier):
    """The built-in classifier with Lightning's learning-rate warm-up recipe in ``optimizer_step``."""

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        for group in optimizer.param_groups:
            group["lr"] = self.hparams["lr"] * min(1.0, (self.trainer.global_step + 1) / 10)
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)


USER = ["callbacks.metric_contract=null", *(f"~model.{key}" for key in ("optimizer", "lr", "momentum", "weight_decay"))]


@pytest.mark.parametrize(
    ("override", "why"),
    [
        ("trainer.profiler=simple", "trainer.profiler='simple': its rows would count executions of K steps"),
        ("trainer.accumulate_grad_batches=2", "trainer.accumulate_grad_batches=2: an execution takes one optimizer"),
        ("trainer.limit_train_batches=5", "trainer.limit_train_batches=5: an epoch is all its global batches"),
        # any model, data module, callback or logger not exactly of dpddp's or Lightning's known classes
        ("model._target_=test_auto_executions.ManualModel", "model._target_ (ManualModel) is not one of dpddp's own"),
        ("model._target_=test_auto_executions.WarmupClassifier", "model._target_ (WarmupClassifier) is not one of"),
        ("model._target_=test_executions.ScheduledModel", "model._target_ (ScheduledModel) is not one of dpddp's"),
        ("+callbacks.kill={_target_:conftest.StopWhenFile,path:none}", "callbacks.kill (StopWhenFile) is not one of"),
        ("trainer.max_time=00:00:10:00", "trainer.max_time=00:00:10:00: Lightning's Timer would see executions"),
        (
            "+callbacks.model_checkpoint.every_n_train_steps=5",
            "callbacks.model_checkpoint.every_n_train_steps=5: its trigger would see executions",
        ),
        ("logger=tensorboard", None),
        ("trainer.gradient_clip_val=0.5", None),  # clipped after each step's gradients, as Lightning does
        (
            "+callbacks.swa={_target_:lightning.pytorch.callbacks.StochasticWeightAveraging,swa_lrs:0.01}",
            "callbacks.swa._target_=lightning.pytorch.callbacks.StochasticWeightAveraging: its learning-rate schedule",
        ),
    ],
)
def test_what_refuses_k_above_one_falls_back_to_one_in_one_line(tmp_path, caplog, override, why):
    caplog.set_level(logging.INFO, logger="dpddp.run.auto_steps")
    args = [*BASE, AUTO, "trainer.max_epochs=1", override, *(USER if override.endswith("Model") else [])]
    result = train(compose_cfg(*args), tmp_path / "run")
    (line,) = _lines(caplog)
    if why is None:  # taken: what refuses K above 1 is gone
        assert result["steps_per_execution"] > 1 and "(a step " in line, line
        return
    assert line.startswith(f"steps_per_execution=auto: 1 ({why}"), line
    assert result["steps_per_execution"] == metrics(tmp_path / "run")["steps_per_execution"] == 1


def test_a_checkpoint_step_interval_keeps_k_a_divisor_of_it(tmp_path, caplog):
    """``checkpoint.every_n_steps=4``: K is at most 4, so each background write lands on its step as with K=1."""
    caplog.set_level(logging.INFO, logger="dpddp.run.auto_steps")
    result = train(compose_cfg(*BASE, AUTO, "trainer.max_epochs=1", "checkpoint.every_n_steps=4"), tmp_path / "run")
    (line,) = _lines(caplog)
    why = "checkpoint.every_n_steps=4: a K dividing it keeps each write at its step"
    assert line == f"steps_per_execution=auto: 4 ({why})"
    assert result["steps_per_execution"] == 4


def test_data_that_is_not_global_batch_falls_back_to_one(caplog):
    caplog.set_level(logging.INFO, logger="dpddp.run.auto_steps")
    args = [*QUIET, "accelerator=cpu", "logger=none", AUTO, "data=sharded", "model.num_features=32"]
    args += ["model.num_classes=2"]
    cfg = compose_cfg(*args, "+data.module._target_=lightning.pytorch.demos.boring_classes.BoringDataModule")
    model = build(cfg.model, "model", _convert_="all")
    assert resolve_steps(_plan(cfg), model, build(cfg.data, "data", _convert_="all")) == 1
    assert _lines(caplog) == [
        "steps_per_execution=auto: 1 (data._target_=dpddp.data.sharded.ShardedDataModule: not a "
        "dpddp.data.global_batch.GlobalBatchDataModule)"
    ]


def test_a_continued_fit_takes_its_checkpoints_k_without_timing(tmp_path, straight, caplog, monkeypatch):
    train(compose_cfg(*BASE, "trainer.max_epochs=3", "trainer.max_steps=7", "steps_per_execution=5"), tmp_path / "a")
    caplog.set_level(logging.INFO, logger="dpddp.run.auto_steps")
    monkeypatch.setattr(auto_steps, "_probe", lambda *args: pytest.fail("a continued fit timed a step"))
    ckpt = f"ckpt_path={tmp_path}/a/checkpoints/last.ckpt"
    continued = train(compose_cfg(*BASE, "trainer.max_epochs=3", AUTO, ckpt), tmp_path / "b")
    assert _lines(caplog) == ["steps_per_execution=auto: 5 (the checkpoint's)"]
    assert continued["steps_per_execution"] == checkpoint(tmp_path / "b")["dpddp"]["steps_per_execution"] == 5
    assert max_diff(weights(straight[0] / "checkpoints/last.ckpt"), weights(tmp_path / "b/checkpoints/last.ckpt")) == 0


def test_a_callback_auto_does_not_know_continues_a_k_5_checkpoint_from_an_epochs_end_at_one(tmp_path, straight):
    """Issue 49's dead end: a K=5 fit stopped at an epoch's end (step 12), continued under auto with a user callback
    (auto takes 1): it continues at K=1 to the straight run's 36 steps and weights, bit for bit."""
    train(compose_cfg(*BASE, "trainer.max_epochs=3", "trainer.max_steps=12", "steps_per_execution=5"), tmp_path / "a")
    user = ["+callbacks.user._target_=conftest.SigtermAtStep", "+callbacks.user.step=1000"]  # never fires
    ckpt = f"ckpt_path={tmp_path}/a/checkpoints/last.ckpt"
    continued = train(compose_cfg(*BASE, "trainer.max_epochs=3", AUTO, *user, ckpt), tmp_path / "b")
    assert continued["steps_per_execution"] == 1 and checkpoint(tmp_path / "b")["global_step"] == 36
    assert max_diff(weights(straight[0] / "checkpoints/last.ckpt"), weights(tmp_path / "b/checkpoints/last.ckpt")) == 0


def test_a_refused_setting_continues_only_a_checkpoint_of_k_one(tmp_path):
    train(compose_cfg(*BASE, "trainer.max_steps=7", "steps_per_execution=5"), tmp_path / "a")
    ckpt = f"ckpt_path={tmp_path}/a/checkpoints/last.ckpt"
    with pytest.raises(ConfigError, match=r"stopped inside an epoch with steps_per_execution=5: continue it with"):
        train(compose_cfg(*BASE, AUTO, ckpt, "trainer.accumulate_grad_batches=2"), tmp_path / "b")


def test_ranks_started_apart_agree_on_each_resolution_in_order(monkeypatch):
    """Ranks started apart take rank 0's K of each of their resolutions through the agent store, in order: a
    second resolution in the same process (a sweep's next job) reads its own K, not the first's."""
    store = torch.distributed.HashStore()
    monkeypatch.setattr(auto_steps, "agent_store", lambda *args: store)
    monkeypatch.setenv("MASTER_ADDR", "localhost")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.delenv("RANK", raising=False)
    cfg = compose_cfg(*BASE, AUTO)
    plans = [Plan(cfg, "fit", replace(world_of(cfg), world_size=2, nodes=2, global_rank=rank)) for rank in (0, 1)]
    measured = [(2, "first"), (4, "second")]
    assert [auto_steps._agreed(plans[0], lambda k=k: k) for k in measured] == measured
    assert [auto_steps._agreed(plans[1], lambda: pytest.fail("rank 1 measured")) for _ in measured] == measured


def test_a_rank_that_opens_no_tracker_run_keeps_autos_k():
    """Under a tracker logger, a rank that opens no run has Lightning's ``DummyLogger``: it sees no execution, so
    auto's K stands on that rank as on rank 0."""
    executions = StepsPerExecution(LinearClassifier(), 2, auto=True)
    trainer = SimpleNamespace(callbacks=[], loggers=[DummyLogger()])
    executions.check_observers(trainer, RandomTensorDataModule())  # raises ConfigError for an unknown logger
    with pytest.raises(ConfigError, match="steps_per_execution=auto took 2, but CSVLoggerOfMine would see"):
        executions.check_observers(
            SimpleNamespace(callbacks=[], loggers=[CSVLoggerOfMine(".")]), RandomTensorDataModule()
        )


class CSVLoggerOfMine(CSVLogger):
    """A user's subclass of a known logger, overriding nothing."""


TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["dpddp", "torchrun"])
def test_ddp_two_processes_agree_on_k_and_equal_one_process(tmp_path, launcher):
    """Rank 0 resolves K: dpddp's launcher hands it to rank 1 in its job, torchrun's ranks through its agent
    store; the run equals one process at K=1."""
    args = [*BASE, "trainer.max_epochs=2", "trainer.max_steps=20", AUTO, "strategy=ddp", "devices=2"]
    one = train(compose_cfg(*BASE, "trainer.max_epochs=2", "trainer.max_steps=20"), tmp_path / "one")
    if launcher == "dpddp":
        done = run_train(*args, "hydra.run.dir=two", cwd=tmp_path)
    else:
        env, tag = child_env()
        cmd = [*TORCHRUN, str(ROOT / "train.py"), *args, "hydra.run.dir=two"]
        done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
        assert leftover(tag) == []
    assert done.returncode == 0, done.stderr[-3000:]
    said = [line for line in (done.stdout + done.stderr).splitlines() if "steps_per_execution=auto: " in line]
    two = metrics(tmp_path / "two")
    k = two["steps_per_execution"]
    assert len(said) == 1 and f"steps_per_execution=auto: {k} (a step " in said[0], said
    assert k in (2, 4, 8) and checkpoint(tmp_path / "two")["dpddp"]["steps_per_execution"] == k
    assert checkpoint(tmp_path / "two")["global_step"] == checkpoint(tmp_path / "one")["global_step"] == 20
    ends = [weights(tmp_path / run / "checkpoints/last.ckpt") for run in ("one", "two")]
    assert max_diff(*ends) <= 1e-5
    for key in KEYS:
        assert two[key] == pytest.approx(one[key], abs=1e-5), key


@pytest.mark.slow
def test_the_lightning_cli_takes_auto(tmp_path, monkeypatch, capsys):
    """``python -m dpddp.cli fit`` on one process, run here (its ranks are not the point)."""
    args = ["fit", *FAST, "--steps_per_execution=auto", "--data.num_samples=1005"]
    assert cli_here(*args, cwd=tmp_path, monkeypatch=monkeypatch) == 0
    out = "".join(capsys.readouterr())
    (path,) = tmp_path.glob("lightning_logs/version_*/metrics.json")
    k = metrics(path.parent)["steps_per_execution"]
    assert k in (2, 4, 8) and f"steps_per_execution=auto: {k} (a step " in out


class WiderClassifier(LinearClassifier):
    """A user's network in the built-in classifier: a subclass is the user's, whatever it overrides."""


class TransferHookData(RandomTensorDataModule):
    def on_before_batch_transfer(self, batch, dataloader_idx):
        return batch


# A user's subclass of each class auto knows (dpddp's own and Lightning's KNOWN), overriding nothing.
class MyContract(MetricContract):
    pass


class MyEarlyStopping(EarlyStopping):
    pass


class MyModelSummary(ModelSummary):
    pass


class MyRichModelSummary(RichModelSummary):
    pass


class MyModelCheckpoint(ModelCheckpoint):
    pass


class MyCSVLogger(CSVLogger):
    pass


class MyTensorBoardLogger(TensorBoardLogger):
    pass


def _callback(target: str, **kwargs) -> dict:
    return {"callbacks": {"mine": {"_target_": target, **kwargs}}}


def _logger(target: str) -> dict:
    return {"logger": {"_target_": target}}


LIGHTNING = "lightning.pytorch.callbacks."
SEEN = [
    ({}, None),
    *((_callback(LIGHTNING + name), None) for name in ("EarlyStopping", "ModelSummary", "RichModelSummary")),
    (_callback(LIGHTNING + "ModelCheckpoint"), None),
    (_callback("dpddp.report.contract.MetricContract"), None),
    *((_logger(f"lightning.pytorch.loggers.{name}"), None) for name in ("CSVLogger", "TensorBoardLogger")),
    *((_logger(f"lightning.pytorch.loggers.{name}"), None) for name in ("MLFlowLogger", "WandbLogger")),
    *(
        (_callback(f"test_auto_executions.{cls}"), f"callbacks.mine ({cls}) is not one of dpddp's callbacks")
        for cls in ("MyContract", "MyEarlyStopping", "MyModelSummary", "MyRichModelSummary", "MyModelCheckpoint")
    ),
    *(
        (_logger(f"test_auto_executions.{cls}"), f"logger ({cls}) is not one of the loggers known by exact type")
        for cls in ("MyCSVLogger", "MyTensorBoardLogger")
    ),
    *(
        (_callback(LIGHTNING + cls), f"callbacks.mine ({cls}) is not one of dpddp's callbacks")
        for cls in ("LambdaCallback", "LearningRateMonitor", "Timer")
    ),
    (
        _callback(LIGHTNING + "ModelCheckpoint", train_time_interval="0:0:10"),
        "callbacks.mine.train_time_interval=0:0:10: its trigger would see executions",
    ),
    (
        _callback(LIGHTNING + "ModelCheckpoint", every_n_train_steps=3),
        "callbacks.mine.every_n_train_steps=3: its trigger would see executions",
    ),
    ({"trainer": {"max_time": "00:00:01:00"}}, "trainer.max_time=00:00:01:00: Lightning's Timer would see"),
]


@pytest.mark.parametrize(("cfg", "seen"), SEEN)
def test_what_is_not_known_by_exact_type_is_named(cfg, seen):
    """``seen_executions``: dpddp's classes and Lightning's ``KNOWN`` ones (each shipped logger) by exact type,
    anything else named, a user's subclass of each of them too."""
    found = auto_steps.seen_executions(cfg, LinearClassifier(), RandomTensorDataModule())
    assert found == seen if seen is None else found.startswith(seen), found


@pytest.mark.parametrize(
    ("model", "data", "seen"),
    [
        (WiderClassifier, RandomTensorDataModule, "model._target_ (WiderClassifier) is not one of dpddp's own"),
        (LinearClassifier, TransferHookData, "data._target_ (TransferHookData) is not one of dpddp's own"),
        (MLPClassifier, TableDataModule, None),
    ],
)
def test_a_model_or_data_module_not_of_dpddps_classes_is_named(model, data, seen):
    kwargs = {"name": "digits"} if data is TableDataModule else {}
    found = auto_steps.seen_executions({}, model(), data(**kwargs))
    assert found == seen if seen is None else found.startswith(seen), found
