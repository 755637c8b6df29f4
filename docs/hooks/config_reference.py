"""MkDocs hook: the configuration reference page, generated from the config model.

The model is the dataclasses of `controlplane/config.py` (`Config` and its sections) and
`controlplane/engine/settings.py` (`EngineSettings`). For every field the page gives its key,
type, default, whether it is live, its environment variable and its explanation, which is read
from the source, never copied by hand (one block per key: a heading with the key, a line of its
type, default, live or restart and environment variable, then its explanation):

- an engine field's `doc` (the first argument of `_live(...)` / `_restart(...)`);
- otherwise the `#` comment block right above the field, and a comment at the end of its line
  (read with `tokenize`, the fields located with `ast`); where the block holds paragraphs
  (a bare `#` line between them), only the last, the one touching the field, is its help: the
  ones above are notes for the code's reader ("why this default");
- a field with no comment of its own takes the comment of `config/controlplane.toml` for that
  key (marked †), else the block comment of the fields it is written with (no blank line
  between them: `ttft_p99_ms` and `itl_p99_ms` share "p99 targets ...").

Types come from the annotations as written, defaults from the dataclasses, live fields from
`LIVE_FIELDS` (the daemon's own list), environment names as `env_names()` spells them, and what
a field accepts (its range or its choices) from the declaration on the field that the validation
loops over (controlplane/limits.py). A help string's `docs/benchmarks.md#<anchor>` becomes a
link to that section of the benchmarks page. It
imports the config model only, which is torch-free: building the docs never loads torch.

Registered in mkdocs.yml under `hooks:`; `render()` is also called by tests/test_docs.py.
"""

from __future__ import annotations

import ast
import dataclasses
import html
import importlib
import inspect
import io
import re
import textwrap
import tokenize
import typing
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
PAGE = "config-reference.md"
TOML = REPO / "config" / "controlplane.toml"
DAGGER = " †"


# -- comments from the source -------------------------------------------------------------------


@dataclasses.dataclass
class FieldSource:
    annotation: str
    block: str  # the comment lines right above it
    trailing: str  # a comment at the end of its line
    group: str  # the block comment it shares with the fields written right above it


def _comments(source: str) -> tuple[dict[int, str], dict[int, str]]:
    """Full-line and end-of-line comments by line number, their `#` stripped."""
    full: dict[int, str] = {}
    trailing: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type != tokenize.COMMENT:
            continue
        text = tok.string.lstrip("#").strip()
        line = tok.line[: tok.start[1]]
        (full if not line.strip() else trailing)[tok.start[0]] = text
    return full, trailing


def class_fields(cls: type) -> dict[str, FieldSource]:
    """Each annotated field of `cls`, with its annotation and comments as written."""
    path = inspect.getsourcefile(cls)
    assert path, cls
    source = Path(path).read_text()
    (node,) = [
        n
        for n in ast.walk(ast.parse(source))
        if isinstance(n, ast.ClassDef) and n.name == cls.__name__
    ]
    full, trailing = _comments(source)
    out: dict[str, FieldSource] = {}
    group, prev_end = "", None
    for stmt in node.body:
        if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
            prev_end = stmt.end_lineno
            continue
        lines = []
        n = stmt.lineno - 1
        while full.get(n):  # a bare `#` ends the help: notes above it are not shown
            lines.insert(0, full[n])
            n -= 1
        block = " ".join(lines)
        tail = trailing.get(stmt.lineno, "")
        if block:
            group = block
        elif tail or prev_end is None or stmt.lineno - 1 != prev_end:
            group = ""  # its own line comment, or a blank line: not part of a group
        out[stmt.target.id] = FieldSource(ast.unparse(stmt.annotation), block, tail, group)
        prev_end = stmt.end_lineno
    return out


def toml_comments(path: Path = TOML) -> tuple[dict[str, str], dict[str, str], dict[str, str]]:
    """config/controlplane.toml's comments: by dotted key the block right above it, by dotted
    key the block of the lines it is written with, and by table the block above its header.
    Commented-out examples (`# num_kv_blocks = 4096`, `# [[api_keys]]`) count as written."""
    own: dict[str, str] = {}
    run: dict[str, str] = {}
    tables: dict[str, str] = {}
    table, pending, current = "", [], ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        code = line.lstrip("#").strip() if line.startswith("#") else line
        header = re.fullmatch(r"\[\[?([a-z_]+)\]\]?", code)
        assign = re.fullmatch(r"([a-z_][a-z0-9_]*)\s*=.*", code)
        if not line:
            pending, current = [], ""
        elif header:
            table = header.group(1)
            tables[table] = " ".join(pending)
            pending, current = [], ""
        elif assign:
            key = f"{table}.{assign.group(1)}" if table else assign.group(1)
            if pending:
                current = " ".join(pending)
                own[key] = current
            run[key] = current
            pending = []
        else:
            pending.append(code)
    return own, run, tables


