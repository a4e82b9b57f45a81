"""Users' models for what dpddp says about them (tests/test_check.py, test_verdicts.py): a Transformer text
classifier on the built-in random tensors (each feature a token) with attention and feed-forward dropout as given
and AdamW, a variant whose forward draws from the global stream (its masks then depend on the rank), and a
LambdaLR warm-up and cosine built for the run's limit (``--model _target_=text_models.X``, ``tests/`` on the
import path)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from dpddp.models.classifier import Classifier
from dpddp.models.mlp import MLPClassifier


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


class LambdaCosineMLP(MLPClassifier):
    """The built-in MLP with AdamW and a ``LambdaLR`` warm-up (10% of the steps) and cosine decay to 0 over
    ``trainer.estimated_stepping_batches``: its limit lives in the lambda, code the checkpoint cannot hold."""

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=self.hparams["lr"])
        total = int(self.trainer.estimated_stepping_batches)
        warm = max(total // 10, 1)

        def factor(step: int) -> float:
            return (step + 1) / warm if step < warm else 0.5 * (1 + math.cos(math.pi * min(step, total) / total))

        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}
