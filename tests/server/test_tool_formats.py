"""The families' tool-call forms (``--tool-call-parser``): each parser reads the same calls however
the text is split, keeps text before the calls and malformed text as content; each grammar, with
the real llguidance and the default tokenizer, holds a tiny random model to calls its parser reads
and that fit the schema; ``auto`` reads the form off the chat template; ids and history fit the
family's template; an unknown parser name exits 2. End to end: ``test_tool_formats_served.py``."""

from __future__ import annotations

import json

import jsonschema
import pytest
import transformers

from vivace.cli import main
from vivace.engine.async_engine import AsyncEngine
from vivace.engine.grammar import GrammarCompiler
from vivace.engine.outputs import FinishReason
from vivace.engine.sampling_params import SamplingParams, StructuredOutput
from vivace.server.protocol import ChatTemplateRequest, Tool
from vivace.server.tool_formats import HERMES, ToolFormat, detect, load_tool_format
from vivace.server.tool_parser import ParsedCall, parse_tool_calls
from vivace.server.tools import chat_messages

LLAMA, MISTRAL, MISTRAL_ARGS = ToolFormat("llama3_json"), ToolFormat("mistral"), ToolFormat("mistral", args_form=True)
GRANITE = ToolFormat("granite")
WEATHER = {"city": "Paris", "tags": ["a}", "b\"", "{;"]}
TIME = {"zone": "utc"}
# Each form's two calls, as the model writes them.
TWO_CALLS = {
    "llama3_json": '{"name": "get_weather", "parameters": ' + json.dumps(WEATHER) + '}; '
                   '{"name": "get_time", "parameters": ' + json.dumps(TIME) + '}',
    "mistral": '[TOOL_CALLS] [{"name": "get_weather", "arguments": ' + json.dumps(WEATHER) + '}, '
               '{"name": "get_time", "arguments": ' + json.dumps(TIME) + ', "id": "abcdefghi"}]',
    "mistral_args": "[TOOL_CALLS]get_weather[ARGS]" + json.dumps(WEATHER) + "[TOOL_CALLS]get_time[ARGS]" + json.dumps(TIME),
    "granite": '<|tool_call|>[{"name": "get_weather", "arguments": ' + json.dumps(WEATHER) + '}, '
               '{"name": "get_time", "arguments": ' + json.dumps(TIME) + '}]',
}
FORMS = {"llama3_json": LLAMA, "mistral": MISTRAL, "mistral_args": MISTRAL_ARGS, "granite": GRANITE}


def stream(form: ToolFormat, pieces: list[str]) -> tuple[str, list[dict[str, str]]]:
    """Feed ``pieces`` to a fresh parser of ``form``; assemble content and calls as an OpenAI
    client does from the deltas."""
    parser, content, calls = form.parser(), "", {}
    for piece in pieces:
        got, deltas = parser.feed(piece)
        content += got
        for delta in deltas:
            if delta.id is not None:
                assert delta.index not in calls and delta.arguments == "", "index, id and name come first"
                calls[delta.index] = {"id": delta.id, "name": delta.name, "arguments": ""}
            calls[delta.index]["arguments"] += delta.arguments
    content += parser.finish()[0]
    assert sorted(calls) == list(range(len(calls)))
    return content, list(calls.values())


def splits(text: str) -> list[list[str]]:
    """``text`` whole, one character at a time, and in two pieces at every boundary."""
    return [[text], list(text), *([text[:i], text[i:]] for i in range(1, len(text)))]


@pytest.mark.parametrize("form", sorted(FORMS))
def test_calls_are_the_same_however_the_text_is_split(form: str) -> None:
    text = "Let me look. " + TWO_CALLS[form]
    whole_content, whole_calls = parse_tool_calls(text, FORMS[form].parser())
    assert whole_content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in whole_calls] == [("get_weather", WEATHER), ("get_time", TIME)]
    for pieces in splits(text):
        content, calls = stream(FORMS[form], pieces)
        assert content == "Let me look. ", pieces
        assert [(c["name"], c["arguments"]) for c in calls] == [(c.name, c.arguments) for c in whole_calls], pieces
        assert calls[0]["id"] != calls[1]["id"]


