"""The README and the pages in docs/: the README stays short, every relative link resolves (to a file, and to a
heading where it names one), and every ``python train.py`` command they show composes and passes the config check
(in-process, through Hydra's compose API), and runs with limits appended (a ddp command as train.py's processes,
the others through train.py's calls in this process), as does every Lightning CLI command of their code blocks.
``python -m dpddp.check`` (test_check.py) and ``python -m dpddp.plot`` (test_progress.py)
are run by their own tests."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import torch
from conftest import ROOT, cli_here, compose_cfg, run_cli, run_train, train_py_here

from dpddp.errors import ConfigError
from dpddp.run.config import check_config

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^\s*```")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
SPAN = re.compile(r"`([^`]+)`")

# Commands the docs show that the compose API cannot check here, each with why (the key is the command as found).
SKIPPED = {
    "python train.py strategy=dp devices=2 accelerator=gpu": "another machine: CUDA GPUs",
    "python train.py strategy=ddp devices=4 num_nodes=2": "another machine: 2 nodes, started by hand on each",
    "python train.py strategy=ddp devices=1 num_nodes=<replicas> cluster=kubeflow": "a PyTorchJob's pods; a "
    "placeholder",
    "python train.py -m hydra/launcher=slurm strategy=ddp devices=4 num_nodes=2 seed=0,1": "a SLURM cluster",
    "python train.py resume=true hydra.run.dir=outputs/<date>/<time> trainer.max_epochs=20": "a placeholder",
    "python train.py ckpt_path=outputs/<date>/<time>/checkpoints/last.ckpt trainer.max_epochs=20": "a placeholder",
    "python train.py -m (sweeps)": "a setting's name in the supported-settings table, not a command",
}


def _blocks(text: str) -> tuple[list[str], list[str]]:
    """The text's fenced code blocks, and the rest in paragraphs (lines joined, so an inline span may wrap)."""
    code, prose, block, para, fenced = [], [], [], [], False
    for line in text.splitlines():
        if FENCE.match(line):
            if fenced:
                code.append("\n".join(block))
                block = []
            fenced = not fenced
        elif fenced:
            block.append(line)
        elif line.strip():
            para.append(line.strip())
            continue
        if para:
            prose.append(" ".join(para))
            para = []
    if para:
        prose.append(" ".join(para))
    return code, prose


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but ``-`` and ``_`` dropped, spaces as ``-``."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a page, a repeated heading's with GitHub's ``-1``, ``-2``, ... suffixes."""
    seen: dict[str, int] = {}
    code, _ = _blocks(path.read_text())
    fenced = {line for block in code for line in block.splitlines()}
    for line in path.read_text().splitlines():
        m = re.match(r"#{1,6} (.+)", line)
        if m and line not in fenced:
            base = slug(m.group(1))
            seen[base] = seen.get(base, -1) + 1
            seen.setdefault(f"{base}-{seen[base]}" if seen[base] else base, 0)
    return set(seen)


def links(path: Path) -> list[str]:
    """The page's relative link targets, outside code."""
    _, prose = _blocks(path.read_text())
    found = [t for para in prose for t in LINK.findall(SPAN.sub("", para))]
    return [t for t in found if not re.match(r"[a-z]+:", t)]


def _command(text: str) -> str:
    """``text`` with its spaces normalised and without the environment it sets (``OMP_NUM_THREADS=1 python ...``)."""
    return re.sub(r"^(\w+=\S*\s+)+", "", " ".join(text.split()))


def commands(path: Path) -> list[tuple[str, str | None]]:
    """Each ``python train.py ...`` command of a page (in a code block, in a table cell or in prose, in
    backticks), with the ``error:`` line a code block shows after it, if any."""
    code, prose = _blocks(path.read_text())
    found: list[tuple[str, str | None]] = []
    for block in code:
        lines = block.replace("\\\n", " ").splitlines()
        for i, line in enumerate(lines):
            for part in re.split(r"\s*(?:&&|;)\s*", line.strip().removeprefix("$ ")):
                part = _command(re.sub(r"\s+#.*", "", part))
                if part.startswith("python train.py"):
                    after = lines[i + 1] if i + 1 < len(lines) else ""
                    found.append((part, after if after.startswith("error: ") else None))
    for para in prose:
        found += [(c, None) for c in map(_command, SPAN.findall(para)) if c.startswith("python train.py")]
    return found


