"""Where start-up goes, dpddp against strong stock Lightning: ``python bench/startup.py [--runs 5] [--out bench/]``.

Each run is a fresh process of ``python train.py`` (the seed's size W1, one CPU process, the lean overrides of
``bench/workloads.py``) or of ``bench/stock_strong.py`` (the same job in stock Lightning as a knowledgeable user
writes it, the peer of ``bench/run.py``'s start-up target), alternating, started through this
script's ``--child`` mode, which imports torch and Lightning itself before handing over to the program, timing
each phase with ``time.time()`` from the process's creation (``psutil``):

- ``python up``: interpreter start until this script runs;
- ``import torch``, then ``import lightning`` (which imports torchmetrics, scipy and more): both programs pay these;
- ``import dpddp, Hydra``: the project's modules, Hydra and OmegaConf (project only);
- ``before composition``: the command-line check and Hydra's set-up until its composition starts;
- ``Hydra composition``: ``Hydra.compose_config`` (the packaged ``conf/`` and the overrides);
- ``to the job``: Hydra's job set-up (run directory, ``.hydra/``, logging) until the job's first log line;
- ``to the first step``: the job (config check, model, data, ``Trainer``, fit set-up), or for stock Lightning
  everything after its imports, until the end of the first optimizer step (``first_step_unix_s``).

Then the answers: the wall time of ``python train.py devises=2`` (a misspelled key: one line,
exit 2), ``python train.py --help`` and ``python -c "import lightning"``, fresh processes in turn, and each one's
ratio to the import in the same round.

The bytecode of ``src/`` and ``bench/`` is written first (``workloads.compile_bytecode``), as an installed
package has it. Writes ``STARTUP.md`` (per phase: median [min-max] seconds over the runs, and the sum of the
phases after ``import lightning``: what the project costs on its own) into ``--out`` and prints it. Needs ``psutil``
(``bench/requirements.txt``). No speed is asserted anywhere: this is a profile, for ``RESULTS.md``'s start-up rows.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import runpy
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from workloads import ROOT, WORKLOADS, compile_bytecode, train_overrides  # bench/ is on sys.path

PHASES = {
    "project": [
        "python up",
        "import torch",
        "import lightning",
        "import dpddp, Hydra",
        "before composition",
        "Hydra composition",
        "to the job",
        "to the first step",
    ],
    "stock": ["python up", "import torch", "import lightning", "to the first step"],
}
SHARED = ("python up", "import torch", "import lightning")  # the phases both programs pay alike
JOB_LINE = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\]\[dpddp\.entry\.hydra\]\[INFO\]", re.M)


def child(program: str, run_dir: Path) -> None:
    """Run ``program`` (``project`` or ``stock``) in this process with its phases timed; write ``phases.json``
    (phase -> seconds) into ``run_dir``."""
    import psutil

    created = psutil.Process().create_time()
    marks = {"python up": time.time()}
    import torch  # noqa: F401

    marks["import torch"] = time.time()
    import lightning.pytorch  # noqa: F401

    marks["import lightning"] = time.time()
    if program == "stock":
        sys.path.insert(0, str(ROOT / "bench"))
        sizes = map(str, WORKLOADS["W1"])
        sys.argv = ["stock_strong.py", "single", "1", *sizes, "1", str(run_dir / "out.json")]
        try:
            runpy.run_path(str(ROOT / "bench" / "stock_strong.py"), run_name="__main__")
        except SystemExit as end:  # its sys.exit(main())
            if end.code:
                raise
        marks["to the first step"] = json.loads((run_dir / "out.json").read_text())["first_step_unix_s"]
    else:
        marks.update(_project(run_dir))
    starts = [created, *marks.values()]
    phases = {name: end - start for (name, end), start in zip(marks.items(), starts, strict=False)}
    (run_dir / "phases.json").write_text(json.dumps(phases))


def _project(run_dir: Path) -> dict[str, float]:
    """``python train.py`` in this process; the wall-clock ends of the project's own phases."""
    import dpddp.entry.hydra as entry

    marks = {"import dpddp, Hydra": time.time()}
    sys.argv = ["train.py", *train_overrides(WORKLOADS["W1"]), "strategy=auto", f"hydra.run.dir={run_dir}"]
    from hydra._internal.hydra import Hydra

    compose = Hydra.compose_config

    def timed(*args, **kwargs):
        marks.setdefault("before composition", time.time())
        try:
            return compose(*args, **kwargs)
        finally:
            marks["Hydra composition"] = time.time()

    Hydra.compose_config = timed  # type: ignore[method-assign]
    entry.main()
    found = JOB_LINE.search((run_dir / "train.log").read_text())
    assert found, "no job log line in train.log"
    job = datetime.datetime.strptime(found.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
    marks["to the job"] = max(job, marks["Hydra composition"])  # the log's clock has millisecond steps
    marks["to the first step"] = json.loads((run_dir / "metrics.json").read_text())["first_step_unix_s"]
    return marks


def measure(program: str, env: dict[str, str]) -> dict[str, float]:
    """One fresh process of ``program``; its phases (phase -> seconds).

    Raises:
        RuntimeError: the process failed (the end of its output in the message).
    """
    with tempfile.TemporaryDirectory(prefix="dpddp-startup-") as tmp:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", program, tmp]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"{program} failed ({proc.returncode}): {(proc.stdout + proc.stderr)[-2000:]}")
        return json.loads((Path(tmp) / "phases.json").read_text())


def _cell(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]" if values else "-"


def report(runs: dict[str, list[dict[str, float]]], command: str) -> str:
    """``STARTUP.md``: a row per phase, a column per program (median [min-max] s), and the rows "after import
    lightning" (the sum of each run's later phases) and "start to first step" (the sum of all)."""
    lines = [
        "# Start-up: dpddp vs strong stock Lightning (W1, one CPU process, lean)",
        "",
        f"Command: `{command}`; {len(runs['project'])} runs of each, alternating, each a fresh process. Cells: "
        "median [min-max] seconds of each phase (see `bench/startup.py`).",
        "",
        "| phase | dpddp | strong stock Lightning |",
        "| --- | --- | --- |",
    ]
    for phase in PHASES["project"]:
        cells = [_cell([r[phase] for r in runs[p] if phase in r]) for p in ("project", "stock")]
        lines.append(f"| {phase} | {' | '.join(cells)} |")
    for label, keep in (("after import lightning", lambda p: p not in SHARED), ("start to first step", bool)):
        cells = [_cell([sum(v for k, v in r.items() if keep(k)) for r in runs[p]]) for p in ("project", "stock")]
        lines.append(f"| **{label}** | {' | '.join(cells)} |")
    return "\n".join(lines) + "\n"


ANSWERS = {
    "python train.py devises=2": (["train.py", "devises=2"], 2),
    "python train.py --help": (["train.py", "--help"], 0),
    'python -c "import lightning"': (["-c", "import lightning"], 0),
}
"""The commands timed side by side: their arguments to ``python`` and their exit status."""
BASE = 'python -c "import lightning"'


def answer_times(runs: int, env: dict[str, str]) -> dict[str, list[float]]:
    """Wall seconds of each of ``ANSWERS`` over ``runs`` rounds, a fresh process each, in turn.

    Raises:
        RuntimeError: a command ended with another status than its own (its stderr's end in the message).
    """
    times: dict[str, list[float]] = {label: [] for label in ANSWERS}
    for _ in range(runs):
        for label, (args, status) in ANSWERS.items():
            start = time.perf_counter()
            proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True)
            times[label].append(time.perf_counter() - start)
            if proc.returncode != status:
                raise RuntimeError(f"{label} ended {proc.returncode}, not {status}: {proc.stderr[-2000:]}")
    return times


