"""Suffix decoding without a model: trees of the continuations that followed the text's longest suffix match.

SuffixDecoding (Oliaro et al., arXiv 2411.04975) drafts from a suffix tree over the request's prompt and
output plus a global tree over past outputs: it matches the longest suffix of the text, takes the subtree
below the match (every continuation that followed an occurrence of that suffix, counted) and proposes the
most frequent branches, as deep as the match is long.  Its reference implementation (the
``arctic-inference`` package) is C++ behind nanobind bindings and builds only from an sdist whose build
requirements pull torch from PyPI, so this is the same idea natively, with the suffix tree's queries
answered from an n-gram position index:

* the node of the longest matching suffix holds exactly the occurrences whose match, counted backwards
  from the text's end, is longest, so the index maps every ``key``-token n-gram to where it occurred, and a
  query extends the most recent occurrences of the last n-gram backwards (at most ``longest`` tokens);
* the subtree below that node is the trie of what followed those occurrences, built per query from at
  most ``occurrences`` of them and ``depth`` tokens each; a node's probability is its count over its
  parent's, times its parent's (SuffixDecoding's estimate), and the proposal is the ``max_nodes`` most
  probable nodes above ``min_prob`` (a parent is always at least as probable as its child, so they form a tree);
* the depth is capped by ``depth_factor`` times the match length (SuffixDecoding's ``max_spec_factor``).

Sources: the request's own text (prompt and output, ``SuffixRequest``), a bounded FIFO cache of past
outputs in this process (``SuffixCache``: the server's other requests, earlier turns, earlier calls),
which a file can carry across runs (``SuffixCache.save``/``load``), and, in the batched engine, the texts
of the requests being served beside it (``propose(peers=...)``).  Prompt lookup's proposal (the latest
occurrence of the longest <= 4-gram match, ``spec/lookup.py``) is the one-occurrence case of the first.
"""
from __future__ import annotations

import heapq
import json
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Hashable, Iterable, Sequence

import numpy as np

from .. import atomic_file

SEP = -1  # between cached outputs: no real token equals it, so no match or continuation crosses it


@dataclass(frozen=True)
class SuffixConfig:
    """Bounds of the suffix structure: proposal shape, query work and cache memory."""

    max_depth: int = 16  # deepest proposal (behind a long match a copy's tokens are right 98% of the time at any depth)
    max_nodes: int = 12  # nodes of a proposal tree (rows of one verification, the root aside)
    min_prob: float = 0.1  # a node's estimated probability must reach this to be proposed
    depth_factor: float = 1.0  # depth <= ceil(depth_factor * match length)
    key: int = 2  # tokens of the indexed n-grams: the shortest match that proposes anything
    longest: int = 32  # match lengths are counted back up to this many tokens
    occurrences: int = 16  # most recent occurrences of the last n-gram a query looks at, per source
    cache_tokens: int = 1 << 18  # past-output tokens kept (FIFO); 0: no cache
    # prompt tokens cached before each output, so that a request repeating a past prompt's end matches into
    # that answer from its first token on (0: outputs alone)
    prompt_context: int = 32

    def __post_init__(self) -> None:
        if self.max_depth < 1 or self.max_nodes < 1 or self.key < 1 or self.occurrences < 1:
            raise ValueError("max_depth, max_nodes, key and occurrences must be at least 1")
        if not 0.0 <= self.min_prob <= 1.0 or self.depth_factor <= 0 or self.cache_tokens < 0 or self.prompt_context < 0:
            raise ValueError("need 0 <= min_prob <= 1, depth_factor > 0, cache_tokens >= 0, prompt_context >= 0")
        if self.longest < self.key:
            raise ValueError(f"longest ({self.longest}) must be at least key ({self.key})")


