"""``dpddp-check``: is data parallelism working here? One process against ``ddp`` on 2 (and ``dp`` over 2+ GPUs):
promise 1 as the same math in 64 bits and a drift within rounding; exit 0 when it holds, 1 with one ``error:`` line
when not, 2 for a bad setting. ``--stops``: promise 3."""

from __future__ import annotations

import argparse
import copy
import logging
import math
import os
import platform
import random
import signal
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from hydra import compose, initialize_config_dir
from hydra.errors import HydraException
from hydra.utils import instantiate
from lightning_utilities.core.apply_func import apply_to_collection
from omegaconf import DictConfig

from dpddp._compat import hydra_override_refused
from dpddp.cluster import launch_environment, master_address, register_resolvers
from dpddp.continuity.state import LIMIT_MARK, built_apart
from dpddp.diagnostics.network import choose_interface
from dpddp.entry.command_line import refused_override
from dpddp.entry.run_dir import hydra_value
from dpddp.errors import EXIT_PREEMPTED, ConfigError, PromiseBroken, first_line, shell
from dpddp.report.curves import write_plot
from dpddp.run.draws_seen import draws_line, find_draws
from dpddp.run.executions import execution_steps
from dpddp.run.training import isolated_job, train

TOLERANCE = 1e-5  # the rounding bound's floor: ddp drifts from one process at most BOUND x max(this, the scale)
BOUND = 3.0
SAME_MATH = 1e-9  # promise 1 in 64 bits: ddp and dp end with one process's weights to this, relative to the largest
SIXTY_FOUR = "trainer.precision=64-true"
PICTURE = "check.png"  # the trainings' curves per epoch (write_plot), in the working directory
TINY = ["trainer.max_epochs=2", "logger=none", "epoch_lines=false", "trainer.enable_progress_bar=false"]


def overrides_of(group: str, values: list[str]) -> list[str]:
    """Hydra overrides for ``--model``/``--data`` values: ``mlp`` -> ``model=mlp``, ``key=v`` -> ``model.key=v``."""
    found = []
    for value in values:
        key, sep, _ = value.partition("=")
        bare = key.lstrip("+~")
        if not sep:
            found.append(f"{group}={value}")
        elif bare == group or bare.startswith(f"{group}."):
            found.append(value)
        else:
            found.append(f"{key[: len(key) - len(bare)]}{group}.{value.lstrip('+~')}")
    return found


def _version(name: str) -> str:
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def environment_lines() -> list[str]:
    """The versions, the devices, the interface gloo/NCCL would use and the launcher variables set."""
    versions = [f"Python {platform.python_version()}", f"torch {torch.__version__}"]
    versions += [f"{n} {_version(n)}" for n in ("lightning", "hydra-core", "dpddp")]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    gpus = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
    shown = ", ".join(f"cuda:{i} {p.name} {p.total_memory / 2**30:.0f} GiB" for i, p in enumerate(gpus)) or "none"
    _, why = choose_interface(master_address()[0] or "127.0.0.1")
    seen = [f"{k}={v}" for k, v in launch_environment().items()]
    return [
        "versions: " + ", ".join(versions),
        f"devices: {cores} CPU cores usable (of {os.cpu_count()}); GPUs: {shown}",
        f"network: {why}; backends: gloo {torch.distributed.is_gloo_available()}, "
        f"nccl {torch.distributed.is_nccl_available()}",
        "launcher variables: " + (" ".join(seen) or "none (one machine, dpddp starts the ranks)"),
    ]


def _compose(overrides: list[str], config_dir: str | None) -> DictConfig:
    """The config ``dpddp-train`` composes after ``TINY``; ``ConfigError`` (``dpddp-train``'s line) if it cannot."""
    extra = [f"hydra.searchpath=[file://{Path(config_dir).absolute()}]"] if config_dir else []
    try:
        with initialize_config_dir(config_dir=str(Path(__file__).parent / "conf"), version_base="1.3"):
            with hydra_override_refused(_refused):
                return compose(config_name="config", overrides=[*TINY, *overrides, *extra])
    except HydraException as err:
        line = (str(err).splitlines() or [type(err).__name__])[0]
        known = getattr(err, "options", None)  # a group option none of the config directories has
        raise ConfigError(f"{line}: choose one of {', '.join(known)}" if known else line) from err


