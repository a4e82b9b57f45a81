"""The contract test: walks ``SURFACE`` (``tests/surface.py``), the table of every setting a user can reach.

Each supported Trainer flag: a run stopped at a seeded random step (``max_steps``) and continued ends with the
step and weights of a straight run (one process, 1e-6), and ddp on 2 processes ends with the step, weights and
metrics of one process (1e-5; every flag's ddp run is a job of one sweep). Each refused setting: its one line.
Every other row names the tests that check its promises: each must be a test pytest collects, not skipped on
CPU, that runs the row's setting. The README's table is the generated one."""

import hashlib
import importlib
import inspect
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import QUIET, ROOT, child_env, compose_cfg, leftover, made_once, max_diff, metrics, weights
from omegaconf import OmegaConf
from surface import SURFACE, markdown

from dpddp.errors import ConfigError
from dpddp.run.config import check_config
from dpddp.run.training import train

BASE = [*QUIET, "accelerator=cpu", "data.num_samples=1005", "logger=none", "model.optimizer=adam", "model.lr=0.01"]
WALKED = [s for s in SURFACE if s.kind == "trainer flag" and not s.refused and not s.tested_by]
# A row whose config is contained in another row's runs as that row's (test_a_folded_row_is_contained_in_its_runs):
# what the other row adds only records (LearningRateMonitor, CSVLogger) or warns (the metric contract), or ends the
# run at the end of an epoch (EarlyStopping), so each line the folded row's runs would reach, its runs reach.
# folded row -> (the row that runs it, the keys where the folded row's config differs from that row's, each because
# what it adds there does not change the weights: the metric contract only warns, the CSV logger only records)
FOLDED = {
    "callbacks=model_checkpoint": ("trainer.max_epochs=N", {".callbacks.metric_contract"}),
    "callbacks=early_stopping": ("callbacks=[early_stopping,lr_monitor] logger=csv", {".logger"}),
    "callbacks=lr_monitor logger=csv": ("callbacks=[early_stopping,lr_monitor] logger=csv", set()),
}
FLAGS = [s for s in WALKED if s.name not in FOLDED]


def _step(run):
    return torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"]


def _one(shared_dir: Path, *args: str) -> Path:
    """``args`` trained on one process in this process, once a session: a row's straight run, which its stop
    and continue and its ddp job are compared to."""
    name = "surface_" + hashlib.sha1("\0".join(args).encode()).hexdigest()[:16]
    return made_once(shared_dir, name, lambda path: train(compose_cfg(*args), path))


@pytest.mark.parametrize("setting", FLAGS, ids=[s.name for s in FLAGS])
def test_a_stop_at_a_random_step_then_continued_equals_a_straight_run(tmp_path, shared_dir, setting):
    args = [*BASE, "trainer.max_epochs=3", *setting.overrides]
    straight = _one(shared_dir, *args)
    stop = random.Random(setting.name).randint(1, _step(straight) - 1)  # anywhere before its end
    train(compose_cfg(*args, f"trainer.max_steps={stop}"), tmp_path / "first")
    assert _step(tmp_path / "first") == stop
    train(compose_cfg(*args, f"ckpt_path={tmp_path / 'first/checkpoints/last.ckpt'}"), tmp_path / "continued")
    assert _step(tmp_path / "continued") == _step(straight)
    a, b = weights(tmp_path / "continued/checkpoints/last.ckpt"), weights(straight / "checkpoints/last.ckpt")
    assert max_diff(a, b) <= 1e-6


def _leaves(value, key: str = "") -> set[tuple[str, str]]:
    """The (dotted key, value) pairs of a config's leaves, ``None`` and an empty dict (a removed group) included."""
    if isinstance(value, dict) and value:
        return set().union(*(_leaves(v, f"{key}.{k}") for k, v in value.items()))
    return {(key, repr(value))}


@pytest.mark.parametrize(("folded", "runs", "differ"), [(f, *r) for f, r in FOLDED.items()])
def test_a_folded_row_is_contained_in_its_runs(folded, runs, differ):
    """Every setting of the folded row's config, with the same value, in the config of the row that runs it, but
    for the differences ``FOLDED`` names (a new difference fails)."""
    rows = {s.name: s for s in WALKED}
    inner, outer = (
        _leaves(OmegaConf.to_container(compose_cfg(*BASE, "trainer.max_epochs=3", *rows[name].overrides)))
        for name in (folded, runs)
    )
    assert {key for key, _ in inner - outer} == differ, sorted(inner - outer)


REFUSED = [s for s in SURFACE if s.refused]
# The flags whose row under ddp is a refused row of its own (trainer.precision=bf16-mixed): one process only.
DDP_FLAGS = [
    s for s in FLAGS if not any("strategy=ddp" in r.overrides and set(s.overrides) <= set(r.overrides) for r in REFUSED)
]


