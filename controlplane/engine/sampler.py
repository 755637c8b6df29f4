"""Turn the last-position logits of each sampling sequence into its next token."""

from __future__ import annotations

from array import array
from typing import Any

import torch

from controlplane.engine.sampling_params import SamplingParams
from controlplane.engine.sequence import Sequence
from controlplane.engine.transfer import to_device
from controlplane.engine.types import TokenLogprobs


def _flat_keys(
    rows: list[int], lists: list[list[int]], vocab: int, device: torch.device
) -> torch.Tensor:
    """row * vocab + id for every id of `lists` (list i belongs to row rows[i]), int64: each
    list copied once through an array's buffer (torch.tensor reads a list element by element,
    several times slower)."""
    parts = [
        torch.frombuffer(array("q", ids), dtype=torch.long) + row * vocab
        for row, ids in zip(rows, lists, strict=True)
        if ids
    ]
    keys = torch.cat(parts) if parts else torch.empty(0, dtype=torch.long)
    return to_device(keys, device)


def apply_penalties(
    logits: torch.Tensor,
    params: list[SamplingParams],
    token_ids: list[list[int]],
    output_ids: list[list[int]],
) -> None:
    """Penalise rows of logits [R, vocab] in place (contiguous: their flat view is written),
    given each row's tokens so far (prompt + output) and its output tokens. All rows at once,
    and only the entries of tokens that occurred (torch.unique over row * vocab + id): a row at
    a time cost milliseconds a row at a long context, and arithmetic or a scan over every
    entry as much again (docs/benchmarks.md#sampling)."""
    flat = logits.view(-1)
    vocab, dtype, device = logits.shape[-1], logits.dtype, logits.device
    rep = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    if rep:
        # HF semantics: over prompt and output, each distinct token once; shrink positive
        # logits, push negative ones down.
        # (On a GPU, torch.unique waits for the device: steps with penalties are synchronous
        # anyway, engine/overlap.py.)
        keys = torch.unique(_flat_keys(rep, [token_ids[i] for i in rep], vocab, device))
        f = to_device([p.repetition_penalty for p in params], device, dtype)[keys // vocab]
        sel = flat[keys]
        flat[keys] = torch.where(sel > 0, sel / f, sel * f)
    counted = [
        i
        for i, p in enumerate(params)
        if (p.presence_penalty or p.frequency_penalty) and output_ids[i]
    ]
    if counted:
        # OpenAI semantics: over output tokens only.
        occurrences = _flat_keys(counted, [output_ids[i] for i in counted], vocab, device)
        keys, counts = torch.unique(occurrences, return_counts=True)
        c = counts.to(dtype)
        row = keys // vocab
        freq = to_device([p.frequency_penalty for p in params], device, dtype)[row]
        pres = to_device([p.presence_penalty for p in params], device, dtype)[row]
        flat[keys] = flat[keys] - (freq * c + pres * (c > 0).to(dtype))


# The candidates the top-k / top-p filter looks at first, widening while a row's kept tokens
# may lie past them: the largest entries in order (topk) rather than the whole vocabulary
# sorted, which takes many times longer on a CPU (docs/benchmarks.md#sampling). A language
# model's peaked rows settle in the first width; a flat row ends in the full sort, as before.
FILTER_WIDTHS = (256, 4096)


def filter_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, top-k, top-p and min-p for rows that sample at random; returns normalized
    probabilities (speculative verification compares them with the draft's: p/q must be
    exact, so the filtered-out mass is renormalized here, not left to the draw)."""
    device = logits.device
    temps = to_device([p.temperature for p in params], device, torch.float32)
    probs = torch.softmax(logits / temps.unsqueeze(1), dim=-1)
    ks = [p.top_k for p in params]
    ps = [p.top_p for p in params]
    if any(k > 0 for k in ks) or any(p < 1.0 for p in ps):
        vocab = probs.shape[-1]
        # k beyond the vocabulary keeps everything (and must not reach torch: int64 overflow).
        k_t = to_device([min(k, vocab) if k > 0 else vocab for k in ks], device)
        p_t = to_device(ps, device, torch.float32)
        probs = _top_k_top_p(probs, k_t.unsqueeze(1), p_t.unsqueeze(1))
    min_ps = [p.min_p for p in params]
    if any(m > 0 for m in min_ps):
        floor = (
            to_device(min_ps, device, torch.float32).unsqueeze(1)
            * probs.max(-1, keepdim=True).values
        )
        probs = probs.masked_fill(probs < floor, 0.0)
    return probs / probs.sum(-1, keepdim=True)


def _top_k_top_p(probs: torch.Tensor, k_t: torch.Tensor, p_t: torch.Tensor) -> torch.Tensor:
    """Keep, per row, the k most likely tokens and of them the smallest prefix whose mass
    reaches p (the first token always kept); the rest are zeroed. k_t, p_t: [N, 1].

    Each width of FILTER_WIDTHS, then the whole vocabulary, looks at a row's largest entries
    in order; a row is settled there when nothing past them can be kept: its k is within the
    width, or the width's mass reaches p (with a margin over the rounding of the mass before
    each later token, which is at least that). Within the width the arithmetic is the full
    sort's, so the kept tokens and their values are the same. A width no remaining row can
    settle in is skipped: sorted entries only fall, so W entries hold at most W / w times the
    mass of the first w (a flat row goes from the first width to the full sort)."""
    vocab = probs.shape[-1]
    # On a GPU the whole sort is cheap, and asking which rows settled would wait for the
    # device (the sampler does not: asynchronous scheduling).
    cpu = probs.device.type == "cpu"
    widths = [w for w in FILTER_WIDTHS if w < vocab and cpu] + [vocab]
    out = torch.zeros_like(probs)
    rows: torch.Tensor | None = None  # the rows not settled yet (None: all of them)
    at = 0
    while True:
        width = widths[at]
        part, k_part, p_part = (
            (probs, k_t, p_t) if rows is None else (probs[rows], k_t[rows], p_t[rows])
        )
        if width < vocab:
            top, order = part.topk(width, dim=-1)
        else:
            top, order = part.sort(dim=-1, descending=True)
        mass = top.cumsum(-1)
        drop = torch.arange(width, device=probs.device).unsqueeze(0) >= k_part
        drop |= mass - top >= p_part  # the mass before a token already reaches p
        kept = top.masked_fill(drop, 0.0)
        settled = None
        if width < vocab:
            settled = ((k_part <= width) | (mass[:, -1:] >= p_part + 1e-6)).squeeze(1)
        if settled is None or bool(settled.all()):
            if rows is None:
                return out.scatter_(-1, order, kept)
            out[rows] = probs.new_zeros(len(rows), vocab).scatter_(-1, order, kept)
            return out
        done = settled.nonzero().squeeze(1) if rows is None else rows[settled]
        if len(done):
            out[done] = probs.new_zeros(len(done), vocab).scatter_(
                -1, order[settled], kept[settled]
            )
        left = ~settled
        rows = left.nonzero().squeeze(1) if rows is None else rows[left]
        at += 1
        k_left, p_left, bound = k_part[left], p_part[left], mass[left, -1:] / width
        while widths[at] < vocab and not bool(
            ((k_left <= widths[at]) | (bound * widths[at] >= p_left)).any()
        ):
            at += 1


def _filter(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    # The sampler's call site, by sequence (fault-injection tests wrap it to fail one request).
    return filter_probs(logits, [s.params for s in seqs])


def invert_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Row i's token: the first entry whose cumulative probability exceeds u[i] * total.
    probs: [N, vocab]; u: [N, 1] float64 uniforms in [0, 1). (argmax(p / Exp(1)) needed an
    exponential number per vocabulary entry: 13.6 ms a step for 16 rows of SmolLM2's 49,152
    on a CPU, a third of the step; this takes 0.4 ms.) The CDF is summed in float64, and an
    entry of probability zero is never drawn."""
    cdf = probs.double().cumsum(dim=-1)
    total = cdf[:, -1:].contiguous()
    picked = torch.searchsorted(cdf, u * total, right=True)
    # u * total can round up to total (once in ~2**53): then the last entry with mass.
    picked = torch.minimum(picked, torch.searchsorted(cdf, total)).squeeze(1)
    # A row with no finite mass (NaN or infinite logits, all filtered out) would search past
    # the vocabulary, and the next step's embedding lookup would fail the whole batch (found
    # by the fuzzed-bodies test): such a row takes its most likely finite entry instead.
    bad = ~(torch.isfinite(total) & (total > 0)).squeeze(1)
    # On a CPU the check is free and spares the argmax; on a GPU it would wait for the device.
    if probs.device.type != "cpu" or bool(bad.any()):
        fallback = torch.nan_to_num(probs.float(), nan=-1.0, posinf=1.0).argmax(dim=-1)
        picked = torch.where(bad, fallback, picked)
    return picked


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """Each row's most likely token [N] (int64): the first of equal maxima, and a NaN counts as
    the largest entry, as torch's max(dim=-1) has it. Float32 logits on a CPU go through
    NumPy's argmax, a vectorized loop, many times faster there than torch's reduction with
    indices (docs/benchmarks.md#sampling)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return torch.from_numpy(logits.numpy().argmax(axis=-1))
    return logits.max(dim=-1).indices


def draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from one row's probabilities [vocab] (speculative decoding's draft and
    correction draws): torch.multinomial took 0.95 ms at SmolLM2's vocabulary on a Xeon."""
    u = torch.rand(1, 1, dtype=torch.float64, device=probs.device, generator=generator)
    return int(invert_cdf(probs.unsqueeze(0), u))


