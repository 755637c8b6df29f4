"""Hostile config files under live reload (issue 24, item 8), against a real `controlplane serve`:

- a byte that is not UTF-8, then a valid edit: the edit is applied (the watcher did not die);
- the path becomes a symlink to a directory, then a file again: later edits are applied;
- a FIFO at the path: /health keeps answering within a second (the file is never opened on the
  event loop, and a FIFO never at all); the next regular file is applied;
- a writer that writes half the file, pauses 1.5 s, then finishes: the half file is never
  applied (settle time), and a writer that stops for longer than the settle time with a file
  that drops keys gets its file held (not applied, a warning naming the keys) until it
  finishes; SIGHUP applies a file that drops keys on purpose, saying which.

One daemon serves the tests of this module in order; each starts from a known file.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from harness import STARTED, DaemonProcess

TOKEN = "reload-token-0123456789"


def render(tmp: Path, model: Path, max_num_seqs: int, max_queue_len: int = 256) -> str:
    """The config file: the keys the tests move are last, so that cutting the file in half
    drops them (what a truncated write looks like)."""
    lines = [
        f'data_dir = "{tmp / "data"}"',
        "[store]",
        "flush_interval_s = 0.1",
        "[[admin_tokens]]",
        'name = "ops"',
        f'token = "{TOKEN}"',
        "[server]",
        'host = "127.0.0.1"',
        "port = 0",
        "config_watch_interval_s = 0.2",
        # config_settle_s left at its default (2 s): the 1.5 s pause is below it.
        f"max_queue_len = {max_queue_len}",
        "[engine]",
        f'model = "{model}"',
        "max_model_len = 256",
        f"max_num_seqs = {max_num_seqs}",
    ]
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def daemon(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("reload")
    path = tmp / "cp.toml"
    path.write_text(render(tmp, tiny_model_dir, 6))
    d = DaemonProcess.start(path)
    STARTED.remove(d.proc)  # shared by the module's tests: this fixture stops it
    c = d.client(TOKEN, timeout=5)
    yield d, c, path, tmp, tiny_model_dir
    c.close()
    try:
        d.stop(timeout=30)
    except Exception:  # a daemon whose loop is stuck (the defect) does not drain: kill it
        d.proc.kill()
        d.proc.wait(30)


def field(c: httpx.Client, name: str) -> Any:
    return c.get("/admin/config").json()["fields"][name]["value"]


def wait_value(c: httpx.Client, name: str, value: Any, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while (now := field(c, name)) != value:
        assert time.monotonic() < deadline, f"{name} never became {value!r} (still {now!r})"
        time.sleep(0.1)


def replace(path: Path, make) -> None:
    """Put something new at `path` atomically: make(tmp_name) creates it, rename moves it."""
    tmp = path.with_name(path.name + ".new")
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    make(tmp)
    os.replace(tmp, path)


def write_file(path: Path, text: str | bytes) -> None:
    def make(tmp: Path) -> None:
        if isinstance(text, bytes):
            tmp.write_bytes(text)
        else:
            tmp.write_text(text)

    replace(path, make)


def start_from(daemon, max_num_seqs: int, max_queue_len: int = 256) -> None:
    """Every test's file sets the same keys (none dropped): it is applied after the settle."""
    _, c, path, tmp, model = daemon
    write_file(path, render(tmp, model, max_num_seqs, max_queue_len))
    wait_value(c, "engine.max_num_seqs", max_num_seqs)
    wait_value(c, "server.max_queue_len", max_queue_len)


def logged(d: DaemonProcess, needle: str, after: int) -> str:
    deadline = time.monotonic() + 20
    while True:
        for line in d.lines[after:]:
            if needle in line:
                return line
        assert time.monotonic() < deadline, f"no {needle!r} in:\n" + "\n".join(d.lines[after:])
        time.sleep(0.05)


# -- reading ------------------------------------------------------------------------------------


def test_read_snapshot_refuses_what_is_not_a_regular_utf8_file(tmp_path):
    from controlplane.runtime.config_file import read_snapshot

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    started = time.monotonic()
    assert "a FIFO, not a regular file" in read_snapshot(fifo).error
    assert time.monotonic() - started < 1  # never opened: nothing to block on
    link = tmp_path / "link"
    link.symlink_to(tmp_path)
    assert "a directory, not a regular file" in read_snapshot(link).error
    bad = tmp_path / "bad.toml"
    bad.write_bytes(b"[server]\n# caf\xe9\nport = 1\n")
    assert "not UTF-8 (byte 0xe9 at offset 14)" in read_snapshot(bad).error
    assert "file not found" in read_snapshot(tmp_path / "missing").error
    good = tmp_path / "good.toml"
    good.write_text("[server]\nport = 1\n")
    snap = read_snapshot(good)
    assert snap.error is None and snap.raw == {"server": {"port": 1}}


# -- the watcher against a real daemon ----------------------------------------------------------


