"""A block drafter's compiled parts (plugins/strategies/compiled_drafter.py) draft what its
layers and sequential head do op by op.

On a CUDA GPU a loaded DSpark or DFlash drafter runs compiled; here OUTRIDER_COMPILED_LAYERS=on
forces it on the CPU. Drafts never change the output, so the checks are of two kinds: the
drafts (and DSpark's confidences) are the eager path's, round after round, and generation
stays plain greedy decoding's.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from conftest import PROMPTS, plain_greedy

import outrider
from outrider.core.compiled_layers import ENV
from outrider.core.proposer import DraftContext
from outrider.core.sampling import SamplingParams
from outrider.plugins.strategies import compiled_drafter
from outrider.plugins.strategies.compiled_drafter import CompiledDraftLayer

HEADS = ["dspark", "dspark-gated", "dspark-rnn", "dflash-zlab"]


def load(target, drafter, monkeypatch, setting: str = "on"):
    monkeypatch.setenv(ENV, setting)
    mode = "dflash" if drafter.name.startswith("dflash") else "dspark"
    return outrider.load(str(target), str(drafter), mode=mode, confidence_threshold=0.0)


def block_proposer(pipe):
    """The pipeline's block proposer, behind the lookup copies' wrapper."""
    return getattr(pipe.proposer, "inner", pipe.proposer)


def rounds(pipe, prompt: str, confidence: bool) -> list:
    """The drafts (and confidences) of rounds that take in 1, 3 and 20 context rows (the
    last past the compiled path's rows) at caps 3, 7 and 5, from one prefill."""
    target, proposer = pipe.target, block_proposer(pipe)
    ids = pipe.encode(prompt)
    taps_ids = tuple(proposer.tap_layer_ids)
    cache = target.make_cache()
    out = []
    with mx.stream(target.stream):
        _, taps = target.prefill(ids, cache, taps_ids)
        proposer.start(ids, taps)
        history = list(ids)
        for new, cap in ((1, 3), (3, 7), (20, 5)):
            if out:  # the rows of `new` more tokens, as a verify hands them over
                more = [(7 * len(history) + i) % 50 + 1 for i in range(new)]
                _, rows = target.forward(mx.array(more, dtype=mx.uint32), cache, taps_ids)
                proposer.observe(new - 1, rows)
                history += more
            extras = {"confidence": True} if confidence else {}
            ctx = DraftContext(history, cap, SamplingParams(), None, extras=extras)
            proposal = proposer.propose(ctx)
            mx.eval(proposal.tokens)
            out.append(proposal.tokens.tolist())
            if confidence:
                out.append(proposal.confidence.tolist())
    return out


@pytest.mark.parametrize("head", HEADS)
def test_compiled_drafts_are_the_eager_drafts(monkeypatch, qwen3_target, drafters, head):
    pipe = load(qwen3_target, drafters[head], monkeypatch)
    proposer = block_proposer(pipe)
    assert all(isinstance(x.compiled, CompiledDraftLayer) for x in proposer.drafter.layers)
    confidence = proposer.spec.confidence_head
    for prompt in PROMPTS[:2]:
        got = rounds(pipe, prompt, confidence)
        with compiled_drafter.bypassed(proposer.drafter):
            assert all(x.compiled is None for x in proposer.drafter.layers)
            want = rounds(pipe, prompt, confidence)
        assert got == want, f"{head} on {prompt!r}"
    assert all(isinstance(x.compiled, CompiledDraftLayer) for x in proposer.drafter.layers)


@pytest.mark.parametrize("head", ["dspark", "dflash-zlab"])
def test_a_compiled_drafter_keeps_plain_greedy_output(monkeypatch, qwen3_target, drafters, head):
    pipe = load(qwen3_target, drafters[head], monkeypatch)
    for cap in (2, 8):
        for prompt in PROMPTS[:2]:
            ids = pipe.encode(prompt)
            got = pipe.generate(ids, max_tokens=40, max_draft=cap, stop_tokens=set())
            assert got.tokens == plain_greedy(qwen3_target, ids, 40), f"cap {cap}: {prompt!r}"


def test_batched_rows_beside_a_compiled_drafter_decode_each_rows_own(
    monkeypatch, qwen3_target, drafters
):
    """Rows drafted together take the layers' own path: each row's output is its own."""
    pipe = load(qwen3_target, drafters["dspark"], monkeypatch)
    rows = [pipe.encode(p) for p in PROMPTS[:3]]
    batch = pipe.generate_batch(rows, max_tokens=24, max_draft=4, stop_tokens=set())
    for ids, got in zip(rows, batch):
        assert got.tokens == plain_greedy(qwen3_target, ids, 24)


def test_weights_changed_after_load_are_the_ones_drafted_with(monkeypatch, qwen3_target, drafters):
    """Compiled parts read the drafter's weights every call: after new MLP and Markov weights
    (and a cast of the layer), the compiled drafts are the eager drafts of the new weights."""
    pipe = load(qwen3_target, drafters["dspark"], monkeypatch, "on")
    proposer = block_proposer(pipe)
    before = rounds(pipe, PROMPTS[0], True)
    drafter = proposer.drafter
    layer = drafter.layers[0]
    layer.set_dtype(mx.float16)
    for name in ("gate_proj", "up_proj"):
        linear = layer.mlp[name]
        linear.update(  # a plain layer of new weights in place of the quantized one
            {"scales": linear.scales * 3.0}
            if "scales" in linear
            else {"weight": linear.weight * 3.0}
        )
    w1 = drafter.markov_head.markov_w1
    w1.weight = mx.random.normal(w1.weight.shape, key=mx.random.key(5)).astype(w1.weight.dtype)
    got = rounds(pipe, PROMPTS[0], True)
    with compiled_drafter.bypassed(drafter):
        want = rounds(pipe, PROMPTS[0], True)
    assert got == want
    assert got != before  # the new weights draft otherwise: the check above could fail


def test_off_and_auto_on_the_cpu_leave_the_drafter_alone(monkeypatch, qwen3_target, drafters):
    for setting in ("off", "auto"):
        pipe = load(qwen3_target, drafters["dspark"], monkeypatch, setting)
        drafter = block_proposer(pipe).drafter
        if setting == "auto" and mx.default_device() == mx.gpu and mx.cuda.is_available():
            continue  # auto compiles on a CUDA GPU
        assert all(x.compiled is None for x in drafter.layers)
        assert not getattr(drafter, "compiled_chain", False)


def test_a_compiled_layer_that_disagrees_leaves_the_drafter_eager(
    monkeypatch, qwen3_target, drafters
):
    """A compiled block roped one position late computes another layer: the load's check
    keeps the drafter on its own path (and the greedy chain with it)."""
    real = CompiledDraftLayer._traced_pre
    monkeypatch.setattr(
        CompiledDraftLayer, "_traced_pre", lambda self, h, offset: real(self, h, offset + 1)
    )
    drafter = block_proposer(load(qwen3_target, drafters["dspark"], monkeypatch)).drafter
    assert all(x.compiled is None for x in drafter.layers)
    assert not getattr(drafter, "compiled_chain", False)
