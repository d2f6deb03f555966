"""A bad deployment file is refused before anything starts, naming the file, the line and
the key, as is an address already in use; and the single-process server never imports Ray."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from vivace.cli import main

VERSION = """models:
  - name: chat
    versions:
      - name: a
{extra}"""
CASES = [
    ("        wieght: 80\n", 5, "models[0].versions[0].wieght", "unknown key"),
    ("        weight: 0\n", 5, "models[0].versions[0].weight", "> 0"),
    ("        weight: -3\n", 5, "models[0].versions[0].weight", "> 0"),
    ("      - name: a\n", 5, "models[0].versions[1].name", "duplicate"),
    ("        engine:\n          num_threads: 1\n          model: /no/such/model.gguf\n", 7,
     "models[0].versions[0].engine.model", "no such model"),
    ("        engine: {quantization: int3}\n", 5, "models[0].versions[0].engine", "quantization"),
    ("        engine: {num_thread: 2}\n", 5, "models[0].versions[0].engine.num_thread", "unknown key"),
    ("        tiers: [gold]\n", 5, "models[0].versions[0].tiers", "unknown tier"),
    ("        engine: {override_generation_config: {temp: 0.5}}\n", 5, "models[0].versions[0].engine",
     "--override-generation-config: unknown field 'temp'"),
    ("        engine: {chat_template: '{% if %}'}\n", 5, "models[0].versions[0].engine",
     "--chat-template (inline): the template does not compile"),
    ("        replicas: 2\n        max_replicas: 3\n", 5, "models[0].versions[0].replicas", "either"),
    ("        replicas: 2.5\n", 5, "models[0].versions[0].replicas", "whole number"),
    ("        max_replicas: 2\n        target_ongoing_requests: .nan\n", 6,
     "models[0].versions[0].target_ongoing_requests", "finite number"),
    ("        max_replicas: 2\n        downscale_delay: -1\n", 6, "models[0].versions[0].downscale_delay", ">= 0"),
]


@pytest.mark.parametrize("extra,line,key,problem", CASES, ids=[c[2].split(".")[-1] + str(i)
                                                           for i, c in enumerate(CASES)])
def test_bad_deployment_file_names_file_line_and_key(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                     extra: str, line: int, key: str, problem: str) -> None:
    path = tmp_path / "deploy.yaml"
    path.write_text(VERSION.format(extra=extra))
    assert main(["serve", "--config", str(path)]) == 2
    error = capsys.readouterr().err
    assert f"{path}:{line}: {key}: " in error and problem in error, error


def test_a_port_in_use_is_refused_before_ray_starts(capsys: pytest.CaptureFixture) -> None:
    import ray

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["serve", "--replicas", "1", "--host", "127.0.0.1", "--port", str(port)]) == 2
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in capsys.readouterr().err
    assert not ray.is_initialized()


def test_single_process_serve_never_imports_ray() -> None:
    code = ("import sys; from vivace.cli import parse_args, engine_config, server_settings; "
            "import vivace.server.serve; args = parse_args(['serve']); engine_config(args); "
            "server_settings(args); assert 'ray' not in sys.modules, 'ray was imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
