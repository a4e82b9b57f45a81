"""A small Transformer text classifier for ``data=tokens`` (docs/your-model-and-data.md, Text)."""

from __future__ import annotations

import torch
from torch import nn
from typing_extensions import override

from dpddp.data.tokens import PAD
from dpddp.models.classifier import Classifier
from dpddp.nn import SampleDropout


class EncoderLayer(nn.Module):
    """``nn.TransformerEncoderLayer``'s post-norm block with ``SampleDropout`` after the attention and in and after
    the feed-forward (not on the attention weights, whose mask would depend on the padded length)."""

    def __init__(self, width: int, heads: int, feedforward: int, dropout: float) -> None:
        super().__init__()
        # No biases: the key projection's gradient is zero, and Adam would scale its rounding noise into steps
        # that differ between world sizes
        self.attention = nn.MultiheadAttention(width, heads, dropout=0.0, bias=False, batch_first=True)
        self.attention_dropout = SampleDropout(dropout)
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.feedforward = nn.Sequential(
            nn.Linear(width, feedforward), nn.ReLU(), SampleDropout(dropout), nn.Linear(feedforward, width)
        )
        self.feedforward_dropout = SampleDropout(dropout)

    @override
    def forward(self, x: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        """``x: [b, length, width]``, ``padding: [b, length]`` bool (True: a padded position, never attended to)."""
        attended, _ = self.attention(x, x, x, key_padding_mask=padding, need_weights=False)
        x = self.norm1(x + self.attention_dropout(attended))
        return self.norm2(x + self.feedforward_dropout(self.feedforward(x)))


class TextClassifier(Classifier):
    """``tokens: [b, length]`` (``PAD`` where padded) -> logits: embeddings, ``layers`` ``EncoderLayer``s, the mean
    over the real positions, a linear head. Raises ``ValueError``: ``width % heads``, or a bad ``dropout``."""

    def __init__(
        self,
        vocab_size: int = 64,
        num_classes: int = 4,
        max_len: int = 32,
        width: int = 32,
        heads: int = 2,
        layers: int = 1,
        feedforward: int = 64,
        dropout: float = 0.1,
        optimizer: str = "adam",
        lr: float = 0.003,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
    ) -> None:
        super().__init__(num_classes, dropout)
        if width % heads:
            raise ValueError(f"model.width={width} does not divide by model.heads={heads}: give a multiple of it")
        self.save_hyperparameters()
        self.embed = nn.Embedding(vocab_size, width, padding_idx=PAD)
        self.position = nn.Embedding(max_len, width)
        self.layers = nn.ModuleList(EncoderLayer(width, heads, feedforward, dropout) for _ in range(layers))
        self.head = nn.Linear(width, num_classes)

    @override
    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        if not len(tokens):  # an evaluation chunk with no samples
            return self.head.weight.new_zeros(0, self.head.out_features)
        padding = tokens == PAD
        x = self.embed(tokens) + self.position(torch.arange(tokens.shape[1], device=tokens.device))
        for layer in self.layers:
            x = layer(x, padding)
        real = (~padding).unsqueeze(-1).to(x.dtype)
        return self.head((x * real).sum(1) / real.sum(1))
