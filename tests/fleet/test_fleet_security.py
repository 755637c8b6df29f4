"""The fleet table is no trust boundary for the admin token (issue 24, defect 4).

Two real daemons share one PostgreSQL database; rows forged straight into `instances` point
at real HTTP listeners on loopback (or at a real daemon that is not the instance named). The
listeners must never receive the token or anything they could replay, every such instance
is reported failed, and no fleet operation starts another.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from sqlalchemy import delete, insert

from controlplane.config import build_config
from controlplane.engine.errors import InvalidSettingError
from controlplane.fleet.registry import INSTANCES, Heartbeat, member, members, register
from controlplane.store import make_engine
from harness import InProcessDaemon, write_config
from tests.conftest import reset_pg

TOKEN = "fleet-secret-token-0123456789abcdef"
NAMES = ("alpha", "beta")


@dataclass
class Listener:
    """A plain HTTP server on loopback recording every request it gets; `mode` says how it
    answers: "ok" (a 200 that looks like an applied change) or "redirect" (to `location`)."""

    mode: str = "ok"
    location: str = ""
    got: list[dict] = field(default_factory=list)
    server: ThreadingHTTPServer | None = None

    def __enter__(self) -> Listener:
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def _any(self) -> None:
                n = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(n) if n else b""
                outer.got.append(
                    {"method": self.command, "path": self.path, "body": body,
                     "headers": {k.lower(): v for k, v in self.headers.items()}}
                )  # fmt: skip
                if outer.mode == "redirect":
                    self.send_response(307)
                    self.send_header("Location", outer.location)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                answer = json.dumps(
                    {"change_id": "x", "dry_run": False, "changed": [], "fields": {},
                     "state": "draining"}
                ).encode()  # fmt: skip
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            do_GET = do_POST = do_PATCH = do_PUT = do_DELETE = _any

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.shutdown()
        self.server.server_close()

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.server_address[1]}"


@dataclass
class Fleet:
    db_url: str
    daemons: dict[str, InProcessDaemon]
    configs: dict[str, Path]

    def url(self, name: str) -> str:
        return self.daemons[name].url

    def forge(self, iid: str, url: str, **values: object) -> None:
        """A row written straight into the shared table (no validation: an attacker's SQL)."""
        now = datetime.now(UTC)
        row = dict(
            id=iid, advertise_url=url, hostname="h", pid=1, version="0.1.0", state="serving",
            started_at=now, heartbeat_at=now, **values,
        )  # fmt: skip
        db = make_engine(self.db_url)
        try:
            with db.begin() as conn:
                conn.execute(insert(INSTANCES).values(**row))
        finally:
            db.dispose()

    def unforge(self) -> None:
        db = make_engine(self.db_url)
        try:
            with db.begin() as conn:
                conn.execute(delete(INSTANCES).where(INSTANCES.c.id.not_in(NAMES)))
        finally:
            db.dispose()

    def setting(self, name: str, key: str = "engine.max_num_seqs") -> object:
        r = httpx.get(self.url(name) + "/admin/config", headers=bearer(), timeout=30)
        return r.json()["fields"][key]["value"]

    def patch_fleet(self, via: str, max_num_seqs: int, timeout: float = 60) -> httpx.Response:
        """An operator's fleet change (PATCH ?scope=fleet) through daemon `via`."""
        return httpx.patch(
            self.url(via) + "/admin/config",
            params={"scope": "fleet"},
            json={"engine": {"max_num_seqs": max_num_seqs}},
            headers=bearer(),
            timeout=timeout,
        )

    def history(self, name: str) -> list[dict]:
        r = httpx.get(self.url(name) + "/admin/config/history", headers=bearer(), timeout=30)
        return r.json()["changes"]

    def cli(self, *args: str) -> subprocess.CompletedProcess:
        env = {**os.environ, "CONTROLPLANE_ADMIN_TOKEN": TOKEN}
        cmd = [sys.executable, "-m", "controlplane", "fleet", *args]
        cmd += ["--config", str(self.configs["alpha"])]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)


def bearer() -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def fleet(tiny_model_dir, tmp_path_factory, pg_database, make_module_daemon) -> Fleet:
    db_url = reset_pg(pg_database)
    tmp = tmp_path_factory.mktemp("fleet_security")
    configs, daemons = {}, {}
    for name in NAMES:
        configs[name] = write_config(
            tmp / f"{name}.toml", tmp / name, tiny_model_dir,
            server={"instance_id": name}, store={"url": db_url, "flush_interval_s": 0.1},
            # Forged rows stay "serving" for the whole module.
            fleet={"heartbeat_s": 0.5, "unreachable_after_s": 600},
            engine={"max_num_seqs": 4, "max_model_len": 256, "num_kv_blocks": 64},
            admin_tokens=[{"name": "ops", "token": TOKEN}],
        )  # fmt: skip
    for name in NAMES:  # one at a time: they migrate the empty database at start
        daemons[name] = make_module_daemon.from_file(configs[name])
    return Fleet(db_url, daemons, configs)


