"""The documentation as a reader meets it: reference, not a lab notebook, and every quoted table true to its file.

README.md, docs/*.md and drafts/README.md must not mention internal run numbers or paths outside the
repository (a clone has neither), must not name repository files that do not exist, and every
``<!-- results:NAME -->`` block must be exactly what ``scripts/results_tables.py`` makes of the files
under results/ (so a figure cannot drift from its data, and a data file cannot lose its command or CPU).
"""
from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "drafts" / "README.md"]
IDS = [str(p.relative_to(ROOT)) for p in DOCS]

RUN_NUMBERS = re.compile(r"\b(?:stops?|sessions?) (?:#\s*)?\d+\b", re.I)
OUTSIDE = re.compile(r"(?<![\w.$])(?:/work/|/tmp/|/root/|/home/|~/|\.\./shared|\.\./data)")
# repository paths as docs write them: in backticks or as relative links, starting at a top-level folder
TOP = ("README.md", "docs/", "drafts/", "results/", "scripts/", "tests/", "hetero_spec/", "converters/", ".ci/")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def _load_tables():
    spec = importlib.util.spec_from_file_location("results_tables", ROOT / "scripts" / "results_tables.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def tables():
    return _load_tables()


def _prose(text: str) -> str:
    """The text without results blocks: those are checked against their files, and quote commands verbatim."""
    return re.sub(r"<!-- results:[\w-]+ -->.*?<!-- /results -->", "", text, flags=re.S)


def _mentioned_paths(text: str) -> set[str]:
    """Repository-relative paths named in code spans (first word) or relative links."""
    found = set()
    for span in CODE_SPAN.findall(text):
        for word in span.split():
            word = word.strip("\"'(),;:")
            word = re.split(r"::|\[|\*", word)[0]
            if word.startswith(TOP):
                found.add(word)
    for link in LINK.findall(text):
        if not re.match(r"[a-z]+://", link):
            found.add(link)
    return found


def _placeholder(path: str) -> bool:
    """`results/exactness/NAME.json`, `OUT.train/`: a name the reader fills in."""
    return any(re.fullmatch(r"[A-Z][A-Z_0-9]{2,}", part) and part != "README" for part in re.split(r"[/.]", path))


@pytest.mark.parametrize("doc", DOCS, ids=IDS)
def test_no_internal_run_numbers(doc: Path):
    hits = [m.group(0) for m in RUN_NUMBERS.finditer(doc.read_text())]
    assert not hits, f"{doc.name} mentions internal run numbers: {hits[:5]}"


def test_no_internal_run_numbers_in_code():
    """Comments and docstrings cite the measurement, not which internal run made it."""
    files = [p for top in ("hetero_spec", "scripts", "tests", "converters") for p in (ROOT / top).rglob("*")
             if p.is_file() and p.suffix in (".py", ".sh", ".md") and p.name != "test_docs.py"]
    hits = [f"{p.relative_to(ROOT)}: {m.group(0)}" for p in files for m in RUN_NUMBERS.finditer(p.read_text())]
    assert not hits, f"internal run numbers in code: {hits[:5]}"


@pytest.mark.parametrize("doc", DOCS, ids=IDS)
def test_no_paths_outside_the_repository(doc: Path):
    text = doc.read_text()
    hits = [text[m.start():m.start() + 40].split()[0] for m in OUTSIDE.finditer(text)]
    assert not hits, f"{doc.name} names paths a clone does not have: {hits[:5]}"


@pytest.mark.parametrize("doc", DOCS, ids=IDS)
def test_named_repository_files_exist(doc: Path):
    base = doc.parent
    missing = []
    for path in sorted(_mentioned_paths(doc.read_text())):
        if any(ch in path for ch in "*{}<>$") or path.endswith("...") or _placeholder(path):
            continue  # patterns and placeholders (NAME, DIR), not files
        candidates = [ROOT / path, base / path]
        if not any(c.exists() for c in candidates):
            missing.append(path)
    assert not missing, f"{doc.name} names files that do not exist: {missing}"


@pytest.mark.parametrize("doc", DOCS, ids=IDS)
def test_results_blocks_match_their_files(doc: Path, tables):
    for name, body in tables.blocks(doc.read_text()):
        assert body == tables.render(name), (
            f"{doc.name}: block {name!r} differs from its files; run `python scripts/results_tables.py write`")


def test_readme_quotes_the_headline_table(tables):
    assert "headline" in [name for name, _ in tables.blocks((ROOT / "README.md").read_text())]


def test_every_table_is_quoted_somewhere(tables):
    quoted = {name for doc in DOCS for name, _ in tables.blocks(doc.read_text())}
    assert set(tables.TABLES) <= quoted, f"tables no document quotes: {sorted(set(tables.TABLES) - quoted)}"


def test_every_results_file_records_command_and_cpu(tables):
    data_files = [p for p in (ROOT / "results").rglob("*") if p.is_file() and p.suffix in (".json", ".txt", ".md")
                  and p.name != "provenance.json"]
    assert data_files
    for p in data_files:
        src = tables.source(str(p.relative_to(ROOT / "results")))
        assert src.command.strip() and src.cpu.strip(), p


def test_every_provenance_entry_names_an_existing_file(tables):
    for rel in tables.provenance():
        assert (ROOT / "results" / rel).exists(), f"results/provenance.json names a missing file: {rel}"


def test_quoted_figures_come_from_the_data(tables, tmp_path, monkeypatch):
    """Change a figure in a copy of a bench file and the rendered table changes: the tables read the data."""
    rel = tables.WITH_DRAFT
    data = json.loads((ROOT / "results" / rel).read_text())
    before = tables.render("speedup-7sets")
    for row in data["summary"]:
        if row["method"] == "auto" and row["dataset"] == "all":
            row["speedup"] += 1.0
    fake = tmp_path / "results"
    (fake / rel).parent.mkdir(parents=True)
    (fake / rel).write_text(json.dumps(data))
    for other in (tables.NO_DRAFT,):
        (fake / other).write_text((ROOT / "results" / other).read_text())
    (fake / "provenance.json").write_text((ROOT / "results" / "provenance.json").read_text())
    monkeypatch.setattr(tables, "RESULTS", fake)
    monkeypatch.setattr(tables, "PROVENANCE", fake / "provenance.json")
    assert tables.render("speedup-7sets") != before


def test_the_checker_catches_run_numbers_and_outside_paths():
    assert RUN_NUMBERS.search("as measured in stop 31")
    assert RUN_NUMBERS.search("Session 4 found")
    assert RUN_NUMBERS.search("stops 25-31 measured")
    assert not RUN_NUMBERS.search("stop strings; 4 sessions")
    assert OUTSIDE.search("see /work/data/s30/split.py")
    assert OUTSIDE.search("`../" + "shared/ARCHITECTURE.md`")  # a sample text, split so no scan takes it for a read
    assert OUTSIDE.search("cached under ~/.cache/hetero-spec")
    assert not OUTSIDE.search("`$XDG_CACHE_HOME/hetero-spec`")
    assert _mentioned_paths("`scripts/x.py --help` and [a](docs/y.md)") == {"scripts/x.py", "docs/y.md"}
    assert _placeholder("results/exactness/NAME.json") and not _placeholder("drafts/README.md")
