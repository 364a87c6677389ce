"""The shipped prompt sets are package data: found from any directory, declared for wheels, documented."""
from __future__ import annotations

import json
import tomllib
from fnmatch import fnmatch
from importlib import resources
from pathlib import Path

import pytest

from hetero_spec.bench.prompts import DATASETS, load_dataset, shipped_text
from hetero_spec.errors import HeteroSpecError

ROOT = Path(__file__).resolve().parents[2]
DATA = resources.files("hetero_spec.bench").joinpath("data")


@pytest.mark.parametrize("name", DATASETS)
def test_each_set_loads_from_any_directory(name, tmp_path, monkeypatch):
    monkeypatch.delenv("HETERO_SPEC_BENCH_DIR", raising=False)
    monkeypatch.chdir(tmp_path)  # nothing relative to the working directory or the checkout
    rows = [json.loads(line) for line in DATA.joinpath(f"{name}.jsonl").read_text().splitlines() if line.strip()]
    assert len(rows) == 80
    prompts = load_dataset(name, 100).prompts
    assert prompts == tuple(r["turns"][0] for r in rows)
    assert load_dataset(name, 3).prompts == prompts[:3]


def test_env_folder_overrides_and_reports_a_missing_file(tmp_path, monkeypatch):
    (tmp_path / "gsm8k.jsonl").write_text(json.dumps({"turns": ["What is 2 + 2?"]}) + "\n")
    monkeypatch.setenv("HETERO_SPEC_BENCH_DIR", str(tmp_path))
    assert load_dataset("gsm8k", 5).prompts == ("What is 2 + 2?",)
    with pytest.raises(HeteroSpecError, match="alpaca.jsonl"):
        shipped_text("alpaca")


def test_readme_names_source_and_license_of_every_set():
    readme = DATA.joinpath("README.md").read_text()
    for name, words in {"mt_bench": ("FastChat", "Apache-2.0"), "humaneval": ("openai/human-eval", "MIT"),
                        "gsm8k": ("openai/grade-school-math", "MIT"), "alpaca": ("stanford_alpaca", "CC BY-NC 4.0")}.items():
        line = next(ln for ln in readme.splitlines() if f"`{name}.jsonl`" in ln)
        assert all(w in line for w in words), line


def test_pyproject_ships_every_data_file():
    """A wheel holds what package-data names: every file under data/ must match a pattern."""
    patterns = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["hetero_spec.bench"]
    base = ROOT / "hetero_spec" / "bench"
    files = [p.relative_to(base).as_posix() for p in (base / "data").rglob("*") if p.is_file()]
    assert {f"data/{n}.jsonl" for n in DATASETS} <= set(files) and "data/README.md" in files
    assert [f for f in files if not any(fnmatch(f, pat) for pat in patterns)] == []


@pytest.mark.parametrize("name, kinds", [("grounded", {"summarise", "passage_qa", "edit_code"}),
                                         ("multiturn", {"revise_list", "revise_text", "revise_code"}),
                                         ("agentic", {"tool_call", "fill_template"})])
def test_the_copying_sets_have_twenty_prompts_of_every_kind_and_a_documented_source(name, kinds, monkeypatch):
    monkeypatch.delenv("HETERO_SPEC_BENCH_DIR", raising=False)
    rows = [json.loads(line) for line in DATA.joinpath(f"{name}.jsonl").read_text().splitlines() if line.strip()]
    assert len(rows) >= 20 and {r["category"] for r in rows} == kinds
    assert {r["category"] for r in rows[: len(kinds)]} == kinds  # the first N prompts cover every kind
    prompts = load_dataset(name, 100).prompts
    assert len(prompts) == len(rows)
    if name == "multiturn":
        assert all(p[-1]["role"] == "user" and any(m["role"] == "assistant" for m in p) for p in prompts)
    else:
        assert all(isinstance(p, str) and p.strip() for p in prompts)
    line = next(ln for ln in DATA.joinpath("README.md").read_text().splitlines() if f"`{name}.jsonl`" in ln)
    assert "Apache-2.0" in line


def test_a_conversation_must_end_with_the_user(tmp_path):
    path = tmp_path / "conv.jsonl"
    path.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}))
    with pytest.raises(HeteroSpecError, match="ending with a user turn"):
        load_dataset(str(path), 5)
