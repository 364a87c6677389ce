"""Prometheus metrics of one server, in its own registry (two apps in one process never collide).

Counters are the source of rates (tokens/s over any window is ``rate(generated_tokens)``);
the two gauges of the last request are for a glance at a dashboard.
"""
from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from ..records import RunStats

PREFIX = "hetero_spec"
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class Metrics:
    """Every metric the server exports; ``observe_generation`` takes one finished request's stats."""

    content_type = CONTENT_TYPE_LATEST

    def __init__(self, queue_depth: Callable[[], int], busy: Callable[[], int], slots: int = 1) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter(f"{PREFIX}_requests", "HTTP requests by endpoint and status "
                                "(499: the client left before the end)", ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "prompt tokens of generations", registry=r)
        self.generated_tokens = Counter(f"{PREFIX}_generated_tokens", "tokens generated", registry=r)
        self.rounds = Counter(f"{PREFIX}_rounds", "draft-verify rounds", registry=r)
        self.drafted = Counter(f"{PREFIX}_drafted_tokens", "tokens proposed by the draft model or copied from the text", registry=r)
        self.accepted = Counter(f"{PREFIX}_accepted_tokens", "proposed tokens the target accepted", registry=r)
        self.tokens_per_s = Gauge(f"{PREFIX}_tokens_per_second", "decode speed of the last finished generation",
                                  registry=r)
        self.mean_accepted = Gauge(f"{PREFIX}_mean_accepted_length", "mean accepted length (bonus token "
                                   "included) of the last finished generation", registry=r)
        Gauge(f"{PREFIX}_queue_depth", "requests waiting for the model", registry=r).set_function(queue_depth)
        Gauge(f"{PREFIX}_busy", "requests generating now (slots in use)", registry=r).set_function(busy)
        Gauge(f"{PREFIX}_slots", "slots (sequences decoded together; --parallel)", registry=r).set(slots)
        Gauge(f"{PREFIX}_slot_occupancy", "share of the slots in use", registry=r).set_function(
            lambda: busy() / slots)
        # engine steps (--parallel): rows per llama_decode, and rows by kind (prompt, plain, draft, and pad:
        # rows that keep the slots in one micro-batch), so the drafted-row share is
        # rate(rows_total{kind="draft"}) / rate(rows_total)
        self.step_rows = Histogram(f"{PREFIX}_step_rows", "rows in one engine step's llama_decode",
                                   buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64), registry=r)
        self.rows = Counter(f"{PREFIX}_rows", "rows decoded by engine steps, by kind", ["kind"], registry=r)
        for kind in ("prompt", "plain", "draft", "pad"):
            self.rows.labels(kind)
        self.accepted_rows = Counter(f"{PREFIX}_accepted_rows", "draft rows of engine steps the target accepted",
                                     registry=r)
        self.reused_prompt = Counter(f"{PREFIX}_reused_prompt_tokens", "prompt tokens a request found in its "
                                     "slot's cells (an earlier turn, a shared prefix) instead of decoding them",
                                     registry=r)
        self.restored_prompt = Counter(f"{PREFIX}_restored_prompt_tokens", "of the reused prompt tokens, those "
                                       "put back from the host-memory prompt cache (--cache-ram)", registry=r)
        self.prompt_cache_bytes = Gauge(f"{PREFIX}_prompt_cache_bytes", "host memory held by saved prompt cells "
                                        "(--cache-ram)", registry=r)
        self.decode_steps = Counter(f"{PREFIX}_decode_steps", "engine steps (one llama_decode each)", registry=r)
        self.queue_wait = Histogram(f"{PREFIX}_queue_wait_seconds", "time from arrival to the model taking a request",
                                    buckets=LATENCY_BUCKETS, registry=r)
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds", "time from arrival to the first text",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.prefill = Histogram(f"{PREFIX}_prefill_seconds", "prompt prefill time", buckets=LATENCY_BUCKETS,
                                 registry=r)
        self.decode = Histogram(f"{PREFIX}_decode_seconds", "generation time after the prefill",
                                buckets=LATENCY_BUCKETS, registry=r)

    def observe_generation(self, stats: RunStats) -> None:
        self.prompt_tokens.inc(stats.prompt_tokens)
        self.generated_tokens.inc(stats.new_tokens)
        self.rounds.inc(len(stats.rounds))
        self.drafted.inc(stats.total("drafted"))
        self.accepted.inc(stats.total("accepted"))
        self.prefill.observe(stats.prefill_s)
        self.decode.observe(max(0.0, stats.wall_s - stats.prefill_s))
        if stats.new_tokens > 1:
            self.tokens_per_s.set(stats.tokens_per_s)
        if stats.rounds:
            self.mean_accepted.set(stats.mean_accepted_length)

    def render(self) -> bytes:
        return generate_latest(self.registry)
