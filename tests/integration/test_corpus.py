"""generate-corpus on the real GGUF: bulk answers with features and taps, second turns, decontamination,
and a resume that ends where an uninterrupted run ends."""
from __future__ import annotations

import json

import numpy as np
import pytest

from converters import corpus as corpus_mod
from converters.corpus import CorpusConfig, generate_corpus
from hetero_spec.bench.prompts import bench_prompts
from hetero_spec.features import iter_sequences, read_manifest
from hetero_spec.target.layer_taps import LayerTapTarget

TAPS = (2, 15, 27)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """Eight short conversations (two with a second user turn), plus one that quotes an MT-Bench
    prompt verbatim and one that shares an 8-word run with a GSM8K prompt."""
    convs = [[("user", f"Name {n} colours."), ("assistant", "x")] for n in ("two", "three", "four", "five")]
    convs += [[("user", "Say hello."), ("assistant", "Hello!"), ("user", "Now say goodbye.")],
              [("user", "What is 2 + 2?"), ("assistant", "4"), ("user", "And 3 + 3?"), ("assistant", "6")],
              [("user", "Write one word."), ("assistant", "Word.")],
              [("user", "Count to three."), ("assistant", "1 2 3")]]
    convs += [[("user", bench_prompts("mt_bench", 1)[0]), ("assistant", "x")]]
    words = bench_prompts("gsm8k", 1)[0].split()[:10]
    convs += [[("user", "Please help: " + " ".join(words) + " thanks"), ("assistant", "x")]]
    path = tmp_path_factory.mktemp("src") / "convs.jsonl"
    path.write_text("\n".join(json.dumps({"messages": [{"role": r, "content": c} for r, c in conv]})
                              for conv in convs) + "\n")
    return path


def config(model_path, source, out, **kw) -> CorpusConfig:
    base = dict(model=model_path, out=out, source=str(source), turns=2, max_new_tokens=24, n_seq=4, threads=1,
                chunk=4, taps=TAPS)
    return CorpusConfig(**{**base, **kw})


@pytest.fixture(scope="module")
def made(model_path, source, tmp_path_factory):
    out = tmp_path_factory.mktemp("corpus") / "c"
    return out, generate_corpus(config(model_path, source, out), progress=False)


def test_corpus_counts_turns_and_decontamination(made):
    out, m = made
    c = m["counts"]
    assert m["decontamination"]["dropped_exact"] == 1 and m["decontamination"]["dropped_ngram8"] == 1
    assert c["conversations"] == 8 and m["progress"]["done"]
    seqs = list(iter_sequences(out / "features"))
    assert len(seqs) == 8 and sum(len(s) for s in seqs) == c["tokens"]
    assert sum(int(s.loss_mask.sum()) for s in seqs) == c["assistant_tokens"]
    assert c["turns"] == 8 + c.get("turn2", 0) and c["turns"] <= 10  # at most one second turn each
    manifest = read_manifest(out / "features")
    assert manifest.n_sequences == 8


def test_ids_shards_match_the_features_and_taps_are_block_inputs(made, model_path):
    from safetensors.numpy import load_file

    out, _ = made
    seqs = list(iter_sequences(out / "features"))
    ids = np.concatenate([load_file(str(p))["input_ids"] for p in sorted((out / "ids").glob("ids-*.safetensors"))])
    assert np.array_equal(ids, np.concatenate([s.input_ids for s in seqs]))
    s = max(seqs, key=len)
    assert set(s.extras) == {f"tap_{i}" for i in TAPS}
    with LayerTapTarget(model_path, tuple(i - 1 for i in TAPS), n_threads=1, kv_type="f16") as lt:
        hidden, outs = lt.run([int(x) for x in s.input_ids])
    n = len(s) - 1  # the last token was sampled, never decoded: its row is zero
    assert not s.hidden[-1].any()
    rel = lambda a, b: float(np.linalg.norm(a[:n].astype(np.float32) - b[:n]) / np.linalg.norm(b[:n]))  # noqa: E731
    assert rel(s.hidden, hidden) < 1e-2
    for i in TAPS:
        assert rel(s.extras[f"tap_{i}"], outs[i - 1]) < 1e-2


