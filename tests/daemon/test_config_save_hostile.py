"""POST /admin/config/save against hostile config files (issue 52, item 2), on a real
`controlplane serve`:

- a file caught mid-write that drops [[api_keys]] and [[admin_tokens]]: 409 naming them, the
  file left as it is (writing it back would serve an open API at the next start);
- a file edited since the daemon applied it (the watcher has not settled it yet): 409, then
  saved once the watcher has applied it;
- a FIFO at the path: 409 naming it at once, and PATCHes and key suspensions right after work
  (the save never held the config lock while reading);
- a read stuck for good (a FUSE mount that never answers: a hung network mount, for real): the
  save answers within the read timeout, changes go on, and SIGTERM ends the daemon. The same
  with a FIFO at the path.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from controlplane.runtime.config_file import READ_TIMEOUT_S
from harness import STARTED, DaemonProcess
from tests.daemon.test_config_reload_hostile import field, replace, wait_value, write_file

TOKEN = "save-token-0123456789"
KEY = "sk-tenant-0123456789"
# SIGTERM to exit: a drain with nothing in flight, the store's last flush and the exit itself
# (7-8 s on a loaded 2-core machine; the defect: never).
EXIT_BOUND_S = 30.0


def render(tmp: Path, model: Path, max_num_seqs: int, max_queue_len: int = 256) -> str:
    """The config file: [[api_keys]] and [[admin_tokens]] last, so that a write cut short
    drops them (the issue's truncated file)."""
    lines = [
        f'data_dir = "{tmp / "data"}"',
        "# the operator's comment, kept by a save",
        "[store]",
        "flush_interval_s = 0.1",
        "[server]",
        'host = "127.0.0.1"',
        "port = 0",
        "config_watch_interval_s = 0.2",
        f"max_queue_len = {max_queue_len}",
        "[engine]",
        f'model = "{model}"',
        "max_model_len = 256",
        f"max_num_seqs = {max_num_seqs}",
        "[[api_keys]]",
        'name = "tenant"',
        f'key = "{KEY}"',
        "[[admin_tokens]]",
        'name = "ops"',
        f'token = "{TOKEN}"',
    ]
    return "\n".join(lines) + "\n"


def _start(tmp: Path, model: Path) -> tuple[DaemonProcess, httpx.Client, Path]:
    path = tmp / "cp.toml"
    path.write_text(render(tmp, model, 6))
    d = DaemonProcess.start(path)
    c = d.client(TOKEN, timeout=5)
    return d, c, path


@pytest.fixture(scope="module")
def daemon(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("save")
    d, c, path = _start(tmp, tiny_model_dir)
    STARTED.remove(d.proc)  # shared by the module's tests: this fixture stops it
    yield d, c, path, tmp, tiny_model_dir
    c.close()
    try:
        d.stop(timeout=30)
    except Exception:  # a daemon whose config lock is stuck (the defect) does not drain
        d.proc.kill()
        d.proc.wait(30)


def start_from(daemon, max_num_seqs: int, max_queue_len: int = 256) -> None:
    """A known file, applied by the watcher, and the same values live: a save then finds the
    file it last applied and nothing to write."""
    _, c, path, tmp, model = daemon
    write_file(path, render(tmp, model, max_num_seqs, max_queue_len))
    patch = {"engine": {"max_num_seqs": max_num_seqs}, "server": {"max_queue_len": max_queue_len}}
    assert c.patch("/admin/config", json=patch).status_code == 200
    deadline = time.monotonic() + 20
    while (r := save(c)[0]).status_code != 200:
        assert time.monotonic() < deadline, f"the watcher never applied the file: {r.text}"
        time.sleep(0.2)
    assert r.json()["saved"] == []


def save(c: httpx.Client, timeout: float = 5) -> tuple[httpx.Response, float]:
    started = time.monotonic()
    r = c.post("/admin/config/save", timeout=timeout)
    return r, time.monotonic() - started


def test_save_over_a_truncated_file_is_refused_and_the_file_left_unchanged(daemon):
    _, c, path, tmp, model = daemon
    start_from(daemon, 6)
    assert c.patch("/admin/config", json={"engine": {"max_num_seqs": 9}}).status_code == 200
    full = render(tmp, model, 6)
    cut = full[: full.index("[[api_keys]]")]  # a writer stopped before the keys
    path.write_text(cut)
    saves = len(_history(c, "config_file"))
    r, _ = save(c)
    assert r.status_code == 409, r.text
    error = r.json()["error"]
    assert error["param"] == "config_file"
    assert "no longer sets admin_tokens, api_keys" in error["message"], error
    assert path.read_text() == cut  # not written back with the live values
    assert len(_history(c, "config_file")) == saves  # nor audited
    # The writer finishes: the file is the one applied again, and the save goes through.
    write_file(path, full)
    r, _ = save(c)
    assert r.status_code == 200, r.text
    assert r.json()["saved"] == [{"field": "engine.max_num_seqs", "value": 9}]
    text = path.read_text()
    assert "max_num_seqs = 9" in text and "[[api_keys]]" in text and "[[admin_tokens]]" in text
    assert "# the operator's comment, kept by a save" in text


def test_save_over_a_file_edited_since_it_was_applied_is_refused(daemon):
    _, c, path, tmp, model = daemon
    start_from(daemon, 6)
    assert c.patch("/admin/config", json={"engine": {"max_num_seqs": 7}}).status_code == 200
    edited = render(tmp, model, 6, max_queue_len=300)
    write_file(path, edited)
    r, _ = save(c)  # before the watcher has settled the edit (2 s)
    assert r.status_code == 409, r.text
    message = r.json()["error"]["message"]
    assert "was edited since it was last applied (server.max_queue_len differ)" in message
    assert path.read_text() == edited
    wait_value(c, "server.max_queue_len", 300)  # the watcher applies the edit ...
    r, _ = save(c)  # ... and the save then keeps it
    assert r.status_code == 200, r.text
    assert "max_queue_len = 300" in path.read_text()
    assert "max_num_seqs = 7" in path.read_text()


def test_save_over_a_fifo_answers_at_once_and_changes_go_on(daemon):
    _, c, path, _, _ = daemon
    start_from(daemon, 6)
    replace(path, os.mkfifo)
    r, took = save(c, timeout=READ_TIMEOUT_S + 5)
    assert r.status_code == 409, r.text
    assert "a FIFO, not a regular file" in r.json()["error"]["message"]
    assert took < 1.0, took
    # The config lock is free: a PATCH, a key suspension and its undoing, right after.
    assert c.patch("/admin/config", json={"engine": {"max_num_seqs": 5}}).status_code == 200
    assert c.post("/admin/keys/tenant/suspend").status_code == 200
    assert c.post("/admin/keys/tenant/unsuspend").status_code == 200
    assert field(c, "engine.max_num_seqs") == 5
    start_from(daemon, 6)  # a regular file again: applied


def _history(c: httpx.Client, name: str) -> list[dict[str, Any]]:
    params = {"limit": 1000, "field": name}
    return c.get("/admin/config/history", params=params).json()["changes"]


# -- a read stuck for good, and SIGTERM -----------------------------------------------------------


@contextlib.contextmanager
def hung_mount(where: Path) -> Iterator[Path]:
    """A FUSE file system at `where` whose server never answers (not even the kernel's
    first request): every lookup under it blocks, as on a hung network mount. Needs root
    (CAP_SYS_ADMIN) and /dev/fuse; skips otherwise. Closing the device aborts the
    connection (every stuck call fails), then it is unmounted."""
    if not os.path.exists("/dev/fuse") or os.geteuid() != 0:
        pytest.skip("needs root and /dev/fuse for a FUSE mount that never answers")
    libc = ctypes.CDLL(None, use_errno=True)
    where.mkdir()
    fd = os.open("/dev/fuse", os.O_RDWR)
    options = f"fd={fd},rootmode=40000,user_id=0,group_id=0".encode()
    if libc.mount(b"hung", str(where).encode(), b"fuse", 0, options) != 0:
        errno = ctypes.get_errno()
        os.close(fd)
        pytest.skip(f"cannot mount FUSE here: {os.strerror(errno)}")
    try:
        yield where
    finally:
        os.close(fd)  # aborts the connection: whatever still waits on it fails now
        libc.umount2(str(where).encode(), 2)  # MNT_DETACH


@pytest.mark.parametrize("stuck", ["fifo", "hung mount"])
def test_sigterm_ends_the_daemon_with_a_config_read_stuck(stuck, tiny_model_dir, tmp_path):
    with contextlib.ExitStack() as stack:
        d, c, path = _start(tmp_path, tiny_model_dir)
        stack.callback(c.close)
        if stuck == "fifo":
            replace(path, os.mkfifo)  # nobody ever opens its other end
            why, bound = "a FIFO, not a regular file", 1.0
        else:
            mount = stack.enter_context(hung_mount(tmp_path / "mnt"))
            replace(path, lambda tmp: tmp.symlink_to(mount / "cp.toml"))
            why, bound = f"did not finish within {READ_TIMEOUT_S:g}s", READ_TIMEOUT_S + 2
        answers: list[tuple[httpx.Response, float]] = []
        thread = threading.Thread(
            target=lambda: answers.append(save(c, 3 * READ_TIMEOUT_S)), daemon=True
        )
        thread.start()
        thread.join(bound + 1)
        try:  # the config lock is free: a change right after the save
            patched = c.patch("/admin/config", json={"engine": {"max_num_seqs": 5}}, timeout=3)
        except httpx.TimeoutException:
            patched = None
        started = time.monotonic()
        d.proc.send_signal(signal.SIGTERM)
        try:
            code = d.proc.wait(EXIT_BOUND_S)
        except Exception:
            d.proc.kill()
            d.proc.wait(30)
            raise AssertionError(f"still running {EXIT_BOUND_S:g}s after SIGTERM") from None
        exited = time.monotonic() - started
        assert answers, "the save never answered"
        r, took = answers[0]
        print(f"{stuck}: save answered in {took:.2f}s; exit {exited:.2f}s after SIGTERM")
        assert code == 0
        assert r.status_code == 409 and why in r.json()["error"]["message"], r.text
        assert took < bound, took
        assert patched is not None and patched.status_code == 200
