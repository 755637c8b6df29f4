"""Running it in production: health probes, start-up errors (store, environment), `serve` flags,
`--version`, JSON logs with extra fields, the access log. Real daemons on loopback, real
subprocesses, real databases."""

from __future__ import annotations

import json
import logging
import re
import signal
import subprocess
import sys
from datetime import UTC, datetime
from importlib.metadata import version
from pathlib import Path

import httpx
import pytest

import controlplane
import harness
from controlplane.config import ENV_NON_KEYS, build_config, env_names
from controlplane.engine.errors import InvalidSettingError
from controlplane.runtime.logs import JSONFormatter
from harness import DaemonProcess, write_config

REPO = Path(__file__).resolve().parents[2]
TOKEN = "ops-token-0123456789abcdef"
MODEL = "model"  # the tiny demo model's directory name, served as the model id
# An unreachable PostgreSQL (nothing listens on port 1), with a password that must never show.
UNREACHABLE = "postgresql+psycopg://u:secret@127.0.0.1:1/x"
SHOWN = "postgresql+psycopg://u:***@127.0.0.1:1/x"


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without CONTROLPLANE_* variables (but the suite's own:
    harness.clean_env), plus `extra`."""
    return harness.clean_env(extra)


def run_cli(
    args: list[str], env: dict[str, str], cwd: Path, prelude: str = ""
) -> subprocess.CompletedProcess:
    """`controlplane ARGS` in a subprocess; `prelude` runs first (in the same interpreter)."""
    code = f"{prelude}\nimport sys\nfrom controlplane.cli import main\nsys.exit(main({args!r}))"
    return subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


# -- health probes ------------------------------------------------------------------------------


def test_probes_while_loading_then_ready(tmp_path):
    # No model configured: SmolLM2 (or the demo model, written first) takes seconds to load, and
    # the HTTP server answers meanwhile.
    cfg = write_config(
        tmp_path / "cp.toml", tmp_path / "data", None, store={"record_requests": False}
    )
    d = DaemonProcess.start(cfg, wait_ready=False)
    try:
        live = httpx.get(d.url + "/health/live", timeout=10)
        ready = httpx.get(d.url + "/health/ready", timeout=10)
        assert live.status_code == 200 and live.json() == {"status": "alive", "state": "loading"}
        assert ready.status_code == 503 and ready.json()["status"] == "loading"
        d.wait_for("ready on", 120)
        assert httpx.get(d.url + "/health/live", timeout=10).status_code == 200
        assert httpx.get(d.url + "/health/ready", timeout=10).json() == {"status": "ready"}
    finally:
        assert d.stop(signal.SIGTERM) == 0


def test_probes_drain_resume_and_dead_step_loop(caplog, make_daemon):
    # dead_exit_s: it answers `dead` all along the test rather than exiting (status 1) 5 s after.
    d = make_daemon(
        with_file=False,
        admin_tokens=[{"name": "ops", "token": TOKEN}],
        server={"dead_exit_s": 300},
    )
    admin = {"Authorization": f"Bearer {TOKEN}"}

    def status(path: str) -> tuple[int, dict]:
        r = httpx.get(d.url + path, timeout=10)
        return r.status_code, r.json()

    assert status("/health/live") == (200, {"status": "alive", "state": "ready"})
    assert status("/health/ready") == (200, {"status": "ready"})
    assert httpx.post(d.url + "/admin/drain", headers=admin).status_code == 200
    # Draining: not ready (a load balancer stops sending), still alive (no restart).
    assert status("/health/ready") == (503, {"status": "draining"})
    assert status("/health/live") == (200, {"status": "alive", "state": "draining"})
    assert status("/health")[0] == 503  # unchanged
    assert httpx.post(d.url + "/admin/resume", headers=admin).status_code == 200
    assert status("/health/ready") == (200, {"status": "ready"})

    def dying_step():
        raise RuntimeError("simulated step loop crash")

    d.daemon.aengine.engine.step = dying_step  # the step thread dies on its next step
    with caplog.at_level(logging.INFO):
        r = httpx.post(
            d.url + "/v1/completions",
            json={"model": MODEL, "prompt": "x", "max_tokens": 4},
            timeout=30,
        )
    assert r.status_code == 503
    # Dead, and why (the step loop's error).
    cause = "RuntimeError: simulated step loop crash"
    assert status("/health/live") == (503, {"status": "dead", "state": "ready", "error": cause})
    assert status("/health/ready") == (503, {"status": "dead", "error": cause})
    # server.access_log is off by default: the request ended, and no access line says so.
    assert not [r for r in caplog.records if r.name == "controlplane.access"]


# -- start-up errors: the store -----------------------------------------------------------------


def assert_one_line_error(done: subprocess.CompletedProcess, *needles: str) -> str:
    out = done.stdout + done.stderr
    assert done.returncode not in (0, None), out
    assert "Traceback" not in out and "secret" not in out, out
    errors = [line for line in out.splitlines() if line.startswith("controlplane: error:")]
    assert len(errors) == 1, out
    for needle in needles:
        assert needle in errors[0], out
    return errors[0]


def test_unreachable_postgres_is_one_line_without_the_password(tmp_path):
    env = clean_env(CONTROLPLANE_DATA_DIR=str(tmp_path / "data"))
    up = run_cli(["db", "upgrade", "--url", UNREACHABLE], env, tmp_path)
    line = assert_one_line_error(up, SHOWN, "Connection refused", "store.url")
    assert up.returncode == 1 and not up.stdout, line
    serve = run_cli(
        ["serve", "--port", "0"], {**env, "CONTROLPLANE_STORE__URL": UNREACHABLE}, tmp_path
    )
    assert_one_line_error(serve, SHOWN, "Connection refused")
    assert serve.returncode == 1


def test_missing_postgres_driver_is_one_line_with_the_fix(tmp_path):
    # psycopg is installed here: None in sys.modules makes `import psycopg` fail exactly as it
    # does where the `postgres` extra was never installed.
    hide = "import sys; sys.modules['psycopg'] = None"
    url = "postgresql://u:secret@127.0.0.1:5432/x"  # plain postgresql:// means psycopg
    shown = "postgresql+psycopg://u:***@127.0.0.1:5432/x"
    env = clean_env(CONTROLPLANE_DATA_DIR=str(tmp_path / "data"))
    fix = "pip install 'controlplane[postgres]'"
    done = run_cli(["db", "upgrade", "--url", url], env, tmp_path, prelude=hide)
    assert_one_line_error(done, shown, "'psycopg' is not installed", fix)
    done = run_cli(
        ["serve", "--port", "0"], {**env, "CONTROLPLANE_STORE__URL": url}, tmp_path, prelude=hide
    )
    assert_one_line_error(done, shown, "'psycopg' is not installed", fix)
    assert done.returncode == 1


# -- start-up errors: the environment -----------------------------------------------------------


def test_unknown_environment_variables_are_rejected_naming_them():
    with pytest.raises(InvalidSettingError) as e:
        build_config({}, {"CONTROLPLANE_SERVER_PORT": "9000"})  # one underscore
    assert str(e.value).startswith("CONTROLPLANE_SERVER_PORT: unknown environment variable")
    assert "did you mean CONTROLPLANE_SERVER__PORT?" in str(e.value)
    with pytest.raises(InvalidSettingError, match="did you mean CONTROLPLANE_ENGINE__MAX_NUM_SEQS"):
        build_config({}, {"CONTROLPLANE_ENGINE__MAX_NUM_SEQ": "4"})
    with pytest.raises(InvalidSettingError, match="did you mean CONTROLPLANE_DATA_DIR"):
        build_config({}, {"CONTROLPLANE_DATADIR": "/tmp"})
    with pytest.raises(InvalidSettingError) as e:
        build_config({}, {"CONTROLPLANE_WHATEVER": "1"})  # nothing close: no guess
    assert "CONTROLPLANE_WHATEVER" in str(e.value) and "did you mean" not in str(e.value)
    # Keys, in any case, and the variables that are not keys, still work.
    env = {name: "x" for name in ENV_NON_KEYS} | {"CONTROLPLANE_server__port": "9000"}
    assert build_config({}, {**env, "CONTROLPLANE_DATA_DIR": "/d"}).server.port == 9000
    assert build_config({}, {"CONTROLPLANE_DATA_DIR": "/d"}).data_dir == "/d"


def test_every_controlplane_variable_the_repo_uses_is_accepted():
    """A variable the code, tests, CI or docs use that the check would reject breaks a start."""
    known = set(env_names()) | ENV_NON_KEYS
    files = [REPO / ".ci" / "run", REPO / "README.md"]
    files += [p for p in REPO.glob("deploy/**/*") if p.is_file()]  # grafana/ included
    files += [*REPO.glob("docs/**/*.md"), *REPO.glob("docs/**/*.py"), REPO / "mkdocs.yml"]
    for folder in ("controlplane", "tests", "benchmarks", "config", "migrations"):
        files += [p for p in (REPO / folder).rglob("*") if p.suffix in (".py", ".toml", ".md")]
    used = set()
    for path in files:
        if path.name == Path(__file__).name:  # this file spells wrong names on purpose
            continue
        used |= set(re.findall(r"\bCONTROLPLANE_[A-Z0-9_]*[A-Z0-9]", path.read_text()))
    # The placeholder in docs, and the README's example of a wrong name.
    used -= {"CONTROLPLANE_SECTION__KEY", "CONTROLPLANE_SERVER_PORT"}
    assert {"CONTROLPLANE_DATA_DIR", "CONTROLPLANE_ADMIN_TOKEN"} <= used
    assert used <= known, used - known


def test_serve_rejects_a_misspelled_variable(tmp_path):
    env = clean_env(CONTROLPLANE_SERVER_PORT="9000", CONTROLPLANE_DATA_DIR=str(tmp_path))
    done = run_cli(["serve"], env, tmp_path)
    line = assert_one_line_error(done, "CONTROLPLANE_SERVER_PORT", "CONTROLPLANE_SERVER__PORT")
    assert done.returncode == 2, line


# -- command line -------------------------------------------------------------------------------


def test_version_is_the_installed_distributions():
    done = subprocess.run(
        [sys.executable, "-m", "controlplane", "--version"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert done.stdout.strip() == f"controlplane {version('controlplane')}"
    assert version("controlplane") == controlplane.__version__


def test_serve_flags_override_file_and_environment(tiny_model_dir, tmp_path):
    # The file and the environment both name a model that does not exist and other data
    # directories; the flags must win over both.
    cfg = write_config(
        tmp_path / "cp.toml",
        tmp_path / "file-data",
        tmp_path / "no-such-model",
        server={"log_level": "debug"},
    )
    env = {
        "CONTROLPLANE_DATA_DIR": str(tmp_path / "env-data"),
        "CONTROLPLANE_ENGINE__MODEL": str(tmp_path / "no-such-model-either"),
        "CONTROLPLANE_SERVER__LOG_LEVEL": "info",
    }
    flag_data = tmp_path / "flag-data"
    args = ("--model", str(tiny_model_dir), "--data-dir", str(flag_data), "--log-level", "warning")
    d = DaemonProcess.start(cfg, args=args, env=env)
    try:
        models = httpx.get(d.url + "/v1/models", timeout=10).json()["data"]
        assert [m["id"] for m in models] == [MODEL]  # the --model directory's name
    finally:
        assert d.stop() == 0
    assert (flag_data / "controlplane.db").is_file() and (flag_data / "instance_id").is_file()
    assert not (tmp_path / "file-data").exists() and not (tmp_path / "env-data").exists()
    # --log-level warning: the info lines (`loading`, `ready`, `stopped`) are not logged; the
    # printed status lines are.
    assert not [line for line in d.lines if " INFO " in line], d.lines
    assert any("controlplane: stopped" in line for line in d.lines)


def test_serve_flags_are_validated_naming_the_key(tmp_path):
    done = run_cli(["serve", "--port", "70000"], clean_env(), tmp_path)
    assert_one_line_error(done, "server.port: must be in [0, 65535], got 70000")


# -- logs ---------------------------------------------------------------------------------------


def test_json_formatter_keeps_extra_fields():
    record = logging.LogRecord("x.y", logging.INFO, __file__, 1, "hello %s", ("you",), None)
    record.request_id, record.when, record.level = "r1", datetime(2026, 1, 2, tzinfo=UTC), "x"
    entry = json.loads(JSONFormatter().format(record))
    assert entry["message"] == "hello you" and entry["request_id"] == "r1"
    assert entry["when"] == "2026-01-02 00:00:00+00:00"  # not JSON-native: as text
    assert entry["level"] == "info"  # an extra cannot overwrite the line's own fields
    assert not {"args", "msg", "exc_info", "lineno"} & set(entry)


def test_access_log_one_json_line_per_finished_request(tiny_model_dir, tmp_path):
    cfg = write_config(
        tmp_path / "cp.toml",
        tmp_path / "data",
        tiny_model_dir,
        server={"log_format": "json", "access_log": True},
        store={"record_requests": False},
        api_keys=[{"name": "team-a", "key": "sk-team-a-secret"}],
    )
    d = DaemonProcess.start(cfg)
    try:
        r = httpx.post(
            d.url + "/v1/completions",
            headers={"Authorization": "Bearer sk-team-a-secret", "X-Request-Id": "trace-42"},
            json={
                "model": MODEL,
                "prompt": "hello",
                "max_tokens": 5,
                "ignore_eos": True,
                "user": "alice",
            },
            timeout=60,
        )
        assert r.status_code == 200
        body = r.json()
    finally:
        assert d.stop() == 0
    entries = [json.loads(line) for line in d.lines if line.startswith("{")]
    access = [e for e in entries if e["logger"] == "controlplane.access"]
    assert len(access) == 1, d.lines
    (line,) = access
    assert line["request_id"] == body["id"] and line["api_key_name"] == "team-a"
    assert line["x_request_id"] == "trace-42" and line["user"] == "alice"
    assert line["status"] == "success" and line["finish_reason"] == "length"
    assert line["prompt_tokens"] == body["usage"]["prompt_tokens"]
    assert line["completion_tokens"] == body["usage"]["completion_tokens"] == 5
    assert isinstance(line["latency_ms"], float) and line["latency_ms"] > 0
    assert line["endpoint"] == "completions" and line["level"] == "info"
    assert "sk-team-a-secret" not in "\n".join(d.lines)
