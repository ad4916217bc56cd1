"""Shared plumbing of the ``key=value`` subcommands (table, plot, reproduce, lrsearch, hessian, bench)."""

from __future__ import annotations

import gc
import re
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Mapping, Sequence

from bnexp.support.errors import BnexpError, ConfigError

OUT_ELSEWHERE = "choose another place with out=PATH"  # when an output cannot be written


def print_error(message: str) -> None:
    """Print one error paragraph to stderr."""
    print(f"bnexp: error: {message}", file=sys.stderr, flush=True)


def print_warning(message: str) -> None:
    """Print one warning line to stderr (the command goes on)."""
    print(f"bnexp: warning: {message}", file=sys.stderr, flush=True)


# reStructuredText in docstrings: a parenthesized cross-reference, a role, an inline literal
_REFERENCE = re.compile(r" ?\((?::\w+:`[^`]+`(?:, )?)+\)")
_ROLE = re.compile(r":\w+:`~?(?:([^`<]*?) <[^`]*>|([^`]*))`")
_LITERAL = re.compile(r"``(.+?)``", re.DOTALL)


def plain_text(doc: str) -> str:
    """A docstring for the terminal (``--help``): cross-references in parentheses dropped,
    other roles as the name they show (``:func:`~a.b``` -> ``b``), inline literals bare."""
    def role(found: re.Match[str]) -> str:
        text = found.group(1) or found.group(2) or ""
        return text.rsplit(".", 1)[-1] if "`~" in found.group(0) else text

    return _LITERAL.sub(r"\1", _ROLE.sub(role, _REFERENCE.sub("", doc)))


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


def run_dir_argument(args: Sequence[str], usage: str) -> Path:
    """The run directory a command's first argument names (bnexp's directory names hold
    ``=``, so it is not taken for an option); a ConfigError with ``usage`` otherwise."""
    if not args or not Path(args[0]).is_dir():
        raise ConfigError(f"usage: {usage}{f' ({args[0]!r} is no directory)' if args else ''}")
    return Path(args[0])


@contextmanager
def output_errors(what: str, then: str) -> Iterator[None]:
    """An OSError in the block (a read-only folder, a full disk) as one ConfigError line:
    ``what`` (naming the file and folder), the OS's reason, then ``then`` (what to do)."""
    try:
        yield
    except OSError as err:
        raise ConfigError(f"{what} ({type(err).__name__}: {err.strerror or err}): {then}") from None


@contextmanager
def cycles_uncollected() -> Iterator[None]:
    """Run a short command that makes many objects and few cycles (``bnexp table``: a value
    per key of each run, hundreds of thousands for a table of 1,350 runs) without Python's
    cyclic garbage collector: every full collection would walk all of them again, a tenth of
    such a command's time. Reference counting frees what it drops, as always. After the block
    what is left is frozen (:func:`gc.freeze`): the command ends there, and the collection
    Python makes as it exits, another fifth, walks only what came after."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        if enabled:
            gc.enable()


def exit_on_error(body: Callable[[], None]) -> None:
    """Run a command; a BnexpError ends it with its one-paragraph message and exit code."""
    try:
        body()
    except BnexpError as err:
        print_error(str(err))
        sys.exit(err.exit_code)