@pytest.mark.parametrize("form", sorted(FORMS))
def test_a_call_alone_has_no_content(form: str) -> None:
    content, calls = parse_tool_calls(TWO_CALLS[form], FORMS[form].parser())
    assert content is None and len(calls) == 2


@pytest.mark.parametrize("form, text", [
    ("llama3_json", 'Here: {"city": "Paris"} and {"name": 5, "parameters": {}}; {"name"'),
    ("llama3_json", '{"name": "f", "parameters": "not an object"}'),
    ("mistral", "[TOOL_CALLS] not a list"),
    ("mistral", '[TOOL_CALLS] [{"arguments": {}}]'),
    ("mistral_args", "[TOOL_CALLS]no args here"),
    ("mistral_args", "[TOOL_CALL"),
    ("granite", "<|tool_call|> not a list"),
])
def test_malformed_calls_stay_content(form: str, text: str) -> None:
    for pieces in splits(text):
        assert stream(FORMS[form], pieces) == (text, []), pieces
    assert parse_tool_calls(text, FORMS[form].parser()) == (text.strip(), [])


def test_text_after_the_calls_is_content_and_a_call_cut_short_keeps_what_it_had() -> None:
    content, calls = parse_tool_calls('{"name": "f", "parameters": {}} Done.', LLAMA.parser())
    assert content == "Done." and calls[0].arguments == "{}"
    parser = MISTRAL_ARGS.parser()
    _, deltas = parser.feed('[TOOL_CALLS]f[ARGS]{"x": "ab')
    assert deltas[0].name == "f" and deltas[-1].arguments == '{"x": "ab'
    assert parser.finish() == ("", [])


@pytest.mark.parametrize("form", list(TWO_CALLS))
def test_a_next_call_cut_off_before_its_name_is_none(form: str) -> None:
    """max_tokens can end the output anywhere between two calls: the first call stands alone,
    and nothing of the second leaks into the content."""
    text, weather = TWO_CALLS[form], json.dumps(WEATHER)
    for cut in range(text.index(weather) + len(weather), text.index("get_time")):
        content, calls = parse_tool_calls(text[:cut], FORMS[form].parser())
        assert content is None and [c.name for c in calls] == ["get_weather"], text[:cut]


def test_ids_are_the_familys() -> None:
    ids = {MISTRAL.new_call_id() for _ in range(20)}
    assert len(ids) == 20 and all(len(i) == 9 and i.isalnum() for i in ids)
    assert LLAMA.new_call_id().startswith("call_") and HERMES.new_call_id().startswith("call_")
    # Mistral's templates raise unless an id is 9 alphanumerics: another id maps to one, always the same.
    assert MISTRAL.history_id("abcdefghi") == "abcdefghi"
    mapped = MISTRAL.history_id("call_1")
    assert len(mapped) == 9 and mapped.isalnum() and mapped == MISTRAL.history_id("call_1") != MISTRAL.history_id("call_2")
    assert LLAMA.history_id("call_1") == "call_1"


@pytest.mark.parametrize("template, parser", [
    ("{% for m in messages %}{{ m.content }}{% endfor %}", "hermes"),
    ("{% if tools %}<tools>{{ tools }}</tools> reply in <tool_call></tool_call>{% endif %}", "hermes"),
    ("{%- if tools %}Environment: ipython{% endif %}<|python_tag|>", "llama3_json"),
    ('{% if tools %}Respond in the format {"name": function name, "parameters": dict}{% endif %}', "llama3_json"),
    ("{% if m.tool_calls %}[TOOL_CALLS] [{{ m.tool_calls | tojson }}]{% endif %}", "mistral"),
    # Granite 3.x's system prompt with tools.
    ("{% if tools %}When a tool is required to answer the user's query, respond with <|tool_call|> followed by a "
     "JSON list of tools used.{% endif %}", "granite"),
])
def test_auto_reads_the_form_off_the_chat_template(template: str, parser: str) -> None:
    assert detect(template) == parser


