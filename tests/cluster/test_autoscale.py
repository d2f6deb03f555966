"""Autoscaling on queue depth: model ``auto`` (one sequence at a time per replica, target
queue depth 1, 1 s up / 2 s down delays) goes from 1 replica to 2 under sustained load and
back to 1 once idle."""

from __future__ import annotations

import threading

from .conftest import ClusterServer, eventually

STREAMS = 4


def test_scales_up_under_load_and_down_when_idle(server: ClusterServer) -> None:
    assert len(server.replicas("auto")) == 1
    stop = threading.Event()

    def load() -> None:
        with server.http() as http:
            while not stop.is_set():
                http.post("/v1/completions", json={"model": "auto", "prompt": "Go", "max_tokens": 100,
                                                   "ignore_eos": True})

    loaders = [threading.Thread(target=load) for _ in range(STREAMS)]
    for loader in loaders:
        loader.start()
    try:
        eventually(lambda: len(server.replicas("auto")) == 2, timeout=180, what="a second replica")
    finally:
        stop.set()
        for loader in loaders:
            loader.join(timeout=60)
    eventually(lambda: len(server.replicas("auto")) == 1, timeout=180, what="back to one replica")
