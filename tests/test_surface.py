"""The contract test: walks ``dpddp.run.surface.SURFACE``, the table of every setting a user can reach.

Each supported Trainer flag: a run stopped at a seeded random step (``max_steps``) and continued ends with the
step and weights of a straight run (one process, 1e-6). Each refused setting: its one line. Every other row
names the tests that check its promises: they must exist. The README's table is the generated one."""

import random
import re

import pytest
import torch
from conftest import QUIET, ROOT, compose_cfg, max_diff, weights

from dpddp.errors import ConfigError
from dpddp.run.config import check_config
from dpddp.run.surface import SURFACE, markdown
from dpddp.run.training import train

BASE = [*QUIET, "accelerator=cpu", "data.num_samples=1005", "logger=none", "model.optimizer=adam", "model.lr=0.01"]
FLAGS = [s for s in SURFACE if s.kind == "trainer flag" and not s.refused and not s.tested_by]


def _step(run):
    return torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"]


@pytest.mark.parametrize("setting", FLAGS, ids=[s.name for s in FLAGS])
def test_a_stop_at_a_random_step_then_continued_equals_a_straight_run(tmp_path, setting):
    args = [*BASE, "trainer.max_epochs=3", *setting.overrides]
    stop = random.Random(setting.name).randint(1, 30)  # 12 batches an epoch: anywhere in the 3 epochs
    train(compose_cfg(*args), tmp_path / "straight")
    train(compose_cfg(*args, f"trainer.max_steps={stop}"), tmp_path / "first")
    train(compose_cfg(*args, f"ckpt_path={tmp_path / 'first/checkpoints/last.ckpt'}"), tmp_path / "continued")
    assert _step(tmp_path / "continued") == _step(tmp_path / "straight")
    a, b = weights(tmp_path / "continued/checkpoints/last.ckpt"), weights(tmp_path / "straight/checkpoints/last.ckpt")
    assert max_diff(a, b) <= 1e-6


REFUSED = [s for s in SURFACE if s.refused]


@pytest.mark.parametrize("setting", REFUSED, ids=[s.name for s in REFUSED])
def test_a_refused_setting_is_one_line(setting):
    with pytest.raises(ConfigError) as err:
        check_config(compose_cfg(*setting.overrides))
    assert str(err.value).startswith(setting.refused) and "\n" not in str(err.value)


def test_every_other_row_names_tests_that_exist():
    rows = [s for s in SURFACE if s not in FLAGS and not s.refused]
    assert rows and all(s.tested_by for s in rows)
    for setting in rows:
        for name in setting.tested_by:
            path, _, test = name.partition("::")
            source = (ROOT / "tests" / path).read_text()
            assert not test or re.search(rf"^def {re.escape(test)}\(", source, re.M), name


def test_the_readme_table_is_the_generated_one():
    readme = (ROOT / "README.md").read_text()
    assert markdown() in readme