def answers_report(times: dict[str, list[float]]) -> str:
    """The answers' section of ``STARTUP.md``: per command its wall seconds and its ratio to ``import lightning``
    in the same round, median [min-max]."""
    lines = [
        "## Answers",
        "",
        f"{len(times[BASE])} rounds, each command a fresh process in turn (`bench/startup.py`). Cells: median "
        "[min-max] wall seconds, and the per-round ratio to importing Lightning.",
        "",
        f"| command | wall time (s) | / `{BASE.removeprefix('python ')}` |",
        "| --- | --- | --- |",
    ]
    for label, values in times.items():
        ratios = [v / base for v, base in zip(values, times[BASE], strict=True)]
        lines.append(f"| `{label}` | {_cell(values)} | {_cell(ratios)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Parse the options, run, write ``STARTUP.md``; return the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="runs of each program (default 5)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench", help="output directory (default bench/)")
    parser.add_argument("--child", nargs=2, metavar=("PROGRAM", "RUN_DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.child[0], Path(args.child[1]))
        return 0
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR")}
    load = os.getloadavg()[0]
    compile_bytecode()
    runs: dict[str, list[dict[str, float]]] = {"project": [], "stock": []}
    for i in range(args.runs):
        for program in runs:
            runs[program].append(measure(program, env))
            print(f"{program:7} run {i}: first step at {sum(runs[program][-1].values()):.2f} s", flush=True)
    times = answer_times(args.runs, env)
    command = " ".join(["python bench/startup.py", *(sys.argv[1:] if argv is None else argv)])
    loads = f"1-minute load average {load:.2f} at the start, {os.getloadavg()[0]:.2f} at the end"
    loads += f" ({os.cpu_count()} cores)"
    text = report(runs, command).replace("\n\n|", f"\n\n{loads}.\n\n|", 1) + "\n" + answers_report(times)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "STARTUP.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
