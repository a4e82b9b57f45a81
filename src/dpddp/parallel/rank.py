"""Entry of a launched DDP rank: ``python -m dpddp.parallel.rank`` (exec'd), or ``run_rank`` in a forked one.

The rank rebuilds its run from the ``RankJob`` in ``$DPDDP_JOB`` (no Hydra, no ``sys.argv``), with rank 0's
working directory and import path, logs to stderr with a ``[rank N]`` prefix and to ``<run dir>/rank<N>.log``,
and exits through the shell (``dpddp.errors.shell``, its ``rank_status``): 0, 2 (bad setting), 1 (crash) or 143
(SIGTERM).
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from dpddp.errors import log_to, shell
from dpddp.parallel.launcher import RankJob
from dpddp.parallel.rules import world_of

__all__ = ["global_rank", "main", "run_rank"]


def global_rank(config: Mapping[str, Any]) -> int:
    """This launched rank's global rank: ``NODE_RANK`` x processes per node (``devices``; the visible GPUs for
    ``devices=-1``) + ``LOCAL_RANK``."""
    return world_of(config).global_rank


def run_rank(job: RankJob) -> int:
    """Run this rank's share of ``job`` in the rank's shell; return 0, or raise ``SystemExit`` with the failure's
    exit status (its line in the rank's log). ``LOCAL_RANK`` and ``NODE_RANK`` come from the environment."""
    rank = global_rank(job.config)
    log_to(Path(job.output_dir) / f"rank{rank}.log", f"[rank {rank}] %(asctime)s %(name)s %(levelname)s: %(message)s")
    with shell(rank=logging.getLogger(__name__)):
        job.entry_function()(job)
    return 0


def main() -> int:
    """``python -m dpddp.parallel.rank``: run the rank whose job is in ``$DPDDP_JOB``; return the exit status."""
    job = RankJob.from_env()
    del os.environ[RankJob.ENV]
    os.chdir(job.cwd)
    return run_rank(job)


if __name__ == "__main__":
    sys.exit(main())
