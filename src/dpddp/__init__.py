"""dpddp: data-parallel training with Lightning and Hydra, from one CPU to many nodes.

Importing the package registers the ``dp`` strategy in Lightning's ``StrategyRegistry`` and the ``dpddp.*``
resolvers the Hydra configs use.
"""

from dpddp.cluster import register_resolvers
from dpddp.data import RandomTensorDataModule
from dpddp.model import LinearClassifier
from dpddp.strategies import DataParallelStrategy, DDPStrategy

register_resolvers()

__all__ = ["DDPStrategy", "DataParallelStrategy", "LinearClassifier", "RandomTensorDataModule"]
