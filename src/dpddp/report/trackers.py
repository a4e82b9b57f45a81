"""MLflow and W&B trackers: one tracker run per dpddp run, its id kept in ``trackers.json`` for a continue."""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import uuid
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf
from typing_extensions import override

from dpddp.errors import ConfigError, first_line
from dpddp.messages import mlflow_opt_out

IDS_FILE = "trackers.json"
"""``<run dir>/trackers.json``: ``{"mlflow": {"run_id": ..., "experiment_id": ...}, "wandb": {"id": ...}}``."""
KINDS = {"MLFlowLogger": "mlflow", "WandbLogger": "wandb"}
SWEEP_EXPERIMENT = "dpddp sweep {}"  # the experiment (W&B: group) of every job of the sweep in a directory
MLFLOW_STORE = "sqlite:///{}/mlflow.db"  # MLflow's default store, in <where dpddp runs>/outputs


def is_tracker(spec: Any) -> str | None:
    """``"mlflow"`` or ``"wandb"`` for a spec of Lightning's tracker logger, else ``None``."""
    target = str(spec.get("_target_", "")) if hasattr(spec, "get") else ""
    return KINDS.get(target.rsplit(".", 1)[-1]) if target.startswith("lightning.pytorch.loggers") else None


def kept_ids(output_dir: Path) -> dict[str, dict[str, Any]]:
    """The tracker ids kept in ``output_dir`` (empty when none). Raises ``ConfigError``: a file that does not read."""
    path = output_dir / IDS_FILE
    try:
        kept = json.loads(path.read_text())
        if isinstance(kept, dict) and all(isinstance(ids, dict) for ids in kept.values()):
            return kept
        wrong = "holds no {kind: ids} mapping"
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as err:
        wrong = f"does not read ({first_line(err, 90)})"
    raise ConfigError(
        f"{path} {wrong}: a continued run reopens the tracker runs it names: restore it, or delete it to open new ones"
    )


def _identity(output_dir: Path) -> tuple[str, str, dict[str, str]]:
    """Experiment, run name and tags, from Hydra's job when there is one."""
    if not HydraConfig.initialized():
        return "dpddp", output_dir.name, {"dpddp.run_dir": str(output_dir)}
    hydra = HydraConfig.get()
    shown = " ".join(o for o in hydra.overrides.task if not o.startswith("logger"))  # the same in every job
    tags = {"dpddp.run_dir": str(output_dir), "dpddp.overrides": " ".join(hydra.overrides.task)}
    if hydra.mode == RunMode.MULTIRUN:
        sweep = str(Path(hydra.sweep.dir))
        tags.update({"dpddp.job": str(hydra.job.num), "dpddp.sweep_dir": sweep})
        return SWEEP_EXPERIMENT.format(sweep), f"job {hydra.job.num}: {shown}".strip(), tags
    return "dpddp", str(Path(hydra.run.dir)), tags


def logger_specs(cfg: Any) -> list[tuple[str, Any]]:
    """``(key, spec)`` of each logger of ``cfg``: ``logger`` itself, or each non-null ``logger.<name>``."""
    loggers = cfg.get("logger") or {}
    if "_target_" in loggers:
        return [("logger", loggers)]
    return [(f"logger.{name}", spec) for name, spec in loggers.items() if spec]


def _mlflow_specs(configs: list[DictConfig]) -> list[tuple[str, Any]]:
    found = [(key, spec) for cfg in configs for key, spec in logger_specs(cfg) if is_tracker(spec) == "mlflow"]
    return found if found and importlib.util.find_spec("mlflow") is not None else []


