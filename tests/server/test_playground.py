"""The playground in a real browser against a real ``vivace serve``: it lists the model once
given the key, streams an answer with its latency figures, stops a long answer server-side
(the server's running count falls to 0), and its live charts follow /metrics."""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import httpx
import pytest

from vivace.server import ServerSettings

from .browser import API_KEY, CONTEXT, browser, playground_url, serving  # noqa: F401 (fixtures)
from .harness import serving as serving_in_process
from .harness import wait_until
from .thinker import ANSWER, THOUGHT, save_thinker

pytestmark = pytest.mark.slow
expect = pytest.importorskip("playwright.sync_api").expect
MS = re.compile(r"^\d+(\.\d+)? ms$")


def running(base_url: str) -> float:
    text = httpx.get(f"{base_url}/metrics", timeout=10).text
    return float(re.search(r"^vivace:num_requests_running (\S+)$", text, re.M).group(1))


@contextlib.contextmanager
def opened(browser, url: str) -> Iterator[object]:
    """The playground at ``url``, opened with its API key entered; fails the test on any page error."""
    context = browser.new_context()
    page = context.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.goto(url)
    expect(page.locator("#model-status")).to_contain_text("needs an API key")
    page.fill("#api-key", API_KEY)
    page.press("#api-key", "Tab")
    expect(page.locator("#model")).to_have_value("tiny")
    yield page
    context.close()
    assert not errors, errors


@pytest.fixture
def page(browser, playground_url: str) -> Iterator[object]:
    with opened(browser, playground_url) as page:
        yield page


