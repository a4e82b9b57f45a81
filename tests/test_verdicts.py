"""What dpddp says about a model is true: draws from the global random streams found by their effect (not by
class), the model and the streams left as they were."""

from __future__ import annotations

import copy
import logging
import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import compose_cfg, run_train, train_py_here
from hydra.utils import instantiate
from text_models import NoisyTextTransformer, TextTransformer
from torch import nn

from dpddp.continuity.state import limit_line
from dpddp.entry.run_dir import other_run
from dpddp.models.mlp import MLPClassifier
from dpddp.parallel.rules import world_of
from dpddp.run.assembly import _warn_global_rng
from dpddp.run.draws_seen import draws_line, global_draws

BATCH = (torch.randn(6, 16), torch.randint(0, 4, (6,)))


class Added(MLPClassifier):
    """The built-in MLP (``dropout``: ``SampleDropout``) with ``extra`` applied to its hidden layer's output, and a
    BatchNorm before the head."""

    def __init__(self, extra: nn.Module, dropout: float = 0.0) -> None:
        super().__init__(num_features=16, num_classes=4, hidden=[8], dropout=dropout)
        self.extra, self.norm = extra, nn.BatchNorm1d(8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net[-1](self.norm(self.extra(self.net[:-1](x))))


class NumpyNoise(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + float(np.random.rand()) + random.random()


def _names(model: nn.Module, keyed: bool = True) -> list[str]:
    return [d.name for d in global_draws(model, BATCH, keyed)]


@pytest.mark.parametrize(
    ("model", "named"),
    [
        (Added(nn.Dropout(0.0)), []),  # draws nothing
        (Added(nn.Dropout(0.1)), ["model.extra"]),
        (Added(nn.Dropout(0.1).eval()), []),  # kept in eval mode by the user: Lightning leaves it so
        (Added(nn.Identity(), dropout=0.5), []),  # SampleDropout draws from its keys
        (Added(NumpyNoise()), ["model.extra"]),
        (TextTransformer(dropout=0.0), []),
        (TextTransformer(dropout=0.1), ["model.encoder.self_attn", "model.encoder.dropout1", "model.encoder.dropout",
                                        "model.encoder.dropout2"]),
        (NoisyTextTransformer(), ["model.forward"]),  # F.dropout in the model's own forward
    ],
)  # fmt: skip
def test_each_draw_of_the_global_streams_is_named_by_its_effect(model, named):
    assert _names(model) == named


def test_functional_dropout_in_multihead_attention_is_named_with_its_fix():
    attention = nn.MultiheadAttention(8, 2, dropout=0.1, batch_first=True)

    class Attending(Added):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = self.net[:-1](x).unsqueeze(1)
            return self.net[-1](attention(h, h, h)[0].squeeze(1))

    model = Attending(nn.Identity())
    model.attention = attention
    draws = global_draws(model, BATCH, keyed=True)
    assert [(d.name, d.kind, d.streams) for d in draws] == [("model.attention", "attention", ("torch",))]
    assert draws_line(draws) == (
        "model.attention draws from the global random streams; use dropout=0 in model.attention and a "
        "dpddp.nn.SampleDropout(p) on its output"
    )


def test_an_unkeyed_sample_dropout_and_numpy_draws_are_named_by_stream():
    draws = global_draws(Added(NumpyNoise(), dropout=0.5), BATCH, keyed=False)  # outside dpddp's loop: nn.Dropout
    assert [(d.name, d.streams) for d in draws] == [("model.net.2", ("torch",)), ("model.extra", ("numpy", "random"))]


def test_the_probe_leaves_the_model_and_every_stream_as_they_were():
    model = Added(nn.Dropout(0.3))
    model.extra.eval()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    streams = torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate()
    assert _names(model) == []  # in eval mode as the user left it
    model.extra.train()
    assert _names(model) == ["model.extra"]
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # BatchNorm's running stats too
    assert torch.equal(streams[0], torch.get_rng_state()) and np.array_equal(streams[1], np.random.get_state()[1])
    assert streams[2] == random.getstate()
    assert model._step_losses == [] and model.extra.training  # the step's kept loss undone; the modes kept


def test_a_step_that_needs_its_trainer_raises_for_the_caller_to_say_so():
    class NeedsTrainer(Added):
        def training_step(self, batch, batch_idx):
            return F.cross_entropy(self(batch[0]), batch[1]) * self.trainer.world_size

    with pytest.raises(RuntimeError, match="not attached to a `Trainer`"):
        global_draws(NeedsTrainer(nn.Identity()), BATCH, keyed=True)


def _warm_cosine(total: int):
    """A LambdaLR factor: 2 warm-up steps, then cosine to 0 at ``total``."""
    return lambda s: (s + 1) / 2 if s < 2 else 0.5 * (1 + math.cos(math.pi * min(s, total) / total))


def _continued(build, first: int, again: int, steps: int, lr: float = 0.1):
    """A scheduler built by ``build(optimizer, limit)`` for ``first`` and stepped ``steps`` times (the first run),
    then built for ``again`` with the first one's state restored, as Lightning restores it: the restored
    scheduler, the first build's state and this build's."""
    weight = nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([weight], lr=lr)
    scheduler = build(optimizer, first)
    old = copy.deepcopy(scheduler.state_dict())
    for _ in range(steps):
        optimizer.step()
        scheduler.step()
    state, groups = scheduler.state_dict(), copy.deepcopy(optimizer.state_dict())
    optimizer = torch.optim.SGD([weight], lr=lr)
    scheduler = build(optimizer, again)
    new = copy.deepcopy(scheduler.state_dict())
    optimizer.load_state_dict(groups)
    scheduler.load_state_dict(state)
    return scheduler, old, new


def test_a_lambda_schedule_continued_to_another_limit_is_said_by_what_it_will_do():
    """Issue 50: the first run's LambdaLR reached 0 at its limit; continued to twice the limit its lambda, code
    the checkpoint cannot hold, takes the new limit's values from the restored step: the rate jumps back up."""
    scheduler, old, new = _continued(lambda o, t: torch.optim.lr_scheduler.LambdaLR(o, _warm_cosine(t)), 10, 20, 10)
    assert limit_line(scheduler, False, old, new) == (
        "LambdaLR's lambda is code, not state: the checkpoint restores its step (10) and this run's lambda, built for "
        "this run's limit, takes over from there, after steps the first run's lambda took, so it cannot equal a "
        "straight run to this limit (its learning rate from step 10: 0, 0.0422, 0.0345, 0.0273; a straight run's: "
        "0.05, 0.0422, 0.0345, 0.0273); keep the first run's limit, or use a schedule that does not depend on it"
    )
    assert scheduler.last_epoch == 10 and scheduler.optimizer.param_groups[0]["lr"] == 0  # measured, then restored
    same, old, new = _continued(lambda o, t: torch.optim.lr_scheduler.LambdaLR(o, _warm_cosine(t)), 20, 20, 10)
    assert limit_line(same, False, old, new) is None  # the same limit: the straight run's schedule


def test_a_schedule_whose_state_holds_its_limit_is_said_with_its_rates_and_its_failing_step():
    cosine = lambda o, t: torch.optim.lr_scheduler.CosineAnnealingLR(o, t)  # noqa: E731
    line = limit_line(*_continued(cosine, 2, 3, 2)[:1], False, *_continued(cosine, 2, 3, 2)[1:])
    assert line == (
        "CosineAnnealingLR was built with T_max=2 for the limit the checkpoint's run had, and this run builds T_max=3: "
        "the continued run follows the first schedule, so it cannot equal a straight run to this limit (its learning "
        "rate from step 2: 0, 0.05, 0.1, 0.05; a straight run's: 0.025, 0, 0.025, 0.075); keep the first run's "
        "limit, or use a schedule that does not depend on it"
    )
    one_cycle = lambda o, t: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=t)  # noqa: E731
    line = limit_line(*_continued(one_cycle, 4, 6, 4)[:1], False, *_continued(one_cycle, 4, 6, 4)[1:])
    assert line is not None and line.endswith(
        "(its learning rate from step 4: 0.0283, then its step raises ValueError: Tried to step 5 times. The specified "
        "number of total steps is 4; a straight run's: 0.0133, 4e-07, 0.0133); keep the first run's limit, or use a "
        "schedule that does not depend on it"
    )


TINY = ["trainer.max_epochs=1", "data.num_samples=512", "logger=none"]


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_a_different_sweep_into_a_used_sweep_directory_is_one_line_before_anything_is_written(
    tmp_path, monkeypatch, capfd
):
    """Case 69, under the basic launcher and joblib: another global batch into the first sweep's directory is
    refused before any job starts, naming the setting and another directory; the first sweep's files stay. The
    first sweep and the joblib one run train.py's calls in this process; the basic one is a process of its own
    (its whole stderr is the line)."""
    sweep = ["-m", "model.lr=0.05,0.2", *TINY, "hydra.sweep.dir=sweeps/lr"]
    assert train_py_here(*sweep, cwd=tmp_path, monkeypatch=monkeypatch) == 0
    capfd.readouterr()
    before = _files(tmp_path / "sweeps")
    line = (
        "error: hydra.sweep.dir=sweeps/lr holds the jobs of a sweep with other settings: this one gives "
        "data.batch_size=128 where it had the config's data.batch_size, and a job continues only with its own "
        "model, data, Trainer and seed settings (a limit aside): give this sweep its own directory "
        "(hydra.sweep.dir=sweeps/lr-2)"
    )
    for launcher in ([], ["hydra/launcher=joblib"]):
        again = ["-m", "model.lr=0.05,0.2", *TINY, "data.batch_size=128", *launcher, "hydra.sweep.dir=sweeps/lr"]
        if launcher:
            said = train_py_here(*again, cwd=tmp_path, monkeypatch=monkeypatch), capfd.readouterr().err.strip()
        else:
            proc = run_train(*again, cwd=tmp_path)
            said = proc.returncode, proc.stderr.strip()
        assert said == (2, line), said[1][-2000:]
        assert _files(tmp_path / "sweeps") == before


@pytest.mark.slow
def test_resuming_a_run_with_another_setting_is_one_line_before_anything_is_written(tmp_path, monkeypatch, capfd):
    """train.py's calls in this process, both runs: the refusal's stderr in a process of its own is the sweep's
    (test_a_different_sweep_...: the same StartChecks refusal after the same imports)."""
    assert train_py_here(*TINY, "hydra.run.dir=runs/a", cwd=tmp_path, monkeypatch=monkeypatch) == 0
    capfd.readouterr()
    before = _files(tmp_path / "runs")
    again = [*TINY, "model.lr=0.3", "resume=true", "hydra.run.dir=runs/a"]
    assert (train_py_here(*again, cwd=tmp_path, monkeypatch=monkeypatch), capfd.readouterr().err.strip()) == (
        2,
        "error: the run directory runs/a holds a run with other settings: this one gives model.lr=0.3 where it had "
        "the config's model.lr, and a continue changes no setting of its model, data, Trainer or seed but a limit: "
        "give this run its own directory (hydra.run.dir=runs/a-2)",
    )
    assert _files(tmp_path / "runs") == before  # a later limit continues: test_a_continue_may_change_...


def test_a_continue_may_change_a_limit_and_what_does_not_say_what_is_trained(tmp_path):
    (tmp_path / ".hydra").mkdir()
    typed = "- model.lr=0.1\n- trainer.max_epochs=2\n- devices=1\n- +callbacks.kill._target_=conftest.SigtermAt\n"
    (tmp_path / ".hydra" / "overrides.yaml").write_text(typed)
    same = ["model.lr=0.1", "trainer.max_epochs=5", "resume=true", "trainer=ddp_sim", "devices=2", "logger=csv"]
    assert other_run(tmp_path, same, tmp_path / ".hydra") is None
    assert other_run(tmp_path, same, None) is None  # nothing says how it was started
    line = other_run(tmp_path, ["trainer.max_epochs=5"], tmp_path / ".hydra")
    assert line is not None and "this one gives the config's model.lr where it had model.lr=0.1" in line
    line = other_run(tmp_path, [*same, "trainer.precision=bf16-mixed"], tmp_path / ".hydra")
    assert line is not None and "this one gives trainer.precision=bf16-mixed where it had the config's" in line


def test_the_start_line_names_attention_and_a_forwards_functional_dropout_and_not_a_zero_rate(caplog):
    """The start line under ddp(2), on a training batch of the run's data: ``nn.MultiheadAttention``'s functional
    dropout and ``F.dropout`` in a forward are named; dropout 0 everywhere says nothing."""
    cfg = compose_cfg("accelerator=cpu", "strategy=ddp", "devices=2", "data.num_samples=512")
    said = {}
    for name, model in [("attention", TextTransformer(dropout=0.1)), ("forward", NoisyTextTransformer()),
                        ("zero", TextTransformer(dropout=0.0))]:  # fmt: skip
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="dpddp.run.assembly"):
            _warn_global_rng(model, instantiate(cfg.data, _convert_="all"), world_of(cfg))
        said[name] = [r.getMessage() for r in caplog.records]
    assert said["zero"] == []
    assert len(said["attention"]) == 1 and said["attention"][0].startswith(
        "model.encoder.self_attn, model.encoder.dropout1, model.encoder.dropout and 1 more draw from the global "
        "random streams; use dpddp.nn.SampleDropout(p) in place of model.encoder.dropout1, model.encoder.dropout, "
        "model.encoder.dropout2; dropout=0 in model.encoder.self_attn and a dpddp.nn.SampleDropout(p) on its output: "
        "with 2 replicas the weights differ from one process's"
    )
    assert said["forward"] == [
        "model.forward draws from the global random streams; use draws keyed by the sample in model.forward "
        "(dpddp.nn.SampleDropout, dpddp.nn.sample_generator): with 2 replicas the weights differ from one process's (a "
        "continued run on the same world size still equals a straight one)"
    ]
