"""A prompt step's attention with decode rows beside its chunk, at Llama-3.1-8B's shape (32 query
heads, 8 KV heads, head_dim 128, bf16 cache in 16-token blocks), one layer: a ``--prompt``-token
chunk and R decode rows of ``--context`` tokens each, in a grid of ``--max-seqs`` + 1 sequences
as a prompt-step graph holds them (the rest without queries), through

- before: the prefill kernel for every row (a decode row: a 64-row tile a query head, one real);
- after: the prefill kernel for the chunk (``decodes_apart``) and the decode kernel, GQA-packed
  with ``--splits``, for the decode rows (``paged_decode_attention`` with ``query_start``).

Each captured in a CUDA graph and replayed (``forward._time_us``: median of CUDA events). Prints
µs a layer for each R, what each decode row adds, the decode rows' K/V bytes and the bandwidth
at which the "after" launch pair reads them beyond R = 0, and the two outputs' largest difference.

    python benchmarks/mixed_attention.py [--prompt 500] [--decode-rows 0 10 57] [--context 1024]
        [--splits 4] [--max-seqs 64]

On a CPU device (``--device cpu``, tiny sizes, Triton's interpreter) it runs each path once
untimed: a check that the script works, not a measurement.
"""

from __future__ import annotations

import argparse

import torch

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16


def mixed_batch(prompt: int, rows: int, context: int, max_seqs: int, device: str) -> dict[str, torch.Tensor]:
    """q, cache, block tables, query starts and lengths of ``rows`` decode rows (first, as the
    scheduler places them) and one ``prompt``-token chunk, among ``max_seqs + 1`` sequences."""
    g = torch.Generator().manual_seed(0)
    query_lens = [1] * rows + [prompt] + [0] * (max_seqs - rows)
    seq_lens = [context] * rows + [prompt] + [0] * (max_seqs - rows)
    per_seq = -(-max(context, prompt) // BLOCK_SIZE)
    tables = torch.arange((max_seqs + 1) * per_seq, dtype=torch.int32).view(max_seqs + 1, per_seq)
    starts = torch.tensor([0] + query_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    cache = torch.randn(2, (rows + 1) * per_seq, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=g)
    tables[rows + 1:] = 0  # sequences without queries: no blocks of their own
    return dict(q=torch.randn(int(starts[-1]), HEADS, HEAD_DIM, generator=g).to(device, torch.bfloat16),
                cache=cache.to(device, torch.bfloat16), tables=tables.to(device), starts=starts.to(device),
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device))


def attention(batch: dict[str, torch.Tensor], out: torch.Tensor, splits: int) -> None:
    """The step's attention into ``out``: the prefill kernel alone (``splits`` 0), or with the
    decode kernel for the decode rows."""
    from vivace.gpu import kernels

    q, cache, tables, starts, seq_lens = (batch[k] for k in ("q", "cache", "tables", "starts", "seq_lens"))
    scale = HEAD_DIM ** -0.5
    kernels.paged_prefill_attention(q, cache, tables, starts, seq_lens, q.shape[0], scale, out=out,
                                    decodes_apart=splits > 0)
    if splits:
        kernels.paged_decode_attention(q, cache, tables, seq_lens, scale, None, splits, out, query_start=starts)


def measure(args: argparse.Namespace) -> list[dict]:
    from vivace.gpu.forward import _time_us

    rows = []
    for count in args.decode_rows:
        batch = mixed_batch(args.prompt, count, args.context, args.max_seqs, args.device)
        outs = {name: torch.zeros_like(batch["q"]) for name in ("before", "after")}
        times = {}
        for name, splits in (("before", 0), ("after", args.splits)):
            def step(out=outs[name], splits=splits) -> None:
                attention(batch, out, splits)

            times[name] = _time_us(step, args.rounds) if args.device == "cuda" else (step(), float("nan"))[1]
        diff = (outs["before"].float() - outs["after"].float()).abs().max().item()
        rows.append(dict(decode_rows=count, before_us=times["before"], after_us=times["after"], max_diff=diff))
    return rows


def report(rows: list[dict], args: argparse.Namespace) -> None:
    print(f"prompt {args.prompt} tokens, decode rows of {args.context} tokens, {args.max_seqs + 1} sequences' grid, "
          f"decode split-K {args.splits}; one layer, Llama-3.1-8B's attention shape, bf16")
    print(f"{'rows':>5} {'before µs':>10} {'after µs':>10} {'before µs/row':>14} {'after µs/row':>13} "
          f"{'K/V MB':>7} {'after GB/s':>10} {'max diff':>9}")
    base = rows[0]
    for row in rows:
        count = row["decode_rows"]
        kv_bytes = count * args.context * KV_HEADS * HEAD_DIM * 2 * 2  # keys and values, bf16
        extra = {name: (row[f"{name}_us"] - base[f"{name}_us"]) / count if count and base["decode_rows"] == 0
                 else float("nan") for name in ("before", "after")}
        bandwidth = kv_bytes / (extra["after"] * count * 1e3) if count else float("nan")
        print(f"{count:>5} {row['before_us']:>10.1f} {row['after_us']:>10.1f} {extra['before']:>14.2f} "
              f"{extra['after']:>13.2f} {kv_bytes / 1e6:>7.1f} {bandwidth:>10.0f} {row['max_diff']:>9.2g}")


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt", type=int, default=500)
    parser.add_argument("--decode-rows", type=int, nargs="+", default=[0, 10, 57])
    parser.add_argument("--context", type=int, default=1024, help="tokens of each decode row's sequence")
    parser.add_argument("--splits", type=int, default=4, help="the decode kernel's split-K")
    parser.add_argument("--max-seqs", type=int, default=64, help="a prompt-step graph's sequences")
    parser.add_argument("--rounds", type=int, default=50)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    return parser.parse_args(argv)


if __name__ == "__main__":
    arguments = parse()
    report(measure(arguments), arguments)
