"""Entry of a launched DDP rank: ``python -m dpddp.parallel.rank`` (its ``RankJob`` in ``$DPDDP_JOB``), or forked."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from dpddp.errors import log_to, shell
from dpddp.parallel.launcher import RankJob
from dpddp.parallel.rules import world_of


def run_rank(job: RankJob) -> int:
    """Run this rank's share of ``job``, logging to ``<run dir>/rank<N>.log``; return 0, or raise ``SystemExit`` with
    the failure's exit status (``dpddp.errors.shell``)."""
    rank = world_of(job.config).global_rank
    log_to(Path(job.output_dir) / f"rank{rank}.log", f"[rank {rank}] %(asctime)s %(name)s %(levelname)s: %(message)s")
    with shell(rank=logging.getLogger(__name__)):
        job.entry_function()(job)
    return 0


def main() -> int:
    """Run the rank whose job is in ``$DPDDP_JOB``; return the exit status."""
    job = RankJob.from_env()
    os.chdir(job.cwd)
    return run_rank(job)


if __name__ == "__main__":
    sys.exit(main())
