"""The Hydra entry point (``train.py``, ``dpddp-train``): one run, or a sweep's job, and the sweep's summary."""

from __future__ import annotations

import atexit
import csv
import gc
import json
import logging
import math
import os
import sys
import traceback
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import hydra
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from hydra.experimental.callback import Callback as HydraCallback
from hydra.types import RunMode
from hydra.utils import get_class, to_absolute_path
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import ConfigKeyError, MissingMandatoryValue
from typing_extensions import override

from dpddp._compat import HYDRA_BASIC_LAUNCHER, hydra_mode_unset, hydra_override_refused, hydra_reported
from dpddp.cluster import register_resolvers, run_name
from dpddp.continuity import stop as sweep_stop
from dpddp.continuity.io import CheckpointFacts, readable
from dpddp.entry.command_line import (
    CONFIG_OPTIONS,
    HYDRA_FAILURES,
    hydra_failure,
    mode_conflict,
    refused_arguments,
    refused_override,
    repeated_key,
    sets_no_mode,
    sweep_refusal,
    sweep_variants,
    sweep_without_multirun,
    unknown_option,
    unreadable_override,
)
from dpddp.entry.run_dir import (
    LIMITS,
    completed_metrics,
    continues,
    directory_problem,
    hydra_value,
    other_run,
    other_sweep,
    reached_limit,
)
from dpddp.errors import (
    EXIT_CRASH,
    EXIT_PREEMPTED,
    KNOWN,
    ConfigError,
    Preempted,
    fail,
    first_line,
    invocation_name,
    invocations,
    resume_command,
    shell,
    unwritable,
)
from dpddp.parallel.rules import world_of
from dpddp.report.curves import job_overrides, varying, write_plot
from dpddp.report.trackers import check_file_stores, is_tracker, kept_ids, logger_specs, open_stores
from dpddp.run.config import Plan, check_checkpoint, check_config
from dpddp.run.training import isolated_job, objective, train

log = logging.getLogger(__name__)
register_resolvers()
CONFIG_DIR = ".hydra"


OmegaConf.register_new_resolver(  # Hydra's output_subdir for the invocation starting now: the first free name
    "dpddp.config_subdir",
    lambda output_dir: invocation_name(CONFIG_DIR, len(invocations(output_dir, CONFIG_DIR)) + 1),
    replace=True,
)


def sweep_resume_command(sweep_dir: Path) -> str:
    """The sweep's command line with its absolute ``hydra.sweep.dir``, to paste into a shell."""
    sweep = f"hydra.sweep.dir={hydra_value(str(sweep_dir.absolute()))}"
    return resume_command(_program(), sys.argv[1:], ("hydra.sweep.dir=",), [sweep])


def _resume_command(overrides: list[str], output_dir: Path, multirun: bool) -> str:
    """The shell command that continues a preempted run in ``output_dir`` (a sweep: ``sweep_resume_command``)."""
    if multirun:
        return sweep_resume_command(output_dir.parent)
    add = ["resume=true", f"hydra.run.dir={hydra_value(str(output_dir))}"]
    invoked, rest = _program(), iter(sys.argv[1:])  # and the config options given, with their values
    for arg in rest:
        if arg in CONFIG_OPTIONS:
            invoked += [arg, next(rest, "")]
        elif arg.startswith(tuple(f"{option}=" for option in CONFIG_OPTIONS)):
            invoked.append(arg)
    return resume_command(invoked, overrides, ("resume=", "hydra.run.dir="), add)


def _program() -> list[str]:
    """This program: a console script by its name, a Python file as ``python <path as given>``."""
    argv0 = sys.argv[0]
    return ["python", argv0] if argv0.endswith(".py") else [Path(argv0).name]


