"""Other libraries' error messages read as data, and only here: each function reads one message format of argparse
(through Hydra's parser), Hydra (composition, ``instantiate``), jsonargparse (LightningCLI's parser), Python's
``TypeError`` or torch, as written by the versions in ``dpddp._compat.CHECKED`` (jsonargparse: 4.x). It imports
nothing (``dpddp.errors`` reads torch's with it before Lightning is imported). tests/test_messages.py feeds each
the real message, made by the library at test time; the callers turn what these return into one-line errors."""

from __future__ import annotations

import re
from typing import NamedTuple

__all__ = ["JsonargparseRefusal", "argparse_choice", "dataloader_failure", "defaults_list_parent"]
__all__ += ["hydra_override_reason", "instantiate_key", "instantiate_target", "jsonargparse_refusal"]
__all__ += ["mlflow_opt_out", "omegaconf_reason", "unexpected_keyword", "without_torch_prefixes"]


def argparse_choice(message: str) -> tuple[str, str, list[str]] | None:
    """argparse's refusal of a value that is not one of an option's choices (``argument --cfg/-c: invalid choice:
    'jobb' (choose from 'job', 'hydra', 'all')``): (the option's first name, the value, the choices); else
    ``None``."""
    found = re.match(r"argument (\S+?)(?:/\S+)?: invalid choice: '(.*?)' \(choose from (.*)\)$", message)
    if found is None:
        return None
    option, value, choices = found.groups()
    return option, value, [c.strip(" '") for c in choices.split(",")]


def defaults_list_parent(first_line: str) -> str | None:
    """The config whose defaults list names a missing config group option, from the first line of Hydra's
    ``MissingConfigException`` (``In 'config': Could not find 'model/foo'``); ``None`` when an override named it."""
    found = re.match(r"In '(.+?)':", first_line)
    return found.group(1) if found else None


def instantiate_key(text: str) -> str | None:
    """The key of the node ``hydra.utils.instantiate`` failed to build, from its ``InstantiationException``'s
    text (``... full_key: data.dataset``); ``None`` for the top node (no ``full_key``)."""
    found = re.search(r"full_key: (\S+)\s*$", text)
    return found.group(1) if found else None


def instantiate_target(text: str) -> str | None:
    """The ``_target_`` named in an ``InstantiationException``'s text (``Error locating target 'pkg.Nope'``,
    ``Error in call to target 'pkg.Class'``); ``None`` when it names none."""
    found = re.search(r"target '([^']+)'", text)
    return found.group(1) if found else None


def unexpected_keyword(reason: str) -> str | None:
    """The argument a callable refused, from Python's ``TypeError`` (``__init__() got an unexpected keyword
    argument 'lr'``); else ``None``."""
    found = re.search(r"unexpected keyword argument '(\w+)'", reason)
    return found.group(1) if found else None


JSONARGPARSE_EXPECTED = re.compile(r"Expected a (?:<class '(.+)'>|typing\.Literal\[(.+?)\])")
"""jsonargparse's line for a value of the wrong type: a class's name, or a ``Literal``'s values."""


class JsonargparseRefusal(NamedTuple):
    """What a jsonargparse ``ArgumentError`` says (``jsonargparse_refusal``); a part its message lacks is ``None``."""

    group_key: str | None  # ``a.b``: a key of a ``--config`` file that its group does not accept
    key: str | None  # ``Parser key "trainer.max_epochs": <reason>``
    reason: str | None
    option: str | None  # ``Option 'x' is not accepted``
    class_path: str | None  # ``Problem with given class_path 'pkg.C'``
    expected: list[str]  # the types of ``Expected a <class 'int'>`` lines


def jsonargparse_refusal(lines: list[str]) -> JsonargparseRefusal:
    """Read jsonargparse's ``ArgumentError`` from its message's stripped lines: the first is its head, the rest its
    causes (``- `` bullets removed by the caller)."""
    head, inner = (lines or [""])[0], lines[1:]
    grouped = re.match(r"Group '(.+)' does not accept option '(.+)'", head)
    parsed = re.match(r'Parser key "(.+?)":\s*(.*)', head)

    def first(pattern: str) -> str | None:
        return next((m.group(1) for line in inner if (m := re.match(pattern, line))), None)

    return JsonargparseRefusal(
        group_key=".".join(grouped.groups()) if grouped else None,
        key=parsed.group(1) if parsed else None,
        reason=parsed.group(2) if parsed else None,
        option=first(r"Option '(.+)' is not accepted"),
        class_path=first(r"Problem with given class_path '(.+)'"),
        expected=[m.group(1) or m.group(2) for line in inner if (m := JSONARGPARSE_EXPECTED.match(line))],
    )


def omegaconf_reason(first_line: str) -> str:
    """OmegaConf's reason an interpolation did not resolve, from its error's first line, without a resolver's
    wrapper (``ValueError raised while resolving interpolation: ...``) and quotes."""
    return re.sub(r"^\w+ raised while resolving interpolation: ", "", first_line).strip('"')


def hydra_override_reason(message: str) -> str | None:
    """Why Hydra's override grammar refused an override: its ``OverrideParseException`` message's first line that is
    not the heading (``Error parsing override ...``) or the link (``See https://...``); ``None`` without one."""
    lines = [x for x in message.splitlines() if x and not x.startswith(("Error parsing", "See https"))]
    return lines[0] if lines else None


def dataloader_failure(first_line: str) -> str | None:
    """torch's ``RuntimeError`` of a stuck or dead DataLoader worker (its first line), as a phrase (``"a DataLoader
    worker sent no batch for 60.0 s"``, ``"a DataLoader worker (pid(s) 42) exited unexpectedly"``), else ``None``
    (torch 2.13's ``torch/utils/data/dataloader.py`` and its C++ SIGCHLD handler)."""
    timed_out = re.fullmatch(r"DataLoader timed out after (\S+) seconds", first_line)
    if timed_out:
        return f"a DataLoader worker sent no batch for {timed_out[1]} s"
    return f"a {first_line}" if first_line.startswith("DataLoader worker (pid") else None


def mlflow_opt_out(text: str) -> str | None:
    """The environment variable an MLflow refusal says to set to opt out of it (``... set
    `MLFLOW_ALLOW_FILE_STORE=true` to opt out of this exception``, MLflow 3.17's file store), else ``None``."""
    found = re.search(r"set `?(MLFLOW_\w+)=true`? to opt out", text)
    return found.group(1) if found else None


_WRAPPED = re.compile(r"(?:Got the following error when running the callback: \w+: )+")
"""torch's ``Future.then`` wrapping of a callback's error, once per chained callback (torch 2.13)."""

_SOURCE = re.compile(r"\[[^\]\s]+\.(?:cc|cpp|h):\d+\] ")
"""The C++ source location that torch's and gloo's messages start with (``[.../unbound_buffer.cc:81] ``)."""


def without_torch_prefixes(text: str) -> str:
    """``text`` without torch's ``Future.then`` wrappings of a callback's error and the first C++ source location
    (``[../gloo/transport/tcp/unbound_buffer.cc:81] Timed out ...``: ``Timed out ...``)."""
    return _SOURCE.sub("", _WRAPPED.sub("", text), count=1)
