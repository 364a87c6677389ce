"""The native greedy chain (draft/native.py) against the float torch draft, built for every kernel this CPU can
run: the host's own (-march=native), AVX2 (x86-64-v3) and the generic loops (x86-64)."""
import copy
from dataclasses import replace

import numpy as np
import pytest
import torch

from hetero_spec.config import DenoiseConfig, DraftConfig
from hetero_spec.cpu_features import cpu_info
from hetero_spec.draft import native
from hetero_spec.draft.model import DraftModel, init_weights
from hetero_spec.draft.runner import NATIVE_MAX_ROWS, DraftRunner

D, V = 80, 300  # 80 wide: every dot product has a tail after the vector kernels' 64 or 32 lanes
TAPS = (0, 1)
CFG = DraftConfig(n_embd=D, n_vocab=V, hidden_size=D, n_heads=4, n_kv_heads=2, ffn_size=144, n_blocks=2,
                  max_positions=256, taps=TAPS, reduced_vocab=200)
CASES = {
    "dgf-gated-taps": CFG,
    "fc-ungated-no-taps": replace(CFG, fusion="fc", gate="none", taps=(), n_blocks=1),
}
DENOISE = {"plain": DenoiseConfig(), "denoised": DenoiseConfig(threshold=0.5, recent_window=3)}


def expected_kernel(march: str) -> str:
    flags = cpu_info()[1]
    if march == "x86-64-v3":
        return "avx2"
    if march == "x86-64":
        return "generic"
    if {"avx512_vnni", "avx512bw"} <= flags:
        return "avx512-vnni"
    return "avx2" if "avx2" in flags else "generic"


@pytest.fixture(scope="module", params=["native", "x86-64-v3", "x86-64"])
def lib(request):
    march = request.param
    if march == "x86-64-v3" and not {"avx2", "fma", "bmi2", "movbe"} <= cpu_info()[1]:
        pytest.skip("this CPU cannot run an x86-64-v3 (AVX2) build")
    built = native.load_library(march)
    assert built is not None, "the native draft step did not build (g++ with OpenMP is part of the set-up)"
    assert native.kernel_name(built) == expected_kernel(march)
    return built


def make_model(cfg: DraftConfig, seed: int = 0) -> DraftModel:
    torch.manual_seed(seed)
    m = init_weights(DraftModel(cfg), seed)
    for p in m.parameters():  # larger than the 0.02 init, so that bugs show in outputs
        p.data.mul_(4.0)
    for blk in m.blocks:
        if blk.importance is not None:  # gates that differ between keys, some under the denoising threshold
            torch.nn.init.normal_(blk.importance.weight, std=0.3)
            torch.nn.init.constant_(blk.importance.bias, 0.0)
    if cfg.taps:
        m.tap_scale.copy_(torch.rand(m.tap_scale.shape) + 0.5)
    m.d2t.copy_(torch.randperm(V)[: m.d2t.shape[0]])
    m.attach_target_weights(torch.randn(V, D), torch.randn(V, D))
    return m.float().eval()


def float_runner(model: DraftModel, denoise: DenoiseConfig) -> DraftRunner:
    return DraftRunner(copy.deepcopy(model), device="cpu", dtype="float32", denoise=denoise)


def native_runner(model: DraftModel, denoise: DenoiseConfig, lib, threads: int) -> DraftRunner:
    """A float32 runner whose chains go through the native step (as an int8 runner's do)."""
    r = float_runner(model, denoise)
    r._native = native.NativeChain(lib, r.model, r.cache, denoise, threads=threads)
    return r


def rows(cfg: DraftConfig, n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, cfg.input_size)).astype(np.float32), rng.integers(0, V, n)