def _first(value: str) -> str:
    """A sweep value's first choice: ``1,2`` -> ``1`` (a comma inside brackets or quotes stays)."""
    depth, quote = 0, ""
    for i, ch in enumerate(value):
        if quote:
            quote = "" if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "[{(":
            depth += 1
        elif ch in "]})":
            depth -= 1
        elif ch == "," and depth == 0:
            return value[:i]
    return value


def overrides(command: str) -> list[str]:
    """The Hydra overrides of a ``python train.py`` command; a sweep's (``-m``) with each value's first choice."""
    args = shlex.split(command)[2:]
    sweep = bool({"-m", "--multirun"} & set(args))
    args = [a for a in args if a not in ("-m", "--multirun")]
    assert all("=" in a and not a.startswith("-") for a in args), f"{command}: not only overrides (add to SKIPPED)"
    return [f"{a.split('=', 1)[0]}={_first(a.split('=', 1)[1])}" if sweep else a for a in args]


FOUND = {(page.name, cmd, error) for page in PAGES for cmd, error in commands(page)}
CHECKED = sorted(f for f in FOUND if f[1] not in SKIPPED)


def test_the_readme_is_at_most_25_kib():
    size = (ROOT / "README.md").stat().st_size
    assert size <= 25 * 1024, f"README.md is {size} bytes: move a part to a page in docs/ and link it"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_resolves(page):
    assert page.name == "README.md" or "../README.md" in links(page), f"{page.name} links no way back to the README"
    for target in links(page):
        file, _, anchor = target.partition("#")
        path = (page.parent / file).resolve() if file else page
        assert path.exists(), f"{page.name}: [{target}] names no file"
        if anchor:
            assert path.suffix == ".md" and anchor in anchors(path), f"{page.name}: [{target}] names no heading"


def test_the_slugs_are_githubs():
    assert slug("Tiny steps: `steps_per_execution`") == "tiny-steps-steps_per_execution"
    assert slug("DP or DDP?") == "dp-or-ddp"
    assert slug("Config knobs (`src/dpddp/conf/`)") == "config-knobs-srcdpddpconf"


def test_the_skipped_commands_are_still_shown():
    shown = {cmd for _, cmd, _ in FOUND}
    assert set(SKIPPED) <= shown, f"no longer in the docs: {set(SKIPPED) - shown}"
    assert len(CHECKED) >= 10


