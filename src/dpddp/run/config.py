"""Validation of a composed config: every bad setting becomes one ``ConfigError`` line, before any process starts.

Each message names the setting, the value and what to do instead. Unknown keys (``+devises=2``) are refused
with the closest valid key, from the signatures of the classes the keys feed (one source of truth).
"""

from __future__ import annotations

import difflib
import inspect
import math
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from hydra.utils import get_class
from omegaconf import DictConfig

from dpddp.cluster import cluster_world_size, stray_rank_variables
from dpddp.data.global_batch import GlobalBatchDataModule
from dpddp.data.random_tensors import RandomTensorDataModule
from dpddp.data.sharded import ShardedDataModule
from dpddp.data.synthetic import BLOCK
from dpddp.errors import ConfigError
from dpddp.models.classifier import Classifier
from dpddp.models.linear import OPTIMIZERS, LinearClassifier
from dpddp.run.checkpoint import checkpoint_problem

__all__ = ["allowed_keys", "check_config", "resolve_accelerator", "target_class", "world_size"]

STRATEGIES = ("auto", "dp", "ddp", "ddp_spawn")
ACCELERATORS = ("auto", "cpu", "gpu", "cuda")
TOP_LEVEL = ("strategy", "accelerator", "devices", "num_nodes", "cluster", "seed", "ckpt_path", "resume", "predict")
TOP_LEVEL_RUN = ("steps_per_execution",)  # how training runs (dpddp.run.executions)
TOP_LEVEL_OUTPUT = ("epoch_lines", "print_config")  # how a run reports progress and its config
CLUSTERS = ("auto", "kubeflow")
GROUPS = ("data", "model", "trainer", "logger", "callbacks")
# Trainer flags owned elsewhere: the top-level knobs, and what the global-batch contract and the run dir need.
TRAINER_OWNED = {
    "strategy": "set it at the top level: strategy=ddp",
    "accelerator": "set it at the top level: accelerator=cpu",
    "devices": "set it at the top level: devices=2",
    "num_nodes": "set it at the top level: num_nodes=2",
    "use_distributed_sampler": "dpddp shards each global batch itself; remove it",
    "logger": "choose a logger group: logger=csv|tensorboard|none",
    "callbacks": "use the callbacks group",
    "default_root_dir": "the run directory is Hydra's: set hydra.run.dir",
}
DDP_OPTIONS = ("process_group_backend", "timeout_s", "launch", "start_method")


def _params(fn: Any) -> list[str]:
    return [
        n
        for n, p in inspect.signature(fn).parameters.items()
        if n != "self" and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
    ]


def target_class(section: str, spec: Mapping) -> type:
    """The class a ``model`` or ``data`` section builds (its ``_target_``).

    Raises:
        ConfigError: no ``_target_``, or one that cannot be imported.
    """
    target = spec.get("_target_")
    if not target:
        raise ConfigError(f"{section}._target_ is missing: name the class to build, e.g. {section}._target_=pkg.Class")
    try:
        return get_class(str(target))
    except Exception as err:
        line = (str(err).splitlines() or [""])[0]
        raise ConfigError(f"{section}._target_={target!r} cannot be imported ({line}): check the name") from err


def allowed_keys(cfg: Mapping | None = None) -> dict[str, list[str]]:
    """Valid keys per section, from the signatures of the classes each section configures (``model`` and
    ``data``: their ``_target_``, the built-in classes when ``cfg`` is not given)."""
    ddp = list(DDP_OPTIONS) + _params(torch.nn.parallel.DistributedDataParallel.__init__)[1:]
    trainer = [k for k in _params(pl.Trainer.__init__) if k not in TRAINER_OWNED]
    model = target_class("model", cfg["model"]) if cfg else LinearClassifier
    data = target_class("data", cfg["data"]) if cfg else RandomTensorDataModule
    return {
        "": [*TOP_LEVEL, *TOP_LEVEL_RUN, *TOP_LEVEL_OUTPUT, *GROUPS],
        "data": ["_target_", *_params(data)],
        "model": ["_target_", *_params(model)],
        "trainer": trainer,
        "strategy": ["name"] + ddp,
    }


