"""The command line of ``train.py`` checked before Hydra reads it: each problem Hydra would end in a traceback or
many lines (modes that cannot be combined, an override its grammar cannot read, an unknown config option) is one
line for ``dpddp.errors.fail``."""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import OverrideParseException

from dpddp._compat import hydra_command_line

__all__ = ["GROUPS", "MODES", "mode_conflict", "unknown_option", "unreadable_override"]


GROUPS = ("strategy", "data", "model", "trainer", "logger", "callbacks", "experiment", "debug", "hparams_search")
"""The packaged config groups whose options ``unknown_option`` checks before Hydra composes."""


def unknown_option(argv: list[str]) -> str | None:
    """One line naming the first ``group=option`` override (sweep lists included) for which no config directory
    has ``<group>/<option>.yaml``, with the options there are; ``None`` when all exist. The directories are the
    packaged ``conf/`` and a ``--config-dir``/``-cd`` given; with ``hydra.searchpath`` overridden, or a sweep
    function (``choice(...)``, ``glob(...)``), Hydra's own check answers instead. Hydra would accept an unknown
    ``experiment=``/``debug=`` preset silently (optional groups) or print a many-line error instead."""
    dirs = [Path(str(files("dpddp.conf")))]
    for i, arg in enumerate(argv):
        if arg in ("--config-dir", "-cd") and i + 1 < len(argv):
            dirs.append(Path(argv[i + 1]))
        elif arg.startswith("--config-dir="):
            dirs.append(Path(arg.split("=", 1)[1]))
        elif "hydra.searchpath" in arg:
            return None
    for arg in argv:
        key, sep, value = arg.partition("=")
        key = key.lstrip("+~")
        if not sep or key not in GROUPS or "(" in value:
            continue
        for option in value.split(","):
            if option not in ("", "null") and not any((d / key / f"{option}.yaml").is_file() for d in dirs):
                known = sorted({p.stem for d in dirs for p in (d / key).glob("*.yaml")})
                return f"{key}={option} is unknown: choose one of {', '.join(known)}"
    return None


MODES: tuple[tuple[str, str], ...] = (("run", "--run (-r)"), ("multirun", "--multirun (-m)"), ("cfg", "--cfg (-c)"))
MODES += (("info", "--info (-i)"), ("shell_completion", "--shell-completion (-sc)"))
"""Hydra's command-line modes, of which a command takes one: the parsed flag, and its spellings."""


def mode_conflict(argv: list[str]) -> str | None:
    """One line naming the Hydra modes of ``argv`` that cannot be combined (``-m --cfg job``), or ``--resolve``
    without ``--cfg``; ``None`` when Hydra can run it as given (by Hydra's own parser:
    ``dpddp._compat.hydra_command_line``)."""
    args = hydra_command_line(argv)
    if args is None or args.help or args.hydra_help:
        return None
    given = [spelled for name, spelled in MODES if getattr(args, name) not in (None, False)]
    if len(given) > 1:
        return (
            f"{' and '.join(given)} cannot be given together: Hydra runs one of them; keep one (--cfg job prints a "
            "run's config: give one value per setting, not a sweep list)"
        )
    if args.resolve and args.cfg is None:
        return "--resolve works only with --cfg: add --cfg job (or hydra, all), or drop --resolve"
    return None


def unreadable_override(argv: list[str]) -> str | None:
    """One line naming the first override of ``argv`` that Hydra's override grammar cannot read (``model.lr=[``,
    a nested ``${...}``), with its reason; ``None`` when all can be read (``OverridesParser``, Hydra's public
    parser, which Hydra runs on the same overrides next)."""
    args = hydra_command_line(argv)
    parser = OverridesParser.create()
    for given in args.overrides if args is not None else []:
        try:
            parser.parse_overrides([given])
        except OverrideParseException as err:
            lines = [x for x in str(err).splitlines() if x and not x.startswith(("Error parsing", "See https"))]
            reason = lines[0] if lines else "not an override"
            return (
                f"{given!r} cannot be read as an override ({reason}): write key=value, quoting a value with "
                "special characters (key='a,b'); see https://hydra.cc/docs/advanced/override_grammar/basic/"
            )
    return None
