"""Traffic recorded by a real daemon, for the replay's tests and benchmark: a Poisson loadgen
run, two requests that share a 64-token prefix (prefix-cache hits) and one with n = 2."""

from __future__ import annotations

import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx

from harness.process import DaemonProcess

SHARED = list(range(100, 164))  # the prefix two requests share


def record_traffic(
    config: Path, *, requests: int = 30, rate: float = 6.0, seed: int = 3
) -> tuple[datetime, datetime]:
    """Serve `requests` loadgen requests (streamed, prompts of 16-96 tokens, 8-32 completion
    tokens, EOS ignored) arriving at `rate` a second, then the three extra requests, on a daemon
    started on `config` and stopped (drained, every row final). Returns a window (since, until)
    that holds exactly them: `requests` + 3 rows."""
    since = datetime.now(UTC) - timedelta(seconds=1)
    # A first start on a host builds the CPU kernels (minutes) unless TORCH_EXTENSIONS_DIR
    # points at a build.
    d = DaemonProcess.start(config, timeout=900)
    try:
        loadgen = [
            sys.executable, "-m", "controlplane", "loadgen", "--url", d.url, "--rate", str(rate),
            "--requests", str(requests), "--prompt-len", "16-96", "--output-len", "8-32",
            "--stream", "--seed", str(seed), "--token-id-range", "3-1000",
        ]  # fmt: skip
        subprocess.run(loadgen, check=True, capture_output=True, timeout=600)
        model = httpx.get(d.url + "/v1/models").json()["data"][0]["id"]
        for prompt in ([*SHARED, 7, 8, 9], [*SHARED, 10, 11]):
            body = {"model": model, "prompt": prompt, "max_tokens": 12, "ignore_eos": True}
            r = httpx.post(d.url + "/v1/completions", json=body, timeout=60)
            r.raise_for_status()
        body = {"model": model, "prompt": [5, 6, 7], "max_tokens": 10, "n": 2, "ignore_eos": True}
        httpx.post(d.url + "/v1/completions", json=body, timeout=60).raise_for_status()
    finally:
        if d.stop() != 0:
            raise RuntimeError(f"the recording daemon did not stop cleanly:{d.log_tail()}")
    return since, datetime.now(UTC) + timedelta(seconds=1)
