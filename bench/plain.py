"""Plain-PyTorch baselines of dpddp's job, for the benchmark (``bench/run.py``).

The same job as ``python train.py``: the project's tensors (``dpddp.data.synthetic.make_tensors``, seed 0,
loaded without the package's ``__init__``) split ``[train | val | test]`` like
``RandomTensorDataModule``, one ``nn.Linear`` seeded like the project, SGD
(lr 0.1, momentum 0.9), the global batch ``batch_size`` taken from a per-epoch ``torch.randperm`` by one
``index_select`` per tensor (no per-sample collate), the last partial batch dropped, validation after each epoch and
a test at the end.

It is the fastest eager loop known for the job (``fit``): no DataLoader, each step's ids a view of the epoch's
permutation, rows gathered into buffers allocated once, nothing else per step but forward, backward and the
default SGD update. Measured side by side in one process (``bench/plain_variants.py``): ``index_select`` beats
``x[idx]`` (advanced indexing) by 1.2-1.4x on W2 (into reused buffers a few percent more) and by a few percent on
W3; ``foreach=True``, ``zero_grad(set_to_none=False)`` and ``inference_mode`` over ``no_grad`` for evaluation made
no difference beyond the noise; ``fused=True`` changes the weights' rounding (1e-7 to 3e-6: no longer the
project's job); ``torch.compile`` is not eager, and compiling costs more than these one-epoch runs.

Modes:
    single: one process.
    ddp: ``world_size`` processes started by ``torch.multiprocessing.spawn``, gloo, ``DistributedDataParallel``;
        rank ``r`` takes the contiguous chunk ``[r * b, (r + 1) * b)`` of each global batch, ``b =
        batch_size / world_size``, and ``torch.set_num_threads(max(1, cpu_count // world_size))``.
    dp: one process, ``nn.DataParallel`` over ``world_size`` CUDA GPUs (refused without CUDA).

``--device cuda`` (single and ddp; refused without CUDA): the model on GPU 0, or under ddp on GPU ``r`` of rank
``r`` with nccl; batches are gathered on the CPU and copied over, as under dp.

Writes (and prints) a JSON object to ``out``: ``samples_per_sec`` (steady state: global batches of the steps
after the first of each epoch over the time from the end of that first step to the end of the epoch's last step,
samples/s), ``first_step_unix_s`` (``time.time()`` at the end of the first optimizer step, s),
``wall_time_s`` (from ``main()`` to the end of testing, s), ``steps`` (optimizer steps), ``val/loss``,
``val/acc``, ``test/loss``, ``test/acc`` (mean loss per sample, fraction; equal to the project's for the same job).

Usage: ``python bench/plain.py MODE WORLD_SIZE NUM_SAMPLES NUM_FEATURES NUM_CLASSES BATCH_SIZE EPOCHS OUT
[--device cpu|cuda]``
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

SEED = 0
VAL_FRACTION = TEST_FRACTION = 0.1
LR, MOMENTUM = 0.1, 0.9

Split = tuple[torch.Tensor, torch.Tensor]


def project_make_tensors() -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    """``dpddp.data.synthetic.make_tensors``, from the project's module ``dpddp/data/synthetic.py`` loaded on its
    own (it imports only torch). ``import dpddp.data.synthetic`` would first run the package's ``__init__``,
    which imports Lightning to register the ``dp`` strategy: seconds and ~100 MB per process the baseline must
    not pay."""
    spec = importlib.util.find_spec("dpddp")  # finds the package without importing it
    if spec is None or spec.origin is None:
        raise SystemExit("error: dpddp is not installed (pip install -e .)")
    path = Path(spec.origin).parent / "data" / "synthetic.py"
    module_spec = importlib.util.spec_from_file_location("dpddp_synthetic", path)
    assert module_spec is not None and module_spec.loader is not None
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.make_tensors


def load_splits(num_samples: int, num_features: int, num_classes: int) -> dict[str, Split]:
    """The project's data split ``[train | val | test]`` like ``RandomTensorDataModule``."""
    x, y = project_make_tensors()(SEED, num_samples, num_features, num_classes)
    num_val, num_test = int(num_samples * VAL_FRACTION), int(num_samples * TEST_FRACTION)
    a, b = num_samples - num_val - num_test, num_samples - num_test
    return {"train": (x[:a], y[:a]), "val": (x[a:b], y[a:b]), "test": (x[b:], y[b:])}


