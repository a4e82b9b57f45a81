"""What the built-in data's processes on one node will hold, against what the machine or container allows."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from dpddp.data.synthetic import BLOCK
from dpddp.errors import ConfigError

CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")  # cgroup v2, v1
PROCESS_BASE_BYTES = 600 * 2**20  # one process before any data (bench/RESULTS.md)


def memory_bytes() -> int:
    """Bytes this run may use: the physical memory, or the container's cgroup limit where lower."""
    limit = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in CGROUP_LIMITS:
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            limit = min(limit, int(text))
    return limit


def check_memory(data: Mapping, per_node: int, available: int) -> None:
    """Raises ConfigError: ``per_node`` processes of the built-in ``data`` need over 80% of ``available`` bytes."""
    limit = available * 0.8
    n, f, c, b = (data[k] for k in ("num_samples", "num_features", "num_classes", "batch_size"))
    streaming = bool(data.get("streaming"))

    def need(features: int, stream: bool) -> int:  # the tensors or five cached blocks, the order, teacher, 3 batches
        held = 5 * BLOCK * (features + 2) * 4 + n // BLOCK * 8 if stream else n * (4 * features + 16)
        return per_node * (PROCESS_BASE_BYTES + held + 3 * b * features * 4 + features * c * 4)

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
