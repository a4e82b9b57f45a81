"""dpddp: data-parallel training with Lightning and Hydra, from one CPU to many nodes.

Importing the package registers the ``dp`` strategy in Lightning's ``StrategyRegistry`` (``Trainer(strategy="dp")``
and ``--trainer.strategy=dp`` then work) and does nothing else. The layers, from the bottom up: ``errors``,
``_compat`` (Lightning's private names), ``cluster``, ``parallel`` (strategies, launcher, launched-rank entry),
``data`` and ``models`` (built-ins), ``run`` (config check, trainer assembly, the one ``train`` function) and
``entry`` (Hydra and the Lightning CLI). Imports run one way, down.
"""

from dpddp.parallel.dp import DataParallelStrategy

__all__ = ["DataParallelStrategy"]
