"""A start that cannot finish (issue 52, section 1): the CPU kernels' build lock, SIGTERM while
loading, and the start deadline. Real processes, real flock, real signals.

Each test gets its own TORCH_EXTENSIONS_DIR. Where a test needs the build to be there, the one
this process already has is copied in (a cold build takes about a minute of CI's two cores);
the SIGTERM test starts a cold build on purpose and stops it seconds in.

A "live builder" below is a process holding what a builder holds (cpu_ops._owner and torch's
FileBaton): the flock on `lock.owner` and the `lock` file.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from controlplane.engine.kernels import cpu_ops
from harness import DaemonProcess
from harness.config import write_config
from tests.kernels import require_kernels

# Skipped where the kernels cannot build; under CI a failed build fails instead.
require_kernels()

TOKEN = "start-faults-admin-token"

HOLDER = """
import fcntl, os, sys, time
d = sys.argv[1]
fd = os.open(os.path.join(d, "lock.owner"), os.O_RDWR | os.O_CREAT, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX)
os.write(fd, f"{os.getpid()}\\n".encode())
open(os.path.join(d, "lock"), "w").close()
print("held", flush=True)
time.sleep(600)
"""


def _copy_build(root: Path) -> Path:
    """This process's build of the kernels, copied into `root` (a TORCH_EXTENSIONS_DIR), with
    no lock; returns its build directory there."""
    from torch.utils.cpp_extension import _get_build_directory

    name = cpu_ops.build_spec()[0]
    built = _get_build_directory(name, False)
    shutil.copytree(built, root / name, ignore=shutil.ignore_patterns("lock", "lock.owner"))
    return root / name


@pytest.fixture
def holder() -> Iterator[Any]:
    """Start a live builder on a build directory: holder(build_dir) -> its Popen."""
    procs: list[subprocess.Popen] = []

    def start(build_dir: Path) -> subprocess.Popen:
        proc = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(build_dir)], stdout=subprocess.PIPE, text=True
        )
        procs.append(proc)
        assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
        return proc

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)


def _config(tmp: Path, model: Path, **server: object) -> Path:
    return write_config(
        tmp / "cp.toml",
        tmp / "data",
        model,
        server=server,
        admin_tokens=[{"name": "ops", "token": TOKEN}],
    )


def _builders_in(build_dir: Path) -> list[int]:
    """Processes working in `build_dir` (ninja and its compilers run there)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if Path(os.readlink(entry / "cwd")) == build_dir:
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def test_a_lock_left_by_a_killed_builder_is_removed_at_once(tmp_path, holder):
    # Today's check removed only locks older than 600 s: one left 18 s into a build by a
    # SIGKILL made every later start wait forever. Whose the lock is decides now, not its age.
    build_dir = _copy_build(tmp_path)
    dead = holder(build_dir)
    dead.send_signal(signal.SIGKILL)
    dead.wait(30)
    assert (build_dir / "lock").exists()
    code = "from controlplane.engine.kernels import cpu_ops\nprint(cpu_ops.available(), cpu_ops.state())\n"
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path))
    started = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    took = time.monotonic() - started
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("True {'state': 'ready'"), result.stdout
    assert f"removing {build_dir / 'lock'}, left by a build that never finished" in result.stderr
    assert "waiting for the kernel build lock" not in result.stderr
    assert not (build_dir / "lock").exists()
    print(f"start after a killed builder: {took:.1f} s (the interpreter and torch included)")


