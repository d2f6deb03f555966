"""What one engine can ever serve, as plain numbers: checked by the engine on every request,
and by a scaled-out server's ingress before it sends a request to a remote engine."""

from __future__ import annotations

from dataclasses import dataclass

from vivace.engine.sampling_params import ParamError, SamplingParams


class LimitError(ParamError):
    """A request these limits can never serve; ``param`` names the request field at fault, if one is."""


@dataclass(frozen=True)
class RequestLimits:
    """An engine's vocabulary, context length and KV pool (``num_blocks`` of ``block_size``)."""

    vocab_size: int
    max_model_len: int
    block_size: int
    num_blocks: int

    def check(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise LimitError (a ValueError) when the request can never be served."""
        num_prompt = len(prompt_token_ids)
        if num_prompt == 0:
            raise LimitError("the prompt is empty")
        if any(not 0 <= t < self.vocab_size for t in prompt_token_ids):
            raise LimitError(f"prompt token ids must be in [0, {self.vocab_size})")
        if any(not 0 <= t < self.vocab_size for t in params.stop_token_ids):
            raise LimitError(f"stop_token_ids must be in [0, {self.vocab_size})", "stop_token_ids")
        if any(not 0 <= t < self.vocab_size for t in params.logit_bias or ()):
            raise LimitError(f"logit_bias token ids must be in [0, {self.vocab_size})", "logit_bias")
        max_tokens = 1 if params.max_tokens is None else params.max_tokens
        wanted = num_prompt + max_tokens
        if wanted > self.max_model_len:
            raise LimitError(
                f"this model's maximum context length is {self.max_model_len} tokens, but "
                f"{num_prompt} prompt tokens plus {max_tokens} max_tokens were requested")
        if -(-wanted // self.block_size) > self.num_blocks:
            raise LimitError(f"the request needs {wanted} tokens of KV cache; the pool holds "
                             f"{self.num_blocks * self.block_size}")
