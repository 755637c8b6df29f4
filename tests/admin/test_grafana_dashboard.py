"""deploy/grafana/controlplane.json run for real: every PromQL expression against a real
Prometheus scraping a real daemon on loopback, every SQL panel against SQLite and PostgreSQL
stores holding rollup rows (with Grafana's macros expanded as Grafana would), and the metrics
a still-loading daemon exports (no placeholder model name)."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import insert, text

from controlplane.store.models import IDLE_KEY, CostRollupRow
from harness import InProcessDaemon, free_port
from tests.admin.test_admin_api import admin_cfg

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "controlplane.json"
PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
SCRAPE_S = 1
# $__rate_interval: Grafana's is max(4 x scrape interval, $__interval + scrape interval); the
# load below lasts a few seconds, so a window that holds all of it and a scrape either side.
RATE_INTERVAL = "30s"
JOB = "controlplane"
# Grafana's unit ids (packages/grafana-data/src/valueFormats/categories.ts) this dashboard may
# use, and its custom-unit forms ("suffix:tok/s"); an unknown id is drawn as a literal suffix.
GRAFANA_UNITS = {"short", "none", "percentunit", "percent", "s", "ms", "reqps", "ops", "cps"}
GRAFANA_UNITS |= {"bytes", "decbytes", "currencyUSD", "Bps"}
CUSTOM_UNIT = re.compile(r"^(suffix|prefix|si|count|currency):.+$")
# Panels whose queries are empty while their feature is off (they must say so).
FEATURE_OFF = {"Draft acceptance": "speculative", "Autopilot decisions": "autopilot"}


def board() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels(b: dict) -> list[dict]:
    """Every panel that draws something (rows' nested panels included)."""
    out = []
    for p in b["panels"]:
        out += p.get("panels", []) if p.get("type") == "row" else [p]
    return out


def promql(b: dict) -> list[tuple[str, str, str]]:
    """(panel title, refId, expression) of every Prometheus target."""
    return [
        (p["title"], t["refId"], t["expr"])
        for p in panels(b)
        for t in p.get("targets", [])
        if "expr" in t
    ]


def sql(b: dict) -> list[tuple[str, dict]]:
    return [(p["title"], t) for p in panels(b) for t in p.get("targets", []) if "rawSql" in t]


def expand_promql(expr: str, **values: str) -> str:
    """Grafana's interpolation of the dashboard's variables ($x and ${x}) and
    $__rate_interval."""
    values = {"__rate_interval": RATE_INTERVAL, **values}

    def one(m: re.Match) -> str:
        name = m.group(1) or m.group(2)
        if name not in values:
            raise AssertionError(f"variable ${name} in {expr!r} has no value in this test")
        return values[name]

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", one, expr)


# -- the dashboard as JSON --------------------------------------------------------------------


def test_units_are_grafana_unit_ids() -> None:
    for p in panels(board()):
        defaults = p.get("fieldConfig", {}).get("defaults", {})
        overrides = p.get("fieldConfig", {}).get("overrides", [])
        units = [defaults.get("unit")] + [
            prop["value"]
            for o in overrides
            for prop in o.get("properties", [])
            if prop.get("id") == "unit"
        ]
        for unit in filter(None, units):
            assert unit in GRAFANA_UNITS or CUSTOM_UNIT.match(unit), (p["title"], unit)


def test_process_panel_selects_the_daemons_and_draws_bytes() -> None:
    (p,) = [p for p in panels(board()) if p["title"] == "Process memory and CPU"]
    for t in p["targets"]:
        assert 'job=~"$job"' in t["expr"] and 'instance=~"$instance"' in t["expr"], t["expr"]
    assert p["fieldConfig"]["defaults"]["unit"] == "bytes"
    names = {v["name"] for v in board()["templating"]["list"]}
    assert {"job", "instance", "model_name"} <= names


def test_feature_off_panels_say_why_they_are_empty() -> None:
    for title, feature in FEATURE_OFF.items():
        (p,) = [p for p in panels(board()) if p["title"] == title]
        assert feature in p["description"].lower() and "off" in p["description"], p
        assert "off" in p["fieldConfig"]["defaults"]["noValue"], p


# -- PromQL against a real Prometheus scraping a real daemon ------------------------------------


class Prometheus:
    """A real Prometheus on loopback, scraping `targets` ({job: host:port}) every SCRAPE_S, and
    itself as job "prometheus"."""

    def __init__(self, folder: Path, targets: dict[str, str]) -> None:
        assert PROMETHEUS is not None
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        targets = {**targets, "prometheus": f"127.0.0.1:{self.port}"}
        jobs = "".join(
            f"  - job_name: {job}\n    static_configs:\n      - targets: ['{target}']\n"
            for job, target in targets.items()
        )
        self.config = folder / "prometheus.yml"
        self.config.write_text(
            f"global:\n  scrape_interval: {SCRAPE_S}s\n  evaluation_interval: {SCRAPE_S}s\n"
            f"scrape_configs:\n{jobs}"
        )
        if PROMTOOL:
            check = subprocess.run(
                [PROMTOOL, "check", "config", str(self.config)],
                capture_output=True,
                text=True,
                check=False,
            )
            assert check.returncode == 0, check.stdout + check.stderr
        self.log = (folder / "prometheus.log").open("w")
        self.proc = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={self.config}",
                f"--storage.tsdb.path={folder / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(self.url + "/-/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert self.proc.poll() is None, "prometheus exited; see " + str(folder)
            assert time.monotonic() < deadline, "prometheus not ready in 60 s"
            time.sleep(0.2)

    def query(self, expr: str) -> list[dict]:
        r = httpx.get(self.url + "/api/v1/query", params={"query": expr}, timeout=30)
        body = r.json()
        assert r.status_code == 200 and body["status"] == "success", (expr, body)
        return body["data"]["result"]

    def wait_scraped_after(self, t: float, job: str, timeout: float = 30) -> None:
        """Until `job` has been scraped twice after time `t` (a rate sees what happened)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            got = self.query(f'timestamp(up{{job="{job}"}})')
            if got and float(got[0]["value"][1]) > t + 2 * SCRAPE_S:
                return
            time.sleep(0.2)
        raise AssertionError(f"prometheus did not scrape {job} after {t}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)
        self.log.close()


def has_data(result: list[dict]) -> bool:
    """A series with a number in it (0/0 is NaN: a panel draws nothing for it)."""
    return any(math.isfinite(float(s["value"][1])) for s in result)


def load(d: InProcessDaemon, seconds: float) -> None:
    """Completions, streamed and not, for `seconds`: every request series gets samples."""
    deadline = time.monotonic() + seconds
    model = d.daemon.runtime.model_name
    with d.client() as c:
        i = 0
        while time.monotonic() < deadline:
            body = {"model": model, "prompt": f"count to {i}", "max_tokens": 6, "ignore_eos": True}
            if i % 2:
                with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                    assert r.status_code == 200
                    r.read()
            else:
                r = c.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
            i += 1


# The features the panels in FEATURE_OFF draw: speculative decoding with the tiny model as its
# own draft (it proposes every step), and an autopilot whose TTFT target every request misses,
# deciding every second on a few seconds of requests.
FEATURES_ON = {
    "engine": {"speculative_method": "draft", "speculative_num_tokens": 2},
    "autopilot": {
        "enabled": True,
        "ttft_p99_ms": 0.01,
        "interval_s": 1,
        "window_s": 3,
        "max_window_s": 6,
        "min_requests": 2,
    },
}


@pytest.fixture(scope="module", params=["features off", "features on"])
def scraped(
    request, tiny_model_dir, tmp_path_factory
) -> Iterator[tuple[Prometheus, InProcessDaemon, bool]]:
    """A daemon under load, scraped by a real Prometheus that scrapes itself as well (the
    process panel must not draw it): autopilot and speculative decoding off (the defaults),
    then on."""
    if PROMETHEUS is None:
        why = (
            "no prometheus binary on PATH (Debian: apt-get install prometheus; .ci/run "
            "installs it): the dashboard's PromQL is not run against a live scrape"
        )
        if os.environ.get("CI"):  # as with PostgreSQL: a broken CI setup cannot pass as green
            pytest.fail(why)
        pytest.skip(why)
    tmp = tmp_path_factory.mktemp("grafana")
    on = request.param == "features on"
    engine = {"max_num_seqs": 4, "max_model_len": 256}
    if on:
        engine |= FEATURES_ON["engine"] | {"speculative_draft_model": str(tiny_model_dir)}
    extra = {"autopilot": FEATURES_ON["autopilot"]} if on else {}
    path = admin_cfg(tmp, tiny_model_dir, engine=engine, **extra)
    with InProcessDaemon.from_file(path) as d:
        host = d.url.removeprefix("http://")
        prom = None
        try:
            prom = Prometheus(tmp, {JOB: host})
            prom.wait_scraped_after(time.time() - 2 * SCRAPE_S, JOB)
            load(d, 6)
            d.daemon.runtime.pump_metrics()
            prom.wait_scraped_after(time.time(), JOB)
            yield prom, d, on
        finally:
            if prom is not None:
                prom.stop()


def test_every_promql_query_returns_data_from_a_live_scrape(scraped) -> None:
    prom, d, features_on = scraped
    b = board()
    queries = promql(b)
    instance = d.url.removeprefix("http://")
    model = d.daemon.runtime.model_name
    # Every selection the dropdowns offer: all of them, and this daemon picked by name.
    selections = [
        {"job": ".*", "instance": ".*", "model_name": ".*"},
        {"job": JOB, "instance": instance, "model_name": model},
    ]
    empty: list[tuple[str, str]] = []
    for values in selections:
        for title, ref, expr in queries:
            result = prom.query(expand_promql(expr, **values))
            if not has_data(result):
                empty.append((title, ref))
                continue
            # Only this daemon's series: never Prometheus' own process.
            for series in result:
                assert series["metric"].get("job", JOB) == JOB, (title, ref, series)
    # Only the panels of features that are off draw nothing, and they say why (see above).
    assert {title for title, _ in empty} <= (set() if features_on else set(FEATURE_OFF)), empty
    # The variables' own queries list this daemon (and no placeholder model).
    for v in b["templating"]["list"]:
        if v.get("type") != "query":
            continue
        m = re.fullmatch(r"label_values\((.*),\s*(\w+)\)", v["definition"])
        assert m, v
        selector = expand_promql(m.group(1), job=".*", instance=".*", model_name=".*")
        values = {s["metric"][m.group(2)] for s in prom.query(selector)}
        assert values == {{"job": JOB, "instance": instance, "model_name": model}[m.group(2)]}


# -- SQL panels against both stores ---------------------------------------------------------------

HOURS = ("2026-11-28T09", "2026-11-28T10", "2026-11-28T11", "2026-11-28T23")
# The panels' time range: 10:30 to 23:10 UTC; the 10:00 hour overlaps it, 09:00 does not.
FROM = datetime(2026, 11, 28, 10, 30, tzinfo=UTC)
TO = datetime(2026, 11, 28, 23, 10, tzinfo=UTC)


def rollup(hour: str, instance: str, key: str, list_usd: float, tokens: int) -> dict:
    return {
        "hour_bucket": hour,
        "day_bucket": hour[:10],
        "instance_id": instance,
        "model": "m",
        "api_key_name": key,
        "requests_succeeded": 1,
        "requests_failed": 0,
        "prompt_tokens": tokens,
        "cached_prompt_tokens": 0,
        "completion_tokens": tokens,
        "list_cost_usd": list_usd,
        "gpu_cost_usd": 0.0,
        "cache_savings_usd": 0.0,
        "covered_s": 3600.0,
        "updated_at": datetime(2026, 11, 29, tzinfo=UTC),
    }


def expand_sql(query: str, start: datetime, end: datetime) -> str:
    """Grafana's global range variables (milliseconds since the epoch, as both data sources
    substitute them); any other macro or variable left would be a query Grafana cannot run
    the same way on both stores."""
    query = query.replace("$__from", str(int(start.timestamp() * 1000)))
    query = query.replace("$__to", str(int(end.timestamp() * 1000)))
    assert "$" not in query, query
    return query


def test_sql_panels_run_unchanged_on_the_store_with_utc_hours(db_engine) -> None:
    rows = [rollup(h, "i1", "team", 1.0, 1000) for h in HOURS]
    rows += [rollup(h, "i2", "team", 0.5, 1000) for h in HOURS]  # a second instance: summed
    rows += [rollup(h, "i1", IDLE_KEY, 9.0, 0) for h in HOURS]  # idle GPU time: not drawn
    with db_engine.begin() as conn:
        conn.execute(insert(CostRollupRow.__table__), rows)
    expected_hours = [
        int(datetime.strptime(h, "%Y-%m-%dT%H").replace(tzinfo=UTC).timestamp()) for h in HOURS[1:]
    ]
    targets = sql(board())
    assert len(targets) == 2
    for title, target in targets:
        # One query for both data sources: PostgreSQL's reads rawSql, SQLite's queryText.
        assert target["queryText"] == target["rawSql"], title
        assert target["timeColumns"] == ["time"] and target["format"] == "time_series"
        query = expand_sql(target["rawSql"], FROM, TO)
        with db_engine.connect() as conn:
            if db_engine.dialect.name == "postgresql":
                # The session's zone must not move the hours (to_timestamp read the UTC bucket
                # as local time: an hour early here).
                conn.execute(text("SET TIME ZONE 'Europe/Berlin'"))
            got = conn.execute(text(query)).mappings().all()
        assert [r["time"] for r in got] == expected_hours, (title, got)
        assert {r["metric"] for r in got} == {"m / team"}, (title, got)
        if title.startswith("List cost"):
            assert [float(r["value"]) for r in got] == [1.5] * 3, got
        else:  # USD per million tokens: 1.5 USD over 4,000 tokens
            assert [float(r["value"]) for r in got] == pytest.approx([375.0] * 3), got


def test_hourly_cost_view_hour_start_is_the_utc_hour(db_engine) -> None:
    with db_engine.begin() as conn:
        conn.execute(insert(CostRollupRow.__table__), [rollup("2026-11-28T10", "i", "k", 1, 1)])
    with db_engine.connect() as conn:
        if db_engine.dialect.name == "postgresql":
            conn.execute(text("SET TIME ZONE 'Europe/Berlin'"))
        (row,) = conn.execute(text("SELECT * FROM hourly_cost_by_model_key")).mappings().all()
    start = row["hour_start"]
    if isinstance(start, str):  # SQLite: RFC 3339 text
        start = datetime.fromisoformat(start)
    assert start == datetime(2026, 11, 28, 10, tzinfo=UTC)
    assert row["hour_epoch"] == int(start.timestamp())


# -- no placeholder model name while the model loads -----------------------------------------------


def model_names(url: str) -> set[str]:
    text_ = httpx.get(url + "/metrics", timeout=30).text
    return {
        s.labels["model_name"]
        for family in text_string_to_metric_families(text_)
        for s in family.samples
        if "model_name" in s.labels
    }


def test_a_loading_daemon_labels_its_series_with_the_served_name(
    tiny_model_dir, monkeypatch, make_daemon
) -> None:
    from controlplane.daemon import Daemon

    release = threading.Event()
    original = Daemon._load_engine

    def slow_load(self: Daemon):  # the load holds until the test has scraped
        release.wait(60)
        return original(self)

    monkeypatch.setattr(Daemon, "_load_engine", slow_load)
    d = make_daemon(admin=True, wait_ready=False)
    try:
        assert httpx.get(d.url + "/health", timeout=10).json()["status"] == "loading"
        assert model_names(d.url) == {tiny_model_dir.name}
        release.set()
        deadline = time.monotonic() + 120
        while not d.daemon.ready.is_set():
            assert time.monotonic() < deadline, "the model did not load"
            time.sleep(0.05)
        assert model_names(d.url) == {tiny_model_dir.name}
    finally:
        release.set()
        d.stop()
