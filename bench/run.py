"""Benchmark dpddp (``python train.py``) against its three peers: the fastest plain-PyTorch loop for the job
(``bench/plain.py``), the best stock-Lightning program a knowledgeable user writes (``bench/stock_strong.py``)
and the stock-Lightning program most users write (``bench/stock.py``).

For each workload and strategy, project, plain, strong stock and naive stock run alternately, each as a fresh
subprocess (one warm-up round, not counted, then ``--reps`` rounds), so slow drifts of the machine hit all alike. Writes
``RESULTS.md`` (medians, min-max, ratios project/peer, the performance targets), ``results.json``
(every run) and ``throughput.png`` into ``--out``. See ``bench/README.md``.

Usage: ``python bench/run.py [--reps 5] [--workloads W1,W2,W3] [--strategies single,ddp,dp] [--k16 auto|on|off]
[--impls project,plain,stock-strong,stock] [--quick] [--out DIR]``
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import importlib.util
import json
import os
import platform
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil
from workloads import QUICK_WORKLOADS, ROOT, WORKLOADS, compile_bytecode, train_overrides  # bench/ is on sys.path

WORKLOAD_TEXT = {
    "W1": "the seed's size, whole wall time matters",
    "W2": "compute-heavy",
    "W3": "small steps, steps/s",
    "W4": "scale: in-memory data vs data.streaming=true, 3000 training steps, 20 validation and test batches",
}
# Extra project overrides per workload: W4 trains on a slice of its epoch (the whole one is 156,250 steps).
EXTRA = {"W4": ["trainer.limit_train_batches=3000", "trainer.limit_val_batches=20", "trainer.limit_test_batches=20"]}
QUICK_EXTRA = {"W4": ["trainer.limit_train_batches=20", "trainer.limit_val_batches=2", "trainer.limit_test_batches=2"]}
# The implementations compared per workload (the first is the denominator of the variant tables).
IMPLS = {"W4": ["project", "project-streaming"]}
# The peers every other workload's project is compared with, strongest first: impl -> (script in bench/, label).
PEER_SCRIPTS = {
    "plain": ("plain.py", "plain"),
    "stock-strong": ("stock_strong.py", "strong stock"),
    "stock": ("stock.py", "naive stock"),
}
PEERS = tuple(PEER_SCRIPTS)
LABELS = {"project": "dpddp", **{peer: label for peer, (_, label) in PEER_SCRIPTS.items()}}
STOCK_PEERS = ("stock-strong", "stock")  # stock Lightning has no dp
# The project variant "project-k16": several optimizer steps per Lightning loop iteration, on
# the tiny-step workload and the compute-heavy one; --k16 auto runs it once the project's config has the key.
STEPS_PER_EXECUTION = 16
K_WORKLOADS = ("W2", "W3")
VARIANTS = {"project-streaming": ["data.streaming=true"], "project-k16": [f"steps_per_execution={STEPS_PER_EXECUTION}"]}
# What one resilience setting costs, on W2 under each strategy: the project with it against the project without
# (the same round, back to back). ``checkpoint.every_n_steps=10``: last.ckpt 20 times in the epoch's 204 steps
# (checkpointing back on: the lean runs switch it off, and that switches the intervals off too).
# ``check_replicas=1``: the replica check every step (its default is every 100, and before each checkpoint); ddp only.
CKPT = ["checkpoint.every_n_steps=10", "trainer.enable_checkpointing=null"]
COSTS = {
    "project-ckpt": (CKPT, "last.ckpt every 10 steps, written in the background", ("single", "ddp")),
    "project-guard1": (["check_replicas=1"], "the replica check every step", ("ddp",)),
}
VARIANTS.update({impl: overrides for impl, (overrides, _, _) in COSTS.items()})
# Variables that would make a child think a cluster launched it.
RANK_VARS = ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT", "PL_GLOBAL_SEED")
# (key in a run record, label, unit scale): the rows of each table.
METRICS = [
    ("samples_per_sec", "samples/s (steady state)", 1.0),
    ("steps_per_sec", "steps/s (steady state)", 1.0),
    ("wall_s", "whole wall time (s)", 1.0),
    ("start_to_first_step_s", "start to first step (s)", 1.0),
    ("peak_rss_bytes", "peak RSS of one process (MiB)", 1 / 2**20),
]
METRIC_LABELS = {key: label for key, label, _ in METRICS}
# The performance targets: (workload, strategy, metric key, numerator, denominator, test, bound). The test is ">=" or
# "<=" on the median of the per-round ratios numerator/denominator, "-<=" on the median of the per-round
# differences numerator - denominator (s). Against the strongest peers: plain PyTorch, and stock Lightning as a
# knowledgeable user writes it; under ddp(2) each ratio bound of the faster-than-peer kind is the single one
# minus 0.05, against plain DDP and Lightning's own ddp.
TARGETS = [
    ("W2", "single", "samples_per_sec", "project", "plain", ">=", 0.95),
    ("W2", "ddp(2)", "samples_per_sec", "project", "plain", ">=", 0.9),
    ("W3", "single", "samples_per_sec", "project", "stock-strong", ">=", 1.0),
    ("W3", "ddp(2)", "samples_per_sec", "project", "stock-strong", ">=", 0.95),
    ("W3", "single", "samples_per_sec", "project-k16", "plain", ">=", 0.9),
    ("W3", "ddp(2)", "samples_per_sec", "project-k16", "plain", ">=", 0.85),
    ("W2", "single", "samples_per_sec", "project-k16", "plain", ">=", 0.95),
    ("W2", "ddp(2)", "samples_per_sec", "project-k16", "plain", ">=", 0.9),
    ("W1", "single", "start_to_first_step_s", "project", "stock-strong", "-<=", 0.3),
    ("W1", "ddp(2)", "start_to_first_step_s", "project", "stock-strong", "-<=", 0.3),
    ("W2", "single", "start_to_first_step_s", "project", "stock-strong", "-<=", 0.3),
    ("W2", "ddp(2)", "start_to_first_step_s", "project", "stock-strong", "-<=", 0.3),
    ("W3", "single", "start_to_first_step_s", "project", "stock-strong", "-<=", 0.3),
    ("W3", "ddp(2)", "start_to_first_step_s", "project", "stock-strong", "-<=", 0.3),
    ("W1", "single", "wall_s", "project", "stock-strong", "<=", 1.0),
    ("W1", "ddp(2)", "wall_s", "project", "stock-strong", "<=", 1.0),
    ("W2", "single", "samples_per_sec", "project", "stock-strong", ">=", 1.0),
    ("W2", "ddp(2)", "samples_per_sec", "project", "stock-strong", ">=", 1.0),
    ("W2", "single", "samples_per_sec", "project-defaults", "project", ">=", 0.95),  # what the defaults cost
    # The default settings (steps_per_execution=auto, checkpoints, CSV logger) against plain PyTorch (issue 40)
    ("W2", "single", "samples_per_sec", "project-defaults", "plain", ">=", 0.9),
    ("W3", "single", "samples_per_sec", "project-defaults", "plain", ">=", 0.8),
    ("W2", "ddp(2)", "samples_per_sec", "project-defaults", "plain", ">=", 0.85),
]


def strategies(names: list[str]) -> dict[str, tuple[str, int]]:
    """``label -> (mode, world size)`` of the chosen strategies: ``single``, ``ddp(2)``, and ``dp(N)``
    (DataParallel over all N GPUs) only where CUDA is present."""
    chosen = {"single": ("single", 1), "ddp(2)": ("ddp", 2)}
    chosen = {label: spec for label, spec in chosen.items() if spec[0] in names}
    if "dp" in names:
        code = "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"
        gpus = int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout.strip() or 0)
        if gpus:
            chosen[f"dp({gpus})"] = ("dp", gpus)
        else:
            print("no CUDA: skipping dp")
    return chosen


def project_knows_k() -> bool:
    """Whether the project's config has the top-level key ``steps_per_execution`` (until it does, Hydra refuses
    it as an unknown key)."""
    config = (ROOT / "src" / "dpddp" / "conf" / "config.yaml").read_text()
    return any(line.startswith("steps_per_execution:") for line in config.splitlines())


def impls_for(workload: str, mode: str, k16: bool) -> list[str]:
    """The implementations of one round, in run order: project, the peers (plain, strong stock, naive stock; no
    dp in stock Lightning), then the project variants of the workload (defaults on at W2 and W3; ``project-k16``
    when ``k16``)."""
    if workload in IMPLS:
        return IMPLS[workload]
    impls = ["project", *(peer for peer in PEERS if not (peer in STOCK_PEERS and mode == "dp"))]
    impls += ["project-defaults"] if workload in K_WORKLOADS and mode != "dp" else []
    impls += [impl for impl, (_, _, modes) in COSTS.items() if workload == "W2" and mode in modes]
    return impls + (["project-k16"] if k16 and workload in K_WORKLOADS else [])


def project_cmd(
    sizes: tuple[int, ...],
    mode: str,
    world_size: int,
    run_dir: Path,
    defaults: bool,
    extra: list[str],
    accelerator: str | None = None,
) -> list[str]:
    """``python train.py`` for one epoch of the workload plus ``extra`` overrides; ``defaults``: progress bar,
    CSV logger and checkpoints left on; ``accelerator`` (default: ``gpu`` for dp, else ``cpu``)."""
    accelerator = accelerator or ("gpu" if mode == "dp" else "cpu")
    cmd = [sys.executable, "train.py", *train_overrides(sizes, lean=not defaults, accelerator=accelerator)]
    cmd += [f"hydra.run.dir={run_dir}"]
    cmd += ["strategy=auto"] if mode == "single" else [f"strategy={mode}", f"devices={world_size}"]
    return cmd + extra


def peer_cmd(peer: str, sizes: tuple[int, ...], mode: str, world_size: int, out: Path, *options: str) -> list[str]:
    """``python bench/<script>`` of ``peer`` (a key of ``PEER_SCRIPTS``) for one epoch of the workload."""
    script = str(ROOT / "bench" / PEER_SCRIPTS[peer][0])
    return [sys.executable, script, mode, str(world_size), *map(str, sizes), "1", str(out), *options]


def _poll_rss(proc: subprocess.Popen, stop: threading.Event, peak: list[int], interval_s: float = 0.05) -> None:
    """Every ``interval_s`` seconds, the largest RSS (bytes) of any one process of ``proc``'s tree into
    ``peak[0]``."""
    try:
        root = psutil.Process(proc.pid)
    except psutil.Error:
        return
    while not stop.is_set():
        try:
            tree = [root, *root.children(recursive=True)]
        except psutil.Error:
            tree = []
        for p in tree:
            try:
                peak[0] = max(peak[0], p.memory_info().rss)
            except psutil.Error:
                pass
        stop.wait(interval_s)


def measure(
    cmd: list[str], result_file: Path, log_file: Path, env: dict[str, str], timeout_s: float | None = None
) -> dict[str, Any]:
    """Run ``cmd`` to its end; return its ``result_file`` JSON plus ``wall_s`` (Popen to exit, s),
    ``start_to_first_step_s`` (``first_step_unix_s`` minus ``time.time()`` before Popen, s) and
    ``peak_rss_bytes`` (the largest RSS of any one process of the tree: 50 ms polls, raised to the kernel's exact
    ``ru_maxrss`` of reaped children when that grew during the run, bytes). With ``timeout_s`` (s) the command
    runs in its own session, killed as a whole when it runs longer.

    Raises:
        RuntimeError: the command failed or timed out (the end of its log in the message).
    """
    rusage_before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    peak, stop = [0], threading.Event()
    with open(log_file, "wb") as log:
        start_unix, start = time.time(), time.perf_counter()
        session = timeout_s is not None
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=session)
        poller = threading.Thread(target=_poll_rss, args=(proc, stop, peak), daemon=True)
        poller.start()
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            code = proc.wait()
        wall = time.perf_counter() - start
    stop.set()
    poller.join()
    if code != 0 or not result_file.is_file():
        tail = log_file.read_text(errors="replace")[-3000:]
        raise RuntimeError(f"exit status {code}: {' '.join(cmd)}\n{tail}")
    rusage_after = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss  # KiB on Linux
    if rusage_after > rusage_before:
        peak[0] = max(peak[0], rusage_after * 1024)
    result = json.loads(result_file.read_text())
    first = result.get("first_step_unix_s")
    return {
        "samples_per_sec": result["samples_per_sec"],
        "wall_s": wall,
        "start_to_first_step_s": first - start_unix if first else float("nan"),
        "peak_rss_bytes": peak[0],
        "inner_wall_time_s": result["wall_time_s"],
        "test_loss": result.get("test/loss"),
    }


def run_one(
    impl: str, sizes: tuple[int, ...], mode: str, world_size: int, env: dict[str, str], extra: list[str]
) -> dict[str, Any]:
    """One fresh subprocess of ``impl`` (``project``, a project variant of ``VARIANTS``, ``project-defaults``,
    or a peer of ``PEER_SCRIPTS``), in a temporary directory that is removed afterwards."""
    tmp = Path(tempfile.mkdtemp(prefix="dpddp-bench-"))
    try:
        if impl in PEERS:
            result_file = tmp / f"{impl}.json"
            cmd = peer_cmd(impl, sizes, mode, world_size, result_file)
        else:
            extra = extra + VARIANTS.get(impl, [])
            cmd = project_cmd(sizes, mode, world_size, tmp / "run", impl == "project-defaults", extra)
            result_file = tmp / "run" / "metrics.json"
        return measure(cmd, result_file, tmp / "log.txt", env)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run_all(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Every run of the session, in order: per workload and strategy, a warm-up round and ``args.reps`` rounds
    of ``impls_for`` the workload (project, the peers, then the project's variants)."""
    env = {k: v for k, v in os.environ.items() if k not in RANK_VARS}
    compile_bytecode()  # every program starts as installed, whatever PYTHONDONTWRITEBYTECODE says
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    sizes_of = QUICK_WORKLOADS if args.quick else WORKLOADS
    chosen = strategies(args.strategies)
    k16 = args.k16 == "on" or (args.k16 == "auto" and project_knows_k())
    if not k16 and any(w in K_WORKLOADS for w in args.workloads):
        print(f"not running steps_per_execution={STEPS_PER_EXECUTION} (--k16 {args.k16})", flush=True)
    runs = []
    for workload in args.workloads:
        for label, (mode, world_size) in chosen.items():
            impls = [impl for impl in impls_for(workload, mode, k16) if impl in args.impls or not args.impls]
            extra = (QUICK_EXTRA if args.quick else EXTRA).get(workload, [])
            for rep in range(0 if args.quick else -1, args.reps):  # rep -1: the warm-up round
                for impl in impls:
                    try:
                        record = run_one(impl, sizes_of[workload], mode, world_size, env, extra)
                    except RuntimeError as err:  # e.g. the working tree caught mid-edit: one retry after a pause
                        print(f"run failed, retrying once in 30 s: {str(err)[-1500:]}", flush=True)
                        time.sleep(30)
                        record = run_one(impl, sizes_of[workload], mode, world_size, env, extra)
                    record.update(workload=workload, strategy=label, impl=impl, rep=rep)
                    record["steps_per_sec"] = record["samples_per_sec"] / sizes_of[workload][3]
                    print(
                        f"{workload} {label:8} {impl:16} rep {rep:2}: {record['samples_per_sec']:10.1f} samples/s,"
                        f" wall {record['wall_s']:6.2f} s, first step at {record['start_to_first_step_s']:6.2f} s,"
                        f" peak RSS {record['peak_rss_bytes'] / 2**20:6.0f} MiB",
                        flush=True,
                    )
                    runs.append(record)
    return runs


