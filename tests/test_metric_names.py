"""The metric contract adapts to a model's own metric names: the best checkpoint and a sweep's objective follow
``callbacks.model_checkpoint.monitor`` (or ``objective``), and a monitored name the model never logs is one line at
the end of the first validation, not Lightning's traceback."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import torch
from conftest import metrics, run_project
from omegaconf import OmegaConf
from test_bring_your_own import MINE, USER_ARGS, _project

pytestmark = pytest.mark.slow

# The template model of docs/your-model-and-data.md, logging Lightning's usual names (train_loss, val_loss, ...).
NAMES = MINE.replace('"train/loss"', '"train_loss"').replace('f"{stage}/loss"', 'f"{stage}_loss"')
NAMES = NAMES.replace('f"{stage}/acc"', 'f"{stage}_acc"')
BY_NAME = ["callbacks.model_checkpoint.monitor=val_loss", "trainer.max_epochs=3"]


def _names_project(tmp_path: Path) -> Path:
    project = _project(tmp_path)
    assert NAMES != MINE and '"val_loss"' not in NAMES  # the names come from f-strings
    (project / "mine.py").write_text(NAMES)
    return project


def test_a_model_logging_its_own_names_checkpoints_by_the_monitor_it_is_given(tmp_path):
    project = _names_project(tmp_path)
    proc = run_project(project, *USER_ARGS, *BY_NAME, "logger=csv", "hydra.run.dir=run")
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = project / "run"
    with open(run / "csv/version_0/metrics.csv") as f:
        val_loss = [float(r["val_loss"]) for r in csv.DictReader(f) if r.get("val_loss")]
    assert len(val_loss) == 3
    state = torch.load(run / "checkpoints/last.ckpt", weights_only=False)["callbacks"]
    (best,) = [v for k, v in state.items() if "'monitor': 'val_loss'" in k]
    assert best["best_model_score"].item() == pytest.approx(min(val_loss), abs=1e-6)  # the best epoch by val_loss
    assert Path(best["best_model_path"]) == run / "checkpoints/best.ckpt" and Path(best["best_model_path"]).is_file()
    written = metrics(run)
    assert written["objective"] == "val_loss" and written["val_loss"] == pytest.approx(val_loss[-1], abs=1e-6)


def test_a_sweep_optimises_the_monitor_a_model_logs(tmp_path):
    """Optuna minimises val_loss (the checkpoint's monitor); the summary shows it for each trial."""
    project = _names_project(tmp_path)
    search = ["hparams_search=optuna", "hydra.sweeper.n_trials=2", "hydra.sweep.dir=opt"]
    proc = run_project(project, *USER_ARGS, *BY_NAME[:1], "trainer.max_epochs=1", *search)
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = [json.loads((project / f"opt/{j}/metrics.json").read_text()) for j in (0, 1)]
    assert all(j["objective"] == "val_loss" and j["val/loss"] is None for j in jobs)  # logged under its own name
    best = OmegaConf.load(project / "opt/optimization_results.yaml").best_value
    assert best == pytest.approx(min(j["val_loss"] for j in jobs), abs=1e-9)
    with open(project / "opt/summary.csv") as f:
        rows = list(csv.DictReader(f))
    assert [float(r["val_loss"]) for r in rows] == pytest.approx([j["val_loss"] for j in jobs], abs=1e-6)


def test_a_monitored_name_the_model_does_not_log_is_one_line_without_a_traceback(tmp_path):
    project = _names_project(tmp_path)
    proc = run_project(project, *USER_ARGS, "trainer.max_epochs=3", "hydra.run.dir=run")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "MisconfigurationException" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: callbacks.model_checkpoint.monitor=val/loss: the model logs no val/loss (it logs val_acc, "
        "val_loss): set callbacks.model_checkpoint.monitor=val_loss, or log val/loss"
    )
    assert not (project / "run/metrics.json").exists()  # refused at the first validation: nothing reported
