"""dpddp: data-parallel training with Lightning and Hydra, from one CPU to many nodes.

Importing the package registers the ``dp`` strategy in Lightning's ``StrategyRegistry`` and the ``dpddp.*``
resolvers the Hydra configs use, and freezes the garbage collector at interpreter exit (``gc.freeze``): the
final collections over the objects of torch, Lightning and Hydra take about 1 s of every run's wall time on a
2-core machine, for nothing (``bench/``).
"""

import atexit
import gc

from dpddp.cluster import register_resolvers
from dpddp.data import RandomTensorDataModule
from dpddp.model import LinearClassifier
from dpddp.strategies import DataParallelStrategy, DDPStrategy

register_resolvers()
atexit.register(gc.freeze)

__all__ = ["DDPStrategy", "DataParallelStrategy", "LinearClassifier", "RandomTensorDataModule"]