def counted_runs(runs: list[dict]) -> list[dict]:
    """The runs of the counted rounds (not the warm-up round, ``rep`` -1): what every report and chart shows."""
    return [r for r in runs if r["rep"] >= 0]


def _stat(values: list[float], scale: float = 1.0) -> str:
    """``median [min-max]`` of the values times ``scale``."""
    if not values:
        return "-"
    values = [v * scale for v in values]
    return f"{_num(statistics.median(values))} [{_num(min(values))}-{_num(max(values))}]"


def _num(value: float) -> str:
    return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"


def _values(runs: list[dict], workload: str, strategy: str, impl: str, key: str) -> list[float]:
    """The values of ``key`` for one workload, strategy and implementation, in run order."""
    return [r[key] for r in runs if (r["workload"], r["strategy"], r["impl"]) == (workload, strategy, impl)]


def paired(
    runs: list[dict], workload: str, strategy: str, key: str, num: str, den: str, diff: bool = False
) -> list[float]:
    """``num / den`` (``diff``: ``num - den``) for each repetition, the runs of a round being back to back."""
    a, b = (_values(runs, workload, strategy, impl, key) for impl in (num, den))
    if len(a) != len(b):  # a side that did not run (W4 has no peers, dp no stock)
        return []
    return [x - y if diff else x / y for x, y in zip(a, b, strict=True) if diff or y]