def _refused(override: Any, cfg: DictConfig, err: Exception) -> None:
    raise ConfigError(refused_override(override, cfg, err)) from err


def _weights(run_dir: Path) -> tuple[dict[str, torch.Tensor], int]:
    ckpt = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    state = {k: v for k, v in ckpt["state_dict"].items() if v.is_floating_point()}
    return state, int(ckpt["global_step"])


def _difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> tuple[float, str]:
    """The largest absolute difference of two state dicts and its entry (``inf``: the keys, or a NaN on one side)."""
    if a.keys() != b.keys():
        return float("inf"), "the state dict's keys"
    diffs = {k: _gap(a[k], b[k]) for k in a}
    worst = max(diffs, key=diffs.__getitem__, default="")
    return diffs.get(worst, 0.0), worst


def _train(cfg: DictConfig, run_dir: Path) -> dict[str, Any]:
    with isolated_job(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return train(cfg, run_dir)


def _draws(cfg: DictConfig, stepped: bool = False) -> str:
    """``; <draws_line>`` for the config's model, or why not; ``stepped``: none found is said too."""
    with isolated_job():
        pl.seed_everything(int(cfg.seed), workers=True, verbose=False)
        draws = find_draws(instantiate(cfg.model, _convert_="all"), instantiate(cfg.data, _convert_="all"))
    if isinstance(draws, str):
        return f"; no training step could run outside the fit to find draws from the global random streams ({draws})"
    if draws or not stepped:
        return f"; {draws_line(draws)}" if draws else ""
    return (
        "; no module drew from the global random streams in a training step: the model's computation depends on "
        "the process (its rank, the world size or its share of the batch)"
    )


def _side_run(overrides: list[str], config_dir: str | None, run_dir: Path) -> tuple[dict[str, torch.Tensor], int] | str:
    """The final weights and step of a training this model may not allow (64 bits, micro-batches), or why not."""
    run_dir.mkdir()
    try:
        _train(_compose(overrides, config_dir), run_dir)
    except Exception as err:  # a setting refused for this model, a model that cannot run in 64 bits: said, not fatal
        return first_line(err)
    return _weights(run_dir)


def _same_math(rows: list[dict[str, Any]], sixty_four: list[tuple[dict[str, torch.Tensor], int] | str]) -> list[str]:
    """Each replicated training's 64-bit line; sets ``row["math"]`` (or ``None``: not measured) and ``row["apart"]``."""
    one, lines = sixty_four[0], []
    for row, found in zip(rows[1:], sixty_four[1:], strict=True):
        why = found if isinstance(found, str) else one if isinstance(one, str) else ""
        row["math"], row["apart"] = None, False
        if why:
            lines.append(f"same math, in 64 bits: {row['name']} not measured ({why})")
            continue
        assert not isinstance(found, str) and not isinstance(one, str)
        diff, where = _difference(found[0], one[0])
        largest = max((w.double().abs().max().item() for w in one[0].values() if w.numel()), default=0.0)
        relative = diff / max(largest, 1e-30)
        row["math"] = (diff, relative, where, found[1], one[1])
        row["apart"] = relative > SAME_MATH or found[1] != one[1]
        steps = f", step {found[1]} against {one[1]}" if found[1] != one[1] else ""
        verdict = "NOT the same math" if row["apart"] else "the same math"
        lines.append(
            f"same math, in 64 bits: {row['name']} ends {diff:.1e} from one process ({relative:.1e} of the largest "
            f"weight; tolerance {SAME_MATH:.0e}){steps}: {verdict}"
        )
    return lines


def _rounding(
    rows: list[dict[str, Any]],
    scaled: tuple[dict[str, torch.Tensor], int] | str,
    wide: tuple[dict[str, torch.Tensor], int] | str,
    precision: str,
) -> str:
    """The rounding line (the scale from ``scaled``, else ``wide``; each drift against its bound); sets ``bound``."""
    if isinstance(scaled, str) and isinstance(wide, str):
        for row in rows[1:]:
            row["bound"] = TOLERANCE
        return f"rounding, in {precision}: the scale not measured ({scaled}; {wide}); the bound is {TOLERANCE:.0e}"
    against = wide if isinstance(scaled, str) else scaled
    assert not isinstance(against, str)
    scale, _ = _difference(against[0], rows[0]["weights"])
    how = f"one process summing its batch in 2 micro-batches ends {scale:.1e} from itself (the scale)"
    if isinstance(scaled, str):
        how = f"one process ends {scale:.1e} from its 64-bit run (the scale; 2 micro-batches: {scaled})"
    parts = []
    for row in rows[1:]:
        row["bound"] = BOUND * max(TOLERANCE, scale)
        ratio = f"{row['diff'] / scale:.2f}x the scale" if scale else "the scale is 0"
        inside = "rounding" if row["diff"] <= row["bound"] else "beyond rounding"
        inside = "not rounding: in 64 bits another computation" if row.get("apart") else inside
        parts.append(f"{row['name']} drifts {row['diff']:.1e} ({ratio}; bound {row['bound']:.1e}): {inside}")
    return f"rounding, in {precision}: {how}; bound {BOUND:g} x max({TOLERANCE:.0e}, scale); {'; '.join(parts)}"


def check(overrides: list[str], config_dir: str | None, work: Path) -> None:
    """Print the report and draw ``PICTURE``. Raises ``ConfigError`` and ``PromiseBroken`` (promise 1 fails)."""
    print(*environment_lines(), sep="\n")
    gpus, on = torch.cuda.device_count(), "gpu" if torch.cuda.device_count() >= 2 else "cpu"
    runs = [("1 process", 1, "auto"), ("ddp(2)", 2, "ddp"), *([(f"dp({gpus})", gpus, "dp")] if gpus >= 2 else [])]
    rows: list[dict[str, Any]] = [
        {"name": name, "replicas": count, "settings": [f"accelerator={on}", f"strategy={how}", f"devices={count}"]}
        for name, count, how in runs
    ]
    for row in rows:
        row["cfg"] = _compose([*row["settings"], *overrides], config_dir)
    for i, row in enumerate(rows):
        run_dir = work / str(i)  # a sweep's job directory to write_plot, labelled by its overrides
        (run_dir / ".hydra").mkdir(parents=True)  # the launched ranks log into it from their start
        (run_dir / ".hydra" / "overrides.yaml").write_text("".join(f"- {s}\n" for s in row["settings"]))
        result = _train(row["cfg"], run_dir)
        row["weights"], row["step"] = _weights(run_dir)
        share = result.get("allreduce_share")
        row["allreduce_share"] = share if isinstance(share, float) and not math.isnan(share) else None
        row.update({k: result.get(k) for k in ("precision", "samples_per_sec", "peak_mem_mib")})
    print(f"{'training':<10} {'samples/s':>10} {'scaling':>8} {'peak MiB':>9} {'all-reduce':>10} {'steps':>6} ", end="")
    print(f"{'max |w - w1|':>13}")
    for row in rows:
        row["diff"], row["where"] = _difference(row["weights"], rows[0]["weights"])
        share = f"{row['allreduce_share']:.0%}" if row["allreduce_share"] is not None else "-"
        scaling = row["samples_per_sec"] / (row["replicas"] * rows[0]["samples_per_sec"])
        print(
            f"{row['name']:<10} {row['samples_per_sec']:>10,.0f} {scaling:>8.0%} {row['peak_mem_mib']:>9,.0f} "
            f"{share:>10} {row['step']:>6} {row['diff']:>13.1e}"
        )
    sixty_four = [
        _side_run([*row["settings"], *overrides, SIXTY_FOUR], config_dir, work / f"wide{i}")
        for i, row in enumerate(rows)
    ]
    print(*_same_math(rows, sixty_four), sep="\n")  # a line for each replicated training
    half = f"data.micro_batch_size={max(int(rows[0]['cfg'].data.batch_size) // 2, 1)}"
    scaled = _side_run([*rows[0]["settings"], *overrides, half], config_dir, work / "micro")
    print(_rounding(rows, scaled, sixty_four[0], rows[0]["precision"]))
    math_apart = [r for r in rows[1:] if r["apart"]]
    drifting = [r for r in rows[1:] if r["diff"] > r["bound"] or r["step"] != rows[0]["step"]]
    print(f"promise 1 (the same math as one process; in {rows[0]['precision']}, a drift within rounding): ", end="")
    print("holds" if not (math_apart or drifting) else "does NOT hold")
    print(f"picture: {write_plot(work, Path(PICTURE).absolute())}")
    if math_apart:
        row = math_apart[0]
        diff, relative, where, step, one_step = row["math"]
        steps = f" and step {step} against {one_step}" if step != one_step else ""
        raise PromiseBroken(
            f"promise 1 does not hold for this model: in 64 bits {row['name']} ends {diff:.1e} from one process's "
            f"weights ({relative:.1e} of the largest weight; tolerance {SAME_MATH:.0e}; the largest in {where})"
            f"{steps}: another computation, not rounding{_draws(_compose(overrides, config_dir), stepped=True)}"
        )
    if drifting:
        row = drifting[0]
        steps = f" and step {row['step']} against {rows[0]['step']}" if row["step"] != rows[0]["step"] else ""
        same = " (in 64 bits the same math: rounding this model amplifies)" if row["math"] else ""
        raise PromiseBroken(
            f"promise 1 does not hold for this model: {row['name']} ends {row['diff']:.1e} from one process's weights "
            f"(bound {row['bound']:.1e}; the largest in {row['where']}){steps}{same}"
            f"{'' if row['math'] else _draws(_compose(overrides, config_dir))}"
        )


STOPS_TOLERANCE = 1e-6  # promise 3: a continued run ends with the straight run's state to this
ONE_PROCESS = ["accelerator=cpu", "strategy=auto", "devices=1"]
STOP_CALLBACK = "+callbacks.check_stop._target_=dpddp.check.StopAt"
RECORD = "check_stops.pt"
# train.py's program: SIGTERM held from the first line until the entry point takes it.
PROGRAM = "import signal; signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM}); "
PROGRAM += "from dpddp.entry.hydra import main; main()"
OWN_PACKAGES = ("lightning", "pytorch_lightning", "dpddp", "torch")
NUMBERS = (bool, int, float, torch.Tensor)  # a user's callback's attributes compared at the end
WALL_CLOCK = ("Timer",)  # callbacks whose state is time measured (trainer.max_time's): never equal, not compared


class StopAt(pl.Callback):
    """Sends this process ``signal`` (``""``: none) before global step ``step + 1``; writes ``RECORD`` at the end."""

    def __init__(self, signal: str = "", step: int = -1) -> None:
        self.signal, self.step = signal, step
        self.epoch_starts: list[int] = []

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_step:
            self.epoch_starts.append(trainer.global_step)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, *args: Any) -> None:
        steps = execution_steps(batch, getattr(trainer.datamodule, "steps_per_execution", 1))  # type: ignore[attr-defined]
        if self.signal and trainer.global_step <= self.step < trainer.global_step + steps:
            os.kill(os.getpid(), getattr(signal, self.signal))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        callbacks = trainer.callbacks  # type: ignore[attr-defined]
        users = [cb for cb in callbacks if type(cb).__module__.split(".")[0] not in OWN_PACKAGES]
        numbers = {cb.state_key: {k: v for k, v in vars(cb).items() if isinstance(v, NUMBERS)} for cb in users}
        attributes = apply_to_collection(numbers, torch.Tensor, lambda t: t.detach().cpu())
        record = {"epoch_starts": self.epoch_starts, "attributes": attributes}
        record["restored"] = {cb.state_key: _read_keys(cb) for cb in callbacks}
        record["schedulers"] = [type(c.scheduler).__name__ for c in trainer.lr_scheduler_configs]
        torch.save(record, Path(trainer.default_root_dir) / RECORD)