@dataclass
class SuffixProposal:
    """A draft tree below the root (the last accepted token, node 0, which the caller fills in).

    Nodes are parents first; ``parents[i] < i``; ``probs`` the estimated probability of reaching node i."""

    tokens: list[int]  # [n] token ids; tokens[0] is a placeholder for the root
    parents: list[int]  # [n]; parents[0] = -1
    depths: list[int]  # [n]; 0 for the root
    probs: list[float]  # [n]; 1.0 for the root
    match: int  # length of the suffix match behind it
    chain: list[int] = field(default_factory=list)  # the most probable path (what chains and sampled rounds verify)
    chain_probs: list[float] = field(default_factory=list)  # [len(chain)] the path's estimated probabilities
    cached: bool = False  # every occurrence behind it is in past outputs, none in the request's own text

    @property
    def depth(self) -> int:
        return self.depths[-1] if len(self.depths) > 1 else 0

    def sizes(self) -> list[int]:
        """Drafted nodes of depth <= d, for d = 0..depth (sizes[0] = 0): what a round of depth d verifies."""
        out = [0] * (max(self.depths) + 1)
        for d in self.depths[1:]:
            out[d] += 1
        for d in range(1, len(out)):
            out[d] += out[d - 1]
        return out

    def boost(self) -> list[float]:
        """Per depth d = 0..len(chain): the tree's estimated probability mass at depth d over the chain's node
        there (1 where the tree has no sibling there): how much likelier the tree is to reach depth d than the
        chain, by SuffixDecoding's frequency estimate.  Auto scales the chain's measured acceptance by it."""
        mass = [0.0] * (len(self.chain) + 1)
        for d, p in zip(self.depths[1:], self.probs[1:]):
            if d <= len(self.chain):
                mass[d] += p
        return [1.0] + [max(1.0, m / c) for m, c in zip(mass[1:], self.chain_probs)]

    def truncated(self, depth: int) -> tuple[list[int], list[int]]:
        """(tokens, parents) of the nodes at depth <= ``depth``, re-indexed, root first."""
        keep = [i for i, d in enumerate(self.depths) if d <= depth]
        where = {old: new for new, old in enumerate(keep)}
        return [self.tokens[i] for i in keep], [where.get(self.parents[i], -1) for i in keep]


class _Index:
    """Tokens (a Python list) and, per ``key``-gram, the positions right after its occurrences, in order."""

    def __init__(self, key: int) -> None:
        self.key = key
        self.tokens: list[int] = []
        self.where: dict[tuple[int, ...], list[int]] = {}

    def extend(self, tokens: Iterable[int]) -> None:
        t, k, where = self.tokens, self.key, self.where
        for tok in tokens:
            j = len(t)  # the n-gram ending just before position j is continued by the token at j
            if j >= k:
                gram = tuple(t[j - k : j])
                if SEP not in gram:
                    where.setdefault(gram, []).append(j)
            t.append(int(tok))

    def matches(self, text: list[int], gram: tuple[int, ...], limit: int, longest: int,
                exclude_from: int) -> list[tuple[int, int]]:
        """(match length, position) of the latest ``limit`` occurrences of ``gram`` before ``exclude_from``,
        the match counted back from the end of ``text`` (``text`` may be this index's own tokens)."""
        positions = self.where.get(gram)
        if not positions:
            return []
        t, k, n = self.tokens, self.key, len(text)
        out = []
        for p in reversed(positions):
            if p >= exclude_from:
                continue
            m = k
            while m < longest and p - m - 1 >= 0 and n - m - 1 >= 0 and t[p - m - 1] == text[n - m - 1] != SEP:
                m += 1
            out.append((m, p))
            if len(out) == limit:
                break
        return out


