"""dpddp: data-parallel training with Lightning and Hydra, from one CPU to many nodes.

Importing the package registers the ``dp`` strategy in Lightning's ``StrategyRegistry`` (``Trainer(strategy="dp")``
and ``--trainer.strategy=dp`` then work) and does nothing else (in dpddp's own commands, it holds SIGTERM first).
The layers, from the bottom up: ``errors``, ``_compat`` (Lightning's private names), ``cluster``, ``parallel``
(strategies, launcher, launched-rank entry), ``data`` and ``models`` (built-ins), ``run`` (config check, trainer
assembly, the one ``train`` function) and ``entry`` (Hydra and the Lightning CLI). Imports run one way, down.
"""

import signal
import sys
from pathlib import Path

if Path(sys.argv[0]).name in ("dpddp", "dpddp-train") or sys.orig_argv[1:3] == ["-m", "dpddp.cli"]:
    # dpddp's own commands (the console scripts, python -m dpddp.cli), as train.py: a SIGTERM from here on is held
    # until dpddp.continuity.stop.command takes it (the imports below take seconds).
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})

from dpddp.parallel.dp import DataParallelStrategy  # noqa: E402

__all__ = ["DataParallelStrategy"]
