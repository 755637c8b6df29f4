"""Measured figures have one home, docs/benchmarks.md. The README's Status table says what is
done, one line a row, with no figure and no machine in it; only its Performance table carries
ratios and machine names, each column pointing at the runs in docs/benchmarks.md. Links into
docs/benchmarks.md from anywhere in the project (docs, help strings, comments) land on an
anchor that exists: MkDocs checks the site's own pages, not the README or the Python sources.

(Help strings get the same kind of check in their own test file; this one keeps to the README.)"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
BENCHMARKS = REPO / "docs" / "benchmarks.md"

# A speed-up or a range of them: "1.26x", "2.8x", "0.68x", "1.39-1.45x", "2x".
RATIO = re.compile(r"\b\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)?x\b")
# The machines figures were measured on, by vendor line, generation or instruction set.
MACHINE = re.compile(
    r"\b(EPYC|Xeon|Ryzen|Zen ?\d*|Sapphire|Emerald|Granite|Genoa|Turin|"
    r"H100|H200|A100|MI300\w*|AMX\w*|AVX\w*)\b"
)
STATUS_SCOPE_MAX_WORDS = 15
STATUS_STATE_MAX_WORDS = 3
PERFORMANCE_ROWS = ("prompt 512", "one user", "4 sequences", "16 sequences", "server at 16 streams")


def sections(text: str) -> dict[str, list[str]]:
    """The README's `## ` sections by title, each its lines (the title line excluded); the text
    before the first one under ""."""
    out: dict[str, list[str]] = {"": []}
    current = ""
    for line in text.splitlines():
        if line.startswith("## "):
            current = line[3:].strip()
            out[current] = []
        else:
            out[current].append(line)
    return out


def table_rows(lines: list[str]) -> list[list[str]]:
    """The body rows of the first Markdown table in `lines`, each a list of its cells."""
    rows = [line for line in lines if line.startswith("|")]
    assert len(rows) >= 3, "no table"
    assert re.fullmatch(r"\|(\s*:?-+:?\s*\|)+", rows[1]), rows[1]
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows[2:]]


def header_cells(lines: list[str]) -> list[str]:
    first = next(line for line in lines if line.startswith("|"))
    return [cell.strip() for cell in first.strip("|").split("|")]


def test_the_patterns_catch_what_they_are_for():
    """The checks below are only as good as these patterns: each catches the figures the README
    used to carry and lets ordinary text through."""
    for figure in ("1.26x", "2.8x", "0.68x", "1.39-1.45x", "at 2x the speed", "(4.77x)"):
        assert RATIO.search(figure), figure
    for text in ("SmolLM2-135M", "torch==2.13.0", "0x1f", "x86", "Q4_1", "8-bit", "X-Request-Id"):
        assert not RATIO.search(text), text
    for name in (
        "EPYC",
        "a 2-core Xeon",
        "Zen 4",
        "Zen5",
        "Sapphire Rapids",
        "AVX512-BF16",
        "H200",
    ):
        assert MACHINE.search(name), name
    for text in ("done", "Xenial", "Zenith", "avx", "amx", "CUDA graphs", "NVML"):
        assert not MACHINE.search(text), text


def test_status_rows_are_one_line_a_state_and_a_short_scope():
    status = sections(README.read_text())["Status"]
    assert header_cells(status) == ["area", "state", "scope"]
    rows = table_rows(status)
    assert len(rows) >= 12, rows
    for area, state, scope in rows:
        for cell in (area, state, scope):
            assert not RATIO.search(cell), f"{area}: a ratio in the Status table: {cell}"
            assert not MACHINE.search(cell), f"{area}: a machine in the Status table: {cell}"
        assert 1 <= len(state.split()) <= STATUS_STATE_MAX_WORDS, (area, state)
        assert 1 <= len(scope.split()) <= STATUS_SCOPE_MAX_WORDS, (area, len(scope.split()), scope)


def test_no_ratio_or_machine_outside_the_performance_table():
    for title, lines in sections(README.read_text()).items():
        if title == "Performance":
            continue
        for line in lines:
            assert not RATIO.search(line), f"## {title}: a ratio outside Performance: {line}"
            assert not MACHINE.search(line), f"## {title}: a machine outside Performance: {line}"


def benchmark_anchors() -> set[str]:
    """The anchors docs/benchmarks.md defines: explicit `{ #id }` on a heading, else the heading's
    slug as MkDocs' toc makes it."""
    anchors = set()
    for line in BENCHMARKS.read_text().splitlines():
        if not line.startswith("#"):
            continue
        explicit = re.search(r"\{\s*#([\w-]+)\s*\}\s*$", line)
        if explicit:
            anchors.add(explicit.group(1))
            continue
        title = line.lstrip("#").strip().lower()
        anchors.add(re.sub(r"[\s]+", "-", re.sub(r"[^\w\s-]", "", title)).strip("-"))
    return anchors