def _check_keys(section: str, keys: Iterable[str], allowed: list[str]) -> None:
    prefix = f"{section}." if section else ""
    for key in keys:
        if section == "trainer" and key in TRAINER_OWNED:
            raise ConfigError(f"trainer.{key} is not set in the trainer group: {TRAINER_OWNED[key]}")
        if key not in allowed:
            near = difflib.get_close_matches(key, allowed, n=1, cutoff=0.5)
            hint = f"did you mean {prefix}{near[0]}?" if near else f"valid keys: {', '.join(sorted(allowed))}"
            raise ConfigError(f"unknown setting {prefix}{key}: {hint}")


def _int(name: str, value: Any, low: int, fix: str, high: int | None = None) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"{name}={value!r} is not an integer: {fix}")
    if value < low or (high is not None and value > high):
        raise ConfigError(f"{name}={value!r} is invalid: {fix}")
    return value


def _float(name: str, value: Any, low: float, high: float, fix: str) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or not low <= value <= high:
        raise ConfigError(f"{name}={value!r} is invalid: {fix}")
    return float(value)


CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")  # cgroup v2, v1
PROCESS_BASE_BYTES = 600 * 2**20
"""What one training process holds before any data: torch, Lightning, Hydra (about 420 MiB RSS with the CPU
build of torch, bench/RESULTS.md; rounded up)."""


def memory_bytes() -> int:
    """Memory the processes of this run may use (bytes): the machine's physical memory, or the container's
    cgroup limit where that is lower (``memory.max``, cgroup v2; ``memory.limit_in_bytes``, v1)."""
    try:
        limit = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        limit = 16 * 2**30
    for path in CGROUP_LIMITS:
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            limit = min(limit, int(text))
    return limit


def data_bytes(num_samples: int, num_features: int, num_classes: int, batch_size: int, streaming: bool) -> int:
    """Bytes one process holds for the built-in data: in memory, ``x`` float32 ``[N, F]``, ``y`` and the
    training order int64 ``[N]``; streaming, the cached blocks (``cache_blocks`` + the one being built, of
    ``BLOCK x (F + 2)`` float32) and the block order; either way the teacher ``[F, C]`` and about three batches
    in flight (the prefetched, the gathered and the one in the step: ``3 x batch_size x F`` float32)."""
    per_batch = 3 * batch_size * num_features * 4 + num_features * num_classes * 4
    if streaming:
        return 5 * BLOCK * (num_features + 2) * 4 + num_samples // BLOCK * 8 + per_batch
    return num_samples * (4 * num_features + 16) + per_batch


