"""The teacher: who answers the self-distillation prompts and runs the training forwards
(`teacher_target`), and how it answers them, greedily and many rows at once
(`greedy_generator`, `batched_greedy`)."""

from __future__ import annotations

from .data import Generate


def greedy_generator(target, max_new_tokens: int, batch_size: int = 256) -> Generate:
    """The target's own greedy answers, each ending with the end-of-turn token when the target
    wrote one: `batch_size` prompts at a time in one batched cache (`batched_greedy`), or
    through mlx-lm's `BatchGenerator` for a target that cannot batch rows."""
    stops = set(target.eos_token_ids)

    def generate(prompts: list[list[int]], max_tokens: int | None = None) -> list[list[int]]:
        limit = max_new_tokens if max_tokens is None else min(max_tokens, max_new_tokens)
        if not getattr(target, "batches", False):
            return _mlx_lm_batches(target.model, prompts, limit, stops, batch_size)
        out: list[list[int]] = []
        for lo in range(0, len(prompts), batch_size):
            out += batched_greedy(target, prompts[lo : lo + batch_size], limit, stops)
        return out

    return generate


def teacher_target(target):
    """The target training learns from: for a quantized target, a copy with its weights
    dequantized (in the type of its scales: a GGUF target's float16, though the target itself
    computes in float32), where that fits memory; else the target. It answers the
    self-distillation prompts and runs the training forwards (taps and next-token
    distributions). MLX's quantized matmul at hundreds of rows is slow (a
    512-row decode step of SmolLM2's Q4_1 GGUF: 144 ms on an H200, 9 ms dequantized;
    benchmarks/distill_throughput.py). Same weights, other rounding: the drafter is measured
    against the target itself. Make it before installing taps on the target."""
    import copy

    from ..core.device import dense_fits, make_dense, scales_dtype
    from ..core.target import Target

    dtype = scales_dtype(target.model)
    if dtype is None or not dense_fits(target.model, dtype.size):
        return target
    model = copy.deepcopy(target.model)
    make_dense(model, dtype)
    return Target(model, target.tokenizer, target.family, target.config, name=target.name)


def batched_greedy(
    target, prompts: list[list[int]], limit: int, stops: set[int]
) -> list[list[int]]:
    """Greedy answers of up to `limit` tokens: the prompts prefilled together in left-padded
    batches where the target can (`Target.prefill_rows`; else each on its own), then every row
    decoded together, one forward and one argmax a step for all of
    them, the next step queued before this one is read. A row that ended keeps being computed
    (cheaper than reshaping the cache) and its tokens are dropped. mlx-lm's `BatchGenerator`
    spent ~0.3 s of host work a step at 512 rows on an H200 (benchmarks/distill_throughput.py),
    fifty times the model's own batched forward."""
    import mlx.core as mx

    if not prompts or limit < 1:
        return [[] for _ in prompts]
    with mx.stream(target.stream):
        together = target.prefill_rows(prompts)
        if together is not None:
            last, rows = together
            y = mx.argmax(last, axis=-1).astype(mx.uint32)
        else:
            caches, firsts = [], []
            for prompt in prompts:
                cache = target.make_cache()
                logits, _ = target.prefill(prompt, cache)
                firsts.append(mx.argmax(logits))
                caches.append(cache)
            rows = target.merge_rows(caches)
            del caches
            y = mx.stack(firsts).astype(mx.uint32)
        answers: list[list[int]] = [[] for _ in prompts]
        open_rows = set(range(len(prompts)))
        for step in range(limit):
            following = None
            if step < limit - 1:
                logits, _ = target.forward_rows(y[:, None], rows)
                following = mx.argmax(logits[:, -1], axis=-1).astype(mx.uint32)
                mx.async_eval(following)
            tokens = y.tolist()
            for i in list(open_rows):
                answers[i].append(tokens[i])
                if tokens[i] in stops:
                    open_rows.discard(i)
            if following is None or not open_rows:
                break
            y = following
    return answers


def _mlx_lm_batches(
    model, prompts, limit: int, stops: set[int], batch_size: int
) -> list[list[int]]:
    """The same answers through mlx-lm's `BatchGenerator` (targets without batched caches)."""
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(
        model,
        stop_tokens=[[t] for t in sorted(stops)],
        completion_batch_size=batch_size,
        prefill_batch_size=min(16, batch_size),
    )
    try:
        uids = gen.insert(prompts, [limit] * len(prompts))
        answers: dict[int, list[int]] = {u: [] for u in uids}
        while responses := gen.next_generated():
            for r in responses:
                answers[r.uid].append(int(r.token))
    finally:
        gen.close()
    return [answers[u] for u in uids]
