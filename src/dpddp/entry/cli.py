"""LightningCLI over the same model and data: ``python -m dpddp.cli fit --trainer.strategy=ddp ...`` or ``dpddp``.

Subcommands ``fit``, ``validate``, ``test``, ``predict``; ``--config FILE`` (repeatable), ``--print_config``,
``--seed_everything``, ``--ckpt_path``. Defaults come from the classes' signatures, the same ones the Hydra
configs repeat. ``data.batch_size`` is the global batch as in ``train.py`` (the Trainer's distributed sampler is
off), ``--trainer.strategy=dp`` works (importing ``dpddp`` registers it), and ``predict`` writes
``predictions.csv`` into the run's log directory. Here Lightning's own DDP launcher is right: it re-runs this
command line, which holds no Hydra sweep.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI, SaveConfigCallback
from lightning.pytorch.plugins.io import TorchCheckpointIO

import dpddp  # noqa: F401  (registers strategy "dp")
from dpddp.callbacks import PredictionWriter, Throughput
from dpddp.checkpoint import AtomicCheckpointIO
from dpddp.data import RandomTensorDataModule
from dpddp.model import LinearClassifier

__all__ = ["DPDDPCLI", "main"]


class VersionedSaveConfig(SaveConfigCallback):
    """Saves the config like Lightning, but never refuses a re-run into the same log directory (case 09): when
    ``config.yaml`` is there from an earlier run it writes ``config_v1.yaml``, ``config_v2.yaml``, ..."""

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        log_dir = trainer.log_dir  # a broadcast: every rank must call it, once
        if not self.already_saved and log_dir is not None:
            base = Path(self.config_filename)
            name, version = base.name, 0
            while trainer.is_global_zero and (Path(log_dir) / name).exists():
                version += 1
                name = f"{base.stem}_v{version}{base.suffix}"
            self.config_filename = trainer.strategy.broadcast(name)
        super().setup(trainer, pl_module, stage)


class DPDDPCLI(LightningCLI):
    """``LightningCLI`` with the model's sizes linked to the data's."""

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.link_arguments("data.num_features", "model.num_features")
        parser.link_arguments("data.num_classes", "model.num_classes")

    def instantiate_trainer(self, **kwargs: Any) -> pl.Trainer:
        trainer = super().instantiate_trainer(**kwargs)
        # Set here, not in trainer_defaults: a plugin instance there would make --print_config unloadable.
        if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:
            trainer.strategy.checkpoint_io = AtomicCheckpointIO()
        return trainer


def main(args: list[str] | None = None) -> None:
    """Run the CLI on ``args`` (default ``sys.argv[1:]``); a bad setting ends with one ``error:`` line, exit 2."""
    try:
        DPDDPCLI(
            LinearClassifier,
            RandomTensorDataModule,
            trainer_defaults={
                "use_distributed_sampler": False,
                "max_epochs": 10,  # as train.py (Lightning's None means 1000)
                "callbacks": [Throughput(), PredictionWriter()],
            },
            seed_everything_default=0,
            save_config_callback=VersionedSaveConfig,
            args=args,
        )
    except ValueError as err:  # ours (dp on CPU, batch not divisible) and Lightning's refusals of a setting
        print(f"error: {(str(err).splitlines() or [type(err).__name__])[0]}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
