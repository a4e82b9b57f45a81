"""What dpddp says about a model is true: draws from the global random streams found by their effect (not by
class), the model and the streams left as they were."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from text_models import NoisyTextTransformer, TextTransformer
from torch import nn

from dpddp.models.mlp import MLPClassifier
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
