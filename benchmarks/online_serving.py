"""Online serving: the daemon under Poisson load, with SQL request recording (and its crash
journal) on and off.

What is measured
----------------
For every combination of arrival rate (``--rates``, default 2 and 6 req/s) and recording mode
(``--modes``, default all three: ``journal`` = ``[store] record_requests = true, journal = true``,
the default; ``sql`` = recording without the journal, ``journal = false``; ``off`` =
``record_requests = false``), a fresh daemon is started as a subprocess,

    python -m controlplane serve --config CFG

with CFG a temporary TOML file (written by ``harness.write_config``: port 0, the daemon picks a
free one; a fresh ``data_dir`` per daemon, so every run starts with an empty database;
``[engine]`` model = the ``small`` demo model, ``dtype = "auto"``, ``max_num_seqs = 16``). Once
it is ready (``GET /health/ready`` answers 200) a few warmup requests are sent (not measured),
then ``controlplane.client.loadgen.run_load`` drives it: ``--requests`` (64) streaming completions, prompts of
``--prompt-len`` (32-256) random token ids, ``--output-len`` (16-128) tokens with EOS ignored,
Poisson arrivals at the rate, workload seed ``--seed + repeat`` (the same for every mode). The
daemon is then stopped with SIGTERM. Combinations are interleaved within each repeat (the order
of the modes rotates between rates and repeats) and the whole set runs ``--repeats`` (2) times;
medians over the repeats are reported.

Figures, per combination: output tokens/s (completion tokens from ``usage`` / wall time from the
first send to the last completion), requests/s, TTFT p50/p99, ITL p50/p99 (gaps between streamed
chunks) and failed requests. Per rate: the **recording overhead** of each recording mode = 1 -
(tok/s of the mode / tok/s with ``off``), target < 2%, and the journal's own cost = 1 - (tok/s
``journal`` / tok/s ``sql``). Below saturation the output throughput follows the offered load
(rate x mean output length, printed as ``offered``), so a throughput overhead near 0 there says
little; the ITL p50 ratio is printed beside it for that reason.

Before the runs, the journal's cost per record is also timed in-process, where it is not lost in
the noise: ``Recorder.submit`` of ``--submit-records`` records into a SQLite file, with and
without the journal (microseconds per record, median of 5).

These are figures to read, never timed assertions: the machine is shared and noisy; the
daemon and this load generator share its CPUs.

How to run
----------
    python -m benchmarks.online_serving                      # 2 rates x 2 x 2 repeats
    python -m benchmarks.online_serving --rates 4 --repeats 1 --requests 16    # smoke run
    python -m benchmarks.online_serving --json /tmp/online.json

from the repository root.

The model directory ``.bench/small`` (repo root) is written on first use with
``controlplane.engine.demo_model.write_demo_model(path, size="small")``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from controlplane.client.loadgen import LoadConfig, LoadSummary, parse_range, run_load
from harness import REPO_ROOT, DaemonError, DaemonProcess, write_config

DEFAULT_MODEL_DIR = REPO_ROOT / ".bench" / "small"
TARGET_OVERHEAD = 0.02
MODES = ("journal", "sql", "off")


def log(msg: str) -> None:
    print(msg, flush=True)


# --------------------------------------------------------------------------------------------- #
# The daemon
# --------------------------------------------------------------------------------------------- #


def start_daemon(
    workdir: Path, mode: str, model_dir: Path, args: argparse.Namespace
) -> DaemonProcess:
    """A daemon on a fresh data dir, its output in <workdir>/daemon.log; returns once ready."""
    cfg = write_config(
        workdir / "config.toml",
        workdir / "data",
        model_dir,
        store={"record_requests": mode != "off", "journal": mode == "journal"},
        engine={"dtype": args.dtype, "max_num_seqs": args.max_num_seqs},
    )
    return DaemonProcess.start(cfg, timeout=args.startup_timeout)


# --------------------------------------------------------------------------------------------- #
# One run
# --------------------------------------------------------------------------------------------- #


@dataclass
class Run:
    rate: float
    mode: str  # journal | sql | off
    repeat: int
    startup_s: float = 0.0
    daemon_exit_code: int | None = None
    db_bytes: int | None = None
    summary: dict[str, Any] = field(default_factory=dict)

    def metric(self, name: str) -> float | None:
        s = self.summary
        if name in ("output_throughput", "request_throughput", "requests_failed"):
            return s.get(name)
        stat, _, q = name.rpartition("_")  # e.g. "ttft_ms_p50"
        block = s.get(stat)
        return None if block is None else block.get(q)


METRICS = (
    "output_throughput",
    "request_throughput",
    "ttft_ms_p50",
    "ttft_ms_p99",
    "itl_ms_p50",
    "itl_ms_p99",
    "e2e_ms_p50",
    "e2e_ms_p99",
    "requests_failed",
)


def run_one(rate: float, mode: str, repeat: int, model_dir: Path, args: argparse.Namespace) -> Run:
    run = Run(rate=rate, mode=mode, repeat=repeat)
    with tempfile.TemporaryDirectory(prefix="cp-online-") as tmp:
        t0 = time.perf_counter()
        daemon = start_daemon(Path(tmp), mode, model_dir, args)
        run.startup_s = time.perf_counter() - t0
        try:
            common = dict(url=daemon.url, stream=True, seed=args.seed + repeat)
            if args.warmup:
                asyncio.run(
                    run_load(
                        LoadConfig(
                            **common,
                            rate=math.inf,
                            num_requests=args.warmup,
                            prompt_len=args.prompt_len,
                            output_len=(4, 8),
                        )
                    )
                )
            summary: LoadSummary = asyncio.run(
                run_load(
                    LoadConfig(
                        **common,
                        rate=rate,
                        num_requests=args.requests,
                        prompt_len=args.prompt_len,
                        output_len=args.output_len,
                    )
                )
            )
            run.summary = summary.to_dict()
        finally:
            run.daemon_exit_code = daemon.stop(timeout=args.stop_timeout, check=False)
            if run.daemon_exit_code is None:
                log(f"  daemon ignored SIGTERM for {args.stop_timeout:g}s: killed it")
        db = Path(tmp) / "data" / "controlplane.db"
        run.db_bytes = db.stat().st_size if db.exists() else None
        if run.daemon_exit_code != 0:
            log(
                f"  note: daemon exit code {run.daemon_exit_code}; log tail:\n{daemon.log_tail(20)}"
            )
    return run


# --------------------------------------------------------------------------------------------- #
# Report
# --------------------------------------------------------------------------------------------- #


def _median(values: list[float | None]) -> float | None:
    xs = [v for v in values if v is not None]
    return statistics.median(xs) if xs else None


def _fmt(v: float | None, spec: str = ".1f") -> str:
    return "n/a" if v is None else format(v, spec)


def _overhead(mine: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """1 - tok/s(mine) / tok/s(base), and the ITL p50 ratio mine / base."""
    overhead = itl_ratio = None
    if mine["output_throughput"] and base["output_throughput"]:
        overhead = 1 - mine["output_throughput"] / base["output_throughput"]
    if mine["itl_ms_p50"] and base["itl_ms_p50"]:
        itl_ratio = mine["itl_ms_p50"] / base["itl_ms_p50"]
    return {"overhead": overhead, "itl_p50_ratio": itl_ratio}


def report(runs: list[Run], args: argparse.Namespace) -> dict[str, Any]:
    mean_out = (args.output_len[0] + args.output_len[1]) / 2
    combos: list[dict[str, Any]] = []
    for rate in args.rates:
        for mode in args.modes:
            mine = [r for r in runs if r.rate == rate and r.mode == mode]
            med = {m: _median([r.metric(m) for r in mine]) for m in METRICS}
            combos.append({"rate": rate, "mode": mode, "medians": med})

    header = (
        f"{'rate':>5} {'recording':>9} {'offered':>8} {'tok/s':>8} {'req/s':>6} "
        f"{'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8} {'failed':>6}"
    )
    log("\n" + header)
    log("-" * len(header))
    for c in combos:
        m = c["medians"]
        log(
            f"{c['rate']:>5g} {c['mode']:>9} "
            f"{c['rate'] * mean_out:>8.0f} {_fmt(m['output_throughput']):>8} "
            f"{_fmt(m['request_throughput'], '.2f'):>6} {_fmt(m['ttft_ms_p50']):>9} "
            f"{_fmt(m['ttft_ms_p99']):>9} {_fmt(m['itl_ms_p50']):>8} {_fmt(m['itl_ms_p99']):>8} "
            f"{_fmt(m['requests_failed'], '.0f'):>6}"
        )
    log("(medians over repeats; latencies in ms; offered = rate x mean output length, tok/s)")

    # (mode, baseline) pairs: recording against no recording, and the journal against SQL alone.
    pairs = [(m, "off") for m in ("journal", "sql") if m in args.modes and "off" in args.modes]
    if "journal" in args.modes and "sql" in args.modes:
        pairs.append(("journal", "sql"))
    overheads: list[dict[str, Any]] = []
    log(f"\noverhead = 1 - tok/s(mode) / tok/s(baseline); recording target < {TARGET_OVERHEAD:.0%}")
    for rate in args.rates:
        med = {c["mode"]: c["medians"] for c in combos if c["rate"] == rate}
        for mode, base in pairs:
            o = _overhead(med[mode], med[base])
            verdict = (
                "n/a"
                if o["overhead"] is None
                else ("ok" if o["overhead"] < TARGET_OVERHEAD else "ABOVE TARGET")
            )
            pct = None if o["overhead"] is None else o["overhead"] * 100
            log(
                f"  rate {rate:g}: {mode} vs {base}: {_fmt(pct, '+.2f')}% ({verdict}), "
                f"ITL p50 ratio {_fmt(o['itl_p50_ratio'], '.3f')}"
            )
            overheads.append(
                {"rate": rate, "mode": mode, "baseline": base, **o, "verdict": verdict}
            )
    return {"combinations": combos, "overhead": overheads}


def measure_submit_cost(records: int, repeats: int = 5) -> dict[str, float]:
    """Microseconds per `Recorder.submit` (median of `repeats`), without and with the journal:
    the journal's cost where it is not lost in the noise of a serving run."""
    from datetime import UTC, datetime

    from controlplane.config import StoreSettings
    from controlplane.store import Recorder, RequestRecord, upgrade

    def one(tmp: Path, journal: bool, rep: int) -> float:
        url = f"sqlite:///{tmp / f'{journal}-{rep}.db'}"
        upgrade(url)
        settings = StoreSettings(buffer_max_records=10 * records)
        rec = Recorder(url, settings, journal_dir=tmp / f"journal-{rep}" if journal else None)
        now = datetime.now(UTC)
        recs = [
            RequestRecord(
                id=f"cmpl-{rep}-{i:08d}{'0' * 24}",
                instance_id="cp-bench",
                model="demo-small",
                endpoint="completions",
                status="running" if i % 2 == 0 else "success",
                arrival_time=now,
                api_key_hash="0" * 64,
                prompt_tokens=100,
                completion_tokens=0 if i % 2 == 0 else 64,
            )
            for i in range(records)
        ]
        t0 = time.perf_counter()
        for r in recs:
            rec.submit(r)
        elapsed = time.perf_counter() - t0
        rec.close(60)
        return elapsed / records * 1e6

    out: dict[str, float] = {}
    with tempfile.TemporaryDirectory(prefix="cp-submit-") as tmp:
        for journal in (False, True):
            key = "journal" if journal else "sql"
            out[key] = statistics.median(one(Path(tmp), journal, rep) for rep in range(repeats))
    log(
        f"Recorder.submit: {out['sql']:.2f} us/record without the journal, {out['journal']:.2f} "
        f"us/record with it (+{out['journal'] - out['sql']:.2f} us; {records} records, median of "
        f"{repeats})"
    )
    return out


