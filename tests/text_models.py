"""A user's Transformer text classifier on the built-in random tensors (each feature a token): attention and
feed-forward dropout as given, AdamW; and a variant whose forward draws from the global stream (its masks then depend
on the rank) (``python -m dpddp.check --model _target_=text_models.X``, with ``tests/`` on the import path)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dpddp.models.classifier import Classifier


class TextTransformer(Classifier):
    """``x: [batch, num_features]``: each feature a token (a linear embedding of its value plus a position), one
    ``nn.TransformerEncoderLayer`` of width ``width``, mean-pooled, a linear head; AdamW at ``lr``."""

    def __init__(
        self, num_features: int = 16, num_classes: int = 4, width: int = 16, dropout: float = 0.0, lr: float = 3e-3
    ) -> None:
        super().__init__(num_classes)
        self.save_hyperparameters()
        self.embed = nn.Linear(1, width)
        self.position = nn.Parameter(torch.randn(num_features, width) * 0.1)
        self.encoder = nn.TransformerEncoderLayer(width, 2, 2 * width, dropout=dropout, batch_first=True)
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.embed(x.unsqueeze(-1)) + self.position
        return self.head(self.encoder(tokens).mean(1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams["lr"])


class NoisyTextTransformer(TextTransformer):
    """``F.dropout`` on the pooled features in the model's own forward: a functional draw of the global stream."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.embed(x.unsqueeze(-1)) + self.position
        return self.head(F.dropout(self.encoder(tokens).mean(1), 0.1, self.training))
