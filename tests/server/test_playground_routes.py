"""The playground's routes: ``/`` serves the page and ``/ui/`` its assets, both gone with
``--no-ui`` (or its twin); the API and its error shape are untouched either way."""

from __future__ import annotations

import pytest

from vivace.cli import parse_args, server_settings
from vivace.server import ServerSettings
from vivace.server.playground import UI_DIR

from .harness import RunningServer, serving


def test_the_page_and_its_assets_are_served(server: RunningServer) -> None:
    with server.http() as http:
        page = http.get("/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert '<script type="module" src="/ui/app.js">' in page.text
        for asset in sorted(UI_DIR.glob("*.js")) + sorted(UI_DIR.glob("*.css")):
            reply = http.get(f"/ui/{asset.name}")
            assert reply.status_code == 200 and reply.text == asset.read_text(), asset.name
        missing = http.get("/ui/nothing.js")
        assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"


def test_no_ui_serves_no_page(tiny_engine) -> None:
    with serving(tiny_engine, ServerSettings(ui=False)) as server, server.http() as http:
        assert http.get("/").status_code == 404
        assert http.get("/ui/app.js").status_code == 404
        assert http.get("/health").status_code == 200


def test_the_page_loads_only_local_files() -> None:
    for asset in UI_DIR.iterdir():
        text = asset.read_text()
        assert "http://" not in text.replace("http://localhost", "") and "https://" not in text, asset


@pytest.mark.parametrize("argv, env, ui, endpoint", [
    ([], {}, True, None),
    (["--no-ui", "--otlp-traces-endpoint", "http://c:4318"], {}, False, "http://c:4318"),
    ([], {"VIVACE_NO_UI": "1", "VIVACE_OTLP_TRACES_ENDPOINT": "http://d:4318"}, False, "http://d:4318"),
])
def test_flags_and_env_twins(argv: list[str], env: dict[str, str], ui: bool, endpoint: str | None,
                             monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("VIVACE_NO_UI", "VIVACE_OTLP_TRACES_ENDPOINT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    settings = server_settings(parse_args(["serve", *argv]))
    assert (settings.ui, settings.otlp_traces_endpoint) == (ui, endpoint)