@pytest.mark.slow
def test_each_flag_on_two_processes_equals_one_process(tmp_path, shared_dir):
    """Promise 1 on every flag: one sweep (one interpreter) runs each flag's ddp(2) run as a job, a config of
    the ``surface`` group written here; meanwhile each flag's one-process run (``_one``) runs in this process."""
    assert DDP_FLAGS
    rows = tmp_path / "conf" / "surface"
    rows.mkdir(parents=True)
    for i, setting in enumerate(DDP_FLAGS):
        logger = [] if any(o.startswith("logger=") for o in setting.overrides) else ["logger=none"]
        (rows / f"r{i}.yaml").write_text(_job_config([*logger, *(o.lstrip("+") for o in setting.overrides)]))
    args = [
        "-m",
        *(o for o in BASE if o != "logger=none"),  # each row's config chooses its logger (none unless it sets one)
        "trainer.max_epochs=3",
        "strategy=ddp",
        "devices=2",
        f"hydra.searchpath=[file://{tmp_path}/conf]",
    ]
    args += [f"+surface={','.join(f'r{i}' for i in range(len(DDP_FLAGS)))}", f"hydra.sweep.dir={tmp_path}/sweep"]
    env, tag = child_env(PYTHONPATH=str(ROOT / "tests"))  # a row's users_models
    cmd = [sys.executable, str(ROOT / "train.py"), *args]
    sweep = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ones = [_one(shared_dir, *BASE, "trainer.max_epochs=3", *setting.overrides) for setting in DDP_FLAGS]
        _, err = sweep.communicate(timeout=600)
    finally:
        sweep.kill()
    assert sweep.returncode == 0, err[-3000:]
    assert leftover(tag) == []
    for i, setting in enumerate(DDP_FLAGS):
        one, two = ones[i], tmp_path / "sweep" / str(i)
        assert metrics(two)["world_size"] == 2, setting.name
        assert _step(two) == _step(one), setting.name
        assert max_diff(weights(two / "checkpoints/last.ckpt"), weights(one / "checkpoints/last.ckpt")) <= 1e-5, (
            setting.name
        )
        for key in ("train/loss", "val/loss", "val/acc", "test/loss", "test/acc"):
            assert metrics(two)[key] == pytest.approx(metrics(one)[key], abs=1e-5), (setting.name, key)


@pytest.mark.parametrize("setting", REFUSED, ids=[s.name for s in REFUSED])
def test_a_refused_setting_is_one_line(setting):
    with pytest.raises(ConfigError) as err:
        check_config(compose_cfg(*setting.overrides))
    assert str(err.value).startswith(setting.refused) and "\n" not in str(err.value)


MODELS = [s for s in SURFACE if s.kind == "model" and not s.tested_by]
VARIANTS = ["", "steps_per_execution=4", "trainer.accumulate_grad_batches=2"]
# 805 training samples: 16 steps an epoch. The model's settings go with each row (a sweep's command line would
# override a job's config).
MODEL_BASE = [o for o in BASE if not o.startswith("model.")] + ["trainer.max_epochs=3", "data.batch_size=48"]
MODEL_DEFAULTS = [o for o in BASE if o.startswith("model.")]


def _model(setting) -> list[str]:
    """The row's overrides after the suite's model settings (a group choice first: it resets the group)."""
    groups = [o for o in setting.overrides if o.startswith("model=")]
    return [*groups, *MODEL_DEFAULTS, *[o for o in setting.overrides if o not in groups]]


def _state(run) -> dict[str, torch.Tensor]:
    """Every tensor of the model in ``last.ckpt``: weights, running statistics and their counts."""
    return torch.load(run / "checkpoints/last.ckpt", map_location="cpu", weights_only=True)["state_dict"]


def _state_diff(a, b) -> float:
    sa, sb = _state(a), _state(b)
    assert sa.keys() == sb.keys()
    return max((sa[k].double() - sb[k].double()).abs().max().item() for k in sa)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("setting", MODELS, ids=[s.name.split(":")[0] for s in MODELS])
