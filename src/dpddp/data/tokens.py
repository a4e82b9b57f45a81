"""The built-in text task (``data=tokens``): variable-length token sequences with a label, padded per batch."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import Dataset
from typing_extensions import override

from dpddp.data.global_batch import GlobalBatchDataModule

PAD = 0  # the padding token; real tokens are 1 .. vocab_size - 1


class RandomTokens(Dataset):
    """``num_samples`` sequences (int64, ``min_len`` to ``max_len`` tokens) and labels from ``seed``: a token comes
    from its class's band of the vocabulary with probability ``signal``, else from all of it."""

    def __init__(
        self,
        num_samples: int = 2048,
        vocab_size: int = 64,
        num_classes: int = 4,
        min_len: int = 4,
        max_len: int = 32,
        signal: float = 0.3,
        seed: int = 0,
    ) -> None:
        g = torch.Generator().manual_seed(seed)
        self.y = torch.randint(0, num_classes, (num_samples,), generator=g)
        lengths = torch.randint(min_len, max_len + 1, (num_samples,), generator=g).tolist()
        band = (vocab_size - 1) // num_classes
        self.x: list[torch.Tensor] = []
        for label, n in zip(self.y.tolist(), lengths, strict=True):
            anywhere = torch.randint(1, vocab_size, (n,), generator=g)
            banded = 1 + label * band + torch.randint(0, band, (n,), generator=g)
            self.x.append(torch.where(torch.rand(n, generator=g) < signal, banded, anywhere))

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def pad_tokens(samples: list[tuple[torch.Tensor, Any]]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens, label)`` samples -> ``(tokens [b, longest] padded with PAD, labels [b])``."""
    tokens = torch.nn.utils.rnn.pad_sequence([t for t, _ in samples], batch_first=True, padding_value=PAD)
    return tokens, torch.stack([torch.as_tensor(y) for _, y in samples])


class TokenDataModule(GlobalBatchDataModule):
    """``RandomTokens`` in global batches, each rank's share padded by ``pad_tokens``."""

    def __init__(
        self,
        num_samples: int = 2048,
        vocab_size: int = 64,
        num_classes: int = 4,
        min_len: int = 4,
        max_len: int = 32,
        batch_size: int = 32,
        val_fraction: float = 0.1,
        test_fraction: float = 0.1,
        seed: int = 0,
        micro_batch_size: int | str | None = None,
        collate_fn: Any = "dpddp.data.tokens.pad_tokens",  # Any: the Lightning CLI keeps a path as given
    ) -> None:
        super().__init__(None, batch_size, val_fraction, test_fraction, seed, 0, micro_batch_size, collate_fn)
        self.save_hyperparameters()
        self.sizes = (num_samples, vocab_size, num_classes, min_len, max_len)

    @override
    def make_dataset(self) -> Dataset:
        """The ``RandomTokens``, drawn when ``setup`` asks (not in every process that only builds the module)."""
        return RandomTokens(*self.sizes, seed=self.seed)
