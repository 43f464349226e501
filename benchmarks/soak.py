"""The soak: hundreds of mixed requests through a live server with continuous batching and the
prefix cache on; every response must equal the same request served alone, and the process's
resident memory must stop growing once warm.

    python benchmarks/soak.py                                   # 500 requests, the demo pair
    python benchmarks/soak.py --requests 200 --concurrency 16 --json soak.json

Requests are multi-turn chats over a few shared system prompts (so the prefix cache hits at
turn boundaries, on exact repeats, and diverges mid-prompt), with answer lengths from 4 to
`--max-tokens`, sent by `--concurrency` clients through the real `openai` SDK. The reference
for each distinct request is a fresh single-request run of the same pipeline (no batch, no
cache). The warm-up sends every distinct request once (so the prefix cache holds what the run
will reuse) and then the first quarter of the run (so MLX's buffer cache has seen every batch
width); RSS is read from /proc after each quarter, and growth is the last reading against the
first. All readings are reported. Exit status 1 on any cross-talk or an RSS growth of
`--max-growth` or more.

Each reading is taken twice: as it stands (`rss_mb_samples`), then after glibc's `malloc_trim`
has handed the heap's free memory back to the OS (`rss_held_mb_samples`, what the process
still holds). glibc keeps what a server frees in its arenas, so the first reading moves by
tens of MB with where it falls between the server's own trims (server/memory.py `HeapTrim`);
the growth checked is the held memory's where the C library trims, the first reading's
elsewhere (`rss_raw_growth` is reported either way).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import random
import sys
import threading
import time
from pathlib import Path

import outrider  # noqa: E402, F401 - first: it picks MLX's CPU BLAS (core/blas.py)

# isort: split
import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

SYSTEMS = [
    "You are a terse assistant. Answer in one sentence. " * 6,
    "You are a patient tutor who explains every step of a calculation. " * 5,
    "You write Python. Reply with code only, no prose. " * 7,
]
ASKS = [
    "Count from one to ten.",
    "Name three colours of the rainbow.",
    "What is 17 times 3?",
    "Write a function that reverses a list.",
    "Say hello in French.",
    "List the days of the week.",
    "What comes after Tuesday?",
    "Spell the word banana backwards.",
]


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def scrape(url: str) -> dict[str, float]:
    """Samples of a Prometheus text page by metric name (labels dropped; `le` buckets
    skipped)."""
    import requests

    out = {}
    for line in requests.get(url, timeout=30).text.splitlines():
        if line and not line.startswith("#") and "le=" not in line:
            name, value = line.rsplit(" ", 1)
            out[name.split("{")[0]] = float(value)
    return out


def conversations(rng: random.Random, distinct: int, max_tokens: int) -> list[dict]:
    """Distinct requests: a system prompt, 1-4 turns of earlier chat, an answer length."""
    out, seen = [], set()
    while len(out) < distinct:
        system = rng.randrange(len(SYSTEMS))
        turns = [rng.randrange(len(ASKS)) for _ in range(rng.randint(1, 4))]
        n = rng.choice([4, 8, 16, 32, max_tokens])
        key = (system, tuple(turns), n)
        if key in seen:
            continue
        seen.add(key)
        msgs = [{"role": "system", "content": SYSTEMS[system]}]
        for i, t in enumerate(turns):
            msgs.append({"role": "user", "content": ASKS[t]})
            if i < len(turns) - 1:
                msgs.append({"role": "assistant", "content": f"(answer {t})"})
        out.append({"messages": msgs, "max_tokens": n})
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="outrider-demo/target")
    parser.add_argument("--drafter", default="outrider-demo/dspark")
    parser.add_argument("--mode", default="dspark")
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--distinct", type=int, default=60)
    parser.add_argument("--concurrency", type=int, default=12)
    parser.add_argument("--max-batch", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-growth", type=float, default=0.05)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    import openai
    from live_server import live_server

    from outrider.core.prefix_cache import GB, PrefixCache
    from outrider.prompts import encode_messages
    from outrider.server.engine import LoadSpec
    from outrider.server.generation import Limits
    from outrider.server.memory import malloc_trim

    rng = random.Random(args.seed)
    asks = conversations(rng, args.distinct, args.max_tokens)
    plan = [rng.randrange(len(asks)) for _ in range(args.requests)]

    single = outrider.load(args.model, args.drafter, mode=args.mode)
    tok = single.tokenizer
    want = []
    for a in asks:
        ids = encode_messages(tok, a["messages"])
        result = single.generate(ids, max_tokens=a["max_tokens"], stop_tokens=set())
        want.append(tok.decode(result.tokens))
    del single

    trim = malloc_trim()

    def readings() -> tuple[float, float]:
        """RSS as it stands, then after handing the heap's free memory back (where glibc can)."""
        raw = rss_mb()
        if trim is None:
            return raw, raw
        trim(0)
        return raw, rss_mb()

    spec = LoadSpec(args.model, args.drafter, args.mode)
    limits = Limits(max_tokens_cap=4096, keepalive_s=5)
    # (requests done after the warm-up, RSS MB as it stands, RSS MB held: `readings`)
    samples: list[tuple[int, float, float]] = []
    quarters = {len(plan) * q // 4 for q in (1, 2, 3, 4)}
    mismatches: list[int] = []
    with live_server(spec, limits, max_batch=args.max_batch) as (url, engine):
        engine.set_prefix_cache(PrefixCache(int(0.5 * GB)))
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        lock = threading.Lock()
        done = 0

        async def one(i: int, k: int, gate: asyncio.Semaphore, count: bool) -> None:
            nonlocal done
            a = asks[k]
            async with gate:
                r = await client.chat.completions.create(
                    model=args.model,
                    messages=a["messages"],
                    max_tokens=a["max_tokens"],
                    extra_body={"ignore_eos": True},
                )
            if r.choices[0].message.content != want[k]:
                mismatches.append(i)
            if count:
                with lock:
                    done += 1
                    if done in quarters:
                        samples.append((done, *readings()))

        async def run(ks: list[int], count: bool) -> None:
            gate = asyncio.Semaphore(args.concurrency)
            await asyncio.gather(*(one(i, k, gate, count) for i, k in enumerate(ks)))

        async def warm_then_soak() -> float:
            await run(list(range(len(asks))), False)  # warm-up: every distinct request once
            samples.append((0, *readings()))
            t0 = time.perf_counter()
            await run(plan, True)
            return time.perf_counter() - t0

        elapsed = asyncio.run(warm_then_soak())
        scraped = scrape(url + "/metrics")
    warm, end = samples[1], samples[-1]  # after the first quarter; at the end
    growth = (end[2] - warm[2]) / warm[2]
    raw_growth = (end[1] - warm[1]) / warm[1]
    report = {
        "benchmark": "soak",
        "model": args.model,
        "mode": args.mode,
        "requests": len(plan),
        "distinct": len(asks),
        "concurrency": args.concurrency,
        "max_batch": args.max_batch,
        "seconds": round(elapsed, 2),
        "cross_talk": len(mismatches),
        "rss_trimmed": trim is not None,
        "rss_mb_after_warmup": round(warm[2], 1),
        "rss_mb_end": round(end[2], 1),
        "rss_growth": round(growth, 4),
        "rss_raw_growth": round(raw_growth, 4),
        "rss_mb_samples": [(n, round(raw, 1)) for n, raw, _ in samples],
        "rss_held_mb_samples": [(n, round(held, 1)) for n, _, held in samples],
        "prefix_cache_mb": round((scraped.get("outrider_prefix_cache_bytes") or 0) / 2**20, 1),
        "prefix_hits": scraped.get("outrider_prefix_cache_hits_total"),
        "prefix_misses": scraped.get("outrider_prefix_cache_misses_total"),
        "prefix_evictions": scraped.get("outrider_prefix_cache_evictions_total"),
        "batch_rows_mean": scraped.get("outrider_batch_rows_mean"),
        "batch_rows_max": scraped.get("outrider_batch_rows_max"),
        "device": str(mx.default_device()),
        "machine": platform.machine(),
        "mlx": mx.__version__,
    }
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    ok = not mismatches and growth < args.max_growth
    print("PASS" if ok else "FAIL", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