def target_label(workload: str, strategy: str, key: str, num: str, den: str, test: str) -> str:
    """``W3 single K=16 samples/s (steady state), dpddp/plain``: what a target compares."""
    suffix = f" K={STEPS_PER_EXECUTION}" if num == "project-k16" else ""
    sides = f"dpddp{' - ' if test.startswith('-') else '/'}{LABELS.get(den, den)}"
    if num == "project-defaults":
        sides = "defaults on/off" if den == "project" else f"dpddp with its defaults/{LABELS.get(den, den)}"
    sides = f"{COSTS[num][0][0]} on/off" if num in COSTS else sides
    return f"{workload} {strategy}{suffix} {METRIC_LABELS[key]}, {sides}"


def target_table(runs: list[dict]) -> list[str]:
    """The performance targets as a markdown table: each bound next to the median [min-max] of its paired values and
    whether the median meets it."""
    lines = ["| target | bound | measured | met |", "| --- | --- | --- | --- |"]
    for workload, strategy, key, num, den, test, bound in TARGETS:
        values = paired(runs, workload, strategy, key, num, den, diff=test.startswith("-"))
        median = statistics.median(values) if values else None
        met = "not measured" if median is None else "yes" if eval_bound(median, test, bound) else "no"
        label = target_label(workload, strategy, key, num, den, test)
        lines.append(f"| {label} | {test.lstrip('-')} {bound:g} | {_stat(values)} | {met} |")
    return lines


