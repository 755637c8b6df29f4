"""Kernels built on purpose: `controlplane kernels build|status`, a shipped build loading where
there is no compiler (the Docker image's final stage), the daemon's caches, and what
/admin/stats and /metrics say about the kernels and the compiled step.

The commands run as subprocesses with PATH emptied where the toolchain must be missing: the
interpreter is called by its path, so nothing else on PATH is needed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from controlplane.engine.kernels import cpu_ops, manifest
from controlplane.engine.kernels.caches import (
    EXTENSIONS_VAR,
    INDUCTOR_VAR,
    cache_root,
    use_caches,
)
from harness.config import ADMIN_TOKEN
from tests.kernels import require_kernels


def _cli(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "controlplane", "kernels", *args],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


def _no_toolchain(tmp_path: Path, ext: Path) -> dict[str, str]:
    """An environment with nothing on PATH (no c++, no system ninja: the `ninja` wheel, a
    dependency, is found by its module) and `ext` as the extensions."""
    empty = tmp_path / "empty-bin"
    empty.mkdir(exist_ok=True)
    return {"PATH": str(empty), EXTENSIONS_VAR: str(ext), "CXX": "c++"}


def _ship(tmp_path: Path) -> Path:
    """What deploy/Dockerfile's final stage holds: this machine's built library and its
    manifest, copied alone (no objects, no build.ninja) into a fresh extensions directory."""
    built = Path(describe_build()["build_dir"])
    ext = tmp_path / "shipped"
    (ext / built.name).mkdir(parents=True)
    for name in (f"{built.name}.so", manifest.NAME):
        shutil.copy2(built / name, ext / built.name / name)
    return ext


def describe_build() -> dict:
    require_kernels()
    return cpu_ops.describe()


def test_the_kernels_build_on_this_machine():
    """CI fails here (not skips) when the kernels do not build on its machine."""
    require_kernels()
    info = cpu_ops.describe()
    assert info["state"] == "ready" and info["reason"] == ""
    assert (Path(info["build_dir"]) / manifest.NAME).is_file()
    record = json.loads((Path(info["build_dir"]) / manifest.NAME).read_text())
    assert record["sources"] == cpu_ops.sources_digest()
    assert set(record["cpu_flags"]) <= manifest.cpu_flags()  # built for what this CPU has


def test_cpu_flags_named_as_proc_cpuinfo_names_them():
    flags = ["-O3", "-mavx512f", "-mavx512vnni", "-mamx-tile", "-mavx512bf16", "-mfma"]
    assert manifest.cpu_flags_needed(flags) == [
        "amx_tile",
        "avx512_bf16",
        "avx512_vnni",
        "avx512f",
        "fma",
    ]


def test_a_shipped_build_loads_and_runs_without_a_compiler(tmp_path):
    ext = _ship(tmp_path)
    env = _no_toolchain(tmp_path, ext)
    status = _cli("status", "--json", "--data-dir", str(tmp_path / "data"), env=env)
    assert status.returncode == 0, status.stdout + status.stderr[-2000:]
    info = json.loads(status.stdout)
    assert info["kernels"] == "ok" and info["loaded"] == "shipped", info
    # The compiler is missing; ninja is not (the package's dependency, found off PATH).
    assert info["toolchain_missing"] == ["C++ compiler (c++)"]
    assert info["build_dir"].startswith(str(ext))
    # A kernel computes what torch does, loaded from the copy.
    code = """
