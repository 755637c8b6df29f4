"""The daemon harness (harness/) is the one launcher of the tests, the drills and the benchmarks:
no copy of it comes back (no second `free_port`, no `sys.path` edits), it stays out of the
wheel, and its config writer and environment scrub do what they say."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

from harness import clean_env, free_port, write_config

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("tests", "drills", "benchmarks", "harness")


def sources() -> list[Path]:
    return sorted(p for folder in FOLDERS for p in (ROOT / folder).rglob("*.py"))


def defines_free_port(tree: ast.AST) -> bool:
    return any(
        isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == "free_port"
        for node in ast.walk(tree)
    )


def edits_sys_path(tree: ast.AST) -> bool:
    """A call of sys.path.<anything> (insert, append, extend), or an assignment to sys.path."""

    def is_sys_path(node: ast.AST) -> bool:
        return (
            isinstance(node, ast.Attribute)
            and node.attr == "path"
            and isinstance(node.value, ast.Name)
            and node.value.id == "sys"
        )

    for node in ast.walk(tree):
        call = isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
        if call and is_sys_path(node.func.value):
            return True
        if isinstance(node, ast.Assign | ast.AugAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(is_sys_path(t) for t in targets):
                return True
    return False


def test_the_checks_see_what_they_look_for():
    assert defines_free_port(ast.parse("def free_port():\n    return 0\n"))
    assert edits_sys_path(ast.parse("import sys\nsys.path.insert(0, 'x')\n"))
    assert edits_sys_path(ast.parse("import sys\nsys.path += ['x']\n"))
    assert not edits_sys_path(ast.parse("import sys\nprint(sys.path[0])\n"))


def test_one_free_port_and_no_sys_path_edits():
    files = sources()
    assert len(files) > 50  # the folders were read
    free_ports, path_edits = [], []
    for path in files:
        tree = ast.parse(path.read_text(), str(path))
        if defines_free_port(tree):
            free_ports.append(path.relative_to(ROOT).as_posix())
        if edits_sys_path(tree):
            path_edits.append(path.relative_to(ROOT).as_posix())
    assert free_ports == ["harness/config.py"]
    assert path_edits == [], "run as `python -m <package>.<module>` from the root instead"


def test_the_harness_is_not_in_the_wheel():
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "packages"
    ]
    assert packages and all(p == "controlplane" or p.startswith("controlplane.") for p in packages)


def test_write_config_renders_tables_and_arrays_of_tables(tmp_path):
    path = write_config(
        tmp_path / "cp.toml",
        tmp_path / "data",
        tmp_path / "model",
        server={"max_queue_len": 8},
        engine={"dtype": "float32", "enable_prefix_caching": False},
        store={"url": 'sqlite:///a "b"\\c'},
        api_keys=[{"name": "a", "key": "sk-a"}, {"name": "b", "key": "sk-b"}],
    )
    assert tomllib.loads(path.read_text()) == {
        "data_dir": str(tmp_path / "data"),
        "server": {"host": "127.0.0.1", "port": 0, "max_queue_len": 8},
        "engine": {
            "model": str(tmp_path / "model"),
            "dtype": "float32",
            "enable_prefix_caching": False,
        },
        "store": {"url": 'sqlite:///a "b"\\c'},
        "api_keys": [{"name": "a", "key": "sk-a"}, {"name": "b", "key": "sk-b"}],
    }


def test_clean_env_drops_inherited_settings_and_keeps_the_given_ones(monkeypatch):
    monkeypatch.setenv("CONTROLPLANE_DATA_DIR", "/elsewhere")
    monkeypatch.setenv("MALLOC_ARENA_MAX", "2")
    monkeypatch.setenv("HARNESS_TEST_KEEP", "1")
    env = clean_env({"CONTROLPLANE_SERVER__PORT": "0"})
    assert "CONTROLPLANE_DATA_DIR" not in env and "MALLOC_ARENA_MAX" not in env
    assert env["CONTROLPLANE_SERVER__PORT"] == "0" and env["HARNESS_TEST_KEEP"] == "1"
    assert env["PYTHONUNBUFFERED"] == "1"
    assert env["CONTROLPLANE_ENGINE__COMPILE"] == "off"  # the suite's choice (conftest) stays


def test_free_port_is_bindable():
    import socket

    port = free_port()
    assert 0 < port < 65536
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:  # taken since, by another process of a busy machine: rare
            pytest.skip("the port was taken in between")