def eval_bound(value: float, test: str, bound: float) -> bool:
    """Whether ``value`` passes ``test`` (``>=``, ``<=`` or ``-<=``, a difference) against ``bound``."""
    return value >= bound if test == ">=" else value <= bound


def headline(runs: list[dict]) -> list[str]:
    """The targets, then the ratios that answer "what does the project cost": one line each, median [min-max]
    of the per-round ratios, against each peer (plain PyTorch, strong stock Lightning, naive stock Lightning)."""
    lines = [*target_table(runs), ""]
    main_metric = {"W1": ("wall_s", "whole wall time"), "W2": ("samples_per_sec", "samples/s")}
    groups = list(dict.fromkeys((r["workload"], r["strategy"]) for r in runs if r["workload"] not in IMPLS))
    for impl, suffix in (("project", ""), ("project-k16", f" K={STEPS_PER_EXECUTION}")):
        for workload, strategy in groups:
            key, label = main_metric.get(workload, ("samples_per_sec", "samples/s"))
            parts = [
                f"dpddp/{LABELS[peer]} **{_stat(ratios)}**"
                for peer in PEERS
                if (ratios := paired(runs, workload, strategy, key, impl, peer))
            ]
            if parts:
                lines.append(f"- {workload} {strategy}{suffix} {label}: {', '.join(parts)}")
    for workload, strategy in groups:
        key = "start_to_first_step_s"
        parts = [
            f"dpddp/{LABELS[p]} **{_stat(r)}**"
            for p in PEERS
            if (r := paired(runs, workload, strategy, key, "project", p))
        ]
        if parts:
            lines.append(f"- {workload} {strategy} start to first step: {', '.join(parts)}")
    wanted = [
        ("W2", "single", key, "project-defaults", "project", f"W2 single {label}, defaults on/off")
        for key, label in (("samples_per_sec", "samples/s"), ("wall_s", "whole wall time"))
    ]
    wanted += [
        ("W2", s, "samples_per_sec", impl, "project", f"W2 {s} samples/s, {what} / without")
        for impl, (_, what, modes) in COSTS.items()
        for s in ("single", "ddp(2)")
        if s.split("(")[0] in modes
    ]
    wanted += [
        ("W4", s, key, "project-streaming", "project", f"W4 {s} {label}, streaming/in-memory")
        for s in ("single", "ddp(2)")
        for key, label in (("samples_per_sec", "samples/s"), ("peak_rss_bytes", "peak RSS per process"))
    ]
    for workload, strategy, key, num, den, label in wanted:
        if ratios := paired(runs, workload, strategy, key, num, den):
            lines.append(f"- {label}: **{_stat(ratios)}**")
    for strategy in ("single", "ddp(2)"):
        if rss := _values(runs, "W4", strategy, "project-streaming", "peak_rss_bytes"):
            lines.append(f"- W4 {strategy} streaming, peak RSS per process (MiB): **{_stat(rss, 1 / 2**20)}**")
    return lines


