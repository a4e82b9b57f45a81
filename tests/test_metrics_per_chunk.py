"""The chunking of a batch over ranks never changes what a metric computes: a torchmetrics multiclass metric fed
logits (AUROC, average precision, calibration error) decides per sample whether its scores are probabilities,
so a rank's small chunk whose logits all lie in [0, 1] is not taken for probabilities; on 1 and 3 processes the
value is the same."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest
import torch
from conftest import child_env, leftover, metrics
from test_bring_your_own import USER_ARGS, _project, train_here
from torchmetrics.classification import MulticlassAUROC, MulticlassAveragePrecision, MulticlassCalibrationError

from dpddp._compat import softmax_per_sample

METRICS = [
    lambda: MulticlassAUROC(3),
    lambda: MulticlassAveragePrecision(3),
    lambda: MulticlassCalibrationError(3, n_bins=5),
]


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """63 + 2 samples of logits; the last batch's two rows each lie in [0, 1] (not summing to 1)."""
    g = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(65, 3, generator=g)
    logits[63:] = torch.tensor([[0.1, 0.9, 0.4], [0.8, 0.3, 0.05]])
    y = torch.randint(0, 3, (65,), generator=g)
    return [(logits[:63], y[:63]), (logits[63:], y[63:])]


def _chunked(make, batches, world_size: int, probabilities: bool = False) -> float:
    """What ``world_size`` ranks compute: each updates its ``tensor_split`` chunk of every batch; the states
    synced (a concatenation) are one metric updated with every chunk."""
    metric = make()
    for scores, y in batches:
        scores = scores.softmax(dim=1) if probabilities else scores
        for chunk, target in zip(
            torch.tensor_split(scores, world_size), torch.tensor_split(y, world_size), strict=True
        ):
            if len(target):
                metric.update(chunk, target)
    return metric.compute().item()


@pytest.mark.parametrize("make", METRICS, ids=["auroc", "average precision", "calibration error"])
def test_a_metric_fed_logits_gives_the_same_value_however_the_batches_are_chunked(make):
    softmax_per_sample()
    batches = _batches()
    right = _chunked(make, batches, 1, probabilities=True)  # the metric of the probabilities
    for world_size in (1, 2, 3, 4):  # 3: the last batch's chunks are 1, 1 and 0 samples
        assert _chunked(make, batches, world_size) == pytest.approx(right, abs=1e-6), world_size
        assert _chunked(make, batches, world_size, probabilities=True) == pytest.approx(right, abs=1e-6)


def test_probabilities_are_kept_and_each_sample_decides_for_itself():
    softmax_per_sample()
    softmax_per_sample()  # idempotent
    module = importlib.import_module("torchmetrics.functional.classification.precision_recall_curve")

    probs = torch.tensor([[0.2, 0.3, 0.5], [0.1, 0.8, 0.1]])
    logits = torch.tensor([[0.1, 0.9, 0.4], [2.0, -1.0, 0.0]])
    assert torch.equal(module.normalize_logits_if_needed(probs, "softmax"), probs)
    assert torch.allclose(module.normalize_logits_if_needed(logits, "softmax"), logits.softmax(1))
    mixed = torch.cat([probs[:1], logits[:1]])
    assert torch.allclose(
        module.normalize_logits_if_needed(mixed, "softmax"), torch.cat([probs[:1], logits[:1].softmax(1)])
    )
    binary = torch.tensor([0.2, 0.7])
    assert torch.equal(module.normalize_logits_if_needed(binary, "sigmoid"), binary)  # sigmoid: torchmetrics' rule


AUROC = """
import torch.nn.functional as F
from torchmetrics.classification import MulticlassAUROC
from mine import TwoLayerNet


class WithAuroc(TwoLayerNet):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.val_auroc = MulticlassAUROC(3)

    def validation_step(self, batch, batch_idx):
        super().validation_step(batch, batch_idx)
        x, y = batch
        if len(y):
            self.val_auroc.update(self(x), y)  # logits
        self.log("val/auroc", self.val_auroc, on_step=False, on_epoch=True)
"""


@pytest.mark.slow
def test_a_users_auroc_of_logits_on_three_processes_equals_one_process(tmp_path, monkeypatch):
    """651 samples (a 65-sample validation split), global batch 63: a last batch of 2 over 3 ranks."""
    project = _project(tmp_path)
    (project / "auroc.py").write_text(AUROC)
    args = [*USER_ARGS, "model._target_=auroc.WithAuroc", "+data.dataset.num_samples=651", "data.batch_size=63"]
    args += ["trainer.max_epochs=1", "objective=val/auroc"]  # metrics.json carries the objective
    env, tag = child_env(PYTHONPATH=str(project))
    cmd = [sys.executable, "train.py", *args, "strategy=ddp", "devices=3", "hydra.run.dir=three"]
    proc = subprocess.run(cmd, cwd=project, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert leftover(tag) == []
    train_here(project, args, "one", monkeypatch)
    runs = {name: metrics(project / name)["val/auroc"] for name in ("one", "three")}
    assert 0.5 < runs["one"] and runs["three"] == pytest.approx(runs["one"], abs=1e-6)
