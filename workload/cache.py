"""Where the suite keeps what it measured or made once and reuses (``--verify``'s references, the CPU
peak, BPE tokens): ``$PIPEBENCH_CACHE``, default ``$XDG_CACHE_HOME/pipebench``, else
``~/.cache/pipebench``.

An entry that is a directory of files (a BPE's tokenizer and ids) is sealed when made: its manifest
(a JSON file in it) keeps, beside what it describes, the SHA-256 of each of its other files
(``seal``), and a reader checks them before trusting it (``damage``): a file changed, truncated or
missing, a manifest that is not JSON, is a damaged entry, which its maker makes again. No torch.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

FILES_KEY = "files"  # in a manifest: {file name: its SHA-256}
ABSENT = "absent"  # ``damage`` of an entry that was never made


class CacheError(RuntimeError):
    """The cache cannot keep what a run needs (one line, naming the directory and why)."""


def cache_dir() -> Path:
    explicit = os.environ.get("PIPEBENCH_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "pipebench"


def writable(directory: Path) -> Path:
    """``directory`` (inside the cache), made if missing, once a file has been made in it for real;
    CacheError (one line) if it cannot be."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=directory, prefix=".write-check-")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        where = os.environ.get("PIPEBENCH_CACHE")
        named = f"PIPEBENCH_CACHE={where}" if where else f"the cache {cache_dir()}"
        raise CacheError(f"{named}: cannot keep files in {directory} ({exc.strerror or exc}): point "
                         "PIPEBENCH_CACHE at a writable directory") from None
    return directory


def _digest(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def seal(entry: Path, manifest: str, contents: dict[str, Any]) -> None:
    """Write ``entry/manifest``: ``contents`` and the SHA-256 of every other file of the entry."""
    files = {p.name: _digest(p) for p in sorted(entry.iterdir()) if p.is_file() and p.name != manifest}
    (entry / manifest).write_text(json.dumps({**contents, FILES_KEY: files}, indent=1) + "\n")


def damage(entry: Path, manifest: str) -> str | None:
    """Why the sealed entry cannot be trusted (``ABSENT`` if it was never made), or None if every file
    its manifest names is there with its SHA-256."""
    if not (entry / manifest).exists():
        return ABSENT
    try:
        kept = json.loads((entry / manifest).read_bytes())
    except (OSError, ValueError) as exc:
        return f"{manifest} unreadable ({getattr(exc, 'strerror', None) or type(exc).__name__})"
    files = kept.get(FILES_KEY) if isinstance(kept, dict) else None
    if not isinstance(files, dict) or not files:
        return f"{manifest} names no files' digests"
    for name, digest in sorted(files.items()):
        path = entry / name
        if not path.is_file():
            return f"{name} missing"
        try:
            if _digest(path) != digest:
                return f"{name} is not the file made (its SHA-256 differs)"
        except OSError as exc:
            return f"{name} unreadable ({exc.strerror})"
    return None


def manifest_of(entry: Path, manifest: str) -> dict[str, Any]:
    """A sound entry's manifest (``damage`` said None), without its files' digests."""
    kept = json.loads((entry / manifest).read_text())
    kept.pop(FILES_KEY, None)
    return kept
