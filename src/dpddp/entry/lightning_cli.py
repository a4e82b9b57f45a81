"""The Lightning CLI entry point: ``dpddp fit --trainer.strategy=ddp --trainer.devices=2`` (``python -m dpddp.cli``).

LightningCLI parses the subcommands ``fit``, ``validate``, ``test``, ``predict`` and every ``--trainer.*``,
``--model.*``, ``--data.*`` argument; the parsed values become the config ``train.py`` composes, run by
``dpddp.run.training.train``: the same checks, strategies, outputs and errors. A run's directory is
``<default_root_dir>/lightning_logs/version_<N>/`` (under torchrun or SLURM, the cluster's run name), with each
invocation's ``config.yaml``, ``config-1.yaml``, ... ``fit`` trains, then tests the final weights;
``--ckpt_path=last`` continues the newest run in its own directory.
"""

from __future__ import annotations

import atexit
import gc
import logging
import os
import sys
import warnings
from importlib.metadata import version
from pathlib import Path
from typing import Any

from hydra import compose, initialize_config_module
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, OmegaConf
from typing_extensions import override

from dpddp.cluster import run_name
from dpddp.data.random_tensors import RandomTensorDataModule
from dpddp.errors import KNOWN, ConfigError, exit_on, invocation_name, invocations, log_to, resume_command
from dpddp.models.linear import LinearClassifier
from dpddp.run.training import STAGES, isolated_job, train

__all__ = ["DPDDPCLI", "main", "run_config"]


def _version(package: str) -> tuple[int, ...]:
    """The installed ``package``'s (major, minor)."""
    return tuple(int(part) for part in version(package).split(".")[:2])


# jsonargparse 4.49 renamed ArgumentParser.save's skip_none to skip_unset (the old name warns, and goes in 5.0).
KEEP_NONE = {"skip_unset" if _version("jsonargparse") >= (4, 49) else "skip_none": False}
TOP_LEVEL = {"strategy": "strategy", "accelerator": "accelerator", "devices": "devices", "num_nodes": "num_nodes"}
CONFIG = "config.yaml"  # the first invocation's config; dpddp.errors.invocation_name numbers the later ones
LOG_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"  # Hydra's job-logging format, as train.py's


class DPDDPCLI(LightningCLI):
    """``LightningCLI`` that parses only: the model's sizes linked to the data's, ``--ckpt_path`` added, and no
    class instantiated (``dpddp.run.training.train`` builds everything, as for ``train.py``)."""

    @override
    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("data.num_features", "model.num_features")
        parser.link_arguments("data.num_classes", "model.num_classes")
        parser.add_argument("--ckpt_path", type=str | None, default=None, help="checkpoint, or 'last'")
        parser.add_argument(
            "--steps_per_execution", type=int, default=1, help="optimizer steps per Lightning loop iteration"
        )

    @override
    def instantiate_classes(self) -> None:
        """Nothing to build here: ``train`` builds the model, data and Trainer from the run config."""


def _spec(value: Any) -> dict[str, Any]:
    """A jsonargparse ``{class_path, init_args}`` as a Hydra ``{_target_, ...}`` spec."""
    value = value if isinstance(value, dict) else vars(value)
    return {"_target_": value["class_path"], **dict(value.get("init_args") or {})}


def _plain(namespace: Any) -> dict[str, Any]:
    return namespace.as_dict() if hasattr(namespace, "as_dict") else dict(namespace)


def run_config(parsed: Any, defaults: Any) -> DictConfig:
    """The run config (``train.py``'s schema) of the CLI's parsed values ``parsed`` (parser defaults:
    ``defaults``).

    Raises:
        ConfigError: a trainer value the run cannot take (a strategy or accelerator object).
    """
    given, default = _plain(parsed), _plain(defaults)
    trainer = {k: v for k, v in given["trainer"].items() if v != default["trainer"].get(k)}
    top = {TOP_LEVEL[k]: trainer.pop(k) for k in list(trainer) if k in TOP_LEVEL}
    if isinstance(top.get("devices"), str) and top["devices"].lstrip("-").isdigit():  # the CLI's type admits str
        top["devices"] = int(top["devices"])
    for key in ("strategy", "accelerator"):
        if key in top and not isinstance(top[key], str):
            raise ConfigError(f"trainer.{key}: give a name (e.g. --trainer.{key}=ddp), not a class")
    overrides = [f"strategy={top.pop('strategy', 'auto')}"]
    with initialize_config_module("dpddp.conf", version_base="1.3"):
        cfg = compose(config_name="config", overrides=overrides)
    trainer.pop("default_root_dir", None)
    logger = trainer.pop("logger", None)
    callbacks = trainer.pop("callbacks", None) or []
    model_cls, data_cls = LinearClassifier, RandomTensorDataModule
    update: dict[str, Any] = {
        **top,
        "seed": given.get("seed_everything", 0),
        "ckpt_path": given.get("ckpt_path"),
        "steps_per_execution": given.get("steps_per_execution", 1),
        "model": {"_target_": f"{model_cls.__module__}.{model_cls.__qualname__}", **given["model"]},
        "data": {"_target_": f"{data_cls.__module__}.{data_cls.__qualname__}", **given["data"]},
        "trainer": trainer,
    }
    merged = OmegaConf.merge(cfg, update)
    assert isinstance(merged, DictConfig)
    if logger is False:
        merged.logger = None
    elif logger not in (None, True):
        merged.logger = _spec(logger)
    for i, callback in enumerate(callbacks):
        merged.callbacks[f"cli_{i}"] = _spec(callback)
    return merged


