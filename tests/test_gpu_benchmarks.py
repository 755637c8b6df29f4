"""The device benchmarks' CPU paths: benchmarks/gpu_seeds.py on the tiny shape, gpu_daemon.py
without NVML, and gpu_check.sh's syntax. Their figures are not checked, only that every figure
the device run reports is there (the device run itself cannot be tested here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from controlplane.engine.errors import ModelLoadError
from controlplane.engine.loader import RANDOM_WEIGHTS_FILE, load_model, load_model_config
from controlplane.engine.model.quant import QuantConfig
from harness import REPO_ROOT


def _run(module: str, *args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_random_weights_directory(tmp_path: Path) -> None:
    from benchmarks.gpu_seeds import SHAPES, ensure_random_model

    model_dir = ensure_random_model("tiny", tmp_path)
    cfg = load_model_config(model_dir)
    assert cfg.hidden_size == SHAPES["tiny"]["hidden_size"]
    none = QuantConfig()

    def load() -> torch.nn.Module:
        return load_model(model_dir, cfg, torch.float32, torch.device("cpu"), 64, False, none)

    a, b = load().state_dict(), load().state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    weight = a["model.layers.0.mlp.down_proj.weight"]
    assert 0.01 < weight.std().item() < 0.03  # normal(0, 0.02)
    assert torch.equal(a["model.norm.weight"], torch.ones_like(a["model.norm.weight"]))
    (model_dir / RANDOM_WEIGHTS_FILE).write_text("[1, 2]")
    with pytest.raises(ModelLoadError, match=RANDOM_WEIGHTS_FILE):
        load()


@pytest.mark.slow  # 13 s on a quiet 2-core VM, 43 s with other work on its cores
def test_gpu_seeds_tiny_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "seeds.json"
    done = _run(
        "benchmarks.gpu_seeds",
        *("--shape", "tiny", "--device", "cpu", "--quick", "--json", str(out)),
        *("--model-root", str(tmp_path)),
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["available"] is True and r["skipped"] == {} and r["errors"] == {}, r
    for key in ("device", "startup_s", "weights_load_s", "warmup_s", "copy_bandwidth_Bps"):
        assert key in r, key
    assert r["weight_bytes"] > 0
    assert {"tok_s", "limit_tok_s", "of_limit"} <= r["batch1"].keys()
    assert {"prompt_len", "s"} <= r["ttft"].keys()
    kv = r["kv_capacity"]
    assert [row["kv_dtype"] for row in kv["rows"]] == ["bfloat16", "int8", "fp8_e4m3"]
    for row in kv["rows"]:
        assert {"max_batch", "seed_h100", "seed_scaled"} <= row.keys()
    assert [b["batch"] for b in r["batches"]] == [32, 64]
    for b in r["batches"]:
        assert {"output_tok_s", "total_tok_s", "seed_h100_tok_s", "seed_scaled_tok_s"} <= b.keys()
        assert b["partial"] is False
    assert "batch 64" in done.stdout  # the table


def test_gpu_seeds_weights_the_engine_refuses(tmp_path: Path, monkeypatch, capsys) -> None:
    import controlplane.engine
    from benchmarks import gpu_seeds
    from controlplane.engine import InvalidSettingError

    def refuse(**settings: object) -> None:
        raise InvalidSettingError("quantization", "must be one of auto, none, int8, int4")

    monkeypatch.setattr(controlplane.engine, "Engine", refuse)
    out = tmp_path / "fp8.json"
    argv = ["--shape", "tiny", "--device", "cpu", "--quick", "--weights", "fp8"]
    assert gpu_seeds.main([*argv, "--json", str(out), "--model-root", str(tmp_path)]) == 0
    r = json.loads(out.read_text())
    assert r["available"] is False and "quantization" in r["not_available"]
    assert "not available" in capsys.readouterr().out


@pytest.mark.slow
def test_gpu_daemon_without_nvml(tmp_path: Path) -> None:
    from benchmarks.gpu_daemon import nvml_state

    if nvml_state()[0]:
        pytest.skip("NVML answers here: the CPU path is not the one this machine takes")
    out = tmp_path / "daemon.json"
    done = _run(
        "benchmarks.gpu_daemon",
        *("--quick", "--json", str(out), "--model-root", str(tmp_path)),
        timeout=400,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "NVML absent" in done.stderr
    r = json.loads(out.read_text())
    assert r["nvml"] is False and "error" not in r, r.get("error")
    assert r["loadgen"]["requests_ok"] == 8
    store = r["store"]
    assert store["utilization_samples"] >= 1 and store["gpu_sample_rows"] == 0
    assert store["cost_rollups"], "no rollup row"
    for key in ("busy_usd_per_mtok_output", "all_in_usd_per_mtok_output"):
        assert key in r["cost"], key
    assert "cost per million output tokens" in done.stdout


def test_gpu_check_script_parses() -> None:
    script = REPO_ROOT / "benchmarks" / "gpu_check.sh"
    done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.slow  # ~10 s: the tiny model's engine, two profiled row counts
def test_gpu_step_profile_on_cpu(tmp_path: Path) -> None:
    """The step profile's CPU path: every row count profiled, the CPU operators ranked by
    their own time, no GPU figures (there are no kernels)."""
    out = tmp_path / "profile.json"
    done = _run(
        "benchmarks.gpu_step_profile",
        *("--device", "cpu", "--shape", "tiny", "--rows", "1,3", "--steps", "3"),
        *("--warmup", "1", "--top", "4", "--json", str(out), "--model-root", str(tmp_path)),
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["device"] == "cpu" and r["cuda_graphs"] is False
    assert [p["rows"] for p in r["profiles"]] == [1, 3]
    for p in r["profiles"]:
        assert p["steps"] == 3 and p["wall_us"] > 0 and p["kernels"] == 0
        assert p["gpu_busy_us"] is None
        assert 1 <= len(p["top"]) <= 4
        shares = [t["share"] for t in p["top"]]
        assert shares == sorted(shares, reverse=True) and 0 < sum(shares) <= 1.0001
    assert "3 rows: wall" in done.stdout


def test_union_of_kernel_intervals() -> None:
    from benchmarks.gpu_step_profile import union_us

    assert union_us([]) == 0
    # Overlapping, nested, touching and separate intervals, out of order.
    assert union_us([(10, 20), (0, 5), (12, 15), (18, 25), (25, 30), (40, 41)]) == 5 + 20 + 1
