"""The draft model in the batched engine: one set of weights, a KV cache and context rows per slot.

WHY per slot: a draft's state is its text (the cells of every position it has read, and the target's
head rows of tokens seen in that text, ``draft/context_head.py``), so each sequence of the engine needs
its own, while the weights, the largest part of a draft step's memory traffic, are shared.  The slots'
caches are views into one tensor per block, ``[n_slots, n_kv, positions, head_dim]``.

On a CPU with the native chain (``draft/native.py``), up to ``NATIVE_MAX_SLOTS`` slots draft one after
another through it: k native steps cost less than one torch forward of the batch.  More slots, or a draft
without it, draft together, in one forward per depth: their rows go through the fusion, the blocks and
the head as one batch (one read of the weights, one set of kernel launches on a GPU), each row attending
to its own slot's cells.  The slots' queued real rows are read
first, in one forward too: slot b's m_b rows padded to the longest slot's.  The int8 layers quantize a
batch's activations together, so a batched chain can differ from the one the slot would draft alone in
a near-tie; a draft only proposes, so that changes acceptance at most, never the output.

Real rows arrive after every decode: the target's features of each kept row with the token picked
after it (a prompt row's next prompt token, a generated row's answer token).  They queue per slot and
are read the next time that slot drafts, so a step that does not draft costs nothing here.  Positions
whose cells were reused from an earlier request have no features; the draft skips them
(``DraftRunner.skip``), as ``HeteroSpec`` does for a reused prefix.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..config import DenoiseConfig
from ..draft.context_head import ContextHead
from ..draft.runner import NATIVE_MAX_ROWS, DraftCache, DraftRunner
from ..target.sequences import SequenceOptions, SequenceTarget

FLUSH_ROWS = 1024  # real rows a slot may queue while it does not draft (7 MB of SmolLM2's taps); then they are read
# rows a slot reads in the slots' shared forward; a longer backlog (a prompt, rows piled up between probes) is read
# alone first, so that the other slots' few rows are not padded to its length
TOGETHER_ROWS = 16
# Up to this many slots draft one after another through the runner's native chain (draft/native.py) rather than
# together in one torch forward per depth: measured on the default model and draft (2 threads, 2 queued rows a
# slot, k=3), 0.9 against 3.8 ms for one slot and 3.8 against 5.6 ms for four.
NATIVE_MAX_SLOTS = 4


@dataclass
class SlotDraft:
    """One slot's draft state: its cache cells and context rows, and the real rows not read yet."""

    cache: DraftCache
    head: ContextHead
    feats: list[np.ndarray] = field(default_factory=list)  # [m_i, feature_size] float32 blocks
    tokens: list[int] = field(default_factory=list)  # the token that followed each queued row
    active: bool = False  # serving a request the draft drafts for

    @property
    def queued(self) -> int:
        return len(self.tokens)


