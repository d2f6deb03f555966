"""Each model family's written form of tool calls (vLLM's ``--tool-call-parser``): the grammar
that holds the output to it, the parser that reads calls out of it, and the call ids its
chat template accepts.

- ``hermes`` (Qwen, Hermes, and vivace's own convention for templates without tools):
  ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one block per call.
- ``llama3_json`` (Llama 3.1/3.2/3.3): a bare ``{"name": ..., "parameters": {...}}``, calls
  separated by ``; ``.
- ``mistral``: the ``[TOOL_CALLS]`` marker, then a JSON array ``[{"name": ..., "arguments":
  {...}}, ...]`` (v3 tokenizers: Mistral 7B v0.3, Nemo), or, where the tokenizer or template
  knows ``[ARGS]`` (Mistral Small 3.1+, Magistral, Devstral), ``[TOOL_CALLS]name[ARGS]{...}``
  per call. Call ids are 9 alphanumeric characters, as its templates demand.
- ``granite`` (Granite 3.x): ``<|tool_call|>`` then the same JSON array.

``auto`` reads the family off the chat template. Every form is a table row: the text (or
special token) that opens the calls and ends free text, what leads to the first call, each
call's own text, what separates calls and what closes them; one function makes the Lark
grammar of any row for llguidance.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vivace.engine.grammar import JSON_LAYOUT, closed_objects
from vivace.engine.sampling_params import StructuredOutput
from vivace.server.protocol import Tool
from vivace.server.tool_parser import CALL_CLOSE, CALL_OPEN, CallParser, CallSyntax, ToolCallParser

PARSERS = ("auto", "hermes", "llama3_json", "mistral", "granite")
MISTRAL_CALLS, MISTRAL_ARGS = "[TOOL_CALLS]", "[ARGS]"
GRANITE_CALLS = "<|tool_call|>"
_EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass(frozen=True)
class Special:
    """A special token in a grammar: llguidance matches it by id, never as text."""

    token_id: int

    def lark(self) -> str:
        return f"<[{self.token_id}]>"


@dataclass(frozen=True)
class Rule:
    """A Lark rule named in a sequence."""

    name: str

    def lark(self) -> str:
        return self.name


Part = str | Special | Rule  # text, a special token, a rule


def _sequence(*parts: Part) -> str:
    """Lark for ``parts`` in order, adjacent text joined into one literal."""
    out: list[str] = []
    text = ""
    for part in parts:
        if isinstance(part, str):
            text += part
            continue
        if text:
            out.append(json.dumps(text))
            text = ""
        out.append(part.lark())
    if text:
        out.append(json.dumps(text))
    return " ".join(out)


def _json_lexemes(text: str) -> str:
    """Lark for ``text`` as JSON's lexemes: each quote and punctuation (with the space after it)
    apart from the words between them."""
    return " ".join(json.dumps(piece) for piece in re.findall(r'"|[{}\[\],:] ?|[^"{}\[\],:]+', text))


def parameters_schema(tool: Tool) -> dict[str, Any]:
    """The schema of ``tool``'s arguments, an object's: one that names no type is given it."""
    return {"type": "object", **(tool.function.parameters or _EMPTY_PARAMETERS)}


def _schema(schema: dict[str, Any]) -> str:
    return json.dumps({**closed_objects(schema), "x-guidance": JSON_LAYOUT})


def _objects_rules(tools: list[Tool], arguments_key: str) -> list[str]:
    """``call``: one JSON object per tool, its name first, then its arguments. Each schema stays
    the root of its own rule, so its ``$ref``s (``#/$defs/...``, as pydantic writes them) resolve."""
    return _calls_rules(tools, lambda name, args: _sequence(
        f'{{"name": {json.dumps(name)}, "{arguments_key}": ', args, "}"))


def _calls_rules(tools: list[Tool], written: Callable[[str, Rule], str]) -> list[str]:
    """``call``: each tool's call as ``written(name, its arguments' rule)``; those rules."""
    rules = [f"call: {' | '.join(written(t.function.name, Rule(f'args{i}')) for i, t in enumerate(tools))}"]
    return rules + [f"args{i}: %json {_schema(parameters_schema(t))}" for i, t in enumerate(tools)]


@dataclass(frozen=True)
class ToolFormat:
    """One family's written form of calls, for one tokenizer. ``name`` is the parser's
    (``hermes``, ``llama3_json``, ``mistral``); ``args_form``: mistral's ``name[ARGS]{...}``
    rather than its array; ``specials``: the markers that are added tokens of the tokenizer (by
    their text: Qwen's ``<tool_call>``, Mistral's ``[TOOL_CALLS]``), which the grammar matches by id
    (llguidance never reads an added token as text); ``hidden``: whether one of them is a special
    token, which the output must then keep as text."""

    name: str
    args_form: bool = False
    specials: tuple[tuple[str, int], ...] = ()
    hidden: bool = False

    @property
    def label(self) -> str:
        """The name, with mistral's form (for the start-up log)."""
        if self.name != "mistral":
            return self.name
        return f"mistral ({'[TOOL_CALLS]name[ARGS]{...}' if self.args_form else '[TOOL_CALLS] [...]'})"

    def _marker(self, text: str) -> Part:
        return next((Special(i) for t, i in self.specials if t == text), text)

    @property
    def keeps_special_tokens(self) -> bool:
        """Whether the output must be detokenized with its special tokens (its markers are some)."""
        return self.hidden

    def _shape(self, tools: list[Tool]) -> tuple[Part, Part, list[Part], list[Part], Part, list[str]]:
        """(opener, lead, call, separator, close, rules): the calls are ``opener lead call
        (separator call)* close``, ``call`` being one of ``tools``' calls."""
        if self.name == "llama3_json":
            opener = '{"name": "'
            rules = _calls_rules(tools, lambda name, args: _sequence(f'{name}", "parameters": ', args, "}"))
            return opener, "", [Rule("call")], ["; " + opener], "", rules
        if self.name == "mistral" and self.args_form:
            opener = self._marker(MISTRAL_CALLS)
            rules = _calls_rules(tools, lambda name, args: _sequence(name, self._marker(MISTRAL_ARGS), args))
            return opener, "", [Rule("call")], [opener], "", rules
        if self.name == "mistral":
            return self._marker(MISTRAL_CALLS), " [", [Rule("call")], [", "], "]", _objects_rules(tools, "arguments")
        if self.name == "granite":
            return self._marker(GRANITE_CALLS), "[", [Rule("call")], [", "], "]", _objects_rules(tools, "arguments")
        opener, close = self._marker(CALL_OPEN), self._marker(CALL_CLOSE)
        return opener, "\n", [Rule("call"), "\n", close], ["\n", opener, "\n"], "", _objects_rules(tools, "arguments")

    def grammar(self, tools: list[Tool], choice: str, parallel: bool,
                answer: StructuredOutput | None = None) -> StructuredOutput:
        """The llguidance Lark grammar of the output for ``choice`` ("auto", "required" or a
        function name): free text or calls for "auto" (the calls begin at the first opener),
        calls for "required" (one unless ``parallel``), exactly one call of a named function.
        With ``answer`` (what ``response_format`` asks for), "auto" is calls from the first token
        or else that answer; the other choices make calls all the same, as vLLM's do."""
        if answer is not None and choice == "auto":
            return dataclasses.replace(self._grammar(tools, "required", parallel, split=True), alternative=answer)
        return self._grammar(tools, choice, parallel, split=False)

    def _grammar(self, tools: list[Tool], choice: str, parallel: bool, split: bool) -> StructuredOutput:
        """``grammar``; ``split``: the opener's text in pieces as JSON's are lexed (``{``, ``"``,
        ``name``...), since llguidance's lexer is greedy: beside an answer that begins as the
        opener does (a JSON object, llama3_json's ``{"name": "``), one long lexeme would win and
        cut the answer off at its first difference."""
        named = choice not in ("auto", "required")
        chosen = [t for t in tools if not named or t.function.name == choice]
        opener, lead, call, separator, close, rules = self._shape(chosen)
        more = f"({_sequence(*separator, *call)})*" if parallel and not named else ""
        end = f" {_sequence(close)}" if close else ""
        lines = [*rules, "TEXT: /(.|\\n)*/"]
        if choice != "auto":
            first = _json_lexemes(opener) if split and isinstance(opener, str) else _sequence(opener)
            lines.append(f"start: {first} {_sequence(lead, *call)} {more}{end}")
        else:
            # The text ends at the first opener, so a call can't hide inside free text: a text
            # opener ends a lazy lexeme; a special token is never inside TEXT (nor ends a lazy one).
            lazy = "" if isinstance(opener, Special) else "[lazy]"
            lines += [f"start: TEXT | head {_sequence(lead, *call)} {more}{end}", f"head{lazy}: TEXT {_sequence(opener)}"]
        return StructuredOutput("grammar", "\n".join(lines))

    def parser(self) -> ToolCallParser | CallParser:
        """A fresh streaming parser of one output in this form."""
        if self.name == "hermes":
            return ToolCallParser()
        return CallParser(SYNTAXES[self.name, self.args_form], self.new_call_id)

    def new_call_id(self) -> str:
        return uuid.uuid4().hex[:9] if self.name == "mistral" else f"call_{uuid.uuid4().hex[:24]}"

    def history_id(self, call_id: str) -> str:
        """The id a call of the history has for the template: mistral's templates raise unless it
        is 9 alphanumeric characters, so any other id maps to 9 hex digits of its hash (the same
        for the assistant's call and the tool's result)."""
        if self.name != "mistral" or (len(call_id) == 9 and call_id.isalnum()):
            return call_id
        return hashlib.sha256(call_id.encode()).hexdigest()[:9]

    def write(self, calls: list[tuple[str, dict[str, Any] | str]]) -> str:
        """``calls`` (name, arguments: an object, or text kept as it was written) as the model
        writes them (for the history of a template without tools)."""
        if self.name == "llama3_json":
            return "; ".join(_call_object(n, "parameters", a) for n, a in calls)
        if self.name == "mistral" and self.args_form:
            return "".join(f"{MISTRAL_CALLS}{n}{MISTRAL_ARGS}{_json_text(a)}" for n, a in calls)
        if self.name in ("mistral", "granite"):
            opener = f"{MISTRAL_CALLS} " if self.name == "mistral" else GRANITE_CALLS
            return opener + "[" + ", ".join(_call_object(n, "arguments", a) for n, a in calls) + "]"
        return "\n".join(f"{CALL_OPEN}\n{_call_object(n, 'arguments', a)}\n{CALL_CLOSE}" for n, a in calls)

    def instruction(self) -> str:
        """How to call, for the system message of a template without tools."""
        if self.name == "llama3_json":
            return ('To call a function, respond with a JSON object of the form {"name": <function-name>, '
                    '"parameters": <args-json-object>}; separate several calls with "; ".')
        if self.name == "mistral" and self.args_form:
            return "To call a function, write [TOOL_CALLS]<function-name>[ARGS]<args-json-object>, once per call."
        if self.name in ("mistral", "granite"):
            opener = MISTRAL_CALLS if self.name == "mistral" else GRANITE_CALLS
            return (f'To call functions, write {opener} followed by a JSON array of the calls: '
                    '[{"name": <function-name>, "arguments": <args-json-object>}, ...]')
        return ("For each function call, return a json object with function name and arguments within "
                "<tool_call></tool_call> XML tags:\n<tool_call>\n"
                '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


HERMES = ToolFormat("hermes")


def _json_text(arguments: dict[str, Any] | str) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments)


def _call_object(name: str, key: str, arguments: dict[str, Any] | str) -> str:
    """``{"name": name, key: arguments}`` as ``json.dumps`` writes it, text arguments as they are."""
    return f'{{"name": {json.dumps(name)}, "{key}": {_json_text(arguments)}}}'

_NAME = r'(?P<name>"(?:[^"\\]|\\.)*")'
_OBJECT_HEAD = r'\{\s*"name"\s*:\s*' + _NAME + r'\s*,\s*"%s"\s*:\s*(?=[{\[])'
_MISTRAL_ARGS_HEAD = r"\[TOOL_CALLS\]\s*(?P<bare>[A-Za-z0-9_.-]+)\s*\[ARGS\]\s*(?=[{\[])"
SYNTAXES = {
    ("llama3_json", False): CallSyntax(
        opener="{", first=_OBJECT_HEAD % "(?:parameters|arguments)", tail=r"\s*\}",
        next=r"\s*;\s*" + _OBJECT_HEAD % "(?:parameters|arguments)"),
    ("mistral", False): CallSyntax(
        opener=MISTRAL_CALLS, first=r"\[TOOL_CALLS\]\s*\[\s*" + _OBJECT_HEAD % "arguments",
        tail=r'\s*(?:,\s*"id"\s*:\s*"[^"]*"\s*)?\}', next=r"\s*,\s*" + _OBJECT_HEAD % "arguments", end=r"\s*\]"),
    ("granite", False): CallSyntax(
        opener=GRANITE_CALLS, first=r"<\|tool_call\|>\s*\[\s*" + _OBJECT_HEAD % "arguments", tail=r"\s*\}",
        next=r"\s*,\s*" + _OBJECT_HEAD % "arguments", end=r"\s*\]"),
    ("mistral", True): CallSyntax(
        opener=MISTRAL_CALLS, first=_MISTRAL_ARGS_HEAD, tail="", next=r"\s*" + _MISTRAL_ARGS_HEAD),
}


def _template(tokenizer: Any) -> str:
    template = getattr(tokenizer, "chat_template", None) or ""
    return template if isinstance(template, str) else "\n".join(map(str, dict(template).values()))


def detect(template: str) -> str:
    """The parser a chat template calls for: its own tool-call markers decide; a template
    without tools gets vivace's Hermes-style convention."""
    if CALL_OPEN in template:
        return "hermes"
    if MISTRAL_CALLS in template:
        return "mistral"
    if GRANITE_CALLS in template:
        return "granite"
    if "<|python_tag|>" in template or "ipython" in template or ('"parameters"' in template and "tools" in template):
        return "llama3_json"
    return "hermes"


def load_tool_format(name: str, tokenizer: Any) -> ToolFormat:
    """The form ``name`` (one of PARSERS; "auto": read off the chat template) for ``tokenizer``."""
    if name not in PARSERS:
        raise ValueError(f"unknown tool call parser {name!r}: choose one of {', '.join(PARSERS)}")
    template = _template(tokenizer)
    if name == "auto":
        name = detect(template)
    vocab = tokenizer.get_vocab()
    added = getattr(tokenizer, "added_tokens_decoder", {})
    special_ids = set(getattr(tokenizer, "all_special_ids", ())) | {i for i, t in added.items() if t.special}
    markers = {"hermes": (CALL_OPEN, CALL_CLOSE), "mistral": (MISTRAL_CALLS, MISTRAL_ARGS),
               "granite": (GRANITE_CALLS,)}.get(name, ())
    specials = tuple((text, vocab[text]) for text in markers if vocab.get(text) in special_ids | set(added))
    return ToolFormat(name, args_form=name == "mistral" and (MISTRAL_ARGS in template or MISTRAL_ARGS in vocab),
                      specials=specials, hidden=any(i in special_ids for _, i in specials))
