"""What an exact stream costs against a map-style data set of the same samples: ``python bench/streams.py [--reps 3]
[--out bench/]``.

``data=stream`` (``dpddp.data.streams``: every rank reads the whole stream and keeps its share of each global
batch) against ``data=dataset`` (the global-batch sampler: each rank fetches only its share), on the same samples
(``Blobs``, ``BlobStream``: one sample at a time, as a decoding stream gives them), the same MLP and global
batch, on one process and ``ddp(2)``; the two data paths alternate in each round. Each run is ``train.py`` in a
fresh process; its ``metrics.json`` gives the steady-state samples/s and the peak memory of the rank that peaked.
Writes ``STREAMS.md`` (medians [min-max] and the ratio stream / map-style of the medians) and prints it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from torch.utils.data import Dataset, IterableDataset

ROOT = Path(__file__).resolve().parents[1]
SIZES = {"num_samples": 20000, "num_features": 32, "num_classes": 4}


def _blobs(num_samples: int, num_features: int, num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, num_classes, (num_samples,), generator=g)
    x = 2 * torch.randn(num_classes, num_features, generator=g)[y] + torch.randn(num_samples, num_features, generator=g)
    return x, y


class Blobs(Dataset):
    """The samples, map-style: ``__len__`` and ``__getitem__``."""

    def __init__(self, **sizes: int) -> None:
        self.x, self.y = _blobs(**{**SIZES, **sizes})

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class BlobStream(IterableDataset):
    """The same samples as a stream, in order: no ``__len__``, no ``__getitem__``."""

    def __init__(self, **sizes: int) -> None:
        self.x, self.y = _blobs(**{**SIZES, **sizes})

    def __iter__(self):
        for i in range(len(self.y)):
            yield self.x[i], self.y[i]


DATA = {
    "map-style": ["data=dataset", "+data.dataset._target_=streams.Blobs"],
    "stream": ["data=stream", "+data.stream._target_=streams.BlobStream", f"data.num_samples={SIZES['num_samples']}"],
}
STRATEGIES = {"single": [], "ddp(2)": ["strategy=ddp", "devices=2"]}
COMMON = [
    "model=mlp", f"model.num_features={SIZES['num_features']}", f"model.num_classes={SIZES['num_classes']}",
    "data.batch_size=256", "accelerator=cpu", "trainer.max_epochs=2", "logger=none",
    "trainer.enable_progress_bar=false",
]  # fmt: skip


def run(data: str, strategy: str, where: Path) -> dict:
    """One ``train.py`` run; its ``metrics.json``."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "bench"), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    cmd = [sys.executable, str(ROOT / "train.py"), *DATA[data], *STRATEGIES[strategy], *COMMON]
    cmd.append(f"hydra.run.dir={where}")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode:
        raise SystemExit(f"{data} {strategy} failed: {proc.stderr[-2000:]}")
    return json.loads((where / "metrics.json").read_text())


def _cell(values: list[float], digits: int = 0) -> str:
    return f"{statistics.median(values):,.{digits}f} [{min(values):,.{digits}f}-{max(values):,.{digits}f}]"


def report(found: dict, reps: int) -> str:
    """``STREAMS.md``: per strategy, each data path's samples/s and peak MiB, and the ratios stream / map-style."""
    lines = [
        "# An exact stream against map-style data (bench/streams.py)",
        "",
        f"{SIZES['num_samples']} samples x {SIZES['num_features']} features, MLP, global batch 256, 2 epochs, CPU; "
        f"median [min-max] of {reps} rounds, the data paths alternating; `python bench/streams.py --reps {reps}`.",
        "",
        "| strategy | data | samples/s | peak MiB | samples/s stream / map-style | peak MiB stream / map-style |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for strategy in STRATEGIES:
        runs = {d: found[(d, strategy)] for d in DATA}
        speed = {d: [r["samples_per_sec"] for r in runs[d]] for d in DATA}
        memory = {d: [r["peak_mem_mib"] for r in runs[d]] for d in DATA}
        ratio = statistics.median(speed["stream"]) / statistics.median(speed["map-style"])
        mem_ratio = statistics.median(memory["stream"]) / statistics.median(memory["map-style"])
        for d in DATA:
            ratios = (f"{ratio:.2f}", f"{mem_ratio:.2f}") if d == "stream" else ("", "")
            lines.append(f"| {strategy} | {d} | {_cell(speed[d])} | {_cell(memory[d])} | {ratios[0]} | {ratios[1]} |")
    lines += [
        "",
        "Map-style, each rank fetches only its share, each sample's `__getitem__` run with the global random",
        "streams seeded by (seed, epoch, sample) (`dpddp.data.draws`: exact augmentation), in a shuffled order; the",
        "stream is read in order, its own draws seeded once a pass, so on one process it can be the faster. Under",
        "ddp every rank of the stream reads all samples and keeps its share: a stream whose reading costs more per",
        "sample (decoding, the network) pays that cost on every rank, and the ratio falls with the world size.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=ROOT / "bench")
    args = parser.parse_args()
    found: dict = {(d, s): [] for d in DATA for s in STRATEGIES}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.reps):
            for strategy in STRATEGIES:
                for data in DATA:
                    where = Path(tmp) / f"{data}-{strategy.replace('(', '').replace(')', '')}-{rep}"
                    found[(data, strategy)].append(run(data, strategy, where))
    text = report(found, args.reps)
    (args.out / "STREAMS.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