class SuffixCache:
    """Past outputs of this process, bounded to ``config.cache_tokens`` tokens, oldest evicted first.

    Keyed by whatever identifies a request (a conversation id, a hash of the prompt): adding under a key
    already held replaces that entry.  Evicted tokens become separators in place; the index is rebuilt
    when dead tokens reach a quarter of the buffer, so eviction costs nothing per round."""

    def __init__(self, config: SuffixConfig = SuffixConfig()) -> None:
        self.config = config
        self.entries: OrderedDict[Hashable, tuple[int, int]] = OrderedDict()  # key -> (start, end) in the index
        self.index = _Index(config.key)
        self.live = 0  # tokens of entries still held
        self._added = 0  # outputs added without a key

    def __len__(self) -> int:
        return len(self.entries)

    def add(self, key: Hashable | None, tokens: Sequence[int]) -> None:
        """Cache one output (end-of-generation tokens included or not, as the caller likes); key None: a new one."""
        if key is None:
            self._added += 1
            key = ("request", self._added)
        cap = self.config.cache_tokens
        tokens = [int(t) for t in tokens][-cap:] if cap else []
        if key in self.entries:
            self.evict(key)
        if not tokens:
            return
        while self.entries and self.live + len(tokens) > cap:
            self.evict(next(iter(self.entries)))
        start = len(self.index.tokens)
        self.index.extend([*tokens, SEP])
        self.entries[key] = (start, start + len(tokens))
        self.live += len(tokens)

    def evict(self, key: Hashable) -> None:
        """Forget one entry (nothing if it is not held)."""
        span = self.entries.pop(key, None)
        if span is None:
            return
        start, end = span
        self.index.tokens[start:end] = [SEP] * (end - start)  # its occurrences can no longer match
        self.live -= end - start
        if len(self.index.tokens) > 4 * max(self.live, 1024) // 3:
            self._rebuild()

    def clear(self) -> None:
        self.entries.clear()
        self.index = _Index(self.config.key)
        self.live = 0

    def _rebuild(self) -> None:
        old, spans = self.index.tokens, list(self.entries.items())
        self.clear()
        for key, (start, end) in spans:
            self.add(key, old[start:end])

    def outputs(self) -> list[tuple[Hashable, list[int]]]:
        """(key, tokens) of every entry, oldest first."""
        t = self.index.tokens
        return [(key, t[start:end]) for key, (start, end) in self.entries.items()]

    def save(self, path: str | Path) -> Path:
        """Write the cached outputs as JSON, to ``load`` in a later run.  Keys made of strings and integers
        (``prompt_key``'s tuples among them) come back equal, so a prompt run again still replaces its
        entry; other keys come back as their ``str``."""
        path = Path(path)
        data = {"format": "hetero-spec suffix cache", "version": 1, "config": asdict(self.config),
                "entries": [[_key_out(key), tokens] for key, tokens in self.outputs()]}
        return atomic_file.write_text(path, json.dumps(data, separators=(",", ":")))

    def load(self, path: str | Path) -> int:
        """Add the outputs a ``save`` wrote (after what is held, oldest first); returns how many.
        A file that is not such a cache raises ValueError."""
        try:
            data = json.loads(Path(path).read_text())
            if data.get("format") != "hetero-spec suffix cache":
                raise ValueError("not a hetero-spec suffix cache")
            entries = [(_key_in(key), [int(t) for t in tokens]) for key, tokens in data["entries"]]
        except (OSError, KeyError, TypeError, AttributeError, ValueError) as exc:
            raise ValueError(f"{path}: not a readable suffix cache ({exc})") from None
        for key, tokens in entries:
            if any(t < 0 for t in tokens):
                raise ValueError(f"{path}: negative token id in entry {key!r}")
            self.add(key, tokens)
        return len(entries)


def _key_out(key: Hashable):
    plain = lambda k: isinstance(k, (str, int)) and not isinstance(k, bool)
    if plain(key) or (isinstance(key, tuple) and all(plain(k) for k in key)):
        return list(key) if isinstance(key, tuple) else key
    return str(key)


def _key_in(key) -> Hashable:
    return tuple(key) if isinstance(key, list) else key


