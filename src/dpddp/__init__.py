"""dpddp: data-parallel training with Lightning and Hydra. Importing it registers the ``dp`` strategy once
``lightning.pytorch`` is imported, and imports neither torch nor Lightning itself."""

import importlib.abc
import importlib.util
import signal
import sys
from pathlib import Path
from typing import Any

_COMMAND = Path(sys.argv[0]).name  # a console script's name; python [-X ...] -m M: M, the name after -m
if _COMMAND == "-m" and "-m" in sys.orig_argv:
    _COMMAND = sys.orig_argv[sys.orig_argv.index("-m") + 1]
if _COMMAND in ("dpddp", "dpddp-train", "dpddp.cli"):
    # dpddp's own commands (the console scripts, python -m dpddp.cli), as train.py: a SIGTERM from here on is held
    # until dpddp.continuity.stop.command takes it (the imports below take seconds).
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
if _COMMAND in ("dpddp", "dpddp-train", "dpddp-check", "dpddp-eval", "dpddp.cli", "dpddp.check"):
    from dpddp.cluster import refuse_non_integer_variables  # dpddp's commands: before they import torch

    refuse_non_integer_variables()

__all__ = ["DataParallelStrategy"]

LIGHTNING = "lightning.pytorch"


class _RegisterDp(importlib.abc.MetaPathFinder):
    """Finds ``lightning.pytorch`` once, so that its import ends by registering ``dp`` (``dpddp.parallel.dp``)."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != LIGHTNING:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_register(module: Any) -> None:
            exec_module(module)
            import dpddp.parallel.dp  # noqa: F401 (registers dp)

        spec.loader.exec_module = exec_and_register  # type: ignore[method-assign]
        return spec


def __getattr__(name: str) -> Any:
    """``dpddp.DataParallelStrategy``, imported when first asked for."""
    if name != "DataParallelStrategy":
        raise AttributeError(f"module 'dpddp' has no attribute {name!r}")
    from dpddp.parallel.dp import DataParallelStrategy

    return DataParallelStrategy


if LIGHTNING in sys.modules:
    import dpddp.parallel.dp  # noqa: F401 (registers dp)
else:
    sys.meta_path.insert(0, _RegisterDp())