def run_job(cfg: DictConfig, late: list[Callable[[], str]]) -> float:
    """Run one Hydra job (``late``: its resume command); its ``objective`` (a sweep's failed job: ``nan``)."""
    hydra_cfg = HydraConfig.get()
    output_dir = Path(hydra_cfg.runtime.output_dir)
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    overrides: Any = OmegaConf.to_container(hydra_cfg.overrides.task, resolve=False)  # as typed: ${...} kept
    try:
        plan = job_plan(cfg, "fit")
    except ConfigError as err:
        if not multirun:
            fail(str(err))
        return _job_failed(hydra_cfg.job.num, output_dir, str(err))
    if isinstance(plan, str):  # nothing to train
        log.info(plan)
        done = completed_metrics(output_dir) or {}
        value = done.get(done.get("objective", "val/loss"))
        return math.nan if value is None else value  # null: it failed (error.txt)
    stops = multirun and sweep_stop.active()
    if stops:
        sweep_stop.watch()  # in this job's process (a worker's, submitit's: its own handler only logs it)
        if sweep_stop.requested():
            log.info("the sweep is stopping (SIGTERM): this job does not start; resuming the sweep runs it")
            return math.nan
    if multirun:
        (output_dir / "error.txt").unlink(missing_ok=True)  # an earlier try's failure, run again now
    dirs = invocations(output_dir, CONFIG_DIR)
    if dirs and hydra_cfg.output_subdir is not None:  # None: a rank other than 0 (it writes no config)
        log.info(f"invocation {len(dirs)} into this run directory: config and overrides in {dirs[-1].name}/")
    own = cfg.get("ckpt_path") == str(output_dir / "checkpoints" / "last.ckpt")  # train.log: what the job continues
    if own and (output_dir / "metrics.json").is_file():
        limits = [f"trainer.{k}={cfg.trainer.get(k)}" for k in LIMITS if cfg.trainer.get(k) not in (None, -1)]
        log.info(f"continuing finished job from {cfg.ckpt_path} to {', '.join(limits)}")
    elif own:
        log.info(f"resuming interrupted job from {cfg.ckpt_path}")
    elif cfg.get("resume") and cfg.get("ckpt_path") is None:
        log.info("resume=true but there is no checkpoints/last.ckpt in the run directory: starting fresh")
    resume = partial(_resume_command, overrides, output_dir, multirun)
    late[:] = [resume]  # main's, for a SIGTERM after the job's end
    with shell(resume, log):  # a lost rank's line: into train.log too
        try:
            with isolated_job():
                value = train(cfg, output_dir, "fit", extra={"overrides": overrides}, plan=plan)[objective(cfg)]
            if not multirun or math.isfinite(value):
                return value
            line = f"{objective(cfg)} (the objective) is {value}: the training diverged, or no validation logged it"
        except KNOWN as err:
            if isinstance(err, Preempted) and stops:
                sweep_stop.request()  # every job stops; the sweep's process prints the line that resumes them
                log.warning(f"{err}: the sweep stops; resuming it continues this job")
                return math.nan
            if isinstance(err, Preempted) or not multirun:  # a preempted sweep stops too: the node is wanted
                raise
            line = str(err)
        except Exception as err:
            if not multirun:
                raise
            log.exception("job failed")
            line = first_line(err)
    return _job_failed(hydra_cfg.job.num, output_dir, line)


def job_plan(cfg: DictConfig, stage: str) -> Plan | str:
    """The ``Plan`` of the Hydra job ``cfg`` for ``stage`` (``StartChecks``' when it ran), or ``_plan``'s line."""
    hydra_cfg = HydraConfig.get()
    output_dir = Path(hydra_cfg.runtime.output_dir)
    targets = [spec.get("_target_") for spec in (hydra_cfg.callbacks or {}).values() if spec]
    checked = any(isinstance(t, str) and issubclass(get_class(t), StartChecks) for t in targets)
    if hydra_cfg.mode != RunMode.RUN or not checked:
        return _plan(cfg, lambda: output_dir, stage)
    ckpt = cfg.get("ckpt_path")  # StartChecks' decision, made absolute there
    facts = CheckpointFacts.of(ckpt, readable(ckpt)) if ckpt else None
    return Plan(cfg, stage, world_of(cfg), facts)