def workload_table(runs: list[dict], workload: str) -> list[str]:
    """The markdown table of one workload: a row per strategy (and project variant ``project-k16``, as
    ``<strategy> K=16``) and metric, the project against each peer."""
    peers = [LABELS[peer] for peer in PEERS]
    lines = [
        f"| strategy | metric | dpddp | {' | '.join(peers)} | {' | '.join(f'dpddp/{p}' for p in peers)} |",
        "| --- | --- | --- |" + " --- | --- |" * len(peers),
    ]
    for strategy in dict.fromkeys(r["strategy"] for r in runs if r["workload"] == workload):
        for impl, suffix in (("project", ""), ("project-k16", f" K={STEPS_PER_EXECUTION}")):
            if impl != "project" and not _values(runs, workload, strategy, impl, "wall_s"):
                continue
            for key, label, scale in METRICS:
                cells = [_stat(_values(runs, workload, strategy, i, key), scale) for i in (impl, *PEERS)]
                cells += [_stat(paired(runs, workload, strategy, key, impl, peer)) for peer in PEERS]
                lines.append(f"| {strategy}{suffix} | {label} | {' | '.join(cells)} |")
    return lines


def variant_table(runs: list[dict], workload: str, strategies: list[str], num: str, den: str) -> list[str]:
    """Two project variants side by side (``num`` against ``den``), a row per strategy and metric."""
    lines = [f"| strategy | metric | {num} | {den} | {num} / {den} |", "| --- | --- | --- | --- | --- |"]
    for strategy in strategies:
        if not _values(runs, workload, strategy, num, "wall_s"):
            continue
        for key, label, scale in METRICS:
            a, b = (_values(runs, workload, strategy, impl, key) for impl in (num, den))
            ratio = _stat(paired(runs, workload, strategy, key, num, den))
            lines.append(f"| {strategy} | {label} | {_stat(a, scale)} | {_stat(b, scale)} | {ratio} |")
    return lines if len(lines) > 2 else []


