"""Scored prompts (issue "Scored prompts"): the engine's prompt logprobs against a full-prompt
forward of transformers, under chunked prefill, preemption and prefix-cache hits, and the
/v1 surface (echo, max_tokens 0, vLLM's prompt_logprobs, the limit) on a real daemon with the
openai SDK, SmolLM2's summed prompt logprob against transformers on the same GGUF."""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import pytest
import torch

from controlplane.engine import Engine, SamplingParams
from harness import drain
from tests.conftest import (
    MIXED_ENGINE,
    mixed_workload,
    require_smollm2,
    smollm2_float32,
)

TEXT = Path(__file__).parents[1] / "data" / "perplexity.txt"
TOL = 1e-4


def _reference(model_dir: Path, prompts: list[list[int]]) -> list[torch.Tensor]:
    """log_softmax of transformers' float32 logits over each whole prompt."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [torch.log_softmax(model(torch.tensor([p])).logits[0].float(), -1) for p in prompts]


def _check(prompt: list[int], lps: list, ref: torch.Tensor, top_n: int) -> None:
    assert len(lps) == len(prompt) and lps[0] is None
    for p in range(1, len(prompt)):
        lp, row = lps[p], ref[p - 1]
        assert lp.token_id == prompt[p]
        assert abs(lp.logprob - float(row[prompt[p]])) < TOL, (p, lp.logprob)
        assert lp.rank == int((row > row[prompt[p]]).sum()) + 1
        vals = row.topk(top_n).values.tolist()
        assert [v for _, v in lp.top] == pytest.approx(vals, abs=TOL)
        for tid, v in lp.top:
            assert abs(v - float(row[tid])) < TOL


def _run(engine: Engine, prompts, params) -> dict[str, object]:
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
    done = drain(engine)
    return [done[i] for i in ids]


def _scored(i: int) -> bool:
    return i % 3 == 1  # requests 1, 4, 7, 10, 13 score their prompts; the rest are plain


def test_prompt_logprobs_match_a_full_forward_under_chunking_and_preemption(hf_model_dirs):
    """16 concurrent requests (chunked prefill: 32-token chunks of prompts up to 117 tokens;
    640 KV slots: preemption by recompute; a shared 40-token prefix: cache hits), five of them
    scoring their prompt: every scored position equals transformers' log_softmax of the whole
    prompt, none lost or duplicated, and every request's tokens are those of the same run
    without scoring."""
    model = hf_model_dirs["llama"]
    prompts, plain_params = mixed_workload(1024, seed=7, first_max_tokens=6)
    scored_params = [
        SamplingParams(
            max_tokens=sp.max_tokens, temperature=0.0, ignore_eos=True, prompt_logprobs=3
        )
        if _scored(i)
        else sp
        for i, sp in enumerate(plain_params)
    ]
    kw = dict(model=str(model), dtype="float32", **MIXED_ENGINE)
    plain_eng = Engine(**kw)
    base = _run(plain_eng, prompts, plain_params)
    eng = Engine(**kw)
    outs = _run(eng, prompts, scored_params)
    assert eng.stats().num_preemptions > 0  # the workload preempts
    assert any(o.metrics.num_preemptions for i, o in enumerate(outs) if _scored(i))
    assert eng.stats().prefix_cache_hits_total > 0  # plain requests still hit the cache
    refs = _reference(model, [p for i, p in enumerate(prompts) if _scored(i)])
    it = iter(refs)
    for i, (o, b) in enumerate(zip(outs, base, strict=True)):
        assert o.token_ids == b.token_ids  # scoring changes no request's tokens
        if _scored(i):
            _check(prompts[i], o.prompt_logprobs, next(it), 3)
            assert o.metrics.num_cached_tokens == 0  # its first pass computed every token
        else:
            assert o.prompt_logprobs is None
    assert eng.block_pool.num_used == 0


def test_scoring_a_cached_prompt_recomputes_it_and_bills_nothing_as_cached(hf_model_dirs):
    """A scoring request whose prompt sits in the prefix cache computes it again (a cached
    block has no logits), so its cached_tokens is 0; the next plain request still hits."""
    model = hf_model_dirs["qwen2"]
    eng = Engine(model=str(model), dtype="float32", block_size=16, prefill_chunk_size=24)
    prompt = torch.randint(3, 1000, (70,), generator=torch.Generator().manual_seed(3)).tolist()
    (first,) = _run(eng, [prompt], [SamplingParams(max_tokens=2, temperature=0.0)])
    assert first.metrics.num_cached_tokens == 0
    hits = eng.stats().prefix_cache_hits_total
    scoring = SamplingParams(max_tokens=0, prompt_logprobs=0)
    (scored,) = _run(eng, [prompt], [scoring])
    assert scored.finish_reason == "length" and scored.token_ids == []
    assert scored.metrics.num_cached_tokens == 0
    assert eng.stats().prefix_cache_hits_total == hits  # nothing came from the cache
    (ref,) = _reference(model, [prompt])
    _check(prompt, scored.prompt_logprobs, ref, 0)
    (again,) = _run(eng, [prompt], [SamplingParams(max_tokens=2, temperature=0.0)])
    assert again.metrics.num_cached_tokens == 64  # 4 full blocks, the last token computed
    assert again.token_ids == first.token_ids


def test_max_tokens_zero_needs_prompt_logprobs():
    from controlplane.engine.errors import InvalidSettingError

    with pytest.raises(InvalidSettingError) as err:
        SamplingParams(max_tokens=0)
    assert err.value.field == "max_tokens"
    with pytest.raises(InvalidSettingError) as err:
        SamplingParams(prompt_logprobs=21)
    assert err.value.field == "prompt_logprobs"


# -- the daemon, with the openai SDK, on SmolLM2 ----------------------------------------------

LIMIT = 1024


@pytest.fixture(scope="module")
def smollm2_daemon(make_module_daemon):
    path = require_smollm2()
    return make_module_daemon(path, **smollm2_float32(max_prompt_logprobs_tokens=LIMIT)), path


@pytest.fixture(scope="module")
def smollm2_reference(smollm2_daemon):
    from transformers import AutoModelForCausalLM

    from controlplane.engine.gguf.tokenizer import tokenizer_from_gguf

    _, path = smollm2_daemon
    ids = tokenizer_from_gguf(path).encode(TEXT.read_text())
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    with torch.no_grad():
        lsm = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    total = float(lsm[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].sum())
    return ids, total


def test_echo_scores_the_shipped_text_like_transformers(smollm2_daemon, smollm2_reference):
    d, _ = smollm2_daemon
    ids, ref_total = smollm2_reference
    text = TEXT.read_text()
    client = d.openai()
    r = client.completions.create(model="smol", prompt=text, echo=True, logprobs=1, max_tokens=0)
    (choice,) = r.choices
    assert choice.finish_reason == "length"
    assert choice.text == text
    lp = choice.logprobs
    assert len(lp.tokens) == len(ids) == r.usage.prompt_tokens
    assert r.usage.completion_tokens == 0
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(len(t) == 1 for t in lp.top_logprobs[1:])
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    total = sum(lp.token_logprobs[1:])
    print(f"SmolLM2 summed prompt logprob {total:.4f} (transformers float32 {ref_total:.4f})")
    assert abs(total / ref_total - 1) < 1e-3


def test_echo_with_generation_and_prompt_logprobs_in_vllm_shape(smollm2_daemon):
    d, _ = smollm2_daemon
    prompts = ["The capital of France is", "One, two, three,"]
    r = httpx.post(
        d.url + "/v1/completions",
        json={
            "model": "smol",
            "prompt": prompts,
            "echo": True,
            "logprobs": 2,
            "max_tokens": 3,
            "temperature": 0,
            "prompt_logprobs": 1,
        },
        timeout=120,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    for choice, prompt in zip(body["choices"], prompts, strict=True):
        assert choice["text"].startswith(prompt) and len(choice["text"]) > len(prompt)
        lp = choice["logprobs"]
        plp = choice["prompt_logprobs"]
        n_prompt = len(plp)
        assert len(lp["tokens"]) == n_prompt + 3
        assert lp["token_logprobs"][0] is None and plp[0] is None
        for i in range(1, n_prompt):
            entry = plp[i]
            assert 1 <= len(entry) <= 2
            # The prompt token's entry agrees with the echo logprobs of the same position.
            actual = [e for e in entry.values() if e["decoded_token"] == lp["tokens"][i]]
            assert actual and actual[0]["logprob"] == pytest.approx(lp["token_logprobs"][i])
            assert any(e["rank"] == 1 for e in entry.values())
        assert all(len(t) == 2 for t in lp["top_logprobs"][1:])
    # Token ids as the prompt: the text is the detokenized prompt, scored the same.
    ids = httpx.post(
        d.url + "/v1/completions",
        json={
            "model": "smol",
            "prompt": [504, 3575, 282],
            "echo": True,
            "logprobs": 0,
            "max_tokens": 0,
        },
        timeout=60,
    ).json()["choices"][0]
    assert len(ids["logprobs"]["tokens"]) == 3 and ids["logprobs"]["token_logprobs"][0] is None
    assert ids["text"] == "".join(ids["logprobs"]["tokens"])


def test_chat_prompt_logprobs_score_the_rendered_prompt(smollm2_daemon):
    d, _ = smollm2_daemon
    r = httpx.post(
        d.url + "/v1/chat/completions",
        json={
            "model": "smol",
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 2,
            "prompt_logprobs": 0,
        },
        timeout=60,
    )
    assert r.status_code == 200, r.text
    body = r.json()
    plp = body["choices"][0]["prompt_logprobs"]
    assert len(plp) == body["usage"]["prompt_tokens"] and plp[0] is None
    assert all(len(e) == 1 and next(iter(e.values()))["logprob"] <= 0 for e in plp[1:])


def _error(r: httpx.Response) -> dict:
    return r.json()["error"]


def test_hostile_scoring_requests_get_400s_naming_the_field(smollm2_daemon):
    d, _ = smollm2_daemon
    url = d.url + "/v1/completions"
    base = {"model": "smol", "prompt": "Hello"}
    r = httpx.post(url, json={**base, "max_tokens": 0}, timeout=30)
    assert r.status_code == 400 and _error(r)["param"] == "max_tokens"
    r = httpx.post(url, json={**base, "prompt_logprobs": 21}, timeout=30)
    assert r.status_code == 400 and _error(r)["param"] == "prompt_logprobs"
    long = [42] * (LIMIT + 1)
    r = httpx.post(url, json={**base, "prompt": long, "prompt_logprobs": 1}, timeout=30)
    assert r.status_code == 400 and _error(r)["param"] == "prompt_logprobs"
    assert str(LIMIT) in _error(r)["message"]
    r = httpx.post(
        d.url + "/v1/chat/completions",
        json={
            "model": "smol",
            "messages": [{"role": "user", "content": "x " * 1500}],
            "prompt_logprobs": 0,
        },
        timeout=30,
    )
    assert r.status_code == 400 and _error(r)["param"] == "prompt_logprobs"
    # 100k tokens with echo: a 4xx naming the field, never a 5xx or an OOM.
    huge = [42] * 100_000
    r = httpx.post(
        url,
        json={**base, "prompt": huge, "echo": True, "logprobs": 1, "max_tokens": 0},
        timeout=60,
    )
    assert 400 <= r.status_code < 500 and _error(r)["param"] == "echo", r.text
    assert str(LIMIT) in _error(r)["message"]
    with pytest.raises(openai.BadRequestError):
        d.openai().completions.create(model="smol", prompt="Hi", max_tokens=0)
    assert httpx.get(d.url + "/health", timeout=10).status_code == 200


def test_streamed_echo_sends_the_prompt_first(smollm2_daemon):
    d, _ = smollm2_daemon
    prompt = "The capital of France is"
    stream = d.openai().completions.create(
        model="smol",
        prompt=prompt,
        echo=True,
        logprobs=0,
        max_tokens=2,
        temperature=0,
        stream=True,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text.startswith(prompt) and len(text) > len(prompt)
    first = chunks[0].choices[0].logprobs
    assert first.token_logprobs[0] is None and len(first.tokens) >= 2
