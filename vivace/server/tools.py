"""Tool calling: the conversation as the chat template sees it, and the grammar of a call.

Rendering: a chat template that takes ``tools`` (Qwen, Hermes, Llama 3 style) gets them, and
the history's tool calls and results, as transformers expects. Any other template (the
default model's plain ChatML) gets vivace's Hermes-style convention: the tools as JSON lines
inside ``<tools></tools>`` in the system message, earlier calls written into the assistant's
text, and tool results as user turns inside ``<tool_response></tool_response>``.

Either way the model calls a tool by writing ``<tool_call>\\n{"name": ..., "arguments":
{...}}\\n</tool_call>``, and llguidance holds it to that: from the first token with
``tool_choice`` "required" or a named function; with "auto" the model writes freely until it
opens a call, and from ``<tool_call>`` on the call must fit one of the tools' schemas.
"""

from __future__ import annotations

import json
from typing import Any

from vivace.engine.grammar import JSON_LAYOUT
from vivace.engine.sampling_params import StructuredOutput
from vivace.server.errors import APIError
from vivace.server.protocol import ChatMessage, ChatTemplateRequest, Tool

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_CONVENTION = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


def tool_choice(body: ChatTemplateRequest) -> str:
    """"none", "auto", "required" or the name of the one function to call. 400 for a choice
    that names no tool, or any choice without tools."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise APIError(400, "tool_choice requires tools", param="tool_choice")
        return "none"
    names = [tool.function.name for tool in body.tools]
    if len(set(names)) != len(names):
        raise APIError(400, "tools: function names must be unique", param="tools")
    if choice is None:
        return "auto"
    if isinstance(choice, str):
        return choice
    if choice.function.name not in names:
        raise APIError(400, f"tool_choice names the function {choice.function.name!r}, which is not "
                            f"among the tools", param="tool_choice.function.name")
    return choice.function.name


def parameters_schema(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters or _EMPTY_PARAMETERS


def call_grammar(tools: list[Tool], choice: str, parallel: bool) -> StructuredOutput:
    """The llguidance Lark grammar of the output for ``choice`` ("auto", "required" or a
    function name): free text or calls for "auto", calls for "required" (one unless
    ``parallel``), exactly one call of a named function."""
    chosen = [t for t in tools if choice in ("auto", "required") or t.function.name == choice]
    schema = {"anyOf": [
        {"type": "object", "properties": {"name": {"const": t.function.name},
                                          "arguments": parameters_schema(t)},
         "required": ["name", "arguments"], "additionalProperties": False} for t in chosen],
        "x-guidance": JSON_LAYOUT}
    named = choice not in ("auto", "required")
    more = f'("\\n{CALL_OPEN}\\n" body "\\n{CALL_CLOSE}")*' if parallel and not named else ""
    lines = [f"body: %json {json.dumps(schema)}", "TEXT: /(.|\\n)*/"]
    if choice == "auto":
        # lazy: the text ends at the first opener, so a call can't hide inside free text.
        lines += [f'start: TEXT | head "\\n" body "\\n{CALL_CLOSE}" {more}',
                  f'head[lazy]: TEXT "{CALL_OPEN}"']
    else:
        lines += [f'start: "{CALL_OPEN}\\n" body "\\n{CALL_CLOSE}" {more}']
    return StructuredOutput("grammar", "\n".join(lines))


def template_takes_tools(tokenizer: Any) -> bool:
    return "tools" in (getattr(tokenizer, "chat_template", None) or "")


def _arguments(message_index: int, call_index: int, text: str) -> dict[str, Any]:
    try:
        arguments = json.loads(text)
    except json.JSONDecodeError:
        arguments = None
    if not isinstance(arguments, dict):
        param = f"messages.{message_index}.tool_calls.{call_index}.function.arguments"
        raise APIError(400, f"{param}: must be a JSON object, as text", param=param)
    return arguments


def _check_roles(index: int, message: ChatMessage) -> None:
    if message.role == "tool" and not message.tool_call_id:
        raise APIError(400, f"messages.{index}.tool_call_id: a tool message needs the id of its call",
                       param=f"messages.{index}.tool_call_id")
    if message.role != "tool" and message.tool_call_id is not None:
        raise APIError(400, f"messages.{index}.tool_call_id: only tool messages have one",
                       param=f"messages.{index}.tool_call_id")
    if message.role != "assistant" and message.tool_calls:
        raise APIError(400, f"messages.{index}.tool_calls: only assistant messages make calls",
                       param=f"messages.{index}.tool_calls")
    for name in ("reasoning_content", "reasoning"):
        if message.role != "assistant" and getattr(message, name) is not None:
            raise APIError(400, f"messages.{index}.{name}: only assistant messages reason",
                           param=f"messages.{index}.{name}")


def _convention_message(index: int, message: ChatMessage) -> dict[str, Any]:
    role = "system" if message.role == "developer" else message.role
    text = message.text()
    if message.role == "tool":
        return {"role": "user", "content": f"<tool_response>\n{text}\n</tool_response>"}
    calls = [json.dumps({"name": c.function.name, "arguments": _arguments(index, i, c.function.arguments)})
             for i, c in enumerate(message.tool_calls or [])]
    text = "\n".join([text] * bool(text) + [f"{CALL_OPEN}\n{call}\n{CALL_CLOSE}" for call in calls])
    return _with_thinking({"role": role, "content": text}, message)


def _template_message(index: int, message: ChatMessage) -> dict[str, Any]:
    rendered: dict[str, Any] = {"role": "system" if message.role == "developer" else message.role,
                                "content": message.text()}
    if message.tool_calls:
        rendered["tool_calls"] = [
            {"id": c.id, "type": "function",
             "function": {"name": c.function.name, "arguments": _arguments(index, i, c.function.arguments)}}
            for i, c in enumerate(message.tool_calls)]
    if message.tool_call_id is not None:
        rendered["tool_call_id"] = message.tool_call_id
    return _with_thinking(rendered, message)


def _with_thinking(rendered: dict[str, Any], message: ChatMessage) -> dict[str, Any]:
    """The template's message with the assistant's thinking, when it carries one."""
    thinking = message.thinking()
    return rendered if thinking is None else {**rendered, "reasoning_content": thinking}


def chat_messages(body: ChatTemplateRequest, tokenizer: Any, choice: str
                  ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages for ``apply_chat_template`` and its ``tools`` argument (None when the
    template doesn't take tools, or no tool may be called)."""
    for index, message in enumerate(body.messages):
        _check_roles(index, message)
    own = template_takes_tools(tokenizer)
    render = _template_message if own else _convention_message
    messages = [render(i, m) for i, m in enumerate(body.messages)]
    if choice == "none" or not body.tools:
        return messages, None
    tools = [tool.model_dump(exclude_none=True) for tool in body.tools]
    if own:
        return messages, tools
    listing = _CONVENTION.format(tools="\n".join(json.dumps(t) for t in tools))
    if messages and messages[0]["role"] == "system":
        messages[0] = {"role": "system", "content": f"{messages[0]['content']}\n\n{listing}"}
    else:
        messages.insert(0, {"role": "system", "content": listing})
    return messages, None
