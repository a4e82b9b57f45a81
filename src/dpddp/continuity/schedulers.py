"""The plateau steps Lightning skips across a stop, taken again; a restored schedule built for another limit, said."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import lightning.pytorch as pl
import torch

from dpddp.errors import first_line


def _due(trainer: pl.Trainer, epoch: int) -> list[tuple[int, Any]]:
    """``(index, config)`` of the epoch-interval plateau schedulers Lightning steps at the end of ``epoch``."""
    configs = trainer.lr_scheduler_configs if trainer.lightning_module.automatic_optimization else []
    return [
        (i, c)
        for i, c in enumerate(configs)
        if c.reduce_on_plateau and c.interval == "epoch" and (epoch + 1) % c.frequency == 0
    ]


def due_plateau_values(trainer: pl.Trainer) -> dict[int, float]:
    """``{scheduler index: monitored value}`` of the plateau steps still due at the current epoch's end."""
    metrics = trainer.callback_metrics
    return {i: float(metrics[c.monitor]) for i, c in _due(trainer, trainer.current_epoch) if c.monitor in metrics}


def take_skipped_plateau_steps(trainer: pl.Trainer, epoch: int, saved: dict[int, float]) -> None:
    """Take the plateau steps of ``epoch``'s end, with the values ``saved``, else the ones logged now."""
    module, metrics = trainer.lightning_module, trainer.callback_metrics
    for i, config in _due(trainer, epoch):
        value = saved.get(i, metrics.get(config.monitor))
        if value is not None:
            module.lr_scheduler_step(config.scheduler, value)


LIMIT_MARK = "so it cannot equal a straight run to this limit"  # in each limit_line: dpddp.check --stops finds it
LOOK_AHEAD = 3


def _stepped(scheduler: Any, build: dict[str, Any] | None = None, steps: int = 0) -> list[float | str]:
    """The first group's learning rate now and at the next ``LOOK_AHEAD`` steps (from ``build`` stepped ``steps``
    times, when given), then what a step raised; ``scheduler`` and its optimizer are left as they were."""
    groups = scheduler.optimizer.param_groups
    saved = copy.deepcopy(scheduler.state_dict()), [{k: v for k, v in g.items() if k != "params"} for g in groups]
    found: list[float | str] = []
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # step() before optimizer.step()
            if build is not None:
                scheduler.load_state_dict(copy.deepcopy(build))
                for group, lr in zip(groups, build.get("_last_lr") or [], strict=False):
                    group["lr"] = lr
                for _ in range(steps):
                    scheduler.step()
            found.append(float(groups[0]["lr"]))
            for _ in range(LOOK_AHEAD):
                scheduler.step()
                found.append(float(groups[0]["lr"]))
    except Exception as err:  # what the continued run's next step will raise
        return [*found, first_line(err)]
    finally:
        scheduler.load_state_dict(saved[0])
        for group, kept in zip(groups, saved[1], strict=True):
            group.update(kept)
    return found


def _shown(lrs: list[float | str], raised: bool = True) -> str:
    """The rates; with ``raised``, what a step raised."""
    numbers = ", ".join(f"{v:.3g}" for v in lrs if isinstance(v, float))
    error = next((v for v in lrs if isinstance(v, str)), None)
    return numbers + (f", then its step raises {error}" if error and raised else "")


def limit_line(scheduler: Any, plateau: bool, old: dict[str, Any], new: dict[str, Any]) -> str | None:
    """The warning for a restored ``scheduler`` whose first build ``old`` differs from this run's ``new``, or
    whose next rates differ from a straight run's (a ``plateau`` one: by builds only); else ``None``."""
    name, apart = type(scheduler).__name__, built_apart(old, new)
    at = int(getattr(scheduler, "last_epoch", 0))
    plateau = plateau or getattr(scheduler, "optimizer", None) is None  # not stepped here: by its builds only
    ahead = [] if plateau else _stepped(scheduler)
    straight = [] if plateau else _stepped(scheduler, new, at)
    if apart is None and ahead == straight:
        return None
    if "lr_lambdas" in new:  # LambdaLR, MultiplicativeLR: the checkpoint holds their step, not their lambdas
        why = (
            f"{name}'s lambda is code, not state: the checkpoint restores its step ({at}) and this run's lambda, "
            "built for this run's limit, takes over from there, after steps the first run's lambda took"
        )
    elif apart is not None:
        why = (
            f"{name} was built with {apart[0]} for the limit the checkpoint's run had, and this run builds "
            f"{apart[1]}: the continued run follows the first schedule"
        )
    else:
        why = f"{name} continues another schedule than a straight run to this limit takes"
    measured = f" (its learning rate from step {at}: {_shown(ahead)}; a straight run's: {_shown(straight, False)})"
    return (
        f"{why}, {LIMIT_MARK}{measured if ahead else ''}; keep the first run's "
        "limit, or use a schedule that does not depend on it"
    )


def built_apart(old: dict[str, Any], new: dict[str, Any]) -> tuple[str, str] | None:
    """Where two builds of a scheduler differ (``("total_steps=50", "total_steps=102")``), or ``None``."""
    keys = [k for k in new if k in old and not _same(old[k], new[k])]
    shown = [k for k in keys if not k.startswith("_")] or keys
    if not shown:
        return None
    return ", ".join(f"{k}={old[k]}" for k in shown), ", ".join(f"{k}={new[k]}" for k in shown)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and bool(torch.equal(a, b))
    return bool(a == b) or (a != a and b != b)  # nan equals nan here