def _opened(key: str, uri: str, experiment: str, artifact_location: str | None) -> None:
    """Make the SQLite store ``uri`` and ``experiment``, locked. Raises ``ConfigError`` naming ``key``: MLflow fails."""
    if not uri.startswith("sqlite:///"):
        return
    db = Path(uri.removeprefix("sqlite:///"))
    try:
        from mlflow.tracking import MlflowClient

        db.parent.mkdir(parents=True, exist_ok=True)
        with open(db.with_name(db.name + ".lock"), "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            client = MlflowClient(uri)
            if client.get_experiment_by_name(experiment) is None:
                client.create_experiment(experiment, artifact_location=artifact_location)
    except Exception as err:
        raise ConfigError(
            f"{key} (MLflow) cannot open its store {uri} ({first_line(err)}): the tracker's own failure: "
            f"give {key}.tracking_uri a store it can open"
        ) from err


def check_file_stores(configs: list[DictConfig]) -> None:
    """Raises ``ConfigError`` for an MLflow file store of ``configs`` that does not open (MLflow 3's opt-out)."""
    for key, spec in _mlflow_specs(configs):
        uri = str(spec.get("tracking_uri") or "")
        if not uri or ("://" in uri and not uri.startswith("file:")):  # the default SQLite store, a server
            continue
        try:
            from mlflow.tracking import MlflowClient

            MlflowClient(uri)
        except Exception as err:
            way_out = mlflow_opt_out(str(err))
            fix = f", or set {way_out}=true as MLflow says" if way_out else ""
            raise ConfigError(
                f"{key}.tracking_uri={uri!r}: MLflow refuses this file store ({first_line(err, 90)}...): use a "
                f"database store (sqlite:///<dir>/mlflow.db; null: outputs/mlflow.db where you run){fix}"
            ) from err


def open_stores(configs: list[DictConfig], sweep_dir: str, cwd: Path) -> None:
    """Make each MLflow store and experiment the sweep's jobs share, before they start; ``ConfigError`` if one fails."""
    for key, spec in _mlflow_specs(configs):
        uri = str(spec.get("tracking_uri") or MLFLOW_STORE.format(cwd / "outputs"))
        name = str(spec.get("experiment_name") or SWEEP_EXPERIMENT.format(sweep_dir))
        _opened(key, uri, name, spec.get("artifact_location"))


def tracker_options(kind: str, spec: DictConfig, output_dir: Path, key: str = "logger") -> dict[str, Any]:
    """Keyword arguments for the tracker ``spec`` (its own settings win): the kept id, MLflow's store (made here;
    ``ConfigError`` if it cannot be), W&B offline unless ``WANDB_MODE`` is set."""
    experiment, name, tags = _identity(output_dir)
    kept = kept_ids(output_dir).get(kind, {})
    if kind == "mlflow":
        root = (Path(HydraConfig.get().runtime.cwd) if HydraConfig.initialized() else Path.cwd()) / "outputs"
        uri = str(spec.get("tracking_uri") or MLFLOW_STORE.format(root))
        _opened(key, uri, str(spec.get("experiment_name") or experiment), spec.get("artifact_location"))
        options: dict[str, Any] = {
            "tracking_uri": MLFLOW_STORE.format(root),
            "experiment_name": experiment,
            "run_name": name,
            "tags": tags,
            "run_id": kept.get("run_id"),
        }
    else:
        options = {
            "offline": "WANDB_MODE" not in os.environ,
            "project": "dpddp",
            "group": experiment,
            "name": name,
            "tags": [f"{k}={v}"[:64] for k, v in tags.items() if k != "dpddp.run_dir"],
            "id": kept.get("id") or uuid.uuid4().hex[:12],  # known before the run opens: kept at setup
        }
    return {k: v for k, v in options.items() if spec.get(k) is None}


def _flat(config: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(config, dict):
        return {k: v for key, value in config.items() for k, v in _flat(value, f"{prefix}{key}.").items()}
    return {prefix[:-1]: config}


class TrackerRuns(pl.Callback):
    """At setup on rank 0: keeps each tracker run's id in ``IDS_FILE`` and logs ``cfg`` into a new one."""

    def __init__(self, cfg: DictConfig, output_dir: Path) -> None:
        self.cfg, self.output_dir = cfg, output_dir

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if not trainer.is_global_zero:
            return
        kept = kept_ids(self.output_dir)
        new = dict(kept)
        for logger in trainer.loggers:
            kind = KINDS.get(type(logger).__name__)
            if kind == "mlflow":
                new[kind] = {"run_id": logger.run_id, "experiment_id": logger.experiment_id}  # type: ignore[attr-defined]
            elif kind == "wandb":
                new[kind] = {"id": logger.experiment.id}  # type: ignore[attr-defined]
            if kind is not None and kind not in kept:
                logger.log_hyperparams(_flat(OmegaConf.to_container(self.cfg, resolve=True)))
        if new != kept:
            (self.output_dir / IDS_FILE).write_text(json.dumps(new, indent=2) + "\n")


def close_trackers(trainer: pl.Trainer) -> None:
    """Finish this process's W&B run (Lightning leaves it open for a sweep's next job to log into)."""
    if any(KINDS.get(type(logger).__name__) == "wandb" for logger in trainer.loggers):
        import wandb

        if wandb.run is not None:
            wandb.finish()