# -- the model ----------------------------------------------------------------------------------


@dataclasses.dataclass
class Row:
    key: str  # as in the file: `max_num_seqs` in [engine]
    type: str
    default: str
    live: bool
    env: str  # "" where there is none
    doc: str
    # Its declared range or choices: ("range", ("[1, 4096]",)), ("one of", ("text", "json"));
    # None where it declares neither.
    accepts: tuple[str, tuple[str, ...]] | None = None


@dataclasses.dataclass
class Section:
    name: str  # "" for the top-level keys
    array: bool  # [[prices]]: a list of tables
    intro: str
    rows: list[Row]


def _live_fields() -> frozenset[str]:
    """The daemon's LIVE_FIELDS, found where it is defined (the package is being reorganised:
    the module is looked up, not named)."""
    root = REPO / "controlplane"
    for path in sorted(root.rglob("*.py")):
        if re.search(r"^LIVE_FIELDS\b", path.read_text(), re.M):
            module = ".".join(path.relative_to(REPO).with_suffix("").parts)
            return frozenset(importlib.import_module(module).LIVE_FIELDS)
    raise RuntimeError("no module of controlplane/ defines LIVE_FIELDS")


def _size(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size and n % size == 0:
            return f" ({n // size} {unit})"
    return ""


def _literal(value: Any, name: str = "") -> str:
    """A default as it would be written in the TOML file."""
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, int) and name.endswith("_bytes"):
        return f"{value}{_size(value)}"
    if hasattr(value, "isoformat"):
        return value.isoformat().replace("+00:00", "Z")
    return repr(value)


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def _doc(dotted: str, src: FieldSource, meta: Any, toml: tuple) -> str:
    """The field's explanation, in the order the module docstring gives."""
    own, run, _ = toml
    text = meta.get("doc", "") if meta else ""
    text = text or " ".join(t for t in (src.block, src.trailing) if t)
    if not text and own.get(dotted):
        text = own[dotted] + DAGGER
    text = text or src.group
    if not text and run.get(dotted):
        text = run[dotted] + DAGGER
    return re.sub(r"^\[live\]\s*", "", text)


def sections() -> list[Section]:
    """The config model, section by section, in the order of `Config`'s fields."""
    from controlplane import config

    env = set(config.env_names())
    live = _live_fields()
    toml = toml_comments()
    hints = typing.get_type_hints(config.Config)
    top = Section("", False, "Keys before the first table of the file.", [])
    out = [top]
    config_src = class_fields(config.Config)
    for f in dataclasses.fields(config.Config):
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            cls, array = hint, False
        elif typing.get_origin(hint) is tuple and dataclasses.is_dataclass(
            typing.get_args(hint)[0]
        ):
            cls, array = typing.get_args(hint)[0], True
        else:
            name = "CONTROLPLANE_" + f.name.upper()
            top.rows.append(
                Row(
                    f.name,
                    config_src[f.name].annotation,
                    _literal(_default(f), f.name),
                    f.name in live,
                    name if name in env else "",
                    _doc(f.name, config_src[f.name], None, toml),
                )
            )
            continue
        srcs = class_fields(cls)
        intro = " ".join((inspect.cleandoc(cls.__doc__ or "")).split())
        if intro.startswith(f"{cls.__name__}("):  # the dataclass's generated signature
            intro = ""
        intro = intro or toml[2].get(f.name, "")
        section = Section(f.name, array, intro, [])
        if array:
            section.intro += " " + _default_entries(_default(f))
        for g in dataclasses.fields(cls):
            dotted = f"{f.name}.{g.name}"
            name = f"CONTROLPLANE_{f.name}__{g.name}".upper()
            default = _default(g)
            section.rows.append(
                Row(
                    g.name,
                    srcs[g.name].annotation,
                    "required" if default is dataclasses.MISSING else _literal(default, g.name),
                    dotted in live or (array and f.name in live),
                    "" if array else name,
                    _doc(dotted, srcs[g.name], g.metadata, toml),
                    _accepts(g),
                )
            )
            if not array:
                assert name in env, f"{name} is not what env_names() spells"
        out.append(section)
    return out


