"""``scripts/project_make_draft.py``: the weights a training token meets, counted from the recipe alone, equal
those of a real draft made with that recipe (the shipped darter), so the 7B projection scales by a true count."""
from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _script():
    spec = importlib.util.spec_from_file_location("project_make_draft", ROOT / "scripts" / "project_make_draft.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_weights_per_token_count_the_shipped_darter():
    from hetero_spec.draft.checkpoint import load_draft

    draft = load_draft(ROOT / "drafts" / "smollm2-135m-darter.safetensors")
    cfg = draft.cfg
    real = sum(p.numel() for p in draft.parameters()) + cfg.reduced_vocab * cfg.n_embd
    recipe = {"variant": "darter", "n_blocks": cfg.n_blocks, "reduced_vocab": cfg.reduced_vocab, "taps": list(cfg.taps)}
    assert cfg.taps == (2, 15, 27)  # what make-draft chooses for SmolLM2's 30 blocks
    assert _script().draft_weights_per_token(cfg.n_embd, cfg.n_vocab, 30, recipe) == real


def test_a_7b_draft_meets_about_thirty_times_the_weights():
    """The ratio the projection uses: a 4096-wide draft against SmolLM2's 576-wide one, the same 8,192-row head."""
    script = _script()
    recipe = {"variant": "darter", "n_blocks": 1, "reduced_vocab": 8192, "taps": [2, 15, 27]}
    small = script.draft_weights_per_token(576, 49152, 30, recipe)
    big = script.draft_weights_per_token(4096, 32000, 32, recipe)
    assert 25 < big / small < 40