def test_a_killed_builders_orphaned_ninja_is_waited_for(tmp_path, holder):
    # A SIGKILL reaches the daemon, not its ninja, which goes on compiling in the build
    # directory: the next start waits for it (two builds would write the same objects), then
    # removes the lock. The orphan here is a process left working in that directory; it ends
    # once the start has said it waits.
    build_dir = _copy_build(tmp_path)
    dead = holder(build_dir)
    orphan = subprocess.Popen(["sleep", "120"], cwd=build_dir, start_new_session=True)
    dead.send_signal(signal.SIGKILL)
    dead.wait(30)
    code = "from controlplane.engine.kernels import cpu_ops\nprint(cpu_ops.available(), cpu_ops.state())\n"
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(tmp_path))
    start = subprocess.Popen(
        [sys.executable, "-c", code],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert start.stderr is not None
        waiting = next((line for line in start.stderr if "kernel build lock" in line), "")
    finally:
        orphan.kill()
        orphan.wait(30)
    out, err = start.communicate(timeout=120)
    assert start.returncode == 0, err[-2000:]
    assert out.startswith("True {'state': 'ready'"), out
    lock = build_dir / "lock"
    assert f"waiting for the kernel build lock {lock} (pid {orphan.pid}, of a" in waiting, waiting
    assert f"removing {lock}, left by a build that never finished" in err, err[-2000:]


def test_a_live_builders_lock_is_waited_for_then_torch_serves(tmp_path, tiny_model_dir, holder):
    # Another live process builds the same kernels (its flock is held): the start waits
    # kernel_build_wait_s, says so, then serves on torch's kernels and /admin/stats says why.
    build_dir = _copy_build(tmp_path / "ext")
    live = holder(build_dir)
    cfg = _config(tmp_path, tiny_model_dir, kernel_build_wait_s=2)
    started = time.monotonic()
    d = DaemonProcess.start(cfg, timeout=90, env={"TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")})
    ready_s = time.monotonic() - started
    lock = build_dir / "lock"
    waiting = [line for line in d.lines if "waiting for the kernel build lock" in line]
    assert waiting and f"waiting for the kernel build lock {lock} (pid {live.pid}" in waiting[0]
    warned = [line for line in d.lines if "CPU kernels not built" in line]
    assert len(warned) == 1 and "server.kernel_build_wait_s = 2 s" in warned[0], d.log_tail()
    stats = httpx.get(
        d.url + "/admin/stats", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10
    ).json()
    kernels = stats["cpu_kernels"]
    assert kernels["state"] == "lock_timeout", kernels
    assert str(lock) in kernels["reason"] and f"pid {live.pid}" in kernels["reason"]
    assert "server.kernel_build_wait_s" in kernels["reason"]
    # The dashboard's line and /metrics say the same: torch's kernels serve, and why.
    assert stats["kernels"] == {"status": "fallback", "reason": kernels["reason"]}
    metrics = httpx.get(d.url + "/metrics", timeout=10).text
    assert f'controlplane:kernels_loaded{{model_name="{stats["model"]}",reason=' in metrics
    loaded = [
        line for line in metrics.splitlines() if line.startswith("controlplane:kernels_loaded{")
    ]
    assert len(loaded) == 1 and loaded[0].endswith(" 0.0") and "kernel build lock" in loaded[0]
    r = httpx.post(
        d.url + "/v1/completions",
        json={"model": stats["model"], "prompt": "hello", "max_tokens": 4},
        timeout=30,
    )
    assert r.status_code == 200, r.text
    assert lock.exists() and live.poll() is None  # the live builder's lock is left alone
    assert d.stop(timeout=30) == 0
    print(f"ready on torch's kernels {ready_s:.1f} s after the start (wait 2 s)")


def test_sigterm_during_a_kernel_build_exits_promptly_and_leaves_no_lock(tmp_path, tiny_model_dir):
    # A cold build in an empty extensions directory, stopped a few seconds in: before, SIGTERM
    # was not honoured until the build (and the load) ended, and a kill then left the lock.
    ext = tmp_path / "ext"
    ext.mkdir()
    build_dir = ext / cpu_ops.build_spec()[0]
    d = DaemonProcess.start(
        _config(tmp_path, tiny_model_dir),
        wait_ready=False,
        timeout=90,
        env={"TORCH_EXTENSIONS_DIR": str(ext)},
    )
    deadline = time.monotonic() + 90
    while not ((build_dir / "lock").exists() and _builders_in(build_dir)):
        assert time.monotonic() < deadline, "no build started" + d.log_tail()
        assert d.proc.poll() is None, d.log_tail()
        time.sleep(0.05)
    time.sleep(1.0)  # the compilers are running
    assert httpx.get(d.url + "/health/live", timeout=10).json() == {
        "status": "alive",
        "state": "loading",
    }
    started = time.monotonic()
    rc = d.stop(signal.SIGTERM, timeout=30)
    took = time.monotonic() - started
    assert rc == 0, d.log_tail()
    assert took < 15, f"SIGTERM took {took:.1f} s" + d.log_tail()
    assert not (build_dir / "lock").exists(), d.log_tail()
    time.sleep(0.5)  # a compiler that outlived the daemon would show now
    assert _builders_in(build_dir) == []
    assert any("stopped while the model was loading" in line for line in d.lines), d.log_tail()
    print(f"SIGTERM during the build: exited in {took:.1f} s")


def test_a_start_past_its_deadline_reports_dead_and_exits_1(tmp_path, tiny_model_dir, holder):
    # A start that cannot finish (here: a live builder that never releases its lock, and a wait
    # longer than the deadline): /health/live says alive while within the deadline, then dead,
    # and the daemon exits 1 so the orchestrator restarts it.
    build_dir = _copy_build(tmp_path / "ext")
    holder(build_dir)
    # On a busy host the deadline may come before the load reaches the lock (importing torch
    # took up to ~20 s here with five test runs on two cores): stuck either way, it cannot
    # finish within 8 s, and the lock makes sure it could not finish at all.
    cfg = _config(tmp_path, tiny_model_dir, kernel_build_wait_s=600, start_timeout_s=8)
    d = DaemonProcess.start(
        cfg, wait_ready=False, timeout=90, env={"TORCH_EXTENSIONS_DIR": str(tmp_path / "ext")}
    )
    seen: list[tuple[int, str]] = []
    with d.client(timeout=5) as c:
        while d.proc.poll() is None:
            try:
                r = c.get("/health/live")
            except httpx.HTTPError:
                break
            entry = (r.status_code, r.json()["status"])
            if not seen or seen[-1] != entry:
                seen.append(entry)
            time.sleep(0.1)
    rc = d.proc.wait(30)
    assert rc == 1, d.log_tail()
    assert seen[0] == (200, "alive") and (503, "dead") in seen, seen
    line = d.wait_for("not ready within server.start_timeout_s = 8 s", 0)
    assert "reporting dead and exiting with status 1" in line
    assert not any("ready on" in line for line in d.lines)
