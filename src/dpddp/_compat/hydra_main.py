"""Hydra's private names around ``hydra.main`` that dpddp relies on, and only here: how it reports a failure of its
search path, composition or run (``run_and_report``) and how ``instantiate`` finds a ``_target_`` (``_locate``).
Checked in hydra-core ``CHECKED`` (1.3.8); tests/test_compat.py fails when one moves."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from hydra.types import RunMode

__all__ = ["hydra_argument_error", "hydra_reported", "locate"]


class _Refused(Exception):
    pass


def hydra_argument_error(argv: list[str]) -> str | None:
    """What Hydra's own parser (``hydra._internal.utils.get_args_parser``, read by ``hydra.main`` with
    ``parse_args``: unknown options refused too) says of ``argv`` where it refuses it (``argument --cfg/-c: invalid
    choice: 'jobb' (choose from 'job', 'hydra', 'all')``: argparse's ``error`` message, without its usage and exit
    2); ``None`` where it reads it, or would act on it (``--version`` prints and exits)."""
    from hydra._internal.utils import get_args_parser

    if "--version" in argv:
        return None
    parser = get_args_parser()

    def refuse(message: str) -> None:
        raise _Refused(message)

    parser.error = refuse  # type: ignore[method-assign,assignment]
    parser.exit_on_error = False
    try:
        parser.parse_args(argv)
    except _Refused as err:
        return str(err)
    except argparse.ArgumentError as err:
        return str(err)
    return None


@contextmanager
def hydra_reported(report: Callable[[Exception], None], kinds: tuple[type[Exception], ...]) -> Iterator[None]:
    """Inside the block, ``hydra._internal.utils.run_and_report`` (which ``hydra.main``'s ``_run_hydra`` calls on
    adding ``--config-dir``, on starting, and on each run, ``--cfg`` or sweep; it prints a failure in several lines
    and exits 1) calls ``report(err)`` first for an error of ``kinds``; ``report`` may end the process
    (``SystemExit`` passes through), else Hydra reports it as before. ``--info`` (``Hydra.show_info``, which Hydra
    does not wrap, and which prints its first sections before it composes) composes first, so that an error of
    ``kinds`` is reported before anything is printed."""
    from hydra._internal import utils
    from hydra._internal.hydra import Hydra

    run_and_report, show_info = utils.run_and_report, Hydra.show_info

    def composed_first(self: Any, info: str, config_name: Any, overrides: list[str], *args: Any) -> None:
        try:
            self.compose_config(config_name, overrides, run_mode=RunMode.RUN, with_log_configuration=False)
        except kinds as err:
            report(err)
        except Exception:
            pass  # as without the block: Hydra's own --info says it
        show_info(self, info, config_name, overrides, *args)

    def reported(func: Any) -> Any:
        def call() -> Any:
            try:
                return func()
            except kinds as err:
                report(err)
                raise

        return run_and_report(call)

    utils.run_and_report, Hydra.show_info = reported, composed_first  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        utils.run_and_report, Hydra.show_info = run_and_report, show_info  # type: ignore[method-assign]


def locate(path: str) -> Any:
    """What ``hydra.utils.instantiate`` builds for ``_target_: <path>`` (``hydra._internal.utils._locate``: the
    longest importable module, then attributes), without ``hydra.utils.get_class``'s ``[HYDRA]`` log lines.

    Raises:
        ImportError: ``path`` names nothing importable (the cause chained), or is empty.
        ValueError: ``path`` has an empty part (``pkg..Class``, a relative import).
    """
    from hydra._internal.utils import _locate

    return _locate(path)
