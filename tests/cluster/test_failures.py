"""A replica SIGKILLed mid-stream: that stream ends with an error event and [DONE], requests
sent after the kill all succeed, and /replicas shows the replacement."""

from __future__ import annotations

import json
import os
import signal

from .conftest import BackgroundStream, ClusterServer, eventually


def test_a_killed_replica_loses_no_later_request_and_is_replaced(server: ClusterServer) -> None:
    before = {r["id"]: r["pid"] for r in server.replicas("tiny")}
    stream = BackgroundStream(server, {"model": "tiny", "prompt": "Count:", "max_tokens": 250,
                                       "stream": True, "ignore_eos": True})
    assert stream.started.wait(60), "the stream never started"
    victim = stream.headers["x-vivace-replica"]
    os.kill(before[victim], signal.SIGKILL)
    assert stream.ended(60), "the stream on the killed replica hung"
    assert stream.events[-1] == "data: [DONE]"
    finish = [json.loads(e[6:]) for e in stream.events[:-1]]
    if not any(c.get("choices") and c["choices"][0].get("finish_reason") == "length" for c in finish):
        assert finish[-1]["error"]["code"] == "replica_failed", finish[-1]
    with server.http() as http:
        for i in range(10):
            response = http.post("/v1/completions", json={"model": "tiny", "prompt": f"after {i}",
                                                          "max_tokens": 2})
            assert response.status_code == 200, response.text
            assert response.headers["x-vivace-replica"] != victim

    def replaced() -> bool:
        now = server.replicas("tiny")
        return len(now) == 2 and victim not in {r["id"] for r in now}

    eventually(replaced, timeout=180, what="a replacement replica")