def prompt_key(prompt: Sequence[int]) -> tuple[str, int]:
    """The cache key of a request's output: its prompt, so that running a prompt again replaces its
    output instead of adding a copy that would make the same continuation look twice as likely."""
    return ("prompt", hash(tuple(int(t) for t in prompt)))


class SuffixRequest:
    """One request's suffix structure over its prompt and output, drafting from it and the shared cache.

    >>> req = SuffixRequest([5, 6, 7, 8, 9, 5, 6, 7, 8])
    >>> req.propose().chain  # the match (5, 6, 7, 8) is 4 long: 4 tokens deep at most
    [9, 5, 6, 7]
    """

    def __init__(self, prompt: Sequence[int], cache: SuffixCache | None = None,
                 config: SuffixConfig | None = None, key: Hashable | None = None) -> None:
        self.config = config or (cache.config if cache is not None else SuffixConfig())
        self.cache = cache
        self.key = key  # the cache entry this request's output becomes (None: a new one)
        self.own = _Index(self.config.key)
        self.own.extend(prompt)
        self.n_prompt = len(self.own.tokens)

    @property
    def output(self) -> list[int]:
        return self.own.tokens[self.n_prompt :]

    def extend(self, tokens: Iterable[int]) -> None:
        """Append accepted tokens to the request's text."""
        self.own.extend(tokens)

    def finish(self) -> None:
        """Hand the output, after the last ``prompt_context`` tokens of its prompt, to the shared cache (under
        ``key``) for later requests.

        WHY the prompt's end: a cached output alone is found only once a later answer has repeated enough of
        it to match (8 tokens before the engine trusts a copy), so a repeated request, a retry or the same
        question from another user, decodes its first tokens one by one; with the prompt's end before it, the
        repeated prompt itself is the match and the answer is copied from its first token."""
        if self.cache is not None and self.config.cache_tokens:
            self.cache.add(self.key, self.own.tokens[max(0, self.n_prompt - self.config.prompt_context):])

    def match(self, peers: Iterable["SuffixRequest"] = ()) -> list[tuple[int, int, _Index]]:
        """The occurrences behind the longest suffix match, as (length, position, index); [] without one.
        ``peers``: other requests in flight, whose prompts and outputs so far are searched too."""
        cfg, text = self.config, self.own.tokens
        if len(text) < cfg.key:
            return []
        gram = tuple(text[-cfg.key :])
        found = [(m, p, self.own) for m, p in self.own.matches(text, gram, cfg.occurrences, cfg.longest, len(text))]
        sources = [self.cache.index] if self.cache is not None and self.cache.entries else []
        sources += [peer.own for peer in peers if peer is not self]
        for idx in sources:
            found += [(m, p, idx) for m, p in idx.matches(text, gram, cfg.occurrences, cfg.longest, len(idx.tokens))]
        if not found:
            return []
        best = max(m for m, _, _ in found)
        return [f for f in found if f[0] == best]

    def propose(self, tree: bool = True, max_depth: int | None = None,
                peers: Iterable["SuffixRequest"] = ()) -> SuffixProposal | None:
        """The draft tree (``tree``) or chain of the most probable continuations, or None without a match.

        ``peers``: the requests served beside this one (the batched engine's other slots).  WHY: requests that
        run together often write the same text (the same question from two clients, agents filling one
        JSON template), and a peer's output joins the cache only when it ends; a peer that is ahead lends
        its continuation now, as llama.cpp's ``ngram-mod`` shares one n-gram table across server slots."""
        found = self.match(peers)
        if not found:
            return None
        cfg = self.config
        match = found[0][0]
        depth = min(max_depth or cfg.max_depth, cfg.max_depth, max(1, int(np.ceil(cfg.depth_factor * match))))
        conts = []
        for _, p, idx in found:
            c = idx.tokens[p : p + depth]
            if SEP in c:
                c = c[: c.index(SEP)]
            if c:
                conts.append(c)
        if not conts:
            return None
        prop = (_best_nodes(conts, match, cfg.max_nodes, cfg.min_prob) if tree
                else _best_chain(conts, match, depth, cfg.min_prob))
        if prop is not None:
            prop.cached = all(idx is not self.own for _, _, idx in found)
        return prop


