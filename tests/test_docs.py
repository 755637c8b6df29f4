"""The documentation site (mkdocs.yml, docs/): it builds with --strict (a broken link or anchor,
or a page left out of the nav, fails it), its configuration reference, generated from the config
model, names every field and environment variable, and the README's quickstart commands are the
ones `.ci/run` runs."""

from __future__ import annotations

import dataclasses
import html
import importlib.util
import os
import re
import subprocess
import sys
import typing
from pathlib import Path
from types import ModuleType

import pytest

from controlplane import config
from controlplane.engine.settings import EngineSettings

REPO = Path(__file__).resolve().parent.parent
DOCS = REPO / "docs"
HOOK = DOCS / "hooks" / "config_reference.py"


def load_hook() -> ModuleType:
    """The hook module, loaded as MkDocs loads it (from its path, registered in sys.modules)."""
    spec = importlib.util.spec_from_file_location("docs_hook_config_reference", HOOK)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def model_sections() -> dict[str, set[str]]:
    """Every key of the config model by table ("" for the top level), read from the dataclasses
    here, not through the hook."""
    hints = typing.get_type_hints(config.Config)
    out: dict[str, set[str]] = {"": set()}
    for f in dataclasses.fields(config.Config):
        cls = hints[f.name]
        if typing.get_origin(cls) is tuple:
            cls = typing.get_args(cls)[0]
        if dataclasses.is_dataclass(cls):
            out[f.name] = {g.name for g in dataclasses.fields(cls)}
        else:
            out[""].add(f.name)
    assert out["engine"] == set(EngineSettings.field_names())
    return out


def text_of(page: Path) -> str:
    return html.unescape(re.sub(r"<[^>]+>", "", page.read_text()))


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return out


def test_site_builds_strict_with_every_page(site):
    pages = sorted(p.stem for p in DOCS.glob("*.md"))
    assert len(pages) >= 15, pages
    for name in pages:
        built = site / ("index.html" if name == "index" else f"{name}/index.html")
        assert built.is_file(), name
    # The generated page is in the site, and the quickstart included from the README.
    assert (site / "config-reference" / "index.html").is_file()
    assert "pip install torch==" in text_of(site / "getting-started" / "index.html")


def test_config_reference_names_every_field_and_environment_variable(site):
    """A field added to the model without reaching the reference fails here."""
    markdown = load_hook().render()
    tables = re.split(r"^## ", markdown, flags=re.M)[1:]
    found: dict[str, set[str]] = {}
    for table in tables:
        title, _, body = table.partition("\n")
        name = "" if title == "Top level" else title.strip("[]")
        keys = re.findall(r"^### <code>([^<]+)</code> \{ #([^ ]+) \}$", body, re.M)
        found[name] = {html.unescape(key) for key, _ in keys}
        # Each key's anchor is its dotted name, unique on the page.
        assert [a for _, a in keys] == [
            f"{name}.{html.unescape(k)}" if name else html.unescape(k) for k, _ in keys
        ]
    assert found == model_sections()
    built = text_of(site / "config-reference" / "index.html")
    for name in config.env_names():
        assert name in built, name
    for section, keys in model_sections().items():
        for key in keys:
            assert key in built, f"{section}.{key}"


def test_config_reference_is_one_block_per_key(site):
    """No six-column table (it broke environment names mid-word and cut the descriptions at
    1400 px): each key is a heading with its dotted name as anchor, followed by its type,
    default, live or restart, environment variable and description, before the next key."""
    page = (site / "config-reference" / "index.html").read_text()
    assert "<table" not in page
    rows = {(s.name, r.key): r for s in load_hook().sections() for r in s.rows}
    for section, keys in model_sections().items():
        for key in keys:
            anchor = f"{section}.{key}" if section else key
            start = page.index(f'id="{anchor}"')
            end = page.find("<h", page.index("</h3>", start))
            block = html.unescape(re.sub(r"<[^>]+>", "", page[start:end]))
            row = rows[section, key]
            assert f"type {row.type}" in block and f"default {row.default}" in block, anchor
            assert ("live" if row.live else "restart") in block, anchor
            assert row.env in block, anchor
            doc = " ".join(row.doc.replace("`", "").split())
            assert doc[:80] in " ".join(block.split()), anchor