class _Reads(dict):
    """A ``state_dict`` that records the keys read from it (a ``dict``, for loads that check that)."""

    get, items, values = Mapping.get, Mapping.items, Mapping.values  # type: ignore[assignment]  # via __getitem__

    def __init__(self, state: dict) -> None:
        super().__init__(state)
        self.read: set = set()

    def __getitem__(self, key: Any) -> Any:
        self.read.add(key)
        return super().__getitem__(key)

    def __iter__(self) -> Any:  # not dict's own: dict.update(this) and **this then read through __getitem__
        return super().__iter__()


def _read_keys(callback: pl.Callback) -> list[str] | None:
    """The keys of ``callback``'s ``state_dict`` its ``load_state_dict`` reads (on a copy); ``None`` if it raised."""
    state = _Reads(callback.state_dict())
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            copy.copy(callback).load_state_dict(state)
    except Exception:  # a load that needs more than its own state: every key compared
        return None
    return sorted(str(k) for k in state.read)


def _leaves(value: Any, name: str, run_dir: Path) -> dict[str, Any]:
    """``value`` flattened to its leaves by dotted name; ``run_dir`` in a string or key reads ``<run>``."""
    if isinstance(value, (dict, list, tuple)):
        items = value.items() if isinstance(value, dict) else enumerate(value)
        found: dict[str, Any] = {}
        for key, item in items:
            key = str(key).replace(str(run_dir), "<run>")
            found.update(_leaves(item, f"{name}.{key}" if name else key, run_dir))
        return found
    return {name: value.replace(str(run_dir), "<run>") if isinstance(value, str) else value}