def _plan(job: DictConfig, directory: Callable[[], Path], stage: str) -> Plan | str:
    """The job's ``Plan`` (``check_config``, and whether it continues ``directory()``), or why nothing trains."""
    plan = check_config(job, stage)
    output_dir = directory()
    hydra_cfg = HydraConfig.get()
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    if job.get("ckpt_path"):
        job.ckpt_path = to_absolute_path(str(job.ckpt_path))
    last = output_dir / "checkpoints" / "last.ckpt"
    loaded = readable(last) if last.is_file() else None
    facts = CheckpointFacts.of(last, loaded)
    resume = continues(job, multirun, facts)
    named = any(o.startswith("hydra.run.dir=") for o in hydra_cfg.overrides.hydra) or "/" not in run_name()
    if problem := directory_problem(job, output_dir, resume, multirun or named, job.ckpt_path):
        raise ConfigError(problem)
    if output_dir.is_dir() and any(is_tracker(spec) for _, spec in logger_specs(job)):  # on every process
        kept_ids(Path(to_absolute_path(str(output_dir))))  # ConfigError: a trackers.json that does not read
    overrides = OmegaConf.to_container(hydra_cfg.overrides.task, resolve=False)
    first = next(iter(invocations(output_dir, CONFIG_DIR)), None)  # a continue is the same run, or refused
    if resume and not multirun and (last.is_file() or (output_dir / "metrics.json").is_file()):
        if problem := other_run(output_dir, [str(o) for o in overrides], first):  # type: ignore[union-attr]
            raise ConfigError(problem)
    done = completed_metrics(output_dir) if resume else None
    if done is not None and done.get("overrides") == overrides:
        return f"already complete with the same overrides, skipping: {output_dir / 'metrics.json'}"
    if not (resume and job.get("ckpt_path") is None and last.is_file()):
        return plan
    if done is not None and (limit := reached_limit(job.trainer, facts)):
        return f"nothing to train: {last} is already at {limit}; raise it to continue the run"
    job.ckpt_path = os.path.abspath(to_absolute_path(str(last)))  # normalised, as Hydra's output_dir
    return replace(plan, checkpoint=check_checkpoint(job, stage, loaded))


def _job_failed(num: int, output_dir: Path, line: str) -> float:
    """A sweep job's failure: said on stderr, recorded in its ``error.txt`` (the summary's row); ``nan``."""
    print(f"job {num} failed: {line}", file=sys.stderr)
    (output_dir / "error.txt").write_text(line + "\n")
    return math.nan


class StartChecks(HydraCallback):
    """Before Hydra makes anything: a run planned (``_plan``) for ``stage``, a sweep checked; else ``fail``."""

    def __init__(self, stage: str = "fit") -> None:
        self.stage = stage

    @override
    def on_run_start(self, config: DictConfig, **kwargs: Any) -> None:
        job = OmegaConf.masked_copy(config, [str(k) for k in config if k != "hydra"])
        try:
            plan = _plan(job, lambda: Path(_directory(config, "run")), self.stage)
            check_file_stores([job])
        except ConfigError as err:
            fail(str(err))
        except (ConfigKeyError, MissingMandatoryValue) as err:  # ~devices, devices=???
            fail(f"{err.full_key} is missing from the config: give it a value (--cfg job shows them)")
        except Exception:  # Hydra's callback wrapper would only warn, and the job would run unchecked
            traceback.print_exc()
            sys.exit(1)
        if isinstance(plan, str):  # nothing to train: nothing is made
            print(plan)
            sys.exit(0)
        _directory(config, "run", writable=True)
        with open_dict(config):  # the decision, in the config Hydra hands the job (a deep copy of it)
            config.ckpt_path = job.ckpt_path

    @override
    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        overrides = [str(o) for o in config.hydra.overrides.task]  # its jobs continue only the same sweep's
        if problem := sweep_refusal(config) or other_sweep(Path(_directory(config, "sweep")), overrides):
            fail(problem)
        if warning := repeated_key(config):
            print(warning, file=sys.stderr)
        loader = GlobalHydra.instance().config_loader()  # checked: the sweep, and each group option's first job
        jobs = [config, *(loader.load_sweep_config(config, job) for job in sweep_variants(config))]
        try:
            check_file_stores(jobs)  # before the sweep's directory is made
            _directory(config, "sweep", writable=True)
            open_stores(jobs, str(Path(config.hydra.sweep.dir)), Path(config.hydra.runtime.cwd))  # shared, made once
        except ConfigError as err:
            fail(str(err))


