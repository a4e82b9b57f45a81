"""Variants of plain PyTorch's training step, side by side in one process: ``python bench/plain_variants.py
[--workload W2|W3] [--chunk 10]``.

Each variant trains its own copy of the model of ``bench/plain.py`` (the same seed, data, order and SGD) in
chunks of ``--chunk`` steps, the variants taking turns chunk by chunk over one epoch, so the machine's load hits
all alike. Printed per variant: the median microseconds per step, the median [quartiles] of its speed over
``x[idx]``'s chunk by chunk, and the largest weight difference from ``x[idx]``'s at the end (0: the same job).
Then evaluation under ``no_grad`` against ``inference_mode``. What it found is in ``plain.py``'s docstring.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plain import LR, MOMENTUM, SEED, epoch_order, load_splits, rank_batches  # noqa: E402

SIZES = {"W2": (262144, 1024, 10, 1024), "W3": (65536, 10, 2, 32)}  # bench/run.py's
VARIANTS: dict[str, dict[str, Any]] = {
    "x[idx]": {"gather": "index"},
    "index_select": {"gather": "isel"},
    "index_select out=": {"gather": "isel_out"},
    "out= foreach=True": {"gather": "isel_out", "foreach": True},
    "out= set_to_none=False": {"gather": "isel_out", "set_to_none": False},
    "out= fused=True": {"gather": "isel_out", "fused": True},
}


class Variant:
    """One variant's model, optimizer, batch buffers and place in the epoch."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, batch_size: int, num_classes: int, **options: Any) -> None:
        self.gather, self.set_to_none = options.pop("gather"), options.pop("set_to_none", True)
        torch.manual_seed(SEED)
        self.model = nn.Linear(x.shape[1], num_classes)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=LR, momentum=MOMENTUM, **options)
        self.batches, self.next = rank_batches(epoch_order(len(y), 0), batch_size, 0, 1), 0
        self.x, self.y = x, y
        self.xb, self.yb = x.new_empty(batch_size, x.shape[1]), y.new_empty(batch_size)

    def run(self, steps: int) -> float:
        """The next ``steps`` steps; their time (s)."""
        begin = time.perf_counter()
        for idx in self.batches[self.next : self.next + steps]:
            if self.gather == "isel_out":
                xb, yb = (
                    torch.index_select(self.x, 0, idx, out=self.xb),
                    torch.index_select(self.y, 0, idx, out=self.yb),
                )
            elif self.gather == "isel":
                xb, yb = self.x.index_select(0, idx), self.y.index_select(0, idx)
            else:
                xb, yb = self.x[idx], self.y[idx]
            loss = F.cross_entropy(self.model(xb), yb)
            self.opt.zero_grad(set_to_none=self.set_to_none)
            loss.backward()
            self.opt.step()
        self.next += steps
        return time.perf_counter() - begin


def main(argv: list[str] | None = None) -> int:
    """Run the variants in turns; print the table; return the exit status."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--workload", choices=sorted(SIZES), default="W3")
    parser.add_argument("--chunk", type=int, default=10, help="steps per turn")
    args = parser.parse_args(argv)
    num_samples, num_features, num_classes, batch_size = SIZES[args.workload]
    splits = load_splits(num_samples, num_features, num_classes)
    x, y = splits["train"]
    variants = {name: Variant(x, y, batch_size, num_classes, **dict(o)) for name, o in VARIANTS.items()}
    times: dict[str, list[float]] = {name: [] for name in variants}
    load = os.getloadavg()[0]
    base = variants["x[idx]"]
    while base.next + args.chunk <= len(base.batches):
        for name, variant in variants.items():
            times[name].append(variant.run(args.chunk))
    times = {name: t[1:] for name, t in times.items()}  # the first turn warms up
    turns = len(times["x[idx]"])
    print(f"{args.workload}: {turns} turns of {args.chunk} steps, load {load:.2f} -> {os.getloadavg()[0]:.2f}")
    for name, variant in variants.items():
        speed = [b / a for a, b in zip(times[name], times["x[idx]"], strict=True)]
        q1, median, q3 = statistics.quantiles(speed)
        diff = (variant.model.weight - base.model.weight).abs().max().item()
        us = statistics.median(times[name]) / args.chunk * 1e6
        print(f"{name:24} {us:9.1f} us/step, speed over x[idx] {median:.3f} [{q1:.3f}-{q3:.3f}], max |dw| {diff:.2g}")
    model, (xv, yv), seconds = variants["index_select out="].model, splits["val"], {"no_grad": [], "inference_mode": []}
    for _ in range(7):
        for name, context in (("no_grad", torch.no_grad), ("inference_mode", torch.inference_mode)):
            begin = time.perf_counter()
            with context():
                for xb, yb in zip(xv.split(batch_size), yv.split(batch_size), strict=True):
                    logits = model(xb)
                    F.cross_entropy(logits, yb, reduction="sum"), (logits.argmax(1) == yb).sum()
            seconds[name].append(time.perf_counter() - begin)
    ratio = statistics.median(a / b for a, b in zip(seconds["no_grad"], seconds["inference_mode"], strict=True))
    print(f"evaluation: inference_mode's speed over no_grad {ratio:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
