"""The Lightning CLI entry point (``dpddp fit``): LightningCLI's parse, run by ``train`` as ``train.py``'s config is."""

from __future__ import annotations

import atexit
import difflib
import gc
import inspect
import logging
import operator
import os
import shutil
import sys
import warnings
from importlib.resources import files
from pathlib import Path
from typing import Any, Literal

from hydra import compose, initialize_config_module
from hydra.utils import get_class
from jsonargparse import ArgumentError
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities import rank_zero_only
from lightning_utilities.core.imports import compare_version
from omegaconf import DictConfig, OmegaConf, open_dict
from typing_extensions import override

from dpddp.cluster import in_cluster_job, run_name
from dpddp.continuity import stop
from dpddp.entry.command_line import argument_error, unknown_option
from dpddp.errors import (
    ConfigError,
    Preempted,
    fail,
    invocation_name,
    invocations,
    log_to,
    resume_command,
    shell,
    unwritable,
)
from dpddp.parallel.rules import lightning_equivalent, lightning_name_line
from dpddp.run.config import CLI_CALLBACKS, Plan, check_config
from dpddp.run.training import STAGES, isolated_job, train

# jsonargparse 4.49 renamed ArgumentParser.save's skip_none to skip_unset (the old name warns, and goes in 5.0).
SKIP_UNSET = compare_version("jsonargparse", operator.ge, "4.49", use_base_version=True)  # 4.49.0rc1 too
KEEP_NONE = {"skip_unset" if SKIP_UNSET else "skip_none": False}
DEFAULT_CLASSES = {  # the classes --model/--data name when a command line names none
    "model": "dpddp.models.linear.LinearClassifier",
    "data": "dpddp.data.random_tensors.RandomTensorDataModule",
}
HELP = (
    "Train, validate, test or predict any LightningModule (--model=pkg.Class, default: {model}) on any "
    "LightningDataModule (--data=pkg.Class, default: {data}) through dpddp: the checks, strategies "
    "(--trainer.strategy=auto|dp|ddp|ddp_spawn), launcher and outputs of dpddp-train. --data.batch_size is the "
    "global batch. Under more than one process the data must be a dpddp.data.global_batch.GlobalBatchDataModule "
    "(or a subclass) or a module wrapped in --data=dpddp.data.sharded.ShardedDataModule --data.module=pkg.Class. "
    "Runs go to <default_root_dir>/lightning_logs/version_N/; --ckpt_path=last continues the newest."
).format(**DEFAULT_CLASSES)
SIZES = ("num_features", "num_classes")
TOP_LEVEL = ("strategy", "accelerator", "devices", "num_nodes")  # Trainer arguments that are top-level keys here
CONFIG = "config.yaml"  # the first invocation's config; dpddp.errors.invocation_name numbers the later ones
LOG_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"  # Hydra's job-logging format, as train.py's
USAGE = f"dpddp {{{','.join(STAGES)}}} [--help] [--config FILE] [--print_config] [ARGS]"


def trainer_defaults() -> dict[str, Any]:
    """The packaged ``trainer/default.yaml``'s set values (a value given equal to Lightning's default is kept)."""
    own = {str(k): v for k, v in _packaged("trainer").items() if v is not None}
    return {**own, "sync_batchnorm": True, "use_distributed_sampler": False}


def _packaged(group: str) -> Any:
    return OmegaConf.load(str(files("dpddp.conf") / group / "default.yaml"))


class DPDDPCLI(LightningCLI):
    """``LightningCLI`` that only parses (with dpddp's arguments added); ``train`` builds everything."""

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        best = _packaged("callbacks")["model_checkpoint"]  # --monitor and --monitor_mode's defaults
        for name, kind, default, text in (
            ("--ckpt_path", str | None, None, "checkpoint, or 'last'"),
            ("--steps_per_execution", int | Literal["auto"], "auto", "optimizer steps per loop iteration, or auto"),
            ("--monitor", str | None, best.monitor, "best.ckpt's metric and the run's objective (null: no best.ckpt)"),
            ("--monitor_mode", Literal["min", "max"], best.mode, "min or max of --monitor"),
            ("--compile", bool | str, False, "torch.compile the model's forward: true, a mode, or false"),
        ):
            parser.add_argument(name, type=kind, default=default, help=text)

    @override
    def parse_arguments(self, parser: LightningArgumentParser, args: Any) -> None:
        try:
            super().parse_arguments(parser, args)
        except ArgumentError as err:
            fail(argument_error(str(err), list(args or []), list(parser.get_defaults().keys()), parser.prog))

    @override
    def instantiate_classes(self) -> None:
        pass  # train builds the model, data and Trainer from the run config


