"""The draft's one-position forward with static shapes, so that CUDA can replay it as one graph.

WHY: on a GPU a draft step is a hundred-odd small kernels, each a few microseconds to launch from
Python, and the launches, not the GPU, set the step's time.  A CUDA graph replays all of them in one
call, but only if every shape and address stays fixed: the position is a device tensor, the cache
cell is written with ``index_copy_`` at it, and the attention reads the whole position-indexed cache
with the cells at or after the next position masked out (on an H200 reading 8,192 cached positions
of one block is a few megabytes, about a microsecond).  The arithmetic is ``DraftRunner._forward_one``'s.

On a CPU the same step runs eagerly (that is what the tests compare); it is not used there, since it
reads the whole cache where the dynamic step reads only the valid cells.

>>> step = StaticStep(runner)            # buffers on the runner's device
>>> x, feat = step(g, tokens)            # g [1, 1, feature_size], tokens [1, 1]; advances runner.n by one
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .model import _attend_one


class StaticStep:
    """One draft position at ``runner.n`` through fixed buffers; on CUDA captured once as a graph."""

    def __init__(self, runner, graph: bool | None = None) -> None:
        """``graph``: capture a CUDA graph (default: when the runner is on CUDA)."""
        self.runner = runner
        cfg, dev, dtype = runner.cfg, runner.device, runner.dtype
        self.g_in = torch.zeros(1, 1, cfg.feature_size, device=dev, dtype=dtype)  # what the fusion reads
        self.tok_in = torch.zeros(1, 1, dtype=torch.long, device=dev)
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)  # the cell written this step
        self._idx = torch.arange(cfg.max_positions, device=dev)  # [max_positions]
        self.x_out: torch.Tensor | None = None  # [1, 1, hidden] the pre-norm output, fixed address after capture
        self.feat_out: torch.Tensor | None = None  # [1, 1, n_embd] the predicted feature
        self._graph = None
        use_graph = dev.type == "cuda" if graph is None else graph
        if use_graph:
            self._capture()

    @torch.inference_mode()
    def _capture(self) -> None:
        """Warm up on a side stream (as torch.cuda.graphs asks), then record one step."""
        n0 = self.runner.cache.n
        self.pos.fill_(n0)
        side = torch.cuda.Stream(device=self.runner.device)
        side.wait_stream(torch.cuda.current_stream(self.runner.device))
        with torch.cuda.stream(side):
            for _ in range(2):  # writes cell n0, which is past the valid cells and rewritten before it is read
                self._run()
        torch.cuda.current_stream(self.runner.device).wait_stream(side)
        self._graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self._graph):
            self.x_out, self.feat_out = self._run()

    @torch.inference_mode()
    def __call__(self, g: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """g [1, 1, feature_size], tokens [1, 1] at position ``runner.n`` -> (pre-norm [1, 1, hidden], predicted
        feature [1, 1, n_embd]).  With a graph the results are its output buffers: read them before the next
        call.  No host synchronisation: the position is filled from the host's count."""
        cache = self.runner.cache
        if cache.n + 1 > self.runner.cfg.max_positions:
            raise ValueError("draft context is full")
        self.g_in.copy_(g, non_blocking=True)
        self.tok_in.copy_(tokens, non_blocking=True)
        self.pos.fill_(cache.n)
        if self._graph is not None:
            self._graph.replay()
            x, feat = self.x_out, self.feat_out
        else:
            x, feat = self._run()
        cache.n += 1
        return x, feat

    def _run(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The step on the fixed buffers (captured as is)."""
        r = self.runner
        model, cache, cfg = r.model, r.cache, r.cfg
        nh, nkv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        half, pos = hd // 2, self.pos
        x, attn_in = model.fusion(self.g_in, model.embed[self.tok_in])
        cos, sin = model.rope_cos.index_select(0, pos), model.rope_sin.index_select(0, pos)  # [1, hd]
        cache.holes.index_fill_(0, pos, 0.0)
        after = self._idx > pos  # [max_positions] cells not yet written this round
        for i, blk in enumerate(model.blocks):
            if attn_in is not None:
                xn, attn_in = attn_in, None
            else:
                xn = blk.attn_norm(x) if blk.attn_norm is not None else x
            qkv = blk.qkv(xn).view(nh + 2 * nkv, hd)
            qk = qkv[: nh + nkv]
            qk = (qk * cos + torch.cat((-qk[:, half:], qk[:, :half]), dim=-1) * sin).to(qkv.dtype)
            cache.k[i][0].index_copy_(1, pos, qk[nh:].unsqueeze(1))
            cache.v[i][0].index_copy_(1, pos, qkv[nh + nkv :].unsqueeze(1))
            gated = blk.importance is not None
            if gated:
                cache.log_gate[i].index_copy_(0, pos, F.logsigmoid(blk.importance(xn).view(1).float()))
            bias = self._bias(cache.log_gate[i], gated, after)
            a = _attend_one(qk[:nh].view(1, nh, 1, hd), cache.k[i], cache.v[i], bias.view(1, 1, 1, -1))
            x = blk.after_attention(x, a.view(1, 1, nh * hd))
        return x, model.feature_out(x)

    def _bias(self, log_gate: torch.Tensor, gated: bool, after: torch.Tensor) -> torch.Tensor:
        """[max_positions] additive bias: ``DraftRunner._bias`` of the valid cells, -inf after them."""
        r = self.runner
        bias = (log_gate if gated else r._zeros) + r.cache.holes
        if gated and r._log_threshold is not None:
            old = self._idx < self.pos + 1 - r.denoise.recent_window  # keys that may be dropped
            bias = bias.masked_fill(old & (bias < r._log_threshold), float("-inf"))
        return bias.masked_fill(after, float("-inf"))
