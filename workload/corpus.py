"""Byte-level text corpora, each with a held-out split (the text the eval loss is measured on and
no step ever trains on).

- ``stdlib``: the Python standard library's own sources, present wherever Python is, no download:
  the top-level ``*.py`` files of the running interpreter's stdlib directory, in sorted order of
  their names; every tenth file (sorted index 9, 19, ...) is held out, the rest are the training
  text. Each file's bytes end with a newline. The same CPython release (x.y.z) gives the same bytes
  on every machine; another release, or a distribution that patches its stdlib, gives other text:
  ``describe`` gives its SHA-256, which the record carries, so runs on different text are never
  compared unknowingly.
- a text file's path: its last tenth (by bytes) is held out, the first nine tenths are trained on.

Plain bytes, no torch: the run command judges a request with these before importing torch.
"""
from __future__ import annotations

import hashlib
import platform
import sysconfig
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

BUILTIN = ("stdlib",)  # corpora that --data names instead of a file
HELD_OUT_EVERY = 10  # one file (or tenth of a file) in ten is held out


@dataclass(frozen=True)
class Split:
    train: bytes
    heldout: bytes


def stdlib_files() -> list[Path]:
    """The stdlib corpus's files: the top-level ``*.py`` of this interpreter's stdlib, sorted by name."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted((p for p in root.glob("*.py") if p.is_file()), key=lambda p: p.name)


@lru_cache(maxsize=4)
def read_corpus(source: str) -> Split:
    """The training and held-out text of ``source`` (a built-in corpus's name or a file's path);
    OSError if the file cannot be read."""
    if source == "stdlib":
        files = stdlib_files()
        texts = [f.read_bytes().rstrip(b"\n") + b"\n" for f in files]
        held = {i for i in range(len(texts)) if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1}
        return Split(train=b"".join(t for i, t in enumerate(texts) if i not in held),
                     heldout=b"".join(texts[i] for i in sorted(held)))
    data = Path(source).read_bytes()
    cut = len(data) - len(data) // HELD_OUT_EVERY
    return Split(train=data[:cut], heldout=data[cut:])


def describe(source: str) -> dict[str, Any]:
    """What a run trained on: the corpus, its splits' sizes and the SHA-256 of its text (training
    text, then held-out text); for ``stdlib`` also the Python release it came from."""
    split = read_corpus(source)
    digest = hashlib.sha256(split.train + split.heldout).hexdigest()
    out: dict[str, Any] = {"name": source, "train_bytes": len(split.train), "heldout_bytes": len(split.heldout),
                           "sha256": digest}
    if source == "stdlib":
        out.update(python=platform.python_version(), files=len(stdlib_files()))
    return out
