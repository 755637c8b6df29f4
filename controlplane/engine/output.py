"""Output processing, one token at a time: append a sampled token to its sequence, detokenize
it, check stop tokens, stop strings, grammar completion and the length limits, and build the
`RequestOutput` the caller sees (holding back text that may still become a stop string)."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import fields

from controlplane.engine.sequence import Sequence
from controlplane.engine.types import RequestOutput, TokenLogprobs


def take_token(
    seq: Sequence,
    token: int,
    lp: TokenLogprobs | None,
    now: float,
    eos_token_ids: Collection[int],
    max_model_len: int,
) -> tuple[str | None, bool]:
    """Append `token` (its grammar already took it) and say whether the sequence ends here:
    (finish reason or None, whether to flush the detokenizer's held-back bytes)."""
    p = seq.params
    m = seq.metrics
    if m.first_token_time is None:
        m.first_token_time = now
    seq.append_token(token)
    m.num_output_tokens += 1
    if lp is not None:
        seq.cumulative_logprob += lp.logprob
    # Complete (nothing but EOS could follow): stop now rather than spend a step on sampling
    # that EOS.
    grammar_done = seq.matcher is not None and seq.matcher.is_stopped()
    if token in p.stop_token_ids or (not p.ignore_eos and token in eos_token_ids):
        return "stop", True  # the stop token's text is not part of the output
    piece = seq.detokenizer.add(token)
    if piece:  # no new text: no new stop-string match either
        seq.output_text.append(piece)
        if p.stop and truncate_at_stop(seq, len(piece)):
            return "stop", False  # the text is cut before the stop string: nothing to flush
    if grammar_done:
        return "stop", True
    if len(seq.output_token_ids) >= p.max_tokens or len(seq.token_ids) >= max_model_len:
        return "length", True
    return None, True


def truncate_at_stop(seq: Sequence, new_chars: int) -> bool:
    """Cut the text before the first stop string; only a match touching the new text is new."""
    text = seq.output_text
    start = max(0, text.length - new_chars - max(len(s) for s in seq.params.stop) + 1)
    tail = text.tail(start)
    hits = [i for i in (tail.find(s) for s in seq.params.stop) if i != -1]
    if hits:
        text.cut(start + min(hits))
    return bool(hits)


def finish_text(seq: Sequence, flush: bool) -> None:
    """The sequence ends: the bytes held back for an unfinished character join its text."""
    if flush and (rest := seq.detokenizer.flush()):
        seq.output_text.append(rest)


# make_output passes RequestOutput's fields by position (keywords cost 3x the construction,
# a few microseconds a row every step): the order it relies on, checked at import.
_OUTPUT_FIELDS = (
    "request_id",
    "prompt_token_ids",
    "token_ids",
    "new_token_ids",
    "text_so_far",
    "delta_text",
    "finished",
    "finish_reason",
    "metrics",
    "logprobs",
    "time",
    "error",
    "error_param",
    "index",
    "cumulative_logprob",
    "prompt_logprobs",
)
if tuple(f.name for f in fields(RequestOutput))[: len(_OUTPUT_FIELDS)] != _OUTPUT_FIELDS:
    raise ImportError("RequestOutput's fields moved: update output.make_output")


def make_output(
    seq: Sequence,
    new: list[int],
    lps: list[TokenLogprobs | None],
    now: float,
    finished: bool,
) -> RequestOutput:
    """What the caller sees of `seq` after this step's `new` tokens."""
    # Hold back text that could still turn out to be the start of a stop string.
    text = seq.output_text
    params = seq.params
    emitted = seq.num_emitted_chars
    release = text.length
    if not finished and params.stop:
        release = max(emitted, release - max(len(s) for s in params.stop) + 1)
    seq.num_emitted_chars = release
    return RequestOutput(
        seq.request_id,
        seq.prompt_token_ids,
        seq.output_token_ids,
        new,
        text.prefix(release),
        text.tail(emitted)[: release - emitted] if release > emitted else "",
        finished,
        seq.finish_reason,
        seq.metrics,
        lps if params.logprobs is not None else [],
        now,
        None,  # error
        None,  # error_param
        seq.index,
        seq.cumulative_logprob if len(seq.group) > 1 else None,
        seq.prompt_logprobs,
    )


def merge(outs: list[RequestOutput]) -> RequestOutput:
    """One output for several tokens of one choice produced in one step (speculation)."""
    last = outs[-1]
    if len(outs) > 1:
        last.new_token_ids = [t for o in outs for t in o.new_token_ids]
        last.delta_text = "".join(o.delta_text for o in outs)
        last.logprobs = [lp for o in outs for lp in o.logprobs]
    return last
