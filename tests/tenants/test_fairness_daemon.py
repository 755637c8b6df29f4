"""Issue 55, fair scheduling through a live daemon: a flooding key keeps 16 long prompts in
flight, a light key sends one short streamed request at a time. Under fcfs the light key's
first token waits behind the flood's queue; under fair (switched live) it takes the next
step's tokens and a slot. The ordering of the two policies is asserted, not a timing."""

from __future__ import annotations

import httpx
import pytest

from harness import ADMIN_TOKEN, InProcessDaemon, fairness
from tests.admin.test_admin_api import MODEL

KEYS = {name: f"sk-{name}-0123456789abcdef" for name in ("flood", "light")}


@pytest.fixture(scope="module")
def daemon(make_module_daemon) -> InProcessDaemon:
    return make_module_daemon(
        admin=True,
        engine={
            "max_num_seqs": 8,
            "max_num_batched_tokens": 64,
            "prefill_chunk_size": 64,
            "max_model_len": 512,
        },
        api_keys=[{"name": n, "key": k} for n, k in KEYS.items()],
    )


def test_fair_keeps_the_light_keys_first_token_near_its_time_alone(daemon):
    vocab = daemon.engine.model_config.vocab_size
    flood = fairness.Flood(concurrency=16, prompt_tokens=200, max_tokens=8)

    def light(flood_key: str | None) -> fairness.LightRun:
        return fairness.run(
            daemon.url, MODEL, KEYS["light"], flood_key, flood, requests=8, vocab=vocab
        )

    alone = light(None)
    fcfs = light(KEYS["flood"])
    fairness.set_policy(daemon.url, ADMIN_TOKEN, "fair")
    fair = light(KEYS["flood"])
    figures = {
        name: (round(run.p50 * 1e3, 1), round(run.p99 * 1e3, 1), round(run.flood_tokens_per_s))
        for name, run in {"alone": alone, "fcfs": fcfs, "fair": fair}.items()
    }
    # The flood ran under both policies, and fair kept the light key well ahead of fcfs.
    assert fcfs.flood_tokens_per_s > 0 and fair.flood_tokens_per_s > 0, figures
    assert fair.p99 < fcfs.p99 and fair.p50 < fcfs.p50, figures
    # Every request of both keys was served: nothing refused, nothing left running.
    stats = httpx.get(
        f"{daemon.url}/admin/stats", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}
    ).json()
    assert stats["scheduling_policy"] == "fair", stats.get("scheduling_policy")


@pytest.mark.parametrize("priority", ["high", 2**40, True, 1.5])
def test_a_bad_priority_is_a_400_naming_the_field(daemon, priority):
    with daemon.client(KEYS["light"]) as c:
        for path, body in (
            ("/v1/completions", {"prompt": "hi"}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
            ("/v1/responses", {"input": "hi"}),
        ):
            r = c.post(path, json={"model": MODEL, "max_tokens": 2, "priority": priority, **body})
            assert r.status_code == 400, (path, r.text)
            error = r.json()["error"]
            assert error["param"] == "priority", (path, error)
            assert error["message"].startswith("priority: must be an int"), (path, error)
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, "priority": -3}
        assert c.post("/v1/completions", json=body).status_code == 200
