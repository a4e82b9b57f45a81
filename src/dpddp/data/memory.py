"""The memory model of the built-in data: what a run's processes on one node will hold, checked against what the
machine or its container allows before anything is drawn."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from dpddp.data.synthetic import BLOCK
from dpddp.errors import ConfigError

__all__ = ["CGROUP_LIMITS", "PROCESS_BASE_BYTES", "check_memory", "data_bytes", "memory_bytes"]

CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")  # cgroup v2, v1
PROCESS_BASE_BYTES = 600 * 2**20
"""What one training process holds before any data (torch, Lightning, Hydra with the CPU build of torch), rounded
up; ``bench/RESULTS.md`` has the measurement."""


def memory_bytes() -> int:
    """Memory the processes of this run may use (bytes): the machine's physical memory, or the container's
    cgroup limit where that is lower (``memory.max``, cgroup v2; ``memory.limit_in_bytes``, v1)."""
    try:
        limit = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        limit = 16 * 2**30
    for path in CGROUP_LIMITS:
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            limit = min(limit, int(text))
    return limit


def data_bytes(num_samples: int, num_features: int, num_classes: int, batch_size: int, streaming: bool) -> int:
    """Bytes one process holds for the built-in data: in memory, ``x`` float32 ``[N, F]``, ``y`` and the
    training order int64 ``[N]``; streaming, the cached blocks (``cache_blocks`` + the one being built, of
    ``BLOCK x (F + 2)`` float32) and the block order; either way the teacher ``[F, C]`` and about three batches
    in flight (the prefetched, the gathered and the one in the step: ``3 x batch_size x F`` float32)."""
    per_batch = 3 * batch_size * num_features * 4 + num_features * num_classes * 4
    if streaming:
        return 5 * BLOCK * (num_features + 2) * 4 + num_samples // BLOCK * 8 + per_batch
    return num_samples * (4 * num_features + 16) + per_batch


def check_memory(data: Mapping, per_node: int, available: int) -> None:
    """Raises: ConfigError: the built-in data ``data`` on one node, ``per_node`` processes each with its own copy,
    needs more than 80% of ``available`` bytes (the rest: headroom); the advice names settings that fit."""
    limit = available * 0.8
    n, f, c, b = (data[k] for k in ("num_samples", "num_features", "num_classes", "batch_size"))
    streaming = bool(data.get("streaming"))

    def need(features: int, stream: bool) -> int:
        return per_node * (PROCESS_BASE_BYTES + data_bytes(n, features, c, b, stream))

    if need(f, streaming) <= limit:
        return
    if not streaming and need(f, True) <= limit:
        fix = "set data.streaming=true (samples generated as batches need them)"
    else:
        fits = [x for x in (f // 2**k for k in range(1, 40)) if x >= 1 and need(x, streaming) <= limit]
        rest = "use fewer processes per node (devices)" if per_node > 1 else "lower data.num_classes, data.batch_size"
        fix = f"lower data.num_features to at most {fits[0]}" if fits else rest
    sizes = f"data.num_samples={n}, data.num_features={f}, data.num_classes={c}, data.batch_size={b}"
    raise ConfigError(
        f"{sizes}, data.streaming={str(streaming).lower()} with {per_node} process(es) per node need about "
        f"{need(f, streaming) / 2**30:.1f} GiB, more than 80% of the {available / 2**30:.1f} GiB this "
        f"machine or container allows: {fix}"
    )
