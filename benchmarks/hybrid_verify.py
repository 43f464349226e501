"""What exact recurrent rollback costs: verify forwards of a hybrid target, with and without it.

A random-weight hybrid of a real size (qwen3_5: gated-delta-net + attention; nemotron_h:
Mamba-2 + attention + MoE) at a fixed context. For each verify width w it times one target
forward of w tokens, evaluated:

  chunked   the model's own multi-token forward (what mlx-lm's generation runs; its recurrent
            state cannot be rolled back)
  verify    outrider's verify forward (recurrent mixers record their input), then a rollback
            of w - 1 rows (the worst case: the recurrent mixers replay one token) evaluated

and prints both with their ratio. Each timed forward starts from the same pre-round cache.

    python benchmarks/hybrid_verify.py --shapes qwen3_5-2b,nemotron_h-tiny --widths 1,2,4,8
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

import outrider  # noqa: E402, F401 - first: it picks MLX's CPU BLAS (core/blas.py)

# isort: split
import mlx.core as mx

from outrider.core.target import Target
from outrider.plugins.targets.hybrid import GatedDeltaFamily, NemotronHFamily
from outrider.testing import build_model, cast_model, tiny_config

SHAPES = {
    "qwen3_5-tiny": ("qwen3_5", {}),  # a smoke test of the script itself
    "qwen3_5-2b": (
        "qwen3_5",
        dict(
            hidden_size=2048,
            num_hidden_layers=24,
            intermediate_size=6144,
            num_attention_heads=16,
            num_key_value_heads=4,
            head_dim=128,
            linear_num_value_heads=16,
            linear_num_key_heads=16,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            full_attention_interval=4,
            vocab_size=32000,
        ),
    ),
    "nemotron_h-tiny": ("nemotron_h", {}),
    "nemotron_h-2b": (
        "nemotron_h",
        dict(
            hidden_size=2048,
            hybrid_override_pattern=["M", "-", "M", "*", "M", "-"] * 4,
            intermediate_size=6144,
            num_attention_heads=16,
            num_key_value_heads=4,
            head_dim=128,
            mamba_num_heads=32,
            mamba_head_dim=64,
            ssm_state_size=128,
            n_groups=8,
            vocab_size=32000,
        ),
    ),
}
FAMILIES = {"qwen3_5": GatedDeltaFamily, "nemotron_h": NemotronHFamily}


def build_target(shape: str, dtype: mx.Dtype) -> Target:
    family_name, dims = SHAPES[shape]
    config = tiny_config(family_name, **dims)
    model = build_model(config, seed=0, scale=1.0)
    cast_model(model, dtype)
    family = FAMILIES[family_name]()
    family.prepare(model)
    return Target(model, None, family, config, name=shape)


def time_width(target: Target, cache: list, width: int, verify: bool, trials: int) -> float:
    saved = [c.state for c in cache]
    ids = mx.array([7 + i for i in range(width)], dtype=mx.uint32)
    times = []
    for _ in range(trials + 2):  # two warm-ups
        for c, s in zip(cache, saved):
            c.state = s
        t = time.perf_counter()
        if verify:
            logits, _ = target.forward(ids, cache)
            mx.eval(logits, [c.state for c in cache])
            target.rollback(cache, width - 1)
            mx.eval([c.state for c in cache])
        else:
            logits = target._run(ids, cache, (), verify=False)
            mx.eval(logits, [c.state for c in cache])
        times.append(time.perf_counter() - t)
    for c, s in zip(cache, saved):
        c.state = s
    return statistics.median(times[2:]) * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shapes", default="qwen3_5-tiny")
    ap.add_argument("--widths", default="1,2,4,8")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--trials", type=int, default=20)
    ap.add_argument("--json")
    args = ap.parse_args()
    dtype = getattr(mx, args.dtype)
    widths = [int(w) for w in args.widths.split(",")]
    out = {"device": str(mx.default_device()), "mlx": mx.__version__, "rows": []}
    out["platform"] = platform.platform()
    print(f"device {out['device']} · mlx {out['mlx']} · {args.dtype} · context {args.context}")
    for shape in args.shapes.split(","):
        target = build_target(shape, dtype)
        cache = target.make_cache()
        with mx.stream(target.stream):
            target.prefill([3 + i % 200 for i in range(args.context)], cache)
            mx.eval([c.state for c in cache])
            print(f"\n== {shape} ==\n width  chunked ms  verify+rollback ms  ratio")
            for w in widths:
                chunked = time_width(target, cache, w, False, args.trials)
                verified = time_width(target, cache, w, True, args.trials)
                ratio = verified / chunked
                print(f" {w:5d}  {chunked:10.2f}  {verified:18.2f}  {ratio:5.2f}")
                out["rows"].append(
                    dict(shape=shape, width=w, chunked_ms=chunked, verify_ms=verified, ratio=ratio)
                )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