def write_results(runs: list[dict], args: argparse.Namespace, command: str) -> None:
    """``RESULTS.md`` and ``results.json`` in ``args.out``."""
    counted = counted_runs(runs)
    sizes_of = QUICK_WORKLOADS if args.quick else WORKLOADS
    versions = {name: importlib.metadata.version(name) for name in ("torch", "lightning")}
    threads = args.threads or "unset"
    nproc = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    lines = [
        "# dpddp vs plain PyTorch and stock Lightning",
        "",
        f"Command: `{command}`  ",
        f"Date: {args.date}; machine: `nproc` = {nproc}, {platform.machine()}, "
        f"Python {platform.python_version()}, torch {versions['torch']}, lightning {versions['lightning']}; "
        f"OMP_NUM_THREADS {threads}; 1-minute load average {args.load[0]:.2f} at the start, {args.load[1]:.2f} at "
        f"the end; matplotlib {'' if importlib.util.find_spec('matplotlib') else 'not '}installed (torchmetrics, "
        "imported by the project, imports it in every project process when it is)  ",
        f"Repetitions: {args.reps} per implementation{'' if args.quick else ' after one warm-up round'}, "
        "dpddp, plain PyTorch (`bench/plain.py`), strong stock Lightning (`bench/stock_strong.py`) and naive stock "
        "Lightning (`bench/stock.py`) alternating, each a fresh process. Cells: median [min-max]; ratios: median "
        "[min-max] of the per-repetition ratios (the runs "
        "of a repetition back to back). samples/s ratio < 1: the project is slower; time and memory ratio > 1: "
        "the project takes more.",
        "",
        "## Headline",
        "",
        *headline(counted),
    ]
    if (args.out / "STARTUP.md").is_file():
        lines += ["", "Where the start-up goes, phase by phase: `STARTUP.md` (`python bench/startup.py`)."]
    if (args.out / "PROFILE.md").is_file():
        lines += ["", "Where a step's time goes, bucket by bucket: `PROFILE.md` (`python bench/step_profile.py`)."]
    for workload in args.workloads:
        num_samples, num_features, num_classes, batch_size = sizes_of[workload]
        lines += [
            "",
            f"## {workload}: {num_samples} samples x {num_features} features -> {num_classes} classes, global batch "
            f"{batch_size}, 1 epoch ({WORKLOAD_TEXT[workload]})",
            "",
        ]
        if workload in IMPLS:
            strategies_run = list(dict.fromkeys(r["strategy"] for r in counted if r["workload"] == workload))
            lines += variant_table(counted, workload, strategies_run, "project-streaming", "project")
            continue
        lines += workload_table(counted, workload)
        defaults = variant_table(counted, "W2", ["single"], "project-defaults", "project") if workload == "W2" else []
        if defaults:
            lines += ["", "What the defaults cost (W2 single): progress bar, CSV logger and checkpoints on.", ""]
            lines += defaults
        for impl, (overrides, what, _) in COSTS.items() if workload == "W2" else ():
            if table := variant_table(counted, "W2", ["single", "ddp(2)"], impl, "project"):
                lines += ["", f"What `{' '.join(overrides)}` costs ({what}), against the project without it.", ""]
                lines += table
    for impl, what in (
        ("project", "the same job"),
        ("stock-strong", "the same job"),
        ("stock", "the same task in another sample order"),
    ):
        losses = []
        for workload, strategy in dict.fromkeys((r["workload"], r["strategy"]) for r in counted):
            a, b = (_values(counted, workload, strategy, i, "test_loss") for i in (impl, "plain"))
            if len(a) == len(b):  # W4 has no plain side
                losses += [abs(x - y) for x, y in zip(a, b, strict=True) if x is not None and y is not None]
        if losses:
            label = LABELS[impl]
            lines += ["", f"Check, {what}: max |test/loss {label} - plain| over the rounds = {max(losses):.2g}."]
    lines += [
        "",
        f"Project command: `python train.py {' '.join(train_overrides(('N', 'F', 'C', 'B')))} "
        "hydra.run.dir=<tmp dir>` plus `strategy=auto` or `strategy=ddp devices=2` "
        "(defaults variant: without the logger, checkpoint and progress bar overrides; K variant: plus "
        f"`{VARIANTS['project-k16'][0]}`). Peer commands: `python bench/{{plain,stock_strong,stock}}.py MODE "
        "WORLD_SIZE N F C B 1 OUT`.",
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "RESULTS.md").write_text("\n".join(lines) + "\n")
    (args.out / "results.json").write_text(
        json.dumps({"command": command, **meta(args), "runs": runs}, indent=1) + "\n"
    )