def test_mistral_form_and_special_markers_come_from_the_tokenizer(default_tokenizer_dir) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(default_tokenizer_dir)
    tokenizer.chat_template = "{{ messages }}[TOOL_CALLS]"
    assert load_tool_format("auto", tokenizer) == ToolFormat("mistral")  # markers as text
    tokenizer.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]", "[ARGS]"]})
    form = load_tool_format("auto", tokenizer)
    assert form.args_form and form.keeps_special_tokens
    assert dict(form.specials) == {"[TOOL_CALLS]": tokenizer.convert_tokens_to_ids("[TOOL_CALLS]"),
                                   "[ARGS]": tokenizer.convert_tokens_to_ids("[ARGS]")}
    assert load_tool_format("llama3_json", tokenizer) == LLAMA  # a named parser wins over the template
    with pytest.raises(ValueError, match="unknown tool call parser 'pythonic'"):
        load_tool_format("pythonic", tokenizer)


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_markers_that_are_added_tokens_are_matched_by_id(default_tokenizer_dir, choice: str) -> None:
    """Qwen2.5's and Qwen3's <tool_call> and </tool_call> are added tokens (not special ones): llguidance
    never reads an added token as text, so the grammar must name them by id, or it forbids the very
    tokens the model writes its calls with; they stay in the text the parser reads."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(default_tokenizer_dir)
    tokenizer.add_tokens(["<tool_call>", "</tool_call>"])
    tokenizer.chat_template = "{{ tools }}<tool_call>"
    form = load_tool_format("auto", tokenizer)
    assert form.name == "hermes" and dict(form.specials) == {
        "<tool_call>": tokenizer.convert_tokens_to_ids("<tool_call>"), "</tool_call>": tokenizer.convert_tokens_to_ids("</tool_call>")}
    assert not form.keeps_special_tokens  # plain added tokens are in the text anyway
    written = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}\n</tool_call>'
    ids = tokenizer.encode(written, add_special_tokens=False)
    assert ids[0] == dict(form.specials)["<tool_call>"]
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    matcher = compiler.compile(form.grammar(TOOLS, choice, parallel=True))
    assert matcher.consume_tokens(ids) and matcher.consume_token(tokenizer.eos_token_id), matcher.get_error()
    assert parse_tool_calls(tokenizer.decode(ids, skip_special_tokens=True), form.parser())[1][0].name == "get_time"


SCHEMAS = {
    "get_weather": {"type": "object", "properties": {"unit": {"enum": ["c", "f"]},
                                                     "days": {"type": "integer", "minimum": 1, "maximum": 3}},
                    "required": ["unit", "days"], "additionalProperties": False},
    "get_time": {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
                 "additionalProperties": False}}
TOOLS = [Tool.model_validate({"type": "function", "function": {"name": n, "parameters": p}}) for n, p in SCHEMAS.items()]


# A nested model as pydantic writes it: ``$defs`` at the root, ``#/$defs/...`` refs to them.
BOOKING = {"$defs": {"Place": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}},
                               "required": ["city"], "additionalProperties": False}},
           "type": "object", "properties": {"to": {"$ref": "#/$defs/Place"},
                                            "back": {"anyOf": [{"$ref": "#/$defs/Place"}, {"type": "null"}]}},
           "required": ["to", "back"], "additionalProperties": False}
BOOK = Tool.model_validate({"type": "function", "function": {"name": "book", "parameters": BOOKING}})
FORM_IDS = {"ids": lambda f: f.label}


async def one_call(engine: AsyncEngine, form: ToolFormat, tools: list[Tool], choice: str, seed: int) -> ParsedCall:
    """The one whole call a random model writes under ``form``'s grammar for ``choice``."""
    params = SamplingParams(temperature=1.0, seed=seed, max_tokens=120,
                            structured=form.grammar(tools, choice, parallel=False))
    text, finish = "", None
    async for out in engine.generate("What is the weather?", params, f"{form.name}-{choice}-{seed}"):
        text += out.outputs[0].text
        finish = out.outputs[0].finish_reason
    assert finish is FinishReason.STOP, text  # the grammar completed: one whole call
    content, calls = parse_tool_calls(text, form.parser())
    assert content is None and len(calls) == 1, text
    assert choice == "required" or calls[0].name == choice
    return calls[0]


