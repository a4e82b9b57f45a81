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

from dpddp.parallel.whereabouts import GRADIENTS, mark

__all__ = ["COMM_HOOKS", "AllReduceTimer"]

COMM_HOOKS = {"fp16_compress": fp16_compress_hook, "bf16_compress": bf16_compress_hook, "powersgd": powerSGD_hook}
"""``strategy.ddp_comm_hook``'s names: torch's hooks that all-reduce the gradients in 16 bits (bf16: NCCL only),
or as low-rank factors (PowerSGD, with a ``PowerSGDState``: ``strategy.powersgd_rank``, ``powersgd_start_iter``)."""


class AllReduceTimer:
    """DDP's communication hook ``hook``: torch's ``allreduce_hook`` (what DDP does without a hook: the same
    sums, the same mean), timed. ``seconds`` adds up, per backward, the time from the launch of the last
    gradient bucket (all gradients computed) to the end of its all-reduce: what backward waits for once its own
    work is done. Buckets are launched in index order and complete in order on one process group, so the last
    one's end is the end of the wait. On CPU ``time.perf_counter``; on CUDA events on the current stream
    (``seconds`` counts the events finished so far; ``settle`` waits for the rest)."""

    def __init__(self, inner: Any = allreduce_hook) -> None:
        self.inner = inner  # the hook timed (``COMM_HOOKS``' compress the buckets first)
        self._seconds = 0.0
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self.buckets = 0  # hook calls so far

    def hook(self, state: Any, bucket):  # no annotations on bucket and the return: DDP checks them
        self.buckets += 1
        if bucket.index() == 0:  # the first launched; unmarked when the last one's all-reduce has ended well
            mark(GRADIENTS)
        if not bucket.is_last():
            return self.inner(state, bucket)
        if bucket.buffer().is_cuda:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            future = self.inner(state, bucket)

            def done_cuda(fut: torch.futures.Future) -> torch.Tensor:
                end = torch.cuda.Event(enable_timing=True)
                end.record()  # the callback's stream waits for the all-reduce
                self._events.append((start, end))
                value = fut.value()
                mark(None)
                return value

            return future.then(done_cuda)
        began = time.perf_counter()
        future = self.inner(state, bucket)

        def done(fut: torch.futures.Future) -> torch.Tensor:
            self._seconds += time.perf_counter() - began
            value = fut.value()
            mark(None)
            return value

        return future.then(done)

    @property
    def seconds(self) -> float:
        """Seconds of waiting so far (CUDA: the finished events only, without waiting for the others)."""
        finished = [pair for pair in self._events if pair[1].query()]
        self._events = [pair for pair in self._events if not pair[1].query()]
        self._seconds += sum(start.elapsed_time(end) for start, end in finished) / 1000.0
        return self._seconds

    def settle(self) -> float:
        """``seconds`` once every recorded all-reduce has finished (a CUDA sync)."""
        for _, end in self._events:
            end.synchronize()
        return self.seconds

    def reset(self) -> None:
        self._seconds, self._events, self.buckets = 0.0, [], 0
