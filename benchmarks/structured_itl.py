"""Decode inter-token latency with and without a JSON-schema constraint, same engine, same run.

    python benchmarks/structured_itl.py [--model default] [--streams 1 16] [--tokens 64] [--compile]

For each stream count, the same prompts run free (``ignore_eos``) and constrained by a schema
whose one string field needs more characters than the run generates (so both decode the same
number of steps). ITL is the gap between a request's consecutive tokens inside the engine
(scheduling, forward, mask fill and application, sampling, detokenization); p50 and p99 over
every gap of every request. Rounds alternate free/constrained so that drift on a shared machine
hits both. Target: constrained p50 <= 1.1x free.
"""

from __future__ import annotations

import argparse
import json

from vivace.config import EngineConfig
from vivace.engine.llm_engine import LLMEngine
from vivace.engine.sampling_params import SamplingParams, StructuredOutput

SCHEMA = {"type": "object", "properties": {"story": {"type": "string", "minLength": 4000}},
          "required": ["story"], "additionalProperties": False}
PROMPT = "Write a long story about a lighthouse keeper, as a JSON object with one field, story."


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run(engine: LLMEngine, streams: int, tokens: int, constrained: bool, tag: str) -> list[float]:
    """Gaps (ms) between consecutive tokens of ``streams`` concurrent requests."""
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}],
                                                  add_generation_prompt=True, tokenize=False)
    structured = StructuredOutput("json_schema", json.dumps(SCHEMA)) if constrained else None
    requests = [engine.add_request(f"{tag}-{i}", prompt, SamplingParams(
        temperature=0, max_tokens=tokens, ignore_eos=True, structured=structured)) for i in range(streams)]
    while engine.has_unfinished():
        engine.step()
    gaps = []
    for request in requests:
        times = request.timings.token_times
        assert len(times) == tokens, f"{tag}: {len(times)} tokens, expected {tokens}"
        gaps += [(b - a) * 1e3 for a, b in zip(times, times[1:])]
    return gaps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="default")
    parser.add_argument("--quantization", default="auto")
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--compile", action="store_true", help="decode through compiled graphs")
    args = parser.parse_args()
    engine = LLMEngine(EngineConfig(model=args.model, quantization=args.quantization, compile=args.compile,
                                    max_num_seqs=max(args.streams), max_model_len=1024))
    run(engine, 1, 4, True, "warm-constrained")
    run(engine, 1, 4, False, "warm-free")
    print(f"model {engine.model_name}, {args.tokens} tokens per request, {args.rounds} rounds")
    print(f"{'streams':>7} {'free p50/p99 ms':>16} {'schema p50/p99 ms':>18} {'ratio p50':>9}")
    for streams in args.streams:
        gaps: dict[bool, list[float]] = {False: [], True: []}
        for round_ in range(args.rounds):
            for constrained in (False, True):
                gaps[constrained] += run(engine, streams, args.tokens, constrained, f"{streams}-{round_}-{constrained}")
        free, schema = gaps[False], gaps[True]
        print(f"{streams:>7} {percentile(free, .5):>8.2f}/{percentile(free, .99):<7.2f} "
              f"{percentile(schema, .5):>9.2f}/{percentile(schema, .99):<8.2f} "
              f"{percentile(schema, .5) / percentile(free, .5):>9.3f}")
    engine.check_integrity()


if __name__ == "__main__":
    main()
