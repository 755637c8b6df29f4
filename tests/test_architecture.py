"""The shape of the code, checked from the source (see README, "How the daemon is built").

The import graph is read with `ast` from every module under controlplane/: module-level and
function-level imports both count (a lazy import is still a dependency). Imports under
`if TYPE_CHECKING:` count too: type-only dependencies on the daemon were how the layers below
it ended up calling back into it, so they must not come back. Importing `a.b.c` is an edge to
`a.b.c` only, not to the parent packages' __init__ (Python has those in sys.modules already,
so they cannot form a cycle of their own).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "controlplane"

# The engine's public API: what a module outside controlplane/engine/ may import from it.
# Everything else there (engine.py, async_engine.py, tokenizer, block pool, scheduler, model
# code...) is reached only through the runtime (controlplane.runtime.runtime), and the daemon
# that wires it (controlplane.daemon) builds the engine.
ENGINE_PUBLIC = {
    "controlplane.engine",  # lazy __init__: AsyncEngine, Engine, LLM, the types, the errors
    "controlplane.engine.errors",
    "controlplane.engine.types",  # torch-free RequestOutput, StepStats, RequestMetrics...
    "controlplane.engine.settings",  # EngineSettings and its checks (the config file)
    "controlplane.engine.sampling_params",  # SamplingParams (the /v1 request parser)
    "controlplane.engine.structured",  # StructuredOutput (the /v1 request parser)
    "controlplane.engine.gguf.known",  # model catalog: default model paths and names
    "controlplane.engine.demo_model",  # `controlplane demo-model` and the default model
    "controlplane.engine.kernels.caches",  # the daemon's kernel and inductor cache directories
    "controlplane.engine.kernels.cpu_ops",  # `controlplane kernels`: build, load, state
    "controlplane.engine.kernels.manifest",  # `controlplane kernels build --ship`
    "controlplane.engine.simulation",  # the scheduler without the model (capacity planning)
}
ENGINE_HANDLES = {"controlplane.runtime.runtime", "controlplane.daemon"}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in PKG.rglob("*.py")}


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _resolve(module: str, name: str | None) -> str | None:
    """The controlplane module an import names: `from pkg import sub` is the submodule when
    there is one, else the package."""
    if name is not None and f"{module}.{name}" in MODULES:
        return f"{module}.{name}"
    return module if module in MODULES else None


def imports_of(name: str) -> set[str]:
    tree = ast.parse(MODULES[name].read_text())
    is_pkg = MODULES[name].name == "__init__.py"
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _resolve(alias.name, None)
                if target:
                    out.add(target)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package
                pkg = name.split(".") if is_pkg else name.split(".")[:-1]
                pkg = pkg[: len(pkg) - node.level + 1]
                base = ".".join([*pkg, base] if base else pkg)
            for alias in node.names:
                target = _resolve(base, alias.name)
                if target:
                    out.add(target)
    out.discard(name)
    return out


GRAPH = {name: imports_of(name) for name in MODULES}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_graph_is_read() -> None:
    # A parser that found nothing would pass every rule below.
    assert "controlplane.runtime.runtime" in GRAPH["controlplane.daemon"]
    assert "controlplane.asgi" in GRAPH["controlplane.daemon"]
    assert "controlplane.admin.routes" in GRAPH["controlplane.asgi"]
    assert "controlplane.runtime.runtime" in GRAPH["controlplane.openai.routes"]  # TYPE_CHECKING


def test_no_import_cycles_between_modules() -> None:
    # Among modules, not packages: the packages are the rooms of the README's diagram, and
    # the engine's lazy __init__ and its submodules legitimately import each other's names.
    assert _cycles(GRAPH) == []


def test_the_cycle_checker_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_only_the_daemon_imports_the_daemon() -> None:
    users = sorted(m for m, deps in GRAPH.items() if "controlplane.daemon" in deps)
    assert users == ["controlplane.cli"]


def test_nothing_above_the_engine_reaches_into_it() -> None:
    bad = {
        module: sorted(
            dep
            for dep in deps
            if dep.startswith("controlplane.engine.") and dep not in ENGINE_PUBLIC
        )
        for module, deps in GRAPH.items()
        if not module.startswith("controlplane.engine") and module not in ENGINE_HANDLES
    }
    assert {m: d for m, d in bad.items() if d} == {}


API_PACKAGES = ("controlplane.openai", "controlplane.admin")
# Below both APIs: what /v1 and /admin share, the runtime they are handed, and the jobs.
BELOW_THE_APIS = (
    "controlplane.telemetry",
    "controlplane.http",
    "controlplane.runtime",
    "controlplane.jobs",
    "controlplane.accounting",
    "controlplane.autopilot",
    "controlplane.store",
    "controlplane.engine",
    "controlplane.tenants",
)


def test_nothing_below_the_apis_imports_an_api_package() -> None:
    bad = {
        module: sorted(d for d in deps if d.startswith(API_PACKAGES))
        for module, deps in GRAPH.items()
        if module.startswith(BELOW_THE_APIS)
    }
    assert {m: d for m, d in bad.items() if d} == {}


def test_the_two_apis_import_neither_each_other() -> None:
    # They meet only in controlplane.asgi, the daemon's HTTP surface, which mounts both.
    bad = {
        module: sorted(
            d
            for d in deps
            if d.startswith(API_PACKAGES) and d.split(".")[1] != module.split(".")[1]
        )
        for module, deps in GRAPH.items()
        if module.startswith(API_PACKAGES)
    }
    assert {m: d for m, d in bad.items() if d} == {}


def test_the_layer_rule_sees_the_api_packages() -> None:
    # A rule over modules that do not exist would pass whatever the code does.
    assert any(m.startswith("controlplane.openai.") for m in GRAPH)
    assert any(m.startswith("controlplane.admin.") for m in GRAPH)
    assert all(any(m.startswith(p) for m in GRAPH) for p in BELOW_THE_APIS)


def test_the_field_error_is_a_leaf() -> None:
    # Everything may import it, the engine included: it must import nothing of ours.
    assert GRAPH["controlplane.errors"] == set()


@pytest.mark.parametrize(
    "module",
    [
        "controlplane.errors",
        "controlplane.engine.types",
        "controlplane.engine",
        "controlplane.common",
        "controlplane.telemetry.stats",
        "controlplane.telemetry.metrics",
        "controlplane.accounting.utilization",
        "controlplane.client.loadgen",
    ],
)
def test_type_and_stats_modules_do_not_import_torch(module: str) -> None:
    code = f"import sys, {module}; sys.exit('torch' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, f"importing {module} imports torch\n{result.stderr}"


def _device_tensors(tree: ast.AST) -> list[int]:
    """Lines of `torch.tensor(..., device=...)` calls: host values copied to a device."""
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "tensor"
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "torch"
        and any(k.arg == "device" for k in node.keywords)
    ]


def test_host_values_reach_the_device_through_transfer() -> None:
    """torch.tensor(values, device=cuda) copies from pageable memory and waits for the device
    first; in a step that undoes asynchronous scheduling (engine/transfer.py says why). Host
    values go through transfer.to_device / copy_into instead."""
    found = {
        name: lines
        for name, path in MODULES.items()
        if (lines := _device_tensors(ast.parse(path.read_text())))
    }
    assert not found, f"torch.tensor(..., device=...): use controlplane.engine.transfer: {found}"
    assert _device_tensors(ast.parse("import torch\nx = torch.tensor([1], device=dev)")) == [2]
