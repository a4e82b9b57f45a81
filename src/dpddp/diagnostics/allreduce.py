"""The time a DDP backward waits on its gradient all-reduce, measured by a pass-through communication hook."""

# No ``from __future__ import annotations``: DDP compares the hook's annotations with the real classes.
import time
from typing import Any

import torch
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import (
    allreduce_hook,
    bf16_compress_hook,
    fp16_compress_hook,
)
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import powerSGD_hook

from dpddp.diagnostics.whereabouts import GRADIENTS, mark

COMM_HOOKS = {"fp16_compress": fp16_compress_hook, "bf16_compress": bf16_compress_hook, "powersgd": powerSGD_hook}


class AllReduceTimer:
    """A DDP comm hook (``hook``): ``inner``, with each backward's last-bucket all-reduce timed into ``seconds``."""

    _events: list[tuple[torch.cuda.Event, torch.cuda.Event]]

    def __init__(self, inner: Any = allreduce_hook) -> None:
        self.inner = inner
        self.reset()

    def hook(self, state: Any, bucket):  # no annotations on bucket and the return: DDP checks them
        self.buckets += 1
        if bucket.index() == 0:  # unmarked when the last bucket's all-reduce has ended well
            mark(GRADIENTS)
        if not bucket.is_last():
            return self.inner(state, bucket)
        start = torch.cuda.Event(enable_timing=True) if bucket.buffer().is_cuda else None
        if start is not None:
            start.record()
        began = time.perf_counter()

        def done(fut: torch.futures.Future) -> torch.Tensor:
            if start is None:
                self._seconds += time.perf_counter() - began
            else:
                end = torch.cuda.Event(enable_timing=True)
                end.record()  # the callback's stream waits for the all-reduce
                self._events.append((start, end))
            value = fut.value()
            mark(None)
            return value

        return self.inner(state, bucket).then(done)

    @property
    def seconds(self) -> float:
        """Seconds of waiting so far (CUDA: the finished events only)."""
        pending = []
        for start, end in self._events:
            if end.query():
                self._seconds += start.elapsed_time(end) / 1000.0
            else:
                pending.append((start, end))
        self._events = pending
        return self._seconds

    def settle(self) -> float:
        """``seconds`` once every recorded all-reduce has finished (a CUDA sync)."""
        for _, end in self._events:
            end.synchronize()
        return self.seconds

    def reset(self) -> None:
        self._seconds, self._events, self.buckets = 0.0, [], 0