def _directory(config: DictConfig, mode: str, writable: bool = False) -> str:
    """``hydra.<mode>.dir`` resolved as in the job (``writable``: made here, and can be written); else ``fail``."""
    HydraConfig.instance().set_config(config)  # what Hydra does next: ${hydra:...} resolves as in the job
    typed = OmegaConf.to_container(config.hydra[mode], resolve=False)["dir"]  # type: ignore[index,call-overload]
    try:
        directory = str(config.hydra[mode].dir)
    except Exception as err:
        reason = (str(err).splitlines() or [type(err).__name__])[0]
        fail(f"hydra.{mode}.dir={typed!r} cannot be resolved ({reason}): give a directory (hydra.{mode}.dir=runs/a)")
    if writable and (why := unwritable(directory)):
        given = f"hydra.{mode}.dir={hydra_value(directory)}"
        fail(f"{given} cannot be written ({why}): give a directory you can write (hydra.{mode}.dir=<directory>)")
    return directory


def main() -> None:
    """``python train.py [key=value ...]``, ``dpddp-train``: ``run_job``; a refused command line is one line, exit 2."""
    argv = sys.argv[1:]
    late: list[Callable[[], str]] = []  # the resume command of this process's last job (run_job's)

    def again() -> str:  # a SIGTERM's command: the last job's, or before one, this command as given
        return late[0]() if late else resume_command(_program(), sys.argv[1:], (), [])

    hydra_main = hydra.main(version_base="1.3", config_path="pkg://dpddp.conf", config_name="config")
    with shell(again):  # a SIGTERM before the job or after its end (its outputs stand): Preempted
        try:
            with sweep_stop.command(again):
                if problem := refused_arguments(argv, " ".join(_program())) or mode_conflict(argv):
                    fail(problem)
                if problem := unreadable_override(argv) or unknown_option(argv) or sweep_without_multirun(argv):
                    fail(problem)
                gc.freeze()  # the imports live as long as the process: out of the collector's sight
                gc.enable()  # train.py turned it off for the imports
                atexit.register(gc.freeze)  # no full collections over what the run built, at exit
                refused = hydra_override_refused(lambda o, c, e: fail(refused_override(o, c, e)))
                with hydra_mode_unset() if sets_no_mode(argv) else nullcontext(), refused:
                    with hydra_reported(lambda err: fail(hydra_failure(err, argv)), HYDRA_FAILURES):
                        hydra_main(partial(run_job, late=late))()
        except HYDRA_FAILURES as err:  # --info's, which Hydra does not report
            raise ConfigError(hydra_failure(err, argv)) from None


# The launchers whose jobs run under the sweep's process: a SIGTERM stops their sweep as one.
LOCAL_LAUNCHERS = (
    HYDRA_BASIC_LAUNCHER,
    "hydra_plugins.hydra_joblib_launcher.joblib_launcher.JoblibLauncher",
    "hydra_plugins.hydra_submitit_launcher.submitit_launcher.LocalLauncher",
)

SUMMARY_COLUMNS: tuple[str, ...] = ("job", "overrides", "status", "val/loss", "val/acc", "test/acc")
SUMMARY_COLUMNS += ("samples_per_sec", "world_size", "wall_time_s", "train_time_s", "segments")


def _job_row(job_dir: Path) -> dict[str, Any]:
    """One summary row from a job directory: its ``metrics.json`` (and objective), or its ``error.txt`` line."""
    row: dict[str, Any] = {"job": job_dir.name, "overrides": job_overrides(job_dir)}
    metrics_file, error_file = job_dir / "metrics.json", job_dir / "error.txt"
    metrics = json.loads(metrics_file.read_text()) if metrics_file.is_file() else None
    last = job_dir / "checkpoints" / "last.ckpt"
    started = "incomplete: resumes from checkpoints/last.ckpt" if last.is_file() else "not started"
    failed = "failed: " + error_file.read_text().strip() if error_file.is_file() else ""
    row["status"] = failed or ("ok" if metrics is not None else started)
    if metrics is not None and (row["status"] == "ok" or metrics.get("predict_error")):  # a failed predict: the
        row.update({k: metrics.get(k) for k in SUMMARY_COLUMNS[3:]})  # fit's and test's metrics stand beside it
        if metrics.get("objective"):  # a name of the user's (callbacks.model_checkpoint.monitor=val_loss)
            row[metrics["objective"]] = metrics.get(metrics["objective"])
        if metrics.get("overrides") is not None:  # the invocation that wrote the metrics, not the first one
            row["overrides"] = list(metrics["overrides"])
    return row


def _cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    return "" if value is None else str(value).replace("|", "\\|")


