"""Server counters, rendered in Prometheus' text exposition format (no client library needed
for a handful of counters; one instance per app, no global registry)."""

from __future__ import annotations

import threading
import time
from collections import Counter

ACCEPT_BUCKETS = (1, 2, 3, 4, 5, 6, 8, 12, 16)
PREFIX_METRICS = (  # (prefix-cache stat, Prometheus kind, help)
    ("hits", "counter", "Requests that reused a cached prompt prefix."),
    ("whole_hits", "counter", "Hits that held the whole prompt: no prefill, first token kept."),
    ("misses", "counter", "Requests that found no cached prefix."),
    ("hit_tokens", "counter", "Prompt tokens reused from the prefix cache (not prefilled)."),
    ("evictions", "counter", "Prefix-cache entries evicted to fit the memory budget."),
    ("bytes", "gauge", "Bytes held by the prefix cache in memory."),
    ("entries", "gauge", "Sequences held by the prefix cache in memory."),
    ("disk_hits", "counter", "Prefix-cache entries loaded from the disk tier."),
    ("disk_writes", "counter", "Prefix-cache entries written to the disk tier."),
    ("disk_refused", "counter", "Disk-tier files refused (damaged or made for another model)."),
    ("checkpoints_dropped", "counter", "Snapshots let go to keep one sequence in budget."),
)


class Metrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.requests: Counter = Counter()  # (route, status) -> n
        self.errors: Counter = Counter()  # kind -> n
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.cancelled = 0
        self.accept_counts: Counter = Counter()  # tokens per target forward -> rounds
        self.decode_tps = 0.0
        self.queue_depth = lambda: 0
        self.in_flight = 0
        self.batch_rows: Counter = Counter()  # rows in a batched round -> rounds
        self.batch_cut = 0  # drafts the batch scheduler left unverified
        self.memory_sheds = 0  # times memory pressure emptied the prefix cache (engine)
        self.last_memory_shed: float | None = None  # when it last did (Unix time)
        self.prefix_cache = lambda: None  # the prefix cache's counters (engine), or None

    def request(self, route: str, status: int) -> None:
        with self._lock:
            self.requests[(route, status)] += 1

    def error(self, kind: str) -> None:
        with self._lock:
            self.errors[kind] += 1

    def generation(self, prompt: int, completion: int, accepts: list[int], tps: float) -> None:
        with self._lock:
            self.prompt_tokens += prompt
            self.completion_tokens += completion
            self.accept_counts.update(accepts)
            if tps:
                self.decode_tps = tps

    def batch_round(self, rows: int) -> None:
        with self._lock:
            self.batch_rows[rows] += 1

    def drafts_cut(self, n: int) -> None:
        if n:
            with self._lock:
                self.batch_cut += n

    def memory_shed(self) -> None:
        with self._lock:
            self.memory_sheds += 1
            self.last_memory_shed = time.time()

    def as_dict(self, labels: dict[str, str]) -> dict:
        """The same counters as `render`, as one JSON object (`GET /metrics?format=json`), for
        scripts that would rather not parse Prometheus' text."""
        with self._lock:
            rounds = sum(self.batch_rows.values())
            committed = sum(k * n for k, n in self.accept_counts.items())
            forwards = sum(self.accept_counts.values())
            return {
                **labels,
                "requests": [
                    {"route": r, "status": s, "count": n}
                    for (r, s), n in sorted(self.requests.items())
                ],
                "errors": dict(sorted(self.errors.items())),
                "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens,
                "cancelled": self.cancelled,
                "decode_tokens_per_second": self.decode_tps,
                "queue_depth": self.queue_depth(),
                "in_flight": self.in_flight,
                # tokens committed per target forward -> rounds, and their mean
                "accept_lengths": {str(k): n for k, n in sorted(self.accept_counts.items())},
                "mean_accept_length": round(committed / forwards, 4) if forwards else None,
                "batch": {
                    "rounds": rounds,
                    "drafts_cut": self.batch_cut,
                    "rows_mean": sum(k * n for k, n in self.batch_rows.items()) / rounds
                    if rounds
                    else 0,
                    "rows_max": max(self.batch_rows, default=0),
                },
                "memory_sheds": self.memory_sheds,
                "prefix_cache": self.prefix_cache(),
            }

    def render(self, labels: dict[str, str]) -> str:
        base = ",".join(f'{k}="{_esc(v)}"' for k, v in labels.items())
        lines: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
            lines.append(f"# HELP {name} {help_}")
            lines.append(f"# TYPE {name} {kind}")
            for extra, value in samples:
                lab = ",".join(x for x in (base, extra) if x)
                lines.append(f"{name}{{{lab}}} {value:g}" if lab else f"{name} {value:g}")

        with self._lock:
            metric(
                "outrider_requests_total",
                "counter",
                "HTTP requests by route and status.",
                [(f'route="{r}",status="{s}"', n) for (r, s), n in sorted(self.requests.items())]
                or [("", 0)],
            )
            metric(
                "outrider_errors_total",
                "counter",
                "Failed requests by kind.",
                [(f'kind="{k}"', n) for k, n in sorted(self.errors.items())] or [("", 0)],
            )
            metric(
                "outrider_prompt_tokens_total",
                "counter",
                "Prompt tokens processed.",
                [("", self.prompt_tokens)],
            )
            metric(
                "outrider_completion_tokens_total",
                "counter",
                "Tokens generated.",
                [("", self.completion_tokens)],
            )
            metric(
                "outrider_cancelled_total",
                "counter",
                "Generations stopped early because the client went away.",
                [("", self.cancelled)],
            )
            metric(
                "outrider_decode_tokens_per_second",
                "gauge",
                "Decode speed of the last finished generation.",
                [("", self.decode_tps)],
            )
            metric(
                "outrider_queue_depth",
                "gauge",
                "Requests waiting for the engine.",
                [("", self.queue_depth())],
            )
            metric(
                "outrider_in_flight",
                "gauge",
                "Generations running or queued.",
                [("", self.in_flight)],
            )
            rounds = sum(self.batch_rows.values())
            metric(
                "outrider_batch_rounds_total",
                "counter",
                "Batched decode rounds (continuous batching, --max-batch).",
                [("", rounds)],
            )
            metric(
                "outrider_batch_drafts_cut_total",
                "counter",
                "Drafts the batch scheduler left unverified (DSpark's prefix scheduler).",
                [("", self.batch_cut)],
            )
            metric(
                "outrider_batch_rows_mean",
                "gauge",
                "Requests per batched round, on average.",
                [("", sum(k * n for k, n in self.batch_rows.items()) / rounds if rounds else 0)],
            )
            metric(
                "outrider_batch_rows_max",
                "gauge",
                "The most requests one batched round has decoded together.",
                [("", max(self.batch_rows, default=0))],
            )
            metric(
                "outrider_memory_sheds_total",
                "counter",
                "Times memory ran short and the engine emptied the prefix cache's memory tier.",
                [("", self.memory_sheds)],
            )
            cached = self.prefix_cache()
            if cached is not None:
                for key, kind, help_ in PREFIX_METRICS:
                    name = f"outrider_prefix_cache_{key}" + ("_total" if kind == "counter" else "")
                    metric(name, kind, help_, [("", cached.get(key, 0))])
            total = sum(self.accept_counts.values())
            tokens = sum(k * n for k, n in self.accept_counts.items())
            name = "outrider_accept_length"
            lines.append(f"# HELP {name} Tokens committed per target forward (speculative rounds).")
            lines.append(f"# TYPE {name} histogram")
            prefix = f"{base}," if base else ""
            for b in ACCEPT_BUCKETS:
                n = sum(v for k, v in self.accept_counts.items() if k <= b)
                lines.append(f'{name}_bucket{{{prefix}le="{b}"}} {n}')
            lines.append(f'{name}_bucket{{{prefix}le="+Inf"}} {total}')
            lines.append(f"{name}_sum{{{base}}} {tokens}" if base else f"{name}_sum {tokens}")
            lines.append(f"{name}_count{{{base}}} {total}" if base else f"{name}_count {total}")
        return "\n".join(lines) + "\n"


def _esc(value: str) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
