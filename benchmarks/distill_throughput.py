"""How fast a target answers prompts for self-distillation, and where the time goes.

`outrider train` has the target answer every training prompt (`outrider/train/data.py`). With
mlx-lm's `BatchGenerator` that ran at ~1.8k tokens/s at 1,024 rows for SmolLM2-135M's Q4_1
GGUF on an H200, far under what a 135M model should do. This times, per weight form of the same
model (`loaded`: as loaded; `dense`: what self-distillation answers with now,
`teacher_target`, its quantized weights dequantized to the type of its scales; `float16`,
`bfloat16`: dequantized to that type):

* one batched decode forward of `--rows` rows over a `--context`-token cache, and one training
  forward of `--train-batch` windows of `--seq-len` tokens (what `outrider train` runs every
  step, from the same form: `teacher_target`);
* answering `--prompts` prompts of the synthetic training mix (`scripts/smollm2/prompts.py`,
  never an evaluation set), `--max-new` tokens each, `--rows` at a time, with each engine of
  `--engines`: `batched` (`batched_greedy`, the one `outrider train` uses) and `mlx-lm`
  (`BatchGenerator`);

and how many answers equal the first form's and engine's, token for token.

    python benchmarks/distill_throughput.py --prompts 1024 --rows 1024 --max-new 64
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import outrider  # noqa: E402, F401 - first: it picks MLX's CPU BLAS (core/blas.py)

# isort: split
import mlx.core as mx  # noqa: E402
from mlx.utils import tree_map  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402
from mlx_lm.utils import dequantize_model  # noqa: E402

from outrider.core.plugins import Plugins  # noqa: E402
from outrider.loaders import load_target  # noqa: E402
from outrider.train.teacher import greedy_generator, teacher_target  # noqa: E402


def mix_prompts(tokenizer, count: int) -> list[list[int]]:
    spec = importlib.util.spec_from_file_location("mix", ROOT / "scripts/smollm2/prompts.py")
    mix = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mix)
    rows = mix.prompt_mix(count, seed=11)
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": r["turns"][0]}], add_generation_prompt=True
        )
        for r in rows
    ]


def dequantized(model, dtype):
    model.update(tree_map(lambda a: a.astype(dtype) if mx.issubdtype(a.dtype, mx.floating) else a,
                          model.parameters()))  # fmt: skip
    dequantize_model(model)
    model.update(tree_map(lambda a: a.astype(dtype) if mx.issubdtype(a.dtype, mx.floating) else a,
                          model.parameters()))  # fmt: skip
    mx.eval(model.parameters())
    return model


def forward_ms(model, rows: int, context: int, reps: int = 5) -> float:
    cache = make_prompt_cache(model)
    mx.eval(model(mx.ones((rows, context), dtype=mx.uint32), cache=cache))
    ids = mx.ones((rows, 1), dtype=mx.uint32)
    times = []
    for _ in range(reps + 1):
        t = time.perf_counter()
        mx.eval(model(ids, cache=cache))
        times.append(time.perf_counter() - t)
        for c in cache:
            c.trim(1)
    return sorted(times[1:])[reps // 2] * 1000


def training_forward_ms(model, batch: int, seq_len: int, reps: int = 5) -> float:
    """One training step's target forward: whole windows, no cache."""
    ids = mx.ones((batch, seq_len), dtype=mx.uint32)
    times = []
    for _ in range(reps + 1):
        t = time.perf_counter()
        mx.eval(model(ids))
        times.append(time.perf_counter() - t)
    return sorted(times[1:])[reps // 2] * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--rows", type=int, default=256, help="BatchGenerator's batch")
    ap.add_argument("--max-new", type=int, default=64)
    ap.add_argument("--context", type=int, default=192)
    ap.add_argument("--train-batch", type=int, default=32, help="training windows per step")
    ap.add_argument("--seq-len", type=int, default=384, help="tokens per training window")
    ap.add_argument("--forms", default="loaded,dense")
    ap.add_argument("--engines", default="batched,mlx-lm")
    args = ap.parse_args()
    plugins = Plugins()
    print(f"device {mx.default_device()}, mlx {mx.__version__}", flush=True)
    answers: dict[str, list] = {}
    for form in args.forms.split(","):
        target = load_target(plugins, args.model)
        if form == "dense":
            target = teacher_target(target)
        elif form != "loaded":
            dequantized(target.model, getattr(mx, form))
        prompts = mix_prompts(target.tokenizer, args.prompts)
        f1 = forward_ms(target.model, 1, args.context)
        fr = forward_ms(target.model, args.rows, args.context)
        ft = training_forward_ms(target.model, args.train_batch, args.seq_len)
        print(
            f"{form:<9} forward 1 row {f1:7.2f} ms, {args.rows} rows {fr:8.2f} ms, training "
            f"{args.train_batch}x{args.seq_len} {ft:8.2f} ms",
            flush=True,
        )
        for engine in args.engines.split(","):
            answerer = target
            if engine == "mlx-lm":  # no `batches`: greedy_generator takes BatchGenerator
                answerer = SimpleNamespace(model=target.model, eos_token_ids=target.eos_token_ids)
            gen = greedy_generator(answerer, args.max_new, batch_size=args.rows)
            gen(prompts[:8], 4)  # compile and warm
            t = time.perf_counter()
            out = gen(prompts)
            seconds = time.perf_counter() - t
            tokens = sum(len(a) for a in out)
            same = ""
            if answers:
                first, ref = next(iter(answers.items()))
                n = sum(a == b for a, b in zip(out, ref))
                same = f"  equal to {first}: {n}/{len(out)}"
            answers[f"{form}/{engine}"] = out
            print(
                f"  {engine:<8} {len(prompts)} prompts x {args.max_new} new, {args.rows} at a "
                f"time: {seconds:6.1f} s, {tokens / seconds:8.0f} tok/s{same}",
                flush=True,
            )
        del target
        mx.clear_cache()


if __name__ == "__main__":
    main()
