"""lm-evaluation-harness against a live daemon on SmolLM2 (the "Scored prompts" surface):
a local multiple-choice task through `local-completions` (echo + logprobs), every choice's
log-likelihood equal to transformers' float32 forward of the same GGUF, and a local
`generate_until` task through `local-chat-completions`. Offline: tasks and data from
tests/data, the tokenizer from the GGUF, nothing from a hub."""

from __future__ import annotations

from pathlib import Path

import lm_eval
import pytest
import torch

from harness.store import wait_rows
from tests.conftest import require_smollm2, smollm2_float32

# About a minute on 2 CPU cores: the daemon, 96 scored requests, transformers' reference.
pytestmark = pytest.mark.slow

DATA = Path(__file__).parents[1] / "data"
TOL = 1e-3
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


@pytest.fixture(scope="module")
def smollm2(make_module_daemon, tmp_path_factory):
    """The daemon on SmolLM2 (float32), and a tokenizer directory saved from the GGUF."""
    from transformers import AutoTokenizer

    path = require_smollm2()
    tok_dir = tmp_path_factory.mktemp("lm_eval") / "tokenizer"
    AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(tok_dir)
    return make_module_daemon(path, **smollm2_float32()), path, tok_dir


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """No hub, a private datasets cache, and tests/data as the working directory (the task
    YAMLs' data_files are relative to it)."""
    for k, v in OFFLINE.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    import datasets.config

    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets")
    monkeypatch.chdir(DATA)


def _evaluate(model: str, model_args: dict, task: str, **kw):
    from lm_eval.tasks import TaskManager

    return lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=[task],
        task_manager=TaskManager(include_path=str(DATA), include_defaults=False),
        log_samples=True,
        bootstrap_iters=0,
        **kw,
    )


def _reference(path: Path, tok_dir: Path, pairs: list[tuple[str, str]]) -> list[float]:
    """Each (context, continuation)'s summed log-probability, split as lm-eval splits it
    (trailing spaces of the context move to the continuation; the pair encoded whole, the
    continuation = the tokens after the context's), under transformers' float32 forward."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tok_dir)
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    out = []
    with torch.no_grad():
        for ctx, cont in pairs:
            n = len(ctx) - len(ctx.rstrip())
            if n:
                ctx, cont = ctx[:-n], ctx[-n:] + cont
            whole = tok(ctx + cont, add_special_tokens=False).input_ids
            n_ctx = len(tok(ctx, add_special_tokens=False).input_ids)
            lsm = torch.log_softmax(model(torch.tensor([whole])).logits[0].float(), -1)
            pos = torch.arange(n_ctx, len(whole))
            out.append(float(lsm[pos - 1, torch.tensor(whole[n_ctx:])].sum()))
    return out


def test_multiple_choice_loglikelihoods_match_transformers(smollm2, offline):
    d, path, tok_dir = smollm2
    results = _evaluate(
        "local-completions",
        {
            "base_url": f"{d.url}/v1/completions",
            "model": "smol",
            # Log-likelihoods need token counts (where the context ends): with the `remote`
            # backend lm-eval tokenizes through the daemon (/tokenizer_info, /tokenize,
            # /detokenize): no tokenizer argument, no model hub.
            "tokenizer_backend": "remote",
            "num_concurrent": 1,
            "max_retries": 1,
        },
        "cp_arithmetic",
    )
    samples = results["samples"]["cp_arithmetic"]
    assert len(samples) == 24
    pairs, got = [], []
    for s in samples:
        assert len(s["resps"]) == 4 and len(s["filtered_resps"]) == 4
        # resps: each request's responses, [(loglikelihood, is_greedy)]; filtered_resps: the
        # response after the task's filters (none here: the same pair).
        for arg, ((ll, _greedy),), (fll, _) in zip(
            s["arguments"], s["resps"], s["filtered_resps"], strict=True
        ):
            assert ll == fll
            pairs.append((arg[0], arg[1]))
            got.append(ll)
    ref = _reference(path, tok_dir, pairs)
    diff = max(abs(a - b) for a, b in zip(got, ref, strict=True))
    acc = results["results"]["cp_arithmetic"]["acc,none"]
    print(
        f"lm-eval {len(got)} log-likelihoods: max |daemon - transformers| = {diff:.2e}; acc {acc}"
    )
    assert diff < TOL
    rows = wait_rows(
        d.cfg.store_url, lambda r: len(r) >= len(got), where="endpoint = 'completions'"
    )
    assert len(rows) == len(got)  # one request per choice (batch size 1)
    assert all(r["status"] == "success" for r in rows)


def test_generate_until_through_chat_completions(smollm2, offline):
    d, _, _ = smollm2
    results = _evaluate(
        "local-chat-completions",
        {"base_url": f"{d.url}/v1/chat/completions", "model": "smol", "num_concurrent": 1},
        "cp_capitals",
        apply_chat_template=True,
    )
    samples = results["samples"]["cp_capitals"]
    assert len(samples) == 4
    for s in samples:
        (resp,) = s["resps"]
        assert isinstance(resp[0], str) and resp[0].strip(), s
    print("lm-eval generations:", [s["resps"][0][0] for s in samples])
    chat = "endpoint = 'chat.completions'"
    rows = wait_rows(d.cfg.store_url, lambda r: len(r) >= len(samples), where=chat)
    assert len(rows) == len(samples)  # one request per item
    assert all(r["status"] == "success" and r["completion_tokens"] > 0 for r in rows)
