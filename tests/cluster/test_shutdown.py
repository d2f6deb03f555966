"""SIGTERM to a scaled-out ``vivace serve``: the stream in flight finishes, the process exits
0, and no process of the Ray cluster it started is left; the same while it is still starting.
(Ends the session's server; a later test would start it again.)"""

from __future__ import annotations

import os
from pathlib import Path

from .conftest import BackgroundStream, Cluster, eventually


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid``."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def titles(pids: set[int]) -> list[str]:
    """The command lines of ``pids`` (those still there)."""
    lines = []
    for pid in pids:
        try:
            lines.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode())
        except OSError:
            continue
    return lines


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().split()[2]


def test_sigterm_drains_then_leaves_no_ray_process(cluster: Cluster) -> None:
    server = cluster.server()
    assert cluster.process is not None
    ray_processes = descendants(cluster.process.pid)
    assert len(ray_processes) >= 5  # gcs, raylet, controller, proxy, replicas...
    stream = BackgroundStream(server, {"model": "tiny", "prompt": "Count:", "max_tokens": 60,
                                       "stream": True, "ignore_eos": True})
    assert stream.started.wait(60)
    assert cluster.stop(timeout=90) == 0, cluster.log_text()
    assert stream.ended(10)
    assert stream.events[-1] == "data: [DONE]" and '"finish_reason":"length"' in stream.events[-2]
    assert not [pid for pid in ray_processes if alive(pid)]


def test_sigterm_during_start_up_leaves_no_ray_process(cluster: Cluster) -> None:
    """Once Ray is up (its core worker puts a handler on SIGTERM that aborts the process) and
    while the application deploys, SIGTERM stops everything as cleanly."""
    cluster.launch()
    process = cluster.process
    assert process is not None

    def serve_started() -> bool:
        assert process.poll() is None, cluster.log_text()
        return any("ServeController" in title for title in titles(descendants(process.pid)))

    eventually(serve_started, timeout=120, what="the Serve controller")
    ray_processes = descendants(process.pid)
    assert cluster.stop(timeout=90) == 0, cluster.log_text()
    assert not [pid for pid in ray_processes if alive(pid)]