def test_performance_table_names_machines_and_commits_and_links_to_the_runs():
    performance = sections(README.read_text())["Performance"]
    header = header_cells(performance)
    machines = header[1:]
    assert 2 <= len(machines) <= 3, header
    anchors = benchmark_anchors()
    for column in machines:
        assert MACHINE.search(column), column
        link = re.search(r"\]\(docs/benchmarks\.md#([\w-]+)\)", column)
        assert link and link.group(1) in anchors, column
    rows = table_rows(performance)
    assert len(rows) == len(PERFORMANCE_ROWS), rows
    for name, row in zip(PERFORMANCE_ROWS, rows, strict=True):
        assert name in row[0], (name, row[0])
        assert len(row) == len(header), row
        for cell in row[1:]:
            assert RATIO.search(cell) or cell == "not measured", (name, cell)
    # One footnote a column: the commits measured and the date, and llama.cpp's build.
    text = "\n".join(performance)
    notes = re.findall(r"^([¹²³]) (.+?)(?=^[¹²³] |^llama\.cpp:)", text, re.M | re.S)
    assert [mark for mark, _ in notes] == list("¹²³")[: len(machines)], notes
    commits = []
    for _, note in notes:
        assert re.search(r"\b2\d{3}-\d{2}-\d{2}\b", note), note
        found = re.findall(r"\b[0-9a-f]{7,40}\b", note)
        assert found, note
        commits += found
    assert re.search(r"^llama\.cpp: .*(build|sdist)", text, re.M | re.S)
    git = subprocess.run(
        ["git", "rev-parse", "--git-dir"], cwd=REPO, capture_output=True, text=True, check=False
    )
    if git.returncode == 0:  # a checkout: every commit named is one of ours
        for commit in commits:
            known = subprocess.run(
                ["git", "cat-file", "-e", f"{commit}^{{commit}}"],
                cwd=REPO,
                capture_output=True,
                check=False,
            )
            assert known.returncode == 0, f"unknown commit {commit}"


# Topics other files link to (help strings, docs): they stay, whatever the tables become.
STABLE_ANCHORS = {
    "reference-machines",
    "how-to-run",
    "against-llama-cpp",
    "server-against-llama-server",
    "compiled-decode-step",
    "cpu-kernels",
    "attention-backends",
    "the-cpu-decode-kernel",
    "the-int4-kernel",
    "quantized-weights",
    "bf16-dot",
    "amx",
    "huge-pages",
    "int4-dense-copy",
    "quantize-activations",
    "token-budget",
    "decode-bandwidth",
    "kv-cache-dtype",
    "prefix-caching",
    "speculative-decoding",
    "structured-outputs",
    "scoring",
    "slo-autopilot",
    "gpu",
    "probe-fixes-issue-52",
    "fairness",
}


def test_links_into_benchmarks_land_on_an_anchor():
    anchors = benchmark_anchors()
    assert anchors >= STABLE_ANCHORS, STABLE_ANCHORS - anchors
    sources = [README, *sorted((REPO / "docs").glob("*.md"))]
    for folder, pattern in (("controlplane", "*.py"), ("benchmarks", "*.py"), ("config", "*.toml")):
        sources += sorted((REPO / folder).rglob(pattern))
    linked = 0
    for path in sources:
        for anchor in re.findall(r"benchmarks\.md#([\w-]+)", path.read_text()):
            linked += 1
            assert anchor in anchors, f"{path.relative_to(REPO)}: benchmarks.md#{anchor}"
    assert linked >= 5, linked
