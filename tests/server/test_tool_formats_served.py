"""Tool calls of Llama 3 and Mistral style models end to end, through the official client: real
programmed models (``programmed.py``) whose chat templates are those families' and whose greedy
answer is a call in the family's own form, written freely under ``tool_choice`` "auto"; the
client gets ``tool_calls``, streamed and whole, with the family's ids, and the history of a call
renders in the template (Mistral 7B v0.3's demands 9-character ids)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import transformers

from vivace.config import EngineConfig
from vivace.server import ServerSettings
from vivace.server.state import server_state

from .harness import RunningServer, assert_engine_idle, serving_own_engine
from .programmed import distinct_tokens, save_programmed

ASK = [{"role": "user", "content": "Weather in Paris?"}]
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ARGUMENTS = {"city": "Paris"}
_RAISE_UNLESS_9 = ("{% if call_id | length != 9 %}{{ raise_exception('Tool call IDs should be alphanumeric "
                   "strings with length 9!') }}{% endif %}")
# Llama 3.1's tool conventions, short: the "ipython" role, a bare JSON call with "parameters".
LLAMA_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n"
    'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.\n\n'
    "{% for tool in tools %}{{ tool | tojson }}\n\n{% endfor %}<|eot_id|>{% endif %}"
    "{% for message in messages %}{% if message.tool_calls %}{% set call = message.tool_calls[0].function %}"
    '<|start_header_id|>assistant<|end_header_id|>\n\n{"name": "{{ call.name }}", "parameters": '
    "{{ call.arguments | tojson }}}<|eom_id|>"
    "{% elif message.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>\n\n{{ message.content }}<|eot_id|>"
    "{% else %}<|start_header_id|>{{ message.role }}<|end_header_id|>\n\n{{ message.content }}<|eot_id|>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
# Mistral 7B v0.3's: tools in [AVAILABLE_TOOLS], calls as a JSON array after [TOOL_CALLS].
MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% if tools %}[AVAILABLE_TOOLS] {{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "{% for message in messages %}{% if message.role == 'user' %}[INST] {{ message.content }}[/INST]"
    "{% elif message.tool_calls %}[TOOL_CALLS] [{% for call in message.tool_calls %}"
    "{% set call_id = call.id %}" + _RAISE_UNLESS_9 +
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}, "id": "{{ call.id }}"}'
    "{% if not loop.last %}, {% endif %}{% endfor %}]{{ eos_token }}"
    "{% elif message.role == 'tool' %}{% set call_id = message.tool_call_id %}" + _RAISE_UNLESS_9 +
    '[TOOL_RESULTS] {"content": {{ message.content }}, "call_id": "{{ message.tool_call_id }}"}[/TOOL_RESULTS]'
    "{% else %}{{ message.content }}{{ eos_token }}{% endif %}{% endfor %}")
# Mistral Small 3.1's and later: a call is [TOOL_CALLS]name[ARGS]{...}, ids are not rendered.
MISTRAL_ARGS_TEMPLATE = (
    "{{ bos_token }}{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "{% for message in messages %}{% if message.role == 'user' %}[INST]{{ message.content }}[/INST]"
    "{% elif message.tool_calls %}{% for call in message.tool_calls %}"
    "[TOOL_CALLS]{{ call.function.name }}[ARGS]{{ call.function.arguments | tojson }}{% endfor %}{{ eos_token }}"
    "{% elif message.role == 'tool' %}[TOOL_RESULTS]{{ message.content }}[/TOOL_RESULTS]"
    "{% else %}{{ message.content }}{{ eos_token }}{% endif %}{% endfor %}")
MISTRAL_SPECIALS = ("[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]",
                    "[/TOOL_RESULTS]")


@dataclass(frozen=True)
class Caller:
    """A family's model: its template and added special tokens, the prompt's last token, what it
    answers (special tokens and pieces of text), and what the server should call its form."""

    template: str
    specials: tuple[str, ...]
    prompt_end: str
    answer: tuple[str, ...]
    label: str


CALLERS = {
    "llama3_json": Caller(LLAMA_TEMPLATE, ("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>"),
                          "ĊĊ", ('{"name": "get_weather", "parameters": ' + json.dumps(ARGUMENTS) + "}",),
                          "llama3_json"),
    "mistral": Caller(MISTRAL_TEMPLATE, MISTRAL_SPECIALS, "[/INST]",
                      ("[TOOL_CALLS]", ' [{"name": "get_weather", "arguments": ' + json.dumps(ARGUMENTS) + "}]"),
                      "mistral ([TOOL_CALLS] [...])"),
    "mistral_args": Caller(MISTRAL_ARGS_TEMPLATE, (*MISTRAL_SPECIALS, "[ARGS]"), "[/INST]",
                           ("[TOOL_CALLS]", "get_weather", "[ARGS]", json.dumps(ARGUMENTS)),
                           "mistral ([TOOL_CALLS]name[ARGS]{...})"),
}


def save_caller(out: Path, tokenizer_dir: Path, caller: Caller) -> Path:
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": list(caller.specials)})
    tokenizer.chat_template = caller.template
    chain = [caller.prompt_end]
    for piece in caller.answer:
        chain += [piece] if piece in caller.specials else distinct_tokens(tokenizer, piece, set(chain))
    return save_programmed(out, tokenizer, [[*chain, tokenizer.eos_token]])


@pytest.fixture(scope="module", params=sorted(CALLERS))
def family(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
           default_tokenizer_dir: Path) -> Iterator[tuple[str, RunningServer]]:
    model = save_caller(tmp_path_factory.mktemp(request.param), default_tokenizer_dir, CALLERS[request.param])
    config = EngineConfig(model=str(model), max_model_len=512, num_kv_blocks=96, max_num_seqs=4)
    with serving_own_engine(config, ServerSettings(served_model_name="caller")) as running:
        yield request.param, running


@pytest.fixture
def server(family: tuple[str, RunningServer]) -> Iterator[tuple[str, RunningServer]]:
    yield family
    assert_engine_idle(family[1].engine)


def _chat(server: RunningServer, **kwargs: object):
    return server.client().chat.completions.create(model="caller", messages=kwargs.pop("messages", ASK),
                                                   tools=[WEATHER], temperature=0, **kwargs)


def _check_id(name: str, call_id: str) -> None:
    if name.startswith("mistral"):
        assert len(call_id) == 9 and call_id.isalnum()
    else:
        assert call_id.startswith("call_")


def test_auto_reads_the_form_off_the_template(server: tuple[str, RunningServer]) -> None:
    name, running = server
    assert server_state(running).tool_format(running.engine).label == CALLERS[name].label


def test_a_call_written_freely_comes_back_as_tool_calls(server: tuple[str, RunningServer]) -> None:
    name, running = server
    choice = _chat(running).choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == ARGUMENTS
    _check_id(name, call.id)


def test_a_streamed_call_comes_as_tool_call_deltas(server: tuple[str, RunningServer]) -> None:
    name, running = server
    calls: dict[int, dict[str, str]] = {}
    content, reasons, pieces = "", [], 0
    for chunk in _chat(running, stream=True):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            reasons.append(choice.finish_reason)
            for delta in choice.delta.tool_calls or []:
                if delta.id is not None:
                    calls[delta.index] = {"id": delta.id, "name": delta.function.name, "arguments": ""}
                calls[delta.index]["arguments"] += delta.function.arguments or ""
                pieces += 1
    assert content == "" and reasons[-1] == "tool_calls"
    (call,) = calls.values()
    assert call["name"] == "get_weather" and json.loads(call["arguments"]) == ARGUMENTS
    assert pieces > 2  # the arguments arrive as the model writes them
    _check_id(name, call["id"])


@pytest.mark.parametrize("call_id", ["abc123XYZ", "call_from_elsewhere"])
def test_the_calls_history_renders_in_the_template(server: tuple[str, RunningServer], call_id: str) -> None:
    name, running = server
    history = [*ASK, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": json.dumps(ARGUMENTS)}}]},
        {"role": "tool", "tool_call_id": call_id, "content": '{"celsius": 21}'}]
    with running.http() as http:
        answer = http.post("/tokenize", json={"model": "caller", "messages": history, "tools": [WEATHER]})
    assert answer.status_code == 200, answer.text
    prompt = running.engine.tokenizer.decode(answer.json()["tokens"])
    assert '{"city": "Paris"}' in prompt and '{"celsius": 21}' in prompt
    if name == "mistral":  # the same 9-character id for the call and its result
        sent = call_id if len(call_id) == 9 else prompt.split('"id": "')[1][:9]
        assert f'"id": "{sent}"' in prompt and f'"call_id": "{sent}"' in prompt and sent.isalnum()


def test_the_responses_api_gets_the_call_too(server: tuple[str, RunningServer]) -> None:
    name, running = server
    flat = {"type": "function", **WEATHER["function"]}
    response = running.client().responses.create(model="caller", input="Weather in Paris?", tools=[flat],
                                                  temperature=0)
    (call,) = [item for item in response.output if item.type == "function_call"]
    assert call.name == "get_weather" and json.loads(call.arguments) == ARGUMENTS
    _check_id(name, call.call_id)