def _accepts(f: dataclasses.Field) -> tuple[str, tuple[str, ...]] | None:
    """What the field's declaration admits, worded as its error words it: a range ("[1, 4096]",
    "(0, 86400] seconds", ">= 0") or the choices."""
    from controlplane.limits import choices_of, range_of

    r = range_of(f)
    if r is not None:
        return "range", (r.describe().removeprefix("in "),)
    choices = choices_of(f)
    return ("one of", tuple(map(str, choices))) if choices else None


def _default_entries(entries: tuple) -> str:
    """The default of a list of tables, [[prices]]'s: what is in force without any."""
    if not entries:
        return "Default: none."
    written = [
        ", ".join(
            f"{f.name} = {_literal(getattr(e, f.name), f.name)}" for f in dataclasses.fields(e)
        )
        for e in entries
    ]
    return (
        f"Default: {len(entries)} entr{'y' if len(entries) == 1 else 'ies'}, "
        + "; ".join(f"({w})" for w in written)
        + "."
    )


# -- the page -----------------------------------------------------------------------------------


# A help string's pointer to its figures: `docs/benchmarks.md#<anchor>` (the path as seen from
# the repository, where the settings are read), a link to the section on the built site.
BENCHMARK_LINK = re.compile(r"docs/benchmarks\.md#([a-z0-9-]+)")


def _cell(text: str) -> str:
    """Markdown-safe text: `code` spans kept, benchmark pointers linked, everything else
    inert."""
    out = []
    for i, piece in enumerate(re.split(r"`([^`]*)`", text)):
        piece = html.escape(piece, quote=False)
        for ch, entity in (("|", "&#124;"), ("*", "&#42;"), ("_", "&#95;"), ("[", "&#91;")):
            piece = piece.replace(ch, entity)
        if not i % 2:
            piece = BENCHMARK_LINK.sub(r"[docs/benchmarks.md#\1](benchmarks.md#\1)", piece)
        out.append(f"<code>{piece}</code>" if i % 2 else piece)
    return "".join(out)


def _code(text: str) -> str:
    return f"<code>{_cell(text)}</code>" if text else "—"


def _anchor(section: Section, key: str) -> str:
    """A key's anchor: its dotted name (`server.max_queue_len`, `data_dir`), so a link to it
    reads as the key; keys repeated across tables (`enabled`) stay distinct."""
    return f"{section.name}.{key}" if section.name else key


def render() -> str:
    lines = [
        "# Configuration reference",
        "",
        textwrap.dedent(
            """\
            Generated when the site is built from the config model (`controlplane/config.py` and
            `controlplane/engine/settings.py`), so it cannot drift from the code: every key of
            the configuration file, its type, default, whether it can change on a running daemon
            (*live*: `PATCH /admin/config`, the TUI, a config reload; otherwise it takes a
            restart), its environment variable and the comment written with it. Each key is a
            heading with its own link (`#server.max_queue_len`). [Configuration](configuration.md)
            says how the file, the environment and the `serve` flags combine;
            `config/controlplane.toml` is a commented file with every default.

            Descriptions marked † come from `config/controlplane.toml`, for fields whose
            definition carries no comment of its own."""
        ).rstrip(),
    ]
    for section in sections():
        title = (
            "Top level"
            if not section.name
            else f"[[{section.name}]]"
            if section.array
            else f"[{section.name}]"
        )
        lines += ["", f"## {title}", ""]
        if section.intro:
            lines += [_cell(section.intro), ""]
        # One block per key, not a table row: a six-column table left the environment
        # variables broken mid-word and the descriptions cut at the page's edge.
        for r in section.rows:
            facts = [
                f"type {_code(r.type)}",
                f"default {_code(r.default)}",
            ]
            if r.accepts:
                kind, values = r.accepts
                facts.append(f"{kind} " + ", ".join(_code(v) for v in values))
            facts.append("**live**" if r.live else "restart")
            if r.env:
                facts.append(f"env {_code(r.env)}")
            lines += [
                f"### <code>{_cell(r.key)}</code> {{ #{_anchor(section, r.key)} }}",
                "",
                " · ".join(facts),
                "",
                *([_cell(r.doc), ""] if r.doc else []),
            ]
    return "\n".join(lines).rstrip() + "\n"


# -- MkDocs -------------------------------------------------------------------------------------


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    files.append(File.generated(config, PAGE, content=render()))
    return files
