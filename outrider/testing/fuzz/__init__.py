"""Malformed HTTP requests for the server, generated deterministically from a seed.

Every request starts from a body that is valid for its route and takes up to three mutations:
fields dropped, duplicated, renamed or retyped, extreme numbers, unicode edge cases (lone
surrogates as JSON escapes, NUL, bidi marks, invalid UTF-8 bytes), oversized fields, truncated or
garbled JSON, a wrong Content-Type, request-supplied chat templates, wrong methods and unknown
routes. Request `index` of `seed` depends on nothing else, so a failing request can be rebuilt
alone. Requests stay cheap on two CPU cores: `max_tokens` stays small, bodies stay under
`max_bytes`, and chat templates run in linear time: the point is status codes, not load.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Iterator

from .json_text import MAX_BYTES, Pairs, Raw, dumps, encode
from .mutators import _Draft, _mutate_body, _mutate_bodyless
from .requests import FuzzRequest, FuzzTarget
from .seeds import METHODS, ROUTES, UNKNOWN_PATHS, UNKNOWN_WEIGHT, WRONG_METHOD_WEIGHT, Route

__all__ = [
    "MAX_BYTES",
    "ROUTES",
    "FuzzRequest",
    "FuzzTarget",
    "Pairs",
    "Raw",
    "Route",
    "dumps",
    "encode",
    "fuzz_request",
    "fuzz_requests",
]


def fuzz_request(
    seed: int, index: int, target: FuzzTarget, max_bytes: int = MAX_BYTES
) -> FuzzRequest:
    """Request `index` of the run seeded `seed` (independent of every other index)."""
    rng = random.Random(f"outrider-fuzz:{seed}:{index}")
    weights = [r.weight for r in ROUTES] + [UNKNOWN_WEIGHT, WRONG_METHOD_WEIGHT]
    pick = rng.choices(range(len(ROUTES) + 2), weights)[0]
    if pick < len(ROUTES):
        route, label = ROUTES[pick], ROUTES[pick].label
    else:
        route = rng.choice(ROUTES)
        label = "(unknown route)" if pick == len(ROUTES) else "(wrong method)"
    value = copy.deepcopy(rng.choice(route.seeds(target)))
    d = _Draft(route, value, target, max_bytes)
    if label == "(unknown route)":
        d.method, d.path = rng.choice(METHODS), rng.choice(UNKNOWN_PATHS)
        done = [f"{d.method} {d.path[:40]}"]
    elif label == "(wrong method)":
        d.method = rng.choice([m for m in METHODS if m != route.method])
        done = [f"{d.method} {d.path}"]
        if d.method == "OPTIONS" and rng.random() < 0.5:  # a CORS preflight
            d.headers.update(Origin="http://127.0.0.1", **{"Access-Control-Request-Method": "POST"})
    else:
        done = []
    if value is not None:
        done += _mutate_body(rng, d)
    else:
        done += _mutate_bodyless(rng, d)
    body = d.body()
    if body is not None and len(body) > max_bytes:
        body = body[:max_bytes]
        done.append(f"capped at {max_bytes} bytes")
    return FuzzRequest(label, d.method, d.path, body, d.headers, done, d.chunked, index)


def fuzz_requests(
    n: int, seed: int, target: FuzzTarget, max_bytes: int = MAX_BYTES
) -> Iterator[FuzzRequest]:
    """The run's requests, in order."""
    for i in range(n):
        yield fuzz_request(seed, i, target, max_bytes)
