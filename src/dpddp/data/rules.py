"""The data settings' rules and the split rule, for the config check and the data modules' ``setup``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dpddp.errors import ConfigError, checked_float, checked_int


def split_sizes(n: int, val_fraction: float, test_fraction: float) -> tuple[int, int, int]:
    num_val, num_test = int(n * val_fraction), int(n * test_fraction)
    return n - num_val - num_test, num_val, num_test


def check_split_settings(batch_size: Any, val_fraction: Any, test_fraction: Any) -> None:
    """Raises ConfigError: a batch size below 1, or fractions outside ``[0, 0.9]`` or leaving no training."""
    checked_int("data.batch_size", batch_size, 1, "use a positive global batch size (samples per step)")
    for key, value in (("val_fraction", val_fraction), ("test_fraction", test_fraction)):
        checked_float(f"data.{key}", value, 0.0, 0.9, "use a fraction in [0, 0.9]")
    if val_fraction + test_fraction >= 1:
        raise ConfigError(
            f"data.val_fraction={val_fraction} + data.test_fraction={test_fraction} leave no training samples: "
            "keep their sum below 1"
        )


def check_train_split(batch_size: int, num_train: int, more: str) -> None:
    """Raises ConfigError: ``num_train`` samples hold no full global batch (``more``: how to get more)."""
    if num_train < batch_size:
        raise ConfigError(
            f"data.batch_size={batch_size} is larger than the train split ({num_train} samples): lower "
            f"data.batch_size or {more}"
        )


def check_divides(
    batch_size: Any, world_size: int, source: str = "devices x num_nodes", key: str = "data.batch_size"
) -> None:
    """Raises ConfigError: an integer ``key`` that ``world_size`` does not divide (``source``: its origin)."""
    if isinstance(batch_size, int) and batch_size % world_size:
        raise ConfigError(
            f"{key}={batch_size} (global) does not divide by the world size {world_size} ({source}): use "
            f"a multiple of {world_size}"
        )


def check_micro_batch_size(value: Any) -> None:
    """Raises ConfigError: not ``null``, ``auto`` or a positive integer."""
    if value is not None and value != "auto":
        checked_int("data.micro_batch_size", value, 1, "use null, auto, or a positive number of samples")


def check_random_tensors(data: Mapping, world_size: int, source: str = "devices x num_nodes") -> tuple[int, int, int]:
    """The ``(train, val, test)`` sample counts of ``RandomTensorDataModule``'s settings ``data``. Raises
    ConfigError: a value out of range, an empty split, or a batch size that does not fit."""
    n = checked_int("data.num_samples", data["num_samples"], 1, "use a positive number of samples")
    checked_int("data.num_features", data["num_features"], 1, "use a positive number of features")
    checked_int("data.num_classes", data["num_classes"], 2, "use at least 2 classes")
    checked_int("data.seed", data["seed"], 0, "use an integer in [0, 2**32 - 1]", high=2**32 - 1)
    check_split_settings(data["batch_size"], data["val_fraction"], data["test_fraction"])
    checked_float("data.label_noise", data["label_noise"], 0.0, 1.0, "use a fraction in [0, 1]")
    if not isinstance(data.get("streaming", False), bool):
        raise ConfigError(f"data.streaming={data['streaming']!r} is invalid: use true or false")
    sizes = split_sizes(n, data["val_fraction"], data["test_fraction"])
    for split, size in (("val", sizes[1]), ("test", sizes[2])):
        if size < 1:
            raise ConfigError(
                f"data.{split}_fraction={data[f'{split}_fraction']} leaves the {split} split empty with "
                f"data.num_samples={n}: raise data.num_samples or data.{split}_fraction"
            )
    check_train_split(data["batch_size"], sizes[0], "raise data.num_samples")
    check_divides(data["batch_size"], world_size, source)
    return sizes


def iterable_refusal(name: str) -> str:
    """The refusal of an ``IterableDataset`` (class ``name``) given to a global-batch data module."""
    return (
        f"data.dataset ({name}) is an IterableDataset (a stream: no len() or [i]), and data=dataset serves map-style "
        f"data sets only: use data=stream +data.stream._target_=<it> data.num_samples=<samples in one pass> (every "
        "rank reads the whole stream), or give a map-style Dataset (__len__ and __getitem__)"
    )
