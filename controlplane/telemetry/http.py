"""HTTP metrics: requests by route template, method and status, and their latency.

``<prefix>http_requests_total{route, method, status}`` (counter) and
``<prefix>http_request_duration_seconds{route, method}`` (histogram), observed by one ASGI
wrapper around the Litestar app's router (`HttpMetricsMiddleware`), so that the router's own
404 / 405 answers are counted too (Litestar's app-level middleware runs only for matched routes).

- ``route`` is the route's template as declared (``/v1/models/{model}``, the path parameter's
  type left out), never the raw path: its values are bounded by the routes the app has. A path
  that matches no route is ``UNMATCHED_ROUTE``.
- ``method``: the request's method, or ``other`` for a method outside the standard ones (a
  client cannot grow the exposition with made-up methods).
- ``status``: the status code sent (``"404"``); 500 when the app raised before sending one.
- The latency runs from the request's arrival to the end of its response body: a streamed
  (SSE) response is observed once, when its stream ends.

The series are not tied to one `Metrics` registry: the runtime keeps one `HttpMetrics` and
each registry it builds registers them (the daemon builds a new registry once the model has
loaded; requests served while it loaded stay counted).
"""

from __future__ import annotations

import re
import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

UNMATCHED_ROUTE = "none"  # the route label of requests no route matched (as the instrumentator)
METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
# prometheus_client's default buckets, extended for LLM requests that stream for minutes.
HTTP_LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 30.0,
    60.0, 120.0, 300.0, 600.0,
)  # fmt: skip
_PARAM_TYPE = re.compile(r"\{([^}:]+):[^}]*\}")  # "{model:str}" -> "{model}"


class HttpMetrics:
    """The HTTP series under one prefix (``controlplane:`` or ``vllm:``)."""

    def __init__(self, prefix: str) -> None:
        self.requests = Counter(
            prefix + "http_requests",
            "HTTP requests, by route template, method and status code.",
            ["route", "method", "status"],
            registry=None,
        )
        self.duration = Histogram(
            prefix + "http_request_duration_seconds",
            "HTTP request latency, arrival to the end of the response body (a stream counts "
            "once, when it ends), by route template and method.",
            ["route", "method"],
            registry=None,
            buckets=HTTP_LATENCY_BUCKETS,
        )
        self._routes: dict[str, str] = {}  # path template -> route label (cached)

    def register(self, registry: CollectorRegistry) -> None:
        registry.register(self.requests)
        registry.register(self.duration)

    def route_label(self, template: str | None) -> str:
        if not template:
            return UNMATCHED_ROUTE
        label = self._routes.get(template)
        if label is None:
            label = self._routes[template] = _PARAM_TYPE.sub(r"{\1}", template)
        return label

    def observe(self, template: str | None, method: str, status: int, seconds: float) -> None:
        route = self.route_label(template)
        method = method if method in METHODS else "other"
        self.requests.labels(route, method, str(status)).inc()
        self.duration.labels(route, method).observe(seconds)


class HttpMetricsMiddleware:
    """ASGI wrapper of the app's router: one observation per HTTP request when it ends.

    Cheap by design: one dict lookup per message sent (to catch the status), one counter and
    one histogram update per request; the response's messages pass through unchanged.
    """

    def __init__(self, app: Any, metrics: HttpMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500  # the app raised before it sent a response start

        async def send_status(message: Any) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            # The router stores the matched route's template in the scope it was given.
            self.metrics.observe(
                scope.get("path_template"),
                scope.get("method", ""),
                status,
                time.perf_counter() - start,
            )
