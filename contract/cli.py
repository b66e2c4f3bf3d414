"""The suite's command-line parser, which every command (``pipebench run | sweep | predict | plan``)
builds on: a bad argument is one line on stderr and exit status 2, as a request judged bad is, and
every flag's help ends with its default (where it has one to show: not None, not a switch's False,
and not already said in the help's own words).

A command names itself in its usage and errors by ``prog``: ``pipebench run`` where the command
``pipebench`` runs it (``pipebench.py`` passes its name to the module's ``main``), else
``python -m runners.run`` as ``python -m`` runs it.
"""
from __future__ import annotations

import argparse
import math
import os
import tempfile
import tomllib
from pathlib import Path


def cannot_create_in(directory: Path) -> str | None:
    """Why a file cannot be made in ``directory`` (created with its parents where missing), or None:
    its nearest existing ancestor is a directory that takes a new file, tried for real (root passes
    every permission check but not a read-only or virtual file system)."""
    existing = next(a for a in (directory.absolute(), *directory.absolute().parents) if a.exists())
    if not existing.is_dir():
        return f"{existing} is not a directory"
    try:
        fd, probe = tempfile.mkstemp(dir=existing, prefix=".write-check-")
    except OSError as exc:
        return f"cannot write in {existing} ({exc.strerror})"
    os.close(fd)
    os.unlink(probe)
    return None


def cannot_write_file(path: str, flag: str) -> str | None:
    """Why a command's output file ``flag PATH`` (written at its end, its directories made) cannot be
    written, in one line, or None: judged before the command does its work, not after."""
    p = Path(path)
    if p.is_dir():
        return f"{flag} {path} is a directory, not a file"
    if why := cannot_create_in(p.parent):
        return f"{flag} {path}: {why}"
    if p.exists() and not os.access(p, os.W_OK):
        return f"{flag} {path}: not writable"
    return None


class DefaultsShown(argparse.RawDescriptionHelpFormatter):
    """Help that ends with ``(default: X)`` where the flag has a default worth showing; a description
    as written (its lines and indents kept)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text, default = action.help or "", action.default
        if (not text or default is None or default is False or default is argparse.SUPPRESS or default == []
                or "default" in text
                or (not action.option_strings and action.nargs not in ("?", "*"))):
            return action.help
        shown = ", ".join(map(str, default)) if isinstance(default, (list, tuple)) else str(default)
        return f"{text} (default: {shown.replace('%', '%%')})"


class Parser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line (exit status 2) and whose help shows defaults."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("formatter_class", DefaultsShown)
        super().__init__(*args, **kwargs)

    def error(self, message: str):  # one line on stderr, exit status 2
        self.exit(2, f"{self.prog}: error: {message}\n")


def number(kind: type, least: float, *, above: bool = False, most: float | None = None):
    """An argparse type: a finite ``kind`` (int or float) >= ``least`` (> with ``above``), <= ``most`` if given."""
    def convert(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if (value is None or not math.isfinite(value) or value < least or (above and value == least)
                or (most is not None and value > most)):
            bound = f" and <= {most:g}" if most is not None else ""
            raise argparse.ArgumentTypeError(f"takes a finite {'whole ' if kind is int else ''}number "
                                             f"{'>' if above else '>='} {least:g}{bound}, got {text!r}")
        return value
    return convert


POSITIVE_INT = number(int, 1)  # a whole number >= 1: a count (stages, devices, a batch)
NONNEGATIVE_INT = number(int, 0)  # a whole number >= 0 (warm-up steps, a context length)
POSITIVE = number(float, 0, above=True)  # a finite number > 0 (seconds of a timeout, a bandwidth)
NONNEGATIVE = number(float, 0)  # a finite number >= 0 (a delay)
PORT = number(int, 1, most=65535)  # a TCP port


def count_or_word(parse, least: int):
    """An argparse type over an option's ``parse`` (a whole number or a word, 'auto'; ValueError otherwise):
    its words as they are, its numbers only from ``least`` on; each refusal one line naming the text."""
    def convert(text: str):
        try:
            value = parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
        if isinstance(value, int) and value < least:
            raise argparse.ArgumentTypeError(f"takes a whole number >= {least} (or 'auto'), got {text!r}")
        return value
    return convert

# A GPU's device file (workload/devices), in every command that takes one; --gpu: its old name
DEVICE_FILE = ("--device-file", "--gpu")


def old_names(flags: tuple[str, ...] | list[str]) -> str:
    """What a flag's help says of its other names (``flags[1:]``): old names, kept for one release."""
    return f"; {', '.join(flags[1:])}: the old name, kept for one release" if len(flags) > 1 else ""


def toml_value(text: str):
    """A ``--set KEY=VALUE``'s VALUE: read as a TOML value (a number, a boolean, a quoted string, an array),
    else the text itself (a bare string)."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text
