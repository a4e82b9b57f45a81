"""The Hydra task: one run, or one job of a sweep, isolated from the jobs around it."""

from __future__ import annotations

import json
import logging
import math
import shlex
import signal
import sys
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.utils import to_absolute_path
from omegaconf import DictConfig, OmegaConf, open_dict

from dpddp.callbacks import Preempted
from dpddp.config import ConfigError
from dpddp.strategies import RankFailed
from dpddp.training import METRIC_KEYS, isolated_job, train

__all__ = ["run"]

log = logging.getLogger(__name__)


def completed_metrics(output_dir: Path) -> dict | None:
    """The job's ``metrics.json`` if it holds every metric key, else ``None``."""
    path = output_dir / "metrics.json"
    try:
        metrics = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return metrics if all(k in metrics for k in METRIC_KEYS) else None


def _resume_command(overrides: list[str], output_dir: Path, multirun: bool) -> str:
    """The command that continues a preempted run: the same overrides in the same run directory; for a sweep,
    the sweep's own command line with its ``hydra.sweep.dir`` (complete jobs are skipped, this one resumes)."""
    if multirun:
        argv = [a for a in sys.argv[1:] if not a.startswith("hydra.sweep.dir=")]
        return shlex.join(["python", "train.py", *argv, f"hydra.sweep.dir={output_dir.parent}"])
    kept = [o for o in overrides if not o.startswith(("resume=", "hydra.run.dir="))]
    return shlex.join(["python", "train.py", *kept, "resume=true", f"hydra.run.dir={output_dir}"])


def run(cfg: DictConfig) -> float:
    """Run the composed ``cfg`` in Hydra's output directory; return ``val/loss`` for sweepers.

    A relative ``ckpt_path`` is taken relative to where the command was run (even with
    ``hydra.job.chdir=true``). In a multirun, a job whose ``metrics.json`` is complete for the same overrides
    is skipped, an interrupted one resumes from its ``checkpoints/last.ckpt``, and a failing job is recorded in
    its ``error.txt`` and returns ``nan`` so the sweep goes on (the summary callback exits non-zero at the end).
    ``resume=true`` does the same for a single run in an existing ``hydra.run.dir``. (A complete job run again
    with other overrides, e.g. more epochs, resumes from its ``last.ckpt``.) Outside a multirun a bad
    setting prints one ``error:`` line and exits with status 2.
    """
    hydra_cfg = HydraConfig.get()
    output_dir = Path(hydra_cfg.runtime.output_dir)
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    overrides = list(hydra_cfg.overrides.task)
    with open_dict(cfg):
        if cfg.get("ckpt_path"):
            cfg.ckpt_path = to_absolute_path(str(cfg.ckpt_path))
        resume = multirun or cfg.get("resume")
        done = completed_metrics(output_dir) if resume else None
        if done is not None and done.get("overrides") == overrides:
            log.info(f"already complete with the same overrides, skipping: {output_dir / 'metrics.json'}")
            return done["val/loss"]
        last = output_dir / "checkpoints" / "last.ckpt"
        if resume and cfg.get("ckpt_path") is None:
            if last.is_file():
                log.info(f"resuming interrupted job from {last}")
                cfg.ckpt_path = str(last)
            elif cfg.get("resume"):
                log.info(f"resume=true but there is no {last}: starting fresh")
    job = {"config": OmegaConf.to_container(cfg, resolve=True), "output_dir": str(output_dir)}
    try:
        with isolated_job():
            return train(cfg, output_dir, job, extra={"overrides": overrides})["val/loss"]
    except ConfigError as err:
        if not multirun:
            print(f"error: {err}", file=sys.stderr)
            sys.exit(2)
        line = str(err)
    except RankFailed as err:
        if not multirun:
            log.error(f"error: {err}")
            sys.exit(1)
        line = str(err)
    except Preempted as err:
        print(f"error: {err}: resume with {_resume_command(overrides, output_dir, multirun)}", file=sys.stderr)
        sys.exit(128 + signal.SIGTERM)
    except Exception as err:
        if not multirun:
            raise
        log.exception("job failed")
        line = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    print(f"job {hydra_cfg.job.num} failed: {line}", file=sys.stderr)
    (output_dir / "error.txt").write_text(line + "\n")
    return math.nan
