"""Autoscaling on queue depth: model ``auto`` (one sequence at a time per replica, target
queue depth 1, 1 s up / 2 s down delays) goes from 1 replica to 2 under sustained load and
back to 1 when the load drops to one stream, losing none of the requests sent meanwhile (the
replica removed drains)."""

from __future__ import annotations

import threading

from .conftest import ClusterServer, eventually

STREAMS = 4


def test_scales_up_under_load_and_down_when_it_drops(server: ClusterServer) -> None:
    assert len(server.replicas("auto")) == 1
    stops = [threading.Event() for _ in range(STREAMS)]
    statuses: list[int] = []

    def load(stop: threading.Event) -> None:
        with server.http() as http:
            while not stop.is_set():
                statuses.append(http.post("/v1/completions", json={
                    "model": "auto", "prompt": "Go", "max_tokens": 100, "ignore_eos": True}).status_code)

    loaders = [threading.Thread(target=load, args=(stop,)) for stop in stops]
    for loader in loaders:
        loader.start()
    try:
        eventually(lambda: len(server.replicas("auto")) == 2, timeout=180, what="a second replica")
        for stop in stops[1:]:
            stop.set()
        eventually(lambda: len(server.replicas("auto")) == 1, timeout=180, what="back to one replica")
    finally:
        for stop in stops:
            stop.set()
        for loader in loaders:
            loader.join(timeout=60)
    assert statuses and set(statuses) == {200}, statuses