def _gap(a: Any, b: Any) -> float:
    """Two leaves' largest absolute difference (numbers, tensors; equal NaN: 0), else 0 when equal or ``inf``."""
    numbers = (bool, int, float)
    if not all(isinstance(v, torch.Tensor) for v in (a, b)) and not all(isinstance(v, numbers) for v in (a, b)):
        return 0.0 if type(a) is type(b) and a == b else math.inf
    x, y = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    if x.shape != y.shape:
        return math.inf
    gaps = torch.where((x == y) | (x.isnan() & y.isnan()), 0.0, (x - y).abs()).nan_to_num(math.inf)
    return float(gaps.max()) if gaps.numel() else 0.0


def _pieces(ckpt: dict, restored: dict[str, list[str] | None]) -> dict[str, Any]:
    """A checkpoint's pieces in compared order (no ``WALL_CLOCK`` callback; of one in ``restored``, its keys)."""
    found = {"weights": ckpt.get("state_dict"), "optimizer": ckpt.get("optimizer_states")}
    found["schedulers"] = ckpt.get("lr_schedulers")
    for key, state in (ckpt.get("callbacks") or {}).items():
        read = restored.get(key)
        if key not in WALL_CLOCK:
            found[f"callbacks.{key}"] = {k: v for k, v in state.items() if k in read} if read is not None else state
    found["random"] = (ckpt.get("dpddp") or {}).get("random")
    return found


