"""The engine's step prices on disk: what makes two layouts share a file, and a damaged file never trusted."""
from __future__ import annotations

from types import SimpleNamespace

from hetero_spec.engine import price_cache
from hetero_spec.engine.cost import StepCost
from hetero_spec.target.sequences import SequenceOptions


def _target(tmp_path, **options):
    model = tmp_path / "m.gguf"
    if not model.exists():
        model.write_bytes(b"GGUF")
    return SimpleNamespace(path=model, options=SequenceOptions(**options), n_threads=2, seq_ctx=1024)


def test_a_file_per_layout_and_probe(tmp_path, monkeypatch):
    monkeypatch.setenv("HETERO_SPEC_CACHE", str(tmp_path / "cache"))
    base = _target(tmp_path, n_seq=4)
    path = price_cache.prices_path(base, (1, 2, 4), 5, 256)
    assert path == price_cache.prices_path(_target(tmp_path, n_seq=4), (1, 2, 4), 5, 256)
    others = [price_cache.prices_path(_target(tmp_path, n_seq=2), (1, 2, 4), 5, 256),
              price_cache.prices_path(_target(tmp_path, n_seq=4, kv_type="f16"), (1, 2, 4), 5, 256),
              price_cache.prices_path(_target(tmp_path, n_seq=4, features=True), (1, 2, 4), 5, 256),
              price_cache.prices_path(_target(tmp_path, n_seq=4, max_rows=8), (1, 2, 4), 5, 256),
              price_cache.prices_path(SimpleNamespace(**{**vars(base), "n_threads": 1}), (1, 2, 4), 5, 256),
              price_cache.prices_path(base, (1, 2, 8), 5, 256),
              price_cache.prices_path(base, (1, 2, 4), 3, 256)]
    assert len({path, *others}) == 1 + len(others)
    assert path.parent == tmp_path / "cache" / "calibration"
    (tmp_path / "m.gguf").write_bytes(b"GGUF, another model")  # the file changed: measured again
    assert price_cache.prices_path(base, (1, 2, 4), 5, 256) != path


def test_round_trip_and_damaged_files(tmp_path):
    path = tmp_path / "p.json"
    assert price_cache.load(path) is None  # missing
    cost = StepCost({1: 4.01234567, 4: 9.5, 32: 40.0})
    price_cache.save(cost, path, "test")
    assert price_cache.load(path).ms == {1: 4.0123, 4: 9.5, 32: 40.0}
    damaged = ['{"version": 1, "ms": {"1": -3', '[]', '{"version": 1, "ms": {"1": 4.0}}',
               '{"version": 1, "ms": {"1": 4.0, "2": -1.0}}', '{"version": 1, "ms": {"one": 4.0, "2": 5.0}}',
               '{"version": 0, "ms": {"1": 4.0, "2": 5.0}}', '{"version": 1}']
    for text in damaged:  # half a file, another shape, one point, a negative price, another version
        path.write_text(text)
        assert price_cache.load(path) is None, text
