"""Byte-level text corpora, each with a held-out split (the text the eval loss is measured on and
no step ever trains on). Token id = byte value (needs vocab_size >= 256).

- ``stdlib``: the Python standard library's own sources, present wherever Python is, no download:
  the top-level ``*.py`` files of the running interpreter's stdlib directory, in sorted order of
  their names; every tenth file (sorted index 9, 19, ...) is held out, the rest are the training
  text. Each file's bytes end with a newline. The same CPython release (x.y.z) gives the same bytes
  on every machine; another release, or a distribution that patches its stdlib, gives other text:
  ``describe`` gives its SHA-256, which the record carries, so runs on different text are never
  compared unknowingly. About 4.7 MB, read into memory.
- a text file's path: its last tenth (by bytes) is held out, the first nine tenths are trained on.
  The file is memory-mapped (uint8, read-only): a rank holds only the pages its batches touch, and
  every rank on a host shares them through the page cache.

No torch: the run command judges a request with these before importing torch.
"""
from __future__ import annotations

import hashlib
import platform
import sysconfig
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

BUILTIN = ("stdlib",)  # corpora that --data names instead of a file
HELD_OUT_EVERY = 10  # one file (or tenth of a file) in ten is held out


@dataclass(frozen=True)
class Split:
    """A corpus's byte tokens (uint8; of a file, read-only views of its memory map)."""

    train: np.ndarray
    heldout: np.ndarray


def stdlib_files() -> list[Path]:
    """The stdlib corpus's files: the top-level ``*.py`` of this interpreter's stdlib, sorted by name."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted((p for p in root.glob("*.py") if p.is_file()), key=lambda p: p.name)


def _file_split(size: int) -> int:
    """Where a file of ``size`` bytes is cut: its training split's length."""
    return size - size // HELD_OUT_EVERY


@lru_cache(maxsize=1)
def _stdlib_split() -> tuple[bytes, bytes]:
    texts = [f.read_bytes().rstrip(b"\n") + b"\n" for f in stdlib_files()]
    held = {i for i in range(len(texts)) if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1}
    return (b"".join(t for i, t in enumerate(texts) if i not in held),
            b"".join(texts[i] for i in sorted(held)))


def split_sizes(source: str) -> tuple[int, int]:
    """The bytes of ``source``'s training and held-out splits, without reading a file; OSError if it
    cannot be read."""
    if source == "stdlib":
        train, heldout = _stdlib_split()
        return len(train), len(heldout)
    size = Path(source).stat().st_size
    return _file_split(size), size - _file_split(size)


@lru_cache(maxsize=4)
def read_corpus(source: str) -> Split:
    """The training and held-out tokens of ``source`` (a built-in corpus's name or a file's path);
    OSError if the file cannot be read, ValueError if it is empty."""
    if source == "stdlib":
        train, heldout = _stdlib_split()
        return Split(train=np.frombuffer(train, dtype=np.uint8), heldout=np.frombuffer(heldout, dtype=np.uint8))
    tokens = np.memmap(source, dtype=np.uint8, mode="r")
    cut = _file_split(len(tokens))
    return Split(train=tokens[:cut], heldout=tokens[cut:])


def describe(source: str) -> dict[str, Any]:
    """What a run trained on: the corpus, its splits' sizes and the SHA-256 of its text (training
    text, then held-out text: a file's bytes, read in chunks); for ``stdlib`` also the Python
    release it came from."""
    train, heldout = split_sizes(source)
    if source == "stdlib":
        digest = hashlib.sha256(b"".join(_stdlib_split())).hexdigest()
    else:
        with open(source, "rb") as f:
            digest = hashlib.file_digest(f, "sha256").hexdigest()
    out: dict[str, Any] = {"name": source, "train_bytes": train, "heldout_bytes": heldout, "sha256": digest}
    if source == "stdlib":
        out.update(python=platform.python_version(), files=len(stdlib_files()))
    return out
