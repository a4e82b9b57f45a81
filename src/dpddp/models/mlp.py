"""A small multi-layer perceptron (``Classifier``'s training and metrics)."""

from __future__ import annotations

import torch
from torch import nn
from typing_extensions import override

from dpddp.models.classifier import Classifier
from dpddp.nn import SampleDropout


class MLPClassifier(Classifier):
    """``x: [batch, num_features] -> logits`` by ``Linear -> ReLU [-> SampleDropout]`` layers of widths ``hidden``.
    Raises ``ValueError``: a width below 1, or a bad ``dropout``."""

    def __init__(
        self,
        num_features: int = 64,
        num_classes: int = 10,
        hidden: tuple[int, ...] | list[int] = (128,),
        dropout: float = 0.0,
        optimizer: str = "adam",
        lr: float = 0.003,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__(num_classes, dropout)
        if not hidden or min(hidden) < 1:
            raise ValueError(f"model.hidden={list(hidden)!r} is invalid: give widths >= 1, e.g. [128]")
        self.save_hyperparameters()
        layers: list[nn.Module] = []
        width = num_features
        for h in hidden:
            layers += [nn.Linear(width, h), nn.ReLU()] + ([SampleDropout(dropout)] if dropout else [])
            width = h
        self.net = nn.Sequential(*layers, nn.Linear(width, num_classes))

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)
