"""A seeded mutation fuzz run against a live server: malformed requests across every route
(outrider.testing.fuzz, sent by benchmarks/fuzz_server.py's runner) get no 5xx, no hang and no
error event inside a 200 stream, and the server still serves a plain chat request afterwards.
The generator itself is checked to be deterministic and to cover what the run claims to."""

from __future__ import annotations

import collections
import sys
from pathlib import Path

import pytest
from live_server import live_server

from outrider.server.engine import LoadSpec
from outrider.testing import make_scripted_target
from outrider.testing.fuzz import ROUTES, FuzzTarget, fuzz_request, fuzz_requests

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from fuzz_server import fuzz_limits, run_fuzz  # noqa: E402

KEY = "fuzz-key"
TARGET = FuzzTarget("scripted-fuzz", "/models/scripted-fuzz", KEY)


def test_requests_are_deterministic_per_seed_and_index():
    a = list(fuzz_requests(50, 7, TARGET))
    assert a == list(fuzz_requests(50, 7, TARGET))
    assert fuzz_request(7, 31, TARGET) == a[31]  # one request can be rebuilt alone
    assert [r.body for r in a] != [r.body for r in fuzz_requests(50, 8, TARGET)]


def test_a_run_covers_every_route_and_kind_of_malformation():
    reqs = list(fuzz_requests(2000, 0, TARGET, max_bytes=1 << 20))
    routes = collections.Counter(r.route for r in reqs)
    assert {r.label for r in ROUTES} | {"(unknown route)", "(wrong method)"} <= set(routes)
    assert all(len(r.body or b"") <= 1 << 20 for r in reqs)
    bodies = [r.body or b"" for r in reqs]
    assert any(b"\\ud800" in b for b in bodies)  # a lone surrogate as a JSON escape
    assert any(b"\xed\xa0\x80" in b or b"\xc0\xaf" in b for b in bodies)  # invalid UTF-8
    assert any(b"NaN" in b for b in bodies) and any(b"1e309" in b for b in bodies)
    assert any(b"18446744073709551616" in b for b in bodies)  # 2**64
    assert any(len(b) > 500_000 for b in bodies)
    kinds = collections.Counter(m.split(" ")[0] for r in reqs for m in r.mutations)
    for kind in ("drop", "duplicate", "rename", "swap", "number", "unicode", "oversize"):
        assert kinds[kind] > 10, kind
    for kind in ("truncate", "garble", "content-type", "chat_template", "body", "auth"):
        assert kinds[kind] > 10, kind


@pytest.mark.slow  # a fuzzing run: the full suite's
def test_fuzz_run_finds_no_server_errors(models_dir):
    path = make_scripted_target(models_dir / "scripted-fuzz")
    target = FuzzTarget("scripted-fuzz", str(path), KEY)
    spec = LoadSpec(str(path), mode="lookup")
    with live_server(spec, fuzz_limits(), api_key=KEY) as (url, _):
        report = run_fuzz(url, target, 300, seed=0, timeout=30, max_bytes=300_000)
    statuses = collections.Counter(o.status for o in report.outcomes)
    assert len(report.outcomes) == 300 and statuses[400] > 50 and statuses[200] > 50
    found = [
        f"#{o.request.index} {o.request.route}: {o.failure} {o.request.mutations} "
        f"{(o.request.body or b'')[:200]!r} -> {o.response[:200]!r}"
        for o in report.failures
    ]
    assert not found, "\n".join(found)
    assert report.still_serves