def test_an_interrupted_corpus_resumes_to_the_same_result(made, model_path, source, tmp_path, monkeypatch):
    out = tmp_path / "c"
    real = corpus_mod._run_chunk
    calls = {"n": 0}

    def dies_on_the_second_chunk(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(corpus_mod, "_run_chunk", dies_on_the_second_chunk)
    with pytest.raises(KeyboardInterrupt):
        generate_corpus(config(model_path, source, out), progress=False)
    assert json.loads((out / "manifest.json").read_text())["progress"]["next_index"] == 4
    monkeypatch.setattr(corpus_mod, "_run_chunk", real)
    m = generate_corpus(config(model_path, source, out), progress=False)
    whole, _ = made
    assert m["counts"] == json.loads((whole / "manifest.json").read_text())["counts"]
    for a, b in zip(iter_sequences(out / "features"), iter_sequences(whole / "features")):
        assert np.array_equal(a.input_ids, b.input_ids) and np.array_equal(a.loss_mask, b.loss_mask)


def test_other_settings_in_the_same_folder_are_refused(made, model_path, source):
    from converters.corpus import CorpusError

    out, _ = made
    with pytest.raises(CorpusError, match="other settings"):
        generate_corpus(config(model_path, source, out, max_new_tokens=30), progress=False)


def test_reexport_from_the_ids_gives_the_runtimes_features(made, model_path, tmp_path):
    """Prefill-speed features from the corpus's token ids equal what the runtime's LlamaTarget (q8_0 KV
    cells, 32-row micro-batches, taps from llama.cpp's layer-input API) computes for the same ids, bit
    for bit; the features kept while generating (F16 cells, other batches) are a few percent off."""
    from converters.corpus import reexport_features
    from hetero_spec.target.llama_target import LlamaTarget, TargetOptions

    out, _ = made
    m = reexport_features(out, model_path, tmp_path / "f", TAPS, threads=1, progress=False)
    assert m.n_sequences == 8
    with LlamaTarget(model_path, TargetOptions(n_ctx=1024, n_threads=1)) as hid, \
            LlamaTarget(model_path, TargetOptions(n_ctx=1024, n_threads=1, taps=TAPS)) as tap:
        for a, b in zip(iter_sequences(tmp_path / "f"), iter_sequences(out / "features")):
            assert np.array_equal(a.input_ids, b.input_ids)
            ids = [int(x) for x in a.input_ids]
            hidden, _ = hid.prefill(ids)
            taps, _ = tap.prefill(ids)
            hid.reset()
            tap.reset()
            np.testing.assert_array_equal(a.hidden, hidden.astype(np.float16))
            np.testing.assert_array_equal(np.concatenate([a.extras[f"tap_{i}"] for i in TAPS], 1), taps.astype(np.float16))
            n = len(a) - 1
            kept = b.hidden[:n].astype(np.float32)
            assert np.linalg.norm(a.hidden[:n].astype(np.float32) - kept) / np.linalg.norm(kept) < 0.08
    again = reexport_features(out, model_path, tmp_path / "f", TAPS, threads=1, progress=False)  # nothing left to do
    assert [s.file for s in again.shards] == [s.file for s in m.shards]


def test_shards_split_the_selection_and_keep_their_own_resume_point(made, model_path, source, tmp_path):
    """--shard i/N parts take every N-th conversation: disjoint, together the unsharded corpus's
    conversations with the same answers, each in its own folder that another shard cannot resume."""
    from converters.corpus import CorpusError

    whole, _ = made
    parts = [generate_corpus(config(model_path, source, tmp_path / f"p{i}", shard=(i, 2), turns=1), progress=False)
             for i in range(2)]
    assert all(p["options"]["shard"] == [i, 2] for i, p in enumerate(parts))
    assert sum(p["counts"]["conversations"] for p in parts) == 8
    prompt = lambda s: tuple(s.input_ids[: int(s.loss_mask.argmax())])  # noqa: E731  (up to the first answer)
    got = [prompt(s) for i in range(2) for s in iter_sequences(tmp_path / f"p{i}" / "features")]
    want = [prompt(s) for s in iter_sequences(whole / "features")]
    assert len(set(got)) == len(got) and set(got) == set(want)  # the same first prompts, each once
    with pytest.raises(CorpusError, match="other settings"):
        generate_corpus(config(model_path, source, tmp_path / "p0", shard=(1, 2), turns=1), progress=False)


def test_offset_answers_the_rest_of_the_shuffle_an_earlier_limit_left(made, model_path, source, tmp_path):
    """--limit L then --offset L on the same seed: two corpora of disjoint conversations that together
    are the whole selection (how a later session answers conversations an earlier draft never saw)."""
    whole, _ = made
    first = generate_corpus(config(model_path, source, tmp_path / "a", limit=3, turns=1), progress=False)
    rest = generate_corpus(config(model_path, source, tmp_path / "b", offset=3, turns=1), progress=False)
    assert rest["options"]["offset"] == 3 and "offset" not in first["options"]
    prompt = lambda s: tuple(s.input_ids[: int(s.loss_mask.argmax())])  # noqa: E731  (up to the first answer)
    a = {prompt(s) for s in iter_sequences(tmp_path / "a" / "features")}
    b = {prompt(s) for s in iter_sequences(tmp_path / "b" / "features")}
    assert a and b and not a & b  # (decontamination drops 2 of the 10, on either side of the cut)
    assert a | b == {prompt(s) for s in iter_sequences(whole / "features")}


# SmolLM2's greedy answers (chat template, 96 tokens): the poem loops on one line, the list never repeats 6 tokens in a
# row, the colours repeat a clause and end later (a loop that training would stop scoring anyway)
REQUESTS = ["Write a short poem about the sea.", "List some fruits.", "Name three colours."]


def test_a_turn_stopped_in_its_loop_ends_where_training_stops_scoring_it(model_path):
    """--stop-loops K: a turn ends at the K-th token in a row that repeats an earlier 8-gram, which is exactly where
    train --loop-keep K stops scoring it (train/loops.py); a turn that never loops runs as it did."""
    from hetero_spec.target.bulk_generate import BulkGenerator, BulkOptions
    from hetero_spec.target.llama_target import LlamaTarget, TargetOptions
    from hetero_spec.train.loops import loop_tail_mask

    keep = 6
    from converters.datasets import ChatRenderer

    with LlamaTarget(model_path, TargetOptions(n_ctx=256, n_threads=1, embeddings=False)) as t:
        renderer = ChatRenderer.for_target(t)
        prompts = [(i, renderer.prompt_ids([{"role": "user", "content": p}])) for i, p in enumerate(REQUESTS)]
    runs = {}
    for stop in (0, keep):
        with BulkGenerator(model_path, BulkOptions(n_seq=1, max_new_tokens=96, seq_ctx=256, n_threads=1, hidden=True,
                                                   stop_loops=stop)) as gen:
            runs[stop] = {r.key: r for r in gen.generate(prompts)}
    looped = 0
    for key, whole in runs[0].items():
        scored = loop_tail_mask(np.asarray(whole.ids), np.asarray(whole.mask), keep)
        unscored = np.flatnonzero(np.asarray(whole.mask, bool) & ~scored)
        stopped = runs[keep][key]
        end = int(unscored[0]) if len(unscored) else len(whole.ids)
        assert stopped.ids == whole.ids[:end] and stopped.mask == whole.mask[:end], REQUESTS[key]
        assert stopped.looped == bool(len(unscored)) and not whole.looped
        hidden = stopped.features["hidden"]  # a row per token; a turn stopped in a loop ends on a decoded token
        assert hidden.shape[0] == len(stopped.ids) and hidden[-1].any() == stopped.looped
        looped += stopped.looped
    assert 1 <= looped < len(REQUESTS)  # both kinds of turn are exercised
