"""Prometheus metrics of one server replica (GET /metrics), in a registry of its own."""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,  # noqa: F401  (re-exported for the app)
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)


class ServerMetrics:
    def __init__(self, replica: str, backend: str):
        self.registry = CollectorRegistry()
        labels = {"replica": replica, "backend": backend}
        self.requests = Counter("reward_requests", "POST /score requests by HTTP status", ["status", *labels],
                                registry=self.registry)
        self.items = Counter("reward_items", "items scored", list(labels), registry=self.registry)
        self.failures = Counter("reward_failures", "failures by kind (client errors and internal ones)",
                                ["kind", *labels], registry=self.registry)
        self.batch_size = Histogram("reward_batch_size", "items per backend batch (@serve.batch)", list(labels),
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256), registry=self.registry)
        self.latency = Histogram("reward_request_latency_seconds", "POST /score latency", list(labels),
                                 buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
                                 registry=self.registry)
        self.batch_latency = Histogram("reward_batch_latency_seconds", "backend time per batch", list(labels),
                                       buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 10, 30),
                                       registry=self.registry)
        self.in_flight = Gauge("reward_items_in_flight", "items received and not yet answered (queue depth)",
                               list(labels), registry=self.registry)
        self.labels = labels

    def request(self, status: int, seconds: float) -> None:
        self.requests.labels(status=str(status), **self.labels).inc()
        self.latency.labels(**self.labels).observe(seconds)

    def failure(self, kind: str) -> None:
        self.failures.labels(kind=kind, **self.labels).inc()

    def batch(self, size: int, seconds: float) -> None:
        self.batch_size.labels(**self.labels).observe(size)
        self.batch_latency.labels(**self.labels).observe(seconds)
        self.items.labels(**self.labels).inc(size)

    def render(self) -> bytes:
        return generate_latest(self.registry)
