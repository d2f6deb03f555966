"""The web playground: static HTML/CSS/JS shipped in the package (``vivace/server/ui``), served
at ``/`` with its files under ``/ui/``. It only talks to the public API (``/v1/models``,
``/v1/chat/completions``, ``/metrics``), so it needs nothing from the server but these files."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.staticfiles import StaticFiles

UI_DIR = Path(__file__).with_name("ui")


async def _index(request: Request) -> Response:
    return FileResponse(UI_DIR / "index.html", headers={"Cache-Control": "no-cache"})


def mount_playground(app: FastAPI) -> None:
    """Serves the playground page at ``/`` and its assets at ``/ui/``."""
    app.add_api_route("/", _index, methods=["GET"], include_in_schema=False)
    app.mount("/ui", StaticFiles(directory=UI_DIR), name="ui")
