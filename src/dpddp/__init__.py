"""dpddp: data-parallel training with Lightning and Hydra, from one CPU to many nodes.

Importing the package registers the ``dp`` strategy in Lightning's ``StrategyRegistry`` (``Trainer(strategy="dp")``
and ``--trainer.strategy=dp`` then work) as soon as ``lightning.pytorch`` is imported, and does nothing else (in
dpddp's own commands, it holds SIGTERM first): ``import dpddp`` imports neither torch nor Lightning, so a bad
setting is answered before them (``dpddp.entry.early``).
The layers, from the bottom up: ``errors``, ``_compat`` (Lightning's private names), ``cluster``, ``parallel``
(strategies, launcher, launched-rank entry), ``data`` and ``models`` (built-ins), ``run`` (config check, trainer
assembly, the one ``train`` function) and ``entry`` (Hydra and the Lightning CLI). Imports run one way, down.
"""

import importlib.abc
import importlib.util
import signal
import sys
from pathlib import Path
from typing import Any

if Path(sys.argv[0]).name in ("dpddp", "dpddp-train") or sys.orig_argv[1:3] == ["-m", "dpddp.cli"]:
    # dpddp's own commands (the console scripts, python -m dpddp.cli), as train.py: a SIGTERM from here on is held
    # until dpddp.continuity.stop.command takes it (the imports below take seconds).
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})

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
    """``dpddp.DataParallelStrategy``, imported (with Lightning) when it is first asked for."""
    if name != "DataParallelStrategy":
        raise AttributeError(f"module 'dpddp' has no attribute {name!r}")
    from dpddp.parallel.dp import DataParallelStrategy

    return DataParallelStrategy


if LIGHTNING in sys.modules:
    import dpddp.parallel.dp  # noqa: F401 (registers dp)
else:
    sys.meta_path.insert(0, _RegisterDp())
