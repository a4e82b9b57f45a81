"""Shared helpers: compose configs in-process, run train.py in subprocesses, find leftover processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import psutil
import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

# One intra-op thread per test process: pytest-xdist runs one worker per core, and two busy multi-threaded
# torch processes on shared cores slow each other down many times over.
torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"
# Rank and rendezvous variables a test must never inherit (they make Lightning think a cluster launched it).
RANK_VARS = ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT", "PL_GLOBAL_SEED")
QUIET = ["trainer.enable_progress_bar=false"]


def compose_cfg(*overrides: str) -> DictConfig:
    """The config ``train.py`` would get for these overrides (Hydra's compose API)."""
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


@pytest.fixture(autouse=True)
def _restore_env():
    saved = dict(os.environ)
    threads = torch.get_num_threads()
    yield
    os.environ.clear()
    os.environ.update(saved)
    torch.set_num_threads(threads)


def run_train(*args: str, cwd: Path, timeout: float = 240, env: dict | None = None, module: bool = False):
    """Run ``train.py`` with one intra-op thread per process; return the CompletedProcess (``.tag`` marks its
    process tree for ``leftover``)."""
    tag = uuid.uuid4().hex
    full_env = {k: v for k, v in os.environ.items() if k not in RANK_VARS}
    full_env.update(OMP_NUM_THREADS="1", DPDDP_TEST_TAG=tag, **(env or {}))
    cmd = [sys.executable, str(ROOT / "train.py"), *args, *QUIET]
    proc = subprocess.run(cmd, cwd=cwd, env=full_env, capture_output=True, text=True, timeout=timeout)
    proc.tag = tag
    return proc


def leftover(tag: str) -> list[int]:
    """PIDs of live processes started under ``tag`` (children inherit the environment)."""
    pids = []
    for p in psutil.process_iter(["pid"]):
        try:
            if p.environ().get("DPDDP_TEST_TAG") == tag and p.status() != psutil.STATUS_ZOMBIE:
                pids.append(p.pid)
        except (psutil.Error, OSError):
            continue
    return pids


def metrics(run_dir: Path) -> dict:
    return json.loads((run_dir / "metrics.json").read_text())


def weights(ckpt: Path) -> dict[str, torch.Tensor]:
    state = torch.load(ckpt, map_location="cpu", weights_only=True)["state_dict"]
    return {k: v for k, v in state.items() if k.startswith("linear.")}


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)
