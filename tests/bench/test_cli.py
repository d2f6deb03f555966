"""`python -m vivace.bench` end to end against a scripted server: table, JSON, plots."""

import argparse
import ast
import json
from pathlib import Path

import vivace.bench
from vivace.bench.cli import add_bench_args, run_bench


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_bench_args(parser)
    return parser.parse_args(argv)


def test_run_writes_table_json_and_plots(scripted_in_thread, tmp_path, capsys) -> None:
    server = scripted_in_thread(ttft_s=0.02, itl_s=0.005, tokens=4)
    args = parse("--base-url", server.url, "--num-requests", "6", "--concurrency", "2", "--warmup", "1",
                 "--output-len", "4", "--input-len", "8", "--output-json", str(tmp_path / "run.json"),
                 "--plots-dir", str(tmp_path / "plots"), "--label", "scripted", "--no-progress")
    assert run_bench(args) == 0
    table = capsys.readouterr().out
    assert "Successful requests:" in table and "Median ITL (ms):" in table
    document = json.loads((tmp_path / "run.json").read_text())
    assert document["summary"]["completed"] == 6 and len(document["requests"]) == 6
    assert document["meta"]["model"] == "scripted" and document["meta"]["output_control"] == "ignore_eos"
    assert all(len(request["itl"]) == 3 for request in document["requests"])
    assert sorted(path.name for path in (tmp_path / "plots").iterdir()) == [
        "scripted-itl-cdf.png", "scripted-itl-time.png", "scripted-ttft-cdf.png"]
    assert len(server.served) == 1 + 1 + 6  # the probe (2 tokens), one warm-up, the measured requests
    assert [served.body["max_tokens"] for served in server.served].count(2) == 1


def test_failed_requests_give_exit_status_1(scripted_in_thread, capsys) -> None:
    server = scripted_in_thread(tokens=0)
    args = parse("--base-url", server.url, "--num-requests", "2", "--warmup", "0", "--no-progress",
                 "--output-control", "none")
    assert run_bench(args) == 1
    assert "empty_output:" in capsys.readouterr().out


def test_unreachable_server_gives_exit_status_2(capsys) -> None:
    assert run_bench(parse("--base-url", "http://127.0.0.1:9", "--no-progress")) == 2
    assert "cannot list models" in capsys.readouterr().err


def test_bench_imports_neither_torch_nor_engine_nor_server() -> None:
    """Checked on the source, since importing `vivace` itself may load the engine."""
    forbidden = ("torch", "vivace.engine", "vivace.server", "vivace.models", "vivace.layers", "vivace.config")
    for path in Path(vivace.bench.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            else:
                continue
            assert not [name for name in names if name.startswith(forbidden)], (path.name, names)