# --------------------------------------------------------------------------------------------- #
# Main
# --------------------------------------------------------------------------------------------- #


def _range(flag: str):
    def parse(text: str) -> tuple[int, int]:
        try:
            return parse_range(text, flag)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc).split(": ", 1)[1]) from None

    return parse


def _rates(text: str) -> list[float]:
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated req/s, got {text!r}") from None
    if not rates or any(not (r > 0 and math.isfinite(r)) for r in rates):
        raise argparse.ArgumentTypeError(f"expected finite rates > 0, got {text!r}")
    return rates


def _modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes) or len(set(modes)) != len(modes):
        raise argparse.ArgumentTypeError(f"expected distinct modes among {MODES}, got {text!r}")
    return modes


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--rates", type=_rates, default="2,6", help="comma-separated arrival rates, req/s"
    )
    p.add_argument(
        "--modes",
        type=_modes,
        default="journal,sql,off",
        help="recording modes to compare: journal (the default config), sql (no journal), off",
    )
    p.add_argument(
        "--submit-records",
        type=int,
        default=20000,
        help="records for the in-process Recorder.submit timing (0: skip it)",
    )
    p.add_argument("--repeats", type=int, default=2, help="repeats of the whole set (medians)")
    p.add_argument("--requests", type=int, default=64, help="measured requests per run")
    p.add_argument(
        "--prompt-len",
        type=_range("--prompt-len"),
        default="32-256",
        metavar="A-B",
        help="prompt tokens",
    )
    p.add_argument(
        "--output-len",
        type=_range("--output-len"),
        default="16-128",
        metavar="C-D",
        help="output tokens, EOS ignored",
    )
    p.add_argument("--seed", type=int, default=0, help="workload seed of repeat r is seed + r")
    p.add_argument("--warmup", type=int, default=4, help="unmeasured requests after startup")
    p.add_argument(
        "--model-dir",
        type=Path,
        default=DEFAULT_MODEL_DIR,
        help="small demo model, written if missing",
    )
    p.add_argument(
        "--dtype", default="auto", help="[engine] dtype (auto: bf16 only with native bf16)"
    )
    p.add_argument("--max-num-seqs", type=int, default=16, help="[engine] max_num_seqs")
    p.add_argument("--startup-timeout", type=float, default=300.0, help="seconds for /health/ready")
    p.add_argument("--stop-timeout", type=float, default=60.0, help="seconds after SIGTERM")
    p.add_argument("--json", type=Path, metavar="PATH", help="write the summary as JSON")
    args = p.parse_args(argv)
    if args.repeats < 1 or args.requests < 1 or args.warmup < 0:
        p.error("--repeats and --requests must be >= 1, --warmup >= 0")
    return args


