"""The native draft step's weight arena (draft/huge_pages.py): exact copies, aligned, in 2 MB pages where the
kernel's THP mode allows, and a fallback that keeps working once the arena is full."""
import numpy as np
import torch

from hetero_spec.config import DenoiseConfig
from hetero_spec.draft import native
from hetero_spec.draft.huge_pages import ALIGN, HUGE_PAGE, HugePageArena, thp_mode

from .test_native_step import CFG, make_model


def test_placed_tensors_are_equal_aligned_copies_inside_the_arena():
    arena = HugePageArena(1 << 20)
    assert arena.address % HUGE_PAGE == 0 and arena.capacity == HUGE_PAGE
    src = [torch.randint(-127, 128, (333, 7), dtype=torch.int8), torch.randn(5), torch.arange(9, dtype=torch.int32)]
    placed = [arena.place(t) for t in src]
    for s, p in zip(src, placed):
        assert torch.equal(s, p) and p.shape == s.shape and p.dtype == s.dtype
        assert p.data_ptr() != s.data_ptr() and p.data_ptr() % ALIGN == 0
        assert arena.address <= p.data_ptr() < arena.address + arena.capacity
    src[1].zero_()  # a copy, not a view of the source
    assert placed[1].abs().sum() > 0


def test_a_full_arena_hands_back_the_tensor_itself():
    arena = HugePageArena(HUGE_PAGE)
    big = arena.place(torch.ones(HUGE_PAGE - 100, dtype=torch.uint8))
    assert arena.address == big.data_ptr()
    over = torch.ones(200, dtype=torch.uint8)
    assert arena.place(over) is over  # does not fit: the caller keeps its own tensor
    small = arena.place(torch.ones(30, dtype=torch.uint8))
    assert small.data_ptr() == arena.address + HUGE_PAGE - 64  # still room on the last cache line's boundary


def test_the_arena_gets_2mb_pages_exactly_when_the_kernel_grants_them():
    mode = thp_mode()
    arena = HugePageArena(2 * HUGE_PAGE)
    arena.place(torch.ones(2 * HUGE_PAGE, dtype=torch.uint8))  # touch both pages
    if mode in ("always", "madvise"):
        assert arena.advised
        assert arena.huge_bytes() >= HUGE_PAGE, f"THP is '{mode}' but the arena got no 2 MB page"
    else:
        assert not arena.advised and arena.huge_bytes() == 0


class NoRoom(HugePageArena):
    """An arena that takes nothing: every weight stays in its own torch tensor, as before the arena."""

    def place(self, t):
        return t.detach().contiguous()


def test_native_chain_streams_its_quantized_weights_from_the_arena_and_not_the_sparse_tables(monkeypatch):
    lib = native.load_library()
    assert lib is not None, "the native draft step did not build (g++ with OpenMP is part of the set-up)"
    model = make_model(CFG)
    chain = native.NativeChain(lib, model, None, DenoiseConfig(), threads=1)
    lo, hi = chain.arena.address, chain.arena.address + chain.arena.capacity
    m = chain._model
    hot = [m.head.w, m.head.scale, m.w1.w, m.w1.scale, m.w1.wsum, m.emb_norm]
    for i in range(CFG.n_blocks):
        b = chain._blocks[i]
        hot += [b.qkv.w, b.o.w, b.gate_up.w, b.down.w, b.down.scale, b.ffn_norm]
    assert all(lo <= p < hi for p in hot)
    assert not any(lo <= p < hi for p in (m.embed, m.head_f32, m.rope_cos))  # read a row at a time
    # the kernels read the arena's copies: the same logits as a chain whose weights stayed in torch tensors
    monkeypatch.setattr(native, "HugePageArena", NoRoom)
    outside = native.NativeChain(lib, model, None, DenoiseConfig(), threads=1)
    assert not lo <= outside._model.head.w < hi
    for seed in range(3):
        feat = torch.randn(CFG.n_embd, generator=torch.Generator().manual_seed(seed))
        np.testing.assert_array_equal(chain.head_logits(feat).numpy(), outside.head_logits(feat).numpy())


def test_without_private_anonymous_mappings_the_arena_holds_nothing(monkeypatch):
    """Where the mmap module has no MAP_PRIVATE (Windows), every tensor stays where it was."""
    from types import SimpleNamespace

    from hetero_spec.draft import huge_pages

    monkeypatch.setattr(huge_pages, "mmap", SimpleNamespace(mmap=huge_pages.mmap.mmap))
    arena = HugePageArena(1 << 20)
    t = torch.ones(10)
    assert arena.place(t) is t and not arena.advised and arena.capacity == 0 and arena.huge_bytes() == 0


def test_thp_mode_reads_the_bracketed_choice():
    assert thp_mode() in ("always", "madvise", "never", "unavailable")