def drive(r: DraftRunner, feats: np.ndarray, toks: np.ndarray) -> tuple[list[list[int]], list[int]]:
    """What a decode loop does: holes, a many-row read, one-row chains with rollbacks (each chain keeps its
    real cell), a chain after a backlog of 8 rows (read by torch first, ``NATIVE_MAX_ROWS``) and one after a
    two-row read (read natively).  Returns every chain's proposals and the cache count after each."""
    r.skip(2)
    r.prefill(feats[:6], toks[:6])
    chains, counts = [], []
    for i in range(6, len(toks) - 2):
        n = r.n
        chains.append(r.propose(feats[i : i + 1], toks[i : i + 1], k=3))
        counts.append(r.n)
        r.rollback(n + 1)
    n = r.n
    chains.append(r.propose(feats[-10:-2], toks[-10:-2], k=3))
    counts.append(r.n)
    r.rollback(n + 8)
    chains.append(r.propose(feats[-2:], toks[-2:], k=3))
    counts.append(r.n)
    return chains, counts


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("den", list(DENOISE))
def test_native_chain_writes_the_float_cells_and_proposes_like_float(lib, case, den):
    """The same cells (k, v, log-gates) as the float torch step to int8 precision, the same cache count, and
    the float draft's proposals on nearly every step; one thread or two give identical results."""
    cfg, denoise = CASES[case], DENOISE[den]
    model = make_model(cfg)
    feats, toks = rows(cfg, 40, seed=1)
    assert 2 <= NATIVE_MAX_ROWS < 8
    ref = float_runner(model, denoise)
    want, want_n = drive(ref, feats, toks)
    got = {}
    for threads in (1, 2):
        r = native_runner(model, denoise, lib, threads)
        got[threads] = drive(r, feats, toks) + (r,)
    assert got[1][:2] == got[2][:2]  # rows are split across threads, each computed alike
    chains, counts, r = got[1]
    assert counts == want_n
    n = r.n - 2  # the cells of real rows (the last chain's two drafted cells follow them)
    for i in range(cfg.n_blocks):
        for a, b in ((r.cache.k[i], ref.cache.k[i]), (r.cache.v[i], ref.cache.v[i])):
            a, b = a[:, :, :n], b[:, :, :n]
            assert float((a - b).norm() / b.norm()) < 0.08
        if cfg.gate == "darter":
            gate_err = (r.cache.log_gate[i][:n] - ref.cache.log_gate[i][:n]).abs()
            assert float(gate_err.median()) < 0.05 and float(gate_err.max()) < 1.0
    # random heads are full of near-ties that int8 activations flip (the shipped draft: 98% equal,
    # scripts/bench_draft_step.py); a wrong cell or row would leave about 1 in 200 equal
    equal = np.mean(np.array(chains) == np.array(want))
    assert equal >= 0.5, f"native proposals equal float's on {equal:.0%} of steps"