@pytest.fixture(scope="module")
def thinking_url(default_tokenizer_dir, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A server of a model that thinks before it answers, with ``--reasoning-parser qwen3``."""
    model = save_thinker(tmp_path_factory.mktemp("thinker"), default_tokenizer_dir)
    with serving(model, tmp_path_factory.mktemp("thinking"), "--reasoning-parser", "qwen3") as url:
        yield url


def ask(page, text: str, max_tokens: int) -> object:
    """Sends ``text`` with Enter; returns the answer's article."""
    page.fill("#max-tokens", str(max_tokens))
    page.fill("#prompt", text)
    page.press("#prompt", "Enter")
    return page.locator("article.assistant").last


def stat(answer, name: str) -> object:
    return answer.locator(f'[data-stat="{name}"]')


def test_an_answer_streams_with_its_latency_figures(page) -> None:
    answer = ask(page, "Say something", 24)
    expect(page.locator("article.user").last).to_have_text(re.compile("Say something"))
    expect(stat(answer, "state")).to_have_text(re.compile(r"^done"), timeout=60_000)
    assert answer.locator(".content").inner_text().strip()
    expect(answer.locator("details.reasoning")).to_be_hidden()  # no thinking, no block
    expect(stat(answer, "ttft")).to_have_text(MS)
    expect(stat(answer, "itl-mean")).to_have_text(MS)
    expect(stat(answer, "itl-p99")).to_have_text(MS)
    expect(stat(answer, "tps")).to_have_text(re.compile(r"^\d+(\.\d+)?$"))
    expect(stat(answer, "cached")).to_have_text(re.compile(r"^\d+$"))
    assert 1 <= int(stat(answer, "tokens").inner_text()) <= 24
    drawn = answer.locator("canvas.sparkline").evaluate(
        "c => c.getContext('2d').getImageData(0, 0, c.width, c.height).data.some(v => v > 0)")
    assert drawn, "the inter-token sparkline is empty"
    # The live panel's TTFT chart now has the request in its last minute.
    expect(page.locator("#chart-ttft .value")).to_have_text(re.compile(r"p50 [\d.]+ ms · p99 [\d.]+ ms"),
                                                            timeout=10_000)


def test_a_thinking_models_reasoning_folds_above_its_answer(browser, thinking_url: str) -> None:
    with opened(browser, thinking_url) as page:
        answer = ask(page, "Capital of France?", 64)
        expect(stat(answer, "state")).to_have_text("done (stop)", timeout=60_000)
        expect(answer.locator(".content")).to_have_text(ANSWER)
        reasoning = answer.locator("details.reasoning")
        expect(reasoning).to_be_visible()
        assert reasoning.evaluate("d => !d.open"), "the thinking should fold once the answer begins"
        reasoning.locator("summary").click()
        expect(answer.locator(".reasoning-text")).to_have_text(THOUGHT)
        expect(stat(answer, "tps")).to_have_text(re.compile(r"^\d+(\.\d+)?$"))  # thinking tokens count
        # The conversation goes on: the next question is sent with the answer only, not its thinking.
        second = ask(page, "And of Italy?", 64)
        expect(stat(second, "state")).to_have_text("done (stop)", timeout=60_000)
        expect(second.locator(".content")).to_have_text(ANSWER)


def test_stop_aborts_the_answer_on_the_server(page, playground_url: str) -> None:
    answer = ask(page, "Tell a very long story", CONTEXT - 100)
    expect(stat(answer, "state")).to_have_text("streaming", timeout=60_000)
    # The conversation follows the answer as it grows past the bottom of the view.
    page.wait_for_function("""() => { const log = document.querySelector('#messages');
        return log.scrollHeight > log.clientHeight + 200 && log.scrollHeight - log.scrollTop - log.clientHeight < 40; }""",
                           timeout=30_000)
    expect(page.locator("#chart-requests .value")).to_contain_text("running 1", timeout=10_000)
    assert running(playground_url) == 1
    page.keyboard.press("Escape")
    expect(stat(answer, "state")).to_have_text("stopped")
    wait_until(lambda: running(playground_url) == 0, what="the server to abort the request")
    expect(page.locator("#chart-requests .value")).to_contain_text("running 0", timeout=10_000)
    expect(page.locator("#send")).to_be_enabled()
    expect(page.locator("#stop")).to_be_disabled()


def test_tokens_without_text_count_as_the_usage_says(page) -> None:
    # A token that ends inside a character (an emoji, CJK) streams as a chunk without text.
    stats = page.evaluate("""async () => {
        const { Answer } = await import('/ui/stream.js');
        const article = document.querySelector('#answer-template').content.firstElementChild.cloneNode(true);
        document.querySelector('#messages').append(article);
        const answer = new Answer(article);
        answer.start = performance.now();
        const chunk = (content, tokens) => ({ choices: [{ index: 0, delta: { content } }],
                                              usage: { completion_tokens: tokens } });
        for (const [content, tokens] of [['', 0], ['', 1], ['', 2], ['🎉', 3], ['日', 4], ['', 5], ['本', 6]]) {
            answer.onChunk(chunk(content, tokens));
        }
        answer.render();
        return { text: answer.text, tokens: article.querySelector('[data-stat="tokens"]').textContent,
                 gaps: answer.gaps.length };
    }""")
    assert stats == {"text": "🎉日本", "tokens": "6", "gaps": 5}


def test_a_page_opened_while_the_model_loads_lists_it_once_ready(browser, tiny_engine) -> None:
    with serving_in_process(None, ServerSettings()) as loading:
        page = browser.new_page()
        page.goto(loading.base_url)
        expect(page.locator("#model-status")).to_contain_text("still loading")
        loading.app.state.vivace.attach_engine(tiny_engine)
        expect(page.locator("#model")).to_have_value(tiny_engine.model_name, timeout=10_000)
        expect(page.locator("#model-status")).to_have_text("")
        page.close()


def test_the_live_charts_update_every_second(page) -> None:
    charts = page.locator("figure.chart")
    expect(charts).to_have_count(5)
    for i in range(5):
        expect(charts.nth(i)).to_have_attribute("data-samples", re.compile(r"^([3-9]|\d\d+)$"),
                                                timeout=15_000)
    expect(page.locator("#chart-kv .value")).to_have_text(re.compile(r"^used \d+\.\d %$"))
    expect(page.locator("#metrics-status")).to_have_text("live")


def test_shift_enter_adds_a_line_instead_of_sending(page) -> None:
    page.fill("#prompt", "first line")
    page.press("#prompt", "Shift+Enter")
    page.keyboard.type("second line")
    expect(page.locator("#prompt")).to_have_value("first line\nsecond line")
    expect(page.locator("article.user")).to_have_count(0)


def test_markdown_is_rendered_and_html_is_escaped(page) -> None:
    html = page.evaluate("""async () => {
        const { renderMarkdown } = await import('/ui/markdown.js');
        return renderMarkdown('# Title\\n**bold** and `x<y`\\n\\n- one\\n- two\\n\\n' +
                              '```py\\nprint(1)\\n```\\n<img src=x onerror=alert(1)>');
    }""")
    assert "<h1>Title</h1>" in html and "<strong>bold</strong>" in html
    assert "<code>x&lt;y</code>" in html and "<ul><li>one</li><li>two</li></ul>" in html
    assert '<pre data-lang="py"><code>print(1)</code></pre>' in html
    assert "<img" not in html and "&lt;img src=x onerror=alert(1)&gt;" in html


def test_the_live_panel_adds_up_every_replica_of_a_scaled_out_server(page) -> None:
    load = page.evaluate("""async () => {
        const { engineLoad, parsePrometheus } = await import('/ui/metrics.js');
        const text = [
            'vivace:num_requests_running{model="a",version="v1",replica="r1"} 2.0',
            'vivace:num_requests_running{model="b",version="v1",replica="r2"} 3.0',
            'vivace:num_requests_waiting{model="a",version="v1",replica="r1"} 0.0',
            'vivace:num_requests_waiting{model="b",version="v1",replica="r2"} 4.0',
            'vivace:kv_cache_usage_perc{model="a",version="v1",replica="r1"} 0.9',
            'vivace:kv_cache_usage_perc{model="b",version="v1",replica="r2"} 0.1'].join('\\n');
        return engineLoad(parsePrometheus(text));
    }""")
    assert load == {"running": 5, "waiting": 4, "kv": 0.9}