def _spec(value: Any) -> Any:
    """A jsonargparse value with its ``{class_path, init_args}`` as Hydra ``{_target_, ...}`` specs."""
    if hasattr(value, "as_dict"):
        value = value.as_dict()
    if isinstance(value, dict):
        if "class_path" in value:
            return {"_target_": value["class_path"], **_spec(dict(value.get("init_args") or {}))}
        return {k: _spec(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_spec(v) for v in value]
    return value


def run_config(parsed: Any, defaults: Any) -> DictConfig:
    """The run config (``train.py``'s schema) of the CLI's ``parsed`` values. Raises ``ConfigError``."""
    given, default = parsed.as_dict(), defaults.as_dict()
    trainer = {k: v for k, v in given["trainer"].items() if v != default["trainer"].get(k)}
    top = {k: trainer.pop(k) for k in list(trainer) if k in TOP_LEVEL}
    if isinstance(top.get("devices"), str) and top["devices"].lstrip("-").isdigit():  # the CLI's type admits str
        top["devices"] = int(top["devices"])
    for key in ("strategy", "accelerator"):
        if key in top and not isinstance(top[key], str):
            raise ConfigError(f"trainer.{key}: give a name (e.g. --trainer.{key}=ddp), not a class")
    strategy = top.pop("strategy", "auto")
    overrides = [f"strategy={strategy}"]  # the only group option the CLI chooses
    if (settings := lightning_equivalent(strategy)) is not None:  # Lightning's names: dpddp's settings for them
        overrides = list(settings)
    elif problem := (lightning_name_line(strategy, "--trainer.") or unknown_option(overrides)):
        raise ConfigError(problem if problem.startswith("--") else f"--trainer.{problem}")
    with initialize_config_module("dpddp.conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    trainer.pop("default_root_dir", None)
    logger = trainer.pop("logger", None)
    callbacks = trainer.pop("callbacks", None) or []
    update = {key: given[key] for key in ("ckpt_path", "steps_per_execution", "compile")}  # DPDDPCLI's, defaulted
    merged: Any = OmegaConf.merge(cfg, top, update, {"seed": given["seed_everything"], "trainer": trainer})
    monitor, mode = given["monitor"], given["monitor_mode"]  # DPDDPCLI's arguments, with their defaults
    if trainer.get("enable_checkpointing") is False:  # Lightning's meaning: no checkpoint callback, ours included
        merged.callbacks.model_checkpoint = merged.callbacks.last_checkpoint = None
    elif monitor is None:
        merged.callbacks.model_checkpoint = None
    else:
        merged.callbacks.model_checkpoint.monitor, merged.callbacks.model_checkpoint.mode = monitor, mode
    model, data = _spec(given["model"]), _spec(given["data"])  # each replaced whole: its class's own keys
    defaults = inspect.signature(get_class(model["_target_"])).parameters  # not a jsonargparse link: it would drop
    for key in SIZES:  # a given size from the saved config; the model's SIZES follow the data's where the class's
        if key in model and key in data and key in defaults and model[key] == defaults[key].default:
            model[key] = data[key]
    merged.model, merged.data = model, data
    if logger is False:
        merged.logger = None
    elif logger not in (None, True):
        merged.logger = _spec(logger)
    with open_dict(merged.callbacks):  # --trainer.callbacks+=pkg.Callback: beside the built-in ones
        for i, callback in enumerate(callbacks):
            merged.callbacks[f"{CLI_CALLBACKS}{i}"] = _spec(callback)
    return merged


def _output_dir(root: Path, stage: str, ckpt_path: str | None) -> tuple[Path, str | None]:
    """The run directory under ``root/lightning_logs`` and the checkpoint (``"last"`` resolved)."""
    logs = root / "lightning_logs"
    versions = sorted((p for p in logs.glob("version_*") if p.name[8:].isdigit()), key=lambda p: int(p.name[8:]))
    if ckpt_path == "last":
        with_last = [p for p in versions if (p / "checkpoints" / "last.ckpt").is_file()]
        if not with_last:
            raise ConfigError(f"--ckpt_path=last: no run under {str(logs)!r} has checkpoints/last.ckpt: fit first")
        ckpt_path = str(with_last[-1] / "checkpoints" / "last.ckpt")
        if stage == "fit":
            return with_last[-1], ckpt_path
    if in_cluster_job():  # every process of a cluster job: one name
        return logs / run_name(), ckpt_path
    return logs / f"version_{int(versions[-1].name[8:]) + 1 if versions else 0}", ckpt_path


def with_default_classes(args: list[str]) -> list[str]:
    """``args`` with the default ``--model``/``--data`` classes first where they and no ``--config`` name one."""
    if any(a in ("-c", "--config") or a.startswith(("--config=", "-c=")) for a in args):
        return args
    named = {key for key in DEFAULT_CLASSES for a in args if a.partition("=")[0] in (f"--{key}", f"--{key}.class_path")}
    return [f"--{key}={cls}" for key, cls in DEFAULT_CLASSES.items() if key not in named] + args


def main(args: list[str] | None = None) -> None:
    """Run the CLI on ``args`` (default ``sys.argv[1:]``); a known error is one line and its exit status."""
    atexit.register(gc.freeze)  # no full collections over what the run built, at exit
    args = list(sys.argv[1:] if args is None else args)
    stage, rest = (args or [""])[0], args[1:]
    output_dir: Path | None = None
    made = False  # this invocation made the run directory (rank 0)

    def resume() -> str:  # from the run's last.ckpt, or before one this command as given
        if output_dir is None or not (output_dir / "checkpoints" / "last.ckpt").is_file():
            return resume_command(["dpddp", stage], rest, (), [])
        return _resume_command(stage, rest, output_dir)

    with shell(resume):
        try:
            with stop.command(resume):  # a SIGTERM before the run or after its end: Preempted as the scope ends
                if stage in ("-h", "--help"):
                    print(f"usage: {USAGE}")
                    sys.exit(0)
                if stage not in STAGES:
                    near = difflib.get_close_matches(stage, STAGES, n=1, cutoff=0.5)
                    hint = f" (did you mean {near[0]}?)" if near else ""
                    fail(f"{stage!r} is not a subcommand{hint}: {USAGE}" if stage else f"give a subcommand: {USAGE}")
                plan, output_dir, made = _parsed(stage, rest)
                with isolated_job():
                    train(plan.cfg, output_dir, stage=stage, plan=plan)
        except Preempted as err:
            if err.path is None and made and output_dir is not None:  # no checkpoint yet: the command makes it anew
                shutil.rmtree(output_dir, ignore_errors=True)
            raise


def _parsed(stage: str, rest: list[str]) -> tuple[Plan, Path, bool]:
    """The ``Plan`` of ``stage`` with arguments ``rest``, its run directory, and whether this call made it (rank 0)."""
    # Harmless: the subcommand is taken off sys.argv here, so LightningCLI gets the rest of the same command line.
    warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended to run from within Python")
    help_only = any(a in ("-h", "--help") for a in rest)
    seed_log = logging.getLogger("lightning.fabric.utilities.seed")  # train seeds: no "Seed set" line here
    level = seed_log.level
    seed_log.setLevel(logging.WARNING)
    try:
        cli = DPDDPCLI(
            None,  # any LightningModule and LightningDataModule (LightningCLI's subclass mode)
            None,
            args=rest if help_only else with_default_classes(rest),
            trainer_defaults=trainer_defaults(),
            seed_everything_default=0,
            save_config_callback=None,
            auto_configure_optimizers=False,  # the model's own configure_optimizers (train builds the model)
            run=False,
            parser_kwargs={"prog": f"dpddp {stage}", "description": HELP, "exit_on_error": False},
        )
    finally:
        seed_log.setLevel(level)
    cfg = run_config(cli.config, cli.parser.get_defaults())
    root = Path(cli.config.trainer.default_root_dir or os.getcwd())
    output_dir, cfg.ckpt_path = _output_dir(root, stage, cfg.ckpt_path)
    cfg.predict = stage == "predict"  # predictions.csv in the run directory
    plan = check_config(cfg, stage)  # before the run directory is made: a bad setting's line is the only one
    made = False
    if rank_zero_only.rank == 0:  # type: ignore[attr-defined]
        made = not output_dir.exists()
        if why := unwritable(output_dir):  # makes it
            given = f"--trainer.default_root_dir={str(root)!r}"
            raise ConfigError(f"{given}: {str(output_dir)!r} cannot be written ({why}): give a directory you can write")
        n = len(invocations(output_dir, CONFIG)) + 1  # config.yaml, then config-1.yaml, ... (as .hydra/)
        cli.parser.save(cli.config, str(output_dir / invocation_name(CONFIG, n)), **KEEP_NONE)
        log_to(output_dir / "train.log", LOG_FORMAT)
        line = f"invocation {n} into this run directory ({stage}): {invocation_name(CONFIG, n)}"
        logging.getLogger(__name__).info(line)
    return plan, output_dir, made


def _resume_command(stage: str, rest: list[str], output_dir: Path) -> str:
    """The command that continues the run in ``output_dir`` from its ``last.ckpt``."""
    add = [f"--trainer.default_root_dir={output_dir.parent.parent}", "--ckpt_path=last"]
    return resume_command(["dpddp", stage], rest, ("--ckpt_path", "--trainer.default_root_dir"), add)


if __name__ == "__main__":
    main()