def objective_of(config: DictConfig) -> tuple[str, bool]:
    """The metric a sweep's jobs return and whether higher is better (``direction``, else the checkpoint's mode)."""
    direction = config.hydra.sweeper.get("direction") if "hydra" in config else None
    mode = ((config.get("callbacks") or {}).get("model_checkpoint") or {}).get("mode")
    return objective(config), direction == "maximize" if isinstance(direction, str) else mode == "max"


def write_summary(sweep_dir: Path, objective: tuple[str, bool] = ("val/loss", False)) -> list[dict[str, Any]]:
    """Write and print ``summary.csv`` and ``summary.md`` (a row per job, the best marked), draw ``curves.png``."""
    job_dirs = sorted((p for p in sweep_dir.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name))
    rows = [_job_row(p) for p in job_dirs]
    name, maximize = objective
    scored = [r for r in rows if r["status"] == "ok" and isinstance(r.get(name), (int, float)) and r[name] == r[name]]
    best = (max if maximize else min)(scored, key=lambda r: r[name]) if scored else None
    for row in rows:
        row["best"] = row is best
    given, common = varying([row["overrides"] for row in rows])
    for row, job in zip(rows, given, strict=True):
        row["overrides"] = " ".join(job)
    columns = [*SUMMARY_COLUMNS, *dict.fromkeys(k for row in rows for k in row if k not in SUMMARY_COLUMNS)]
    with open(sweep_dir / "summary.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    marked = [{**row, "best": "best" if row["best"] else ""} for row in rows]
    lines += ["| " + " | ".join(_cell(row.get(c)) for c in columns) + " |" for row in marked]
    if common:
        lines = [f"overrides of every job: {' '.join(common)}", "", *lines]
    table = "\n".join(lines) + "\n"
    (sweep_dir / "summary.md").write_text(table)
    print(f"\nsweep summary ({sweep_dir / 'summary.md'}):\n{table}")
    if best is not None:
        print(f"best: job {best['job']} ({name}={_cell(best[name])}, the {'highest' if maximize else 'lowest'})")
    if any((p / "metrics.csv").is_file() for p in job_dirs):
        print(f"curves: {write_plot(sweep_dir)}")
    return rows


def end_sweep(sweep_dir: Path, cut_short: bool = False, objective: tuple[str, bool] = ("val/loss", False)) -> None:
    """Write the summary; exit 143 if SIGTERM stopped the sweep unfinished (``cut_short``), 1 if a job failed."""
    rows = write_summary(sweep_dir, objective)
    stopped = sweep_stop.requested()
    sweep_stop.clear()
    unfinished = [row["job"] for row in rows if row["status"] != "ok" and not row["status"].startswith("failed")]
    if stopped and (unfinished or cut_short):
        kinds = {"ok": "", "incomplete": "stopped with a checkpoint", "not started": "not started", "failed": "failed"}
        jobs = {key: [row["job"] for row in rows if row["status"].split(":")[0] == key] for key in kinds}
        parts = [f"{len(jobs['ok'])} of {len(rows)} jobs finished"]
        parts += [f"{what}: {_jobs(jobs[key])}" for key, what in kinds.items() if what and jobs[key]]
        command = sweep_resume_command(sweep_dir)
        fail(f"the sweep was stopped by SIGTERM ({'; '.join(parts)}): resume with {command}", EXIT_PREEMPTED)
    failed = [row["job"] for row in rows if row["status"] != "ok"]
    if failed:
        fail(f"{len(failed)} of {len(rows)} jobs failed: {_jobs(failed)}", EXIT_CRASH)


def _jobs(names: list[str]) -> str:
    """``job 3`` or ``jobs 1, 2``: job numbers that do not read as counts."""
    return f"job {names[0]}" if len(names) == 1 else f"jobs {', '.join(names)}"


class SweepSummary(HydraCallback):
    """Hydra callback: a SIGTERM stops a ``LOCAL_LAUNCHERS`` sweep as one; at its end, ``end_sweep``."""

    @override
    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        if config.hydra.launcher.get("_target_") in LOCAL_LAUNCHERS:
            sweep_stop.start(Path(config.hydra.sweep.dir))

    @override
    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        end_sweep(Path(config.hydra.sweep.dir), objective=objective_of(config))
