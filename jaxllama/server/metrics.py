"""The server's Prometheus metrics (served at GET /metrics): requests, tokens, and latency histograms.

Each server has its own registry, so several apps in one process (tests) keep separate counts.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# Seconds: from a few milliseconds (an accelerator's decode step) to minutes (a long prompt on a busy CPU).
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)


class Metrics:
    """Counters and histograms; the engine thread and the HTTP handlers update them."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "jaxllama_requests",
            "HTTP requests answered, by endpoint and status code",
            ["endpoint", "status"],
            registry=r,
        )
        self.finished = Counter(
            "jaxllama_requests_finished", "Generations ended, by finish reason", ["finish_reason"], registry=r
        )
        self.prompt_tokens = Counter("jaxllama_prompt_tokens", "Prompt tokens of accepted requests", registry=r)
        self.completion_tokens = Counter("jaxllama_completion_tokens", "Tokens generated", registry=r)
        self.ttft = Histogram(
            "jaxllama_time_to_first_token_seconds",
            "From a request's arrival to its first generated token",
            buckets=TTFT_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "jaxllama_inter_token_latency_seconds",
            "Time between consecutive generated tokens of a request",
            buckets=ITL_BUCKETS,
            registry=r,
        )
        self.running = Gauge("jaxllama_requests_running", "Requests holding a decode slot", registry=r)
        self.waiting = Gauge("jaxllama_requests_waiting", "Requests waiting for a decode slot", registry=r)

    def watch_load(self, running: Callable[[], float], waiting: Callable[[], float]) -> None:
        """Read the two gauges from these functions at each scrape."""
        self.running.set_function(running)
        self.waiting.set_function(waiting)

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition, and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