def int8_exact(model: DraftModel) -> DraftModel:
    """The model with every linear weight and the head on its rows' int8 grid, so that int8 weights lose nothing."""
    model = copy.deepcopy(model)
    with torch.no_grad():
        for w in [mod.weight for mod in model.modules() if isinstance(mod, torch.nn.Linear)] + [model.head]:
            scale = (w.abs().amax(dim=1, keepdim=True) / 127.0).clamp_min(1e-12)
            w.copy_(torch.round(w / scale) * scale)
    return model


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("den", list(DENOISE))
def test_native_step_is_the_float_arithmetic_on_int8_exact_weights(lib, case, den):
    """With weights already on the int8 grid and activations kept in float, the native chain is the float
    draft's arithmetic in another order: every cell and every proposal equal (to float32 rounding).  This is
    the test that catches a wrong index, norm, RoPE half, gate or mask; the one above bounds int8's error."""
    cfg, denoise = CASES[case], DENOISE[den]
    model = int8_exact(make_model(cfg))
    feats, toks = rows(cfg, 40, seed=4)
    ref = float_runner(model, denoise)
    want, want_n = drive(ref, feats, toks)
    r = float_runner(model, denoise)
    r._native = native.NativeChain(lib, r.model, r.cache, denoise, threads=2, quantize_activations=False)
    got, got_n = drive(r, feats, toks)
    assert got == want and got_n == want_n
    n = r.n
    for i in range(cfg.n_blocks):
        torch.testing.assert_close(r.cache.k[i][:, :, :n], ref.cache.k[i][:, :, :n], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(r.cache.v[i][:, :, :n], ref.cache.v[i][:, :, :n], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(r.cache.log_gate[i][:n], ref.cache.log_gate[i][:n], rtol=1e-4, atol=1e-4)


def test_native_head_picks_the_float_argmax_over_draft_and_context_rows(lib):
    """A chain's first proposal from a given feature is the head's argmax, which the native head rescores in
    float: equal to the float head's over its own rows and the context rows (added rows win only when higher)."""
    model = make_model(CFG)
    r = native_runner(model, DenoiseConfig(), lib, threads=1)
    ref = float_runner(model, DenoiseConfig())
    outside = sorted(set(range(V)) - set(model.d2t.tolist()))[:20]
    for x in (r, ref):
        x.add_context(outside)
    assert r._head.n_added == 20
    chain = r._native
    chain.attach(r.cache)
    rng = np.random.default_rng(3)
    picks, context_picks = [], 0
    for _ in range(60):
        feat = torch.from_numpy(rng.standard_normal(D).astype(np.float32))
        ids, written = chain.run(None, None, 0, 1, r._head._extra, r._head.d2t_t, x0=torch.zeros(D), feat0=feat)
        assert written == 0
        want = int(ref._head.greedy(feat[None]))
        picks.append(ids[0] == want)
        context_picks += want in outside
    assert all(picks)
    assert context_picks > 0  # the context rows did win some of the time


@pytest.mark.parametrize("quantized", [False, True], ids=["int8-exact-float-activations", "int4-head"])
def test_native_head_ranks_a_tree_level_like_the_float_softmax(lib, quantized):
    """A greedy tree level's ranking (``NativeChain.head_topk``) over the head's and the context rows: on int8-exact
    weights with float activations, the float softmax's best rows and probabilities; with the int4 head, whose best
    rows are rescored in float, its first row is the chain's token and its probabilities stay near the float ones."""
    model = make_model(CFG)
    if not quantized:
        model = int8_exact(model)
    r = float_runner(model, DenoiseConfig())
    r._native = native.NativeChain(lib, r.model, r.cache, DenoiseConfig(), threads=2, quantize_activations=quantized)
    outside = sorted(set(range(V)) - set(model.d2t.tolist()))[:20]
    r.add_context(outside)
    head, chain = r._head, r._native
    feats = torch.from_numpy(np.random.default_rng(5).standard_normal((12, D)).astype(np.float32))
    top_i, top_p = chain.head_topk(feats, 4, head._extra)
    assert top_i.shape == top_p.shape == (12, 4)
    probs = torch.softmax(torch.cat([feats @ model.head.t(), feats @ head._extra.t()], dim=-1).double(), -1).numpy()
    want_p, want_i = np.sort(probs, 1)[:, ::-1][:, :4], np.argsort(-probs, 1, kind="stable")[:, :4]
    assert (np.diff(top_p, axis=1) <= 0).all() and (top_p.sum(1) <= 1 + 1e-6).all()
    assert (top_i >= len(model.d2t)).any()  # context rows ranked among the best
    if not quantized:
        assert (top_i == want_i).all()
        np.testing.assert_allclose(top_p, want_p, rtol=1e-4, atol=1e-6)
        return
    for b in range(len(feats)):
        ids, _ = chain.run(None, None, 0, 1, head._extra, head.d2t_t, x0=torch.zeros(D), feat0=feats[b])
        assert head.d2t[top_i[b, 0]] == ids[0]
    np.testing.assert_allclose(top_p[:, 0], want_p[:, 0], atol=0.05)
    assert (top_i[:, 0] == want_i[:, 0]).mean() >= 0.9


def test_int8_runner_takes_the_native_chain_unless_turned_off(monkeypatch):
    """``dtype int8-full`` on the CPU runs its chains natively (the float draft's proposals on most steps);
    ``HETERO_SPEC_NATIVE_DRAFT=0`` keeps the torch int8 step; eagle3's fusion, which the native step lacks,
    keeps it too."""
    model = make_model(CFG)
    feats, toks = rows(CFG, 40, seed=2)
    want, _ = drive(float_runner(model, DenoiseConfig()), feats, toks)
    r = DraftRunner(copy.deepcopy(model), device="cpu", dtype="int8-full")
    assert r._native is not None
    got, _ = drive(r, feats, toks)
    assert np.mean(np.array(got) == np.array(want)) >= 0.5
    monkeypatch.setenv("HETERO_SPEC_NATIVE_DRAFT", "0")
    assert DraftRunner(copy.deepcopy(model), device="cpu", dtype="int8-full")._native is None
    monkeypatch.delenv("HETERO_SPEC_NATIVE_DRAFT")
    eagle3 = make_model(replace(CFG, fusion="eagle3", n_blocks=1))
    assert DraftRunner(eagle3, device="cpu", dtype="int8-full")._native is None


def test_build_is_cached_and_never_half_written(tmp_path, monkeypatch):
    """The library is compiled once per source, compiler and CPU into the cache, under its final name only
    when complete; a failing compiler leaves nothing behind and the draft falls back."""
    monkeypatch.setenv("HETERO_SPEC_CACHE", str(tmp_path))
    path = native.build("x86-64")
    assert path is not None and path.exists() and path.parent == tmp_path / "native"
    mtime = path.stat().st_mtime_ns
    assert native.build("x86-64") == path and path.stat().st_mtime_ns == mtime
    monkeypatch.setenv("HETERO_SPEC_NATIVE_MARCH", "no-such-cpu")
    assert native.build() is None
    assert sorted(p.name for p in (tmp_path / "native").iterdir()) == [path.name]


def test_a_greedy_tree_of_width_one_is_the_native_chain_with_p_min(lib):
    """auto's chains come through ``propose_tree`` (top_k 1) with llama.cpp's draft-p-min: the native chain
    stops where the best row's probability falls below p_min, as the torch tree does, and hands back the same
    chain, parents and real-cell count (int8-exact weights, float activations: the same arithmetic)."""
    model = int8_exact(make_model(CFG))
    feats, toks = rows(CFG, 30, seed=8)
    ref, r = float_runner(model, DenoiseConfig()), float_runner(model, DenoiseConfig())
    r._native = native.NativeChain(lib, r.model, r.cache, DenoiseConfig(), threads=2, quantize_activations=False)
    lengths = []
    for x in (ref, r):
        x.prefill(feats[:8], toks[:8])
    for i in range(8, 28, 2):
        got = []
        for x in (ref, r):
            n = x.n
            prop = x.propose_tree(feats[i : i + 2], toks[i : i + 2], top_k=1, total_tokens=5, depth=5, p_min=0.9)
            got.append((prop.tokens.tolist(), prop.parents.tolist(), prop.n_real))
            assert prop.n_real == n + 2
            x.rollback(prop.n_real)
        assert got[0] == got[1]
        lengths.append(len(got[1][0]) - 1)
    assert min(lengths) < 5 and max(lengths) > 1  # p-min cut some chains short, not all at once


@pytest.mark.parametrize("width", [80, 128])
def test_head_kernels_compute_the_dot_products_of_their_grids(lib, width):
    """The head's logits before rescoring.  With each head row on its int4 (or int8) grid and the feature on its
    int8 grid, both kernels lose nothing: every logit equals the float64 product (to float32 rounding).  80
    wide pads the int4 rows' second block of 64; a swapped nibble, block or sign would be off by whole units."""
    model = init_weights(DraftModel(replace(CFG, n_embd=width, hidden_size=width)), 0).float().eval()
    model.attach_target_weights(torch.randn(V, width), torch.randn(V, width))
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for bits, levels in ((4, 7), (8, 127)):
            steps = torch.rand(model.head.shape[0], 1, generator=gen) + 0.1
            grid = torch.randint(-levels, levels + 1, model.head.shape, generator=gen).float()
            grid[:, 0] = levels  # each row's absmax on the grid's edge: its scale is exactly the step
            model.head.copy_(grid * steps)
            feat = torch.randint(-127, 128, (width,), generator=gen).float() * 0.03
            feat[1] = 127 * 0.03
            want = (model.head.double() @ feat.double()).float()
            for threads in (1, 2):
                chain = native.NativeChain(lib, model, None, DenoiseConfig(), threads=threads, head_bits=bits)
                assert chain.head_bits == bits
                torch.testing.assert_close(chain.head_logits(feat), want, rtol=1e-5, atol=1e-4)


def test_the_int4_head_is_the_default_and_needs_quantized_activations(lib):
    """The runtime's chain reads an int4 head (half the bytes of the step's largest matrix) and rescores more rows;
    the exact float-activation reference keeps int8, and asking for int4 there is refused."""
    model = make_model(CFG)
    assert native.NativeChain(lib, model, None, DenoiseConfig(), threads=1).head_bits == 4
    exact = native.NativeChain(lib, model, None, DenoiseConfig(), threads=1, quantize_activations=False)
    assert exact.head_bits == 8 and exact._model.rescore == native.RESCORE[8] < native.RESCORE[4]
    with pytest.raises(ValueError, match="quantized activations"):
        native.NativeChain(lib, model, None, DenoiseConfig(), threads=1, quantize_activations=False, head_bits=4)


def test_a_greedy_tree_is_drafted_natively_like_torch(lib, monkeypatch):
    """A greedy tree (top_k 2) reads its round's real rows through the native step when they are few
    (``NATIVE_MAX_ROWS``; a backlog through torch), and forwards each level's nodes through it with their tree
    mask and shared RoPE position.  With int8-exact weights and float activations (the same arithmetic) every
    tree, its parents, its real-cell count and every cell the trees wrote equal the torch draft's."""
    model = int8_exact(make_model(CFG))
    feats, toks = rows(CFG, 40, seed=9)
    ref, r = float_runner(model, DenoiseConfig()), float_runner(model, DenoiseConfig())
    r._native = native.NativeChain(lib, r.model, r.cache, DenoiseConfig(), threads=2, quantize_activations=False)
    reads, read = [], r._native.read
    monkeypatch.setattr(r._native, "read", lambda rows_, tokens, p0: reads.append(len(tokens)) or read(rows_, tokens, p0))
    levels, nodes = [], r._native.nodes
    monkeypatch.setattr(r._native, "nodes", lambda g, *a: levels.append(len(g)) or nodes(g, *a))
    for x in (ref, r):
        x.prefill(feats[:8], toks[:8])
    widths = set()
    for a, b in [(8, 9), (9, 11), (11, 19), (19, 22), (22, 23)]:  # 1 and 2 rows, a backlog of 8, 3 and 1 rows
        got = []
        for x in (ref, r):
            n = x.n
            prop = x.propose_tree(feats[a:b], toks[a:b], top_k=2, total_tokens=5, depth=3)
            got.append((prop.tokens.tolist(), prop.parents.tolist(), prop.n_real))
            assert prop.n_real == n + (b - a)
            written = x.n  # the real rows' cells, then the levels' nodes
        for i in range(CFG.n_blocks):
            for c, c_ref in ((r.cache.k[i], ref.cache.k[i]), (r.cache.v[i], ref.cache.v[i])):
                torch.testing.assert_close(c[:, :, :written], c_ref[:, :, :written], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(r.cache.log_gate[i][:written], ref.cache.log_gate[i][:written], rtol=1e-4,
                                       atol=1e-4)
        assert written == ref.n == got[1][2] + 4  # two levels of two nodes each
        for x in (ref, r):
            x.rollback(got[1][2])
        assert got[0] == got[1]
        widths.add(len(got[1][0]) - 1)
    assert reads == [1, 2, 3, 1]  # the backlog went through torch
    assert levels == [2, 2] * 5  # every tree's two forwarded levels went through the native step
    assert widths == {5}  # whole trees: the root's two children, two of theirs, one more
