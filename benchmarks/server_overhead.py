"""Server overhead: the same generation through `outrider serve` and through the Python API.

Starts `outrider serve` in a child process (127.0.0.1, a free port), streams a
completion (`/v1/completions`, `ignore_eos`, greedy) and times time-to-first-token and decode
tokens/s on the client side of HTTP; then runs the same prompt and max_tokens through
`Pipeline.stream` and times the same two figures. Trials interleave the two paths; best-of and
median figures are reported with the overhead per token (whole-run time / tokens). The two outputs are checked
token-count and text equal (a mismatch fails the run).

    python benchmarks/server_overhead.py                      # a tiny random Qwen3, lookup
    python benchmarks/server_overhead.py --model PATH --mode dspark --drafter PATH
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]


def via_api(pipe, prompt: str, n: int) -> tuple[float, float, int, str]:
    ids = list(pipe.tokenizer.encode(prompt))
    t0 = time.perf_counter()
    first = last = None
    count, text = 0, []
    for chunk in pipe.stream(ids, max_tokens=n, stop_tokens=set()):
        if chunk.tokens:
            now = time.perf_counter()
            first = first or now
            last = now
            count += len(chunk.tokens)
        text.append(chunk.text)
    return first - t0, last - t0, count, "".join(text)


def via_server(url: str, prompt: str, n: int) -> tuple[float, float, int, str]:
    body = {
        "prompt": prompt,
        "max_tokens": n,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    t0 = time.perf_counter()
    first = last = None
    text, count = [], 0
    with requests.post(url + "/v1/completions", json=body, stream=True) as r:
        for line in r.iter_lines():
            if not line.startswith(b"data: {"):
                continue
            obj = json.loads(line[6:])
            if obj.get("usage"):
                count = obj["usage"]["completion_tokens"]
            if obj["choices"] and obj["choices"][0]["text"]:
                now = time.perf_counter()
                first = first or now
                last = now
                text.append(obj["choices"][0]["text"])
    # decode rate over the same span the API measures: first token to last token
    return first - t0, last - t0, count, "".join(text)


# Random-weight Qwen3 shapes (fp32): "tiny" is the tests' size; "medium" makes a token in a
# few milliseconds on a CPU, nearer a real model's per-token time than tiny's ~1 ms.
SHAPES = {
    "tiny": {},
    "medium": dict(
        hidden_size=512,
        num_hidden_layers=8,
        intermediate_size=1536,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
    ),
}


def random_target(shape: str) -> Path:
    from outrider.cli import cache_root
    from outrider.testing import make_tiny_target

    path = cache_root() / "bench" / f"qwen3-{shape}"
    if not (path / "config.json").is_file():
        make_tiny_target(path, **SHAPES[shape])
    return path


@contextlib.contextmanager
def served(model: str, args: argparse.Namespace):
    """`outrider serve` in its own process, as clients meet it (the client here is another
    process, so the two do not share an interpreter lock)."""
    from live_server import free_port

    port = free_port()
    cmd = [sys.executable, "-m", "outrider", "serve", "--model", model, "--mode", args.mode]
    cmd += ["--port", str(port), "--max-tokens-cap", str(max(args.max_tokens, 8))]
    if args.drafter:
        cmd += ["--drafter", args.drafter]
    proc = subprocess.Popen(cmd, cwd=ROOT, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 600
        while True:
            try:
                if requests.get(url + "/health", timeout=1).json().get("status") == "ok":
                    break
            except requests.ConnectionError:
                pass
            if proc.poll() is not None or time.time() > deadline:
                sys.exit("the server did not start")
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="target (default: --shape tiny)")
    ap.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        default=None,
        help="instead of --model: a random-weight Qwen3 of this shape, built once (tiny is "
        "the size of the tests' models)",
    )
    ap.add_argument("--drafter", default=None)
    ap.add_argument("--mode", default="lookup")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--prompt", default="Write a short story about a lighthouse keeper.")
    args = ap.parse_args()

    import outrider

    model = args.model or str(random_target(args.shape or "tiny"))
    pipe = outrider.load(model, args.drafter, args.mode)
    with served(model, args) as url:
        via_server(url, args.prompt, 8)  # warm both paths
        via_api(pipe, args.prompt, 8)
        rows = {"api": [], "server": []}
        for _ in range(args.trials):
            rows["server"].append(via_server(url, args.prompt, args.max_tokens))
            rows["api"].append(via_api(pipe, args.prompt, args.max_tokens))
    texts = {r[3] for r in rows["api"] + rows["server"]}
    counts = {r[2] for r in rows["api"] + rows["server"]}
    if len(texts) != 1 or counts != {args.max_tokens}:
        sys.exit(f"outputs differ between the API and the server: counts {sorted(counts)}")
    n = args.max_tokens
    print(f"model {Path(model).name}, mode {pipe.mode}, {n} tokens, {args.trials} trials")
    print(f"{'path':<8} {'stat':<7} {'TTFT ms':>9} {'total ms':>10} {'decode tok/s':>13}")
    stats = {}
    for k in ("api", "server"):
        for name, fn in (("median", statistics.median), ("best", min)):
            ttft, total = fn(r[0] for r in rows[k]), fn(r[1] for r in rows[k])
            stats[k, name] = (ttft, total)
            rate = (n - 1) / (total - ttft)
            print(f"{k:<8} {name:<7} {ttft * 1e3:>9.2f} {total * 1e3:>10.1f} {rate:>13.1f}")
    # Decode: time from the first token the client saw to the last, per token after the first
    # (streams coalesce frames when the client side lags, which this figure includes). TTFT
    # apart. Other processes only ever add time, so best-of-trials is the cleaner estimate on
    # a busy machine; the median is printed beside it.
    for name in ("best", "median"):
        (ta, a), (ts, b) = stats["api", name], stats["server", name]
        per_api, per_srv = (a - ta) / (n - 1), (b - ts) / (n - 1)
        print(
            f"{name:<6} server overhead per decoded token {(per_srv - per_api) * 1e3:+.3f} ms "
            f"({(per_srv / per_api - 1) * 100:+.1f}%); whole run {(b / a - 1) * 100:+.1f}%; "
            f"TTFT {(ts - ta) * 1e3:+.2f} ms"
        )


if __name__ == "__main__":
    main()
