"""The strategy, accelerator and cluster names and their checks."""

from __future__ import annotations

from collections.abc import Mapping

from dpddp.errors import ConfigError, checked_int

STRATEGIES = ("auto", "dp", "ddp", "ddp_spawn")
ACCELERATORS = ("auto", "cpu", "gpu", "cuda")
CLUSTERS = ("auto", "kubeflow")


def check_device_values(cfg: Mapping) -> None:
    """``ConfigError`` for a bad ``strategy.name``, ``accelerator``, ``devices`` or ``num_nodes``."""
    strategy, devices, num_nodes = cfg["strategy"]["name"], cfg["devices"], cfg["num_nodes"]
    if strategy not in STRATEGIES:
        raise ConfigError(f"strategy={strategy!r} is unknown: choose one of {', '.join(STRATEGIES)}")
    if cfg["accelerator"] not in ACCELERATORS:
        raise ConfigError(f"accelerator={cfg['accelerator']!r} is unknown: choose one of {', '.join(ACCELERATORS)}")
    if devices != -1:
        checked_int("devices", devices, 1, "use a positive number of devices per node, or -1 for all GPUs")
    if num_nodes != "auto":
        checked_int("num_nodes", num_nodes, 1, "use a positive number of nodes, or auto (the launcher's)")
