"""make-prompts on the real GGUF: the target writes user prompts, a resume continues the same sequence,
and generate-corpus answers the file."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from converters.corpus import CorpusConfig, generate_corpus
from converters.datasets import ChatRenderer, load_source
from converters.self_prompts import (PLAIN_STOPS, PromptConfig, make_prompts, query_prefix, rejection, request_prefix,
                                    sample_requests)
from hetero_spec.api import HeteroSpec
from hetero_spec.chat_template import PLAIN_TEMPLATE
from hetero_spec.config import SamplingConfig
from hetero_spec.target.llama_target import LlamaTarget, TargetOptions


def cli(*args: str):
    return subprocess.run([sys.executable, "-m", "hetero_spec", "make-prompts", *args], capture_output=True, text=True,
                          timeout=600)


def test_the_query_prefix_ends_where_the_users_words_start(model_path):
    with LlamaTarget(model_path, TargetOptions(n_ctx=64, embeddings=False)) as t:
        r = ChatRenderer.for_target(t)
        prefix = query_prefix(r, "Be brief.")
        assert prefix == r.render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
                                  False).split("Hi")[0]
        assert prefix.endswith("user\n") and "Be brief." in prefix
    plain = ChatRenderer(PLAIN_TEMPLATE, "<s>", "</s>", lambda s: [], lambda t: False)
    assert query_prefix(plain) == "<s>User: "


@pytest.mark.parametrize("text, finished, why", [
    ("How do I sort a list in Python?", True, None),
    ("How do I sort a list in Python?", False, "unfinished"),
    ("Hello there", True, "short"),
    ("buy now " * 10, True, "repetitive"),
    ("how do i SORT a list, in python", True, "duplicate"),
])
def test_rejection_reasons(text, finished, why):
    assert rejection(text, finished, {"how do i sort a list in python"} if why == "duplicate" else set()) == why


def one_at_a_time(cfg: PromptConfig, attempts: int) -> list[tuple[int, str, bool]]:
    """The reference: each attempt sampled alone by ``HeteroSpec`` from an empty cache, with its own seed."""
    out = []
    with HeteroSpec(cfg.model, None, threads=1) as hs:
        renderer = ChatRenderer.for_target(hs.target, cfg.template)
        prefix = renderer.tokenize(query_prefix(renderer, cfg.system))
        for a in range(attempts):
            seed = int(np.random.SeedSequence([cfg.seed, a]).generate_state(1)[0])
            hs.reset()
            done = hs.generate(prefix, max_new_tokens=cfg.max_tokens, draft_len=0, stop=PLAIN_STOPS if
                               cfg.template == "plain" else (), sampling=SamplingConfig(
                                   temperature=cfg.temperature, top_p=cfg.top_p, seed=seed))
            out.append((a, done.text.strip(), done.stats.stop_reason in ("eog", "stop_string")))
    return out


@pytest.mark.parametrize("template, tokens, attempts", [("gguf", 32, 5), ("plain", 64, 6)])
def test_requests_sampled_together_are_the_ones_sampled_alone(model_path, tmp_path, template, tokens, attempts):
    """Several requests share each decode, and each still draws what it draws alone (its own seeded generator,
    rows exact beside others), in attempt order; the plain template's requests end at the next speaker (at 64
    tokens, attempts 4 and 5 do)."""
    cfg = PromptConfig(model=model_path, out=tmp_path / "x.jsonl", n=8, max_tokens=tokens, template=template,
                       threads=1, n_seq=3)
    prefix = request_prefix(cfg)
    together = list(sample_requests(cfg, prefix, 0, attempts, lambda: attempts))
    assert together == one_at_a_time(cfg, attempts)
    assert [a for a, _, _ in together] == list(range(attempts)) and any(ended for _, _, ended in together)
    assert all(not any(s in text for s in PLAIN_STOPS) for _, text, _ in together)
    assert list(sample_requests(cfg, prefix, 3, attempts, lambda: 1)) == together[3:]  # a resume draws the same


def test_prompts_resume_to_the_same_file_and_feed_generate_corpus(model_path, tmp_path):
    straight, split = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    base = PromptConfig(model=model_path, out=straight, n=4, max_tokens=48, threads=1)
    state = make_prompts(base, progress=False)
    assert state["kept"] == 4 and state["attempts"] == 4 + sum(state["dropped"].values())
    make_prompts(PromptConfig(**{**base.__dict__, "out": split, "n": 2}), progress=False)
    with split.open("a") as fh:
        fh.write('{"id": "half-writ')  # a crash between the line and the progress file
    make_prompts(PromptConfig(**{**base.__dict__, "out": split}), progress=False)
    assert split.read_text() == straight.read_text()
    src = load_source(straight)
    assert len(src.conversations) == 4 and not src.skipped
    assert all(len(c.messages) == 1 and c.messages[0]["role"] == "user" for c in src.conversations)
    assert len({c.messages[0]["content"] for c in src.conversations}) == 4
    m = generate_corpus(CorpusConfig(model=model_path, out=tmp_path / "corpus", source=str(straight), turns=1,
                                     max_new_tokens=8, n_seq=4, threads=1, features=False), progress=False)
    assert m["counts"]["conversations"] == 4 and m["counts"]["assistant_tokens"] > 0


def test_a_cap_on_attempts_stops_short_of_n_and_a_resume_keeps_to_it(model_path, tmp_path):
    """make-draft samples within a time budget: it must not wait on a model that rarely ends a request."""
    cfg = PromptConfig(model=model_path, out=tmp_path / "c.jsonl", n=50, max_tokens=8, threads=1)
    state = make_prompts(cfg, progress=False, max_attempts=3)
    assert state["attempts"] == 3 and state["kept"] == len(cfg.out.read_text().splitlines()) < 50
    assert make_prompts(cfg, progress=False, max_attempts=3) == state  # nothing more drawn
    assert make_prompts(cfg, progress=False, max_attempts=5)["attempts"] == 5  # a higher cap continues


def test_cli_refuses_changed_settings_and_foreign_files_in_one_line(model_path, tmp_path):
    out = tmp_path / "p.jsonl"
    ok = cli(str(model_path), str(out), "--n", "1", "--max-tokens", "48", "-t", "1")
    assert ok.returncode == 0 and "1 prompts from" in ok.stdout and len(out.read_text().splitlines()) == 1
    changed = cli(str(model_path), str(out), "--n", "2", "--max-tokens", "48", "--temperature", "0.5", "-t", "1")
    assert changed.returncode != 0 and "Traceback" not in changed.stderr and "temperature" in changed.stderr
    assert len(changed.stderr.strip().splitlines()) == 1 and len(out.read_text().splitlines()) == 1
    foreign = tmp_path / "mine.jsonl"
    foreign.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    refused = cli(str(model_path), str(foreign), "--n", "1", "-t", "1")
    assert refused.returncode != 0 and "without" in refused.stderr and len(refused.stderr.strip().splitlines()) == 1
    assert cli(str(model_path), str(tmp_path / "p.txt")).returncode == 2
