"""What a container run found (issue 24, defect 11): an unwritable data directory, and a
`docker stop` whose 10 s grace is shorter than the drain (SIGKILL mid-stream)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pytest

from controlplane.config import ServerSettings, load_config
from controlplane.runtime.ledger import PROGRESS_INTERVAL_S
from harness import DaemonProcess, write_config
from tests.conftest import require_smollm2

REPO = Path(__file__).resolve().parents[2]
SERVE = [sys.executable, "-m", "controlplane", "serve"]
DOCKER_STOP_GRACE_S = 10  # `docker stop` without --timeout


# -- an unwritable data directory: one line, no traceback ----------------------------------


def _unwritable_dirs(tmp_path: Path) -> list[Path]:
    """Directories this process cannot write, even as root: one under a file (a file is in the
    way), and sysfs, where nobody creates files (the root-owned bind mount of a container run
    fails the same way for its non-root user: EACCES)."""
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    found = [blocker, blocker / "data"]
    try:
        fd, probe = tempfile.mkstemp(dir="/sys/fs")
    except OSError:
        found.append(Path("/sys/fs"))
    else:  # pragma: no cover - not Linux
        os.close(fd)
        os.unlink(probe)
    return found


def test_unwritable_data_dir_is_one_line_naming_path_and_user(tmp_path):
    cfg = write_config(tmp_path / "cp.toml", tmp_path / "unused", None)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONTROLPLANE_")}
    for data_dir in _unwritable_dirs(tmp_path):
        proc = subprocess.run(
            [*SERVE, "--config", str(cfg), "--data-dir", str(data_dir)],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        out = (proc.stdout + proc.stderr).strip()
        assert proc.returncode == 2, out
        assert "Traceback" not in out, out
        assert len(out.splitlines()) == 1, out
        assert str(data_dir) in out and "not writable by user" in out, out
        assert f"uid {os.geteuid()}" in out, out


# -- the image makes the default stop safe ----------------------------------------------------


def test_image_default_stop_fits_docker_stop_grace():
    text = (REPO / "deploy" / "Dockerfile").read_text()
    assert re.search(r"^STOPSIGNAL SIGTERM$", text, re.M)
    m = re.search(r"^ENV CONTROLPLANE_SERVER__DRAIN_TIMEOUT_S=([0-9.]+)$", text, re.M)
    assert m, "the image sets its drain timeout"
    drain = float(m.group(1))
    # The drain, then about a second to stop the server and flush the records.
    assert drain + 1.5 <= DOCKER_STOP_GRACE_S
    # Orchestrators that give the pod more time keep the daemon's longer default.
    for name in ("kubernetes.yaml", "kubernetes-fleet.yaml"):
        manifest = (REPO / "deploy" / name).read_text()
        grace = int(re.search(r"terminationGracePeriodSeconds: (\d+)", manifest).group(1))
        drain_k8s = float(
            re.search(
                r"CONTROLPLANE_SERVER__DRAIN_TIMEOUT_S\n\s+value: \"([0-9.]+)\"", manifest
            ).group(1)
        )
        assert drain_k8s == ServerSettings().drain_timeout_s and drain_k8s + 15 <= grace
    # The README, and the docs page that says how to stop the image (docs/deployment.md).
    readme = (REPO / "README.md").read_text() + (REPO / "docs" / "deployment.md").read_text()
    assert "docker stop --time " not in readme  # deprecated: --timeout
    unit = (REPO / "deploy" / "controlplane.service").read_text()
    assert re.search(r"^LimitNOFILE=\d+$", unit, re.M)


# -- SIGKILL mid-stream: the row keeps the tokens streamed so far ----------------------------


@pytest.mark.timeout(400)
def test_sigkill_mid_stream_row_keeps_tokens_streamed_so_far(tmp_path):
    """A stream cut by SIGKILL (what `docker stop` does after its grace) is `interrupted` after
    the restart with the completion tokens of at most PROGRESS_INTERVAL_S before the kill (the
    row was billed zero tokens before). SmolLM2, so that a stream lasts seconds."""
    model = require_smollm2()
    data = tmp_path / "data"
    cfg_path = write_config(tmp_path / "cp.toml", data, model)
    url = load_config(cfg_path, env={}).store_url
    d = DaemonProcess.start(cfg_path, timeout=180)
    model_id = httpx.get(d.url + "/v1/models", timeout=10).json()["data"][0]["id"]
    times: list[float] = []  # client receive time of each token
    ids: list[str] = []
    stop = threading.Event()

    def stream() -> None:
        body = {
            "model": model_id,
            "messages": [{"role": "user", "content": "Count from one to one thousand."}],
            "max_tokens": 1500,
            "ignore_eos": True,
            "logprobs": True,
            "stream": True,
        }
        with (
            contextlib.suppress(httpx.HTTPError),
            httpx.stream("POST", d.url + "/v1/chat/completions", json=body, timeout=120) as r,
        ):
            for line in r.iter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[6:])
                ids.append(chunk["id"])
                lp = chunk["choices"][0].get("logprobs") if chunk["choices"] else None
                now = time.monotonic()
                times.extend([now] * len((lp or {}).get("content") or []))
                if stop.is_set():
                    return

    client = threading.Thread(target=stream)
    client.start()
    deadline = time.monotonic() + 120
    # Well past a few progress intervals, mid-stream.
    while time.monotonic() < deadline and (len(times) < 30 or time.monotonic() - times[0] < 3.5):
        time.sleep(0.01)
    os.kill(d.proc.pid, signal.SIGKILL)
    killed_at = time.monotonic()
    d.proc.wait(30)
    stop.set()
    client.join(30)
    received = sum(1 for t in times if t <= killed_at)
    recent = sum(1 for t in times if killed_at - (PROGRESS_INTERVAL_S + 0.5) < t <= killed_at)
    assert received >= 30, received

    d2 = DaemonProcess.start(cfg_path, timeout=180)
    try:
        from harness import rows

        row = {r["id"]: r for r in rows(url)}[ids[0]]
    finally:
        d2.stop()
    assert row["status"] == "interrupted", row
    got = row["completion_tokens"]
    # Within the stated bound: the tokens of the last progress interval (and a little slack
    # for the event loop), never more than the engine had produced.
    assert received - recent <= got <= received + 8, (got, received, recent)
    assert row["cost_usd"] is None or row["cost_usd"] >= 0
    print(f"streamed {received} tokens, row says {got} (last {PROGRESS_INTERVAL_S}s: {recent})")
