"""Self-distillation's batched greedy answers (`outrider/train/data.py`) are the target's own
greedy decoding of each prompt, row for row, whatever the rows' lengths and where they stop."""

from __future__ import annotations

import pytest

import outrider
from outrider.train.teacher import batched_greedy, greedy_generator

PROMPTS = [
    "def add(a, b):",
    "Write a short poem about the sea, in four lines, rhyming.",
    "What is 12 times 7?",
    "x",
    "class Stack:\n    def push(self, item):",
]


@pytest.mark.parametrize("family", ["qwen3_target", "llama_target"])
def test_batched_answers_equal_each_prompts_plain_greedy_decoding(family, request):
    pipe = outrider.load(str(request.getfixturevalue(family)), mode="baseline")
    target = pipe.target
    prompts = [target.tokenizer.encode(p) for p in PROMPTS]
    # a stop token the tiny model writes early in some rows and never in others
    first = [pipe.generate(p, max_tokens=12, stop_tokens=set()).tokens for p in prompts]
    stop = first[0][5]
    want = []
    for p in prompts:
        tokens = pipe.generate(p, max_tokens=12, stop_tokens=set()).tokens
        want.append(tokens[: tokens.index(stop) + 1] if stop in tokens else tokens)
    assert any(len(w) < 12 for w in want) and any(len(w) == 12 for w in want)
    assert batched_greedy(target, prompts, 12, {stop}) == want


def test_greedy_generator_answers_in_chunks_and_caps_the_length(qwen3_target):
    pipe = outrider.load(str(qwen3_target), mode="baseline")
    target = pipe.target
    prompts = [target.tokenizer.encode(p) for p in PROMPTS]
    stops = set(target.eos_token_ids)
    want = [pipe.generate(p, max_tokens=6, stop_tokens=stops).tokens for p in prompts]
    got = greedy_generator(target, max_new_tokens=6, batch_size=2)(prompts)
    # plain decoding leaves a stop token out of its tokens; an answer keeps it
    assert [g[: len(w)] for g, w in zip(got, want)] == want
    assert all(
        len(g) == len(w) or (len(g) == len(w) + 1 and g[-1] in stops) for g, w in zip(got, want)
    )
    assert greedy_generator(target, max_new_tokens=6, batch_size=8)(prompts, 3) == [
        w[:3] for w in want
    ]


def test_a_quantized_target_answers_from_a_dequantized_copy_and_stays_quantized(qwen3_target):
    import mlx.core as mx
    import mlx.nn as nn

    from outrider.train.teacher import teacher_target

    target = outrider.load(str(qwen3_target), mode="baseline").target
    nn.quantize(target.model, group_size=32, bits=8)
    mx.eval(target.model.parameters())

    def quantized(model) -> int:
        return sum(isinstance(m, nn.QuantizedLinear) for _, m in model.named_modules())

    assert quantized(target.model) > 0
    answering = teacher_target(target)
    assert answering is not target and quantized(answering.model) == 0
    assert quantized(target.model) > 0, "the target itself keeps its quantized weights"
    ids = mx.array([target.tokenizer.encode(PROMPTS[1])])
    want, got = target.model(ids), answering.model(ids)
    assert got.dtype == want.dtype
    assert mx.allclose(got, want, atol=1e-4, rtol=1e-4).item()
    plain = outrider.load(str(qwen3_target), mode="baseline").target
    assert teacher_target(plain) is plain, "a float target answers itself"


def test_prompts_prefilled_together_give_each_rows_own_prefill(qwen3_target):
    """Several groups (a small budget), rows returned in the order given, and the next step of
    every row equal to that row's own cache's."""
    import mlx.core as mx

    target = outrider.load(str(qwen3_target), mode="baseline").target
    prompts = [target.tokenizer.encode(p) for p in PROMPTS]
    lengths = sorted(map(len, prompts))
    assert lengths[0] < lengths[-1]
    last, rows = target.prefill_rows(prompts, budget=2 * lengths[-1])
    assert last.shape[0] == len(prompts)
    nxt = mx.argmax(last, axis=-1)[:, None].astype(mx.uint32)
    step, _ = target.forward_rows(nxt, rows)
    for i, prompt in enumerate(prompts):
        cache = target.make_cache()
        want, _ = target.prefill(prompt, cache)
        assert mx.allclose(last[i], want, atol=1e-4, rtol=1e-4).item(), i
        own, _ = target.forward(nxt[i], cache)
        assert mx.allclose(step[i, -1], own[-1], atol=1e-4, rtol=1e-4).item(), i


def test_a_recurrent_target_prefills_each_prompt_on_its_own(models_dir):
    from outrider.testing import make_tiny_target

    path = make_tiny_target(models_dir / "distill-qwen3_next", family="qwen3_next")
    pipe = outrider.load(str(path), mode="baseline")
    prompts = [pipe.target.tokenizer.encode(p) for p in PROMPTS[:3]]
    assert pipe.target.prefill_rows(prompts) is None
    want = [pipe.generate(p, max_tokens=5, stop_tokens=set()).tokens for p in prompts]
    assert batched_greedy(pipe.target, prompts, 5, set()) == want