def compare(straight: Path, continued: Path, kind: str, cause: str = "") -> tuple[float, str | None]:
    """Two run directories' ``last.ckpt`` compared: the largest gap, and the first leaf apart's line or ``None``."""
    ckpts = [
        torch.load(d / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
        for d in (straight, continued)
    ]
    records = [
        torch.load(d / RECORD, weights_only=True) if (d / RECORD).is_file() else {} for d in (straight, continued)
    ]
    restored = records[0].get("restored", {})
    ours, theirs = (_pieces(c, restored) for c in ckpts)
    worst = 0.0
    for name in [*ours, *(n for n in theirs if n not in ours)]:  # a piece on one side only: its leaves missing
        left, right = _leaves(ours.get(name), "", straight), _leaves(theirs.get(name), "", continued)
        gaps = {k: _gap(left[k], right[k]) for k in left if k in right}
        missing = [k for k in [*left, *right] if (left.get(k) is None) != (right.get(k) is None)]
        where = missing[0] if missing else max(gaps, key=gaps.__getitem__, default="")
        if missing or gaps.get(where, 0.0) > STOPS_TOLERANCE:
            steps = [int(c["global_step"]) for c in ckpts]
            side = "continued" if left.get(where) is not None else "straight"
            apart = f"missing in the {side} run" if missing else f"{gaps[where]:.2g} apart"
            line = f"{name}: {where + ' ' if where else ''}{apart} after a {kind} continue"
            line += f" (at step {steps[1]} against {steps[0]})" if steps[0] != steps[1] else ""
            own = name.startswith("callbacks.")  # its state holds what differs: no attribute left out
            cause = cause or _schedule_cause(ckpts, records[0]) or ("" if own else _attribute_cause(records))
            return gaps.get(where, math.inf), f"{cause}; first apart: {line}" if cause else line
        worst = max(worst, gaps.get(where, 0.0))
    return worst, None


def _schedule_cause(ckpts: list[dict], record: dict) -> str:
    """The line on the first LR scheduler the continued run built for another limit, or ``""``."""
    builds = [(c.get("dpddp") or {}).get("schedules") or [] for c in ckpts]
    names = record.get("schedulers", [])
    for i, (straight, continued) in enumerate(zip(*builds, strict=False)):
        apart = built_apart(continued, straight)
        if apart:
            name = f"lr_schedulers.{i}" + (f" ({names[i]})" if i < len(names) else "")
            return (
                f"{name} was built with {apart[0]} for the stopped run's limit and with {apart[1]} for the straight "
                "run's: the continued run follows the first schedule; keep the limit, or use a schedule that does not "
                "depend on it"
            )
    return ""


def _attribute_cause(records: list[dict]) -> str:
    """The line for the first user's callback attribute apart in the two ``StopAt`` records, or ``""``."""
    if not all(records):
        return ""
    ours, theirs = (r["attributes"] for r in records)
    for key, numbers in ours.items():
        for name, value in numbers.items():
            if name in theirs.get(key, {}) and (apart := _gap(value, theirs[key][name])) > STOPS_TOLERANCE:
                return (
                    f"callbacks.{key}: its {name} is {apart:.2g} apart at the end, and its state_dict does not "
                    "restore it: keep it in the callback's state_dict and load_state_dict"
                )
    return ""


def _entry_point(args: list[str], expect: int, what: str) -> None:
    """Run train.py's entry point with ``args``. Raises ``RuntimeError`` (its last line) unless it exits ``expect``."""
    proc = subprocess.run([sys.executable, "-c", PROGRAM, *args], capture_output=True, text=True)
    if proc.returncode != expect:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise RuntimeError(f"the {what} run ended with exit {proc.returncode}, not {expect}: {last}")


def check_stops(overrides: list[str], config_dir: str | None, work: Path) -> None:
    """``--stops``: the run straight, then stopped 3 ways and continued; ``ConfigError``, ``PromiseBroken``."""
    base = [*overrides, *ONE_PROCESS, STOP_CALLBACK]
    straight = work / "straight"
    straight.mkdir()
    cfg = _compose(base, config_dir)
    _train(cfg, straight)
    total = _weights(straight)[1]
    starts = torch.load(straight / RECORD, weights_only=True)["epoch_starts"]
    if not starts or total < 3:
        raise ConfigError(
            f"--stops needs 2 epochs and 3 steps or more (this run: {total} steps in {len(starts) + 1} "
            f"epoch{'s' if starts else ''}): set trainer.max_epochs=2 or more"
        )
    rng = random.Random(int(cfg.seed))
    limit, kill = rng.randint(1, total - 1), rng.randint(starts[0], total - 1)
    term = rng.choice([s for s in range(1, total - 1) if s not in starts] or [1])
    print(
        f"stops: the straight run takes {total} steps; a limit at step {limit}, a SIGTERM before step {term + 1}, "
        f"a SIGKILL before step {kill + 1}"
    )
    program = [*(["--config-dir", str(Path(config_dir).absolute())] if config_dir else []), *TINY, *base]
    signalled = {"SIGTERM": (term, EXIT_PREEMPTED), "SIGKILL": (kill, -signal.SIGKILL)}

    def stop_and_continue(kind: str, run_dir: Path) -> None:
        where = f"hydra.run.dir={hydra_value(str(run_dir))}"
        if kind in signalled:
            step, status = signalled[kind]
            stop = [f"+callbacks.check_stop.signal={kind}", f"+callbacks.check_stop.step={step}", where]
            _entry_point([*program, *stop], status, f"{kind}-stopped")
        else:
            run_dir.mkdir()
            _train(_compose([*base, f"trainer.max_steps={limit}"], config_dir), run_dir)
        if kind == "SIGTERM":
            _entry_point([*program, "resume=true", where], 0, "continued")
        else:
            again = _compose(base, config_dir)
            again.ckpt_path = str(run_dir / "checkpoints" / "last.ckpt")
            _train(again, run_dir)

    for kind in ("limit", "SIGTERM", "SIGKILL"):
        run_dir = work / kind.lower()
        with _schedule_lines() as said:  # a continue's line on a schedule built for another limit: the cause
            try:
                stop_and_continue(kind, run_dir)
            except Exception as err:
                if said:  # e.g. OneCycleLR stepped past the total it was built with
                    raise PromiseBroken(f"{said[0]}; the {kind} continue then failed: {first_line(err)}") from err
                raise
        gap, problem = compare(straight, run_dir, kind, said[0] if said else "")
        if problem is not None:
            raise PromiseBroken(problem)
        print(f"stops: {kind} continued equals the straight run (max diff {gap:.2g})")


@contextmanager
def _schedule_lines() -> Iterator[list[str]]:
    """The lines an in-process continue says about a schedule built for another limit (``LIMIT_MARK``)."""
    said: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: said.append(record.getMessage()) if LIMIT_MARK in record.getMessage() else None  # type: ignore[method-assign]
    logger = logging.getLogger("dpddp.continuity")
    level = logger.level
    logger.setLevel(logging.WARNING)
    logger.addHandler(handler)
    try:
        yield said
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def main(argv: list[str] | None = None) -> None:
    """``python -m dpddp.check [--stops] [--model M ...] [--data D ...] [--config-dir DIR] [key=value ...]``."""
    parser = argparse.ArgumentParser(prog="python -m dpddp.check", description=__doc__)
    parser.add_argument("--model", action="append", default=[], help="model option or key=value (repeatable)")
    parser.add_argument("--data", action="append", default=[], help="data option or key=value (repeatable)")
    parser.add_argument("--config-dir", help="a directory of your own configs (model/, data/), as dpddp-train's")
    parser.add_argument("--stops", action="store_true", help="promise 3: the run stopped 3 ways and continued")
    parser.add_argument("--env", action="store_true", help="print the environment for a bug report, and exit")
    parser.add_argument("overrides", nargs="*", help="other Hydra overrides (trainer.max_epochs=3, seed=1)")
    args = parser.parse_args(argv)
    if args.env:
        lines = [f"platform: {platform.platform()}", *environment_lines()]
        print("Paste this into your bug report:\n\n```text\n" + "\n".join(lines) + "\n```")
        return
    overrides = [*overrides_of("model", args.model), *overrides_of("data", args.data), *args.overrides]
    register_resolvers()
    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "dpddp"):
        logging.getLogger(name).setLevel(logging.ERROR)
    with tempfile.TemporaryDirectory(prefix="dpddp-check-", ignore_cleanup_errors=True) as tmp:
        with shell(crash="a check training failed"):  # a failed training: one line, the cause
            (check_stops if args.stops else check)(overrides, args.config_dir, Path(tmp))


if __name__ == "__main__":
    main()
