"""Entry point of a DDP rank started by ``dpddp.strategies.DDPStrategy``: ``python -m dpddp.launch``.

It rebuilds the job from the resolved config in ``$DPDDP_JOB`` (no Hydra, no ``sys.argv``), logs to stderr
with a ``[rank N]`` prefix and to ``<run dir>/rank<N>.log``, and exits 0, 2 (bad setting), 1 (crash) or 143
(stopped by SIGTERM). A rank forked by the launcher (CPU) runs ``run_rank`` directly.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
from pathlib import Path

from omegaconf import OmegaConf

from dpddp.callbacks import Preempted
from dpddp.config import ConfigError
from dpddp.strategies import JOB_ENV
from dpddp.training import train


def run_rank(job: dict) -> int:
    """Run this rank's share of ``job`` (``{"config": <resolved config dict>, "output_dir": str}``); return the
    process exit status. ``LOCAL_RANK`` (and ``NODE_RANK``) come from the environment."""
    cfg = OmegaConf.create(job["config"])
    rank = int(os.environ.get("NODE_RANK", 0)) * cfg.devices + int(os.environ["LOCAL_RANK"])
    fmt = logging.Formatter(f"[rank {rank}] %(asctime)s %(name)s %(levelname)s: %(message)s")
    handlers = [logging.StreamHandler(sys.stderr), logging.FileHandler(Path(job["output_dir"]) / f"rank{rank}.log")]
    for handler in handlers:
        handler.setFormatter(fmt)
    logging.basicConfig(level=logging.INFO, handlers=handlers, force=True)  # force: a forked rank had rank 0's
    log = logging.getLogger("dpddp.launch")
    try:
        train(cfg, job["output_dir"])
    except ConfigError as err:
        log.error(f"error: {err}")
        return 2
    except Preempted as err:
        log.error(str(err))
        return 128 + signal.SIGTERM
    except Exception:
        log.exception("rank failed")
        return 1
    return 0


def main() -> int:
    """``python -m dpddp.launch``: run the rank whose job is in ``$DPDDP_JOB``; return the exit status."""
    return run_rank(json.loads(os.environ.pop(JOB_ENV)))


if __name__ == "__main__":
    sys.exit(main())
