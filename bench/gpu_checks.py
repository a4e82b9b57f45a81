"""The promises one lent GPU machine can show, each measured: ``bench/gpu.py`` runs them before its throughput
table (``--dry-run``: listed with what each needs, then run on CPU at tiny sizes, ``accelerator=cpu``).

Each check compares the final weights (``last.ckpt``) of two runs of ``train.py``; a run several checks use runs
once. Runs are fresh processes (the dry run's one-process runs: in this process, ``train_here``); "2 ranks
sharing one GPU" are two torchrun agents on this machine (``num_nodes=2``, one process each, both on GPU 0), over
gloo, which carries CUDA tensors (NCCL refuses two ranks on one device).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
BASE = ["model=mlp", "model.hidden=[64]", "model.optimizer=adam", "model.lr=0.01", "data.batch_size=64"]
BASE += ["logger=none", "trainer.enable_progress_bar=false", "epoch_lines=false", "curves=false"]
SIZES = {
    "gpu": ["data.num_samples=4096", "trainer.max_epochs=2"],
    "cpu": ["data.num_samples=1005", "trainer.max_epochs=1"],
}
STOP = {"gpu": 40, "cpu": 5}  # the step a stopped run ends at before it is continued
BF16, FP16 = "trainer.precision=bf16-mixed", "trainer.precision=16-mixed"
SHARED = "shared"  # a run kind: 2 ranks on GPU 0 (two torchrun agents, gloo)

# name: (kind, overrides, GPUs it needs); kinds: "cpu" (always CPU), "one" (this device), SHARED, "all" (every GPU)
RUNS: dict[str, tuple[str, tuple[str, ...], int]] = {
    "cpu32": ("cpu", (), 0),
    "one32": ("one", (), 1),
    "dp1": ("one", ("strategy=dp", "devices=1"), 1),
    "shared32": (SHARED, (), 1),
    "one_bf16": ("one", (BF16,), 1),
    "shared_bf16": (SHARED, (BF16,), 1),
    "one_fp16": ("one", (FP16,), 1),
    "shared_fp16": (SHARED, (FP16,), 1),
    "fp16_stopped": ("one", (FP16, "trainer.max_steps={stop}"), 1),
    "fp16_continued": ("one", (FP16, "ckpt_path={fp16_stopped}"), 1),
    "dp_all": ("all", ("strategy=dp",), 2),
    "ddp_nccl": ("all", ("strategy=ddp", "strategy.process_group_backend=nccl"), 2),
    "ddp_nccl_bf16": ("all", ("strategy=ddp", "strategy.process_group_backend=nccl", BF16), 2),
}

CPU_SAME = {
    "one32": "cpu32",
    "shared32": "dp_all",
    "one_fp16": "one_bf16",
    "shared_fp16": "shared_bf16",
    "ddp_nccl": "dp_all",
    "ddp_nccl_bf16": "shared_bf16",
}
"""The dry run's runs that are another's on CPU (one device is the CPU; 16-mixed is bf16; dp and nccl become ddp
over gloo, 2 ranks whether torchrun or Lightning starts them; the torchrun pair's command runs in bf16): run once."""


@dataclass(frozen=True)
class Check:
    """``runs[0]`` against ``runs[1]``: max abs weight difference within ``bound`` (a number, or ``"16-bit"``: 3 x
    max(1e-5, what 16 bits cost one device, ``cost`` = ``(16-bit run, 32-bit run)``)); ``gpus``: GPUs it needs."""

    name: str
    runs: tuple[str, str]
    bound: float | str
    gpus: int
    cost: tuple[str, str] | None = None


CHECKS = (
    Check("one GPU equals the CPU run (32-bit)", ("one32", "cpu32"), 1e-5, 1),
    Check("strategy=dp devices=1 equals one GPU", ("dp1", "one32"), 1e-5, 1),
    Check("ddp, 2 ranks sharing one GPU over gloo, equals one process", ("shared32", "one32"), 1e-5, 1),
    Check(
        "bf16-mixed: ddp (2 ranks, one GPU) within 16-bit tolerance",
        ("shared_bf16", "one_bf16"),
        "16-bit",
        1,
        ("one_bf16", "one32"),
    ),
    Check(
        "16-mixed (scaler): ddp (2 ranks, one GPU) within 16-bit tolerance",
        ("shared_fp16", "one_fp16"),
        "16-bit",
        1,
        ("one_fp16", "one32"),
    ),
    Check(
        "16-mixed stopped and continued equals the straight run (scaler state too)",
        ("fp16_continued", "one_fp16"),
        1e-6,
        1,
    ),
    Check("dp over every GPU equals one GPU (32-bit)", ("dp_all", "one32"), 1e-5, 2),
    Check("ddp over NCCL, every GPU, equals one GPU (32-bit)", ("ddp_nccl", "one32"), 1e-5, 2),
    Check(
        "bf16-mixed ddp over NCCL within 16-bit tolerance",
        ("ddp_nccl_bf16", "one_bf16"),
        "16-bit",
        2,
        ("one_bf16", "one32"),
    ),
)
EXTRA_NEEDS = (  # what bench/gpu.py measures besides the checks, and what it needs
    ("peak GPU memory per process (metrics.json peak_mem_mib, torch.cuda.max_memory_allocated) of every run", 1),
    ("docs/performance.md's DP-or-DDP throughput table (one GPU, dp and ddp over every GPU, against plain PyTorch)", 2),
)


def listing() -> list[str]:
    """Every check and measurement, with the GPUs it needs and the runs it compares."""
    lines = ["checks (GPUs needed; runs compared; bound):"]
    for c in CHECKS:
        bound = "3 x max(1e-5, 16-bit cost on one device)" if c.bound == "16-bit" else f"{c.bound:g}"
        lines.append(f"  [{c.gpus} GPU{'s' if c.gpus > 1 else ''}] {c.name}: {c.runs[0]} vs {c.runs[1]}, {bound}")
    lines += [f"  [{n} GPU{'s' if n > 1 else ''}] {what}" for what, n in EXTRA_NEEDS]
    return lines


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(name: str, where: str, gpus: int, out: Path, env: dict[str, str], timeout_s: float) -> Path:
    """Run ``name`` of ``RUNS`` into ``out/name``; ``where``: ``"gpu"`` or ``"cpu"`` (the dry run). Raises
    ``RuntimeError`` with the log's tail when a process fails."""
    kind, overrides, _ = RUNS[name]
    run_dir = out / name
    args = [o.format(stop=STOP[where], fp16_stopped=out / "fp16_stopped/checkpoints/last.ckpt") for o in overrides]
    accelerator = "cpu" if kind == "cpu" or where == "cpu" else "gpu"
    args = [*BASE, *SIZES[where], *args, f"accelerator={accelerator}", f"hydra.run.dir={run_dir}"]
    if kind == "all":
        args.append(f"devices={gpus if where == 'gpu' else 2}")
        if where == "cpu":  # the dry run: dp over CPU is refused, nccl needs CUDA
            args = [a for a in args if a not in ("strategy=dp", "strategy.process_group_backend=nccl")]
            args += [] if "strategy=ddp" in args else ["strategy=ddp"]
    if where == "cpu" and kind != SHARED and "strategy=ddp" not in args:
        train_here(args, out, out / f"{name}.0.log")
        return run_dir
    train = [str(ROOT / "train.py")]
    if kind == SHARED:
        node = ["--nnodes=2", "--nproc_per_node=1", "--master_addr=127.0.0.1", f"--master_port={_port()}"]
        args += ["strategy=ddp", "devices=1", "num_nodes=2", "strategy.process_group_backend=gloo"]
        cmds = [
            [sys.executable, "-m", "torch.distributed.run", *node, f"--node_rank={r}", *train, *args] for r in (0, 1)
        ]
    else:
        cmds = [[sys.executable, *train, *args]]
    logs = [out / f"{name}.{i}.log" for i in range(len(cmds))]
    procs = [
        subprocess.Popen(c, cwd=out, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)
        for c, log in zip(cmds, logs, strict=True)
    ]
    try:
        codes = [p.wait(timeout=timeout_s) for p in procs]
    except subprocess.TimeoutExpired:
        codes = [None]
    finally:
        for p in procs:
            p.kill()
    if any(code != 0 for code in codes):
        raise RuntimeError(f"{name} exited {codes}: " + logs[0].read_text()[-2000:])
    return run_dir


def train_here(args: list[str], cwd: Path, log: Path) -> None:
    """``python train.py ARGS`` in this process (train.py's main), in ``cwd``, its output into ``log``. Puts
    back the working directory, ``sys.argv``, the SIGTERM handler, Hydra's global state and the root logger's
    handlers. Raises ``RuntimeError`` with the log's tail when it fails."""
    from hydra.core.global_hydra import GlobalHydra

    from dpddp.entry import hydra as entry

    root = logging.getLogger()
    saved = os.getcwd(), sys.argv, signal.getsignal(signal.SIGTERM), root.handlers[:], root.level
    os.chdir(cwd)
    sys.argv = [str(ROOT / "train.py"), *args]
    try:
        with open(log, "w") as out, contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            entry.main()
    except SystemExit as stop:
        if stop.code not in (0, None):
            raise RuntimeError(f"train.py exited {stop.code}: " + log.read_text()[-2000:]) from None
    except Exception as err:
        raise RuntimeError(f"train.py failed ({err!r}): " + log.read_text()[-2000:]) from err
    finally:
        os.chdir(saved[0])
        sys.argv = saved[1]
        signal.signal(signal.SIGTERM, saved[2])
        GlobalHydra.instance().clear()
        for made in root.handlers:
            if made not in saved[3]:
                made.close()
        root.handlers[:], root.level = saved[3], saved[4]


def _weights_and_scaler(run: Path) -> tuple[dict[str, Any], Any]:
    import torch  # here only: the parent of the runs imports torch once they are done

    ckpt = torch.load(run / "checkpoints/last.ckpt", map_location="cpu", weights_only=True)
    return ckpt["state_dict"], ckpt.get("MixedPrecision")


def _diff(a: Path, b: Path) -> float:
    (wa, _), (wb, _) = _weights_and_scaler(a), _weights_and_scaler(b)
    return max((wa[k].double() - wb[k].double()).abs().max().item() for k in wa)


def run_checks(gpus: int, dry_run: bool, timeout_s: float = 240) -> list[dict[str, Any]]:
    """Every check this machine can run (``gpus`` GPUs; ``dry_run``: on CPU, each with what it needs on a GPU), in
    order; one record per check: ``name``, ``needs``, ``measured``, ``bound``, ``ok`` (``None``: not run, or a run
    failed; ``error`` says which), and ``peak_mem_mib`` per run."""
    where = "cpu" if dry_run else "gpu"
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT")}
    env.setdefault("OMP_NUM_THREADS", "1")
    out = Path(tempfile.mkdtemp(prefix="dpddp-gpu-checks-"))
    try:
        return _checks(gpus, dry_run, where, env, out, timeout_s)
    finally:
        shutil.rmtree(out, ignore_errors=True)


def _checks(gpus: int, dry_run: bool, where: str, env: dict[str, str], out: Path, timeout_s: float) -> list[dict]:
    done: dict[str, Path | str] = {}

    def get(name: str) -> Path:
        name = CPU_SAME.get(name, name) if dry_run else name
        if name not in done:
            if name == "fp16_continued":
                get("fp16_stopped")
            try:
                done[name] = _run(name, where, gpus, out, env, timeout_s)
            except RuntimeError as err:
                done[name] = str(err)
        found = done[name]
        if isinstance(found, str):
            raise RuntimeError(found)
        return found

    records = []
    for check in CHECKS:
        record: dict[str, Any] = {"name": check.name, "needs": check.gpus, "runs": list(check.runs), "ok": None}
        if not dry_run and gpus < check.gpus:
            records.append({**record, "error": f"needs {check.gpus} GPUs, {gpus} here"})
            continue
        try:
            measured = _diff(get(check.runs[0]), get(check.runs[1]))
            bound = check.bound
            if check.cost is not None:
                cost = _diff(get(check.cost[0]), get(check.cost[1]))
                record["cost"] = cost
                bound = 3 * max(1e-5, cost)
            assert isinstance(bound, float)
            ok = measured <= bound
            if check.runs[0] == "fp16_continued":  # the scaler's state too (none on CPU: bf16 there)
                ok = ok and _weights_and_scaler(get(check.runs[0]))[1] == _weights_and_scaler(get(check.runs[1]))[1]
            record.update(measured=measured, bound=bound, ok=ok)
        except RuntimeError as err:
            record["error"] = str(err)[-2000:]
        records.append(record)
    import json

    peaks = {}
    for name, found in done.items():
        if isinstance(found, Path) and (found / "metrics.json").is_file():
            m = json.loads((found / "metrics.json").read_text())
            peaks[name] = (m.get("peak_mem_mib"), m.get("peak_mem_of"), m.get("world_size"))
    return [*records, {"name": "peak memory per process (MiB, what it counts, processes)", "peaks": peaks}]


def report(records: list[dict[str, Any]], dry_run: bool) -> list[str]:
    """The markdown section of ``GPU.md``: one row per check, then the peak memory of each run."""
    where = "dry run on CPU (accelerator=cpu, tiny sizes): the code path, not the GPU figures" if dry_run else "GPU"
    lines = ["## Checks", "", f"Where: {where}.", "", "| check | GPUs needed | measured | bound | result |"]
    lines.append("| --- | --- | --- | --- | --- |")
    for r in records[:-1]:
        result = {True: "holds", False: "FAILS", None: "not run: " + r.get("error", "")[:80].replace("|", "/")}
        measured = f"{r['measured']:.3g}" if "measured" in r else "-"
        bound = (
            f"{r['bound']:.3g}" + (f" (16-bit cost {r['cost']:.3g})" if "cost" in r else "") if "bound" in r else "-"
        )
        lines.append(f"| {r['name']} | {r['needs']} | {measured} | {bound} | {result[r['ok']]} |")
    lines += ["", "| run | peak memory per process (MiB) | counts | processes |", "| --- | --- | --- | --- |"]
    for name, (mib, kind, procs) in records[-1]["peaks"].items():
        lines.append(f"| {name} | {mib if mib is None else f'{mib:.0f}'} | {kind} | {procs} |")
    return lines
