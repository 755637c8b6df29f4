"""This daemon's row in the fleet table (`instances`): registration, heartbeat, stopped.

A plain asyncio loop rather than an APScheduler job: the heartbeat must run from the first
second (state loading), while the jobs start once the model is ready, and it must not queue
behind a long cost rollup on the jobs' single worker thread. SQL runs in a worker thread; a
database outage is one warning when it starts and one line when it ends, and never stops or
slows serving.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading
from datetime import UTC, datetime
from typing import TYPE_CHECKING

from controlplane import __version__
from controlplane.fleet import registry
from controlplane.runtime.state import DaemonState

if TYPE_CHECKING:
    from controlplane.runtime.runtime import Runtime

log = logging.getLogger("controlplane.fleet")


def figures(runtime: Runtime) -> registry.Heartbeat:
    """The runtime's state and the headline figures of /admin/stats (the same computation),
    the incident ones too: the oldest wait, the minute's TTFT p99 and `slo.met`."""
    admitting = (DaemonState.READY, DaemonState.DRAINING)  # else loading (or a dead loop)
    state = runtime.state.fleet_name if runtime.state in admitting else registry.LOADING
    config = runtime.live.live_values()
    if not runtime.engine.loaded:
        return registry.Heartbeat(state, config=config)
    stats = runtime.stats_payload()
    ttft = stats.get("ttft_p50_ms")
    met = (stats.get("slo") or {}).get("met")
    return registry.Heartbeat(
        state,
        model=stats.get("model"),
        quantization=(stats.get("memory") or {}).get("quantization"),
        num_running=stats["num_running"],
        num_waiting=stats["num_waiting"],
        kv_usage=stats["kv_usage_perc"] / 100,
        output_tokens_per_s=stats["decode_tokens_per_s"],
        ttft_p50_s=None if ttft is None else ttft / 1000,
        config=config,
        oldest_waiting_s=stats.get("oldest_waiting_s"),
        ttft_p99_ms=stats.get("ttft_p99_ms"),
        slo_met=met if isinstance(met, bool) else None,
    )


def default_advertise_url(host: str, port: int) -> str:
    """http://<host>:<port>, with the hostname when listening on every interface (0.0.0.0
    is no address to reach a daemon at)."""
    if host in ("0.0.0.0", "::", ""):
        host = socket.gethostname()
    elif ":" in host:
        host = f"[{host}]"  # an IPv6 literal
    return f"http://{host}:{port}"


class FleetMember:
    """Keeps `runtime.instance_id`'s row current while the daemon runs."""

    def __init__(self, runtime: Runtime, advertise_url: str) -> None:
        self.runtime = runtime
        self.advertise_url = advertise_url
        self._failing = False
        # A beat still in its thread when the daemon says stopped must not land after it.
        self._lock = threading.Lock()
        self._stopped = False

    def register(self) -> None:
        """Insert (or, after a restart with the same instance id, replace) the row."""
        registry.register(
            self.runtime.store.db,
            self.runtime.instance_id,
            advertise_url=self.advertise_url,
            hostname=socket.gethostname(),
            pid=os.getpid(),
            version=__version__,
            beat=figures(self.runtime),
            now=datetime.now(UTC),
        )

    def beat(self) -> None:
        beat = figures(self.runtime)
        with self._lock:
            if self._stopped or self.runtime.store.db is None:
                return
            now = datetime.now(UTC)
            if not registry.heartbeat(
                self.runtime.store.db, self.runtime.instance_id, beat, now=now
            ):
                self.register()  # the row was deleted by hand (or registration failed)

    async def beat_now(self) -> None:
        """One heartbeat, now (a state change); failures are logged once per outage."""
        try:
            await asyncio.to_thread(self.beat)
        except Exception as exc:
            if not self._failing:
                log.warning("fleet heartbeat failed (will retry every beat): %s", exc)
            self._failing = True
            return
        if self._failing:
            log.info("fleet heartbeat written again")
        self._failing = False

    async def run_forever(self) -> None:
        while True:
            await asyncio.sleep(self.runtime.cfg.fleet.heartbeat_s)  # read live each beat
            await self.beat_now()

    async def stopped(self) -> None:
        """A graceful exit says so, so readers show stopped rather than unreachable."""
        try:
            await asyncio.to_thread(self._say_stopped)
        except Exception as exc:
            log.warning("could not mark this instance stopped in the fleet table: %s", exc)

    def _say_stopped(self) -> None:
        beat = registry.Heartbeat(registry.STOPPED, num_running=0, num_waiting=0)
        with self._lock:
            self._stopped = True
            if self.runtime.store.db is not None:
                registry.heartbeat(
                    self.runtime.store.db, self.runtime.instance_id, beat, now=datetime.now(UTC)
                )
