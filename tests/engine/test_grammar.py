"""Grammar-constrained decoding in the engine, on the tiny random Llama with the default
tokenizer: what comes out matches the grammar, free rows of the same batch are untouched."""

import json
import re

import jsonschema
import pytest

from vivace import LLM, FinishReason, SamplingParams
from vivace.engine.sampling_params import StructuredOutput

SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "size": {"type": "integer", "minimum": 0, "maximum": 9},
        "ok": {"type": "boolean"},
    },
    "required": ["color", "size", "ok"],
    "additionalProperties": False,
}


def constrained(kind: str, spec: str, **kwargs: object) -> SamplingParams:
    params = dict(temperature=0, max_tokens=64)
    params.update(kwargs)
    return SamplingParams(**params, structured=StructuredOutput(kind, spec))


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    """An engine whose KV pool must be whole again after each test."""
    engine = LLM(str(tiny_model_dir), num_kv_blocks=64, max_num_seqs=8)
    yield engine
    engine.check_integrity()


@pytest.fixture(autouse=True)
def _pool_is_whole(llm):
    yield
    kv = llm.engine.kv
    assert kv.num_free_blocks == len(kv.blocks)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_json_schema_output_validates(llm, temperature):
    params = constrained("json_schema", json.dumps(SCHEMA), temperature=temperature, seed=3)
    outputs = llm.generate([[1, 2, 3, 4], [9, 8, 7]], params)
    for out in outputs:
        completion = out.outputs[0]
        assert completion.finish_reason == FinishReason.STOP
        jsonschema.validate(json.loads(completion.text), SCHEMA)


def test_choice_and_regex(llm):
    choice = llm.generate([5, 6, 7], constrained("choice", json.dumps(["yes", "no", "maybe"])))[0]
    assert choice.outputs[0].text in {"yes", "no", "maybe"}
    regex = llm.generate([5, 6, 7], constrained("regex", r"[a-z]{3}-[0-9]{2}"))[0]
    assert re.fullmatch(r"[a-z]{3}-[0-9]{2}", regex.outputs[0].text)
    assert regex.outputs[0].finish_reason == FinishReason.STOP


def test_cut_by_max_tokens_says_length(llm):
    schema = {"type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}
    out = llm.generate([5, 6, 7], constrained("json_schema", json.dumps(schema), max_tokens=5))[0]
    assert out.outputs[0].finish_reason == FinishReason.LENGTH
    assert len(out.outputs[0].token_ids) == 5


def test_free_rows_of_a_mixed_batch_keep_their_greedy_tokens(llm):
    free = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prompts = [[11, 12, 13], [21, 22, 23, 24], [31, 32]]
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, free)]
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        engine.add_request(f"free-{i}", prompt, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
        engine.add_request(f"json-{i}", prompt, constrained("json_schema", json.dumps(SCHEMA)))
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
    assert [tokens[f"free-{i}"] for i in range(3)] == alone
    for i in range(3):
        jsonschema.validate(json.loads(llm.engine.tokenizer.decode(tokens[f"json-{i}"])), SCHEMA)


def test_an_always_true_grammar_keeps_greedy_output(llm):
    prompt = [40, 41, 42, 43]
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=24))[0].outputs[0]
    anything = llm.generate(prompt, constrained("regex", r"(?s:.*)", max_tokens=24))[0].outputs[0]
    assert anything.token_ids == free.token_ids


def test_a_schema_that_does_not_compile_is_refused_before_queueing(llm):
    bad = constrained("json_schema", json.dumps({"type": "string", "pattern": "(?<=a)b"}))
    with pytest.raises(ValueError, match="look-around"):
        llm.engine.add_request("bad", [1, 2, 3], bad)
    assert "bad" not in llm.engine.requests
    with pytest.raises(ValueError, match="invalid json_schema"):
        llm.engine.add_request("bad", [1, 2, 3], constrained("json_schema", "{not json"))


def test_constrained_requests_do_not_speculate(tiny_model_dir):
    llm = LLM(str(tiny_model_dir), num_kv_blocks=128, speculative="ngram")
    params = constrained("json_schema", json.dumps(SCHEMA))
    out = llm.generate([1, 2, 3, 1, 2, 3, 1, 2, 3], params)[0]
    jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)
    assert llm.engine.spec_stats.num_proposed == 0
    llm.check_integrity()


def _accepts(llm, schema: dict, text: str) -> bool:
    """Whether ``schema``'s grammar takes ``text`` whole."""
    matcher = llm.engine.grammars.compile(StructuredOutput("json_schema", json.dumps(schema)))
    ids = llm.engine.tokenizer.encode(text, add_special_tokens=False)
    return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()


PERSON = {"type": "object", "required": ["name"], "properties": {
    "name": {"type": "string"},
    "home": {"$ref": "#/$defs/City"},
    "properties": {"type": "object", "properties": {"x": {"type": "integer"}}}},  # a key named so
    "$defs": {"City": {"type": "object", "properties": {"zip": {"type": "string"}}}}}


@pytest.mark.parametrize(("text", "taken"), [
    ('{"name": "a"}', True),
    ('{"name": "a", "home": {"zip": "1"}, "properties": {"x": 1}}', True),
    ('{"name": "a", "age": 3}', False),  # a key the schema does not list
    ('{"name": "a", "home": {"zip": "1", "street": "b"}}', False),  # nor its $ref's
    ('{"name": "a", "properties": {"y": 1}}', False),
])
def test_objects_that_list_properties_take_no_others(llm, text, taken):
    """As vLLM's xgrammar and llama.cpp read a schema: a small model must not pad an answer with
    keys of its own (it did, until max_tokens cut the JSON)."""
    assert _accepts(llm, PERSON, text) is taken


@pytest.mark.parametrize(("schema", "text"), [
    ({"type": "object"}, '{"any": 1}'),  # json_object: lists nothing, stays free
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": True}, '{"a": 1, "b": 2}'),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "b"]}, '{"a": 1, "b": 2}'),
    ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "minProperties": 2},
     '{"a": 1, "b": 2}'),
    ({"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                {"type": "object", "properties": {"b": {"type": "integer"}}}]}, '{"a": 1, "b": 2}'),
    ({"$defs": {"Base": {"type": "object", "properties": {"a": {"type": "integer"}}}},
      "allOf": [{"$ref": "#/$defs/Base"}], "properties": {"b": {"type": "integer"}}}, '{"a": 1, "b": 2}'),
])
def test_objects_that_say_otherwise_or_combine_stay_open(llm, schema, text):
    """Closing the parts of an allOf would refuse each other's keys: they stay as written."""
    assert _accepts(llm, schema, text)
