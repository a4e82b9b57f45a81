"""Issue 49's cases as kinds: a user's model (an unpicklable attribute: a lock, an open file; callbacks of its own
from ``configure_callbacks``; a hook that logs before each optimizer step), a user's subclass of a callback auto
knows, and a profiler keep ``steps_per_execution=auto`` at K=1, in its one line naming the first such object,
with nothing of the user's copied or run by the probe; a K given explicitly refuses their per-step hooks
(test_executions' one-line rows)."""

import logging
import os
import threading
from types import SimpleNamespace

import pytest
from conftest import QUIET, checkpoint, compose_cfg, max_diff, weights
from lightning.pytorch.callbacks import Callback, EarlyStopping, LearningRateMonitor
from lightning.pytorch.utilities import grad_norm

from dpddp.errors import ConfigError
from dpddp.models.linear import LinearClassifier
from dpddp.parallel.rules import world_of
from dpddp.run import auto_steps
from dpddp.run.build import build
from dpddp.run.config import Plan
from dpddp.run.training import train

BASE = [*QUIET, "accelerator=cpu", "data.num_samples=1005", "logger=none", "model.optimizer=adam", "model.lr=0.01"]
AUTO = "steps_per_execution=auto"


def _plan(cfg) -> Plan:
    """A fit's plan of ``cfg`` as ``check_config`` makes it, with no checkpoint."""
    return Plan(cfg, "fit", world_of(cfg))


class LockNet(LinearClassifier):
    """Case 58: the built-in classifier holding a lock."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self._cache_lock = threading.Lock()


class FileNet(LinearClassifier):
    """Case 58's kind: an open file, another attribute that cannot be copied."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self._sink = open(os.devnull, "w")  # noqa: SIM115


class BatchBudget(Callback):
    """Case 59: ends the fit after ``max_batches`` training batches."""

    def __init__(self, max_batches: int) -> None:
        self.max_batches, self.seen = max_batches, 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.seen += 1
        trainer.should_stop = trainer.should_stop or self.seen >= self.max_batches


class BudgetNet(LinearClassifier):
    def configure_callbacks(self):
        return [BatchBudget(10)]


class MonitoredLinear(LinearClassifier):
    """Case 59's kind: another callback a model brings, Lightning's own."""

    def configure_callbacks(self):
        return LearningRateMonitor()


class GradNormLinear(LinearClassifier):
    """Case 68: Lightning's recipe for logging gradient norms."""

    def on_before_optimizer_step(self, optimizer):
        self.log_dict(grad_norm(self, norm_type=2))


class EarlyStoppingOrLowLoss(EarlyStopping):
    """Case 60: EarlyStopping that also stops at the first training step whose loss is below ``loss_below``."""

    def __init__(self, loss_below: float = 1.0, **kw):
        super().__init__(**kw)
        self.loss_below = loss_below

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if float(outputs["loss"]) < self.loss_below:
            trainer.should_stop = True


def _line(caplog) -> str:
    (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("steps_per_execution=auto:")]
    return line


@pytest.mark.parametrize("name", ["LockNet", "FileNet", "BudgetNet", "MonitoredLinear", "GradNormLinear"])
def test_a_users_model_keeps_one_and_the_probe_touches_nothing_of_it(name, caplog, monkeypatch):
    caplog.set_level(logging.INFO, logger="dpddp.run.auto_steps")
    monkeypatch.setattr(auto_steps, "_probe", lambda *args: pytest.fail("the probe ran on a user's model"))
    cfg = compose_cfg(*BASE, AUTO, f"model._target_=test_fused_cases.{name}")
    model, data = build(cfg.model, "model", _convert_="all"), build(cfg.data, "data", _convert_="all")
    assert auto_steps.resolve_steps(_plan(cfg), model, data) == 1
    assert _line(caplog).startswith(f"steps_per_execution=auto: 1 (model._target_ ({name}) is not one of dpddp's")


