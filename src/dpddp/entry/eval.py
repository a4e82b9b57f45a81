"""The evaluation entry point (``eval.py``, ``dpddp-eval``): ``python eval.py ckpt_path=<checkpoint> [key=value ...]``
validates and tests the checkpoint's weights, exactly (every sample once) on any world size, without training,
and writes ``metrics.json`` (``val/*``, ``test/*``) into a run directory of its own; ``predict=true`` adds
``predictions.csv``. The config is ``train.py``'s: give the model and data settings the checkpoint was trained
with. A checkpoint of another model, or one that cannot be read, is one line, exit 2, before anything starts."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from dpddp._compat.hydra_main import hydra_reported
from dpddp.entry.command_line import HYDRA_FAILURES, hydra_failure, unknown_option, unreadable_override
from dpddp.entry.hydra import StartChecks, job_plan
from dpddp.errors import fail, shell
from dpddp.run.training import isolated_job, objective, train

__all__ = ["EvalChecks", "main", "run_eval"]

log = logging.getLogger(__name__)
USAGE = "python eval.py ckpt_path=<a run's checkpoints/last.ckpt> [key=value ...]"


class EvalChecks(StartChecks):
    """``StartChecks`` for an evaluation: the config and the checkpoint are checked for ``eval``, not a fit."""

    stage = "eval"


def run_eval(cfg: DictConfig) -> float:
    """Hydra's task: evaluate ``cfg.ckpt_path`` into the run directory; return the objective (``val/loss``)."""
    output_dir = Path(HydraConfig.get().runtime.output_dir)
    overrides = OmegaConf.to_container(HydraConfig.get().overrides.task)
    with shell(log=log), isolated_job():
        plan = job_plan(cfg, "eval")
        assert not isinstance(plan, str)  # an evaluation continues no run
        return train(cfg, output_dir, stage="eval", extra={"overrides": overrides}, plan=plan)[objective(cfg)]


_hydra_main = hydra.main(version_base="1.3", config_path="pkg://dpddp.conf", config_name="config")(run_eval)


def main() -> None:
    """``python eval.py ckpt_path=... [key=value ...]`` or ``dpddp-eval ...``; ``--help``: this and Hydra's help.
    A missing ``ckpt_path``, a sweep (``-m``), an unknown override or config option: one line, exit 2."""
    argv = sys.argv[1:]
    if any(a in ("-h", "--help") for a in argv):
        print(f"usage: {USAGE}\n\n{__doc__}")
        sys.exit(0)
    with shell():
        if not any(a.startswith("ckpt_path=") and a != "ckpt_path=null" for a in argv):
            fail(f"ckpt_path is missing: {USAGE}")
        if any(a in ("-m", "--multirun") for a in argv):
            fail("eval.py evaluates one checkpoint: drop -m (sweep the trainings with train.py -m)")
        if problem := unreadable_override(argv) or unknown_option(argv):
            fail(problem)
        sys.argv.append(f"hydra.callbacks.start_checks._target_={EvalChecks.__module__}.{EvalChecks.__name__}")
        with hydra_reported(lambda err: fail(hydra_failure(err, argv)), HYDRA_FAILURES):
            _hydra_main()
