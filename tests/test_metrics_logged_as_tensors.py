"""Metrics a user's model logs as plain tensors (``self.log(name, tensor, sync_dist=True)``) are reported
truthfully under ddp: a rank's empty chunk of a split's short last batch adds nothing (its mean over no samples
would make the value nan, reported as "no validation ran"), the values equal one process's, and a warning says
what such a value is; train/loss logged without sync_dist gets the same kind of warning."""

from __future__ import annotations

import pytest
from conftest import metrics, run_project
from test_bring_your_own import USER_ARGS, _project, train_here

pytestmark = pytest.mark.slow

TENSORS = """
import torch.nn.functional as F
from mine import TwoLayerNet


class TensorLogged(TwoLayerNet):
    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train/loss", loss, on_step=False, on_epoch=True)
        return loss

    def _evaluate(self, batch, stage):
        x, y = batch
        logits = self(x)
        self.log(f"{stage}/loss", F.cross_entropy(logits, y), on_epoch=True, sync_dist=True)
        self.log(f"{stage}/acc", (logits.argmax(1) == y).float().mean(), on_epoch=True, sync_dist=True)
"""
EVAL = ("val/loss", "val/acc", "test/loss", "test/acc")


@pytest.mark.parametrize(
    ("devices", "num_samples", "batch_size"),
    [(2, 651, 32), (3, 621, 30)],
    ids=["2 processes, last batch of 1", "3 processes, last batch of 2"],
)
def test_tensor_metrics_with_sync_dist_equal_one_process_with_a_warning(
    tmp_path, monkeypatch, devices, num_samples, batch_size
):
    project = _project(tmp_path)
    (project / "tensors.py").write_text(TENSORS)
    args = [*USER_ARGS, "model._target_=tensors.TensorLogged", f"+data.dataset.num_samples={num_samples}"]
    args += [f"data.batch_size={batch_size}", "trainer.max_epochs=1"]
    train_here(project, args, "one", monkeypatch)  # the one-process run, in this process
    many = run_project(project, *args, "strategy=ddp", f"devices={devices}", "hydra.run.dir=many", check=True)
    one, written = metrics(project / "one"), metrics(project / "many")
    for key in EVAL:  # the split's last batch leaves at least one rank an empty chunk
        assert written[key] is not None and written[key] == pytest.approx(one[key], abs=1e-5), key
    assert not set(written.get("missing", {})) & set(EVAL)
    said = many.stderr + many.stdout
    for key in EVAL:
        assert (
            f"metric contract: {key} is logged as a tensor with {devices} processes, so it is each step's value "
            "weighted by its chunk's samples over every rank (sync_dist): exact for a mean" in said
        ), key
    assert (
        f"metric contract: train/loss is logged as a tensor with {devices} processes, so it is rank 0's steps "
        "alone (no sync_dist)" in said
    )
