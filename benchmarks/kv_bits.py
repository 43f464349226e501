"""What `--kv-bits` costs and saves: decode speed, prefill time and the KV cache's bytes, with
the cache in the model's dtype and quantized to 8 and 4 bits, for plain decoding and a
drafting mode. Every run is checked against the same mode's plain decoding at the same bits
(greedy: token-identical, or parted at an fp tie, which a GPU's batched rounding can flip;
any other divergence ends the run), since a quantized cache changes what the target computes but must
never change what speculation adds.

On a CUDA GPU attention reads the quantized cache dequantized (core/kv_quant.py); elsewhere
through MLX's quantized product; OUTRIDER_KV_ATTENTION forces either.

    python benchmarks/kv_bits.py --prompt-tokens 2048 --max-tokens 128 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path

import outrider  # first: it picks MLX's CPU BLAS (core/blas.py)

# isort: split
import mlx.core as mx

from outrider.core.device import kv_attention

sys.path.insert(0, str(Path(__file__).parent))
from prefix_cache import tie_or_fail  # noqa: E402


def cache_bytes(pipe, ids: list[int]) -> int:
    """Bytes the target's cache holds after a prefill of `ids`."""
    cache = pipe.target.make_cache()
    pipe.target.prefill(ids, cache)
    mx.eval([a for c in cache for a in _arrays(c)])
    return sum(c.nbytes for c in cache)


def _arrays(c) -> list:
    stored = getattr(c, "stored", c)
    keys, values = getattr(stored, "keys", None), getattr(stored, "values", None)
    out = []
    for x in (keys, values):
        out += list(x) if isinstance(x, tuple) else [x] if x is not None else []
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="outrider-demo/target")
    ap.add_argument("--drafter", default="outrider-demo/dspark")
    ap.add_argument("--modes", default="baseline,dspark")
    ap.add_argument("--bits", default="none,8,4")
    ap.add_argument("--prompt-tokens", type=int, default=2048)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    print(f"mlx {mx.__version__} {mx.default_device()}; quantized cache read: {kv_attention()}")
    rows, plain = [], {}
    for bits in [None if b == "none" else int(b) for b in args.bits.split(",")]:
        for mode in args.modes.split(","):
            drafter = None if mode in ("baseline", "lookup") else args.drafter
            pipe = outrider.load(args.model, drafter, mode=mode, kv_bits=bits)
            vocab = pipe.target.config.get("vocab_size", 1000)
            rng = random.Random(0)
            ids = [rng.randrange(10, min(vocab, 30000)) for _ in range(args.prompt_tokens)]
            pipe.generate(ids, max_tokens=8, stop_tokens=set())  # kernels for these shapes
            runs = [pipe.generate(ids, max_tokens=args.max_tokens, stop_tokens=set())
                    for _ in range(args.repeats)]  # fmt: skip
            tokens = runs[0].tokens
            if mode == "baseline":
                plain[bits] = tokens
            same = plain.get(bits) == tokens if bits in plain else None
            tie = (
                None if same in (True, None) else tie_or_fail(pipe.target, ids, tokens, plain[bits])
            )
            row = {
                "bits": bits,
                "mode": mode,
                "decode_tps": statistics.median(len(r.tokens) / r.decode_seconds for r in runs),
                "prefill_ms": statistics.median(r.prefill_seconds for r in runs) * 1e3,
                "cache_mb": cache_bytes(pipe, ids) / 1e6,
                "same_as_baseline": same,
                "fp_tie": tie,
            }
            rows.append(row)
            print(f"bits {str(bits or '-'):>2}  {mode:<9} decode {row['decode_tps']:8.1f} tok/s  "
                  f"prefill {row['prefill_ms']:8.1f} ms  cache {row['cache_mb']:8.1f} MB  "
                  f"same tokens as baseline: {same}{' (fp tie)' if tie else ''}",
                  flush=True)  # fmt: skip
    if args.json:
        meta = {"model": args.model, "prompt_tokens": args.prompt_tokens,
                "max_tokens": args.max_tokens, "read": kv_attention(),
                "device": str(mx.default_device()), "mlx": mx.__version__}  # fmt: skip
        args.json.write_text(json.dumps({**meta, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