@pytest.mark.parametrize("form", [HERMES, LLAMA, MISTRAL, MISTRAL_ARGS, GRANITE], **FORM_IDS)
@pytest.mark.parametrize("choice", ["required", "get_time"])
async def test_each_grammar_holds_a_random_model_to_calls_that_fit(tiny_engine: AsyncEngine, form: ToolFormat,
                                                                   choice: str) -> None:
    for seed in (0, 1):
        call = await one_call(tiny_engine, form, TOOLS, choice, seed)
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])


@pytest.mark.parametrize("form", [HERMES, LLAMA, MISTRAL, MISTRAL_ARGS, GRANITE], **FORM_IDS)
async def test_a_schemas_refs_to_its_own_defs_resolve_in_each_grammar(tiny_engine: AsyncEngine,
                                                                      form: ToolFormat) -> None:
    call = await one_call(tiny_engine, form, [*TOOLS, BOOK], "book", seed=0)
    jsonschema.validate(json.loads(call.arguments), BOOKING)


def test_grammars_of_each_form_name_only_the_chosen_function() -> None:
    tools = [Tool.model_validate({"type": "function", "function": {"name": n}}) for n in ("get_weather", "get_time")]
    for form in (HERMES, LLAMA, MISTRAL, MISTRAL_ARGS, GRANITE):
        named = form.grammar(tools, "get_time", parallel=True).spec
        assert "get_time" in named and "get_weather" not in named and "TEXT |" not in named
        assert "TEXT |" in form.grammar(tools, "auto", parallel=True).spec


def test_an_unknown_tool_call_parser_exits_2_naming_the_choices(capsys: pytest.CaptureFixture[str],
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    assert main(["serve", "--tool-call-parser", "pythonic", "--enable-auto-tool-choice", "--port", "1"]) == 2
    assert "unknown tool call parser 'pythonic': choose one of auto, hermes, llama3_json, mistral, granite" in capsys.readouterr().err
    monkeypatch.setenv("VIVACE_TOOL_CALL_PARSER", "xlam")
    assert main(["serve", "--port", "1"]) == 2
    assert "unknown tool call parser 'xlam'" in capsys.readouterr().err


@pytest.mark.parametrize("form, written", [
    (HERMES, '<tool_call>\n{"name": "get_time", "arguments": {"zone": "utc"}}\n</tool_call>'),
    (LLAMA, '{"name": "get_time", "parameters": {"zone": "utc"}}'),
    (MISTRAL, '[TOOL_CALLS] [{"name": "get_time", "arguments": {"zone": "utc"}}]'),
    (MISTRAL_ARGS, '[TOOL_CALLS]get_time[ARGS]{"zone": "utc"}'),
    (GRANITE, '<|tool_call|>[{"name": "get_time", "arguments": {"zone": "utc"}}]'),
])
def test_a_template_without_tools_is_told_the_form_and_sees_its_calls_in_it(default_tokenizer_dir, form: ToolFormat,
                                                                           written: str) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(default_tokenizer_dir)
    body = ChatTemplateRequest.model_validate({"tools": [t.model_dump() for t in TOOLS], "messages": [
        {"role": "user", "content": "Time?"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "get_time", "arguments": json.dumps(TIME)}}]}]})
    messages, tools = chat_messages(body, tokenizer, "auto", form)
    assert tools is None and form.instruction() in messages[0]["content"]
    assert messages[-1]["content"] == written
    assert parse_tool_calls(written, form.parser())[1][0].name == "get_time"


