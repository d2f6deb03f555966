"""Where vivace keeps what it builds or unpacks once per machine."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir(name: str) -> Path:
    """``$XDG_CACHE_HOME/vivace/<name>`` (``~/.cache/vivace/<name>`` without it), read at each call
    so that a changed environment (a child's, a test's) is followed."""
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "vivace" / name
