"""The drills in drills/, at CI's size: each runs a real daemon and ends with PASS/FAIL checks.

Marked `drill`: left out of the default run (minutes of load each) and run by CI's drill step
(`python -m pytest -q -m drill`). The PostgreSQL drill restarts the real server, so it runs
last, after the tests that need PostgreSQL.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

DRILLS = Path(__file__).resolve().parents[1] / "drills"
pytestmark = pytest.mark.drill


def _drill(name: str):
    sys.path.insert(0, str(DRILLS))
    spec = importlib.util.spec_from_file_location(f"drill_{name}", DRILLS / f"{name}.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_disconnect_storm_leaves_nothing_behind():
    assert _drill("disconnect_storm").main(["--requests", "2000", "--warmup", "300"]) == 0


def test_sigkill_five_times_loses_and_doubles_no_row():
    assert _drill("sigkill_restarts").main(["--rounds", "5", "--load-seconds", "3"]) == 0


def test_idle_event_streams_cost_under_ten_percent():
    assert _drill("idle_connections").main(["--requests", "300", "--repeats", "5"]) == 0


@pytest.mark.skipif(
    not Path("/etc/postgresql").is_dir() or os.geteuid() != 0,
    reason="restarts the local PostgreSQL cluster: needs root and pg_ctlcluster",
)
def test_postgres_restart_under_load_keeps_serving_and_every_row():
    assert _drill("postgres_restart").main([]) == 0