def _check_memory(data: Mapping, per_node: int) -> None:
    """Case 22: what the run will hold on one node, ``per_node`` processes each with its own copy of the data,
    against ``memory_bytes()`` (80%: headroom for the allocator and the OS); the advice names settings that
    pass this same check."""
    limit = memory_bytes() * 0.8
    n, f, c, b = (data[k] for k in ("num_samples", "num_features", "num_classes", "batch_size"))
    streaming = bool(data.get("streaming"))

    def need(features: int, stream: bool) -> int:
        return per_node * (PROCESS_BASE_BYTES + data_bytes(n, features, c, b, stream))

    if need(f, streaming) <= limit:
        return
    if not streaming and need(f, True) <= limit:
        fix = "set data.streaming=true (samples generated as batches need them)"
    else:
        fits = [x for x in (f // 2**k for k in range(1, 40)) if x >= 1 and need(x, streaming) <= limit]
        rest = "use fewer processes per node (devices)" if per_node > 1 else "lower data.num_classes, data.batch_size"
        fix = f"lower data.num_features to at most {fits[0]}" if fits else rest
    sizes = f"data.num_samples={n}, data.num_features={f}, data.num_classes={c}, data.batch_size={b}"
    raise ConfigError(
        f"{sizes}, data.streaming={str(streaming).lower()} with {per_node} process(es) per node need about "
        f"{need(f, streaming) / 2**30:.1f} GiB, more than 80% of the {memory_bytes() / 2**30:.1f} GiB this "
        f"machine or container allows: {fix}"
    )


def resolve_accelerator(accelerator: str) -> str:
    """``auto`` -> ``gpu`` when CUDA is available, else ``cpu``; ``cuda`` is ``gpu``."""
    if accelerator == "auto":
        return "gpu" if torch.cuda.is_available() else "cpu"
    return "gpu" if accelerator == "cuda" else accelerator


def world_size(cfg: Mapping) -> int:
    """Processes the run will have: ``devices * num_nodes`` for DDP, 1 for ``auto`` and ``dp`` (one process).

    ``devices=-1`` counts the visible GPUs.
    """
    if cfg["strategy"]["name"] not in ("ddp", "ddp_spawn"):
        return 1
    devices = cfg["devices"] if cfg["devices"] != -1 else torch.cuda.device_count()
    return devices * cfg["num_nodes"]


def _check_devices(cfg: Mapping) -> None:
    strategy, devices, num_nodes = cfg["strategy"]["name"], cfg["devices"], cfg["num_nodes"]
    if strategy not in STRATEGIES:
        raise ConfigError(f"strategy={strategy!r} is unknown: choose one of {', '.join(STRATEGIES)}")
    if cfg["accelerator"] not in ACCELERATORS:
        raise ConfigError(f"accelerator={cfg['accelerator']!r} is unknown: choose one of {', '.join(ACCELERATORS)}")
    if devices != -1:
        _int("devices", devices, 1, "use a positive number of devices per node, or -1 for all GPUs")
    _int("num_nodes", num_nodes, 1, "use a positive number of nodes")
    accelerator = resolve_accelerator(cfg["accelerator"])
    if accelerator == "gpu" and not torch.cuda.is_available():
        raise ConfigError(f"accelerator={cfg['accelerator']} but CUDA is not available: use accelerator=cpu")
    if accelerator == "cpu" and devices == -1:
        raise ConfigError("devices=-1 (all GPUs) on CPU: give a number of CPU processes, e.g. devices=2")
    if accelerator == "gpu" and devices > torch.cuda.device_count():
        raise ConfigError(f"devices={devices} but {torch.cuda.device_count()} GPUs are visible: lower devices")
    cores = os.cpu_count() or 1
    if accelerator == "cpu" and devices > 4 * cores:
        raise ConfigError(f"devices={devices} CPU processes on {cores} cores: use at most {4 * cores}")
    if strategy == "dp" and accelerator == "cpu" and devices > 1:
        raise ConfigError(
            f"strategy=dp with devices={devices} on CPU: DataParallel replicates over CUDA GPUs in one process; "
            f"for several CPU processes use strategy=ddp devices={devices}"
        )
    if strategy in ("auto", "dp") and num_nodes > 1:
        raise ConfigError(f"num_nodes={num_nodes} needs one process per device: use strategy=ddp")
    if strategy == "auto" and devices != 1:
        raise ConfigError(f"strategy=auto runs on one device, not devices={devices}: use strategy=ddp (or dp on GPUs)")
    if cfg["cluster"] not in CLUSTERS:
        raise ConfigError(f"cluster={cfg['cluster']!r} is unknown: choose one of {', '.join(CLUSTERS)}")
    _check_strategy_options(cfg["strategy"])
    if problem := stray_rank_variables(cfg["cluster"], num_nodes):
        raise ConfigError(problem)
    cluster = cluster_world_size(cfg["cluster"])
    if cluster and strategy not in ("ddp", "ddp_spawn") and cluster[0] > 1:  # case 27
        raise ConfigError(
            f"the cluster started {cluster[0]} processes ({cluster[1]}={cluster[0]}) but strategy={strategy} runs "
            f"one, so each would train alone into the same directory: use strategy=ddp with devices x num_nodes = "
            f"{cluster[0]}"
        )
    if cluster and strategy in ("ddp", "ddp_spawn") and cluster[0] != world_size(cfg):
        raise ConfigError(
            f"devices={devices} x num_nodes={num_nodes} = {world_size(cfg)} processes, but the cluster started "
            f"{cluster[0]} ({cluster[1]}={cluster[0]}): make devices x num_nodes match the cluster's tasks"
        )


def _check_strategy_options(options: Mapping) -> None:
    if "timeout_s" in options:
        _float("strategy.timeout_s", options["timeout_s"], 1.0, 7 * 86400.0, "use seconds, e.g. strategy.timeout_s=180")
    backend = options.get("process_group_backend")
    if backend not in (None, "gloo", "nccl", "mpi", "ucc"):
        raise ConfigError(f"strategy.process_group_backend={backend!r} is unknown: use null (automatic), gloo or nccl")
    if options.get("launch", "auto") not in ("auto", "fork", "exec"):
        raise ConfigError(f"strategy.launch={options['launch']!r} is unknown: use auto, fork (CPU) or exec")
    start = options.get("start_method")
    if start not in (None, "popen"):  # Lightning's multiprocessing launchers: no SIGTERM checkpoint (case 16)
        raise ConfigError(
            f"strategy.start_method={start!r} is not offered: dpddp starts the ranks itself; remove it and choose "
            "strategy.launch=fork (CPU) or exec (a fresh interpreter per rank, as strategy=ddp_spawn does)"
        )
    for key in ("find_unused_parameters", "static_graph", "gradient_as_bucket_view"):
        if key in options and not isinstance(options[key], bool):
            raise ConfigError(f"strategy.{key}={options[key]!r} is invalid: use true or false")
    port = os.environ.get("MASTER_PORT")
    if port is not None and not (port.isdigit() and 0 < int(port) < 65536):
        raise ConfigError(f"MASTER_PORT={port!r} (environment) is not a port: unset it or use 1-65535")


def _check_data(data: Mapping, n_procs: int) -> None:
    _int("data.num_samples", data["num_samples"], 1, "use a positive number of samples")
    _int("data.num_features", data["num_features"], 1, "use a positive number of features")
    _int("data.num_classes", data["num_classes"], 2, "use at least 2 classes")
    batch = _int("data.batch_size", data["batch_size"], 1, "use a positive global batch size (samples per step)")
    _int("data.seed", data["seed"], 0, "use an integer in [0, 2**32 - 1]", high=2**32 - 1)
    for key in ("val_fraction", "test_fraction"):
        _float(f"data.{key}", data[key], 0.0, 0.9, "use a fraction in [0, 0.9]")
    if data["val_fraction"] + data["test_fraction"] >= 1:
        raise ConfigError(
            f"data.val_fraction={data['val_fraction']} + data.test_fraction={data['test_fraction']} leave no "
            "training samples: keep their sum below 1"
        )
    _float("data.label_noise", data["label_noise"], 0.0, 1.0, "use a fraction in [0, 1]")
    if not isinstance(data.get("streaming", False), bool):
        raise ConfigError(f"data.streaming={data['streaming']!r} is invalid: use true or false")
    dm = RandomTensorDataModule(**{k: v for k, v in data.items() if k != "_target_"})
    for split, size in (("val", dm.num_val), ("test", dm.num_test)):
        if size < 1:
            raise ConfigError(
                f"data.{split}_fraction={data[f'{split}_fraction']} leaves the {split} split empty with "
                f"data.num_samples={data['num_samples']}: raise data.num_samples or data.{split}_fraction"
            )
    if dm.num_train < batch:
        raise ConfigError(
            f"data.batch_size={batch} is larger than the train split ({dm.num_train} samples): lower "
            "data.batch_size or raise data.num_samples"
        )
    _check_batch(data, n_procs)


def _check_val_interval(trainer: Mapping, data: Mapping) -> None:
    """An integer ``val_check_interval`` counts training batches within an epoch (while
    ``check_val_every_n_epoch`` is set): more than an epoch has would fail inside the fit (Lightning's check)."""
    interval, every = trainer.get("val_check_interval"), trainer.get("check_val_every_n_epoch", 1)
    if not isinstance(interval, int) or isinstance(interval, bool) or every is None:
        return
    dm = RandomTensorDataModule(**{k: v for k, v in data.items() if k != "_target_"})
    batches, limit = dm.num_train // dm.batch_size, trainer.get("limit_train_batches")
    if isinstance(limit, int) and not isinstance(limit, bool):
        batches = min(batches, limit)
    elif isinstance(limit, float):
        batches = int(batches * limit)
    if interval > batches:
        raise ConfigError(
            f"trainer.val_check_interval={interval} is more than the {batches} training batches of an epoch: use at "
            f"most {batches}, a fraction of the epoch (e.g. 0.5), or set trainer.check_val_every_n_epoch=null to count "
            "batches across epochs"
        )


def _check_batch(data: Mapping, n_procs: int) -> None:
    batch = data.get("batch_size")
    if isinstance(batch, int) and batch % n_procs:
        raise ConfigError(
            f"data.batch_size={batch} (global) does not divide by the world size {n_procs} (devices x num_nodes): "
            f"use a multiple of {n_procs}"
        )


def _check_model(model: Mapping) -> None:
    if model["optimizer"] not in OPTIMIZERS:
        raise ConfigError(f"model.optimizer={model['optimizer']!r} is unknown: choose one of {', '.join(OPTIMIZERS)}")
    _float("model.lr", model["lr"], 1e-12, 1e3, "use a positive learning rate, e.g. model.lr=0.1")
    _float("model.momentum", model["momentum"], 0.0, 0.999999, "use a momentum in [0, 1)")
    _float("model.weight_decay", model["weight_decay"], 0.0, 1e3, "use a non-negative weight decay")
    for key in ("num_features", "num_classes"):
        _int(f"model.{key}", model[key], 1, f"keep model.{key}: ${{data.{key}}}")


def _check_sharding(cfg: Mapping) -> None:
    """A data module of the user's with its own loaders would run every epoch whole on every rank (case 29)."""
    data = target_class("data", cfg["data"])
    n_procs = world_size(cfg)
    if n_procs > 1 and not issubclass(data, (GlobalBatchDataModule, ShardedDataModule)):
        raise ConfigError(
            f"data._target_={cfg['data']['_target_']} would give each of the {n_procs} processes every batch of its "
            "loaders: shard them with data=sharded +data.module._target_=<that class> (its batch_size becomes the "
            "global batch), or build it on dpddp.data.global_batch.GlobalBatchDataModule"
        )


# Settings that cannot keep the promises with steps_per_execution > 1: (setting, the values that can, why).
EXECUTION_LIMITS = (
    ("trainer.accumulate_grad_batches", (None, 1), "an execution takes one optimizer step per global batch"),
    ("trainer.gradient_clip_val", (None, 0), "Lightning clips only under automatic optimization"),
    ("trainer.val_check_interval", (None, 1.0), "validation runs at epoch ends"),
    ("trainer.limit_train_batches", (None, 1.0), "an epoch is all its global batches"),
    ("strategy", ("auto", "ddp", "ddp_spawn"), "DataParallel would split an execution's steps over its devices"),
)


def _check_executions(cfg: Mapping) -> None:
    """``steps_per_execution``: a positive integer; above 1, the ``EXECUTION_LIMITS`` and the data checked."""
    k = _int("steps_per_execution", cfg.get("steps_per_execution", 1), 1, "use a positive number, e.g. 16")
    if k == 1:
        return
    for name, ok, why in EXECUTION_LIMITS:
        section, _, key = name.rpartition(".")
        value = (cfg[section] or {}).get(key) if section else cfg["strategy"]["name"]
        if value not in ok:
            raise ConfigError(
                f"{name}={value!r} cannot be kept with steps_per_execution={k} ({why}): remove it, or use "
                "steps_per_execution=1"
            )
    if not issubclass(target_class("data", cfg["data"]), GlobalBatchDataModule):
        raise ConfigError(
            f"steps_per_execution={k} needs global-batch data (data._target_={cfg['data']['_target_']} is not a "
            "dpddp.data.global_batch.GlobalBatchDataModule): use steps_per_execution=1"
        )


SIXTEEN_BIT = (
    *("16", "bf16", "16-mixed", "bf16-mixed", "16-true", "bf16-true"),
    *("transformer-engine", "transformer-engine-float16"),
)


def _check_precision(cfg: Mapping) -> None:
    """Promise 1 at 16 bits: each process (or dp replica) rounds its own share of the gradient to 16 bits before
    they are summed, so the weights drift from one process's: 2 processes, bf16-mixed, 36 Adam steps of the contract
    test's run ended 4e-4 away (1e-7 at 32 bits), the gradient of one step 5e-4 (relative 3e-3)."""
    precision = str((cfg["trainer"] or {}).get("precision"))
    dp = cfg["strategy"]["name"] == "dp"
    replicas = (torch.cuda.device_count() if cfg["devices"] == -1 else cfg["devices"]) if dp else world_size(cfg)
    if precision in SIXTEEN_BIT and replicas > 1:
        where = f"{replicas} GPUs under strategy=dp" if dp else f"{replicas} processes"
        raise ConfigError(
            f"trainer.precision={precision} with {where}: each rounds its own share of every gradient to 16 bits, "
            "so the weights drift from one process's (4e-4 in 36 steps, not 1e-5): use trainer.precision=32-true, "
            f"or one device with trainer.precision={precision}"
        )


def check_config(cfg: DictConfig | Mapping, stage: str = "fit") -> None:
    """Check a composed config (see ``conf/``) for ``stage``; return nothing, or raise one ``ConfigError`` line.

    Raises:
        ConfigError: an unknown key, a value out of range, a batch size that does not divide by the world size,
            a device request this machine cannot meet, a cluster whose world size differs from
            ``devices * num_nodes``, or a ``ckpt_path`` that does not exist, cannot be read, has finished more
            epochs than ``trainer.max_epochs``, or (``resume=true``) was trained with other data settings, or (a fit)
            with another ``steps_per_execution``.
    """
    _check_keys("", [str(k) for k in cfg.keys()], [*TOP_LEVEL, *TOP_LEVEL_RUN, *TOP_LEVEL_OUTPUT, *GROUPS])
    keys = allowed_keys(cfg)
    for section in ("data", "model", "trainer", "strategy"):
        _check_keys(section, (cfg[section] or {}).keys(), keys[section])
    _check_devices(cfg)
    _int("seed", cfg["seed"], 0, "use an integer in [0, 2**32 - 1]", high=2**32 - 1)
    if target_class("data", cfg["data"]) is RandomTensorDataModule:
        _check_data(cfg["data"], world_size(cfg))  # after the devices: the world size needs them valid
        _check_val_interval(cfg["trainer"] or {}, cfg["data"])
        _check_memory(cfg["data"], world_size(cfg) // cfg["num_nodes"] if world_size(cfg) > 1 else 1)
    else:
        _check_batch(cfg["data"], world_size(cfg))
    _check_sharding(cfg)
    _check_executions(cfg)
    if issubclass(target_class("model", cfg["model"]), Classifier):  # the built-in models
        _check_model(cfg["model"])
    for key in ("num_features", "num_classes"):  # linked settings (case 18)
        if key in cfg["model"] and key in cfg["data"] and cfg["model"][key] != cfg["data"][key]:
            raise ConfigError(
                f"model.{key}={cfg['model'][key]!r} differs from data.{key}={cfg['data'][key]!r}: set data.{key} "
                f"only (model.{key} follows it)"
            )
    overfit = (cfg["trainer"] or {}).get("overfit_batches") or 0
    if overfit:  # case 14: Lightning swaps the training sampler for a sequential one, and the global batch is lost
        raise ConfigError(
            f"trainer.overfit_batches={overfit!r} is not offered: Lightning replaces the training sampler for it; "
            f"use trainer.limit_train_batches={overfit!r} trainer.limit_val_batches={overfit!r} instead"
        )
    _check_precision(cfg)
    accumulate = (cfg["trainer"] or {}).get("accumulate_grad_batches")
    if accumulate is not None:
        _int("trainer.accumulate_grad_batches", accumulate, 1, "use a positive number of batches per optimizer step")
    clip = (cfg["trainer"] or {}).get("gradient_clip_val")
    if clip is not None:
        _float("trainer.gradient_clip_val", clip, 0.0, math.inf, "use a non-negative norm or value, or null")
    for key in ("max_epochs", "max_steps"):
        value = (cfg["trainer"] or {}).get(key)
        if value is not None and value != -1:
            _int(f"trainer.{key}", value, 1, "use a positive number, or -1 for no limit")
    ckpt = cfg["ckpt_path"]
    if ckpt is not None and not Path(str(ckpt)).is_file():
        raise ConfigError(
            f"ckpt_path={str(ckpt)!r} does not exist: give a checkpoint file, e.g. <run dir>/checkpoints/last.ckpt"
        )
    max_epochs = (cfg["trainer"] or {}).get("max_epochs")
    data = dict(cfg["data"]) if cfg.get("resume") else None  # resume=true continues the same run: same data
    k = cfg.get("steps_per_execution", 1) if stage == "fit" else None
    if ckpt is not None and (problem := checkpoint_problem(ckpt, max_epochs, data, k)):
        raise ConfigError(f"ckpt_path={str(ckpt)!r} {problem}")
