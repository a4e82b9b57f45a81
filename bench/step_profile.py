"""Where a training step's time goes, per workload: ``python bench/step_profile.py [--runs 3] [--workloads W2,W3]
[--impls plain,project,project-defaults,project-k16] [--quick] [--out bench/]`` writes ``PROFILE.md``.

Each run is a fresh process of this script's ``--child`` mode, which wraps a few functions with timers and then
runs the program as its own command line would (``runpy``): plain PyTorch (``bench/plain.py single``) and dpddp
(``python train.py`` with the lean overrides of ``bench/workloads.py``, ``steps_per_execution`` 1 and 16, and with
the defaults on at 1), one
epoch of the workload's sizes (``bench/workloads.py``'s). The buckets, each the time spent in the wrapped calls less the
wrapped calls nested in them, counted while gradients are enabled (training, not evaluation) and after the end
of the first optimizer step up to the end of the last (the steady state of ``bench/run.py``'s samples/s):

- gather: ``torch.index_select`` and ``Tensor.index_select`` (the rows of each batch);
- forward: ``torch.nn.functional.linear`` and ``cross_entropy`` (the bench's model is one ``nn.Linear``);
- backward: ``Tensor.backward``;
- optimizer: ``Optimizer.zero_grad`` and the SGD update (``torch.optim.sgd.sgd``, inside ``SGD.step``);
- loop and hooks: the rest of the steady-state time (the training loop, the data loader, Lightning's hooks and
  callbacks, the model's bookkeeping in ``training_step``, ``Optimizer.step``'s wrapper and closure).

Per step in microseconds (the bucket's time over the steps after the first) and as shares of the step. The
wrappers cost about a microsecond per call, a few per step: the figures are a profile, not a throughput.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import platform
import runpy
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import workloads  # bench/ is on sys.path
from workloads import ROOT, train_overrides

BUCKETS = ("gather", "forward", "backward", "optimizer")
ROWS = ("loop and hooks", *BUCKETS)
# bench/run.py's workloads with steps to profile.
WORKLOADS = {name: workloads.WORKLOADS[name] for name in ("W2", "W3")}
QUICK_WORKLOADS = {name: workloads.QUICK_WORKLOADS[name] for name in WORKLOADS}
IMPLS = {"plain": "plain PyTorch", "project": "dpddp K=1", "project-defaults": "dpddp K=1, defaults"}
IMPLS["project-k16"] = "dpddp K=16"


class Clock:
    """Exclusive time per bucket (s) and the ends of the optimizer steps, while gradients are enabled."""

    def __init__(self) -> None:
        import torch

        self.grad_enabled = torch.is_grad_enabled
        self.totals = dict.fromkeys(BUCKETS, 0.0)
        self.stack: list[list[float]] = []  # per open call: [nested time]
        self.first_end: float | None = None
        self.last_end, self.steps = 0.0, 0

    def wrap(self, bucket: str, fn: Callable[..., Any], step_end: bool = False) -> Callable[..., Any]:
        """``fn`` timed into ``bucket``; ``step_end``: its return ends an optimizer step."""

        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.grad_enabled() and not step_end:
                return fn(*args, **kwargs)
            self.stack.append([0.0])
            begin = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                end = time.perf_counter()
                (nested,) = self.stack.pop()
                if self.stack:
                    self.stack[-1][0] += end - begin
                if self.first_end is not None:
                    self.totals[bucket] += end - begin - nested
                if step_end:
                    self.steps += 1
                    self.last_end = end
                    if self.first_end is None:
                        self.first_end = end

        return timed

    def install(self) -> None:
        """Wrap the functions of ``BUCKETS`` (before the program imports them)."""
        import importlib

        import torch
        import torch.nn.functional as F

        sgd = importlib.import_module("torch.optim.sgd")  # torch.optim deletes its submodules' names
        torch.index_select = self.wrap("gather", torch.index_select)
        torch.Tensor.index_select = self.wrap("gather", torch.Tensor.index_select)  # type: ignore[method-assign]
        F.linear = self.wrap("forward", F.linear)
        F.cross_entropy = self.wrap("forward", F.cross_entropy)
        torch.Tensor.backward = self.wrap("backward", torch.Tensor.backward)  # type: ignore[method-assign]
        torch.optim.Optimizer.zero_grad = self.wrap("optimizer", torch.optim.Optimizer.zero_grad)  # type: ignore
        sgd.sgd = self.wrap("optimizer", sgd.sgd, step_end=True)

    def result(self) -> dict[str, Any]:
        """Per-step microseconds of each row, over the steps after the first."""
        steps = self.steps - 1
        if self.first_end is None or steps < 1:
            raise SystemExit("error: fewer than 2 optimizer steps: nothing to profile")
        total = self.last_end - self.first_end
        per_step = {bucket: seconds / steps * 1e6 for bucket, seconds in self.totals.items()}
        per_step["loop and hooks"] = total / steps * 1e6 - sum(per_step.values())
        return {"steps": steps, "step_us": total / steps * 1e6, "us": per_step}


def child(impl: str, sizes: list[int], out: Path) -> None:
    """Run ``impl`` on ``sizes`` in this process under a ``Clock``; write its ``result`` as JSON to ``out``."""
    clock = Clock()
    clock.install()
    with tempfile.TemporaryDirectory(prefix="dpddp-profile-") as tmp:
        if impl == "plain":
            script = ROOT / "bench" / "plain.py"
            sys.argv = [str(script), "single", "1", *map(str, sizes), "1", str(Path(tmp) / "plain.json")]
            sys.path.insert(0, str(script.parent))
        else:
            script = ROOT / "train.py"
            lean = impl != "project-defaults"  # defaults: progress bar, CSV logger and checkpoints on
            sys.argv = [str(script), *train_overrides(tuple(sizes), lean), "strategy=auto", f"hydra.run.dir={tmp}/run"]
            sys.argv.append(f"steps_per_execution={16 if impl == 'project-k16' else 1}")
        try:
            runpy.run_path(str(script), run_name="__main__")
        except SystemExit as exit_:
            if exit_.code not in (0, None):
                raise
    out.write_text(json.dumps(clock.result()) + "\n")


def measure(impl: str, sizes: tuple[int, ...], env: dict[str, str]) -> dict[str, Any]:
    """One fresh ``--child`` process of ``impl``; its result.

    Raises:
        RuntimeError: the child failed (the end of its output in the message).
    """
    with tempfile.TemporaryDirectory(prefix="dpddp-profile-") as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, __file__, "--child", impl, *map(str, sizes), "--result", str(out)]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if proc.returncode != 0 or not out.is_file():
            raise RuntimeError(f"exit status {proc.returncode}: {' '.join(cmd)}\n{(proc.stdout + proc.stderr)[-3000:]}")
        return json.loads(out.read_text())


def table(results: list[dict[str, Any]]) -> list[str]:
    """A markdown table of one workload: a column per implementation run, per row the median over the runs of the
    per-step microseconds and its share of the step."""
    impls = [impl for impl in IMPLS if any(r["impl"] == impl for r in results)]
    lines = ["| per step | " + " | ".join(IMPLS[impl] for impl in impls) + " |", "| --- |" + " --- |" * len(impls)]
    med = {impl: statistics.median(r["step_us"] for r in results if r["impl"] == impl) for impl in impls}
    lines.append("| **step (us)** | " + " | ".join(f"**{med[impl]:.1f}**" for impl in impls) + " |")
    for row in ROWS:
        cells = []
        for impl in impls:
            runs = [r for r in results if r["impl"] == impl]
            us = statistics.median(r["us"][row] for r in runs)
            share = statistics.median(r["us"][row] / r["step_us"] for r in runs)
            cells.append(f"{us:.1f} ({share:.0%})")
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    return lines


def report(results: list[dict[str, Any]], command: str, sizes_of: dict[str, tuple[int, ...]], meta: str) -> str:
    """``PROFILE.md``: a table per workload, the command and the machine."""
    lines = ["# Where a training step's time goes", "", f"Command: `{command}`  ", meta, ""]
    lines += [(__doc__ or "").split("\n\n", 1)[1].strip(), ""]
    for workload in dict.fromkeys(r["workload"] for r in results):
        n, f, c, b = sizes_of[workload]
        runs = [r for r in results if r["workload"] == workload]
        lines += [f"## {workload}: {n} samples x {f} features -> {c} classes, global batch {b}, one process", ""]
        lines += [*table(runs), ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Parse the options, profile (or, with ``--child``, be one profiled run); return the exit status."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="fresh processes per implementation (median)")
    parser.add_argument("--workloads", default="W2,W3", help="comma-separated subset of W2,W3")
    parser.add_argument("--impls", default=",".join(IMPLS), help=f"comma-separated subset of {','.join(IMPLS)}")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one run (the smoke test)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench", help="where PROFILE.md goes (default bench/)")
    parser.add_argument("--child", nargs=5, metavar=("IMPL", "N", "F", "C", "B"), help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child[0], [int(v) for v in args.child[1:]], args.result)
        return 0
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    if unknown := set(workloads) - set(WORKLOADS):
        parser.error(f"unknown workloads {sorted(unknown)}; choose from {', '.join(WORKLOADS)}")
    impls = [i.strip() for i in args.impls.split(",") if i.strip()]
    if unknown := set(impls) - set(IMPLS):
        parser.error(f"unknown implementations {sorted(unknown)}; choose from {', '.join(IMPLS)}")
    sizes_of = QUICK_WORKLOADS if args.quick else WORKLOADS
    runs = 1 if args.quick else args.runs
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    load = os.getloadavg()[0]
    results = []
    for workload in workloads:
        for rep in range(runs):
            for impl in impls:  # alternating, like bench/run.py
                record = measure(impl, sizes_of[workload], env) | {"impl": impl, "workload": workload, "rep": rep}
                print(f"{workload} {impl:12} run {rep}: {record['step_us']:9.1f} us/step", flush=True)
                results.append(record)
    command = " ".join(["python bench/step_profile.py", *(sys.argv[1:] if argv is None else argv)])
    meta = (
        f"Date: {datetime.date.today().isoformat()}; `nproc` = {os.cpu_count()}, Python "
        f"{platform.python_version()}; OMP_NUM_THREADS {env['OMP_NUM_THREADS']}; 1-minute load average "
        f"{load:.2f} at the start, {os.getloadavg()[0]:.2f} at the end; {runs} fresh process(es) per column, "
        "alternating; cells: median over them of microseconds per step (share of the step)."
    )
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "PROFILE.md").write_text(report(results, command, sizes_of, meta))
    (args.out / "profile.json").write_text(json.dumps({"command": command, "runs": results}, indent=1) + "\n")
    print(f"wrote {args.out / 'PROFILE.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
