"""The command line's checks of its input: argparse types that name the value and the
fix, and a parser whose refusal is one line and exit code 2, before anything is
created or opened.

>>> count("3"), seconds("0.5"), rates("1000,2e3")
(3, 0.5, [1000.0, 2000.0])
>>> count("-3")
Traceback (most recent call last):
...
argparse.ArgumentTypeError: '-3': pass a whole number >= 1
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from pathlib import Path


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose refusal is one line, ``PROG: MESSAGE``, and exit 2 (no
    usage block, no traceback); ``--help`` shows every option's default."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", Formatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # noqa: D102 - argparse's hook
        self.exit(2, f"{self.prog}: {message} ({self.prog} --help lists the options)\n")


class Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` with each option's default, where it has one."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default in (None, False, [], argparse.SUPPRESS) or "%(default)" in text:
            return text
        if action.option_strings or action.nargs in (argparse.OPTIONAL, argparse.ZERO_OR_MORE):
            return f"{text} (default: %(default)s)"
        return text


def refuse(prog: str, message: str) -> int:
    """Print one line naming the value and the fix; the exit code of bad input (2)."""
    print(f"{prog}: {message}", file=sys.stderr)
    return 2


def count(text: str, low: int = 1, high: int | None = None) -> int:
    """A whole number in ``[low, high]`` (argparse ``type=``)."""
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value < low or (high is not None and value > high):
        span = f">= {low}" if high is None else f"from {low} to {high}"
        raise argparse.ArgumentTypeError(f"{text!r}: pass a whole number {span}")
    return value


def count_from(low: int, high: int | None = None):
    """:func:`count` with its own bounds, e.g. ``type=count_from(0)``."""
    def check(text: str) -> int:
        return count(text, low, high)

    check.__name__ = "count"
    return check


def block_size(text: str) -> int:
    """Tokens per block: 1 to 65535 (engines use 16 to 256)."""
    try:
        return count(text, 1, 0xFFFF)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: pass the engines' tokens per block, 1 to 65535 (vLLM's default "
            "is 16)") from None


def _number(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def seconds(text: str) -> float:
    """A time in seconds, more than 0."""
    value = _number(text)
    if value is None or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: pass a number of seconds > 0")
    return value


def seconds_or_zero(text: str) -> float:
    """A time in seconds, 0 or more (0: the option is off, or no wait)."""
    value = _number(text)
    if value is None or value < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: pass a number of seconds >= 0")
    return value


def milliseconds_up_to(high: float):
    """A time in milliseconds from 0 to ``high`` (argparse ``type=``).

    >>> milliseconds_up_to(20)("5")
    5.0
    """
    def check(text: str) -> float:
        value = _number(text)
        if value is None or not 0 <= value <= high:
            raise argparse.ArgumentTypeError(
                f"{text!r}: pass a number of milliseconds from 0 to {high:g}")
        return value

    check.__name__ = "milliseconds"
    return check


def fraction(text: str) -> float:
    """A fraction in [0, 1)."""
    value = _number(text)
    if value is None or not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: pass a fraction from 0 up to (not) 1")
    return value


def positive(text: str) -> float:
    """A number more than 0."""
    value = _number(text)
    if value is None or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r}: pass a number > 0")
    return value


def rates(text: str) -> list[float]:
    """Comma-separated rates, each more than 0."""
    try:
        return [positive(part) for part in text.split(",")]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: pass rates > 0, comma-separated, e.g. 5000,10000,20000") from None


def trace(text: str) -> str:
    """A trace file that exists and is a file (mooncake-format .jsonl or .jsonl.gz)."""
    what = _unreadable(text)
    if what:
        raise argparse.ArgumentTypeError(
            f"{text!r} {what}; pass a mooncake-format .jsonl or .jsonl.gz file (omit "
            "--trace for the built-in workload)")
    return text


def _unreadable(text: str) -> str | None:
    """Why ``text`` is not a file this user may read, or None."""
    path = Path(text)
    return ("is a folder" if path.is_dir() else "does not exist" if not path.exists()
            else None if os.access(path, os.R_OK) else "cannot be read by this user")


def index_location(text: str) -> str:
    """An index: ``valkey://HOST:PORT/NAMESPACE``, an index folder, or a folder that can
    be made (its nearest existing parent a folder this user may write)."""
    from .store import check_location  # (the store's import at parse time, not at the CLI's)

    try:
        check_location(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def valkey_url(text: str) -> str:
    """A ``valkey://HOST:PORT/NAMESPACE`` URL (its form checked; nothing is reached)."""
    if "://" not in text:
        raise argparse.ArgumentTypeError(f"{text!r} is not a Valkey URL; pass "
                                         "valkey://HOST:PORT/NAMESPACE")
    index_location(text)
    return text


def shard(text: str) -> str:
    """A shard's name (``--shard``): 1 to 32 characters from [A-Za-z0-9_-]."""
    from .store import check_shard_name

    try:
        check_shard_name(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).replace("shard=", "", 1)) from None
    return text


def existing_index(text: str) -> str:
    """An index that is there: a URL, or a folder that exists."""
    index_location(text)
    if "://" not in text and not Path(text).is_dir():
        raise argparse.ArgumentTypeError(
            f"{text!r} does not exist; pass an index folder (one `sarp serve` or "
            "`sarp.open` made) or valkey://HOST:PORT/NAMESPACE")
    return text


def new_folder(text: str) -> str:
    """A folder that does not exist yet and can be made."""
    if Path(text).exists():
        raise argparse.ArgumentTypeError(f"{text!r} exists; pass a new folder (repair never "
                                         "overwrites)")
    return index_location(text)


def readable_file(text: str) -> str:
    """A file that exists and this user may read."""
    what = _unreadable(text)
    if what:
        raise argparse.ArgumentTypeError(f"{text!r} {what}; pass a file this user may read")
    return text

