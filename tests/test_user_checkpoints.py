"""A user's own ModelCheckpoint lives beside the built-in ones: the same monitor as best.ckpt's does not collide,
one without a dirpath writes into the run's checkpoints/ (not the logger's version_N/), and its top-k is kept
across a SIGTERM and a resume, on 1 and 2 processes."""

from __future__ import annotations

import csv
import os
from pathlib import Path

import pytest
import torch
from conftest import ROOT, leftover, run_train, train_py_here

pytestmark = pytest.mark.slow

MC = "lightning.pytorch.callbacks.ModelCheckpoint"


def _epochs(run: Path, key: str) -> dict[int, float]:
    with open(run / "metrics.csv") as f:
        return {int(r["epoch"]): float(r[key]) for r in csv.DictReader(f) if r["stage"] == "fit"}


def _kept(run: Path, marker: str) -> dict[str, float]:
    """The top-k (file -> score) in ``last.ckpt`` of the one checkpoint callback whose state key has ``marker``."""
    state = torch.load(run / "checkpoints/last.ckpt", weights_only=False)["callbacks"]
    (mine,) = [v for k, v in state.items() if marker in k]
    return {Path(p).name: float(v) for p, v in mine["best_k_models"].items()}


def _ok(proc) -> None:
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert leftover(proc.tag) == []


def test_a_top3_checkpoint_on_the_built_in_monitor_lives_beside_best_ckpt(tmp_path, monkeypatch):
    """train.py runs here: one process, no rank (the callback's files are the point, not the process)."""
    top3 = [f"+callbacks.top3._target_={MC}", "+callbacks.top3.monitor=val/loss", "+callbacks.top3.save_top_k=3"]
    args = ["model=mlp", "trainer.max_epochs=5", *top3, "hydra.run.dir=run"]
    assert train_py_here(*args, cwd=tmp_path, monkeypatch=monkeypatch) == 0
    run = tmp_path / "run"
    val = _epochs(run, "val/loss")
    kept = _kept(run, "[callbacks.top3]")  # its key: the built-in's (same monitor and mode) and its setting
    best3 = sorted(val, key=val.get)[:3]
    assert sorted(kept.values()) == pytest.approx(sorted(val[e] for e in best3), abs=1e-6)  # the 3 best epochs
    files = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert files == sorted(["best.ckpt", "last.ckpt", *kept])  # in the run's checkpoints/, beside the built-ins
    assert sorted(int(f.split("-")[0].removeprefix("epoch=")) for f in kept) == sorted(best3)  # last.ckpt is current


@pytest.mark.parametrize("devices", [1, 2])
def test_a_topk_checkpoint_without_dirpath_keeps_its_top_k_across_a_resume(tmp_path, monkeypatch, devices):
    """On 1 process train.py runs here (its stop and resume: exit statuses from its own handler, no rank); on 2,
    as processes (the ranks' stop)."""
    topk = [f"+callbacks.topk._target_={MC}", "+callbacks.topk.monitor=val/acc", "+callbacks.topk.mode=max"]
    topk += ["+callbacks.topk.save_top_k=2", "logger=csv", "trainer.max_epochs=5", "hydra.run.dir=run"]
    ddp = ["strategy=ddp", f"devices={devices}"] if devices > 1 else []
    kill = ["+callbacks.kill._target_=conftest.SigtermAt", "+callbacks.kill.at=120"]  # in epoch 2 (51 steps each)
    env = {"PYTHONPATH": os.pathsep.join([str(ROOT / "tests")])}
    if devices == 1:
        assert train_py_here(*topk, *kill, cwd=tmp_path, monkeypatch=monkeypatch) == 143
        assert train_py_here(*topk, "resume=true", cwd=tmp_path, monkeypatch=monkeypatch) == 0
    else:
        stopped = run_train(*topk, *ddp, *kill, cwd=tmp_path, env=env)
        assert stopped.returncode == 143, stopped.stderr[-3000:]
        _ok(run_train(*topk, *ddp, "resume=true", cwd=tmp_path))
    run = tmp_path / "run"
    acc = _epochs(run, "val/acc")
    assert sorted(acc) == [0, 1, 2, 3, 4]
    kept = _kept(run, "'monitor': 'val/acc'")
    assert len(kept) == 2 and sorted(kept.values()) == pytest.approx(sorted(acc.values())[-2:], abs=1e-6)
    mine = sorted(p.name for p in (run / "checkpoints").iterdir() if p.name not in ("best.ckpt", "last.ckpt"))
    assert mine == sorted(kept)  # only its top-2 over the whole run, in the run's checkpoints/
    best2 = sorted(acc, key=acc.get)[-2:]
    assert sorted(int(f.split("-")[0].removeprefix("epoch=")) for f in mine) == sorted(best2)
    assert not list(run.glob("csv/**/*.ckpt"))  # nothing in the logger's version directories
