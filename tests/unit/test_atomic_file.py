"""hetero_spec.atomic_file: a reader sees the old file or the new one, never half of one, even with
two processes writing the same file at once (two servers saving step prices)."""
from __future__ import annotations

import multiprocessing as mp
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from hetero_spec import atomic_file


def test_write_text_makes_the_folder_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "a" / "b" / "prices.json"
    assert atomic_file.write_text(path, "{}") == path
    assert path.read_text() == "{}"
    assert atomic_file.write_bytes(path, b"[1]") == path and path.read_bytes() == b"[1]"
    assert sorted(p.name for p in path.parent.iterdir()) == ["prices.json"]


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_a_failed_write_keeps_the_old_file_and_removes_its_temporary(tmp_path, error):
    path = tmp_path / "shard.safetensors"
    path.write_text("old")
    with pytest.raises(error):
        with atomic_file.replacing(path) as tmp:
            tmp.write_text("half of the new")
            raise error()
    assert path.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shard.safetensors"]


def test_the_temporary_is_hidden_and_never_matches_the_destinations_suffix(tmp_path):
    tmp = atomic_file.temporary_for(tmp_path / "manifest.json")
    assert tmp.parent == tmp_path and tmp.name.startswith(".manifest.json.tmp")
    with atomic_file.replacing(tmp_path / "manifest.json") as t:
        t.write_text("x")
        assert t == tmp and list(tmp_path.glob("*.json")) == []  # a reader globbing *.json skips it


def test_threads_and_processes_get_their_own_temporary(tmp_path):
    path = tmp_path / "curve.json"
    names = []
    t = threading.Thread(target=lambda: names.append(atomic_file.temporary_for(path)))
    t.start()
    t.join()
    with mp.get_context("spawn").Pool(1) as pool:
        other = pool.apply(atomic_file.temporary_for, (path,))
    mine = atomic_file.temporary_for(path)
    assert len({mine, names[0], other}) == 3


def _write_many(path: str, letter: str, times: int, go) -> None:
    go.wait()  # both writers start together: spawning takes longer than the writes
    for _ in range(times):
        atomic_file.write_text(path, letter * 20_000)


def test_two_processes_writing_one_file_never_show_a_reader_half_a_file(tmp_path):
    """With one shared temporary name this fails: a rename takes the other writer's file while it is
    being written (a short read), or finds it gone (FileNotFoundError in a writer)."""
    path = tmp_path / "prices.json"
    atomic_file.write_text(path, "a" * 20_000)
    ctx = mp.get_context("spawn")
    go = ctx.Event()
    writers = [ctx.Process(target=_write_many, args=(str(path), c, 2000, go)) for c in "ab"]
    for w in writers:
        w.start()
    go.set()
    while any(w.is_alive() for w in writers):
        text = Path(path).read_text()
        assert len(text) == 20_000 and len(set(text)) == 1
    for w in writers:
        w.join()
        assert w.exitcode == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prices.json"]


def test_a_killed_writers_leftover_goes_at_the_next_write_and_a_live_ones_stays(tmp_path):
    path = tmp_path / "ckpt.pt"
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # a pid that no longer runs
    old = time.time() - 2 * atomic_file.STALE_S
    stale = tmp_path / f".ckpt.pt.tmp{dead.pid}-1"
    fresh = tmp_path / f".ckpt.pt.tmp{dead.pid}-2"  # a writer on another machine: still being written
    alive = tmp_path / f".ckpt.pt.tmp{os.getppid()}-3"  # pytest's parent runs
    other = tmp_path / f".other.pt.tmp{dead.pid}-1"  # another file's: not this write's business
    for f in (stale, fresh, alive, other):
        f.write_bytes(b"half")
    for f in (stale, alive, other):
        os.utime(f, (old, old))
    atomic_file.write_bytes(path, b"whole")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["ckpt.pt", fresh.name, alive.name, other.name])


def test_a_figure_goes_into_a_folder_that_did_not_exist(tmp_path):
    """A plot is the last thing a long command writes (calibrate --plot): a missing folder failed it after the work."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.plot([1, 2], [3, 4])
    path = atomic_file.save_figure(fig, tmp_path / "a" / "curve.png", dpi=50)
    plt.close(fig)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in path.parent.iterdir()] == ["curve.png"]


def test_a_device_or_pipe_is_written_in_place_and_a_links_target_replaced(tmp_path):
    """``--stats-json /dev/stdout`` or ``>(jq .)``: a rename would replace the device (as root) or fail; a
    symbolic link keeps pointing where it did."""
    r, w = os.pipe()
    fifo = f"/proc/self/fd/{w}"
    atomic_file.write_text(fifo, "through the pipe")
    os.close(w)
    with os.fdopen(r) as fh:
        assert fh.read() == "through the pipe"
    target = tmp_path / "real.json"
    target.write_text("old")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    atomic_file.write_text(link, "new")
    assert link.is_symlink() and target.read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.json", "real.json"]
