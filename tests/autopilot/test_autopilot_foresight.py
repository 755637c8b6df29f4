"""autopilot.simulate_first (controlplane/autopilot/foresight.py): the verdict on a step from its
simulated figures, and a real daemon under load whose autopilot simulates each step it takes
(tiny model, real HTTP, real SQLite)."""

from __future__ import annotations

import dataclasses
import re

import pytest

from controlplane.autopilot.foresight import verdict
from controlplane.autopilot.policy import LATENCY, THROUGHPUT, Decision, Targets
from controlplane.planning.summary import Figures
from harness import wait_rows
from tests.admin.test_admin_api import TOKEN, loadgen
from tests.autopilot.test_autopilot_daemon import wait

TARGETS = Targets(ttft_p99_ms=2000, itl_p99_ms=80)
BASE = Figures(
    label="now", requests=100, failed=0, prompt_tokens=1000, completion_tokens=1000,
    ttft_p50_ms=500.0, ttft_p99_ms=1500.0, itl_p50_ms=40.0, itl_p99_ms=90.0, queue_p50_ms=10.0,
    queue_p99_ms=400.0, throughput_tok_s=500.0, preemptions=0, peak_kv_usage=0.5,
    prefix_hit_rate=0.0, spec_acceptance=None, slo_attainment=0.9, cost_per_mtok_usd=None,
)  # fmt: skip
ITL = Decision("itl_p99 90 ms > 80 ms target: max_num_seqs 32 -> 24", "max_num_seqs", 32, 24,
               LATENCY)  # fmt: skip
TTFT = Decision("ttft_p99 2500 ms > 2000 ms target: max_num_batched_tokens 1024 -> 1280",
                "max_num_batched_tokens", 1024, 1280, THROUGHPUT)  # fmt: skip
MORE = Decision("targets met with headroom and 3.0 requests queued: max_num_seqs 32 -> 40",
                "max_num_seqs", 32, 40, THROUGHPUT)  # fmt: skip


def fig(**changes: float) -> Figures:
    return dataclasses.replace(BASE, **changes)


@pytest.mark.parametrize(
    ("decision", "step", "words"),
    [
        (ITL, fig(itl_p99_ms=70.0), None),  # the ITL it aims at falls: taken
        (ITL, fig(itl_p99_ms=89.0), "simulated itl p99 90 -> 89 ms, no gain"),  # < 2%
        (ITL, fig(itl_p99_ms=120.0, ttft_p99_ms=10.0), "simulated itl p99 90 -> 120 ms"),
        (TTFT, fig(ttft_p99_ms=900.0), None),
        (TTFT, fig(ttft_p99_ms=1600.0), "simulated ttft p99 1,500 -> 1,600 ms, no gain"),
        (MORE, fig(itl_p99_ms=79.0), None),  # within both targets
        (MORE, fig(itl_p99_ms=81.0), "simulated itl p99 81 ms would miss the 80 ms target"),
        (ITL, fig(itl_p99_ms=None), None),  # nothing to judge by: the policy's step stands
    ],
)
def test_verdict(decision: Decision, step: Figures, words: str | None) -> None:
    got = verdict(decision, BASE, step, TARGETS)
    assert got == words if words is None else words in got


def test_itl_is_judged_over_every_gap_where_the_simulation_kept_them() -> None:
    """A smaller prefill chunk shortens the one stalled gap of each request: the p99 of the
    requests' mean gaps stays put (90 ms both), the p99 over gaps falls."""
    now = fig(itl_gap_p99_ms=120.0)
    assert verdict(ITL, now, fig(itl_gap_p99_ms=60.0), TARGETS) is None
    got = verdict(ITL, now, fig(itl_gap_p99_ms=119.0), TARGETS)
    assert got == "simulated itl p99 120 -> 119 ms, no gain"


# A decision the simulator judged: taken with its prediction, or vetoed with it. Not one
# that says "(not simulated: ...)": a tick before the store holds any request row has nothing
# to replay, and its decision stands as the policy made it, saying so (docs/planning.md).
JUDGED = re.compile(r"(?<!not )simulated (itl|ttft)")


def test_the_daemon_simulates_each_step_before_taking_it(make_daemon) -> None:
    """An impossible ITL target under load: once traffic is recorded, every decision that
    moves a knob the simulator models says what the simulator predicted, and only predicted
    gains are taken; before, a decision says why it was not simulated."""
    d = make_daemon(
        admin=True,
        engine={"max_num_seqs": 8, "max_model_len": 512},
        autopilot={"enabled": False, "itl_p99_ms": 1.0, "simulate_first": True, "interval_s": 0.5,
                   "window_s": 1.0, "max_window_s": 5.0, "min_requests": 3,
                   "max_num_seqs_min": 2},
    )  # fmt: skip
    c = d.client(TOKEN)
    gen = loadgen(
        d.url, "--rate", "40", "--requests", "800", "--prompt-len", "8-32",
        "--output-len", "20-40", "--stream",
    )  # fmt: skip

    decisions: list[dict] = []

    def simulated() -> list[dict]:
        decisions[:] = c.get("/admin/autopilot").json()["decisions"]
        return [x for x in decisions if JUDGED.search(x["reason"])]

    try:
        # The simulator replays recorded rows: the autopilot starts once the store holds some.
        # (Started with the load, its first ticks came before any row on a loaded CI machine:
        # nothing to replay, so they moved max_num_seqs unsimulated, as documented, and the
        # load could end before a tick the simulator judged.)
        wait_rows(d.cfg.store_url, lambda rows: len(rows) >= 3, timeout=30)
        assert c.patch("/admin/autopilot", json={"enabled": True}).status_code == 200
        found = wait(simulated, 60, "a decision the simulator judged")
    finally:
        gen.kill()
        gen.wait()
    for x in decisions:
        if "not simulated" in x["reason"]:  # the first ticks, before rows were recorded
            assert re.search(r"\(not simulated: .+\)", x["reason"]), x
    for x in found:
        if x["applied"]:  # taken: the predicted ITL p99 fell by at least 2%
            m = re.search(r"\(simulated itl p99 ([\d,]+) -> ([\d,]+) ms\)", x["reason"])
            assert m is not None, x
            before, after = (float(g.replace(",", "")) for g in m.groups())
            assert after <= before * 0.98 + 0.5, x  # the figures are rounded to 1 ms
        else:  # vetoed: a hold naming the knob and what the simulator predicted
            assert x["knob"] is None and "no gain" in x["reason"], x