META = ("date", "load", "reps", "quick", "threads", "workloads")
"""What ``RESULTS.md`` says of a session besides its runs, kept in ``results.json`` for ``--render``."""


def meta(args: argparse.Namespace) -> dict[str, Any]:
    """The ``META`` entries of a session's options."""
    return {key: getattr(args, key) for key in META}


def render(out: Path) -> None:
    """Rewrite ``RESULTS.md`` and the chart in ``out`` from its ``results.json`` (no run): after a change of
    the report or of the targets, the numbers stay those of the one session that measured them."""
    results = json.loads((out / "results.json").read_text())
    args = argparse.Namespace(out=out, **{key: results[key] for key in META})
    write_results(results["runs"], args, results["command"])
    write_chart(results["runs"], out / "throughput.png")


def write_chart(runs: list[dict], path: Path) -> None:
    """Grouped bars: median samples/s (log scale, min-max whiskers) per workload and strategy: the project (and
    its K variant) and each peer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counted = counted_runs(runs)
    groups = list(dict.fromkeys((r["workload"], r["strategy"]) for r in counted if r["workload"] not in IMPLS))
    names = {**LABELS, "project-k16": f"dpddp K={STEPS_PER_EXECUTION}"}
    impls = [i for i in ("project", "project-k16", *PEERS) if any(r["impl"] == i for r in counted)]
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(groups)), 4))
    width = 0.8 / max(len(impls), 1)
    for i, impl in enumerate(impls):
        values = [_values(counted, w, s, impl, "samples_per_sec") for w, s in groups]
        medians = [statistics.median(v) if v else 0 for v in values]
        low = [m - min(v) if v else 0 for m, v in zip(medians, values, strict=True)]
        high = [max(v) - m if v else 0 for m, v in zip(medians, values, strict=True)]
        xs = [g + (i - (len(impls) - 1) / 2) * width for g in range(len(groups))]
        ax.bar(xs, medians, width, yerr=[low, high], capsize=3, label=names.get(impl, impl))
    ax.set_xticks(range(len(groups)), [f"{w}\n{s}" for w, s in groups])
    ax.set_yscale("log")
    ax.set_ylabel("training samples/s (median, min-max)")
    ax.set_title("Steady-state training throughput: dpddp vs plain PyTorch and stock Lightning", fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


README_START, README_END = "<!-- bench/run.py: start -->", "<!-- bench/run.py: end -->"


def readme_section(results: dict[str, Any]) -> str:
    """The performance numbers of ``docs/performance.md``, from a ``results.json``: its command, then the
    performance targets (``target_table``) and the ratio lines of ``headline``."""
    counted = counted_runs(results["runs"])  # as in RESULTS.md
    body = [f"From `{results['command']}` (`bench/RESULTS.md` has every cell):", "", *headline(counted)]
    return "\n".join([README_START, *body, README_END])


def write_readme(readme: Path, results_json: Path) -> None:
    """Replace the part of ``readme`` between the markers with ``readme_section`` of ``results_json``."""
    text = readme.read_text()
    start, end = text.index(README_START), text.index(README_END) + len(README_END)
    readme.write_text(text[:start] + readme_section(json.loads(results_json.read_text())) + text[end:])


def main(argv: list[str] | None = None) -> int:
    """Parse the options, run the session, write the results; return the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5, help="counted repetitions per implementation (default 5)")
    parser.add_argument("--workloads", default="W1,W2,W3,W4", help="comma-separated subset of W1,W2,W3,W4")
    parser.add_argument(
        "--strategies", default="single,ddp,dp", help="comma-separated subset of single,ddp,dp (dp: CUDA only)"
    )
    parser.add_argument("--threads", type=int, help="OMP_NUM_THREADS for every run (default: inherited/unset)")
    parser.add_argument(
        "--k16",
        choices=["auto", "on", "off"],
        default="auto",
        help=f"the project with steps_per_execution={STEPS_PER_EXECUTION} on {','.join(K_WORKLOADS)} "
        "(auto: when the project's config has the key)",
    )
    parser.add_argument(
        "--impls",
        default="",
        help="comma-separated subset of project,plain,stock-strong,stock and the project variants (default all)",
    )
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 1 repetition, no warm-up (smoke test)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench", help="output directory (default bench/)")
    parser.add_argument(
        "--readme", action="store_true", help="only rewrite docs/performance.md's numbers from <out>/results.json"
    )
    parser.add_argument(
        "--render", action="store_true", help="only rewrite <out>/RESULTS.md and the chart from <out>/results.json"
    )
    args = parser.parse_args(argv)
    if args.readme:
        write_readme(ROOT / "docs" / "performance.md", args.out / "results.json")
        return 0
    if args.render:
        render(args.out)
        return 0
    args.workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    args.strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    args.impls = [i.strip() for i in args.impls.split(",") if i.strip()]
    if unknown := set(args.impls) - {"project", *VARIANTS, "project-defaults", *PEERS}:
        parser.error(f"unknown implementations {sorted(unknown)}")
    if unknown := set(args.workloads) - set(WORKLOADS):
        parser.error(f"unknown workloads {sorted(unknown)}; choose from {', '.join(WORKLOADS)}")
    if unknown := set(args.strategies) - {"single", "ddp", "dp"}:
        parser.error(f"unknown strategies {sorted(unknown)}; choose from single, ddp, dp")
    if args.quick:
        args.reps = 1
    has_matplotlib = importlib.util.find_spec("matplotlib") is not None
    if not has_matplotlib and not args.quick:
        parser.error("the chart needs matplotlib: pip install -r bench/requirements.txt")
    command = " ".join(["python bench/run.py", *(sys.argv[1:] if argv is None else argv)])
    load_start = os.getloadavg()[0]
    args.date = datetime.date.today().isoformat()
    args.threads = args.threads or os.environ.get("OMP_NUM_THREADS")  # the session's, kept for --render
    runs = run_all(args)
    args.load = (load_start, os.getloadavg()[0])
    args.out.mkdir(parents=True, exist_ok=True)  # the runs first: a report that fails to render loses nothing
    (args.out / "results.json").write_text(
        json.dumps({"command": command, **meta(args), "runs": runs}, indent=1) + "\n"
    )
    write_results(runs, args, command)
    if has_matplotlib:
        write_chart(runs, args.out / "throughput.png")
    else:
        print("matplotlib missing: no chart (pip install -r bench/requirements.txt)")
    print(f"wrote {args.out / 'RESULTS.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
