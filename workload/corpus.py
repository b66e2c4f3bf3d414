"""Text corpora as bytes, each with a held-out split (the text the eval loss is measured on and
no step ever trains on); ``workload.tokens`` turns them into token ids (bytes, or BPE).

- ``stdlib``: the Python standard library's own sources, present wherever Python is, no download:
  the top-level ``*.py`` files of the running interpreter's stdlib directory, in sorted order of
  their names; every tenth file (sorted index 9, 19, ...) is held out, the rest are the training
  text. Each file's bytes end with a newline. The same CPython release (x.y.z) gives the same bytes
  on every machine; another release, or a distribution that patches its stdlib, gives other text:
  ``describe`` gives its SHA-256, which the record carries, so runs on different text are never
  compared unknowingly. About 4.7 MB, read into memory.
- ``pydocs``: natural language: the Python documentation's reStructuredText sources as the
  distribution's ``python3.X-doc`` package installs them (``DOCS``, X the running interpreter's
  minor version; ``scripts/setup_env.sh`` installs it), every ``*.txt`` under it sorted by its path
  there, every tenth held out as for ``stdlib``. About 11 MB. Where the package is not installed,
  ``pydocs`` is the ``stdlib`` text (``describe`` says which, the run command warns).
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

BUILTIN = ("stdlib", "pydocs")  # corpora that --data names instead of a file
HELD_OUT_EVERY = 10  # one file (or tenth of a file) in ten is held out
# The reST sources of the Python documentation, as Debian's python3.X-doc installs them
DOCS = "/usr/share/doc/python{version}/html/_sources"


@dataclass(frozen=True)
class Split:
    """A corpus's byte tokens (uint8; of a file, read-only views of its memory map)."""

    train: np.ndarray
    heldout: np.ndarray


def stdlib_files() -> list[Path]:
    """The stdlib corpus's files: the top-level ``*.py`` of this interpreter's stdlib, sorted by name."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted((p for p in root.glob("*.py") if p.is_file()), key=lambda p: p.name)


def docs_files() -> list[Path]:
    """The ``pydocs`` corpus's files (empty where the documentation is not installed): every ``*.txt``
    under ``DOCS`` for this interpreter's version, sorted by the path under it."""
    root = Path(DOCS.format(version=sysconfig.get_python_version()))
    return sorted((p for p in root.rglob("*.txt") if p.is_file()), key=lambda p: p.relative_to(root).as_posix())


def builtin_files(source: str) -> tuple[str, list[Path]]:
    """A built-in corpus's text (``stdlib`` or ``pydocs``: what it is, for the record) and its files;
    ``pydocs`` without the documentation installed is the stdlib's sources."""
    if source == "pydocs":
        docs = docs_files()
        if docs:
            return f"the Python {sysconfig.get_python_version()} documentation (reST sources)", docs
        return "the stdlib's sources: no Python documentation here (python3.X-doc)", stdlib_files()
    return "the stdlib's sources", stdlib_files()


def _file_split(size: int) -> int:
    """Where a file of ``size`` bytes is cut: its training split's length."""
    return size - size // HELD_OUT_EVERY


@lru_cache(maxsize=2)
def builtin_documents(source: str) -> tuple[tuple[bytes, ...], tuple[bytes, ...]]:
    """A built-in corpus's files' texts, each ending with one newline: (training, held-out), every
    tenth file held out."""
    texts = [f.read_bytes().rstrip(b"\n") + b"\n" for f in builtin_files(source)[1]]
    held = {i for i in range(len(texts)) if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1}
    return (tuple(t for i, t in enumerate(texts) if i not in held), tuple(texts[i] for i in sorted(held)))


@lru_cache(maxsize=2)
def _builtin_split(source: str) -> tuple[bytes, bytes]:
    train, heldout = builtin_documents(source)
    return b"".join(train), b"".join(heldout)


def split_sizes(source: str) -> tuple[int, int]:
    """The bytes of ``source``'s training and held-out splits, without reading a file; OSError if it
    cannot be read."""
    if source in BUILTIN:
        train, heldout = _builtin_split(source)
        return len(train), len(heldout)
    size = Path(source).stat().st_size
    return _file_split(size), size - _file_split(size)


@lru_cache(maxsize=4)
def read_corpus(source: str) -> Split:
    """The training and held-out tokens of ``source`` (a built-in corpus's name or a file's path);
    OSError if the file cannot be read, ValueError if it is empty."""
    if source in BUILTIN:
        train, heldout = _builtin_split(source)
        return Split(train=np.frombuffer(train, dtype=np.uint8), heldout=np.frombuffer(heldout, dtype=np.uint8))
    tokens = np.memmap(source, dtype=np.uint8, mode="r")
    cut = _file_split(len(tokens))
    return Split(train=tokens[:cut], heldout=tokens[cut:])


def describe(source: str) -> dict[str, Any]:
    """What a run trained on: the corpus, its splits' sizes and the SHA-256 of its text (training
    text, then held-out text: a file's bytes, read in chunks); for a built-in corpus also what text it
    is, its files and the Python release it came from."""
    train, heldout = split_sizes(source)
    if source in BUILTIN:
        digest = hashlib.sha256(b"".join(_builtin_split(source))).hexdigest()
    else:
        with open(source, "rb") as f:
            digest = hashlib.file_digest(f, "sha256").hexdigest()
    out: dict[str, Any] = {"name": source, "train_bytes": train, "heldout_bytes": heldout, "sha256": digest}
    if source in BUILTIN:
        text, files = builtin_files(source)
        out.update(text=text, python=platform.python_version(), files=len(files))
    return out