def test_config_reference_reads_comments_from_the_source():
    rows = {
        (s.name, r.key): r for s in load_hook().sections() for r in s.rows
    }  # (table, key) -> Row
    # A comment above the field, a comment at the end of its line, an engine field's doc.
    assert rows["server", "max_queue_len"].doc.startswith("Waiting requests beyond this get 429")
    assert rows["store", "batch_size"].doc == "most rows per write transaction"
    assert (
        rows["engine", "max_num_seqs"].doc
        == EngineSettings.__dataclass_fields__["max_num_seqs"].metadata["doc"]
    )
    # Fields written together share their block comment; live and environment as the daemon has them.
    assert rows["autopilot", "itl_p99_ms"].doc == rows["autopilot", "ttft_p99_ms"].doc
    assert rows["engine", "max_num_seqs"].live and not rows["engine", "block_size"].live
    assert rows["server", "port"].env == "CONTROLPLANE_SERVER__PORT"
    assert rows["", "data_dir"].env == "CONTROLPLANE_DATA_DIR"
    assert rows["engine", "kv_cache_memory_bytes"].default == "1073741824 (1 GiB)"


def test_config_reference_does_not_import_torch():
    code = (
        "import importlib.util, sys; "
        f"spec = importlib.util.spec_from_file_location('hook', {str(HOOK)!r}); "
        "m = importlib.util.module_from_spec(spec); sys.modules['hook'] = m; "
        "spec.loader.exec_module(m); m.render(); "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr


def test_configuration_page_names_only_real_keys():
    """docs/configuration.md keeps no hand-written key table (the generated reference is the one
    list, and it links there), and every `table.key` it names in passing exists."""
    sections = model_sections()
    text = (DOCS / "configuration.md").read_text()
    assert "](config-reference.md)" in text
    assert not re.search(r"^\| *key *\|", text, re.M), "a hand-written key table is back"
    named = re.findall(r"(?<![\w./])([a-z_]+)\.([a-z_]+)\b", text)
    checked = [(table, key) for table, key in named if table in sections and table]
    assert len(checked) >= 5, named
    for table, key in checked:
        assert key in sections[table], f"{table}.{key}"


def quickstart_block(name: str) -> str:
    """The README's quickstart block `name` (between its snippet markers, which the docs include)."""
    readme = (REPO / "README.md").read_text()
    quickstart = readme.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    block = re.search(
        rf"--8<-- \[start:{name}\] -->\n```bash\n(.*?)```\n<!-- --8<-- \[end:{name}\]",
        quickstart,
        re.S,
    )
    assert block, f"README quickstart has no {name} block"
    return block.group(1)


def ci_commands() -> set[str]:
    """.ci/run's commands, each as typed in a terminal: without `-q` on pip installs, leading
    VAR=value assignments and a trailing `&` or `|| ...`."""
    out = set()
    for line in (REPO / ".ci" / "run").read_text().splitlines():
        line = re.sub(r"^(\w+=\S+ )+", "", line.strip())
        line = re.sub(r"\s*(\|\|.*|&)$", "", line).replace("pip install -q ", "pip install ")
        out.add(line)
    return out


def test_readme_quickstart_commands_are_what_ci_runs():
    install = quickstart_block("install").strip()
    commands = [c.strip() for c in install.split("&&")]
    assert commands[0].startswith("pip install torch==") and commands[-1] == "controlplane serve"
    tests = quickstart_block("test").strip()
    assert tests == (
        'python -m pytest -q -n 2 --dist loadfile -m "not serial and not drill"'
        " && python -m pytest -q -m serial"
    )
    ci = ci_commands()
    for command in [*commands, tests]:
        assert command in ci, command


def test_readme_links_point_at_files():
    """The README's map of the docs links to pages that exist (MkDocs checks the pages' own
    links, not the README's)."""
    readme = (REPO / "README.md").read_text()
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", readme)
    local = [link for link in links if "://" not in link]
    assert len(local) >= 15, local
    for link in local:
        assert (REPO / link).is_file(), link
