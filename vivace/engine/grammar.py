"""Grammar-constrained decoding on llguidance: the one module that knows the grammar engine.

A request's ``SamplingParams.structured`` names what its output must match. The engine
keeps one ``LLMatcher`` per constrained request; each step it fills the constrained rows of
a token bitmask (on a worker thread, while the model's forward runs), sets every token the
grammar forbids to -inf in those logits rows, and after sampling advances each matcher by
the token it got. Compiled grammars are cached by their spec; a request gets a copy. A spec
``after_thinking`` a think block is composed behind it, the block's text left free (a thinking
model's reasoning: ``vivace.server.reasoning``).
"""

from __future__ import annotations

import functools
import json
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import llguidance
import llguidance.hf
import numpy as np
import torch
from llguidance import LLMatcher

from vivace.engine.sampling_params import StructuredOutput, ThinkBlock

# JSON as json.dumps writes it. Free whitespace lets a small model pad forever; a schema's own
# "x-guidance" options still override this.
JSON_LAYOUT: llguidance.JsonCompileOptions = {
    "whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


# Keywords whose value is a schema, a map of names to schemas, or a list of schemas.
_SUBSCHEMA = ("items", "additionalItems", "contains", "propertyNames", "not", "if", "then", "else",
              "additionalProperties", "unevaluatedProperties", "unevaluatedItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_OTHERS_SAID = ("additionalProperties", "unevaluatedProperties", "patternProperties", "allOf", "$ref")


def closed_objects(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on each object schema that lists
    ``properties`` (every ``required`` one among them, at least ``minProperties`` of them) and says
    nothing of others, as vLLM's default backend (xgrammar) and llama.cpp read a schema: a model
    is not free to add keys of its own. Parts an ``allOf`` (or a ``$ref`` beside ``properties``)
    combines stay open, since closing one would refuse the others' keys. The input is not changed."""
    combined: set[str] = set()
    _collect_combined_refs(schema, combined)
    return _close(schema, "#", combined, closable=True)


def _collect_combined_refs(node: Any, refs: set[str]) -> None:
    if isinstance(node, list):
        for item in node:
            _collect_combined_refs(item, refs)
        return
    if not isinstance(node, dict):
        return
    members = node.get("allOf") if isinstance(node.get("allOf"), list) else []
    if "properties" in node:
        members = [*members, node]
    refs.update(m["$ref"] for m in members if isinstance(m, dict) and isinstance(m.get("$ref"), str))
    for value in node.values():
        _collect_combined_refs(value, refs)


def _close(node: Any, pointer: str, combined: set[str], closable: bool) -> Any:
    if not isinstance(node, dict):
        return node
    out = dict(node)
    for key in _SUBSCHEMA:
        if isinstance(node.get(key), dict):
            out[key] = _close(node[key], f"{pointer}/{key}", combined, True)
    for key in _SUBSCHEMA_MAPS:
        if isinstance(node.get(key), dict):
            out[key] = {name: _close(sub, f"{pointer}/{key}/{_escape(name)}", combined, True)
                        for name, sub in node[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(node.get(key), list):
            out[key] = [_close(sub, f"{pointer}/{key}/{i}", combined, key != "allOf")
                        for i, sub in enumerate(node[key])]
    properties, required = node.get("properties"), node.get("required", [])
    if (closable and pointer not in combined and isinstance(properties, dict)
            and not any(key in node for key in _OTHERS_SAID)
            and isinstance(required, list) and all(name in properties for name in required)
            and node.get("minProperties", 0) <= len(properties)):
        out["additionalProperties"] = False
    return out


def _escape(name: str) -> str:
    """``name`` as a JSON-pointer segment."""
    return name.replace("~", "~0").replace("/", "~1")


class GrammarError(ValueError):
    """A constrained request's matcher refused the token it was given; ends only that request."""


class GrammarCompiler:
    """Compiles ``StructuredOutput`` specs for one tokenizer. Thread-safe: the server compiles
    to validate while the engine thread makes matchers."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._eos = list(eos_token_ids)
        self._lock = threading.Lock()
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        # Compiled grammars by spec, per compiler: a request's matcher is a copy of one.
        self._template = functools.lru_cache(maxsize=256)(self._build)

    @property
    def ll_tokenizer(self) -> llguidance.LLTokenizer:
        """llguidance's view of the vocabulary, built on first use (a few hundred ms)."""
        with self._lock:
            if self._ll_tokenizer is None:
                self._ll_tokenizer = llguidance.hf.from_tokenizer(
                    self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=self._eos)
            return self._ll_tokenizer

    def compile(self, structured: StructuredOutput) -> LLMatcher:
        """A fresh matcher for ``structured``. Raises ValueError naming what does not compile."""
        return self._template(structured).deep_copy()

    def _build(self, structured: StructuredOutput) -> LLMatcher:
        grammar = _grammar_of(structured)
        if structured.alternative is not None:
            grammar = _either(grammar, _grammar_of(structured.alternative))
        if structured.after_thinking is not None:
            grammar = self._after_thinking(grammar, structured.after_thinking)
        is_error, messages = LLMatcher.validate_grammar_with_warnings(grammar, self.ll_tokenizer)
        if is_error:
            raise ValueError(f"unsupported or invalid {structured.kind}: {messages[0]}")
        matcher = LLMatcher(self.ll_tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"unsupported or invalid {structured.kind}: {matcher.get_error()}")
        matcher.compute_bitmask()  # one that no text matches (an empty class) fails only here
        if matcher.is_error():
            raise ValueError(f"invalid {structured.kind}: no text matches it")
        return matcher

    def _after_thinking(self, grammar: str, think: ThinkBlock) -> str:
        """``grammar`` (llguidance's JSON or Lark text) behind ``think``: free text up to the
        block's closing token, at most two newlines, then ``grammar``. Tags llguidance holds
        special (added tokens) are matched by id; others as text, the thinking ending lazily at
        the first closing tag."""
        tags = [f"<[{t}]>" if self.ll_tokenizer.is_special_token(t) else json.dumps(self._hf_tokenizer.decode([t]))
                for t in (think.open_id, think.close_id)]
        head = f"{tags[0]}? thought" if think.opened else f"({tags[0]} thought)?"
        lazy = "" if tags[1].startswith("<[") else "[lazy]"  # a special token can't end a lazy lexeme
        lark = "\n".join([f"start: {head} /\\n{{0,2}}/ @answer", f"thought{lazy}: THOUGHT {tags[1]}",
                          "THOUGHT: /(.|\\n)*/"])
        return json.dumps({"grammars": [{"lark_grammar": lark}, *_named(grammar, "answer")]})


def _grammar_of(structured: StructuredOutput) -> str:
    """llguidance's top-level grammar of ``structured``'s own spec (JSON as ``JSON_LAYOUT`` writes
    it, objects closed). Raises ValueError naming what does not compile."""
    try:
        if structured.kind == "json_schema":
            schema = closed_objects(json.loads(structured.spec))
            return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
        return llguidance.grammar_from(structured.kind, structured.spec)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"invalid {structured.kind}: {exc}") from None


def _either(first: str, second: str) -> str:
    """The top-level grammar of output that matches ``first`` or ``second`` (a choice at its start)."""
    return json.dumps({"grammars": [{"lark_grammar": "start: @first | @second"},
                                    *_named(first, "first"), *_named(second, "second")]})


def _named(grammar: str, name: str) -> list[dict[str, Any]]:
    """The grammars of ``grammar`` (a JSON top-level grammar, or Lark text), its start one named
    ``name`` for another to reference as ``@name``."""
    try:
        grammars = json.loads(grammar)["grammars"]
    except json.JSONDecodeError:
        grammars = [{"lark_grammar": grammar}]
    return [{**grammars[0], "name": name}, *grammars[1:]]


class TokenMasks:
    """The batched side: bitmask rows for the constrained requests of a step, filled on a
    worker thread (llguidance drops the GIL), applied to their logits rows in one call."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._words = (vocab_size + 31) // 32
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="vivace-grammar")

    def fill_async(self, matchers: list[LLMatcher]) -> Future[torch.Tensor]:
        """Starts filling one bitmask row per matcher; the future gives the [n, words] int32 mask."""
        return self._worker.submit(self._fill, matchers)

    def _fill(self, matchers: list[LLMatcher]) -> torch.Tensor:
        bitmask = torch.empty((len(matchers), self._words), dtype=torch.int32)
        for row, matcher in enumerate(matchers):
            view = bitmask[row]
            matcher.unsafe_compute_mask_ptr(view.data_ptr(), view.numel() * view.element_size())
        return bitmask

    def apply(self, logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
        """Set ``logits[rows[i], t]`` to -inf for every token ``t`` that row ``i`` of
        ``bitmask`` forbids (in place). Columns past the mask's vocabulary are forbidden too."""
        vocab = logits.shape[-1]
        bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=1, bitorder="little")
        bits = np.pad(bits, ((0, 0), (0, max(0, vocab - bits.shape[1]))))[:, :vocab]
        if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous():
            # numpy, single-threaded: a few torch ops here would each pay an intra-op thread
            # hand-off that costs more than the work on a busy 2-core machine.
            view = logits.numpy()
            for i, row in enumerate(rows):
                np.copyto(view[row], -np.inf, where=bits[i] == 0)
            return
        allowed = torch.from_numpy(bits).to(logits.device, torch.bool)
        index = torch.tensor(rows, dtype=torch.long, device=logits.device)
        logits[index] = logits[index].masked_fill(~allowed, float("-inf"))

    def shutdown(self) -> None:
        self._worker.shutdown(wait=False)


def advance(matcher: LLMatcher, token_id: int) -> bool:
    """Feed the sampled ``token_id`` to ``matcher``; True when the grammar is now complete
    (nothing but end-of-sequence may follow). Raises GrammarError if the grammar refuses it."""
    if not matcher.consume_token(token_id):
        raise GrammarError(f"the grammar refused token {token_id}: {matcher.get_error()}")
    return matcher.is_stopped()
