"""Prefix caching and speculative decoding in SQL, end to end: a real daemon on loopback (tiny
model, n-gram speculation from its config file) writes request rows with draft counts,
utilization samples with both rates, and cost figures whose cache savings follow the price."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta

import httpx
import pytest
import sqlalchemy as sa

from controlplane.accounting.reports import cost_report
from controlplane.config import DEFAULT_PRICES, load_config
from controlplane.store import UtilizationSampleRow, make_engine
from harness import InProcessDaemon, wait_rows
from tests.admin.test_admin_api import TOKEN, admin_cfg
from tests.admin.test_cache_visibility import BS, SHARED, metric

SAMPLES = UtilizationSampleRow.__table__
# Five cached blocks, then a repeating tail the n-gram proposer drafts from.
PROMPT = [*SHARED, *([11, 12, 13, 14, 15, 16] * 4)]


def complete(c: httpx.Client) -> dict:
    body = {"model": "model", "prompt": PROMPT, "max_tokens": 24, "temperature": 0}
    r = c.post("/v1/completions", json={**body, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()


def test_rows_samples_and_costs_count_drafts_and_cache(tiny_model_dir, tmp_path) -> None:
    engine = {
        "max_num_seqs": 8,
        "max_model_len": 1024,
        "speculative_method": "ngram",
        "speculative_ngram_min": 1,
    }
    path = admin_cfg(tmp_path, tiny_model_dir, engine=engine, jobs={"utilization_interval_s": 0.5})
    cfg = load_config(path, env={})
    url = cfg.store_url
    started = datetime.now(UTC)
    with InProcessDaemon(cfg, config_path=path) as d:
        with d.client(TOKEN) as c:
            ids = [complete(c)["id"], complete(c)["id"]]  # the second finds the prefix cached
            proposed = metric(c, "controlplane:spec_decode_num_draft_tokens_total")
            accepted = metric(c, "controlplane:spec_decode_num_accepted_tokens_total")
        got = wait_rows(
            url,
            lambda rs: len(rs) == 2 and all(r["status"] == "success" for r in rs),
            where="id IN ({})".format(", ".join(f"'{i}'" for i in ids)),
        )
        rows = {r["id"]: r for r in got}
        first, second = rows[ids[0]], rows[ids[1]]
        # The rows hold the engine's counts: together they are everything it drafted.
        assert first["draft_tokens"] > 0 and second["draft_tokens"] > 0
        assert sum(r["draft_tokens"] for r in got) == proposed
        assert sum(r["accepted_draft_tokens"] for r in got) == accepted
        assert all(0 <= r["accepted_draft_tokens"] <= r["draft_tokens"] for r in got)
        assert first["cached_prompt_tokens"] == 0
        assert second["cached_prompt_tokens"] >= 5 * BS

        # The sampler (every 0.5 s) saw the lookups and the drafts: rates in [0, 1], NULL in the
        # samples that had none.
        db = make_engine(url)
        try:
            deadline = time.monotonic() + 20
            while True:
                with db.connect() as conn:
                    rates = conn.execute(
                        sa.select(SAMPLES.c.prefix_cache_hit_rate, SAMPLES.c.spec_acceptance_rate)
                    ).all()
                hits = [h for h, _ in rates if h is not None]
                accepts = [a for _, a in rates if a is not None]
                if hits and accepts:
                    break
                assert time.monotonic() < deadline, f"no sample with both rates: {rates}"
                time.sleep(0.1)
            assert all(0 <= r <= 1 for r in hits + accepts) and max(hits) > 0
        finally:
            db.dispose()
    assert d.exit_code == 0

    # At the (default) list price the cache saved cached x (prompt - cached rate) / 1e6.
    (price,) = DEFAULT_PRICES
    cached = first["cached_prompt_tokens"] + second["cached_prompt_tokens"]
    prompt = first["prompt_tokens"] + second["prompt_tokens"]
    db = make_engine(url)
    try:
        report = cost_report(
            db,
            since=started - timedelta(minutes=1),
            until=datetime.now(UTC) + timedelta(minutes=1),
            group_by="model",
        )
    finally:
        db.dispose()
    t = report.totals
    assert (t["prompt_tokens"], t["cached_prompt_tokens"]) == (prompt, cached)
    assert t["cached_share"] == pytest.approx(cached / prompt, rel=1e-12)
    saved = cached * (price.prompt_per_mtok - price.cached_prompt_per_mtok) / 1e6
    assert t["cache_savings_usd"] == pytest.approx(saved, rel=1e-9)
