"""Hydra's private names around ``hydra.main`` (``run_and_report``, ``_locate``, its parser), checked in
hydra-core 1.3.8 (``CHECKED``); tests/test_compat.py fails when one moves."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from hydra.types import RunMode


def hydra_argument_error(argv: list[str]) -> str | None:
    """argparse's message where Hydra's ``get_args_parser`` refuses ``argv``; ``None`` where it reads it."""
    from hydra._internal.utils import get_args_parser

    if "--version" in argv:
        return None
    parser = get_args_parser()

    def refuse(message: str) -> None:
        raise argparse.ArgumentError(None, message)

    parser.error = refuse  # type: ignore[method-assign,assignment]
    parser.exit_on_error = False
    try:
        parser.parse_args(argv)
    except argparse.ArgumentError as err:
        return str(err)
    return None


@contextmanager
def hydra_reported(report: Callable[[Exception], None], kinds: tuple[type[Exception], ...]) -> Iterator[None]:
    """Inside it, Hydra's ``run_and_report`` and ``show_info`` call ``report(err)`` first for an error of ``kinds``."""
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
    """What ``instantiate`` builds for ``_target_: <path>``, without ``get_class``'s log lines. Raises ``ImportError``
    or ``ValueError``."""
    from hydra._internal.utils import _locate

    return _locate(path)