def _output_dir(root: Path, stage: str, ckpt_path: str | None) -> tuple[Path, str | None]:
    """The run directory under ``root/lightning_logs`` and the checkpoint (``"last"`` resolved; see the module)."""
    logs = root / "lightning_logs"
    versions = sorted(
        (p for p in logs.glob("version_*") if p.name[8:].isdigit()), key=lambda p: int(p.name[8:])
    )  # fmt: skip
    if ckpt_path == "last":
        with_last = [p for p in versions if (p / "checkpoints" / "last.ckpt").is_file()]
        if not with_last:
            raise ConfigError(f"--ckpt_path=last: no run under {str(logs)!r} has checkpoints/last.ckpt: fit first")
        ckpt_path = str(with_last[-1] / "checkpoints" / "last.ckpt")
        if stage == "fit":
            return with_last[-1], ckpt_path
    if "RANK" in os.environ or "SLURM_JOB_ID" in os.environ:  # every process of a cluster job: one name
        return logs / run_name(), ckpt_path
    return logs / f"version_{int(versions[-1].name[8:]) + 1 if versions else 0}", ckpt_path


def main(args: list[str] | None = None) -> None:
    """Run the CLI on ``args`` (default ``sys.argv[1:]``); a known error ends it in one line with its exit status
    (``dpddp.errors.exit_on``)."""
    atexit.register(gc.freeze)  # no full collections over what the run built, at exit
    args = list(sys.argv[1:] if args is None else args)
    if not args or args[0] not in STAGES:
        print(f"usage: dpddp {{{','.join(STAGES)}}} [--help] [--config FILE] [--print_config] [ARGS]", file=sys.stderr)
        sys.exit(2)
    stage, rest = args[0], args[1:]
    # Harmless: the subcommand is taken off sys.argv here, so LightningCLI gets the rest of the same command line.
    warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended to run from within Python")
    cli = DPDDPCLI(
        LinearClassifier,
        RandomTensorDataModule,
        trainer_defaults={"use_distributed_sampler": False, "max_epochs": 10},  # as train.py
        seed_everything_default=0,
        save_config_callback=None,
        run=False,
        args=rest,
        parser_kwargs={"prog": f"dpddp {stage}"},
    )
    output_dir = Path()
    try:
        cfg = run_config(cli.config, cli.parser.get_defaults())
        root = Path(cli.config.trainer.default_root_dir or os.getcwd())
        output_dir, cfg.ckpt_path = _output_dir(root, stage, cfg.ckpt_path)
        cfg.predict = stage == "predict"  # predictions.csv in the run directory
        if rank_zero_only.rank == 0:  # type: ignore[attr-defined]
            output_dir.mkdir(parents=True, exist_ok=True)
            n = len(invocations(output_dir, CONFIG)) + 1  # config.yaml, then config-1.yaml, ... (as .hydra/)
            cli.parser.save(cli.config, str(output_dir / invocation_name(CONFIG, n)), **KEEP_NONE)
            log_to(output_dir / "train.log", LOG_FORMAT)
            logging.getLogger(__name__).info(
                f"invocation {n} into this run directory ({stage}): {invocation_name(CONFIG, n)}"
            )
        with isolated_job():
            train(cfg, output_dir, stage=stage)
    except KNOWN as err:
        exit_on(err, lambda: _resume_command(stage, rest, output_dir))


def _resume_command(stage: str, rest: list[str], output_dir: Path) -> str:
    """The command that continues the run in ``output_dir`` from its ``last.ckpt``."""
    add = [f"--trainer.default_root_dir={output_dir.parent.parent}", "--ckpt_path=last"]
    return resume_command(["dpddp", stage], rest, ("--ckpt_path", "--trainer.default_root_dir"), add)


if __name__ == "__main__":
    main()
