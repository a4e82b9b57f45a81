"""``compile=true``: the model's forward compiled by ``torch.compile`` (inductor, C++ on the CPU) ends within
``BOUND`` of eager on one process and on 2 ddp processes, with eager's ``state_dict`` keys, and continues exactly;
``strategy=dp`` and a value that is not a mode are refused in one line."""

from __future__ import annotations

import pytest
import torch
from conftest import ROOT, compose_cfg, made_once, max_diff, metrics, run_train, train_py_here, weights

from dpddp.errors import ConfigError
from dpddp.models.mlp import MLPClassifier
from dpddp.run.assembly import MODES, compile_mode
from dpddp.run.config import check_config
from dpddp.run.training import train

BASE = ["accelerator=cpu", "data.num_samples=1005", "logger=none", "model=mlp", "model.hidden=[16]"]
BASE += ["trainer.max_epochs=2"]  # 12 steps an epoch
BATCHNORM = ["model._target_=users_models.BatchNormMLP", "model.optimizer=sgd", "model.lr=0.05"]
BOUND = 1e-5
"""Compiled against eager, max abs weight difference (promise 1's bound): measured over these 24 steps 3.0e-8 on one
process, 4.5e-8 on ddp(2) and 2.4e-7 on ddp(2) with BatchNorm (against eager one process; float32 rounding:
inductor fuses and reorders the forward's sums)."""


def _run(path, *args: str) -> None:
    """``train.py BASE args`` into ``path``, checked (exit 0, no process left); its stderr kept beside it."""
    env = {"PYTHONPATH": str(ROOT / "tests")}  # users_models
    proc = run_train(*BASE, *args, f"hydra.run.dir={path}", cwd=path.parent, env=env, check=True)
    (path / "stderr.txt").write_text(proc.stderr)


def _eager_here(path, *args: str) -> None:
    """``BASE args`` eager on one process, trained in this process (what ``train.py`` runs) into ``path``."""
    train(compose_cfg(*BASE, *args), path)


def _eager(shared_dir):
    return made_once(shared_dir, "compile_eager_one", _eager_here)


def _compiled(shared_dir):
    return made_once(shared_dir, "compile_one", lambda path: _run(path, "compile=true"))


def _compiled_fully(run) -> None:
    """The run said it compiles the forward, and torch never gave up compiling it (its recompile limit)."""
    assert "forward is compiled by torch.compile" in (run / "train.log").read_text()
    assert "recompile_limit" not in (run / "stderr.txt").read_text()


@pytest.mark.slow
def test_one_compiled_process_is_within_the_bound_of_eager_and_loads_in_eager(shared_dir):
    eager, compiled = _eager(shared_dir), _compiled(shared_dir)
    _compiled_fully(compiled)
    assert metrics(compiled)["world_size"] == 1
    ours, theirs = weights(compiled / "checkpoints/last.ckpt"), weights(eager / "checkpoints/last.ckpt")
    assert ours.keys() == theirs.keys()  # no `_orig_mod.` prefix: the same checkpoints as eager
    assert max_diff(ours, theirs) <= BOUND
    state = torch.load(compiled / "checkpoints/last.ckpt", map_location="cpu", weights_only=True)["state_dict"]
    MLPClassifier(num_features=16, num_classes=4, hidden=[16]).load_state_dict(state, strict=True)


@pytest.mark.slow
def test_two_compiled_ddp_processes_with_batchnorm_are_within_the_bound_of_one_eager_process(tmp_path):
    """BatchNorm too: its layers, converted for the global batch's statistics before the first forward, are what
    the compiled forward traces (a graph break at their all-reduce)."""
    _eager_here(tmp_path / "one", *BATCHNORM)
    _run(tmp_path / "ddp", *BATCHNORM, "compile=true", "strategy=ddp", "devices=2")
    _compiled_fully(tmp_path / "ddp")
    assert metrics(tmp_path / "ddp")["world_size"] == 2
    ddp, one = weights(tmp_path / "ddp/checkpoints/last.ckpt"), weights(tmp_path / "one/checkpoints/last.ckpt")
    assert max_diff(ddp, one) <= BOUND


@pytest.mark.slow
def test_a_compiled_run_stopped_then_continued_equals_the_straight_compiled_run(shared_dir, tmp_path, monkeypatch):
    """Both segments: train.py's calls in this process (each compiles afresh: ``compile_model`` resets torch's)."""
    straight, run = _compiled(shared_dir), tmp_path / "run"
    for segment in ["trainer.max_epochs=1"], ["resume=true"]:  # then to BASE's 2 epochs
        args = [*BASE, "compile=true", *segment, f"hydra.run.dir={run}"]
        assert train_py_here(*args, cwd=tmp_path, monkeypatch=monkeypatch) == 0
    assert metrics(run)["segments"] == 2
    continued, whole = weights(run / "checkpoints/last.ckpt"), weights(straight / "checkpoints/last.ckpt")
    assert max_diff(continued, whole) <= BOUND


@pytest.mark.parametrize(
    "overrides,line",
    [
        (
            ["strategy=dp", "compile=true"],
            "strategy='dp' cannot be kept with compile=true (DataParallel's replicas run the model's forward "
            "uncompiled; ddp compiles it on every rank): remove it, or use compile=false",
        ),
        (
            ["strategy=dp", "compile=max-autotune"],
            "strategy='dp' cannot be kept with compile=max-autotune (DataParallel's replicas run the model's forward "
            "uncompiled; ddp compiles it on every rank): remove it, or use compile=false",
        ),
        (
            ["compile=fast"],
            "compile='fast' is not offered: use compile=true (torch.compile's default mode), a mode (default, lite, "
            "reduce-overhead, max-autotune, max-autotune-no-cudagraphs) or compile=false",
        ),
        (
            ["+model.compile=true"],  # where a user may look for it
            "unknown setting model.compile: set it at the top level: compile=true (torch.compile of the model's "
            "forward)",
        ),
    ],
)
def test_what_compile_cannot_keep_is_one_line(overrides, line):
    with pytest.raises(ConfigError) as err:
        check_config(compose_cfg("accelerator=cpu", *overrides))
    assert str(err.value) == line


def test_a_refused_compile_exits_2_with_its_line_and_writes_nothing(tmp_path, monkeypatch, capfd):
    """train.py's calls in this process."""
    code = train_py_here("compile=fast", f"hydra.run.dir={tmp_path / 'run'}", cwd=tmp_path, monkeypatch=monkeypatch)
    err = capfd.readouterr().err
    assert code == 2 and err.strip().startswith("error: compile='fast' is not offered"), err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("value,mode", [(False, None), (True, "default"), *((m, m) for m in MODES)])
def test_compile_takes_false_true_and_each_mode(value, mode):
    assert compile_mode({"compile": value}) == mode
    check_config(compose_cfg("accelerator=cpu", f"compile={str(value).lower() if isinstance(value, bool) else value}"))


@pytest.mark.slow
def test_each_job_of_a_sweep_compiles_afresh(tmp_path):
    """A sweep's jobs share one process: each drops the earlier jobs' compiled graphs, which would otherwise count
    towards torch's recompile limit (a model of another size is 3-4 graphs more: without the drop, this sweep
    passes the limit of 8 and its last job runs eager)."""
    args = [*BASE, "compile=true", "model.hidden=[8],[12],[16]", f"hydra.sweep.dir={tmp_path}"]
    proc = run_train("-m", *args, cwd=tmp_path, check=True)
    assert "recompile_limit" not in proc.stderr
    for job in range(3):
        assert "forward is compiled by torch.compile" in (tmp_path / str(job) / "train.log").read_text()
