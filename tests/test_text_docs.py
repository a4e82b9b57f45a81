"""docs/your-model-and-data.md's text example as a user copies it: its ``mine.py`` (``MyTokens``, ``pad_collate``)
and its command run, and a batch with a mask third, ``(tokens, labels, mask)``, trains as the docs say."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from conftest import ROOT, max_diff, metrics, run_project, weights

DOC = ROOT / "docs" / "your-model-and-data.md"
MASKED = """
from dpddp.models.transformer import TextClassifier
from mine import pad_collate


def mask_collate(samples):
    tokens, labels = pad_collate(samples)
    return tokens, labels, tokens != 0


class Masked(TextClassifier):  # the docs' model of your own: its steps unpack three parts
    def training_step(self, batch, batch_idx):
        tokens, labels, mask = batch
        assert mask.shape == tokens.shape
        return super().training_step((tokens, labels), batch_idx)

    def validation_step(self, batch, batch_idx):
        return super().validation_step(batch[:2], batch_idx)

    def test_step(self, batch, batch_idx):
        return super().test_step(batch[:2], batch_idx)
"""
TINY = ["trainer.max_epochs=1", "+data.dataset.num_samples=256", "logger=none"]


@pytest.mark.slow
def test_the_text_example_runs_as_written_and_a_mask_third_in_the_batch_changes_nothing(tmp_path: Path):
    """A user's report: ``mine.MyTokens`` was never defined and the batch's parts unsaid. The section's ``mine.py``
    and command (ddp(2), 256 samples, 1 epoch): exit 0; the same with ``(tokens, labels, mask)`` batches cut in
    micro-batches of 8 ends with the same weights, to rounding (1e-5, the section's bound)."""
    text = DOC.read_text()
    section = text[text.index("## Text: variable-length") : text.index("**Dropout in a Transformer.**")]
    (tmp_path / "mine.py").write_text(re.search(r"`mine.py`\n```python\n(.*?)```", section, re.S).group(1))
    (tmp_path / "masked.py").write_text(MASKED)
    command = shlex.split(re.search(r"```bash\nPYTHONPATH=\. (.*?)\n```", section, re.S).group(1).replace("\\\n", ""))
    assert command[0] == "dpddp-train" and "data.collate_fn=mine.pad_collate" in command
    run_project(tmp_path, *command[1:], *TINY, "hydra.run.dir=plain", command=command[:1], check=True)
    masked = ["data.collate_fn=masked.mask_collate", "model._target_=masked.Masked", "data.micro_batch_size=8"]
    run_project(tmp_path, *command[1:], *TINY, *masked, "hydra.run.dir=masked", command=command[:1], check=True)
    assert {"test/acc", "test/loss"} <= metrics(tmp_path / "masked").keys()
    plain, three = (weights(tmp_path / run / "checkpoints" / "last.ckpt") for run in ("plain", "masked"))
    assert plain.keys() == three.keys() and max_diff(plain, three) < 1e-5  # micro-batches pad to their own longest
