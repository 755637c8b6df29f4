"""The SLO figures and severity thresholds of ``GET /admin/stats`` (pure functions).

The latency targets are the autopilot's when it has any (autopilot.ttft_p99_ms /
itl_p99_ms, 0: none), else the critical values of [alerts]. The thresholds are [alerts], but
a latency the autopilot targets at T reads as a warning from 0.8 x T and critical from T.
"""

from __future__ import annotations

from collections.abc import Sequence
from statistics import fmean
from typing import Any, Protocol

from controlplane.config import AlertsSettings, AutopilotSettings


class Finished(Protocol):
    """What the SLO reads of a finished request (the runtime ledger's records have it)."""

    ttft: float | None
    gaps: list[float]


AUTOPILOT_WARN = 0.8  # warn at this share of an autopilot target


def thresholds(alerts: AlertsSettings, autopilot: AutopilotSettings) -> dict[str, dict[str, float]]:
    """{"<figure>": {"warn", "crit"}} for every figure of [alerts], the autopilot's targets
    applied."""
    out = {name: {"warn": w, "crit": c} for name, (w, c) in alerts.pairs().items()}
    for name in ("ttft_p99_ms", "itl_p99_ms"):
        target = getattr(autopilot, name)
        if target:
            out[name] = {"warn": round(AUTOPILOT_WARN * target, 3), "crit": target}
    return out


def slo(
    alerts: AlertsSettings,
    autopilot: AutopilotSettings,
    finished: Sequence[Finished],
    ttft_p99_ms: float | None,
    itl_p99_ms: float | None,
) -> dict[str, Any]:
    """The targets, their source, and over `finished` (the last minute's requests):

    - ``attainment``: the share of the finished requests that had a first token whose TTFT
      and mean inter-token gap met every target (None: none had a first token);
    - ``met``: the minute's p99s (`ttft_p99_ms`, `itl_p99_ms`) are within their targets
      (None: no p99 for any target)."""
    if autopilot.ttft_p99_ms or autopilot.itl_p99_ms:
        source = "autopilot"
        ttft_t, itl_t = autopilot.ttft_p99_ms or None, autopilot.itl_p99_ms or None
    else:
        source = "thresholds"
        ttft_t, itl_t = alerts.ttft_p99_ms_crit, alerts.itl_p99_ms_crit
    timed = [f for f in finished if f.ttft is not None]
    attainment = None
    if timed:
        good = 0
        for f in timed:
            ok = ttft_t is None or 1000 * f.ttft <= ttft_t  # type: ignore[operator]
            ok = ok and (itl_t is None or not f.gaps or 1000 * fmean(f.gaps) <= itl_t)
            good += ok
        attainment = round(good / len(timed), 4)
    checks = [
        p99 <= target
        for p99, target in ((ttft_p99_ms, ttft_t), (itl_p99_ms, itl_t))
        if p99 is not None and target is not None
    ]
    return {
        "ttft_p99_ms": ttft_t,
        "itl_p99_ms": itl_t,
        "source": source,
        "attainment": attainment,
        "met": all(checks) if checks else None,
    }
