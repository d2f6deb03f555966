"""The conversation as real models' chat templates see it (``vivace.server.tools``): which templates
take the request's ``tools`` (the ``tools`` variable of any of the tokenizer's named templates, not
the word), and the text of a message sent in parts (joined by newlines, as vLLM joins them)."""

from __future__ import annotations

import json

import pytest
import transformers

from vivace.server.errors import APIError
from vivace.server.prompts import chat_prompt_ids
from vivace.server.protocol import ChatTemplateRequest
from vivace.server.tool_formats import HERMES
from vivace.server.tools import chat_messages, template_takes_tools

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
ASK = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]
# Phi-4-mini-instruct's published template: it reads a system message's own "tools" key (a JSON
# string), never the tools variable, so the request's tools must reach it another way.
PHI4_MINI = ("{% for message in messages %}{% if message['role'] == 'system' and 'tools' in message and "
             "message['tools'] is not none %}{{ '<|' + message['role'] + '|>' + message['content'] + '<|tool|>' + "
             "message['tools'] + '<|/tool|>' + '<|end|>' }}{% else %}{{ '<|' + message['role'] + '|>' + "
             "message['content'] + '<|end|>' }}{% endif %}{% endfor %}{% if add_generation_prompt %}"
             "{{ '<|assistant|>' }}{% else %}{{ eos_token }}{% endif %}")
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Hermes-2-Pro's and Command-R's tokenizer_config.json: named templates, "tool_use" for requests with tools.
NAMED = {"default": CHATML, "tool_use": "{% for t in tools %}TOOL {{ t.function.name }}\n{% endfor %}" + CHATML}


@pytest.fixture
def tokenizer(default_tokenizer_dir):
    return transformers.AutoTokenizer.from_pretrained(default_tokenizer_dir)


def _prompt(tokenizer, **body: object) -> str:
    request = ChatTemplateRequest.model_validate(body)
    return tokenizer.decode(chat_prompt_ids(tokenizer, request, "auto" if request.tools else "none"))


def test_a_template_that_only_mentions_tools_gets_them_by_the_convention(tokenizer) -> None:
    tokenizer.chat_template = PHI4_MINI
    assert not template_takes_tools(tokenizer)
    prompt = _prompt(tokenizer, messages=ASK, tools=[WEATHER])
    assert prompt.startswith("<|system|>Be brief.\n\n# Tools") and '"name": "get_weather"' in prompt


def test_named_templates_take_tools_in_their_tool_use_one(tokenizer, tmp_path) -> None:
    tokenizer.chat_template = NAMED
    tokenizer.save_pretrained(tmp_path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path)
    assert isinstance(tokenizer.chat_template, dict) and template_takes_tools(tokenizer)
    assert _prompt(tokenizer, messages=ASK, tools=[WEATHER]).startswith("TOOL get_weather\n<|im_start|>system\nBe brief.")
    assert _prompt(tokenizer, messages=ASK).startswith("<|im_start|>system\nBe brief.<|im_end|>")


def test_templates_that_read_tools_get_them(tokenizer) -> None:
    tokenizer.chat_template = "{% if tools is not none %}{{ tools | length }} tools{% endif %}" + CHATML
    assert template_takes_tools(tokenizer)
    assert _prompt(tokenizer, messages=ASK, tools=[WEATHER]).startswith("1 tools<|im_start|>system")


def test_text_parts_are_joined_by_newlines_as_vllm_joins_them(tokenizer) -> None:
    body = ChatTemplateRequest.model_validate({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "Hello"}, {"type": "text", "text": "World"}]}]})
    messages, _ = chat_messages(body, tokenizer, "none", HERMES)
    assert messages[0]["content"] == "Hello\nWorld"


# Gemma 3's template, condensed: no system role (its text opens the first user turn), and turns
# that must alternate user / model.
GEMMA3 = ("{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set first_user_prefix = messages[0]['content'] + "
          "'\\n\\n' %}{% set loop_messages = messages[1:] %}{% else %}{% set first_user_prefix = '' %}"
          "{% set loop_messages = messages %}{% endif %}{% for message in loop_messages %}"
          "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
          "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
          "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\\n' + "
          "(first_user_prefix if loop.first else '') + message['content'] | trim + '<end_of_turn>\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}")


def test_parallel_calls_results_are_one_user_turn_for_a_template_without_tools(tokenizer) -> None:
    tokenizer.chat_template = GEMMA3
    calls = [{"id": f"call_{i}", "type": "function", "function": {"name": "get_weather", "arguments": f'{{"city": "{c}"}}'}}
             for i, c in enumerate(["Paris", "Rome"])]
    prompt = _prompt(tokenizer, tools=[WEATHER], messages=[
        *ASK, {"role": "assistant", "content": None, "tool_calls": calls},
        {"role": "tool", "tool_call_id": "call_0", "content": "21"}, {"role": "tool", "tool_call_id": "call_1", "content": "25"}])
    assert prompt.endswith("<start_of_turn>user\n<tool_response>\n21\n</tool_response>\n<tool_response>\n25\n"
                           "</tool_response><end_of_turn>\n<start_of_turn>model\n")


def test_a_template_that_cannot_compute_with_a_message_is_a_400(tokenizer) -> None:
    """A TypeError inside the template (here a number added to each message's text) is a 400 on
    ``messages``, as vLLM answers it, not a 500."""
    tokenizer.chat_template = "{% for m in messages %}{{ m.content + 1 }}{% endfor %}"
    with pytest.raises(APIError) as refused:
        _prompt(tokenizer, messages=ASK)
    assert refused.value.status == 400 and refused.value.param == "messages"
    assert "could not render the messages" in str(refused.value)


@pytest.mark.parametrize("template", [None, "{% for m in messages %}{% for c in m.tool_calls or [] %}"
                                            "{{ c.function.arguments | tojson }}{% endfor %}{% endfor %}{{ tools }}"])
def test_history_arguments_sent_as_an_object_render_as_the_same_text(tokenizer, template: str | None) -> None:
    """LangChain and other clients send a call's ``arguments`` back as an object, which vLLM takes:
    it renders as its JSON text does, in vivace's convention and in a template that takes tools;
    text that is no JSON object (a call max_tokens cut) is kept as it was written."""
    if template is not None:
        tokenizer.chat_template = template

    def prompt(arguments: object) -> str:
        call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
        return _prompt(tokenizer, tools=[WEATHER], messages=[
            *ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "21"}])

    assert prompt({"city": "Paris"}) == prompt('{"city": "Paris"}')
    written = '{"city": "Paris"}' if template else '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
    assert written in prompt({"city": "Paris"})
    cut = '{"city": "Par'
    assert (cut if template is None else json.dumps(cut)) in prompt(cut)
