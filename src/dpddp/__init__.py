"""dpddp: data-parallel training with Lightning and Hydra, from one CPU to many nodes.

Importing the package registers the ``dp`` strategy in Lightning's ``StrategyRegistry``.
"""

from dpddp.data import RandomTensorDataModule
from dpddp.model import LinearClassifier
from dpddp.strategies import DataParallelStrategy, DDPStrategy

__all__ = ["DDPStrategy", "DataParallelStrategy", "LinearClassifier", "RandomTensorDataModule"]
