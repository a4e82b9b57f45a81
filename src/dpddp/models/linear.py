"""The linear classifier: one ``nn.Linear`` (``Classifier``'s training and metrics)."""

from __future__ import annotations

import torch
from torch import nn
from typing_extensions import override

from dpddp.models.classifier import Classifier


class LinearClassifier(Classifier):
    """Logistic regression, ``x: [batch, num_features] -> logits [batch, num_classes]``."""

    def __init__(
        self,
        num_features: int = 16,
        num_classes: int = 4,
        optimizer: str = "sgd",
        lr: float = 0.1,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__(num_classes)
        self.save_hyperparameters()
        self.linear = nn.Linear(num_features, num_classes)

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)
