"""``GET /metrics``: the server's counters in Prometheus' text format, kept with
``prometheus_client`` in a registry of the app's own.

- ``attnkit_requests_total{route, status}``: requests answered, by route and HTTP status (the
  body limit's 413 and the key's 401 included); ``attnkit_rejected_requests_total{status}``:
  those turned away, 429 (queue full), 413 (body too large) and 504 (past the timeout, a
  stream's included).
- ``attnkit_prompt_tokens_total`` and ``attnkit_generation_tokens_total``: tokens read and
  written, counted when a request finishes.
- ``attnkit_time_to_first_token_seconds`` and ``attnkit_time_per_output_token_seconds``:
  histograms, from a request's submission to its first token and between its later tokens.
- ``attnkit_queue_length``, ``attnkit_running_batch_size``: the engine's waiting requests and
  rows now; ``attnkit_prompt_cache_hits_total``: prompts that reused a recent one's cache.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

__all__ = ["CONTENT_TYPE", "Counted", "Metrics"]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
REJECTED = {429, 413, 504}
_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class _EngineState:
    """A collector that reads the engine's stats when scraped."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def collect(self):
        stats = self.engine.stats()
        yield GaugeMetricFamily("attnkit_queue_length", "requests waiting", stats["waiting"])
        yield GaugeMetricFamily(
            "attnkit_running_batch_size", "rows being decoded", stats["running"]
        )
        yield CounterMetricFamily(
            "attnkit_prompt_cache_hits",
            "prompts that reused a recent prompt's cache",
            stats.get("prompt_cache_hits", 0),
        )


class Metrics:
    """The app's counters: :class:`Counted` counts its requests, :meth:`see` a request's
    events."""

    def __init__(self, engine) -> None:
        self.registry = registry = CollectorRegistry()
        self.requests = Counter(
            "attnkit_requests", "requests by route and status", ["route", "status"],
            registry=registry,
        )  # fmt: skip
        self.rejected = Counter(
            "attnkit_rejected_requests", "requests turned away (429, 413, 504)", ["status"],
            registry=registry,
        )  # fmt: skip
        self.prompt_tokens = Counter(
            "attnkit_prompt_tokens", "prompt tokens of finished requests", registry=registry
        )
        self.generated_tokens = Counter(
            "attnkit_generation_tokens", "tokens generated", registry=registry
        )
        self.first_token = Histogram(
            "attnkit_time_to_first_token_seconds", "from submission to the first token",
            buckets=_SECONDS, registry=registry,
        )  # fmt: skip
        self.per_token = Histogram(
            "attnkit_time_per_output_token_seconds", "between a request's later tokens",
            buckets=_SECONDS, registry=registry,
        )  # fmt: skip
        registry.register(_EngineState(engine))

    def text(self) -> bytes:
        return generate_latest(self.registry)

    def clock(self, count: int) -> list[tuple[float, bool]]:
        """For :meth:`see`: each of ``count`` requests' last moment (now: its submission), and
        whether its first token has come."""
        return [(time.monotonic(), False)] * count

    def see(self, clock: list, index: int, event: dict) -> None:
        """Count one engine event of request ``index``."""
        if event["type"] == "token" and event.get("id") is not None:
            now, (last, started) = time.monotonic(), clock[index]
            (self.per_token if started else self.first_token).observe(now - last)
            clock[index] = (now, True)
        elif event["type"] == "done":
            self.prompt_tokens.inc(event["prompt_tokens"])
            self.generated_tokens.inc(event["completion_tokens"])


class Counted:
    """ASGI middleware: every HTTP answer counted by route (one of ``routes``, or "other") and
    status."""

    def __init__(self, app, metrics: Metrics, routes: set[str]) -> None:
        self.app, self.metrics, self.routes = app, metrics, routes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def watch(message):
            if message["type"] == "http.response.start":
                path = getattr(scope.get("route"), "path", scope["path"])
                status = message["status"]
                route = path if path in self.routes else "other"
                self.metrics.requests.labels(route, str(status)).inc()
                if status in REJECTED:
                    self.metrics.rejected.labels(str(status)).inc()
            await send(message)

        return await self.app(scope, receive, watch)