def _best_chain(conts: list[list[int]], match: int, max_nodes: int, min_prob: float) -> SuffixProposal | None:
    """The most probable path of ``_best_nodes``'s trie, without building it: at each depth the most frequent next
    token among the continuations still on the path (the first seen among equals, as the trie's insertion
    order gives).  The batched engine asks every generating slot for a chain every step, mostly of one
    continuation."""
    alive, chain, probs, p = conts, [], [], 1.0
    while True:
        d, counts = len(chain), {}
        for c in alive:
            if len(c) > d:
                counts[c[d]] = counts.get(c[d], 0) + 1
        if not counts:
            break
        token = max(counts, key=counts.__getitem__)
        p *= counts[token] / len(alive)  # the path's count over its parent's (continuations ending there included)
        if p < min_prob:
            break
        chain.append(token)
        probs.append(p)
        alive = [c for c in alive if len(c) > d and c[d] == token]
    n = min(len(chain), max_nodes)
    if n == 0:
        return None
    return SuffixProposal(tokens=[-1] + chain[:n], parents=[-1] + list(range(n)), depths=list(range(n + 1)),
                          probs=[1.0] + probs[:n], match=match, chain=chain, chain_probs=probs)


def _best_nodes(conts: list[list[int]], match: int, max_nodes: int, min_prob: float) -> SuffixProposal | None:
    """The trie of the continuations, its ``max_nodes`` most probable nodes (best first, so parents first)."""
    children: list[dict[int, int]] = [{}]
    count, tok, parent, depth = [len(conts)], [-1], [-1], [0]
    for c in conts:
        node = 0
        for t in c:
            nxt = children[node].get(t)
            if nxt is None:
                nxt = children[node][t] = len(tok)
                children.append({})
                count.append(0)
                tok.append(t)
                parent.append(node)
                depth.append(depth[node] + 1)
            count[nxt] += 1
            node = nxt
    prob = [1.0] * len(tok)
    for i in range(1, len(tok)):  # trie nodes are numbered parents first
        prob[i] = prob[parent[i]] * count[i] / count[parent[i]]
    # the most probable path: what a chain verifies
    chain, node = [], 0
    while children[node]:
        node = max(children[node].values(), key=count.__getitem__)
        if prob[node] < min_prob:
            break
        chain.append(node)
    # best first; among equals the shallower node (it costs the same row and leads to more)
    picked, heap = [], [(-prob[c], 1, c) for c in children[0].values()]
    heapq.heapify(heap)
    while heap and len(picked) < max_nodes:
        p, d, node = heapq.heappop(heap)
        if -p < min_prob:
            break
        picked.append(node)
        for c in children[node].values():
            heapq.heappush(heap, (-prob[c], d + 1, c))
    # no deeper than the chain: auto prices a tree against the chain's acceptance (``boost``)
    picked = sorted((n for n in picked if depth[n] <= len(chain)), key=depth.__getitem__)  # parents first
    if not picked:
        return None
    new = {0: 0}
    for i, node in enumerate(picked, 1):
        new[node] = i
    return SuffixProposal(tokens=[-1] + [tok[n] for n in picked], parents=[-1] + [new[parent[n]] for n in picked],
                          depths=[0] + [depth[n] for n in picked], probs=[1.0] + [prob[n] for n in picked],
                          match=match, chain=[tok[n] for n in chain], chain_probs=[prob[n] for n in chain])


__all__ = ["SuffixConfig", "SuffixCache", "SuffixRequest", "SuffixProposal", "SEP", "prompt_key"]
