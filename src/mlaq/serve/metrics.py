"""Prometheus metrics with vLLM's names and its ``model_name`` label (prometheus_client, own registry).

Counters move when the engine thread delivers a step's outputs; the gauges are read from the engine
after every step. Speculative-decoding counters are the engine's own ``SpecDecodingStats``, added by
difference, so /metrics equals ``LLMEngine.spec_decoding_stats`` at every scrape.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from mlaq.engine.spec_metrics import SpecDecodingStats

# vLLM's buckets (seconds)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class ServerMetrics:
    """One registry per server (no global state: two servers in one process do not mix)."""

    def __init__(self, model_name: str, num_spec_tokens: int = 0) -> None:
        self.registry = CollectorRegistry()
        r, name = self.registry, ["model_name"]
        self.labels = {"model_name": model_name}
        self.running = Gauge("vllm:num_requests_running", "Requests in the running batch.", name, registry=r)
        self.waiting = Gauge(
            "vllm:num_requests_waiting", "Requests waiting to be scheduled.", name, registry=r
        )
        self.kv_usage = Gauge(
            "vllm:kv_cache_usage_perc", "KV cache usage; 1 means 100 percent.", name, registry=r
        )
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefill tokens processed.", name, registry=r)
        self.generation_tokens = Counter("vllm:generation_tokens", "Generation tokens.", name, registry=r)
        self.success = Counter(
            "vllm:request_success", "Finished requests.", [*name, "finished_reason"], registry=r
        )
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds", "Time to first token.", name, buckets=TTFT_BUCKETS, registry=r
        )
        self.itl = Histogram(
            "vllm:inter_token_latency_seconds", "Inter-token latency.", name, buckets=ITL_BUCKETS, registry=r
        )
        self.tpot = Histogram(
            "vllm:time_per_output_token_seconds", "Time per output token (mean per request).", name,
            buckets=ITL_BUCKETS, registry=r,
        )  # fmt: skip
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "End-to-end request latency.",
            name,
            buckets=E2E_BUCKETS,
            registry=r,
        )
        self.batch = Histogram(
            "mlaq:step_batch_size", "Sequences per engine step (continuous batching).", name,
            buckets=BATCH_BUCKETS, registry=r,
        )  # fmt: skip
        self.spec = num_spec_tokens > 0
        self._spec_seen = SpecDecodingStats.new(num_spec_tokens) if self.spec else None
        if self.spec:
            self.drafts = Counter("vllm:spec_decode_num_drafts", "Spec decoding drafts.", name, registry=r)
            self.draft_tokens = Counter(
                "vllm:spec_decode_num_draft_tokens", "Draft tokens.", name, registry=r
            )
            self.accepted = Counter(
                "vllm:spec_decode_num_accepted_tokens", "Accepted tokens.", name, registry=r
            )
            self.accepted_pos = Counter(
                "vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position.",
                [*name, "position"], registry=r,
            )  # fmt: skip
            for i in range(num_spec_tokens):  # every position shows from the start, at 0
                self.accepted_pos.labels(model_name, str(i))
        for metric in (self.prompt_tokens, self.generation_tokens, self.ttft, self.itl, self.e2e):
            metric.labels(model_name)
        for reason in ("stop", "length", "abort"):
            self.success.labels(model_name, reason)

    def observe_engine(
        self, running: int, waiting: int, kv_usage: float, spec: SpecDecodingStats | None
    ) -> None:
        m = self.labels["model_name"]
        self.running.labels(m).set(running)
        self.waiting.labels(m).set(waiting)
        self.kv_usage.labels(m).set(kv_usage)
        if spec is not None and self._spec_seen is not None:
            old = self._spec_seen
            self.drafts.labels(m).inc(spec.num_drafts - old.num_drafts)
            self.draft_tokens.labels(m).inc(spec.num_draft_tokens - old.num_draft_tokens)
            self.accepted.labels(m).inc(spec.num_accepted_tokens - old.num_accepted_tokens)
            before = old.num_accepted_tokens_per_pos
            for i, n in enumerate(spec.num_accepted_tokens_per_pos):
                delta = n - (before[i] if i < len(before) else 0)
                if delta:
                    self.accepted_pos.labels(m, str(i)).inc(delta)
            self._spec_seen = spec

    def render(self) -> bytes:
        return generate_latest(self.registry)
