"""Scored prompts on /v1: the limit on prompt tokens scored, `echo`'s prompt part of a
completion choice's legacy `logprobs`, and vLLM's `prompt_logprobs` list.

The engine scores a prompt when SamplingParams.prompt_logprobs is set (see
controlplane/engine/prompt_logprobs.py): `RequestOutput.prompt_logprobs` holds None for the
first prompt token, then one TokenLogprobs (logprob, rank, top N) per prompt token.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from controlplane.http.errors import invalid

if TYPE_CHECKING:
    from controlplane.engine import RequestOutput


def check_limit(prompts_ids: list[list[int]], field: str, limit: int) -> None:
    """400 naming `field` when a prompt to be scored is longer than the limit
    (server.max_prompt_logprobs_tokens): checked before the engine sees the request."""
    for i, ids in enumerate(prompts_ids):
        if len(ids) > limit:
            where = f" (prompt[{i}])" if len(prompts_ids) > 1 else ""
            raise invalid(
                field,
                f"scores {len(ids)} prompt tokens{where}; the limit is {limit} per prompt "
                "(server.max_prompt_logprobs_tokens)",
            )


def echo_logprobs(
    out: RequestOutput, top_n: int, token_str: Callable[[int], str]
) -> tuple[list[str], list[float | None], list[dict[str, float] | None]]:
    """The prompt's tokens, token_logprobs and top_logprobs (None first) for `echo`."""
    ids = out.prompt_token_ids
    lps = out.prompt_logprobs or [None] * len(ids)
    tokens = [token_str(t) for t in ids]
    values = [None if lp is None else lp.logprob for lp in lps]
    tops = [None if lp is None else {token_str(i): v for i, v in lp.top[:top_n]} for lp in lps]
    return tokens, values, tops


def vllm_prompt_logprobs(
    out: RequestOutput, top_n: int, token_str: Callable[[int], str]
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's shape: None for the first token, then {token id: {logprob, rank,
    decoded_token}} holding the prompt token and the top N (N or N + 1 entries)."""
    result: list[dict[str, dict[str, Any]] | None] = []
    for lp in out.prompt_logprobs or [None] * len(out.prompt_token_ids):
        if lp is None:
            result.append(None)
            continue
        entry: dict[str, dict[str, Any]] = {
            str(lp.token_id): {
                "logprob": lp.logprob,
                "rank": lp.rank,
                "decoded_token": token_str(lp.token_id),
            }
        }
        for rank, (tid, v) in enumerate(lp.top[:top_n], start=1):
            entry.setdefault(
                str(tid), {"logprob": v, "rank": rank, "decoded_token": token_str(tid)}
            )
        result.append(entry)
    return result