class SlotDrafts:
    """``runner``'s weights drafting for ``n_slots`` sequences, each with its own cache and context rows.

    >>> drafts = SlotDrafts(runner, n_slots=4)
    >>> drafts.start(seq, prompt, reused=0)          # a request takes the slot
    >>> drafts.feed(seq, features, next_tokens)      # after each decode, the kept rows
    >>> drafts.propose([0, 2], k=3)                  # {seq: [3 ids]}
    """

    def __init__(self, runner: DraftRunner, n_slots: int) -> None:
        self.runner = runner
        runner.cuda_graph = False  # a captured step is bound to one cache's buffers, and slots swap caches
        cfg, dev, dtype = runner.cfg, runner.device, runner.dtype
        shape = (n_slots, cfg.n_kv_heads, cfg.max_positions, cfg.head_dim)
        self._k = k = [torch.zeros(shape, device=dev, dtype=dtype) for _ in range(cfg.n_blocks)]
        self._v = v = [torch.zeros(shape, device=dev, dtype=dtype) for _ in range(cfg.n_blocks)]
        self._gates = gates = [torch.zeros(n_slots, cfg.max_positions, device=dev) for _ in range(cfg.n_blocks)]
        self._holes = holes = torch.zeros(n_slots, cfg.max_positions, device=dev)
        # slots that draft together share one forward per depth (False: one after another); with a native chain,
        # up to NATIVE_MAX_SLOTS go one after another anyway
        self.batched = True
        self.slots = [SlotDraft(DraftCache(k=[t[s:s + 1] for t in k], v=[t[s:s + 1] for t in v],
                                           log_gate=[g[s] for g in gates], holes=holes[s]),
                                runner._head.fresh()) for s in range(n_slots)]
        # measured, for the slots that draft together: one depth, and reading the real rows a step adds (a slot
        # that drafts every step reads its kept rows, a few; a backlog read after a pause is not a step's price)
        self.step_ms: float | None = None
        self.read_ms: float | None = None

    @property
    def feature_size(self) -> int:
        return self.runner.cfg.input_size

    def start(self, seq: int, prompt: list[int], reused: int) -> None:
        """Slot ``seq`` takes a request: an empty cache past the ``reused`` prompt cells (skipped: no features),
        context rows for the prompt's tokens."""
        s = self.slots[seq]
        s.cache.n = 0
        s.head.clear()
        s.feats, s.tokens, s.active = [], [], True
        s.head.add(prompt)
        self._use(s)
        self.runner.skip(min(reused, self.runner.max_positions))

    def stop(self, seq: int) -> None:
        self.slots[seq].active = False
        self.slots[seq].feats, self.slots[seq].tokens = [], []

    def feed(self, seq: int, features: np.ndarray, next_tokens: list[int]) -> None:
        """Real rows of slot ``seq``, in position order: the target's features [m, feature_size] of the rows it
        kept, and the token that followed each."""
        s = self.slots[seq]
        if not s.active or not next_tokens:
            return
        s.feats.append(np.asarray(features, dtype=np.float32).reshape(len(next_tokens), -1))
        s.tokens.extend(int(t) for t in next_tokens)
        s.head.add(next_tokens)
        if s.queued >= FLUSH_ROWS:
            self._read(s)

    def propose(self, seqs: list[int], k: int) -> dict[int, list[int]]:
        """``k`` greedy drafts for each slot of ``seqs`` that has real rows queued, reading them first.
        ``step_ms`` keeps the time of one depth for the slots together; ``read_ms`` the time of reading the
        rows, from calls where each slot had only a step's worth queued (at most ``k`` + 2)."""
        ready = []
        for seq in seqs:
            s = self.slots[seq]
            if not s.active or not s.queued:
                continue
            if s.cache.n + s.queued + k > self.runner.max_positions:
                s.active = False  # its cells are full: the slot goes on without drafts
                continue
            ready.append(seq)
        if not ready:
            return {}
        steady = max(self.slots[seq].queued for seq in ready) <= k + 2
        t0 = time.perf_counter()
        if self.batched and not (self.runner._native is not None and len(ready) <= NATIVE_MAX_SLOTS):
            out, depth_s = self._propose_together(ready, k)
        else:  # each slot through the runner alone: its native chain, or the tests' comparison
            out, depth_s = {}, 0.0
            for seq in ready:
                s = self.slots[seq]
                if s.queued > NATIVE_MAX_ROWS:  # a backlog is read first, so that a depth's price is a depth's
                    self._read(s, keep=1)
                feats, tokens = self._take(s)
                self._use(s)
                n_real = s.cache.n + len(tokens)
                t_slot = time.perf_counter()
                out[seq] = self.runner.propose(feats, tokens, k)
                depth_s += time.perf_counter() - t_slot
                self.runner.rollback(n_real)  # the drafted cells go; the real rows stay
        ms = 1e3 * depth_s / k
        self.step_ms = ms if self.step_ms is None else 0.8 * self.step_ms + 0.2 * ms
        if steady:
            read = max(0.0, 1e3 * (time.perf_counter() - t0 - depth_s))
            self.read_ms = read if self.read_ms is None else 0.8 * self.read_ms + 0.2 * read
        return out

    @torch.inference_mode()
    def _propose_together(self, seqs: list[int], k: int) -> tuple[dict[int, list[int]], float]:
        """``DraftRunner.propose`` for several slots: one forward reads every slot's queued real rows, then every
        depth is one forward of one row per slot; also returns the seconds the depths took."""
        r = self.runner
        for seq in seqs:
            if self.slots[seq].queued > TOGETHER_ROWS:  # the backlog alone; its newest row joins the others
                self._read(self.slots[seq], keep=1)
        taken = [self._take(self.slots[seq]) for seq in seqs]
        lengths = [len(tokens) for _, tokens in taken]
        M = max(lengths)
        # slot b's rows at [b, :m_b]; its pad rows repeat its last real row (so the fusion's int8 inputs, quantized
        # with the batch's, hold no values the real rows lack) and are dropped with their cells
        offsets = np.cumsum([0] + lengths[:-1])
        pick = torch.tensor([[o + min(j, m - 1) for j in range(M)] for o, m in zip(offsets, lengths)], device=r.device)
        g = r._real(np.concatenate([rows for rows, _ in taken]))[0, pick]  # [B, M, feature_size]
        tokens = r._tokens([t for _, ts in taken for t in ts])[0, pick]  # [B, M]
        x, feat = self._forward_together(seqs, g, tokens, lengths)
        n_real = [self.slots[seq].cache.n for seq in seqs]
        t0 = time.perf_counter()
        chains = []  # [B] target ids per depth, on the device: read back once
        for j in range(k):
            tok = self._greedy(seqs, feat[:, 0])
            chains.append(tok)
            if j + 1 < k:
                x, feat = self._forward_together(seqs, r.model.drafted_input(x, feat), tok.view(-1, 1))
        for seq, n in zip(seqs, n_real):
            self.slots[seq].cache.n = n  # the drafted cells go; the real rows stay
        out = dict(zip(seqs, torch.stack(chains, dim=1).tolist()))  # the one read-back (a GPU waits here)
        return out, time.perf_counter() - t0

    def _greedy(self, seqs: list[int], feat: torch.Tensor) -> torch.Tensor:
        """Each row's proposal [B] (target ids) from its slot's head: the shared rows scored together (int8 with
        the best rows rescored in float, as ``RescoredInt8Head.best``), then the slot's own context rows."""
        base = self.runner._head.base  # the rows every slot shares
        best = getattr(base, "best_rows", None)
        if best is not None:
            rows, scores = best(feat)
        else:
            scores, rows = base(feat).float().max(dim=-1)
        return torch.stack([self.slots[seq].head.pick(feat[b:b + 1], rows[b], scores[b]) for b, seq in enumerate(seqs)])

    def _forward_together(self, seqs: list[int], g: torch.Tensor, tokens: torch.Tensor,
                          lengths: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of several slots in one forward: g [B, M, feature_size], tokens [B, M]; slot ``seqs[b]``'s rows
        are [b, :lengths[b]] (all M by default), at its next cells; the rest pad.  Returns the last real row
        of each slot: (pre-norm [B, 1, hidden], predicted features [B, 1, n_embd]).

        ``DraftRunner._forward``'s arithmetic (``_forward_one``'s for one row), each row attending to its own
        slot's cells up to its own position.  Pad rows sit at the cells after their slot's real rows (the last
        cell at most), which nothing reads before a real or drafted row writes them again."""
        r, model = self.runner, self.runner.model
        cfg, dev = r.cfg, r.device
        nh, nkv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        B, M = tokens.shape
        half, grp = hd // 2, nh // nkv
        m = lengths or [M] * B
        n0 = [self.slots[seq].cache.n for seq in seqs]
        ends = [n + mb for n, mb in zip(n0, m)]  # each slot's cells after its real rows
        L, last_cell = max(ends), r.max_positions - 1
        # indices built on the host and sent once each: nothing here reads the device back
        S = torch.tensor(seqs, device=dev)
        P = torch.tensor([[min(n + j, last_cell) for j in range(M)] for n in n0], device=dev)
        end = torch.tensor(ends, device=dev)
        cols = torch.arange(L, device=dev)
        later = cols[None, None, :] > P[:, :, None]  # [B, M, L]: cells past each row's own position
        x, attn_in = model.fusion(g, model.embed[tokens])
        cos, sin = model.rope_cos[P][:, :, None], model.rope_sin[P][:, :, None]  # [B, M, 1, hd]
        SB = S[:, None].expand(B, M)
        self._holes[SB, P] = 0.0  # these cells get real states now
        for i, blk in enumerate(model.blocks):
            if attn_in is not None:
                xn, attn_in = attn_in, None
            else:
                xn = blk.attn_norm(x) if blk.attn_norm is not None else x
            qkv = blk.qkv(xn).view(B, M, nh + 2 * nkv, hd)
            qk = qkv[:, :, : nh + nkv]
            qk = (qk * cos + torch.cat((-qk[..., half:], qk[..., :half]), dim=-1) * sin).to(qkv.dtype)
            self._k[i][SB, :, P] = qk[:, :, nh:]
            self._v[i][SB, :, P] = qkv[:, :, nh + nkv:]
            gated = blk.importance is not None
            if gated:
                self._gates[i][SB, P] = F.logsigmoid(blk.importance(xn).view(B, M).float())
                bias = self._gates[i][S, :L] + self._holes[S, :L]
                if r._log_threshold is not None:  # denoising: old keys under the threshold go, a recent window stays
                    recent = cols[None, :] >= (end - r.denoise.recent_window)[:, None]
                    bias = torch.where(recent | (bias >= r._log_threshold), bias, float("-inf"))
            else:
                bias = self._holes[S, :L].clone()
            bias = bias[:, None, :].masked_fill(later, float("-inf"))  # [B, M, L]
            q = qk[:, :, :nh].reshape(B, M, nkv, grp, hd).permute(0, 2, 3, 1, 4)  # [B, nkv, grp, M, hd]
            keys, values = self._k[i][S, :, None, :L], self._v[i][S, :, None, :L]  # [B, nkv, 1, L, hd]
            scores = torch.matmul(q, keys.transpose(-1, -2)) * hd**-0.5 + bias[:, None, None].to(q.dtype)
            a = torch.matmul(scores.softmax(dim=-1), values)  # [B, nkv, grp, M, hd]
            x = blk.after_attention(x, a.permute(0, 3, 1, 2, 4).reshape(B, M, nh * hd))
        for seq, n in zip(seqs, ends):
            self.slots[seq].cache.n = n
        last = x if M == 1 else x[torch.arange(B, device=dev), torch.tensor(m, device=dev) - 1][:, None]  # [B, 1, hidden]
        return last, model.feature_out(last)

    def _take(self, s: SlotDraft) -> tuple[np.ndarray, list[int]]:
        """The slot's queued rows, which leave the queue."""
        feats, tokens = np.concatenate(s.feats), s.tokens
        s.feats, s.tokens = [], []
        return feats, tokens

    def _read(self, s: SlotDraft, keep: int = 0) -> None:
        """Read the queued rows without proposing (a slot that has not drafted for a while), all but the ``keep``
        newest, which stay queued."""
        if s.cache.n + s.queued > self.runner.max_positions:
            s.active = False
            return
        self._use(s)
        rows, tokens = self._take(s)
        self.runner.prefill(rows[:len(tokens) - keep], tokens[:len(tokens) - keep])
        if keep:
            s.feats, s.tokens = [rows[-keep:]], tokens[-keep:]

    def _use(self, s: SlotDraft) -> None:
        """Point the runner at slot ``s``'s cache and context rows."""
        self.runner.cache, self.runner._head = s.cache, s.head


def open_slots(model: str | Path, draft: str | Path | None, options: SequenceOptions, *, device: str = "auto",
               dtype: str = "auto", denoise: DenoiseConfig = DenoiseConfig()
               ) -> tuple[SequenceTarget, SlotDrafts | None]:
    """The engine's target and, with a draft file, the slots' drafts: the target opened with the features the
    draft reads (its taps), the draft loaded against it as ``run`` loads one (``api.load_runner``).  The target
    is closed if the draft fails to load."""
    from ..api import draft_taps, load_runner

    if draft is not None:
        options = replace(options, features=True, taps=draft_taps(draft))
    target = SequenceTarget(model, options)
    if draft is None:
        return target, None
    try:
        runner = load_runner(target, draft, device=device, dtype=dtype, denoise=denoise)
        return target, SlotDrafts(runner, options.n_seq)
    except BaseException:
        target.close()
        raise
