"""schemathesis hooks for fuzzing vivace (loaded with SCHEMATHESIS_HOOKS=fuzz_hooks).

A positive case is valid by the JSON schema; a few of vivace's rules tie fields together, which a
JSON schema can't say (top_logprobs needs logprobs, stream_options needs stream,
continuous_usage_stats needs include_usage, min_tokens <= max_tokens, best_of == n, max_tokens 0
only with echo, prompt_logprobs not in a stream, continue_final_message without
add_generation_prompt, thinking only in assistant messages, a reasoning effort (chat's or
the Responses API's) only where the server reasons, prompt plus max_tokens within the context), and
the grammar-carrying fields (a JSON schema, regex or grammar to constrain the output, tools and
their calls, legacy functions and theirs) are valid only if the grammar engine compiles them,
which no JSON schema can say.
For positive cases only, this hook makes such a body obey the rules and drops those fields, and
keeps each case short (at most 8 tokens, 2 choices) so a bounded run covers many cases; the
messages of a ``/tokenize`` body get the same care (its tools stay, with unique names, and no tool_choice), and a ``/v1/responses`` body
its own (no tools or json_schema format, function calls' arguments ``{}``, few tokens), and a
``/v1/messages`` (or count_tokens) body its own (the served model's name, which it must give; no
tools or output format, a prompt within the context, no thinking budget, few tokens). Negative cases
go out untouched. Structured output and tools have their own tests.
"""

from __future__ import annotations

import json
from typing import Any

import schemathesis

MAX_TOKENS = 8
MAX_CHOICES = 2
MODEL = "fuzzed"  # the name fuzz.py serves the model under (fuzz.SERVED_MODEL)
# Characters of a Messages API conversation's JSON (escaped: a character of it makes a token at most)
# that leave its prompt room in fuzz.py's context of 1024 tokens, with the template's own tokens.
PROMPT_CHARS = 400


GRAMMAR_FIELDS = ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
                  "tools", "tool_choice", "parallel_tool_calls", "functions", "function_call")


def _drop_grammars(body: dict[str, Any]) -> None:
    for field in GRAMMAR_FIELDS:
        body.pop(field, None)
    if isinstance(body.get("response_format"), dict) and body["response_format"].get("type") not in ("text", "json_object"):
        body.pop("response_format")
    _drop_calls(body)


def _drop_calls(body: dict[str, Any]) -> None:
    """Messages without tool calls or results (their ids must pair up), legacy function calls or
    results included, and thinking only in assistant messages."""
    for message in body.get("messages") or []:
        if isinstance(message, dict):
            message.pop("tool_calls", None)
            message.pop("tool_call_id", None)
            message.pop("function_call", None)
            if message.get("role") in ("tool", "function"):
                message["role"] = "user"
            if message.get("role") != "assistant":
                message.pop("reasoning_content", None)
                message.pop("reasoning", None)


