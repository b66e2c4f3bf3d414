"""Where the suite keeps what it measured once and reuses (``--verify``'s references, the CPU peak):
``$PIPEBENCH_CACHE``, default ``$XDG_CACHE_HOME/pipebench``, else ``~/.cache/pipebench``."""
from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    explicit = os.environ.get("PIPEBENCH_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "pipebench"
