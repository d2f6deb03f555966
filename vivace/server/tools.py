"""Tool calling: the conversation as the chat template sees it.

Rendering: a chat template that takes ``tools`` (Qwen, Hermes, Llama 3, Mistral style) gets
them, and the history's tool calls and results, as transformers expects (with call ids a
Mistral template accepts). Any other template (the default model's plain ChatML) gets vivace's
convention: the tools as JSON lines inside ``<tools></tools>`` in the system message with how
to call them, earlier calls written into the assistant's text as the model writes them, and
tool results as user turns inside ``<tool_response></tool_response>`` (a run of them in one turn).

How the model writes a call, and the grammar that holds it to that, is its family's
(``vivace.server.tool_formats``; Hermes-style ``<tool_call>`` blocks by default): from the first
token with ``tool_choice`` "required" or a named function; with "auto" the model writes freely
until it opens a call, and from there on the call must fit one of the tools' schemas.
"""

from __future__ import annotations

import functools
import json
from typing import Any

import jinja2
import jinja2.meta

from vivace.server.errors import APIError
from vivace.server.functions import tool_messages
from vivace.server.protocol import ChatMessage, ChatTemplateRequest
from vivace.server.tool_formats import HERMES, ToolFormat

_CONVENTION = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

{instruction}"""


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


def template_takes_tools(tokenizer: Any) -> bool:
    """Whether the chat template (or one of the tokenizer's named templates, such as Hermes-2-Pro's
    "tool_use", which transformers picks for a request with tools) reads the ``tools`` variable; a
    template that only mentions the word (Phi-4-mini's reads a system message's own ``tools`` key)
    gets the tools by vivace's convention instead."""
    template = getattr(tokenizer, "chat_template", None) or ""
    return any(_reads_tools(source) for source in (template.values() if isinstance(template, dict) else [template]))


@functools.lru_cache(maxsize=16)
def _reads_tools(template: str) -> bool:
    from transformers.utils.chat_template_utils import _compile_jinja_template  # transformers' own environment

    try:
        environment = _compile_jinja_template(template).environment
        return "tools" in jinja2.meta.find_undeclared_variables(environment.parse(template))
    except jinja2.TemplateSyntaxError:
        return "tools" in template


def _arguments(arguments: str | dict[str, Any]) -> dict[str, Any] | str:
    """A history call's arguments as the template gets them: an object, sent as one or as its JSON
    text; empty text is no arguments (``{}``), as vLLM reads it (clients send ``""`` back for a
    function without parameters); other text (a call cut short by max_tokens) stays as written."""
    if isinstance(arguments, dict):
        return arguments
    if not arguments.strip():
        return {}
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError:
        return arguments
    return parsed if isinstance(parsed, dict) else arguments


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


def _convention_message(message: ChatMessage, form: ToolFormat) -> dict[str, Any]:
    role = "system" if message.role == "developer" else message.role
    text = message.text()
    if message.role == "tool":
        return {"role": "user", "content": f"<tool_response>\n{text}\n</tool_response>"}
    calls = [(c.function.name, _arguments(c.function.arguments)) for c in message.tool_calls or []]
    text = "\n".join([text] * bool(text) + [form.write(calls)] * bool(calls))
    return _with_thinking(_with_name({"role": role, "content": text}, message), message)


def _template_message(message: ChatMessage, form: ToolFormat) -> dict[str, Any]:
    rendered: dict[str, Any] = {"role": "system" if message.role == "developer" else message.role,
                                "content": message.text()}
    if message.tool_calls:
        rendered["tool_calls"] = [
            {"id": form.history_id(c.id), "type": "function",
             "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)}}
            for c in message.tool_calls]
    if message.tool_call_id is not None:
        rendered["tool_call_id"] = form.history_id(message.tool_call_id)
    return _with_thinking(_with_name(rendered, message), message)


def _with_name(rendered: dict[str, Any], message: ChatMessage) -> dict[str, Any]:
    """The template's message with its participant's ``name``, when it has one (as vLLM passes it:
    the template decides whether it shows)."""
    return rendered if message.name is None else {**rendered, "name": message.name}


def _with_thinking(rendered: dict[str, Any], message: ChatMessage) -> dict[str, Any]:
    """The template's message with the assistant's thinking, when it carries one."""
    thinking = message.thinking()
    return rendered if thinking is None else {**rendered, "reasoning_content": thinking}


def _joined_results(sent: list[ChatMessage], rendered: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``rendered`` with each run of tool results (a parallel call's) in one user turn, as Qwen's
    template writes them: templates whose turns must alternate (Gemma 3's) refuse two user turns."""
    joined: list[dict[str, Any]] = []
    for index, (message, turn) in enumerate(zip(sent, rendered)):
        if message.role == "tool" and index and sent[index - 1].role == "tool":
            joined[-1] = {**joined[-1], "content": f"{joined[-1]['content']}\n{turn['content']}"}
        else:
            joined.append(turn)
    return joined


def chat_messages(body: ChatTemplateRequest, tokenizer: Any, choice: str, form: ToolFormat = HERMES
                  ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages for ``apply_chat_template`` and its ``tools`` argument (None when the
    template doesn't take tools, or no tool may be called); calls are written in ``form``, legacy
    function calls and results as tool calls and results."""
    sent = tool_messages(body.messages)
    for index, message in enumerate(sent):
        _check_roles(index, message)
    own = template_takes_tools(tokenizer)
    if own:
        messages = [_template_message(m, form) for m in sent]
    else:
        messages = _joined_results(sent, [_convention_message(m, form) for m in sent])
    if choice == "none" or not body.tools:
        return messages, None
    tools = [tool.model_dump(exclude_none=True, exclude={"cache_control"}) for tool in body.tools]  # hints stay out
    if own:
        return messages, tools
    listing = _CONVENTION.format(tools="\n".join(json.dumps(t) for t in tools), instruction=form.instruction())
    if messages and messages[0]["role"] == "system":
        messages[0] = {"role": "system", "content": f"{messages[0]['content']}\n\n{listing}"}
    else:
        messages.insert(0, {"role": "system", "content": listing})
    return messages, None