@pytest.mark.parametrize(("page", "command", "error"), CHECKED, ids=[f"{p}: {c}" for p, c, _ in CHECKED])
def test_every_command_composes_and_passes_the_config_check(page, command, error, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a relative path a command names (hydra.run.dir=outputs/mine) is a fresh one
    cfg = compose_cfg(*overrides(command))
    if error is None:
        check_config(cfg)
    else:  # the page shows the line a refused setting gives
        with pytest.raises(ConfigError) as refused:
            check_config(cfg)
        assert f"error: {refused.value}" == error


def same_run(command: str) -> tuple[str, ...]:
    """What a command runs: its arguments, in order, without ``accelerator=cpu`` where there is no CUDA (``auto``
    resolves to ``cpu`` there: ``rules.resolve_accelerator``)."""
    cpu = () if torch.cuda.is_available() else ("accelerator=cpu",)
    return tuple(sorted(a for a in shlex.split(command)[2:] if a not in cpu))


RUNS: dict[tuple[str, ...], tuple[str, str, None]] = {}
for _page, _command_shown, _error in CHECKED:
    if _error is None and "compile=" not in _command_shown:
        RUNS.setdefault(same_run(_command_shown), (_page, _command_shown, None))
RUN = list(RUNS.values())
"""The commands that run (a refused one's line is checked above), each run for real by the next test; a command
shown on several pages (or with ``accelerator=cpu`` added, on a machine without CUDA) runs once, under the first
page that shows it."""
LIMITS = ["trainer.max_steps=32", "trainer.limit_val_batches=2", "trainer.limit_test_batches=2"]
LIMITS += ["trainer.enable_progress_bar=false", "hydra.run.dir=run", "hydra.sweep.dir=sweep"]


@pytest.mark.slow
@pytest.mark.parametrize(("page", "command", "error"), RUN, ids=[f"{p}: {c}" for p, c, _ in RUN])
def test_every_command_runs(page, command, error, tmp_path, monkeypatch):
    """Each command as a user types it, in a fresh directory, with limits appended so that it ends soon (32 steps,
    2 validation and test batches; a sampling sweep: 2 trials): exit 0, and each run's ``metrics.json``. A ddp
    command runs as train.py's processes; the others run train.py's calls in this process. The commands that
    compile are left to ``test_compile.py``."""
    args = shlex.split(command)[2:] + LIMITS + (["hydra.sweeper.n_trials=2"] if "optuna" in command else [])
    if "strategy=ddp" in args:
        run_train(*args, cwd=tmp_path, timeout=300, check=True)
    else:
        assert train_py_here(*args, cwd=tmp_path, monkeypatch=monkeypatch) == 0
    found = sorted(tmp_path.rglob("metrics.json"))
    assert found and all(json.loads(p.read_text())["world_size"] >= 1 for p in found)


CLI_SKIPPED = {
    "mine.": "the template project's classes: test_bring_your_own.py runs dpddp fit --model=mine.TwoLayerNet",
    "=PATH": "a placeholder",
    "--compile=true": "test_compile.py runs compile=true",
}
CLI_LIMITS = ["--trainer.max_steps=32", "--trainer.limit_val_batches=2", "--trainer.limit_test_batches=2"]
CLI_LIMITS += ["--trainer.enable_progress_bar=false"]


def cli_blocks(path: Path) -> list[list[str]]:
    """The Lightning CLI commands (``dpddp <stage> ...``, ``python -m dpddp.cli <stage> ...``) of each of the page's
    code blocks, in order, without comments and ``PYTHONPATH=.``."""
    code, _ = _blocks(path.read_text())
    found = []
    for block in code:
        lines = [_command(re.sub(r"\s+#.*", "", line)) for line in block.splitlines()]
        found.append([c for c in lines if re.match(r"(dpddp|python -m dpddp\.cli) (fit|validate|test|predict)\b", c)])
    return [b for b in found if b]


CLI_RUN = [
    (page.name, i, runs)
    for page in PAGES
    for i, block in enumerate(cli_blocks(page))
    if (runs := [c for c in block if not any(mark in c for mark in CLI_SKIPPED)])
]


@pytest.mark.slow
@pytest.mark.parametrize(("page", "index", "block"), CLI_RUN, ids=[f"{p}: block {i}" for p, i, _ in CLI_RUN])
def test_every_cli_command_runs(page, index, block, tmp_path, monkeypatch, capsys):
    """Each code block's Lightning CLI commands, in its order, in one fresh directory (``> my.yaml`` writes the file
    the next reads), with limits appended: exit 0, and a run's ``metrics.json`` for each fit. A ddp command runs as
    typed (``python -m dpddp.cli`` or the console script); the others run the CLI's ``main`` in this process. The
    commands of ``CLI_SKIPPED`` are left to the tests it names."""
    fits = 0
    for command in block:
        head, _, out = command.partition(" > ")
        args = shlex.split(head)
        script = args[0] != "python"  # the dpddp console script, else python -m dpddp.cli
        args = args[1:] if script else args[3:]  # the stage and what follows
        printing = "--print_config" in args
        args += [] if printing else CLI_LIMITS
        if "--trainer.strategy=ddp" in args:
            printed = run_cli(*args, cwd=tmp_path, script=script, timeout=300, check=True).stdout
        else:
            capsys.readouterr()
            assert cli_here(*args, cwd=tmp_path, monkeypatch=monkeypatch) == 0
            printed = capsys.readouterr().out
        if out:
            (tmp_path / out.strip()).write_text(printed)
        fits += args[0] == "fit" and not printing
    assert len(list(tmp_path.glob("lightning_logs/version_*/metrics.json"))) == fits > 0
