"""Two measurements behind the performance notes (docs/performance.md), in plain torch on W2-sized steps
(262,144 x 1024 float32 samples, 10 classes, global batch 1024, SGD): ``python bench/gather.py [--rounds 3]``.

1. **One gather per execution.** ``steps_per_execution=16`` gathers an execution's 16 global batches at once
   (``[16, 1024, 1024]``, 64 MiB) and then steps on each; one gather per step keeps each batch (4 MiB) in the
   cache until its step reads it. Printed: epoch seconds of both, and their ratio.
2. **Overlapping the gather with compute.** A thread gathers the next batch while the main thread steps (torch
   releases the GIL in both), against gathering then stepping. Run it with and without ``OMP_NUM_THREADS=1``
   (set in the environment, so that both threads get it): on a machine with few cores the gather competes with
   the step's matmul for them.

Ratios are per round, both sides back to back in one process; the median is printed. No target is asserted.
"""

from __future__ import annotations

import argparse
import os
import queue
import statistics
import threading
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

N, FEATURES, CLASSES, BATCH = 262_144, 1024, 10, 1024
STEPS = N // BATCH // 2  # half an epoch a side: about 0.5-1 s on 2 cores


def setup() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, Callable[[torch.Tensor, torch.Tensor], None]]:
    """The data (``[N, FEATURES]``, ``[N]``), one epoch's permutation and an SGD step on one batch."""
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(N, FEATURES, generator=gen), torch.randint(0, CLASSES, (N,), generator=gen)
    model = torch.nn.Linear(FEATURES, CLASSES)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def step(xb: torch.Tensor, yb: torch.Tensor) -> None:
        opt.zero_grad()
        F.cross_entropy(model(xb), yb).backward()
        opt.step()

    return x, y, torch.randperm(N, generator=gen), step


def per_execution(x, y, perm, step, k: int) -> float:
    """Seconds for ``STEPS`` steps, gathering ``k`` global batches at a time (``k = 1``: one per step)."""
    start = time.perf_counter()
    for first in range(0, STEPS, k):
        idx = perm[first * BATCH : (first + k) * BATCH]
        xs, ys = x.index_select(0, idx).view(k, BATCH, FEATURES), y.index_select(0, idx).view(k, BATCH)
        for i in range(k):
            step(xs[i], ys[i])
    return time.perf_counter() - start


def overlapped(x, y, perm, step) -> float:
    """Seconds for ``STEPS`` steps with each batch gathered by a thread while the previous one steps."""
    ready: queue.Queue = queue.Queue(maxsize=2)

    def gather() -> None:
        for k in range(STEPS):
            idx = perm[k * BATCH : (k + 1) * BATCH]
            ready.put((x.index_select(0, idx), y.index_select(0, idx)))

    start = time.perf_counter()
    worker = threading.Thread(target=gather, daemon=True)
    worker.start()
    for _ in range(STEPS):
        step(*ready.get())
    worker.join()
    return time.perf_counter() - start


def main() -> None:
    """Run both measurements and print their medians."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds after a warm-up (default 3)")
    args = parser.parse_args()
    data = setup()
    per_execution(*data, 1)  # warm-up
    one, sixteen, seq, ovl = [], [], [], []
    for _ in range(args.rounds):
        one.append(per_execution(*data, 1))
        sixteen.append(per_execution(*data, 16))
        seq.append(per_execution(*data, 1))
        ovl.append(overlapped(*data))
    ratio16 = statistics.median(s / o for s, o in zip(sixteen, one, strict=True))
    ratio_ovl = statistics.median(s / o for s, o in zip(seq, ovl, strict=True))
    print(
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')} ({torch.get_num_threads()} intra-op "
        f"threads), {STEPS} steps: gather per step {statistics.median(one):.3f} s, per execution of 16 "
        f"{statistics.median(sixteen):.3f} s (x{ratio16:.2f} the time); overlapped gather "
        f"{statistics.median(ovl):.3f} s (speed-up x{ratio_ovl:.2f} over sequential)"
    )


if __name__ == "__main__":
    main()