def test_a_history_call_with_empty_arguments_has_none(default_tokenizer_dir) -> None:
    """Clients send ``"arguments": ""`` back for a call without parameters: it is ``{}`` (as in vLLM),
    not a 400."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(default_tokenizer_dir)
    body = ChatTemplateRequest.model_validate({"messages": [
        {"role": "user", "content": "Time?"},
        {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "get_time", "arguments": ""}}]}]})
    messages, _ = chat_messages(body, tokenizer, "none", HERMES)
    assert messages[-1]["content"] == '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'


def test_a_participants_name_reaches_the_template(default_tokenizer_dir) -> None:
    tokenizer = transformers.AutoTokenizer.from_pretrained(default_tokenizer_dir)
    body = ChatTemplateRequest.model_validate({"messages": [{"role": "user", "content": "Hi", "name": "alice"},
                                                            {"role": "user", "content": "Yo"}]})
    messages, _ = chat_messages(body, tokenizer, "none", HERMES)
    assert [m.get("name") for m in messages] == ["alice", None]



def takes_call(tokenizer_dir, parameters: dict, arguments: str) -> bool:
    """Whether the Hermes grammar of one tool with ``parameters`` takes a call with ``arguments``."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    tools = [Tool.model_validate({"type": "function", "function": {"name": "get_weather", "parameters": parameters}})]
    matcher = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id]).compile(
        HERMES.grammar(tools, "required", parallel=False))
    written = f'<tool_call>\n{{"name": "get_weather", "arguments": {arguments}}}\n</tool_call>'
    ids = tokenizer.encode(written, add_special_tokens=False)
    return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()


CITY = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


@pytest.mark.parametrize(("parameters", "arguments", "taken"), [
    (CITY, '{"city": "Paris"}', True),
    (CITY, '{"city": "Paris", "unit": "c"}', False),
    ({"properties": {"city": {"type": "string"}}}, '"Paris"', False),  # no type: still an object
    ({"properties": {"city": {"type": "string"}}}, '{"city": "Paris"}', True),
])
def test_arguments_are_an_object_of_the_keys_their_schema_lists(default_tokenizer_dir, parameters: dict,
                                                                 arguments: str, taken: bool) -> None:
    """A schema that lists its properties and says nothing of others (as most tools' do) gets no
    others, as vLLM's xgrammar and llama.cpp hold calls: a small model padded its arguments with
    keys of its own (the tool's description, its type...) until max_tokens cut them. Arguments are
    an object even where the schema names no type (the parsers read nothing else)."""
    assert takes_call(default_tokenizer_dir, parameters, arguments) is taken


# Answers (their schema and one of them) that begin as some form's calls do: an object, one whose
# first key is llama3_json's "name", an array (mistral's and granite's calls are in one).
ANSWERS = [({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}, {"city": "Paris"}),
           ({"type": "object"}, {"name": "get_time"}), ({"type": "array", "items": {"type": "string"}}, ["Paris"])]


@pytest.mark.parametrize("form", [HERMES, LLAMA, MISTRAL, MISTRAL_ARGS, GRANITE, "qwen"],
                         ids=lambda f: f if isinstance(f, str) else f.label)
def test_auto_with_an_answer_schema_takes_calls_or_that_answer_and_nothing_else(default_tokenizer_dir,
                                                                                form: ToolFormat | str) -> None:
    """tools with a response_format: the output is the form's calls from its first token, or the
    answer in the schema (as ``json.dumps`` writes it), even one that begins as the calls do; free
    text, or text before a call, is neither. "qwen": Hermes calls whose markers are added tokens."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(default_tokenizer_dir)
    if form == "qwen":
        tokenizer.add_tokens(["<tool_call>", "</tool_call>"])
        tokenizer.chat_template = "{{ tools }}<tool_call>"
        form = load_tool_format("auto", tokenizer)
        assert form.specials
    compiler = GrammarCompiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    forced = form.grammar(TOOLS, "required", parallel=True)
    assert form.grammar(TOOLS, "required", parallel=True, answer=forced) == forced  # a forced choice wins
    call = form.write([("get_time", TIME)])
    for schema, answer in ANSWERS:
        grammar = form.grammar(TOOLS, "auto", parallel=True, answer=StructuredOutput("json_schema", json.dumps(schema)))

        def takes(text: str) -> bool:
            matcher = compiler.compile(grammar)
            ids = tokenizer.encode(text, add_special_tokens=False)
            return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()

        assert takes(call) and takes(json.dumps(answer)), (schema, answer)
        # A call that is an answer too (llama3_json's beside any object) ends the output: one call at most.
        two = form.write([("get_time", TIME), ("get_weather", {"unit": "c", "days": 2})])
        assert takes(two) != (form is LLAMA and schema == {"type": "object"})
        assert not takes("Paris") and not takes("Let me check. " + call) and not takes(json.dumps(answer) + call)
