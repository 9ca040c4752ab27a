"""Prometheus metrics of a server, named after vLLM's (``vllm:`` becomes ``flexpage:``).

Each server has its own registry, so several can live in one process (tests).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)


class Metrics:
    """What the engine thread reports: queue depths, KV usage, prefix cache, tokens and latencies."""

    def __init__(self, model_name: str, kv_bytes_per_token: int) -> None:
        self.registry = CollectorRegistry()
        labels, values = ["model_name"], [model_name]

        def make(kind, name: str, doc: str, extra: tuple[str, ...] = (), labelled: bool = True, **kwargs):
            """A metric labelled with the model's name (or, unless ``labelled``, still open to ``extra``)."""
            metric = kind(f"flexpage:{name}", doc, [*labels, *extra], registry=self.registry, **kwargs)
            return metric.labels(*values) if labelled else metric

        self.running = make(Gauge, "num_requests_running", "Requests in the engine's running batch")
        self.waiting = make(Gauge, "num_requests_waiting", "Requests waiting to be admitted")
        self.kv_usage = make(Gauge, "kv_cache_usage_perc", "Fraction of KV-cache pages in use (1 = full)")
        make(Gauge, "kv_cache_bytes_per_token", "KV-cache pool bytes per token slot (every pool, K and V, scales included)"
             ).set(kv_bytes_per_token)
        self.prefix_queries = make(Counter, "prefix_cache_queries", "Prompt tokens looked up in the prefix cache")
        self.prefix_hit_tokens = make(Counter, "prefix_cache_hits", "Prompt tokens served from the prefix cache")
        self.preemptions = make(Counter, "num_preemptions", "Requests preempted (pages freed, recomputed later)")
        self.prompt_tokens = make(Counter, "prompt_tokens", "Prompt tokens received")
        self.generation_tokens = make(Counter, "generation_tokens", "Tokens generated")
        self.ttft = make(Histogram, "time_to_first_token_seconds", "Seconds from arrival to the first token",
                         buckets=LATENCY_BUCKETS)
        self.itl = make(Histogram, "inter_token_latency_seconds", "Seconds between a request's tokens",
                        buckets=LATENCY_BUCKETS)
        self.drafts = make(Counter, "spec_decode_num_drafts", "Speculative drafts verified (one per sequence and step)")
        self.draft_tokens = make(Counter, "spec_decode_num_draft_tokens", "Speculated tokens verified")
        self.accepted_tokens = make(Counter, "spec_decode_num_accepted_tokens", "Speculated tokens accepted")
        self.e2e = make(Histogram, "e2e_request_latency_seconds", "Seconds from arrival to the last token",
                        buckets=LATENCY_BUCKETS)
        self._success = make(Counter, "request_success", "Requests finished, by reason", ("finished_reason",),
                             labelled=False)
        self._model = model_name

    def request_received(self, prompt_tokens: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)
        self.prefix_queries.inc(prompt_tokens)

    def prefix_hits(self, tokens: int) -> None:
        self.prefix_hit_tokens.inc(tokens)

    def token(self, seconds: float, first: bool) -> None:
        self.generation_tokens.inc()
        (self.ttft if first else self.itl).observe(seconds)

    def request_finished(self, reason: str, seconds: float) -> None:
        self._success.labels(self._model, reason).inc()
        self.e2e.observe(seconds)

    def speculation(self, drafts: int, drafted: int, accepted: int) -> None:
        self.drafts.inc(drafts)
        self.draft_tokens.inc(drafted)
        self.accepted_tokens.inc(accepted)

    def step(self, running: int, waiting: int, kv_usage: float, preemptions: int) -> None:
        self.running.set(running)
        self.waiting.set(waiting)
        self.kv_usage.set(kv_usage)
        self.preemptions.inc(preemptions)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