import torch
from controlplane.engine.kernels import cpu_ops
assert cpu_ops.available(), cpu_ops.build_error()
torch.manual_seed(0)
x = torch.randn(3, 64)
w = torch.randint(-127, 128, (32, 64), dtype=torch.int8)
s = torch.rand(32) + 0.5
got = torch.ops.controlplane_cpu.int8_linear(x, w, s)
want = torch.nn.functional.linear(x, w.float()) * s
print(cpu_ops.describe()["loaded"], torch.allclose(got, want, rtol=1e-4, atol=1e-3))
"""
    run = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["shipped", "True"], run.stdout + run.stderr[-2000:]


def test_a_shipped_build_of_other_sources_is_not_loaded(tmp_path):
    ext = _ship(tmp_path)
    (path,) = ext.glob(f"*/{manifest.NAME}")
    record = json.loads(path.read_text())
    path.write_text(json.dumps({**record, "sources": "0" * 64}))
    env = _no_toolchain(tmp_path, ext)
    status = _cli("status", "--data-dir", str(tmp_path / "data"), env=env)
    assert status.returncode == 1
    assert "fallback: no C++ compiler (c++) on PATH, and no shipped build" in status.stdout
    build = _cli("build", "--data-dir", str(tmp_path / "data"), env=env)
    assert build.returncode == 1
    assert "controlplane: kernels: build failed: RuntimeError: cannot build the kernels here" in (
        build.stderr
    ), build.stderr[-2000:]
    assert "are for other sources, torch or CPUs" in build.stderr


def test_status_and_build_name_what_is_missing(tmp_path):
    env = _no_toolchain(tmp_path, tmp_path / "nothing-built")
    status = _cli("status", "--data-dir", str(tmp_path / "data"), env=env)
    assert status.returncode == 1
    assert status.stdout.splitlines()[0].split(None, 1) == [
        "kernels",
        "fallback: no C++ compiler (c++) on PATH, and no shipped build fits this machine",
    ]
    assert "missing C++ compiler (c++)" in status.stdout
    build = _cli("build", "--data-dir", str(tmp_path / "data"), env=env)
    assert build.returncode == 1
    assert "build failed" in build.stderr and "none is there" in build.stderr, build.stderr


def test_build_ships_what_an_image_loads_first(tmp_path):
    """`kernels build --ship DIR` where this machine's build is cached (the session's
    extensions directory): it loads it, says where, and copies the library and manifest to
    DIR. A process with CONTROLPLANE_KERNELS_DIR=DIR loads that copy, compiler or not, and
    builds nothing in its own (empty) extensions directory."""
    info = describe_build()
    env = {EXTENSIONS_VAR: info["extensions_dir"]}
    shipped = tmp_path / "kernels"
    build = _cli("build", "--ship", str(shipped), "--data-dir", str(tmp_path / "data"), env=env)
    assert build.returncode == 0, build.stderr[-2000:]
    assert f"kernels: building {info['library']}" in build.stdout, build.stdout
    assert "kernels: ok in" in build.stdout and info["library"] in build.stdout
    assert sorted(p.name for p in (shipped / info["library"]).iterdir()) == sorted(
        [f"{info['library']}.so", manifest.NAME]
    )
    empty = tmp_path / "ext"
    env = {EXTENSIONS_VAR: str(empty), cpu_ops.SHIPPED_VAR: str(shipped)}
    status = _cli("status", "--json", "--data-dir", str(tmp_path / "data"), env=env)
    assert status.returncode == 0, status.stdout + status.stderr[-2000:]
    got = json.loads(status.stdout)
    assert (got["kernels"], got["loaded"]) == ("ok", "shipped")
    assert got["build_dir"] == str(shipped / info["library"])
    assert not empty.exists() or not any(empty.iterdir())


def test_caches_go_under_the_data_directory_unless_the_environment_says(tmp_path):
    root = cache_root(tmp_path / "data")
    assert root == tmp_path / "data" / "cache"
    assert cache_root(tmp_path / "data", str(tmp_path / "elsewhere")) == tmp_path / "elsewhere"
    env: dict[str, str] = {}
    caches = use_caches(root, env)
    assert env == {
        EXTENSIONS_VAR: str((root / "torch_extensions").resolve()),
        INDUCTOR_VAR: str((root / "inductor").resolve()),
    }
    assert caches.from_env == () and (root / "inductor").is_dir()
    env = {EXTENSIONS_VAR: "/opt/kernels"}
    caches = use_caches(root, env)
    assert env[EXTENSIONS_VAR] == "/opt/kernels" and caches.from_env == (EXTENSIONS_VAR,)
    assert env[INDUCTOR_VAR] == str((root / "inductor").resolve())


def test_kernels_parse_without_torch():
    code = (
        "import sys\nfrom controlplane.cli import build_parser\n"
        "build_parser().parse_args(['kernels', 'status'])\nprint('torch' in sys.modules)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.stdout.strip() == "False", run.stderr


def test_stats_and_metrics_say_what_the_engine_runs_on(make_daemon):
    d = make_daemon(admin=True)
    stats = d.client(ADMIN_TOKEN).get("/admin/stats").json()
    loaded = cpu_ops.available() or torch.cuda.is_available()
    assert stats["kernels"] == (
        {"status": "ok", "reason": None}
        if loaded
        else {"status": "fallback", "reason": cpu_ops.build_error()}
    )
    assert stats["compiled_step"] == "off"  # the suite keeps compile off (tests/conftest.py)
    assert stats["compiled_max_rows"] is None
    assert stats["cpu_kernels"]["state"] in ("ready", "failed", "unused")
    text = d.client().get("/metrics").text
    assert f'controlplane:kernels_loaded{{model_name="{stats["model"]}",reason=""}} 1.0' in text
    assert f'controlplane:compiled_step{{model_name="{stats["model"]}",state="off"}} 1.0' in text
    assert f'controlplane:compiled_step{{model_name="{stats["model"]}",state="ready"}} 0.0' in text


def test_the_image_builds_the_kernels_in_a_stage_and_ships_them():
    """Docker is not part of CI: the Dockerfile's shape is checked here, and what its final
    stage does (load the shipped copy, no build) by the tests above."""
    text = (Path(__file__).resolve().parents[2] / "deploy" / "Dockerfile").read_text()
    build, final = text.split("\nFROM python:3.11-slim\n")
    assert "FROM python:3.11-slim AS build" in build
    assert "apt-get install -y --no-install-recommends g++" in build
    assert "controlplane kernels build" in build and "--ship /opt/controlplane/kernels" in build
    assert "COPY --from=build /opt/controlplane/kernels /opt/controlplane/kernels" in final
    assert f"{cpu_ops.SHIPPED_VAR}=/opt/controlplane/kernels" in final
    # inductor compiles the decode step's graphs at run time: the final image keeps g++.
    assert "apt-get install -y --no-install-recommends g++" in final