@pytest.fixture
def sqlite_db(tmp_path: Path) -> Iterator[object]:
    """A migrated SQLite store (not the `engine` fixture: its PostgreSQL half would empty the
    schema the module's daemons run on)."""
    from controlplane.store import upgrade

    url = f"sqlite:///{tmp_path / 'fleet.db'}"
    upgrade(url)
    db = make_engine(url)
    yield db
    db.dispose()


@pytest.fixture
def clean(fleet: Fleet) -> Iterator[Fleet]:
    fleet.unforge()
    yield fleet
    fleet.unforge()


def assert_nothing_reusable(got: list[dict]) -> None:
    """No request a listener saw holds the token (in any header, the path or the body)."""
    for req in got:
        assert "authorization" not in req["headers"], req
        blob = json.dumps(req["headers"]) + req["path"] + req["body"].decode("latin-1")
        assert TOKEN not in blob, req


def replay(url: str, req: dict) -> httpx.Response:
    headers = {k: v for k, v in req["headers"].items() if k not in ("host", "content-length")}
    return httpx.request(
        req["method"], url + req["path"], headers=headers, content=req["body"], timeout=30
    )


def outcomes(body: dict) -> dict[str, dict]:
    return {o["instance"]: o for o in body["instances"]}


def test_a_forged_row_at_a_listener_never_gets_the_token_and_fails(clean: Fleet) -> None:
    fleet = clean
    with Listener() as evil:
        fleet.forge("evil", evil.url)
        # An operator's fleet change through a daemon: evil cannot be asked, none applies.
        r = fleet.patch_fleet("alpha", 6)
        assert evil.got, "the listener was never asked: the test proves nothing"
        assert_nothing_reusable(evil.got)
        assert r.status_code == 503, r.text
        found = outcomes(r.json())
        assert found["evil"]["outcome"] == "failed", found
        assert "not signed by instance 'evil'" in found["evil"]["detail"]
        assert {found[n]["outcome"] for n in NAMES} == {"not_applied"}
        assert {fleet.setting(n) for n in NAMES} == {4}
        # What it got is bound to "evil" and to one use: no real instance takes it.
        for req in evil.got:
            for name in NAMES:
                assert replay(fleet.url(name), req).status_code == 401
                as_alpha = {**req, "headers": {**req["headers"], "x-controlplane-fleet-instance": name}}  # fmt: skip
                assert replay(fleet.url(name), as_alpha).status_code == 401

        # The CLI talks to each instance itself: it signs too, and reports evil failed.
        seen = len(evil.got)
        (path := fleet.configs["alpha"].parent / "change.json").write_text(
            '{"engine.max_num_seqs": 6}'
        )
        done = fleet.cli("apply", str(path), "--format", "json")
        assert done.returncode == 1, (done.stdout, done.stderr)
        found = outcomes(json.loads(done.stdout))
        assert found["evil"]["outcome"] == "failed", found
        assert {found[n]["outcome"] for n in NAMES} == {"not_applied"}
        # Drain and resume sign as well; a listener's answer is not the instance's.
        done = fleet.cli("drain", "evil")
        assert done.returncode == 1 and "not signed by instance" in done.stderr, done.stderr
        assert len(evil.got) > seen
        assert_nothing_reusable(evil.got)
        assert {fleet.setting(n) for n in NAMES} == {4}


def test_an_instance_answering_for_another_id_is_reported_failed(clean: Fleet) -> None:
    fleet = clean
    # A row that names "imposter" but advertises alpha's URL: alpha must not answer for it.
    fleet.forge("imposter", fleet.url("alpha"))
    before = len(fleet.history("alpha"))
    r = fleet.patch_fleet("beta", 5)
    assert r.status_code == 503, r.text
    found = outcomes(r.json())
    assert found["imposter"]["outcome"] == "failed", found
    assert "refused the request signed for instance 'imposter'" in found["imposter"]["detail"]
    assert {found[n]["outcome"] for n in NAMES} == {"not_applied"}
    assert {fleet.setting(n) for n in NAMES} == {4}
    assert len(fleet.history("alpha")) == before

    # Without the forged row the same change applies, signed, with the token's name as actor.
    fleet.unforge()
    r = fleet.patch_fleet("beta", 5)
    assert r.status_code == 200, r.text
    change_id = r.json()["change_id"]
    for name in NAMES:
        assert fleet.setting(name) == 5
        (row,) = [h for h in fleet.history(name) if h["change_id"] == change_id]
        assert (row["source"], row["actor"]) == ("fleet", "ops")
    assert httpx.patch(
        fleet.url("alpha") + "/admin/config", json={"engine.max_num_seqs": 4}, headers=bearer()
    ).is_success
    assert httpx.patch(
        fleet.url("beta") + "/admin/config", json={"engine.max_num_seqs": 4}, headers=bearer()
    ).is_success


