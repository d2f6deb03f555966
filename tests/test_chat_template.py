"""``--chat-template``: read as vLLM reads it (a file, else the template itself), refused at start when
it does not compile or names a file that is not there; through a real server it replaces the
tokenizer's template (``/tokenize`` of messages, chat completions), and a model without one keeps
today's answer."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import transformers

from tests.server.harness import RunningServer, serving_command_line
from vivace.chat_template import read_chat_template

FILE_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
INLINE_TEMPLATE = "{% for m in messages %}{{ m['content'] | upper }}\\n{% endfor %}"  # as typed in a shell
MESSAGES = [{"role": "user", "content": "hello there"}]
REPO = Path(__file__).resolve().parents[1]


def test_a_file_is_read_else_the_value_is_the_template_with_its_escapes_decoded(tmp_path: Path) -> None:
    path = tmp_path / "template.jinja"
    path.write_text(FILE_TEMPLATE)
    assert read_chat_template(str(path)) == FILE_TEMPLATE
    assert read_chat_template(INLINE_TEMPLATE) == INLINE_TEMPLATE.replace("\\n", "\n")
    assert read_chat_template("{{ 'café ☕' }}") == "{{ 'café ☕' }}"  # characters beyond latin-1 kept
    with pytest.raises(ValueError, match="--chat-template missing.jinja: looks like a file's path, but it cannot"):
        read_chat_template("missing.jinja")
    with pytest.raises(ValueError, match=r"--chat-template \(inline\): the template does not compile"):
        read_chat_template("{% for m in messages %}")


def test_a_bad_template_exits_2_at_start(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "vivace.cli", "serve", str(tmp_path), "--chat-template", "{% if %}"],
                          cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 2, done.stderr
    assert "vivace serve: --chat-template (inline): the template does not compile" in done.stderr


@pytest.fixture(scope="module")
def untemplated_model(make_tiny_llama, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with a tokenizer that has no chat template."""
    model = tmp_path_factory.mktemp("untemplated") / "model"
    shutil.copytree(make_tiny_llama(), model)
    (model / "chat_template.jinja").unlink()
    assert not transformers.AutoTokenizer.from_pretrained(model).chat_template
    return model


def _tokenize(server: RunningServer) -> list[int]:
    with server.http() as http:
        answer = http.post("/tokenize", json={"model": "tiny", "messages": MESSAGES, "add_generation_prompt": False})
    assert answer.status_code == 200, answer.text
    return answer.json()["tokens"]


def test_a_template_file_replaces_the_tokenizers_everywhere(untemplated_model: Path, tmp_path: Path) -> None:
    path = tmp_path / "template.jinja"
    path.write_text(FILE_TEMPLATE)
    tokenizer = transformers.AutoTokenizer.from_pretrained(untemplated_model)
    with serving_command_line(untemplated_model, "--chat-template", str(path)) as server:
        ids = _tokenize(server)
        assert ids == tokenizer.encode("<user>hello there", add_special_tokens=False)
        reply = server.client().chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2)
        assert reply.usage.prompt_tokens == len(ids)


def test_an_inline_template_replaces_it_too(untemplated_model: Path) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(untemplated_model)
    with serving_command_line(untemplated_model, "--chat-template", INLINE_TEMPLATE) as server:
        assert _tokenize(server) == tokenizer.encode("HELLO THERE\n", add_special_tokens=False)


def test_without_a_template_chat_requests_get_todays_answer(untemplated_model: Path) -> None:
    with serving_command_line(untemplated_model) as server, server.http() as http:
        for path in ("/tokenize", "/v1/chat/completions"):
            answer = http.post(path, json={"model": "tiny", "messages": MESSAGES})
            assert answer.status_code == 400
            assert answer.json()["error"]["message"] == "This model has no chat template; use /v1/completions"