def test_a_models_stop_at_a_random_step_then_continued_equals_a_straight_run(tmp_path, shared_dir, setting, variant):
    args = [*MODEL_BASE, *_model(setting), *([variant] if variant else [])]
    straight = _one(shared_dir, *args)
    steps = _step(straight)
    k = 4 if "steps_per_execution" in variant else 1  # a stop inside an execution is its own test
    stop = k * random.Random(setting.name + variant).randint(1, steps // k - 1)
    train(compose_cfg(*args, f"trainer.max_steps={stop}"), tmp_path / "first")
    assert _step(tmp_path / "first") == stop
    train(compose_cfg(*args, f"ckpt_path={tmp_path / 'first/checkpoints/last.ckpt'}"), tmp_path / "continued")
    assert _step(tmp_path / "continued") == steps
    assert _state_diff(tmp_path / "continued", straight) <= 1e-6


def _job_config(overrides: list[str]) -> str:
    """A ``# @package _global_`` config of ``train.py`` overrides (a group choice becomes a defaults override)."""
    groups = [o.split("=", 1) for o in overrides if "=" in o and "." not in o.split("=", 1)[0] and o[0] != "+"]
    groups = [(k, v) for k, v in groups if k in ("model", "data", "logger", "callbacks")]
    values = OmegaConf.from_dotlist([o for o in overrides if o.split("=", 1)[0] not in dict(groups)])
    defaults = "".join(f"  - override /{k}: {v}\n" for k, v in groups)
    body = OmegaConf.to_yaml(values) if values else ""  # a row of group choices alone has no values
    return "# @package _global_\n" + (f"defaults:\n{defaults}" if defaults else "") + body


MODEL_JOBS = [(s, v, 2) for s in MODELS for v in VARIANTS] + [(s, "", 3) for s in MODELS]


@pytest.mark.slow
def test_each_model_on_two_and_three_processes_equals_one_process(tmp_path, shared_dir):
    """Promise 1 on each model row: ddp on 2 processes with each variant, and on 3, as jobs of one sweep; the
    weights and running statistics of one process (``_one``: 1e-5), and its step and metrics."""
    rows = tmp_path / "conf" / "surface"
    rows.mkdir(parents=True)
    for i, (setting, variant, devices) in enumerate(MODEL_JOBS):
        job = [*_model(setting), *([variant] if variant else []), f"devices={devices}"]
        (rows / f"m{i}.yaml").write_text(_job_config(job))
    args = ["-m", *MODEL_BASE, "strategy=ddp", f"hydra.searchpath=[file://{tmp_path}/conf]"]
    args += [f"+surface={','.join(f'm{i}' for i in range(len(MODEL_JOBS)))}", f"hydra.sweep.dir={tmp_path}/sweep"]
    env, tag = child_env(PYTHONPATH=str(ROOT / "tests"))
    cmd = [sys.executable, str(ROOT / "train.py"), *args]
    sweep = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        ones = [_one(shared_dir, *MODEL_BASE, *_model(s), *([v] if v else [])) for s, v, _ in MODEL_JOBS]
        _, err = sweep.communicate(timeout=900)
    finally:
        sweep.kill()
    assert sweep.returncode == 0, err[-3000:]
    assert leftover(tag) == []
    for i, (setting, variant, devices) in enumerate(MODEL_JOBS):
        one, many, case = ones[i], tmp_path / f"sweep/{i}", (setting.name, variant, devices)
        assert metrics(many)["world_size"] == devices and _step(many) == _step(one), case
        assert _state_diff(many, one) <= 1e-5, case
        for key in ("train/loss", "val/loss", "val/acc", "test/loss", "test/acc"):
            assert metrics(many)[key] == pytest.approx(metrics(one)[key], abs=1e-5), (case, key)


ROWS = [s for s in SURFACE if s not in WALKED and s not in MODELS and not s.refused]
NAMED = [(setting, name) for setting in ROWS for name in setting.tested_by]


def test_every_other_row_names_its_tests():
    assert ROWS and all(s.tested_by for s in ROWS)


def _marks(obj: object) -> list[pytest.Mark]:
    marks = getattr(obj, "pytestmark", [])
    return list(marks) if isinstance(marks, list) else [marks]


@pytest.mark.parametrize("setting,name", NAMED, ids=[f"{s.name} | {name}" for s, name in NAMED])
def test_each_named_test_is_collected_and_runs_on_cpu(setting, name):
    """``file::test``: a ``test_*`` function of a ``test_*.py`` module of tests/ (what pytest collects), with no
    mark that skips it here (``skip``, a true ``skipif``, ``xfail``, ``gpu``): a renamed, removed or skipped test
    fails. What it runs is its own assertions' to show."""
    path, _, test = name.partition("::")
    assert re.fullmatch(r"test_\w+\.py", path) and (ROOT / "tests" / path).is_file(), name
    assert test.startswith("test_"), f"{name}: name one test"
    module = importlib.import_module(path.removesuffix(".py"))  # tests/ is on sys.path, as for conftest
    function = getattr(module, test, None)
    assert inspect.isfunction(function) and function.__module__ == module.__name__, f"{name}: no such test"
    marks = _marks(module) + _marks(function)
    for mark in marks:
        assert mark.name not in ("skip", "xfail", "gpu"), f"{name} is marked {mark.name}"
        if mark.name == "skipif":
            condition = mark.args[0] if mark.args else mark.kwargs.get("condition")
            assert isinstance(condition, bool) and not condition, f"{name} is skipped here: {mark.kwargs}"


def test_the_readme_table_is_the_generated_one():
    readme = (ROOT / "README.md").read_text()
    assert markdown() in readme
