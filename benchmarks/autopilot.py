"""The SLO autopilot on a load ramp, against fixed settings, in the same run.

What is measured
----------------
One daemon (``python -m controlplane serve``, SQLite, SmolLM2 by default) gets the same seeded
ramp of streaming completions several times: Poisson arrivals at the rates of ``--phases``
(default ``0.3:60,1.2:60,0.3:60``: requests/s for seconds, low -> high -> low), prompts of
``--prompt-len`` random token ids, ``--output-len`` output tokens (EOS ignored). Runs:

* ``default``: the engine's default knobs, fixed;
* each setting of ``--grid`` (``;``-separated, each ``knob=value,knob=value``), fixed: a small
  grid search over the knobs the autopilot moves (batch size and prefill chunk), the rest at
  their defaults;
* ``autopilot``: from the defaults, with ``[autopilot]`` on (interval ``--interval`` s).

For each: goodput (requests that met both targets per second of the run, from the first send
to the last answer), SLO attainment (the fraction that met both, and each), TTFT and ITL p99.
A request meets the ITL target when its own p99 gap between content chunks does (the
autopilot's definition). The targets are ``--ttft-ms`` / ``--itl-ms``. For the autopilot run
also: its changes per phase and how often a knob reversed direction inside a phase
(oscillation). Targets of the issue: autopilot goodput within 5% of the best fixed setting and
at least 1.3x the default's, no oscillation in the steady phases.

Figures to read, never timed assertions: the load generator runs on the daemon's CPUs.

How to run
----------
    python -m benchmarks.autopilot                            # ~20 minutes on 2 cores
    python -m benchmarks.autopilot --phases 0.5:20,2:20,0.5:20 --grid max_num_seqs=4  # smoke
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from controlplane.common import percentile
from harness import DaemonProcess, write_config

TOKEN = "autopilot-bench-token-0123456789"


def start(workdir: Path, model: str) -> DaemonProcess:
    """The daemon on `model`, with an admin token; returns once it is ready."""
    cfg = write_config(
        workdir / "config.toml",
        workdir / "data",
        model,
        server={"max_queue_len": 4096},
        admin_tokens=[{"name": "bench", "token": TOKEN}],
    )
    return DaemonProcess.start(cfg, timeout=300)


def parse_phases(text: str) -> list[tuple[float, float]]:
    phases = []
    for part in text.split(","):
        rate, _, seconds = part.partition(":")
        phases.append((float(rate), float(seconds)))
    return phases


def schedule(phases: list[tuple[float, float]], seed: int) -> list[tuple[float, int]]:
    """(send offset, phase index) of every request: Poisson within each phase."""
    rng = random.Random(seed)
    out, t0 = [], 0.0
    for i, (rate, seconds) in enumerate(phases):
        t = t0 + rng.expovariate(rate)
        while t < t0 + seconds:
            out.append((t, i))
            t += rng.expovariate(rate)
        t0 += seconds
    return out


async def one(client: Any, model: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    t0 = time.perf_counter()
    times: list[float] = []
    stream = await client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].text:
            times.append(time.perf_counter())
    gaps = [b - a for a, b in itertools.pairwise(times)]
    return {
        "ttft_s": times[0] - t0 if times else None,
        "itl_p99_s": percentile(gaps, 99) if gaps else None,
        "gaps": gaps,
        "end": time.perf_counter(),
    }


async def ramp(url: str, model: str, args: argparse.Namespace) -> tuple[list[dict], float]:
    import openai

    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=900)
    rng = random.Random(args.seed)
    plan = schedule(parse_phases(args.phases), args.seed)
    lo, hi = map(int, args.prompt_len.split("-"))
    olo, ohi = map(int, args.output_len.split("-"))
    specs = [
        ([rng.randrange(3, 20000) for _ in range(rng.randint(lo, hi))], rng.randint(olo, ohi))
        for _ in plan
    ]
    start = time.perf_counter()

    async def send(i: int) -> dict[str, Any]:
        offset, phase = plan[i]
        await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
        res = await one(client, model, *specs[i])
        res.update(phase=phase, sent=offset)
        return res

    try:
        results = await asyncio.gather(*(send(i) for i in range(len(plan))))
    finally:
        await client.close()
    return results, max(r["end"] for r in results) - start


def score(results: list[dict], wall: float, ttft_ms: float, itl_ms: float) -> dict[str, Any]:
    def ok_ttft(r: dict) -> bool:
        return r["ttft_s"] is not None and r["ttft_s"] * 1000 <= ttft_ms

    def ok_itl(r: dict) -> bool:
        return r["itl_p99_s"] is None or r["itl_p99_s"] * 1000 <= itl_ms

    good = [r for r in results if ok_ttft(r) and ok_itl(r)]
    ttfts = [r["ttft_s"] for r in results if r["ttft_s"] is not None]
    gaps = [g for r in results for g in r["gaps"]]
    return {
        "requests": len(results),
        "wall_s": round(wall, 1),
        "goodput_rps": len(good) / wall,
        "attainment": len(good) / len(results),
        "ttft_attainment": sum(map(ok_ttft, results)) / len(results),
        "itl_attainment": sum(map(ok_itl, results)) / len(results),
        "ttft_p99_ms": 1000 * percentile(ttfts, 99) if ttfts else None,
        "itl_p99_ms": 1000 * percentile(gaps, 99) if gaps else None,
    }


def oscillation(decisions: list[dict], bounds: list[float]) -> dict[str, Any]:
    """Changes per phase, direction reversals of a knob inside one phase, and each phase's
    settling time: seconds from the phase's start to its last change (0: none)."""
    # This run's changes only (the daemon keeps earlier runs' decisions), by the phase whose
    # time span holds them (bounds: the phases' start times, then the end).
    changes = [d for d in reversed(decisions) if d.get("applied") and d["time"] >= bounds[0]]
    t0 = changes[0]["time"] - 1 if changes else 0
    per_phase: dict[int, list[dict]] = {}
    for d in changes:
        phase = sum(d["time"] >= b for b in bounds[1:-1])
        per_phase.setdefault(phase, []).append(d)
    reversals = 0
    for ds in per_phase.values():
        last: dict[str, str] = {}
        for d in ds:
            if d["knob"] in last and last[d["knob"]] != d["direction"]:
                reversals += 1
            last[d["knob"]] = d["direction"]
    return {
        "changes_per_phase": {k: len(v) for k, v in sorted(per_phase.items())},
        "settle_s_per_phase": {
            k: round(max(d["time"] for d in v) - bounds[k], 1) for k, v in sorted(per_phase.items())
        },
        "reversals_within_phases": reversals,
        "changes": [f"{d['reason']}" for d in changes],
        "first_change_at": t0,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--phases", default="0.3:60,1.2:60,0.3:60", help="rate:seconds,...")
    p.add_argument(
        "--grid",
        default="max_num_seqs=8;prefill_chunk_size=64;max_num_seqs=8,prefill_chunk_size=64;"
        "max_num_seqs=16,prefill_chunk_size=128",
        help="fixed settings to try: knob=value[,knob=value][;...]",
    )
    p.add_argument("--ttft-ms", type=float, default=5000.0)
    p.add_argument("--itl-ms", type=float, default=200.0)
    p.add_argument("--interval", type=float, default=5.0, help="autopilot.interval_s")
    p.add_argument("--prompt-len", default="64-256")
    p.add_argument("--output-len", default="32-96")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path)
    p.add_argument(
        "--simulate-first",
        action="store_true",
        help="add a run of the autopilot with autopilot.simulate_first (each step simulated "
        "on the last window of traffic before it is taken)",
    )
    args = p.parse_args()

    with tempfile.TemporaryDirectory(prefix="autopilot-") as tmp:
        d = start(Path(tmp), args.model)
        admin = httpx.Client(
            base_url=d.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=60
        )
        try:
            # The decode step compiles in the background after start: the first run must not
            # pay for it (a run of 2026-11-30 did: ITL p99 541 ms for the defaults, 15 ms once
            # compiled).
            deadline = time.time() + 900
            while admin.get("/admin/stats").json().get("compiled_step") == "warming":
                if time.time() > deadline:
                    raise SystemExit("the decode step was still compiling after 900 s")
                time.sleep(2)
            model = httpx.get(d.url + "/v1/models", timeout=30).json()["data"][0]["id"]
            defaults = {
                k: v["value"]
                for k, v in admin.get("/admin/config").json()["fields"].items()
                if k
                in (
                    "engine.max_num_seqs",
                    "engine.max_num_batched_tokens",
                    "engine.prefill_chunk_size",
                )
            }
            # Operator changes between runs must not pin the knobs for the autopilot run.
            admin.patch("/admin/autopilot", json={"operator_hold_s": 0}).raise_for_status()
            runs = [("default", {})]
            for setting in filter(None, args.grid.split(";")):  # --grid "": no fixed grid
                pairs = dict(kv.split("=") for kv in setting.split(","))
                runs.append((setting, {f"engine.{k}": int(v) for k, v in pairs.items()}))
            runs.append(("autopilot", {}))
            if args.simulate_first:
                runs.append(("autopilot+simulate_first", {}))
            report: dict[str, Any] = {"args": vars(args) | {"json": str(args.json)}, "runs": {}}
            for name, settings in runs:
                admin.patch("/admin/autopilot", json={"enabled": False}).raise_for_status()
                admin.patch("/admin/config", json={**defaults, **settings}).raise_for_status()
                admin.post("/admin/cache/reset").raise_for_status()
                piloted = name.startswith("autopilot")
                if piloted:
                    admin.patch(
                        "/admin/autopilot",
                        json={
                            "enabled": True,
                            "ttft_p99_ms": args.ttft_ms,
                            "itl_p99_ms": args.itl_ms,
                            "interval_s": args.interval,
                            "window_s": 2 * args.interval,
                            "min_requests": 8,
                            "simulate_first": name == "autopilot+simulate_first",
                        },
                    ).raise_for_status()
                began = time.time()
                print(f"{name}: running the ramp ({args.phases}) ...", flush=True)
                results, wall = asyncio.run(ramp(d.url, model, args))
                row = score(results, wall, args.ttft_ms, args.itl_ms)
                # Per request, so other targets can be scored from the same run (--json).
                row["per_request"] = [[r["phase"], r["ttft_s"], r["itl_p99_s"]] for r in results]
                if piloted:
                    state = admin.get("/admin/autopilot").json()
                    edges = [began]
                    for _, seconds in parse_phases(args.phases):
                        edges.append(edges[-1] + seconds)
                    row["oscillation"] = oscillation(state["decisions"], edges)
                    row["final_knobs"] = {
                        k: v["value"]
                        for k, v in admin.get("/admin/config").json()["fields"].items()
                        if k in defaults
                    }
                report["runs"][name] = row
                shown = {k: v for k, v in row.items() if k != "per_request"}
                print(f"{name}: {json.dumps(shown)}", flush=True)
        finally:
            admin.close()
            d.stop(timeout=120, check=False)

    fixed = {k: v for k, v in report["runs"].items() if not k.startswith("autopilot")}
    best_name = max(fixed, key=lambda k: fixed[k]["goodput_rps"])
    best, base = fixed[best_name]["goodput_rps"], fixed["default"]["goodput_rps"]
    auto = report["runs"]["autopilot"]
    print(
        f"\n== SLO autopilot on a ramp ({args.phases} req/s:s), targets TTFT p99 "
        f"<= {args.ttft_ms:g} ms, ITL p99 <= {args.itl_ms:g} ms =="
    )
    for name, row in report["runs"].items():
        print(
            f"{name:>40}: goodput {row['goodput_rps']:.3f} req/s, attainment "
            f"{row['attainment']:.0%} (TTFT {row['ttft_attainment']:.0%}, ITL "
            f"{row['itl_attainment']:.0%}), TTFT p99 {row['ttft_p99_ms']:.0f} ms, "
            f"ITL p99 {row['itl_p99_ms']:.0f} ms"
        )
    print(
        f"autopilot / best fixed ({best_name}): {auto['goodput_rps'] / best:.3f} (target >= 0.95)"
        if best
        else "no fixed setting had goodput"
    )
    print(
        f"autopilot / default: {auto['goodput_rps'] / base:.2f}x (target >= 1.3x)"
        if base
        else "default goodput 0: ratio undefined"
    )
    for name, row in report["runs"].items():
        if not name.startswith("autopilot"):
            continue
        osc = row["oscillation"]
        print(
            f"{name}: changes per phase {osc['changes_per_phase']}, settling s per phase "
            f"{osc['settle_s_per_phase']}, direction reversals inside a phase "
            f"{osc['reversals_within_phases']}, final {row['final_knobs']}"
        )
    sim = report["runs"].get("autopilot+simulate_first")
    if sim is not None and auto["goodput_rps"]:
        print(f"simulate_first / autopilot goodput: {sim['goodput_rps'] / auto['goodput_rps']:.3f}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