def ensure_model_dir(model_dir: Path) -> Path:
    from controlplane.engine.demo_model import write_demo_model  # imports torch: only here

    return write_demo_model(model_dir, size="small")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    model_dir = ensure_model_dir(args.model_dir)
    log(
        f"online serving: model {model_dir}, rates {args.rates} req/s, {args.requests} requests, "
        f"prompt {args.prompt_len[0]}-{args.prompt_len[1]}, output "
        f"{args.output_len[0]}-{args.output_len[1]}, {args.repeats} repeats, cpus {os.cpu_count()}"
    )
    submit_cost = measure_submit_cost(args.submit_records) if args.submit_records > 0 else None
    runs: list[Run] = []
    for repeat in range(args.repeats):
        for i, rate in enumerate(args.rates):
            k = (repeat + i) % len(args.modes)
            for mode in args.modes[k:] + args.modes[:k]:
                tag = f"[repeat {repeat + 1}/{args.repeats}] rate {rate:g} recording {mode}"
                log(f"{tag}: starting daemon ...")
                try:
                    run = run_one(rate, mode, repeat, model_dir, args)
                except DaemonError as exc:
                    log(f"{tag}: FAILED: {exc}")
                    return 1
                s = run.summary
                log(
                    f"{tag}: up in {run.startup_s:.1f}s; {s['output_throughput']:.1f} tok/s, "
                    f"ok {s['requests_ok']} / failed {s['requests_failed']}"
                    + (f" {s['errors']}" if s["errors"] else "")
                    + f", ITL p50 {_fmt((s['itl_ms'] or {}).get('p50'))} ms"
                )
                runs.append(run)
    result = report(runs, args)
    if args.json:
        payload = {
            "config": {
                "rates": args.rates,
                "modes": args.modes,
                "repeats": args.repeats,
                "requests": args.requests,
                "prompt_len": list(args.prompt_len),
                "output_len": list(args.output_len),
                "seed": args.seed,
                "warmup": args.warmup,
                "model_dir": str(model_dir),
                "dtype": args.dtype,
                "max_num_seqs": args.max_num_seqs,
                "cpus": os.cpu_count(),
            },
            **result,
            "submit_us_per_record": submit_cost,
            "runs": [
                {
                    "rate": r.rate,
                    "mode": r.mode,
                    "repeat": r.repeat,
                    "startup_s": r.startup_s,
                    "daemon_exit_code": r.daemon_exit_code,
                    "db_bytes": r.db_bytes,
                    "summary": r.summary,
                }
                for r in runs
            ],
        }
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
        log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
