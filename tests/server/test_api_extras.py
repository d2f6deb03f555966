"""vLLM's extras that its users send: ``chat_template_kwargs``, ``logit_bias`` (OpenAI's too),
``/tokenize`` and ``/detokenize``, ``/version`` and ``stream_options.continuous_usage_stats``; one
tiny model whose chat template reads variables (``enable_thinking`` as Qwen3's, a budget it does
arithmetic with) behind one server for the module."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai
import pytest
import transformers
from openapi_spec_validator import validate

import vivace
from vivace.config import EngineConfig
from vivace.engine.async_engine import AsyncEngine
from vivace.server import ServerSettings

from .harness import RunningServer, assert_engine_idle, serving

HI = [{"role": "user", "content": "hi"}]
PROMPT = "Once upon a time"
TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
    "{% if thinking_budget is defined %}Budget: {{ thinking_budget - 1 }}\n{% endif %}{% endif %}")


@pytest.fixture(scope="module")
def extras_engine(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[AsyncEngine]:
    model = tmp_path_factory.mktemp("thinking-model")
    shutil.copytree(tiny_model_dir, model, dirs_exist_ok=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model)
    tokenizer.chat_template = TEMPLATE
    tokenizer.save_pretrained(model)
    engine = AsyncEngine(EngineConfig(model=str(model), max_model_len=256, num_kv_blocks=64, max_num_seqs=8))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def server(extras_engine: AsyncEngine) -> Iterator[RunningServer]:
    with serving(extras_engine, ServerSettings(served_model_name="tiny")) as running:
        yield running


@pytest.fixture(autouse=True)
def _engine_integrity(extras_engine: AsyncEngine) -> Iterator[None]:  # this module's engine, not the shared one
    yield
    assert_engine_idle(extras_engine)


def greedy(client: openai.OpenAI, max_tokens: int, prompt: str = PROMPT, **extra: object) -> str:
    return client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                     **extra).choices[0].text


def test_chat_template_kwargs_reach_the_template(server: RunningServer) -> None:
    client = server.client()

    def prompt_tokens(**kwargs: object) -> int:
        extra = {"chat_template_kwargs": kwargs} if kwargs else None
        return client.chat.completions.create(model="tiny", messages=HI, max_tokens=1,
                                              extra_body=extra).usage.prompt_tokens

    plain = prompt_tokens()
    assert prompt_tokens(enable_thinking=False) > plain  # the empty <think></think> block
    assert prompt_tokens(enable_thinking=True) == prompt_tokens(unused={"a": [1]}) == plain
    assert prompt_tokens(thinking_budget=8) > plain
    with server.http() as http:
        tokens = http.post("/tokenize", json={"messages": HI, "chat_template_kwargs": {"thinking_budget": 8}}).json()
        text = http.post("/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"]
    assert text.endswith("<|im_start|>assistant\nBudget: 7\n")


@pytest.mark.parametrize("kwargs,message", [
    ({"add_generation_prompt": False}, "fields of the request itself"),
    ({"messages": []}, "vivace sets it"),
    ({"thinking_budget": "many"}, "could not use chat_template_kwargs"),
])
def test_chat_template_kwargs_that_cannot_work_are_400(server: RunningServer, kwargs: dict, message: str) -> None:
    with server.http() as http:
        response = http.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 1,
                                                           "chat_template_kwargs": kwargs})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "chat_template_kwargs" and message in error["message"]


def test_reasoning_effort_without_a_reasoning_parser_is_only_none(server: RunningServer) -> None:
    client = server.client()
    plain = client.chat.completions.create(model="tiny", messages=HI, max_tokens=1)
    none = client.chat.completions.create(model="tiny", messages=HI, max_tokens=1, reasoning_effort="none")
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens  # no parser: the template is left alone
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="tiny", messages=HI, max_tokens=1, reasoning_effort="high")
    assert refused.value.body["param"] == "reasoning_effort" and "doesn't reason" in refused.value.body["message"]


def test_logit_bias_of_100_makes_every_token_that_token(server: RunningServer,
                                                         extras_engine: AsyncEngine) -> None:
    tokenizer = extras_engine.tokenizer
    chosen = tokenizer.encode(" castle", add_special_tokens=False)[0]
    client = server.client()
    assert greedy(client, 6, logit_bias={str(chosen): 100}) == tokenizer.decode([chosen] * 6)
    chat = client.chat.completions.create(model="tiny", messages=HI, max_tokens=4, temperature=0,
                                          logit_bias={str(chosen): 100})
    assert chat.choices[0].message.content == tokenizer.decode([chosen] * 4)


def test_logit_bias_of_minus_100_changes_the_greedy_token(server: RunningServer,
                                                          extras_engine: AsyncEngine) -> None:
    client = server.client()
    first = greedy(client, 1)
    texts = extras_engine.tokenizer.batch_decode([[t] for t in range(len(extras_engine.tokenizer))])
    banned = [t for t, text in enumerate(texts) if text == first]
    assert 1 <= len(banned) <= 300
    assert greedy(client, 1, logit_bias={str(t): -100 for t in banned}) != first


def test_a_biased_request_leaves_its_batchmates_alone(server: RunningServer, extras_engine: AsyncEngine) -> None:
    client = server.client()
    chosen = extras_engine.tokenizer.encode(" castle", add_special_tokens=False)[0]
    alone = greedy(client, 12)
    with ThreadPoolExecutor(6) as pool:
        plain = [pool.submit(greedy, client, 12) for _ in range(3)]
        biased = [pool.submit(greedy, client, 12, "The end", logit_bias={str(chosen): 100}) for _ in range(3)]
        assert [f.result() for f in plain] == [alone] * 3
        assert [f.result() for f in biased] == [extras_engine.tokenizer.decode([chosen] * 12)] * 3


@pytest.mark.parametrize("bias,param", [
    ({"99999999": 5}, "logit_bias"),  # past the vocabulary
    ({"-1": 5}, "logit_bias"),
    ({"007": 5}, "logit_bias"),
    ({"castle": 5}, "logit_bias"),
    ({"5": 100.5}, "logit_bias"),
    ({str(t): 1 for t in range(301)}, "logit_bias"),
    ([5], "logit_bias"),
])
def test_bad_logit_bias_is_400_naming_it(server: RunningServer, bias: object, param: str) -> None:
    with server.http() as http:
        response = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1, "logit_bias": bias})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"].startswith(param), response.text
        assert http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 1}).status_code == 200


def test_tokenize_a_text_or_messages_and_detokenize(server: RunningServer, extras_engine: AsyncEngine) -> None:
    tokenizer = extras_engine.tokenizer
    client = server.client()
    with server.http() as http:
        text = http.post("/tokenize", json={"model": "tiny", "prompt": PROMPT}).json()
        strs = http.post("/tokenize", json={"prompt": PROMPT, "return_token_strs": True}).json()
        chat = http.post("/tokenize", json={"messages": HI}).json()
        back = http.post("/detokenize", json={"tokens": text["tokens"]}).json()
        empty = http.post("/detokenize", json={"tokens": []}).json()
    ids = tokenizer.encode(PROMPT)
    assert text == {"count": len(ids), "max_model_len": 256, "tokens": ids, "token_strs": None}
    assert strs["token_strs"] == tokenizer.convert_ids_to_tokens(ids)
    answer = client.chat.completions.create(model="tiny", messages=HI, max_tokens=1)
    assert chat["count"] == len(chat["tokens"]) == answer.usage.prompt_tokens
    assert back == {"prompt": PROMPT} and empty == {"prompt": ""}


@pytest.mark.parametrize("path,body,status,param", [
    ("/detokenize", {"tokens": [1, 10**7]}, 400, "tokens.1"),
    ("/detokenize", {"tokens": [-1]}, 400, "tokens.0"),
    ("/detokenize", {"tokens": "hi"}, 400, "tokens"),
    ("/tokenize", {"prompt": 5}, 400, "prompt"),
    ("/tokenize", {}, 400, "prompt"),
    ("/tokenize", {"messages": HI, "prompt": "hi"}, 400, "prompt"),
    ("/tokenize", {"messages": []}, 400, "messages"),
    ("/tokenize", {"prompt": "hi", "model": "other"}, 404, "model"),
])
def test_bad_tokenize_requests(server: RunningServer, path: str, body: dict, status: int, param: str) -> None:
    with server.http() as http:
        response = http.post(path, json=body)
    assert response.status_code == status, response.text
    assert response.json()["error"]["param"] == param


def test_the_new_routes_are_in_the_contract_and_behind_the_key(extras_engine: AsyncEngine) -> None:
    with serving(extras_engine, ServerSettings(api_keys=("sk-1",))) as keyed, keyed.http() as http:
        refused = [http.post(path, json=body).status_code
                   for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]}))]
        allowed = http.post("/tokenize", json={"prompt": "hi"}, headers={"Authorization": "Bearer sk-1"})
        version = http.get("/version")
        spec = http.get("/openapi.json").json()
    assert refused == [401, 401] and allowed.status_code == 200
    assert version.json() == {"version": vivace.__version__} and spec["info"]["version"] == vivace.__version__
    validate(spec)
    paths = spec["paths"]
    either_key = [{"bearer": []}, {"apiKey": []}]
    assert paths["/tokenize"]["post"]["security"] == paths["/detokenize"]["post"]["security"] == either_key
    assert "security" not in paths["/version"]["get"]
    schemas = spec["components"]["schemas"]
    assert schemas["DetokenizeRequest"]["properties"]["tokens"]["items"]["maximum"] == len(extras_engine.tokenizer) - 1
    (pattern,) = schemas["ChatCompletionRequest"]["properties"]["logit_bias"]["anyOf"][0]["patternProperties"]
    assert pattern.startswith("^(0|[1-9][0-9]{0,3}|")  # below the vocabulary's 49,152


@pytest.mark.parametrize("chat", [True, False])
def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(server: RunningServer, chat: bool) -> None:
    client = server.client()
    options = {"include_usage": True, "continuous_usage_stats": True}
    if chat:
        chunks = list(client.chat.completions.create(model="tiny", messages=HI, max_tokens=5, stream=True,
                                                     stream_options=options, extra_body={"ignore_eos": True}))
    else:
        chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, stream=True,
                                                stream_options=options, extra_body={"ignore_eos": True}))
    assert all(chunk.usage is not None for chunk in chunks)
    counts = [chunk.usage.completion_tokens for chunk in chunks]
    assert counts == sorted(counts) and counts[-1] == 5 and counts[0] < 5
    assert {chunk.usage.prompt_tokens for chunk in chunks} == {chunks[-1].usage.prompt_tokens}
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == chunks[-1].usage.prompt_tokens + 5
    with pytest.raises(openai.BadRequestError) as alone:  # as in vLLM, it needs include_usage
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=1, stream=True,
                                  stream_options={"continuous_usage_stats": True})
    assert alone.value.body["param"] == "stream_options.continuous_usage_stats"
