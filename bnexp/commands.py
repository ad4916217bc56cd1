"""Shared plumbing of the ``key=value`` subcommands (table, plot, reproduce, lrsearch, hessian, bench)."""

from __future__ import annotations

import sys
from typing import Callable, Mapping, Sequence

from bnexp.errors import BnexpError, ConfigError


def print_error(message: str) -> None:
    """Print one error paragraph to stderr."""
    print(f"bnexp: error: {message}", file=sys.stderr, flush=True)


def split_options(args: Sequence[str], defaults: Mapping[str, object]) -> tuple[dict[str, str], list[str]]:
    """``key=value`` arguments -> (the command's own options given, the rest as Hydra overrides).

    A key of ``defaults`` is an option of the command; any other key is an override.
    """
    options: dict[str, str] = {}
    overrides: list[str] = []
    for arg in args:
        key, sep, value = arg.partition("=")
        if not sep:
            raise ConfigError(f"expected key=value, got {arg!r}")
        if key in defaults:
            options[key] = value
        else:
            overrides.append(arg)
    return options, overrides


def exit_on_error(body: Callable[[], None]) -> None:
    """Run a command; a BnexpError ends it with its one-paragraph message and exit code."""
    try:
        body()
    except BnexpError as err:
        print_error(str(err))
        sys.exit(err.exit_code)
