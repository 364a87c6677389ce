"""Conversation sources and loss masks: pure logic, no model."""
from __future__ import annotations

import json

import pytest

from converters.datasets import (ChatRenderer, SourceError, assistant_mask, load_source, normalize, select)

SMOL_TEMPLATE = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
                 "{{ '<|im_start|>system\nYou are helpful<|im_end|>\n' }}{% endif %}"
                 "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
                 "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
EOT = "<|im_end|>"


def conv(i: int, n_turns: int = 2) -> dict:
    turns = [{"from": "human" if k % 2 == 0 else "gpt", "value": f"turn {k} of {i}"} for k in range(n_turns)]
    return {"id": str(i), "conversations": turns}


def test_truncated_json_array_recovers_whole_conversations(tmp_path):
    text = json.dumps([conv(i) for i in range(5)], indent=2)
    cut = text[: text.rindex("turn 1 of 4") + 4]  # cut mid-string inside the last conversation
    path = tmp_path / "cut.json"
    path.write_text(cut)
    with pytest.raises(json.JSONDecodeError):
        json.loads(cut)
    src = load_source(path)
    assert [c.index for c in src.conversations] == [0, 1, 2, 3]
    assert src.skipped["truncated_tail"] == 1 and src.format == "json-array"
    assert src.conversations[2].messages == [{"role": "user", "content": "turn 0 of 2"},
                                             {"role": "assistant", "content": "turn 1 of 2"}]


def test_jsonl_malformed_lines_are_counted_not_fatal(tmp_path):
    lines = [json.dumps(conv(0)), "{not json", json.dumps({"messages": [{"role": "user", "content": "hi"},
                                                                        {"role": "assistant", "content": "yo"}]}),
             json.dumps([1, 2]), json.dumps({"conversations": [{"from": "alien", "value": "x"}]}),
             json.dumps({"conversations": []}), json.dumps({"messages": [{"role": "user", "content": "  "}]}), ""]
    path = tmp_path / "mixed.jsonl"
    path.write_text("\n".join(lines))
    src = load_source(path)
    assert len(src.conversations) == 2
    assert src.conversations[1].messages[1] == {"role": "assistant", "content": "yo"}  # OpenAI-style record
    assert dict(src.skipped) == {"malformed_json": 1, "malformed_record": 2, "empty": 2}


def test_json_that_is_not_an_array_is_refused(tmp_path):
    path = tmp_path / "obj.json"
    path.write_text("  {\"a\": 1}")
    src = load_source(path)  # a single object line is read as JSONL: one malformed record
    assert not src.conversations and src.skipped["malformed_record"] == 1
    path.write_text("[" + json.dumps(conv(0)) + ",\n{\"broken\": ")
    assert len(load_source(path).conversations) == 1


def test_leading_answers_are_dropped(tmp_path):
    path = tmp_path / "lead.jsonl"
    rec = {"conversations": [{"from": "gpt", "value": "Welcome!"}, {"from": "human", "value": "Hi"},
                             {"from": "gpt", "value": "Hello"}]}
    path.write_text(json.dumps(rec))
    assert [m["role"] for m in load_source(path).conversations[0].messages] == ["user", "assistant"]


def test_normalize_rejects_wrong_types():
    assert normalize({"conversations": [{"from": "human", "value": 3}]}) is None
    assert normalize({"messages": "hi"}) is None
    assert normalize({"conversations": [{"from": "system", "value": "s"}, {"from": "bing", "value": "b"}]}) == [
        {"role": "system", "content": "s"}, {"role": "assistant", "content": "b"}]


def test_select_is_deterministic_and_shards_partition(tmp_path):
    from converters.datasets import Conversation

    items = [Conversation(i, []) for i in range(50)]
    a = select(items, limit=20, offset=5, seed=3)
    assert [c.index for c in a] == [c.index for c in select(items, limit=20, offset=5, seed=3)]
    assert [c.index for c in a] != [c.index for c in select(items, limit=20, offset=5, seed=4)]
    parts = [select(items, limit=20, offset=5, seed=3, shard=(i, 3)) for i in range(3)]
    assert sorted(c.index for p in parts for c in p) == sorted(c.index for c in a)
    assert [c.index for c in select(items, limit=3, offset=0)] == [0, 1, 2]


def test_assistant_mask_stops_after_end_of_turn():
    eog = {9}
    assert assistant_mask([1, 2, 9, 5], eog.__contains__) == [1, 1, 1, 0]
    assert assistant_mask([1, 2, 3], eog.__contains__) == [1, 1, 1]  # cut off: no end-of-turn yet


def char_renderer() -> ChatRenderer:
    """One id per character, except the end-of-turn marker which is one special id (-1)."""
    def tokenize(text: str) -> list[int]:
        out, i = [], 0
        while i < len(text):
            if text.startswith(EOT, i):
                out.append(-1)
                i += len(EOT)
            else:
                out.append(ord(text[i]))
                i += 1
        return out
    return ChatRenderer(SMOL_TEMPLATE, "", "", tokenize, lambda t: t == -1)


def test_encode_masks_exactly_the_assistant_answers_and_end_of_turn():
    r = char_renderer()
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
                {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Ciao"}]
    ids, mask = r.encode(messages)
    assert ids == r.tokenize(r.render(messages, False))  # same text as the whole rendering
    learned = "".join(("|" if t == -1 else chr(t)) if m else "_" for t, m in zip(ids, mask)).split("_")
    assert [s for s in learned if s] == ["Hello|", "Ciao|"]
    assert mask[-1] == 0  # the "\n" after the last end-of-turn is template glue


def test_missing_source_is_a_clear_error(tmp_path):
    from converters.datasets import resolve_source

    with pytest.raises(SourceError, match="not found"):
        resolve_source(str(tmp_path / "nope.jsonl"))
