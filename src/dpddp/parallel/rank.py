"""Entry of a launched DDP rank: ``python -m dpddp.parallel.rank`` (exec'd), or ``run_rank`` in a forked one.

The rank rebuilds its run from the ``RankJob`` in ``$DPDDP_JOB`` (no Hydra, no ``sys.argv``), with rank 0's
working directory and import path, logs to stderr with a ``[rank N]`` prefix and to ``<run dir>/rank<N>.log``,
and exits with the status ``dpddp.errors.exit_status`` gives: 0, 2 (bad setting), 1 (crash) or 143 (SIGTERM).
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from dpddp.errors import ConfigError, Preempted, exit_status
from dpddp.parallel.launcher import RankJob

__all__ = ["main", "run_rank"]


def run_rank(job: RankJob) -> int:
    """Run this rank's share of ``job``; return the process exit status. ``LOCAL_RANK`` and ``NODE_RANK`` come
    from the environment."""
    rank = int(os.environ.get("NODE_RANK", 0)) * int(job.config["devices"]) + int(os.environ["LOCAL_RANK"])
    fmt = logging.Formatter(f"[rank {rank}] %(asctime)s %(name)s %(levelname)s: %(message)s")
    handlers: list[logging.Handler] = [logging.StreamHandler(sys.stderr)]
    handlers.append(logging.FileHandler(Path(job.output_dir) / f"rank{rank}.log"))
    for handler in handlers:
        handler.setFormatter(fmt)
    logging.basicConfig(level=logging.INFO, handlers=handlers, force=True)  # force: a forked rank had rank 0's
    log = logging.getLogger(__name__)
    try:
        job.entry_function()(job)
    except (ConfigError, Preempted) as err:
        log.error(f"error: {err}" if isinstance(err, ConfigError) else str(err))
        return exit_status(err)
    except Exception as err:
        log.exception("rank failed")
        return exit_status(err)
    return 0


def main() -> int:
    """``python -m dpddp.parallel.rank``: run the rank whose job is in ``$DPDDP_JOB``; return the exit status."""
    job = RankJob.from_env()
    del os.environ[RankJob.ENV]
    os.chdir(job.cwd)
    return run_rank(job)


if __name__ == "__main__":
    sys.exit(main())