def test_non_utf8_byte_then_a_valid_edit_is_applied(daemon):
    d, c, path, tmp, model = daemon
    start_from(daemon, 6)
    mark = len(d.lines)
    text = render(tmp, model, 9).replace("[store]", "# r\xe9sum\xe9\n[store]")
    write_file(path, text.encode("latin-1"))  # 0xe9: not UTF-8
    logged(d, "not UTF-8 (byte 0xe9", mark)
    assert field(c, "engine.max_num_seqs") == 6
    write_file(path, render(tmp, model, 7))
    wait_value(c, "engine.max_num_seqs", 7)


def test_symlink_to_a_directory_then_a_file_again(daemon):
    d, c, path, tmp, model = daemon
    start_from(daemon, 6)
    mark = len(d.lines)
    replace(path, lambda t: t.symlink_to(tmp))
    logged(d, "a directory, not a regular file", mark)
    write_file(path, render(tmp, model, 5))
    wait_value(c, "engine.max_num_seqs", 5)
    # And edits after that are still seen.
    write_file(path, render(tmp, model, 4))
    wait_value(c, "engine.max_num_seqs", 4)


def test_fifo_at_the_path_does_not_block_health(daemon):
    d, c, path, tmp, model = daemon
    start_from(daemon, 6)
    mark = len(d.lines)
    replace(path, os.mkfifo)
    # Longer than a poll plus the settle time: whatever the watcher does with it happens now.
    slowest = 0.0
    deadline = time.monotonic() + 4.0
    while time.monotonic() < deadline:
        started = time.monotonic()
        r = httpx.get(d.url + "/health", timeout=1.0)  # raises if it takes a second
        slowest = max(slowest, time.monotonic() - started)
        assert r.status_code == 200
        time.sleep(0.1)
    assert slowest < 1.0
    logged(d, "a FIFO, not a regular file", mark)
    write_file(path, render(tmp, model, 3))
    wait_value(c, "engine.max_num_seqs", 3)


def _write_slowly(path: Path, text: str, cut: int, pause_s: float) -> threading.Thread:
    """Write text[:cut] in place, pause, then the rest (an editor or a config tool that
    stalls mid-file)."""

    def run() -> None:
        with open(path, "w") as f:
            f.write(text[:cut])
            f.flush()
            os.fsync(f.fileno())
            time.sleep(pause_s)
            f.write(text[cut:])

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _watch(c: httpx.Client, seen: list[tuple[int, int]], stop: threading.Event) -> None:
    while not stop.is_set():
        fields = c.get("/admin/config").json()["fields"]
        seen.append(
            (fields["engine.max_num_seqs"]["value"], fields["server.max_queue_len"]["value"])
        )
        time.sleep(0.05)


def test_writer_pausing_mid_file_never_gets_the_half_file_applied(daemon):
    d, c, path, tmp, model = daemon
    start_from(daemon, 16, 1000)
    full = render(tmp, model, 16, 1001)
    # The cut leaves `max_queue_len = 10` (default 256 -> 10 if applied) and drops [engine]
    # (max_num_seqs 16 -> the default 32 if applied): the truncated file.
    cut = full.index("max_queue_len = 1001") + len("max_queue_len = 10")
    mark = len(d.lines)
    seen: list[tuple[int, int]] = []
    stop = threading.Event()
    with httpx.Client(base_url=d.url, headers=c.headers, timeout=5) as c2:
        watcher = threading.Thread(target=_watch, args=(c2, seen, stop), daemon=True)
        watcher.start()
        writer = _write_slowly(path, full, cut, 1.5)
        writer.join(10)
        wait_value(c, "server.max_queue_len", 1001)
        time.sleep(1.0)
        stop.set()
        watcher.join(10)
    assert seen and all(s == (16, 1000) or s == (16, 1001) for s in seen), sorted(set(seen))
    held = [line for line in d.lines[mark:] if "held" in line or "1000 -> 10," in line]
    assert not held, "\n".join(d.lines[mark:])


def test_writer_stopping_longer_than_the_settle_time_is_held_until_it_finishes(daemon):
    d, c, path, tmp, model = daemon
    start_from(daemon, 16, 1000)
    full = render(tmp, model, 16, 1002)
    cut = full.index("max_queue_len = 1002") + len("max_queue_len = 10")
    mark = len(d.lines)
    writer = _write_slowly(path, full, cut, 6.0)  # settle is 2 s
    line = logged(d, "held: ", mark)
    assert "engine.max_num_seqs" in line and "engine.model" in line and "SIGHUP" in line, line
    assert (field(c, "engine.max_num_seqs"), field(c, "server.max_queue_len")) == (16, 1000)
    writer.join(15)
    wait_value(c, "server.max_queue_len", 1002)
    assert field(c, "engine.max_num_seqs") == 16


def test_sighup_applies_a_file_that_drops_keys_and_says_so(daemon):
    d, c, path, tmp, model = daemon
    start_from(daemon, 12)
    mark = len(d.lines)
    write_file(path, render(tmp, model, 12).replace("max_num_seqs = 12\n", ""))
    logged(d, "held: ", mark)  # the watcher holds it ...
    assert field(c, "engine.max_num_seqs") == 12
    mark = len(d.lines)
    d.proc.send_signal(signal.SIGHUP)  # ... the operator confirms it
    line = logged(d, "back to their defaults: engine.max_num_seqs", mark)
    assert "SIGHUP" in line
    wait_value(c, "engine.max_num_seqs", 32)