def test_redirects_are_not_followed(clean: Fleet) -> None:
    fleet = clean
    with Listener() as target, Listener(mode="redirect") as bouncer:
        bouncer.location = target.url + "/admin/config"
        fleet.forge("bouncer", bouncer.url)
        r = fleet.patch_fleet("alpha", 6)
        assert r.status_code == 503, r.text
        found = outcomes(r.json())
        assert found["bouncer"]["outcome"] == "failed"
        assert "not followed" in found["bouncer"]["detail"]
        assert bouncer.got and not target.got
        assert_nothing_reusable(bouncer.got)


def test_advertise_urls_are_validated_at_registration(sqlite_db) -> None:
    engine = sqlite_db
    now = datetime.now(UTC)
    bad = (
        "http://127.0.0.1:8000/?scope=fleet&",
        "http://127.0.0.1:8000/#frag",
        "http://127.0.0.1:8000?",
        "ftp://127.0.0.1:8000",
        "file:///etc/passwd",
        "http://ops:pw@127.0.0.1:8000",
        "http://",
        "http://h:99999",
        "http://h :1",
    )
    for url in bad:
        with pytest.raises(ValueError, match="advertise_url"):
            register(engine, "x", advertise_url=url, hostname="h", pid=1, version="0",
                     beat=Heartbeat("loading"), now=now)  # fmt: skip
        with pytest.raises(InvalidSettingError, match=r"server\.advertise_url"):
            build_config({"server": {"advertise_url": url}})
    assert members(engine, now=now, unreachable_after_s=15) == []
    for url in ("http://127.0.0.1:8000", "https://cp.example.com/", "http://[::1]:81"):
        register(engine, "x", advertise_url=url, hostname="h", pid=1, version="0",
                 beat=Heartbeat("loading"), now=now)  # fmt: skip
        assert build_config({"server": {"advertise_url": url}}).server.advertise_url == url


def test_rows_with_a_query_fragment_or_other_scheme_are_never_asked(clean: Fleet) -> None:
    fleet = clean
    with Listener() as listener:
        # The URL that made one PATCH recurse into hundreds of nested fleet changes.
        fleet.forge("looper", fleet.url("alpha") + "/?scope=fleet&")
        fleet.forge("queried", listener.url + "/?x=1")
        fleet.forge("fragment", listener.url + "#admin")
        fleet.forge("other-scheme", listener.url.replace("http://", "ftp://"))
        before = {n: len(fleet.history(n)) for n in NAMES}
        r = fleet.patch_fleet("alpha", 6, timeout=30)
        assert r.status_code == 503, r.text
        found = outcomes(r.json())
        for iid in ("looper", "queried", "fragment", "other-scheme"):
            assert found[iid]["outcome"] == "failed", found
            assert found[iid]["detail"].startswith("not asked: advertise_url"), found[iid]
        assert not listener.got
        assert {n: len(fleet.history(n)) for n in NAMES} == before
        assert {fleet.setting(n) for n in NAMES} == {4}


