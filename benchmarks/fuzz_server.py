"""Mutation fuzzing of a live server: malformed requests across every route, none answered 5xx.

Starts the server in-process on 127.0.0.1 (a free port) over a tiny scripted model, sends
`--requests` requests from `outrider.testing.fuzz` (mutated JSON, wrong types, extreme numbers,
lone surrogates and invalid UTF-8, oversized fields, truncated bodies, wrong Content-Types and
methods, unknown routes, request-supplied chat templates), and prints requests per route, the
status codes, and every failure: a status >= 500, an error event inside a 200 stream, no answer
within `--timeout` seconds (a hang), or a dropped connection. After a POST to /admin that
succeeded the served model is reloaded, so a mutated load never leaves later requests a 503. The
server must still answer a plain chat request with 200 at the end. Exit code 1 on any failure.

    python benchmarks/fuzz_server.py                          # 2000 requests, seed 0
    python benchmarks/fuzz_server.py --requests 300 --seed 3
    python benchmarks/fuzz_server.py --seed 0 --only 17 412   # those requests of that run again
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import os
import re
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a mutated /admin/load must never download
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import requests  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from outrider.testing.fuzz import MAX_BYTES, FuzzRequest, FuzzTarget, fuzz_request  # noqa: E402

API_KEY = "fuzz-key"
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@dataclass
class Outcome:
    """What one request got: a status (None if no answer) and a failure, if it is one."""

    request: FuzzRequest
    status: int | None
    failure: str | None
    seconds: float
    response: bytes = b""


@dataclass
class Report:
    outcomes: list[Outcome] = field(default_factory=list)
    reloads: int = 0
    still_serves: bool = False
    server_5xx: int | None = None  # the server's own count, from /metrics

    @property
    def failures(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.failure]

    @property
    def ok(self) -> bool:
        return self.still_serves and not self.failures


def fuzz_limits() -> Any:
    """Small generation caps (the point is status codes, not load); where this version of the
    server has them, a 1.5 MiB body limit (so the largest fuzz bodies meet the 413 path) and
    request-supplied chat templates allowed (so they reach the sandbox instead of a refusal)."""
    from outrider.server.generation import Limits

    known = {f.name for f in dataclasses.fields(Limits)}
    extra = {"max_body_bytes": 3 << 19, "trust_request_chat_template": True}
    extra = {k: v for k, v in extra.items() if k in known}
    return Limits(default_max_tokens=16, max_tokens_cap=256, keepalive_s=5, **extra)


@contextlib.contextmanager
def serve(api_key: str | None = API_KEY) -> Iterator[tuple[str, FuzzTarget]]:
    """A server on 127.0.0.1 over a scripted model; yields (base URL, what the seeds name)."""
    import uvicorn

    from outrider.server.app import create_app
    from outrider.server.engine import Engine, LoadSpec
    from outrider.testing import make_scripted_target

    with tempfile.TemporaryDirectory() as tmp:
        path = make_scripted_target(Path(tmp) / "scripted")
        engine = Engine().start()
        engine.load(LoadSpec(str(path), mode="lookup"))
        end = time.time() + 120
        while engine.state == "loading" and time.time() < end:
            time.sleep(0.05)
        assert engine.state == "ready", engine.error
        app = create_app(engine, fuzz_limits(), api_key)
        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="error", lifespan="off")
        server = uvicorn.Server(config)
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        end = time.time() + 30
        while not server.started and time.time() < end:
            time.sleep(0.02)
        assert server.started, "the server did not start"
        port = server.servers[0].sockets[0].getsockname()[1]
        try:
            yield f"http://127.0.0.1:{port}", FuzzTarget("scripted", str(path), api_key)
        finally:
            server.should_exit = True
            thread.join(timeout=10)
            engine.stop()


def _stream_error(r: requests.Response, body: bytes) -> bool:
    """A 200 stream that carries an error event (how a generation failure shows mid-stream)."""
    if "text/event-stream" not in r.headers.get("content-type", ""):
        return False
    return b"\nevent: error" in b"\n" + body or b'data: {"error"' in body


def send(session: requests.Session, url: str, req: FuzzRequest, timeout: float) -> Outcome:
    """Send one request and read its whole answer within `timeout` seconds."""
    data: bytes | Iterable[bytes] | None = req.body
    if req.chunked and req.body is not None:
        data = iter([req.body[i : i + 65536] for i in range(0, len(req.body), 65536)] or [b""])
    t0 = time.monotonic()
    try:
        with session.request(
            req.method,
            url + req.path,
            data=data,
            headers=req.headers,
            timeout=(5, timeout),
            stream=True,
            allow_redirects=False,
        ) as r:
            parts, size = [], 0
            for part in r.iter_content(65536):
                size += len(part)
                if size < 1 << 20:
                    parts.append(part)
                if time.monotonic() - t0 > timeout:
                    return Outcome(req, r.status_code, "timeout", time.monotonic() - t0)
            body = b"".join(parts)
            failure = None
            if r.status_code >= 500:
                failure = f"HTTP {r.status_code}"
            elif _stream_error(r, body):
                failure = "error event in a 200 stream"
            return Outcome(req, r.status_code, failure, time.monotonic() - t0, body)
    except requests.Timeout:
        return Outcome(req, None, "timeout", time.monotonic() - t0)
    except requests.RequestException as e:
        return Outcome(req, None, f"no answer: {type(e).__name__}", time.monotonic() - t0)


def _headers(target: FuzzTarget) -> dict[str, str]:
    return {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}


def health(url: str, target: FuzzTarget) -> str:
    try:
        return requests.get(url + "/health", headers=_headers(target), timeout=10).json()["status"]
    except (requests.RequestException, ValueError, KeyError):
        return "down"


def reload(url: str, target: FuzzTarget, timeout: float = 60) -> bool:
    """Load the scripted model again (the window reset to the model's own); True once ready."""
    body = {"model": target.path, "mode": "lookup", "context_window": 0}
    try:
        r = requests.post(url + "/admin/load", json=body, headers=_headers(target), timeout=10)
    except requests.RequestException:
        return False
    end = time.time() + timeout
    while r.status_code == 202 and time.time() < end:
        status = health(url, target)
        if status == "ok":
            return True
        if status in ("error", "no_model", "down"):
            return False
        time.sleep(0.02)
    return False


def still_serves(url: str, target: FuzzTarget) -> bool:
    try:
        r = requests.post(
            url + "/v1/chat/completions", json=CHAT, headers=_headers(target), timeout=30
        )
    except requests.RequestException:
        return False
    return r.status_code == 200 and r.json()["choices"][0]["message"] is not None


def run_fuzz(
    url: str,
    target: FuzzTarget,
    n: int,
    seed: int,
    timeout: float = 60,
    max_bytes: int = MAX_BYTES,
    indexes: Iterable[int] | None = None,
    progress: Callable[[int, Outcome], None] | None = None,
) -> Report:
    """Send requests `indexes` (default 0..n-1) of run `seed`, keeping the model loaded."""
    report = Report()
    session = requests.Session()
    for count, i in enumerate(indexes if indexes is not None else range(n)):
        req = fuzz_request(seed, i, target, max_bytes)
        out = send(session, url, req, timeout)
        report.outcomes.append(out)
        changed = req.method == "POST" and req.path.startswith("/admin")
        if changed and out.status is not None and out.status < 400:
            report.reloads += 1
            if not reload(url, target):
                out.failure = out.failure or "the model could not be loaded again"
                break
        elif (out.failure or count % 50 == 49) and health(url, target) != "ok":
            out.failure = out.failure or "the model was lost"
            report.reloads += 1
            if not reload(url, target):
                break
        if progress:
            progress(count, out)
    session.close()
    report.still_serves = health(url, target) == "ok" and still_serves(url, target)
    try:
        text = requests.get(url + "/metrics", headers=_headers(target), timeout=10).text
        found = re.findall(r'outrider_requests_total\{[^}]*status="(5\d\d)"[^}]*\} (\d+)', text)
        report.server_5xx = sum(int(v) for _, v in found)
    except requests.RequestException:
        pass
    return report


def _excerpt(data: bytes | None, n: int = 160) -> str:
    if data is None:
        return "(no body)"
    text = repr(data[:n])
    return text + (f" …(+{len(data) - n} bytes)" if len(data) > n else "")


def signature(o: Outcome) -> str:
    """A failure's kind, for grouping: route, failure and the response's message, numbers out."""
    msg = o.response.decode("utf-8", "replace")
    m = re.search(r'"message":\s*"((?:[^"\\]|\\.)*)"', msg)
    msg = re.sub(r"\d+", "N", (m.group(1) if m else msg)[:70])
    return f"{o.request.route} | {o.failure} | {msg}"


def print_report(report: Report, seed: int, elapsed: float) -> None:
    outs = report.outcomes
    print(f"\n{len(outs)} requests, seed {seed}, {elapsed:.1f} s, {report.reloads} reloads")
    by_route: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for o in outs:
        by_route[o.request.route][f"{o.status // 100}xx" if o.status else "none"] += 1
        by_route[o.request.route]["fail"] += bool(o.failure)
    cols = ["2xx", "3xx", "4xx", "5xx", "none", "fail"]
    print(f"\n{'route':34}{'n':>6}" + "".join(f"{c:>6}" for c in cols))
    for route, c in sorted(by_route.items(), key=lambda kv: -sum(kv[1][k] for k in cols[:5])):
        total = sum(c[k] for k in cols[:5])
        print(f"{route:34}{total:>6}" + "".join(f"{c[k]:>6}" for k in cols))
    codes = collections.Counter(o.status for o in outs)
    print(
        "\nstatus codes: "
        + ", ".join(
            f"{k or 'none'}: {v}" for k, v in sorted(codes.items(), key=lambda kv: kv[0] or 0)
        )
    )
    print(f"5xx counted by the server's /metrics: {report.server_5xx}")
    fails = report.failures
    print(f"\nfailures: {len(fails)}")
    for o in fails:
        r = o.request
        print(
            f"\n#{r.index} {r.route}: {o.failure} ({o.seconds:.1f} s) -> {r.method} {r.path[:80]}"
        )
        print(f"  mutations: {'; '.join(r.mutations)}")
        print(f"  headers:   {r.headers}")
        print(f"  body:      {_excerpt(r.body)}")
        print(f"  response:  {_excerpt(o.response, 300)}")
    if fails:
        print("\ndistinct failures:")
        groups = collections.defaultdict(list)
        for o in fails:
            groups[signature(o)].append(o.request.index)
        for sig, idx in sorted(groups.items(), key=lambda kv: -len(kv[1])):
            print(f"  {len(idx):4} x {sig}  (e.g. #{', #'.join(map(str, idx[:4]))})")
    print(f"\nstill serves a plain chat request: {report.still_serves}")
    print("RESULT:", "PASS" if report.ok else "FAIL")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=60, help="seconds per request (a hang)")
    p.add_argument("--max-bytes", type=int, default=MAX_BYTES, help="largest request body")
    p.add_argument("--only", type=int, nargs="*", help="send only these request indexes")
    args = p.parse_args()
    with serve() as (url, target):
        print(f"server {url}, model {target.path}")
        t0 = time.time()

        def progress(count: int, o: Outcome) -> None:
            if o.failure:
                print(f"  #{o.request.index} {o.request.route}: {o.failure}", flush=True)
            if count % 200 == 199:
                print(f"  {count + 1} requests, {time.time() - t0:.0f} s", flush=True)

        report = run_fuzz(
            url, target, args.requests, args.seed, args.timeout, args.max_bytes, args.only, progress
        )
        print_report(report, args.seed, time.time() - t0)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