def test_a_subclass_of_a_known_callback_keeps_one(caplog, monkeypatch):
    caplog.set_level(logging.INFO, logger="dpddp.run.auto_steps")
    monkeypatch.setattr(auto_steps, "_probe", lambda *args: pytest.fail("the probe ran"))
    cfg = compose_cfg(*BASE, AUTO, "+callbacks.es._target_=test_fused_cases.EarlyStoppingOrLowLoss")
    assert auto_steps.resolve_steps(_plan(cfg), build(cfg.model, "model"), build(cfg.data, "data")) == 1
    assert _line(caplog).startswith("steps_per_execution=auto: 1 (callbacks.es (EarlyStoppingOrLowLoss) is not one")


def test_a_profiler_keeps_one(caplog):
    caplog.set_level(logging.INFO, logger="dpddp.run.auto_steps")
    cfg = compose_cfg(*BASE, AUTO, "debug=profiler")
    assert auto_steps.resolve_steps(_plan(cfg), build(cfg.model, "model"), build(cfg.data, "data")) == 1
    assert _line(caplog) == (
        "steps_per_execution=auto: 1 (trainer.profiler='simple': its rows would count executions of K steps, not steps)"
    )


@pytest.mark.parametrize(
    ("extra", "step"),
    [
        (["model._target_=test_fused_cases.LockNet"], 24),  # case 58: trained, not a traceback
        (["model._target_=test_fused_cases.BudgetNet"], 10),  # case 59: the model's callback stops it at 10
        (["+callbacks.es._target_=test_fused_cases.EarlyStoppingOrLowLoss", "+callbacks.es.monitor=val/loss"], 17),
    ],
)
def test_the_cases_at_the_defaults_end_as_one_does(tmp_path, extra, step):
    args = [*BASE, "trainer.max_epochs=2", *extra]
    default = train(compose_cfg(*args, AUTO), tmp_path / "auto")
    train(compose_cfg(*args, "steps_per_execution=1"), tmp_path / "one")
    assert default["steps_per_execution"] == 1
    assert checkpoint(tmp_path / "auto")["global_step"] == checkpoint(tmp_path / "one")["global_step"] == step
    assert max_diff(*(weights(tmp_path / run / "checkpoints/last.ckpt") for run in ("auto", "one"))) == 0


def test_case_65_the_loggers_record_at_the_optimizer_step(tmp_path):
    """The defaults' model (K=32 when idle, 51 steps an epoch): ``logger=csv`` rows at steps 50, 101, 152 and the
    test's at 153, as K=1's (were 1, 3, 5 and 6), with the same values."""
    args = [*QUIET, "accelerator=cpu", "trainer.max_epochs=3", "logger=csv"]
    assert train(compose_cfg(*args, AUTO), tmp_path / "auto")["steps_per_execution"] > 1  # 32 when idle
    train(compose_cfg(*args, "steps_per_execution=1"), tmp_path / "one")
    auto, one = ((tmp_path / run / "csv/version_0/metrics.csv").read_text() for run in ("auto", "one"))
    assert auto == one
    rows = [line.split(",")[:2] for line in auto.splitlines()[1:]]
    assert rows == [["0", "50"]] * 2 + [["1", "101"]] * 2 + [["2", "152"]] * 2 + [["3", "153"]]


def test_an_object_the_rule_did_not_see_ends_the_run_in_one_line(tmp_path, monkeypatch):
    """The guard after the Trainer is built: were the rule to miss an object (here it is told to see nothing),
    auto's K above 1 is not run with it."""
    monkeypatch.setattr(auto_steps, "seen_executions", lambda *args: None)
    cfg = compose_cfg(*BASE, AUTO, "model._target_=test_fused_cases.BudgetNet")
    with pytest.raises(ConfigError, match=r"^steps_per_execution=auto took \d+, but BudgetNet would see executions"):
        train(cfg, tmp_path / "run")


def test_a_callback_an_installed_package_adds_keeps_one(monkeypatch):
    factory = [SimpleNamespace(name="their_callbacks")]
    monkeypatch.setattr(
        auto_steps, "entry_points", lambda group: factory if group == auto_steps.CALLBACKS_FACTORY else []
    )
    cfg = compose_cfg(*BASE, AUTO)
    seen = auto_steps.seen_executions(cfg, build(cfg.model, "model"), build(cfg.data, "data"))
    assert seen == "lightning.pytorch.callbacks_factory entry point their_callbacks: its callbacks could see executions"
