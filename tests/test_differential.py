"""The differential walk (issue 49): each row runs twice in one process, at the defaults (``steps_per_execution=
auto``) and at ``steps_per_execution=1``, and everything a user or a tool observes must be equal: each checkpoint's
global step, the final weights, optimizer and scheduler states, every logger's files (``metrics.csv``, TensorBoard's
``(tag, step, value)``), dpddp's ``metrics.csv`` and ``metrics.json`` less timings and K, and the epoch lines less
their timings; or both refuse in the same one line. The rows: each supported single-process row of
``tests/surface.py`` with overrides, and each kind of issue 49's cases. A rule that lets a subclass through fails
the walk (``test_a_rule_that_allows_a_subclass_fails_the_walk``)."""

import csv
import json
import logging
import re
from pathlib import Path

import pytest
import torch
from conftest import QUIET, compose_cfg
from lightning.pytorch.callbacks import EarlyStopping
from surface import SURFACE

from dpddp.errors import ConfigError
from dpddp.run import auto_steps, executions
from dpddp.run.training import train

BASE = [*QUIET, "accelerator=cpu", "model.optimizer=adam", "model.lr=0.01", "trainer.max_epochs=2", "logger=csv"]
SIZE = "data.num_samples=600"  # 480 training samples: 7 steps an epoch, K=4
TIMINGS = ("samples_per_sec", "peak_mem", "first_step_unix_s", "train_time_s", "wall_time_s", "epoch_s")
UNSEEN = (*TIMINGS, "steps_per_execution", "allreduce", "per_rank", "slowest")
"""What may differ: timings, memory, and K itself."""

CASES = {  # issue 49's kinds (tests/test_fused_cases.py's classes) and what auto takes K above 1 for
    "case 58 (a lock)": ["model._target_=test_fused_cases.LockNet"],
    "case 59 (configure_callbacks)": ["model._target_=test_fused_cases.BudgetNet"],
    "case 59 (a model's LearningRateMonitor)": ["model._target_=test_fused_cases.MonitoredLinear"],
    "case 60 (a subclass of EarlyStopping)": [
        "+callbacks.es._target_=test_fused_cases.EarlyStoppingOrLowLoss",
        "+callbacks.es.monitor=val/loss",
    ],
    "case 64 (debug=profiler)": ["debug=profiler"],
    "case 65 (logger=csv_tensorboard)": ["logger=csv_tensorboard"],
    "case 68 (grad norms from on_before_optimizer_step)": ["model._target_=test_fused_cases.GradNormLinear"],
    "a scheduler (a user's model)": ["model=mlp", "model._target_=users_models.StepLRMLP"],
    "RichModelSummary": ["+callbacks.summary._target_=lightning.pytorch.callbacks.RichModelSummary"],
    "checkpoint.every_n_steps=4": ["checkpoint.every_n_steps=4"],
    "micro-batches": ["data.micro_batch_size=16"],
    "data=digits, model=mlp": ["data=digits", "model=mlp"],
    "bf16-mixed": ["trainer.precision=bf16-mixed"],
}
SURFACE_ROWS = {
    s.name: list(s.overrides)
    for s in SURFACE
    if s.kind in ("trainer flag", "model") and not s.refused and s.overrides
    and not any(o.startswith(("strategy=", "devices=")) for o in s.overrides)
}  # fmt: skip
ROWS = {**SURFACE_ROWS, **CASES}


