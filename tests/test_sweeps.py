"""Hydra multirun sweeps whose jobs launch DDP ranks: summary, failures, resume, joblib, how it was started."""

import csv
import subprocess
import sys

import pytest
from conftest import QUIET, ROOT, child_env, leftover, metrics, run_train

pytestmark = pytest.mark.slow
SMALL = ["accelerator=cpu", "data.num_samples=606", "trainer.max_epochs=1"]


def test_mixed_strategies_with_a_failing_job_then_resume(tmp_path):
    args = ["-m", "strategy=auto,ddp", "devices=1,2", *SMALL, "hydra.sweep.dir=sweep"]
    proc = run_train(*args, cwd=tmp_path)
    assert proc.returncode == 1  # job 1 (auto on 2 devices) failed; the others ran
    assert "error: 1 of 4 jobs failed: 1" in proc.stderr
    assert leftover(proc.tag) == []
    sweep = tmp_path / "sweep"
    with open(sweep / "summary.csv") as f:
        rows = list(csv.DictReader(f))
    assert [r["job"] for r in rows] == ["0", "1", "2", "3"]
    assert rows[1]["status"].startswith("failed: strategy=auto runs on one device")
    assert (sweep / "1" / "error.txt").is_file() and not (sweep / "1" / "metrics.json").exists()
    for row in (rows[0], rows[2], rows[3]):
        job = metrics(sweep / row["job"])
        assert row["status"] == "ok"
        assert int(row["world_size"]) == job["world_size"]
        for key in ("val/loss", "val/acc", "test/acc", "samples_per_sec", "wall_time_s"):
            assert float(row[key]) == pytest.approx(job[key], rel=1e-9), key
    assert [metrics(sweep / j)["world_size"] for j in "023"] == [1, 1, 2]
    assert "| 3 | strategy=ddp devices=2" in (sweep / "summary.md").read_text()

    # Resume: complete jobs are skipped, an interrupted one (no metrics.json, a last.ckpt) resumes.
    stamp = (sweep / "2" / "metrics.json").stat().st_mtime_ns
    (sweep / "3" / "metrics.json").unlink()
    again = run_train(*args, cwd=tmp_path)
    assert again.returncode == 1
    assert (sweep / "2" / "metrics.json").stat().st_mtime_ns == stamp
    assert "resuming interrupted job from" in (sweep / "3" / "train.log").read_text()
    assert metrics(sweep / "3")["world_size"] == 2
    assert len(list(csv.DictReader(open(sweep / "summary.csv")))) == 4


def test_joblib_launcher_runs_ddp_jobs_in_parallel(tmp_path):
    args = ["-m", "hydra/launcher=joblib", "strategy=ddp", "devices=2,1", *SMALL, "hydra.sweep.dir=sweep"]
    proc = run_train(*args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [metrics(tmp_path / "sweep" / j)["world_size"] for j in "01"] == [2, 1]
    assert metrics(tmp_path / "sweep/0")["val/loss"] == pytest.approx(metrics(tmp_path / "sweep/1")["val/loss"])
    assert leftover(proc.tag) == []


def test_sweep_started_as_a_module(tmp_path):
    """``python -m train`` from the project root: ranks do not depend on how the script was started."""
    env, _ = child_env()
    args = ["-m", "strategy=ddp", "devices=2", "seed=0,1", *SMALL, f"hydra.sweep.dir={tmp_path / 'sweep'}", *QUIET]
    proc = subprocess.run(
        [sys.executable, "-m", "train", *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [metrics(tmp_path / "sweep" / j)["world_size"] for j in "01"] == [2, 2]
    assert metrics(tmp_path / "sweep/0")["val/loss"] != metrics(tmp_path / "sweep/1")["val/loss"]


def test_optuna_search_minimises_val_loss(tmp_path):
    args = ["hparams_search=optuna", "hydra.sweeper.n_trials=3", *SMALL, "hydra.sweep.dir=opt"]
    proc = run_train(*args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = [metrics(tmp_path / "opt" / str(i))["val/loss"] for i in range(3)]
    best = (tmp_path / "opt" / "optimization_results.yaml").read_text()
    assert f"best_value: {min(losses)}" in best
    assert len(list(csv.DictReader(open(tmp_path / "opt" / "summary.csv")))) == 3


def test_submitit_local_launcher_runs_ddp_jobs(tmp_path):
    args = ["-m", "hydra/launcher=submitit_local", "strategy=ddp", "devices=2", *SMALL, "hydra.sweep.dir=sub"]
    proc = run_train(*args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert metrics(tmp_path / "sub" / "0")["world_size"] == 2
    assert leftover(proc.tag) == []


def test_optuna_search_records_a_failed_trial_and_goes_on(tmp_path):
    """Case 15: a refused trial (it returns nan) is a FAILED trial, the others run, the summary is written."""
    pytest.importorskip("optuna")
    args = ["hparams_search=optuna", "hydra.sweeper.n_trials=3", "model.lr=choice(0.1,-1.0)", "trainer.max_steps=10"]
    args += ["hydra.sweeper.sampler.seed=5", *SMALL[:2]]
    proc = run_train(*args, "hydra.sweep.dir=opt", cwd=tmp_path)  # seed 5: trial 0 gets lr=-1.0, 1 and 2 get 0.1
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "error: 1 of 3 jobs failed: 0" in proc.stderr and "Traceback" not in proc.stderr
    assert (tmp_path / "opt/0/error.txt").read_text().startswith("model.lr=-1.0")
    rows = list(csv.DictReader(open(tmp_path / "opt/summary.csv")))
    assert [r["status"][:7] for r in rows] == ["failed:", "ok", "ok"]
    assert "Failed experiment: job 0 returned nan (see its error.txt)" in proc.stdout  # told Optuna: FAIL
    best = min(metrics(tmp_path / "opt" / j)["val/loss"] for j in "12")
    assert f"best_value: {best}" in (tmp_path / "opt/optimization_results.yaml").read_text()
