"""vLLM's ``POST /tokenize`` (a text, or messages rendered as chat completions renders them) and
``POST /detokenize``, with the served model's tokenizer (the ingress's copy when scaled out)."""

from __future__ import annotations

import json
import re
from functools import cache, partial
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from vivace.server.errors import APIError
from vivace.server.prompts import chat_prompt_ids, off_the_loop, parse_body, template_size
from vivace.server.protocol import DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest
from vivace.server.responses import DetokenizeResponse, TokenizeResponse
from vivace.server.state import server_state
from vivace.server.tools import tool_choice

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback (Llama 2, Gemma)


@cache
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet (SmolLM2, Llama 3, Qwen), character -> the byte it stands for."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\N{INVERTED EXCLAMATION MARK}"), ord("\N{SOFT HYPHEN}")),
                 *range(ord("\N{REGISTERED SIGN}"), 256)]
    shifted = [byte for byte in range(256) if byte not in printable]  # the rest, moved past 255 in order
    return {**{chr(byte): byte for byte in printable}, **{chr(256 + i): byte for i, byte in enumerate(shifted)}}


def token_bytes(tokenizer: Any, token_id: int, text: str) -> list[int]:
    """The UTF-8 bytes of one token, as OpenAI's logprobs give them: a token that holds only part
    of a character (an emoji's first bytes) decodes to U+FFFD, so its bytes come from its piece in
    the vocabulary, and the pieces' bytes joined are the text's."""
    if "\ufffd" not in text:
        return list(text.encode())
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if isinstance(piece, str):
        if match := _BYTE_PIECE.fullmatch(piece):
            return [int(match.group(1), 16)]
        decoder = _byte_level_decoder()
        if piece and all(char in decoder for char in piece):
            return [decoder[char] for char in piece]
    return list(text.encode())


def _tokenize_schema(raw: bytes) -> type[TokenizeChatRequest] | type[TokenizeCompletionRequest]:
    """Messages make a chat body; anything else is read as a text body (and its errors told so)."""
    try:
        data = json.loads(raw)
    except ValueError:
        return TokenizeCompletionRequest
    return TokenizeChatRequest if isinstance(data, dict) and "messages" in data else TokenizeCompletionRequest


async def tokenize(request: Request) -> Response:
    """The token ids of ``prompt`` or of ``messages``, their count and the context length."""
    state = server_state(request)
    schema = _tokenize_schema(await request.body())
    body = await parse_body(request, schema, state.metrics.work["parse"])
    engine = state.engine_for(body.model, state.caller(request))
    tokenizer = engine.tokenizer
    if isinstance(body, TokenizeChatRequest):
        ids = await off_the_loop(state.metrics.work["prompt"], chat_prompt_ids, tokenizer, body,
                                 tool_choice(body), body.add_special_tokens, state.tool_format(engine),
                                 size=template_size(body, tool_choice(body)))
    else:
        ids = await off_the_loop(state.metrics.work["prompt"],
                                 partial(tokenizer.encode, add_special_tokens=body.add_special_tokens),
                                 body.prompt, size=len(body.prompt))
    strs = tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return JSONResponse(TokenizeResponse(count=len(ids), max_model_len=engine.max_model_len, tokens=ids,
                                         token_strs=strs).model_dump(mode="json"))


async def detokenize(request: Request) -> Response:
    """The text of ``tokens``; 400 for an id outside the tokenizer's vocabulary."""
    state = server_state(request)
    body = await parse_body(request, DetokenizeRequest, state.metrics.work["parse"])
    tokenizer = state.engine_for(body.model, state.caller(request)).tokenizer
    vocab_size = len(tokenizer)
    bad = next((i for i, t in enumerate(body.tokens) if t >= vocab_size), None)
    if bad is not None:
        raise APIError(400, f"tokens.{bad}: token id {body.tokens[bad]} is outside the vocabulary "
                            f"[0, {vocab_size})", param=f"tokens.{bad}")
    text = await off_the_loop(state.metrics.work["prompt"], tokenizer.decode, body.tokens, size=len(body.tokens))
    return JSONResponse(DetokenizeResponse(prompt=text).model_dump(mode="json"))
