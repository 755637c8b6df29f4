"""What the dashboard's tests share: the screen as text, waiting under the pilot, and a fake
daemon (fixed payloads with AdminClient's async methods) for the snapshots and the other
deterministic tests."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from controlplane.client.admin import APIError
from controlplane.tui.dashboard_app import DashboardApp


def screen_text(app: DashboardApp) -> str:
    strips = app.screen._compositor.render_strips()
    return "\n".join("".join(seg.text for seg in strip) for strip in strips)


async def wait_until(
    pilot: Any, cond: Callable[[], Any], timeout: float = 15, what: str = ""
) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or cond}:\n{screen_text(pilot.app)}")
        await pilot.pause(0.05)


T0 = 1_795_000_000.0


def fake_stats(i: int) -> dict[str, Any]:
    return {
        "state": "ready",
        "model": "tiny-llama",
        "uptime_s": 3723.0 + i,
        "time": T0 + i,
        "num_running": 6,
        "num_waiting": 3,
        "num_swapped": 0,
        "queue_length": 3 * i,
        "kv_blocks_used": 412,
        "kv_blocks_total": 1024,
        "kv_usage_perc": 40.2,
        "num_preemptions": 2 * i // 10,
        "num_finished": 3 * i,
        "step": 1000 + i,
        "batch_fill_seqs": 0.75,
        "batch_fill_tokens": 0.41,
        "steps_in_window": 200,
        "step_time_p50_ms": 11.5,
        "step_time_p99_ms": 27.25,
        "preemptions_in_window": 1,
        "prefill_tokens_per_s": 800 + 300 * ((i * 7) % 11),
        "decode_tokens_per_s": 1500 + 40 * ((i * 5) % 13),
        "enable_prefix_caching": True,
        "prefix_cache_hit_rate": 0.62,
        "kv_blocks_cached": 180,
        "kv_blocks_evictable": 96,
        "speculative_method": "ngram",
        "speculative_num_tokens": 3,
        "speculation": "active",
        "spec_acceptance_rate": 0.71,
        "spec_mean_accepted_len": 3.13,
        "requests_in_flight": 9,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 2048,
        "max_queue_len": 256,
        "autopilot": {"state": "holding", "ttft_p99_ms": 2000.0, "itl_p99_ms": 80.0},
        # The incident signals (an overload building up over the snapshots).
        "arrivals_per_s": 6.0,
        "completions_per_s": 4.1,
        "best_completion_rate_per_s": 4.3,
        "rejected_per_s": 1.2,
        "rejected_429_per_s": 1.2,
        "rejected_503_per_s": 0.0,
        "failed_per_s": 0.0,
        "oldest_waiting_s": 0.7 * i,
        "prefill_step_p50_ms": 48.0,
        "decode_step_p50_ms": 11.0,
        "ttft_p50_ms": 950.0,
        "ttft_p99_ms": 1500.0 + 40 * i,
        "ttft_p99_10s_ms": 1800.0 + 40 * i,
        "itl_p50_ms": 12.0,
        "itl_p99_ms": 41.0,
        "itl_p99_10s_ms": 66.0,
        "slo": {
            "ttft_p99_ms": 2000.0,
            "itl_p99_ms": 80.0,
            "source": "autopilot",
            "attainment": 0.93,
            "met": 1500.0 + 40 * i <= 2000.0,
        },
        "thresholds": {
            "ttft_p99_ms": {"warn": 1600.0, "crit": 2000.0},
            "itl_p99_ms": {"warn": 64.0, "crit": 80.0},
            "kv_usage_perc": {"warn": 85.0, "crit": 97.0},
            "queue_fill": {"warn": 0.5, "crit": 0.9},
            "rejected_per_s": {"warn": 0.1, "crit": 1.0},
            "failed_per_s": {"warn": 0.01, "crit": 0.5},
            "heartbeat_age_s": {"warn": 10.0, "crit": 30.0},
        },
        "diagnosis": {
            "code": "overloaded",
            "message": "overloaded: 6.0 req/s arriving, at most 4.3 req/s completed in 15 min: "
            "shed load (server.max_queue_len) or add instances; retuning cannot fix it",
            "knob": "server.max_queue_len",
        },
        "memory": {
            "weights_bytes": 142_606_336,
            "kv_cache_bytes": 1 << 30,
            "kv_cache_blocks": 1024,
            "quantization": "int8",
            "dtype": "float32",
            "kv_cache_dtype": "int8",
        },
    }


class FakeClient:
    """Fixed payloads with AdminClient's async methods; for the snapshots only."""

    async def aclose(self) -> None:
        pass

    async def events(self, interval: float = 0.5):
        for i in range(60):
            yield "stats", fake_stats(i * 5)
        await asyncio.Event().wait()

    async def config(self) -> dict[str, Any]:
        def f(value: Any, source: str = "default") -> dict[str, Any]:
            return {"value": value, "source": source, "live": True}

        return {
            "fields": {
                "engine.max_num_seqs": f(8, "tui"),
                "engine.max_num_batched_tokens": f(2048),
                "engine.prefill_chunk_size": f(512),
                "engine.preemption_mode": f("recompute"),
                "engine.speculative_method": f("ngram", "api"),
                "engine.speculative_num_tokens": f(3),
                "engine.speculative_max_batch_size": f(8),
                "engine.enable_prefix_caching": f(True),
                "autopilot.ttft_p99_ms": f(2000.0, "api"),
                "autopilot.itl_p99_ms": f(80.0, "api"),
            }
        }

    async def simulate(self, body: dict[str, Any], window_s: float = 900.0) -> dict[str, Any]:
        # What a daemon with no recent traffic answers (the tuning form says it and goes on).
        raise APIError(409, "no request rows arrived in the window: nothing to replay")

    async def history(self, limit: int = 50) -> dict[str, Any]:
        def e(i: int, t: str, src: str, actor: Any, field: str, old: Any, new: Any) -> dict:
            return dict(
                id=i, time=t, source=src, actor=actor, field=field, old_value=old, new_value=new
            )

        return {
            "changes": [
                e(2, "2026-11-18T09:41:05+00:00", "tui", "ops", "engine.max_num_seqs", 16, 8),
                e(1, "2026-11-18T09:30:00+00:00", "file", None, "server.max_queue_len", 128, 256),
            ]
        }

    async def block_map(self, buckets: int = 48) -> tuple[list[float], list[float]]:
        used = [((i * 7) % 9) / 8 for i in range(buckets)]
        return used, [(1 - u) * (i % 3) / 2 for i, u in enumerate(used)]

    async def requests(self) -> dict[str, Any]:
        live = [
            {
                "id": f"cmpl-{i:04x}",
                "state": "running" if i < 6 else "waiting",
                "api_key_name": ["alice", "bob", None][i % 3],
                "end_user": ["u1", None][i % 2],
                "age_s": 1.5 * (9 - i),
                "prompt_tokens": 20 + 7 * i,
                "output_tokens": 100 - 9 * i,
                "preemptions": 0,
                "endpoint": "completions",
            }
            for i in range(9)
        ]
        return {"live": live, "finished": [], "next_cursor": None}

    async def costs(
        self, since: str = "1h", group_by: str = "model", scope: str | None = None, until=None
    ) -> dict[str, Any]:
        if until is not None:  # the last whole hour: $ per 1M tokens
            totals = {"list_usd_per_mtok_completion": 0.6, "gpu_usd_per_mtok": 0.0412}
            return {"columns": ["model", *totals], "rows": [], "totals": totals, "empty": False}
        names = {"api_key": ["alice", "bob", None], "model": ["tiny-llama"], "end_user": ["u1"]}
        rows = [
            {group_by: name, "requests": 10 + i, "list_usd": 0.0125 / (i + 1)}
            for i, name in enumerate(names[group_by])
        ]
        total = {"requests": sum(r["requests"] for r in rows)}
        total["list_usd"] = sum(r["list_usd"] for r in rows)
        return {"columns": [group_by, "requests", "list_usd"], "rows": rows, "totals": total}

    async def utilization(self, since: str = "1h") -> dict[str, Any]:
        totals = {"mean_busy_fraction": 0.63, "mean_kv_usage": 0.38, "mean_gpu_power_w": None}
        return {"columns": ["hour", *totals], "rows": [], "totals": totals, "empty": False}


def fake_app() -> DashboardApp:
    return DashboardApp("http://127.0.0.1:8000", "token", client=FakeClient(), clock=lambda: T0)


async def loaded(pilot: Any) -> None:
    app = pilot.app
    await wait_until(
        pilot,
        lambda: (
            app.dashboard.stats_received == 60
            and app.dashboard.changes
            and app.dashboard.costs
            and app.dashboard.util
        ),
        10,
        "fake data",
    )
    await pilot.pause(0.1)
