"""The `:` command line and the `/` filter, as a terminal shows them while they are typed: the
rendered screen under Textual's pilot at three sizes, and a real `controlplane tui` in tmux
against a real daemon (what an operator sees). The prompt was once hidden under the footer (two
widgets docked at the bottom overlap) while its widget held the typed text."""

from __future__ import annotations

import asyncio
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from harness import InProcessDaemon
from harness.config import clean_env
from tests.admin.test_admin_api import TOKEN
from tests.tui.support import fake_app, loaded, screen_text, wait_until
from tests.tui.test_tui import start_daemon

SIZES = [(80, 24), (100, 30), (120, 40)]
SIZE_IDS = ["80x24", "100x30", "120x40"]


def prompt_line(lines: list[str], mark: str, text: str) -> int | None:
    """The row showing the prompt `mark` (`:` or `/`) followed by the typed `text`."""
    return next((i for i, line in enumerate(lines) if line.strip().startswith(mark + text)), None)


@pytest.mark.parametrize("size", SIZES, ids=SIZE_IDS)
def test_the_prompt_shows_what_is_typed_on_screen(size):
    async def main() -> None:
        app = fake_app()
        async with app.run_test(size=size) as pilot:
            await loaded(pilot)
            for key, mark, text in (("colon", ":", "drain-typed"), ("slash", "/", "bob-typed")):
                await pilot.press(key, *text)
                # The rendered rows, as the terminal gets them: the typed text on the row above
                # the footer (and the footer says how to close the prompt).
                await wait_until(
                    pilot,
                    lambda m=mark, t=text: prompt_line(screen_text(app).splitlines(), m, t),
                    5,
                    f"{mark}{text} on screen",
                )
                lines = screen_text(app).splitlines()
                assert len(lines) == size[1]
                assert prompt_line(lines, mark, text) == size[1] - 2, lines[-3:]
                assert "esc Close" in lines[-1], lines[-1]
                await pilot.press("escape")
                await wait_until(pilot, lambda: "q Quit" in screen_text(app), 5, "prompt closed")
                assert prompt_line(screen_text(app).splitlines(), mark, text) is None

    asyncio.run(main())


# -- a real terminal ---------------------------------------------------------------------------
class Tmux:
    """A tmux server of this test's own (its own socket: another tmux on the machine is not
    touched), one detached session running `command`."""

    def __init__(self, command: list[str], size: tuple[int, int]) -> None:
        self.socket = f"cp-test-{id(self)}"
        self("new-session", "-d", "-s", "t", "-x", str(size[0]), "-y", str(size[1]),
             shlex.join(command))  # fmt: skip

    def __call__(self, *args: str) -> str:
        argv = ["tmux", "-L", self.socket, "-f", "/dev/null", *args]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=10, env=clean_env())
        assert done.returncode == 0, (argv, done.stderr)
        return done.stdout

    def screen(self) -> str:
        return self("capture-pane", "-p", "-t", "t")

    def wait_for(self, cond: Callable[[str], Any], timeout: float, what: str) -> str:
        deadline = time.monotonic() + timeout
        while True:
            text = self.screen()
            if cond(text):
                return text
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}; the terminal shows:\n{text}")
            time.sleep(0.1)

    def close(self) -> None:
        subprocess.run(["tmux", "-L", self.socket, "kill-server"], capture_output=True, timeout=10)


@pytest.fixture
def real_daemon(tiny_model_dir, tmp_path) -> Iterator[InProcessDaemon]:
    d = start_daemon(tmp_path, tiny_model_dir)
    yield d
    d.stop()


@pytest.mark.serial  # 10 s for a relayout: missed once beside a parallel worker
@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
def test_the_prompt_shows_what_is_typed_in_a_real_terminal(real_daemon):
    cmd = ["env", "TERM=xterm-256color", sys.executable, "-m", "controlplane", "tui",
           "--url", real_daemon.url, "--token", TOKEN]  # fmt: skip
    tmux = Tmux(cmd, SIZES[0])
    try:
        tmux.wait_for(lambda s: "q Quit" in s and "Live requests" in s, 60, "the dashboard")
        for width, height in SIZES:
            tmux("resize-window", "-t", "t", "-x", str(width), "-y", str(height))
            tmux.wait_for(
                # Laid out again at the new size: the footer reaches the right edge.
                lambda s, w=width, h=height: (
                    len(s.splitlines()) == h and len(s.splitlines()[-1].rstrip()) >= w - 2
                ),
                10,
                f"{width}x{height}",
            )
            for key, mark, text in ((":", ":", "drain-typed"), ("/", "/", "bob-typed")):
                tmux("send-keys", "-t", "t", key)
                # The footer changes as the prompt opens (it did before the fix as well).
                tmux.wait_for(lambda s: "q Quit" not in s, 10, f"{key} taken")
                tmux("send-keys", "-t", "t", "-l", text)
                shown = tmux.wait_for(
                    lambda s, m=mark, t=text: prompt_line(s.splitlines(), m, t) is not None,
                    10,
                    f"{mark}{text} on the terminal at {width}x{height}",
                )
                assert prompt_line(shown.splitlines(), mark, text) == height - 2, shown
                tmux("send-keys", "-t", "t", "Escape")
                tmux.wait_for(lambda s: "q Quit" in s, 10, "the prompt closed")
        tmux("send-keys", "-t", "t", "q")
    finally:
        tmux.close()