def epoch_order(num_samples: int, epoch: int) -> torch.Tensor:
    """The training order of ``epoch``, int64 ``[num_samples]``: ``torch.randperm`` seeded like the project's
    global-batch sampler (``seed * 1_000_003 + epoch``)."""
    return torch.randperm(num_samples, generator=torch.Generator().manual_seed(SEED * 1_000_003 + epoch))


def rank_batches(order: torch.Tensor, batch_size: int, rank: int, world_size: int) -> list[torch.Tensor]:
    """The ids each step of an epoch gives rank ``rank``: the contiguous ``rank``-th ``batch_size / world_size``
    of each global batch of ``order`` (the last partial batch dropped), as views of ``order`` (int64 ``[b]``)."""
    steps, chunk = len(order) // batch_size, batch_size // world_size
    return list(order[: steps * batch_size].view(steps, batch_size)[:, rank * chunk : (rank + 1) * chunk].unbind(0))


def evaluate(
    model: nn.Module, split: Split, batch_size: int, rank: int, world_size: int, device: torch.device
) -> tuple[float, float]:
    """Mean loss and accuracy over the split, each sample counted once over all ranks (rank ``r`` takes the
    contiguous ``r``-th part of the split, in batches of ``batch_size / world_size`` samples)."""
    x, y = (t.tensor_split(world_size)[rank] for t in split)
    sums = torch.zeros(3, dtype=torch.float64)  # loss sum, correct, count
    with torch.inference_mode():
        for xb, yb in zip(x.split(batch_size // world_size), y.split(batch_size // world_size), strict=True):
            logits = model(xb.to(device)).cpu()
            sums += torch.tensor(
                [F.cross_entropy(logits, yb, reduction="sum"), (logits.argmax(1) == yb).sum(), len(yb)]
            )
    if world_size > 1 and dist.is_initialized():
        sums = sums.to(device)  # nccl reduces CUDA tensors only
        dist.all_reduce(sums)
        sums = sums.cpu()
    loss, correct, count = sums.tolist()
    return loss / max(count, 1), correct / max(count, 1)


def fit(
    model: nn.Module, splits: dict[str, Split], batch_size: int, epochs: int, rank: int, world_size: int
) -> dict[str, Any]:
    """Train, validate each epoch, test; return the timings (s, samples/s) and metrics of this rank. Each step:
    ``torch.index_select`` of its ids into the batch buffers (``out=``), forward, ``zero_grad(set_to_none=True)``,
    backward, SGD's default update; evaluation under ``torch.inference_mode`` (see the module's docstring)."""
    device = next(model.parameters()).device
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)
    x, y = splits["train"]
    chunk = batch_size // world_size
    xb, yb = x.new_empty(chunk, *x.shape[1:]), y.new_empty(chunk, *y.shape[1:])  # the batch buffers, reused
    samples, seconds, first_step_unix_s, fallback, steps = 0, 0.0, None, 0.0, 0
    result: dict[str, Any] = {}
    for epoch in range(epochs):
        batches = rank_batches(epoch_order(len(y), epoch), batch_size, rank, world_size)
        last = None
        for k, idx in enumerate(batches):
            begin = time.perf_counter()
            torch.index_select(x, 0, idx, out=xb)
            torch.index_select(y, 0, idx, out=yb)
            loss = F.cross_entropy(model(xb.to(device, non_blocking=True)), yb.to(device, non_blocking=True))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if k in (0, len(batches) - 1):  # CUDA: the last sync waits for every step queued since the first
                sync()
            now = time.perf_counter()
            if first_step_unix_s is None:
                first_step_unix_s, fallback = time.time(), now - begin
            if last is not None:
                samples, seconds = samples + batch_size, seconds + now - last
            last = now
        steps += len(batches)
        result["val/loss"], result["val/acc"] = evaluate(model, splits["val"], batch_size, rank, world_size, device)
    result["test/loss"], result["test/acc"] = evaluate(model, splits["test"], batch_size, rank, world_size, device)
    speed = samples / seconds if samples else (batch_size / fallback if fallback else float("nan"))
    return {"samples_per_sec": speed, "first_step_unix_s": first_step_unix_s, "steps": steps, **result}


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ddp_rank(rank: int, args: argparse.Namespace, port: int, queue: Any) -> None:
    """One DDP rank (``mp.spawn`` target); rank 0 puts its result on ``queue``."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.world_size))
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=args.world_size)
    try:
        splits = load_splits(args.num_samples, args.num_features, args.num_classes)
        torch.manual_seed(SEED)
        linear = nn.Linear(args.num_features, args.num_classes)
        if cuda:
            model = nn.parallel.DistributedDataParallel(linear.cuda(rank), device_ids=[rank])
        else:
            model = nn.parallel.DistributedDataParallel(linear)
        result = fit(model, splits, args.batch_size, args.epochs, rank, args.world_size)
        if rank == 0:
            queue.put(result)
        dist.barrier()  # no collective in flight when a rank tears gloo down (else the other may abort: SIGABRT)
    finally:
        dist.destroy_process_group()
    # DDP keeps the gloo process group and its worker threads alive past destroy_process_group; one of them may
    # still release a collective's tensors while the interpreter finalizes, which aborts (SIGABRT, "terminate
    # called without an active exception"; about 1 run in 40 here). The rank's work is done: end without finalizing.
    sys.stdout.flush()
    os._exit(0)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Run ``args.mode``; return rank 0's result."""
    if args.batch_size % args.world_size:
        raise SystemExit(f"error: batch_size {args.batch_size} does not divide by world_size {args.world_size}")
    if (args.mode == "dp" or args.device == "cuda") and not torch.cuda.is_available():
        raise SystemExit(f"error: {'mode dp' if args.mode == 'dp' else '--device cuda'} needs CUDA")
    if args.mode == "ddp":
        queue = mp.get_context("spawn").SimpleQueue()
        mp.spawn(_ddp_rank, args=(args, free_port(), queue), nprocs=args.world_size, join=True)
        return queue.get()
    splits = load_splits(args.num_samples, args.num_features, args.num_classes)
    torch.manual_seed(SEED)
    model: nn.Module = nn.Linear(args.num_features, args.num_classes)
    if args.mode == "dp":
        model = nn.DataParallel(model.cuda(), device_ids=list(range(args.world_size)))
    elif args.device == "cuda":
        model = model.cuda()
    world_size = 1  # single and dp: one process takes the whole global batch
    return fit(model, splits, args.batch_size, args.epochs, 0, world_size)


def main(argv: list[str] | None = None) -> int:
    """Parse the command line, run, write the JSON; return the exit status."""
    start = time.perf_counter()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mode", choices=["single", "ddp", "dp"])
    parser.add_argument("world_size", type=int, help="processes (ddp) or GPUs (dp); 1 for single")
    parser.add_argument("num_samples", type=int, help="samples in train + val + test")
    parser.add_argument("num_features", type=int)
    parser.add_argument("num_classes", type=int)
    parser.add_argument("batch_size", type=int, help="global batch (samples per optimizer step)")
    parser.add_argument("epochs", type=int)
    parser.add_argument("out", type=Path, help="JSON file to write")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="single and ddp (dp: always cuda)")
    args = parser.parse_args(argv)
    result = {**run(args), "mode": args.mode, "world_size": args.world_size}
    result["wall_time_s"] = time.perf_counter() - start
    text = json.dumps(result, indent=2)
    args.out.write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
