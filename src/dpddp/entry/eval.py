"""Validate and test a run's full checkpoint exactly on any world size, train nothing, and write ``metrics.json``
(``predict=true``: ``predictions.csv``). The config is ``train.py``'s. A checkpoint of another model, a weights-only
or an unreadable one is one line, exit 2, before anything starts."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from dpddp._compat import hydra_override_refused, hydra_reported
from dpddp.entry.command_line import (
    HYDRA_FAILURES,
    hydra_failure,
    refused_override,
    unknown_option,
    unreadable_override,
)
from dpddp.entry.hydra import job_plan
from dpddp.errors import fail, shell
from dpddp.run.training import isolated_job, objective, train

log = logging.getLogger(__name__)
USAGE = "python eval.py ckpt_path=<a run's checkpoints/last.ckpt> [key=value ...]"


def run_eval(cfg: DictConfig) -> float:
    """Hydra's task: evaluate ``cfg.ckpt_path`` into the run directory; return the objective."""
    output_dir = Path(HydraConfig.get().runtime.output_dir)
    overrides = OmegaConf.to_container(HydraConfig.get().overrides.task)
    with shell(log=log), isolated_job():
        plan = job_plan(cfg, "eval")
        assert not isinstance(plan, str)  # an evaluation continues no run
        return train(cfg, output_dir, stage="eval", extra={"overrides": overrides}, plan=plan)[objective(cfg)]


def main() -> None:
    """``eval.py``/``dpddp-eval``. A missing ``ckpt_path``, ``-m``, an unknown override or option: one line, exit 2."""
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
        sys.argv.append("+hydra.callbacks.start_checks.stage=eval")
        refused = hydra_override_refused(lambda o, c, e: fail(refused_override(o, c, e)))
        with refused, hydra_reported(lambda err: fail(hydra_failure(err, argv)), HYDRA_FAILURES):
            hydra.main(version_base="1.3", config_path="pkg://dpddp.conf", config_name="config")(run_eval)()
