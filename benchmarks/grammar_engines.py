"""llguidance against xgrammar on the default model's tokenizer: vocabulary set-up time,
schema compile time (p50/p99, no cache), share of schemas accepted, and the time to fill one
token mask while walking each schema's example answer token by token.

    python benchmarks/grammar_engines.py [--schemas benchmarks/data/json_schemas.json]

xgrammar is optional (``pip install --no-deps xgrammar apache-tvm-ffi``): its Linux wheel
asks for triton, which it does not need on CPU. Prints one table; figures go to
docs/benchmarks.md ("Structured output").
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import transformers

from vivace.models.loader import default_model_path

HERE = Path(__file__).parent


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


class Llguidance:
    name = "llguidance"

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        import llguidance
        import llguidance.hf
        self.ll = llguidance
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
        self.mask = torch.empty((1, (vocab_size + 31) // 32), dtype=torch.int32)

    def compile(self, schema: dict) -> Any:
        from vivace.engine.grammar import JSON_LAYOUT
        grammar = self.ll.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
        is_error, messages = self.ll.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if is_error:
            raise ValueError(messages[0])
        return self.ll.LLMatcher(self.tokenizer, grammar, log_level=0)

    def fill(self, matcher: Any) -> None:
        matcher.unsafe_compute_mask_ptr(self.mask.data_ptr(), self.mask.numel() * 4)

    def accept(self, matcher: Any, token: int) -> bool:
        return matcher.consume_token(token)


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        import xgrammar
        self.xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
        self.compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        self.mask = xgrammar.allocate_token_bitmask(1, vocab_size)

    def compile(self, schema: dict) -> Any:
        compiled = self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False,
                                                     separators=(", ", ": "))
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher: Any) -> None:
        matcher.fill_next_token_bitmask(self.mask)

    def accept(self, matcher: Any, token: int) -> bool:
        return matcher.accept_token(token)


def measure(engine_class: type, tokenizer: Any, vocab_size: int, schemas: list[dict]) -> dict:
    start = time.perf_counter()
    engine = engine_class(tokenizer, vocab_size)
    setup = time.perf_counter() - start
    compile_ms, mask_us, accepted, walked = [], [], 0, 0
    for case in schemas:
        start = time.perf_counter()
        try:
            matcher = engine.compile(case["schema"])
        except Exception:  # noqa: BLE001 (an engine's refusal, whatever it raises, is the figure)
            continue
        compile_ms.append((time.perf_counter() - start) * 1e3)
        accepted += 1
        ok = True
        for token in tokenizer.encode(json.dumps(case["example"]), add_special_tokens=False):
            start = time.perf_counter()
            engine.fill(matcher)
            mask_us.append((time.perf_counter() - start) * 1e6)
            ok = ok and engine.accept(matcher, token)
        walked += ok
    return {"engine": engine_class.name, "setup_ms": setup * 1e3, "accepted": accepted, "walked": walked,
            "compile_p50_ms": percentile(compile_ms, 0.5), "compile_p99_ms": percentile(compile_ms, 0.99),
            "mask_p50_us": percentile(mask_us, 0.5), "mask_p99_us": percentile(mask_us, 0.99),
            "mask_mean_us": statistics.fmean(mask_us) if mask_us else float("nan")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schemas", type=Path, default=HERE / "data" / "json_schemas.json")
    args = parser.parse_args()
    schemas = json.loads(args.schemas.read_text())
    path = default_model_path()
    tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(path.parent, gguf_file=path.name)
    vocab_size = len(tokenizer)
    rows = []
    for engine_class in (Llguidance, Xgrammar):
        try:
            rows.append(measure(engine_class, tokenizer, vocab_size, schemas))
        except ImportError as exc:
            print(f"{engine_class.name}: not installed ({exc})")
    print(f"{len(schemas)} schemas, vocabulary {vocab_size}")
    print(f"{'engine':<11} {'setup ms':>9} {'accepted':>9} {'example ok':>10} {'compile p50/p99 ms':>19} "
          f"{'mask p50/p99/mean us':>21}")
    for r in rows:
        print(f"{r['engine']:<11} {r['setup_ms']:>9.0f} {r['accepted']:>6}/{len(schemas):<2} {r['walked']:>10} "
              f"{r['compile_p50_ms']:>9.2f}/{r['compile_p99_ms']:<9.2f} "
              f"{r['mask_p50_us']:>6.1f}/{r['mask_p99_us']:.0f}/{r['mask_mean_us']:.1f}")


if __name__ == "__main__":
    main()
