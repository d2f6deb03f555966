"""Reasoning output of thinking models (vLLM's ``--reasoning-parser``): Qwen3, QwQ, SmolLM3 and
the DeepSeek-R1 family write their thinking between ``<think>`` and ``</think>`` before the
answer; the server hands it out apart, as the message's ``reasoning_content`` (and ``reasoning``).

Where a request's output begins is read off its prompt's token ids: a prompt whose last think
tag is an open ``<think>`` (QwQ's, R1 distills' and Qwen3-Thinking's templates put it there) starts
the output inside the thinking; one whose last tag is ``</think>`` (Qwen3's ``enable_thinking:
false`` renders an empty block) or that has none lets the output open a block itself, or answer
at once. ``deepseek_r1`` also reads an output as thinking from its first token when the prompt
has no tag at all (R1 may leave out the opening tag, as vLLM's parser of that name assumes).

The output's text is split as it streams (:class:`ThoughtSplitter`), so a tag cut across tokens or
detokenizer chunks is never handed out in pieces; the reasoning is handed out without its leading
and trailing whitespace, the answer without the whitespace that follows ``</think>`` (Qwen3's
template strips both when the turn is sent back, so nothing the model needs is lost).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from enum import Enum
from typing import Any

from vivace.engine.sampling_params import StructuredOutput, ThinkBlock
from vivace.server.errors import APIError
from vivace.server.tool_parser import partial_suffix

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# Parser name -> whether an output whose prompt has no think tag is thinking from its first token.
PARSERS = {"qwen3": False, "deepseek_r1": True}


def effort_template_kwargs(effort: str | None, parser: str | None) -> dict[str, Any]:
    """The chat template's variables for a request's ``reasoning_effort``: qwen3's "none" turns
    thinking off (``enable_thinking: false``); any other effort lets the model think as long as it
    does. 400 for an effort the served model can't honour: any but "none" without a reasoning
    parser (the model doesn't reason), "none" with deepseek_r1 (R1 always thinks)."""
    if parser is None:
        if effort not in (None, "none"):
            raise APIError(400, "reasoning_effort: the served model doesn't reason (the server has no "
                                "--reasoning-parser): leave it out or set it to \"none\"", param="reasoning_effort")
        return {}
    if effort != "none":
        return {}
    if parser == "deepseek_r1":
        raise APIError(400, "reasoning_effort: the served model always reasons (--reasoning-parser deepseek_r1): "
                            "\"none\" can't be honoured", param="reasoning_effort")
    return {"enable_thinking": False}


@dataclass(frozen=True)
class ReasoningParser:
    """One served tokenizer's think tags: ``open_id`` and ``close_id`` are their token ids."""

    name: str
    open_id: int
    close_id: int

    @classmethod
    def load(cls, name: str, tokenizer: Any) -> ReasoningParser:
        """The parser ``name`` (one of PARSERS) for ``tokenizer``. Raises ValueError for a tokenizer
        without both tags as single tokens that its detokenized text keeps (a special token is
        dropped from the text, so no split could be seen)."""
        vocab = tokenizer.get_vocab()
        special = set(getattr(tokenizer, "all_special_ids", ()))
        ids = []
        for tag in (THINK_OPEN, THINK_CLOSE):
            token_id = vocab.get(tag)
            if token_id is None:
                raise ValueError(f"--reasoning-parser {name}: the model's tokenizer has no {tag} token; it is not "
                                 "a thinking model of that family (serve it without a reasoning parser)")
            if token_id in special:
                raise ValueError(f"--reasoning-parser {name}: the model's tokenizer marks {tag} as a special token, "
                                 "which the detokenized text leaves out, so its thinking can't be told apart")
            ids.append(token_id)
        return cls(name, ids[0], ids[1])

    def thinking(self, prompt_ids: list[int]) -> Thinking:
        """How an output of ``prompt_ids`` begins: inside a think block the prompt opened, or not."""
        last_open, last_close = _last_index(prompt_ids, self.open_id), _last_index(prompt_ids, self.close_id)
        if last_open < 0 and last_close < 0:
            return Thinking(self, opened=PARSERS[self.name])
        return Thinking(self, opened=last_open > last_close)


def _last_index(ids: list[int], token_id: int) -> int:
    try:
        return len(ids) - 1 - ids[::-1].index(token_id)
    except ValueError:
        return -1


@dataclass(frozen=True)
class Split:
    """A whole output, split: ``reasoning`` None when it has none; ``content`` None when a
    think block took the whole output (e.g. max_tokens cut it mid-thought)."""

    reasoning: str | None
    content: str | None
    thought: bool  # whether the output had a think block


@dataclass(frozen=True)
class Thinking:
    """One request's outputs as the parser reads them: ``opened`` when they start inside a think block."""

    parser: ReasoningParser
    opened: bool

    def splitter(self) -> ThoughtSplitter:
        return ThoughtSplitter(self.opened)

    def split(self, text: str) -> Split:
        """The reasoning and content of a whole output, as a stream of it would hand them out."""
        splitter = self.splitter()
        reasoning, content = splitter.feed(text, final=True)
        return Split(reasoning or None, None if splitter.thought and not content else content, splitter.thought)

    def constrained(self, structured: StructuredOutput) -> StructuredOutput:
        """``structured`` applied only once the think block (if the output has one) has ended,
        as vLLM applies grammars after the reasoning; the thinking itself stays free."""
        return dataclasses.replace(structured, after_thinking=ThinkBlock(self.parser.open_id, self.parser.close_id,
                                                                         self.opened))

    def reasoning_tokens(self, token_ids: list[int], thought: bool) -> int:
        """Tokens of an output's think block (up to its ``</think>``, or all when it never closed)."""
        if not thought:
            return 0
        close_id = self.parser.close_id
        return token_ids.index(close_id) + 1 if close_id in token_ids else len(token_ids)


class _State(Enum):
    MAY_OPEN = "may open"        # a <think> may come first, else the output is content
    MAY_REOPEN = "may reopen"    # inside a block the prompt opened; a repeated <think> first is dropped
    THINKING = "thinking"
    ANSWERING = "answering"


class ThoughtSplitter:
    """Splits one choice's streamed text into reasoning and content. ``feed`` takes each new
    piece and returns what may be handed out now; text that may still be part of a tag, and
    whitespace the split strips, wait for what follows (or for the output's end)."""

    def __init__(self, opened: bool) -> None:
        self._state = _State.MAY_REOPEN if opened else _State.MAY_OPEN
        self._pending = ""
        self._leading = True  # the current part has handed out nothing yet (its leading whitespace goes)
        self.thought = opened  # whether the output has a think block

    def feed(self, text: str, final: bool = False) -> tuple[str, str]:
        """(reasoning, content) that ``text``, the next piece of output, releases; with ``final``
        (the output ends with it) all that is left: held text was only text after all."""
        reasoning, content = self._feed(text)
        if not final:
            return reasoning, content
        rest_reasoning, rest_content = self._finish()
        return reasoning + rest_reasoning, content + rest_content

    def _feed(self, text: str) -> tuple[str, str]:
        self._pending += text
        if self._state in (_State.MAY_OPEN, _State.MAY_REOPEN) and not self._decide_opening():
            return "", ""
        reasoning = ""
        if self._state is _State.THINKING:
            end = self._pending.find(THINK_CLOSE)
            if end < 0:
                return self._take_thought(final=False), ""
            reasoning = self._strip_leading(self._pending[:end].rstrip())
            self._pending = self._pending[end + len(THINK_CLOSE):]
            self._state, self._leading = _State.ANSWERING, True
        return reasoning, self._take_content()

    def _finish(self) -> tuple[str, str]:
        if self._state is _State.MAY_OPEN:
            content, self._pending = self._pending, ""
            return "", content
        if self._state in (_State.MAY_REOPEN, _State.THINKING):
            return self._take_thought(final=True), ""
        return "", self._take_content()

    def _decide_opening(self) -> bool:
        """Whether the output's start is known yet: a <think> (dropped), or anything else."""
        head = self._pending.lstrip()
        if head.startswith(THINK_OPEN):
            self._pending, self._state, self.thought = head[len(THINK_OPEN):], _State.THINKING, True
            return True
        if THINK_OPEN.startswith(head):  # nothing but whitespace yet, or a part of the tag
            return False
        if self._state is _State.MAY_OPEN:
            self._state, self._leading = _State.ANSWERING, False  # no think block: the text as written
        else:
            self._state = _State.THINKING
        return True

    def _take_thought(self, final: bool) -> str:
        """The thinking so far, but for a possible start of ``</think>`` and trailing whitespace."""
        held = 0 if final else partial_suffix(self._pending, THINK_CLOSE)
        text = self._pending[:len(self._pending) - held].rstrip()
        self._pending = "" if final else self._pending[len(text):]
        return self._strip_leading(text)

    def _take_content(self) -> str:
        text, self._pending = self._pending, ""
        return self._strip_leading(text)

    def _strip_leading(self, text: str) -> str:
        if self._leading:
            text = text.lstrip()
            self._leading = not text
        return text