def _scalars(run: Path) -> list[tuple[str, int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    found = []
    for events in sorted(run.glob("tensorboard/version_*")):
        acc = EventAccumulator(str(events))
        acc.Reload()
        found += [(tag, e.step, e.value) for tag in acc.Tags()["scalars"] for e in acc.Scalars(tag)]
    return sorted(found)


def _table(path: Path) -> list[dict]:
    with open(path) as f:
        return [{k: v for k, v in row.items() if not k.startswith(UNSEEN)} for row in csv.DictReader(f)]


def _observed(run: Path, lines: list[str]) -> dict:
    """Everything of a run directory a user or a tool reads, less timings and K."""
    ckpts = {}
    for path in sorted(run.glob("checkpoints/*.ckpt")):
        ckpt = torch.load(path, map_location="cpu", weights_only=False)
        ckpts[path.name] = {k: ckpt.get(k) for k in ("global_step", "epoch", "state_dict", "lr_schedulers")}
        ckpts[path.name]["optimizer_states"] = ckpt.get("optimizer_states")
    written = json.loads((run / "metrics.json").read_text())
    return {
        "checkpoints": ckpts,
        "metrics.json": {k: v for k, v in written.items() if not k.startswith(UNSEEN)},
        "metrics.csv": _table(run / "metrics.csv") if (run / "metrics.csv").exists() else None,
        "loggers": {str(p.relative_to(run)): p.read_text() for p in sorted(run.glob("*/version_*/metrics.csv"))},
        "tensorboard": _scalars(run),
        "lines": [re.sub(r" \(.*\)$", "", line) for line in lines],
    }


def _equal(a, b, where: str) -> None:
    if isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{where}: {a.keys()} != {b.keys()}"
        for key in a:
            _equal(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), f"{where}: {a} != {b}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _equal(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert torch.equal(a, b), f"{where}: tensors differ by {(a.double() - b.double()).abs().max()}"
    elif isinstance(a, float) and a != a:
        assert isinstance(b, float) and b != b, f"{where}: nan != {b}"
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def _run(tmp: Path, name: str, overrides: list[str], caplog) -> tuple[dict | str, int]:
    """``(what the run shows, its K)``, or ``(its one-line refusal, 0)``."""
    caplog.clear()
    try:
        size = [] if any(o.startswith("data=") for o in overrides) else [SIZE]
        result = train(compose_cfg(*BASE, *size, *overrides), tmp / name)
    except ConfigError as err:
        return str(err), 0
    lines = [r.getMessage() for r in caplog.records if r.name == "dpddp.report.epochs"]
    return _observed(tmp / name, lines), int(result["steps_per_execution"])


def _walk(tmp: Path, overrides: list[str], caplog) -> int:
    """The row's default run against its K=1 run (see the module); returns the default's K."""
    caplog.set_level(logging.INFO, logger="dpddp.report.epochs")
    default, k = _run(tmp, "default", [*overrides, "steps_per_execution=auto"], caplog)
    one, _ = _run(tmp, "one", [*overrides, "steps_per_execution=1"], caplog)
    _equal(default, one, f"K={k}")
    return k


@pytest.mark.parametrize("row", ROWS)
def test_the_default_shows_what_steps_per_execution_1_shows(tmp_path, caplog, row):
    k = _walk(tmp_path, ROWS[row], caplog)
    print(f"{row}: K={k}")  # the report's count of rows that take K above 1
    assert k >= 1 or row in SURFACE_ROWS  # 0: both refused in the same line


class EarlyStoppingOrBudget(EarlyStopping):
    """Case 60's kind: an EarlyStopping that also ends the fit after 10 training batches."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.seen = 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.seen += 1
        trainer.should_stop = trainer.should_stop or self.seen >= 10


def test_a_rule_that_allows_a_subclass_fails_the_walk(tmp_path, caplog, monkeypatch):
    """The rule broken as an allow-list would be (``issubclass`` of a known class): auto takes K above 1 for case
    60's kind, and the walk finds the difference (the budget counts executions)."""
    budget = ["+callbacks.es._target_=test_differential.EarlyStoppingOrBudget", "+callbacks.es.monitor=val/loss"]
    assert _walk(tmp_path / "kept", budget, caplog) == 1
    loose = lambda obj: issubclass(obj if isinstance(obj, type) else type(obj), executions.KNOWN) or known(obj)  # noqa: E731
    known = executions.known
    monkeypatch.setattr(auto_steps, "known", loose)
    monkeypatch.setattr(executions, "known", loose)
    with pytest.raises(AssertionError, match="K=4"):
        _walk(tmp_path / "broken", budget, caplog)