def test_a_signed_request_never_starts_a_fleet_operation_nor_replays(clean: Fleet) -> None:
    from controlplane.http.signing import Signer, fleet_key

    fleet = clean
    signer = Signer(fleet_key(TOKEN), "alpha")
    url = fleet.url("alpha")

    def signed(method: str, path: str, body: bytes = b"", **extra: str) -> httpx.Request:
        headers = {"Content-Type": "application/json", **extra}
        headers.update(signer.headers(method, path, body, source=extra.get("X-Controlplane-Source", "")))  # fmt: skip
        return httpx.Request(method, url + path, headers=headers, content=body)

    with Listener() as listener, httpx.Client(timeout=30) as http:
        fleet.forge("watcher", listener.url)
        body = json.dumps({"engine.max_num_seqs": 7}).encode()
        # A fleet PATCH inside a fleet operation: refused, nothing fans out.
        r = http.send(signed("PATCH", "/admin/config?scope=fleet", body))
        assert r.status_code == 403 and r.json()["error"]["param"] == "scope", r.text
        assert not listener.got
        # Signed requests reach only what fleet actions use: no reads, no other writes.
        assert http.send(signed("GET", "/admin/fleet")).status_code == 401
        assert http.send(signed("POST", "/admin/cache/reset")).status_code == 401
        # A good one applies once; the same bytes again are a replay.
        req = signed("PATCH", "/admin/config?dry_run=true", body, **{"X-Controlplane-Source": "fleet"})  # fmt: skip
        r = http.send(req)
        assert r.status_code == 200, r.text
        assert r.headers["x-controlplane-fleet-instance"] == "alpha"
        assert signer.answered_by_instance(
            req.headers["x-controlplane-fleet-nonce"], r.status_code, r.headers, r.content
        )
        assert http.send(req).status_code == 401
        # A changed body, a changed audit source, or a stale time: refused.
        tampered = signed("PATCH", "/admin/config?dry_run=true", body)
        tampered = httpx.Request("PATCH", tampered.url, headers=tampered.headers, content=b'{"engine.max_num_seqs": 1}')  # fmt: skip
        assert http.send(tampered).status_code == 401
        relabelled = signed("PATCH", "/admin/config?dry_run=true", body)
        relabelled.headers["X-Controlplane-Source"] = "tui"
        assert http.send(relabelled).status_code == 401
        stale = signed("PATCH", "/admin/config?dry_run=true", body)
        stale.headers["X-Controlplane-Fleet-Time"] = f"{time.time() - 120:.3f}"
        assert http.send(stale).status_code == 401
        assert not listener.got
    assert fleet.setting("alpha") == 4


def test_a_heartbeat_from_the_future_is_clamped_and_reads_unreachable(sqlite_db) -> None:
    engine = sqlite_db
    now = datetime.now(UTC)

    def reg(iid: str, at: datetime) -> None:
        register(engine, iid, advertise_url="http://127.0.0.1:1", hostname="h", pid=1,
                 version="0", beat=Heartbeat("serving"), now=at)  # fmt: skip

    reg("year-ahead", now + timedelta(days=365))
    reg("skewed", now + timedelta(seconds=5))  # a clock a little ahead: still serving
    reg("stopped-ahead", now + timedelta(days=365))
    with engine.begin() as conn:
        conn.execute(
            INSTANCES.update().where(INSTANCES.c.id == "stopped-ahead").values(state="stopped")
        )
    got = {m.id: m for m in members(engine, now=now, unreachable_after_s=15)}
    assert got["year-ahead"].state == "unreachable"
    assert got["year-ahead"].heartbeat_age_s == 0
    assert got["year-ahead"].unreachable_since == now
    assert got["skewed"].state == "serving" and got["skewed"].heartbeat_age_s == 0
    assert got["stopped-ahead"].state == "stopped"
    assert all(m.heartbeat_age_s >= 0 for m in got.values())
    # The same row later on: still unreachable until the clock passes it, never negative.
    later = member(
        {**_row(), "heartbeat_at": now + timedelta(days=365)},
        now=now + timedelta(days=200),
        unreachable_after_s=15,
    )
    assert later.state == "unreachable" and later.heartbeat_age_s == 0


def _row() -> dict:
    now = datetime.now(UTC)
    return dict(
        id="a", advertise_url="http://h:1", hostname="h", pid=1, version="0", model=None,
        quantization=None, state="serving", started_at=now, heartbeat_at=now, num_running=None,
        num_waiting=None, kv_usage=None, output_tokens_per_s=None, ttft_p50_s=None,
    )  # fmt: skip


def test_apply_change_reports_a_listener_failed_in_process(clean: Fleet) -> None:
    """The library call the CLI and the daemon share: straight from the table, signed."""
    from controlplane.fleet.actions import apply_change

    fleet = clean
    with Listener() as evil:
        fleet.forge("evil", evil.url)
        db = make_engine(fleet.db_url)
        try:
            found = members(db, now=datetime.now(UTC), unreachable_after_s=600)
        finally:
            db.dispose()
        result = asyncio.run(apply_change(found, {"engine.max_num_seqs": 6}, TOKEN))
        got = {o.instance: o.outcome for o in result.instances}
        assert got == {"evil": "failed", "alpha": "not_applied", "beta": "not_applied"}
        assert not result.applied
        assert evil.got
        assert_nothing_reusable(evil.got)
