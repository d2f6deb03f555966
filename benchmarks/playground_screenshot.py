"""The README's screenshot of the playground, taken from a running server:

    python -m vivace.cli serve &   # the default model on 127.0.0.1:8000
    python benchmarks/playground_screenshot.py [--url http://127.0.0.1:8000/] [--out docs/playground.png]

Asks two questions through the page (the second renders as a markdown list), waits for both
answers and a few live-panel samples, and saves a 1280x760 PNG. Uses Debian's headless Chromium
(`make browser`), as the playground's tests do.
"""

from __future__ import annotations

import argparse
import re

from playwright.sync_api import expect, sync_playwright

CHROMIUM = "/usr/lib/chromium/chromium-headless-shell"
ARGS = ["--no-sandbox", "--use-gl=angle", "--use-angle=swiftshader", "--enable-unsafe-swiftshader",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        "--no-first-run", "--disable-quic"]
QUESTIONS = ["What is the capital of France?", "Give three tips for writing fast Python code, as a list."]


def main() -> None:
    parser = argparse.ArgumentParser(description="screenshot of the playground")
    parser.add_argument("--url", default="http://127.0.0.1:8000/")
    parser.add_argument("--out", default="docs/playground.png")
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=ARGS)
        page = browser.new_page(viewport={"width": 1280, "height": 760})
        page.goto(args.url)
        expect(page.locator("#model")).not_to_have_value("")
        page.fill("#system", "You are a concise assistant.")
        page.fill("#max-tokens", str(args.max_tokens))
        page.fill("#temperature", "0.2")
        for question in QUESTIONS:
            page.fill("#prompt", question)
            page.press("#prompt", "Enter")
            state = page.locator("article.assistant").last.locator('[data-stat="state"]')
            expect(state).to_have_text(re.compile("^done"), timeout=300_000)
        samples = page.locator("#chart-requests")
        count = int(samples.get_attribute("data-samples") or 0)
        expect(samples).to_have_attribute("data-samples", str(count + 3), timeout=10_000)
        page.screenshot(path=args.out)
        browser.close()


if __name__ == "__main__":
    main()