def _number(value: Any) -> bool:
    """An integer of JSON Schema's: 5 or 5.0 (never true)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _fit(body: dict[str, Any]) -> None:
    _drop_grammars(body)
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = MAX_TOKENS
    for field in ("max_tokens", "max_completion_tokens"):
        if _number(body.get(field)):
            body[field] = min(body[field], MAX_TOKENS)
    if _number(body.get("n")):
        body["n"] = min(body["n"], MAX_CHOICES)
    if "best_of" in body and body["best_of"] is not None:
        body["best_of"] = body.get("n", 1)
    limit = min([MAX_TOKENS] + [body[f] for f in ("max_tokens", "max_completion_tokens") if _number(body.get(f))])
    if _number(body.get("min_tokens")):
        body["min_tokens"] = min(body["min_tokens"], limit)
    if "prompt" in body and _number(body.get("max_tokens")) and body["max_tokens"] == 0:
        body["echo"] = True
    if not body.get("stream"):
        body.pop("stream_options", None)
    elif isinstance(body.get("stream_options"), dict) and body["stream_options"].get("continuous_usage_stats"):
        body["stream_options"]["include_usage"] = True
    if body.get("logprobs") is not True and "messages" in body:
        body.pop("top_logprobs", None)
    if body.get("stream"):
        body.pop("prompt_logprobs", None)
    if body.get("reasoning_effort") not in (None, "none"):  # the fuzzed server has no reasoning parser
        body.pop("reasoning_effort")
    _fit_template(body)


def _fit_template(body: dict[str, Any]) -> None:
    if body.get("continue_final_message"):
        body["add_generation_prompt"] = False


def _fit_tools(body: dict[str, Any]) -> None:
    """A /tokenize body's tools as chat requires them: no tool_choice (a named one must name a
    tool, any but "none" needs tools), and no tools at all where two share a name."""
    body.pop("tool_choice", None)
    tools = body.get("tools")
    if isinstance(tools, list):
        names = [str((tool.get("function") or {}).get("name")) for tool in tools
                 if isinstance(tool, dict) and isinstance(tool.get("function"), dict)]
        if len(set(names)) != len(names):
            body.pop("tools")


def _fit_response(body: dict[str, Any]) -> None:
    """A /v1/responses body: no tools or json_schema format (grammars), function calls'
    arguments a JSON object, no reasoning effort but "none" (the fuzzed server has no reasoning
    parser), at most MAX_TOKENS tokens."""
    for field in ("tools", "tool_choice", "parallel_tool_calls"):
        body.pop(field, None)
    reasoning = body.get("reasoning")
    if isinstance(reasoning, dict) and reasoning.get("effort") not in (None, "none"):
        reasoning.pop("effort")
    text = body.get("text")
    if isinstance(text, dict) and isinstance(text.get("format"), dict) and text["format"].get("type") == "json_schema":
        text.pop("format")
    if isinstance(body.get("input"), list):
        for item in body["input"]:
            if isinstance(item, dict) and item.get("type") == "function_call":
                item["arguments"] = "{}"
    if not _number(body.get("max_output_tokens")):
        body["max_output_tokens"] = MAX_TOKENS
    body["max_output_tokens"] = min(body["max_output_tokens"], MAX_TOKENS)


def _fit_messages(body: dict[str, Any]) -> None:
    """A Messages API body: the served model, no tools or output format (grammars), a prompt
    within the context (tool_use blocks' input ``{}``, then fewer messages, or a short one, while
    the conversation's JSON is longer than PROMPT_CHARS), no thinking budget (at least 1024 tokens,
    more than max_tokens), at most MAX_TOKENS tokens."""
    body["model"] = MODEL
    for field in ("tools", "tool_choice"):
        body.pop(field, None)
    messages = body.get("messages") if isinstance(body.get("messages"), list) else []
    for message in messages:
        blocks = message.get("content") if isinstance(message, dict) else None
        for block in blocks if isinstance(blocks, list) else []:
            if isinstance(block, dict) and block.get("type") == "tool_use":
                block["input"] = {}
    while len(messages) > 1 and len(json.dumps(messages)) > PROMPT_CHARS:  # the conversation's start stays
        messages.pop()
    if messages and isinstance(messages[0], dict) and len(json.dumps(messages)) > PROMPT_CHARS:
        messages[0]["content"] = "Hi"
    if len(json.dumps(body.get("system"))) > PROMPT_CHARS:
        body["system"] = "Be brief."
    if isinstance(body.get("output_config"), dict):
        body["output_config"].pop("format", None)
    if isinstance(body.get("thinking"), dict) and body["thinking"].get("type") == "enabled":
        body.pop("thinking")
    if "max_tokens" in body and _number(body["max_tokens"]):
        body["max_tokens"] = min(body["max_tokens"], MAX_TOKENS)


@schemathesis.hook
def before_call(ctx: Any, case: Any, kwargs: Any) -> None:
    meta = case.meta
    if meta is not None and meta.generation.mode.is_positive and isinstance(case.body, dict):
        if case.path == "/v1/responses":
            _fit_response(case.body)
        elif case.path.startswith("/v1/messages"):
            _fit_messages(case.body)
        elif case.path.startswith("/v1/"):
            _fit(case.body)
        elif case.path == "/tokenize":
            _drop_calls(case.body)
            _fit_template(case.body)
            _fit_tools(case.body)
