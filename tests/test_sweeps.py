"""Hydra multirun sweeps whose jobs launch DDP ranks: summary, failures, resume, joblib, how it was started."""

import csv
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
from conftest import QUIET, ROOT, child_env, leftover, made_once, max_diff, metrics, run_train, train_py_here, weights

pytestmark = pytest.mark.slow
SMALL = ["accelerator=cpu", "data.num_samples=606", "trainer.max_epochs=1"]


def test_mixed_strategies_with_a_failing_job_then_resume(tmp_path):
    """Started as ``python -m train`` from the project root (job 3's ranks do not depend on how the script was
    started), resumed as ``python train.py``."""
    sweep = tmp_path / "sweep"
    args = ["-m", "strategy=auto,ddp", "devices=1,2", *SMALL, f"hydra.sweep.dir={sweep}"]
    env, tag = child_env()
    proc = subprocess.run(
        [sys.executable, "-m", "train", *args, *QUIET], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 1  # job 1 (auto on 2 devices) failed; the others ran
    assert "error: 1 of 4 jobs failed: job 1" in proc.stderr
    assert leftover(tag) == []
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
    assert metrics(sweep / "3")["val/loss"] == pytest.approx(metrics(sweep / "2")["val/loss"])  # its ranks: one job
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


def test_optuna_search_records_a_failed_trial_and_goes_on(tmp_path, monkeypatch, capfd):
    """A failed job must not end a whole search: a refused trial (it returns nan) is a FAILED trial, the others run, the
    summary is written; the search's best value is the least val/loss of its trials. One-process jobs: train.py's
    calls in this process."""
    optuna = pytest.importorskip("optuna")
    args = ["hparams_search=optuna", "hydra.sweeper.n_trials=3", "model.lr=choice(0.1,-1.0)", "trainer.max_steps=10"]
    args += ["hydra.sweeper.sampler.seed=14", *SMALL[:2]]
    # seed 14: trial 0 gets lr=-1.0, 1 and 2 get 0.1
    code = train_py_here(*args, "hydra.sweep.dir=opt", cwd=tmp_path, monkeypatch=monkeypatch)
    err = capfd.readouterr().err
    assert code == 1, err[-3000:]
    assert "error: 1 of 3 jobs failed: job 0" in err and "Traceback" not in err
    assert (tmp_path / "opt/0/error.txt").read_text().startswith("model.lr=-1.0")
    rows = list(csv.DictReader(open(tmp_path / "opt/summary.csv")))
    assert [r["status"][:7] for r in rows] == ["failed:", "ok", "ok"]
    study = optuna.load_study(study_name="dpddp", storage=f"sqlite:///{tmp_path / 'opt/optuna.db'}")
    assert [t.state.name for t in study.trials] == ["FAIL", "COMPLETE", "COMPLETE"]  # told Optuna: FAIL
    best = min(metrics(tmp_path / "opt" / j)["val/loss"] for j in "12")
    assert f"best_value: {best}" in (tmp_path / "opt/optimization_results.yaml").read_text()


def _sweep_watched(args: list[str], cwd: Path, env: dict[str, str]) -> tuple[subprocess.Popen, list[psutil.Process]]:
    """Run ``train.py ARGS`` while collecting every process of its tree as it grows (psutil); return the ended
    Popen (its output in ``.out``, ``.err``) and the processes seen."""
    with open(cwd / "stdout.txt", "w+") as out, open(cwd / "stderr.txt", "w+") as err:
        proc = subprocess.Popen(
            [sys.executable, str(ROOT / "train.py"), *args], cwd=cwd, env=env, stdout=out, stderr=err
        )
        seen: dict[int, psutil.Process] = {}
        deadline = time.monotonic() + 600
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                children = psutil.Process(proc.pid).children(recursive=True)
            except psutil.Error:
                children = []
            for child in children:
                try:
                    if child.pid not in seen:
                        child.seen_cmdline = " ".join(child.cmdline())  # type: ignore[attr-defined]
                        seen[child.pid] = child
                except psutil.Error:
                    continue
            time.sleep(0.5)  # a worker or rank lives for seconds at least: its imports
        proc.kill()
        proc.wait()
        out.seek(0)
        err.seek(0)
        proc.out, proc.err = out.read(), err.read()  # type: ignore[attr-defined]
    return proc, list(seen.values())


def _left(seen: list[psutil.Process], tmp_path, tag: str, wait_s: float = 10.0) -> list[str]:
    """The sweep's processes still alive after ``wait_s`` seconds: any seen in its tree, any with its tag, any
    whose command line or working directory is the test's directory."""
    deadline = time.monotonic() + wait_s
    while True:
        left = {p.pid: p for p in seen if _alive(p)}
        for p in psutil.process_iter():
            try:
                mine = str(tmp_path) in " ".join(p.cmdline()) or p.cwd() == str(tmp_path)
                if (mine or p.environ().get("DPDDP_TEST_TAG") == tag) and _alive(p):
                    left[p.pid] = p
            except (psutil.Error, OSError):
                continue
        if not left or time.monotonic() > deadline:
            return [f"{p.pid} {' '.join(p.cmdline())[:120]}" for p in left.values() if _alive(p)]
        time.sleep(0.2)


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


@pytest.mark.parametrize(
    "launcher",
    [["hydra/launcher=joblib", "hydra.launcher.n_jobs=2"], ["hydra/launcher=submitit_local"], []],
    ids=["joblib", "submitit_local", "basic"],
)
def test_sigterm_to_a_sweep_stops_its_jobs_with_a_checkpoint_and_the_sweep_resumes_exactly(
    tmp_path, launcher, shared_dir, monkeypatch
):
    """A SIGTERM must reach the processes a launcher plugin started: two identical DDP jobs, in parallel (one after the
    other under the basic launcher); job 1, before its first batch and once job 0 has finished, SIGTERMs the sweep's
    process. Job 1's ranks stop after that batch with ``last.ckpt``, the summary is written, one line says how to
    resume, exit 143, no worker, rank, tracker or controller is left. Job 0 (its ranks started from a launcher's
    worker, in parallel with job 1 under joblib) ends at one device's weights. The printed command skips job 0 and
    continues job 1 to job 0's weights."""
    env, tag = child_env(PYTHONPATH=os.pathsep.join([str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]))
    stop = ["+callbacks.stop._target_=conftest.SigtermSweepAt", "+callbacks.stop.step=-1,0"]
    stop += ["+callbacks.stop.after=sweep/0/metrics.json"]
    args = ["-m", *launcher, "strategy=ddp", "devices=2", *SMALL[:1], "data.num_samples=2048", "logger=none"]
    args += ["trainer.max_epochs=2", *stop, *QUIET, "hydra.sweep.dir=sweep"]
    proc, seen = _sweep_watched(args, tmp_path, env)
    assert proc.returncode == 143, proc.err[-3000:]
    assert _left(seen, tmp_path, tag) == []
    if launcher:
        assert any("popen_loky" in p.seen_cmdline or "submitit" in p.seen_cmdline for p in seen)  # the workers
    lines = [x for x in proc.err.splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and "stopped by SIGTERM (1 of 2 jobs finished; stopped with a checkpoint: job 1)" in lines[0]
    sweep = tmp_path / "sweep"
    rows = list(csv.DictReader(open(sweep / "summary.csv")))
    assert [r["status"].split(":")[0] for r in rows] == ["ok", "incomplete"]
    assert metrics(sweep / "0")["world_size"] == 2  # a ddp job under each launcher
    one = made_once(shared_dir, "sweep-one-device", lambda path: _one_device(path, monkeypatch))
    assert max_diff(weights(sweep / "0/checkpoints/last.ckpt"), weights(one / "checkpoints/last.ckpt")) <= 1e-5
    steps = _step(sweep / "0/checkpoints/last.ckpt")  # 2 epochs of 25
    # at a check after the SIGTERM, mid-fit: the first batch's on an idle machine, the next (ranks agree about once
    # a second) when the stop reaches a rank after it; the resume below equals job 0 either way
    assert 1 <= _step(sweep / "1/checkpoints/last.ckpt") < steps
    assert not (sweep / "1/metrics.json").exists() and not (sweep / ".stop").exists()

    command = shlex.split(lines[0].split("resume with ", 1)[1])
    assert command[:2] == ["python", str(ROOT / "train.py")] and "hydra.sweep.dir=" + str(sweep) in command
    stamp = (sweep / "0/metrics.json").stat().st_mtime_ns
    again, seen = _sweep_watched(command[2:], tmp_path, env)
    assert again.returncode == 0, again.err[-3000:]
    assert (sweep / "0/metrics.json").stat().st_mtime_ns == stamp  # finished: not run again
    assert "resuming interrupted job from" in (sweep / "1/train.log").read_text()
    assert _step(sweep / "1/checkpoints/last.ckpt") == steps
    assert max_diff(weights(sweep / "1/checkpoints/last.ckpt"), weights(sweep / "0/checkpoints/last.ckpt")) <= 1e-6
    assert [r["status"] for r in csv.DictReader(open(sweep / "summary.csv"))] == ["ok", "ok"]
    assert _left(seen, tmp_path, tag) == []


def _one_device(run_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The sweep's job as one process on one device, into ``run_dir``: train.py's calls in this process."""
    args = [*SMALL[:1], "data.num_samples=2048", "logger=none", "trainer.max_epochs=2", f"hydra.run.dir={run_dir}"]
    assert train_py_here(*args, cwd=run_dir.parent, monkeypatch=monkeypatch) == 0


def _step(ckpt: Path) -> int:
    return torch.load(ckpt, map_location="cpu", weights_only=True)["global_step"]
