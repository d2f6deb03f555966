"""Fixtures of the playground's browser tests: Debian's headless Chromium driven by Playwright, and a real
``vivace serve`` process on a tiny random model with a long context (so that an answer can run
long enough to be stopped) and an API key."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from .harness import free_port
from .test_serve_process import REPO, wait_healthy

CHROMIUM = Path(os.environ.get("VIVACE_TEST_CHROMIUM", "/usr/lib/chromium/chromium-headless-shell"))
# Software GL and no calls home (the test machines' network is closed). Not --single-process:
# with it, closing a browser context takes the whole browser down.
CHROMIUM_ARGS = ["--no-sandbox", "--use-gl=angle", "--use-angle=swiftshader",
                 "--enable-unsafe-swiftshader", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic"]
API_KEY = "playground-key"
CONTEXT = 8192


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    """Chromium for one module: Playwright's sync API holds an event loop on the main thread while
    it is open, and later tests' ``asyncio.run`` must not find it running."""
    if not CHROMIUM.exists():
        pytest.skip(f"no headless Chromium at {CHROMIUM} (`make browser` installs Debian's "
                    "chromium-headless-shell; VIVACE_TEST_CHROMIUM points elsewhere)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
    with sync_api.sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


@contextlib.contextmanager
def serving(model: Path, log_dir: Path, *args: str) -> Iterator[str]:
    """``vivace serve model`` with the playground's API key (and ``args``) as a process; its base URL."""
    port = free_port()
    log_path = log_dir / "serve.log"
    with log_path.open("w") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "vivace.cli", "serve", str(model), "--port", str(port),
             "--served-model-name", "tiny", "--api-key", API_KEY, "--eager",
             "--log-level", "warning", *args],
            cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    base_url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base_url, process, timeout=120)
        yield base_url
    finally:
        process.terminate()
        assert process.wait(timeout=60) == 0, log_path.read_text()


@pytest.fixture(scope="module")
def playground_url(make_tiny_llama, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with serving(make_tiny_llama(max_position_embeddings=CONTEXT), tmp_path_factory.mktemp("playground")) as url:
        yield url