class Sampler:
    def __init__(self, seed: int, device: torch.device) -> None:
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def _draw(self, probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
        """One token per row of `probs`: a request with a seed draws its uniform number from
        its own generator, so its tokens do not depend on what else shares the batch."""
        dev, f64, n = probs.device, torch.float64, len(generators)
        unseeded = [j for j, gen in enumerate(generators) if gen is None]
        if len(unseeded) == n:  # no seed in the batch: the generator's numbers are every row's
            u = torch.rand(n, 1, dtype=f64, device=dev, generator=self.generator)
        else:
            u = torch.empty(n, 1, dtype=f64, device=dev)
            if unseeded:
                rand = torch.rand(len(unseeded), 1, dtype=f64, device=dev, generator=self.generator)
                u[to_device(unseeded, dev)] = rand
        for j, gen in enumerate(generators):
            if gen is not None:
                u[j] = torch.rand(1, dtype=f64, device=dev, generator=gen)
        return invert_cdf(probs, u)

    def __call__(
        self, logits: torch.Tensor, seqs: list[Sequence]
    ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """Sample one token per row and read it (and its logprobs) on the host."""
        return self.sample(logits, seqs).result()

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> Sampled:
        """Sample one token per row without waiting for the device: tokens, their logprobs and
        the top alternatives asked for stay on the device in one tensor, which `Sampled`
        copies to the host in one transfer (one sync point per step, not one per row)."""
        # logits: [N, vocab] float32, one row per sequence in `seqs`
        params = [s.params for s in seqs]
        # Parallel sampling keeps each choice's cumulative logprob (best_of ranks by it).
        want = [(p.logprobs or 0) if p.logprobs is not None or p.n > 1 else -1 for p in params]
        raw_lp = torch.log_softmax(logits, dim=-1) if max(want, default=-1) >= 0 else None
        if any(p.needs_penalties for p in params):
            pen = [i for i, p in enumerate(params) if p.needs_penalties]
            part = logits[pen]  # a copy: the caller's logits stay as they are
            apply_penalties(
                part,
                [params[i] for i in pen],
                [seqs[i].token_ids for i in pen],
                [seqs[i].output_token_ids for i in pen],
            )
            logits = logits.index_put((to_device(pen, logits.device),), part)

        tokens = argmax_rows(logits)
        rand_rows = [i for i, p in enumerate(params) if not p.greedy]
        if rand_rows:
            rows = to_device(rand_rows, logits.device)
            probs = _filter(logits[rows], [seqs[i] for i in rand_rows])
            tokens[rows] = self._draw(probs, [seqs[i].generator for i in rand_rows])
        if raw_lp is None:
            return Sampled(tokens, tokens, want)
        # One float64 row per sequence: token, its logprob, the top K ids, their logprobs
        # (float64 holds every token id and float32 logprob exactly).
        k = max(want)
        cols = [tokens.double().unsqueeze(1), raw_lp.gather(1, tokens.unsqueeze(1)).double()]
        if k > 0:
            vals, ids = raw_lp.topk(k, dim=-1)
            cols += [ids.double(), vals.double()]
        return Sampled(tokens, torch.cat(cols, dim=1), want)


class Sampled:
    """One step's tokens on the device (`tokens` feeds the next step's inputs without a trip
    through the host) and their one copy to the host. On CUDA the copy goes to pinned memory
    without blocking, so the host waits for it only in `result`."""

    __slots__ = ("_event", "_host", "_known", "_packed", "_want", "errors", "tokens")

    def __init__(self, tokens: torch.Tensor, packed: torch.Tensor, want: list[int]) -> None:
        self.tokens = tokens
        self.errors: dict[int, str] = {}  # row -> why it failed (row-by-row sampling)
        self._packed, self._want = packed, want
        self._host: torch.Tensor | None = None
        self._event: Any = None
        self._known: list[TokenLogprobs | None] | None = None

    @classmethod
    def known(
        cls, tokens: torch.Tensor, lps: list[TokenLogprobs | None], errors: dict[int, str]
    ) -> Sampled:
        """Rows sampled one by one on the host already (a batch that failed to sample)."""
        out = cls(tokens, tokens, [])
        out._known, out.errors = lps, errors
        return out

    def start_copy(self) -> None:
        if self._host is not None:
            return
        if self._packed.device.type == "cuda":
            self._host = torch.empty(self._packed.shape, dtype=self._packed.dtype, pin_memory=True)
            self._host.copy_(self._packed, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = self._packed

    def result(self) -> tuple[list[int], list[TokenLogprobs | None]]:
        """The tokens and their logprobs (None for rows that did not ask), on the host."""
        self.start_copy()
        if self._event is not None:
            self._event.synchronize()
        rows = self._host.tolist()  # type: ignore[union-attr]
        if self._known is not None:
            return rows, self._known
        if self._packed is self.tokens:  # no logprobs asked for
            return rows, [None] * len(rows)
        k = max(self._want)
        tokens: list[int] = []
        lps: list[TokenLogprobs | None] = []
        for row, want in zip(rows, self._want, strict=True):
            token = int(row[0])
            tokens.append(token)
            if want < 0:
                lps.append(None)
                continue
            top = [
                (int(i), v)
                for i, v in zip(row[2 : 2 + want], row[2 + k : 2 + k + want], strict=True)
            ]
            lps.append(TokenLogprobs(token, row[1], top))
        return tokens, lps
