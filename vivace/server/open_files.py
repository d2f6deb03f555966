"""The server's limit of open files: one per connection, so it bounds the concurrent clients."""

from __future__ import annotations

import logging
import resource

logger = logging.getLogger("vivace.server")
# What the server asks for, as vLLM's ``set_ulimit`` does: a distribution's default soft limit
# (1024) refuses connections past about a thousand concurrent clients.
OPEN_FILES_TARGET = 65535


def raise_open_files_limit(target: int = OPEN_FILES_TARGET) -> int:
    """Raise this process's soft limit of open files to ``target`` (at most the hard limit; never
    lowered), for the server and the processes it starts; returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = target if hard == resource.RLIM_INFINITY else min(target, hard)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
            soft = wanted
        except (ValueError, OSError) as exc:
            logger.warning("could not raise the open files limit from %d to %d (%s): connections "
                           "past about %d at once will be refused", soft, wanted, exc, soft)
    return soft
