"""`controlplane loadgen`: drive a daemon's OpenAI-compatible API at a Poisson arrival rate and
report throughput and latency. Torch-free on purpose: it must start instantly.

    controlplane loadgen --url http://127.0.0.1:8000 --rate 4 --requests 200 --stream
    controlplane loadgen --url URL --rate inf --duration 60 --concurrency-limit 8 --json out.json

Workload
--------
Every request is a ``POST /v1/completions`` sent with the official ``openai`` client
(``AsyncOpenAI(base_url=URL + "/v1", api_key=K or "none", max_retries=0)``). Request ``i`` gets a
prompt of ``A..B`` random token ids (``prompt: list[int]``, ids uniform in ``--token-id-range``,
default ``[100, 30000)``), ``max_tokens`` uniform in ``C..D`` and ``extra_body={"ignore_eos":
True}``, so its output length is exactly what was asked. The workload is drawn from a
``random.Random`` seeded with ``--seed``; the arrival times come from a second stream of the same
seed, so changing ``--rate`` does not change the prompts. ``--model`` defaults to the first id of
``GET /v1/models``.

Arrivals: the first request is sent at t=0, then the gaps are exponential with mean ``1/rate``
(a Poisson process). ``--rate inf`` (or ``0``) sends everything at once. ``--concurrency-limit M``
caps the requests in flight: an arrival waits for a free slot (its latency counts from when it is
actually sent). ``--requests N`` sends N requests; ``--duration S`` sends the arrivals that fall
in the first S seconds (with ``--rate inf`` it needs ``--concurrency-limit``, which makes it a
closed loop of M clients). Either way the run then waits for the requests in flight.

Client mix (for drills): ``--stream-fraction F`` streams a random share F of the requests
(overriding ``--stream``); ``--disconnect-fraction F`` makes a random share F of the clients hang
up after a delay uniform in ``[0, --disconnect-within]`` seconds (default 2): the request is
cancelled and its connection closed, as a client that goes away would. Both are drawn from a
stream of their own (``seed:clients``), so they never change the prompts.

Figures
-------
* requests ok / failed; failures by kind: the HTTP status (``"429"``) for an error response, the
  transport exception's class (``"ConnectError"``, ``"ReadTimeout"``) for a connection problem,
  else the exception's class. ``cancelled`` counts requests cut off by Ctrl-C, ``disconnected``
  the clients that hung up on purpose before their response ended (not failures).
* wall time: from the first send to the last completion.
* request throughput: ok requests / wall time; output throughput: completion tokens of the ok
  requests (from ``usage``) / wall time.
* ``short_outputs``: ok requests whose completion_tokens differ from their ``max_tokens``.
* latencies in ms, each as p50 / p90 / p99 / mean / count; percentiles use **linear
  interpolation** between the closest ranks (numpy's default method), see :func:`percentile`:

  - ``e2e``: from sending the request to the end of the response.
  - with ``--stream`` only (``null`` without it): ``ttft``, from sending to the first content
    chunk (a chunk with a choice that carries text or is not the finish-only chunk); ``itl``,
    every gap between consecutive content chunks of every request; ``tpot``, per request,
    ``(e2e - ttft) / (completion_tokens - 1)``, the mean time per output token after the first.

JSON (``--json PATH``, also :meth:`LoadSummary.to_dict`)
--------------------------------------------------------
``url``, ``model``, ``stream`` (bool), ``rate`` (req/s, or the string ``"inf"``),
``requests_sent``, ``requests_ok``, ``requests_failed``, ``requests_cancelled``,
``requests_disconnected``, ``errors``
({kind: count}), ``error_samples`` ({kind: first message}), ``wall_s``, ``request_throughput``
(req/s), ``output_throughput`` (tokens/s), ``total_prompt_tokens``, ``total_completion_tokens``,
``short_outputs``, ``missing_usage`` (ok requests that returned no usage; their token counts fall
back to the prompt length and the content chunks), ``interrupted`` (bool), and ``ttft_ms``,
``tpot_ms``, ``itl_ms``, ``e2e_ms``: each ``{"p50", "p90", "p99", "mean", "count"}`` or ``null``
when there is no sample.

Exit status: 0 when the run happened (even with failed requests; Ctrl-C stops sending, cancels
the requests in flight and still prints the partial summary), 1 when it could not start (no model
found), 2 for bad arguments, 130 when interrupted before the first request or by a second Ctrl-C.
"""

from __future__ import annotations

from controlplane.client.loadgen.cli import (
    add_loadgen_parser,
    config_from_args,
    parse_range,
    parse_rate,
)
from controlplane.client.loadgen.config import (
    Interrupted,
    LatencyStats,
    LoadConfig,
    LoadError,
    LoadSummary,
    RequestResult,
    RequestSpec,
)
from controlplane.client.loadgen.run import run_load
from controlplane.client.loadgen.workload import (
    arrival_offsets,
    error_kind,
    request_specs,
    summarize,
)
from controlplane.common import percentile

__all__ = [
    "Interrupted",
    "LatencyStats",
    "LoadConfig",
    "LoadError",
    "LoadSummary",
    "RequestResult",
    "RequestSpec",
    "add_loadgen_parser",
    "arrival_offsets",
    "config_from_args",
    "error_kind",
    "parse_range",
    "parse_rate",
    "percentile",
    "request_specs",
    "run_load",
    "summarize",
]
