"""Other libraries' messages read as data, only here, as the versions in ``dpddp._compat.CHECKED`` write them."""

from __future__ import annotations

import re
from typing import NamedTuple

UNUSED_PARAMETERS = "Expected to have finished reduction in the prior iteration"
"""How torch's DDP error for a parameter the last loss did not use begins (as Lightning 2.6.6 matches it)."""


def litlogger_tip(message: str) -> bool:
    """Whether a Lightning 2.6.6 log message is its "try installing litlogger" advertisement."""
    return message.startswith("💡 Tip: For seamless cloud logging")


def unused_parameters(text: str) -> bool:
    """Whether ``text`` is torch's DDP error for a parameter the last loss did not use."""
    return UNUSED_PARAMETERS in text


def argparse_choice(message: str) -> tuple[str, str, list[str]] | None:
    """``(option, value, choices)`` of argparse's ``invalid choice`` refusal, else ``None``."""
    found = re.match(r"argument (\S+?)(?:/\S+)?: invalid choice: '(.*?)' \(choose from (.*)\)$", message)
    if found is None:
        return None
    option, value, choices = found.groups()
    return option, value, [c.strip(" '") for c in choices.split(",")]


def defaults_list_parent(first_line: str) -> str | None:
    """The config whose defaults list names a missing option (Hydra's ``In '<config>': Could not find``), else None."""
    found = re.match(r"In '(.+?)':", first_line)
    return found.group(1) if found else None


def missing_primary_config(first_line: str) -> bool:
    """Whether Hydra's ``MissingConfigException`` is for the primary config (``--config-name``)."""
    return first_line.startswith("Cannot find primary config")


def instantiate_key(text: str) -> str | None:
    """The ``full_key`` of the node Hydra's ``InstantiationException`` failed to build; ``None`` for the top node."""
    found = re.search(r"full_key: (\S+)\s*$", text)
    return found.group(1) if found else None


def instantiate_target(text: str) -> str | None:
    """The ``_target_`` an ``InstantiationException`` names, else ``None``."""
    found = re.search(r"target '([^']+)'", text)
    return found.group(1) if found else None


def locating_failed(text: str) -> bool:
    """Whether an ``InstantiationException`` says its ``_target_`` could not be imported."""
    return text.startswith("Error locating target")


def unexpected_keyword(reason: str) -> str | None:
    """The argument Python's ``TypeError`` says a callable refused, else ``None``."""
    found = re.search(r"unexpected keyword argument '(\w+)'", reason)
    return found.group(1) if found else None


def named_setting(reason: str, keys: list[str]) -> str | None:
    """The one of ``keys`` an error's ``reason`` names (quoted ones first), else ``None``."""
    named = [k for k in keys if re.search(rf"\b{re.escape(k)}\b", reason)]
    quoted = [k for k in named if f"`{k}`" in reason or f"'{k}'" in reason]
    return (quoted or named)[0] if len(quoted or named) == 1 else None


class JsonargparseRefusal(NamedTuple):
    """What a jsonargparse ``ArgumentError`` says; a part its message lacks is ``None``."""

    group_key: str | None  # ``a.b``: a key of a ``--config`` file that its group does not accept
    key: str | None  # ``Parser key "trainer.max_epochs": <reason>``
    reason: str | None
    option: str | None  # ``Option 'x' is not accepted``
    class_path: str | None  # ``Problem with given class_path 'pkg.C'``
    expected: list[str]  # the types of ``Expected a <class 'int'>`` lines
    detail: str  # the first cause that is not a ``Problem with`` line
    cause: str | None  # the first that is not an ``Expected a path`` line either


def jsonargparse_refusal(lines: list[str]) -> JsonargparseRefusal:
    """Read jsonargparse's ``ArgumentError`` from its message's stripped lines (its head, then its causes)."""
    head, inner = (lines or [""])[0], lines[1:]
    grouped = re.match(r"Group '(.+)' does not accept option '(.+)'", head)
    parsed = re.match(r'Parser key "(.+?)":\s*(.*)', head)
    expected = re.compile(r"Expected a (?:<class '(.+)'>|typing\.Literal\[(.+?)\])")

    def first(pattern: str) -> str | None:
        return next((m.group(1) for line in inner if (m := re.match(pattern, line))), None)

    return JsonargparseRefusal(
        group_key=".".join(grouped.groups()) if grouped else None,
        key=parsed.group(1) if parsed else None,
        reason=parsed.group(2) if parsed else None,
        option=first(r"Option '(.+)' is not accepted"),
        class_path=first(r"Problem with given class_path '(.+)'"),
        expected=[m[1] or m[2] for line in inner if (m := expected.match(line))],
        detail=next((line for line in inner if not line.startswith("Problem with")), ""),
        cause=next((line for line in inner if not line.startswith(("Problem with", "Expected a path"))), None),
    )


def unrecognized(head: str) -> str | None:
    """The arguments argparse's (jsonargparse's) ``unrecognized arguments: ...`` line names, else ``None``."""
    return head.removeprefix("unrecognized arguments: ") if head.startswith("unrecognized arguments: ") else None


def omegaconf_reason(first_line: str) -> str:
    """OmegaConf's reason an interpolation did not resolve, without a resolver's wrapper and quotes."""
    return re.sub(r"^\w+ raised while resolving interpolation: ", "", first_line).strip('"')


def hydra_override_reason(message: str) -> str | None:
    """Why Hydra's ``OverrideParseException`` refused an override (its first line of substance), else ``None``."""
    lines = [x for x in message.splitlines() if x and not x.startswith(("Error parsing", "See https"))]
    return lines[0] if lines else None


def dataloader_failure(first_line: str) -> str | None:
    """torch's ``RuntimeError`` first line of a stuck or dead DataLoader worker as a phrase, else ``None``."""
    timed_out = re.fullmatch(r"DataLoader timed out after (\S+) seconds", first_line)
    if timed_out:
        return f"a DataLoader worker sent no batch for {timed_out[1]} s"
    return f"a {first_line}" if first_line.startswith("DataLoader worker (pid") else None


def mlflow_opt_out(text: str) -> str | None:
    """The variable an MLflow 3.17 refusal says to set ``=true`` to opt out of it, else ``None``."""
    found = re.search(r"set `?(MLFLOW_\w+)=true`? to opt out", text)
    return found.group(1) if found else None


def without_torch_prefixes(text: str) -> str:
    """``text`` without torch's ``Future.then`` wrappings and its first C++ source location (torch's, gloo's)."""
    text = re.sub(r"(?:Got the following error when running the callback: \w+: )+", "", text)
    return re.sub(r"\[[^\]\s]+\.(?:cc|cpp|h):\d+\] ", "", text, count=1)
