"""Looped-depth targets (mlx-lm nanbeige with num_loops): the drafter's taps index the unrolled
stream, the boundary tap of each loop but the last is the state after the norm between loops,
and decoding stays plain greedy's."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from mlx_lm.models.base import create_attention_mask

import outrider
from outrider.core.errors import OutriderError
from outrider.testing import make_tiny_drafter, make_tiny_target

PROMPT = "def fibonacci(n): return fibonacci(n - 1) + fibonacci(n - 2)"


def unrolled(target, ids: list[int]) -> list[mx.array]:
    """The stream a looped model computes, by hand: each layer's output in every loop, the
    last layer's replaced by the normed state between loops (none after the last loop, or with
    skip_loop_final_norm)."""
    inner = target.model.model
    layers = [getattr(x, "layer", x) for x in inner.layers]
    cache = target.make_cache()
    h = inner.embed_tokens(mx.array(ids)[None])
    mask = create_attention_mask(h, cache[0])
    out = []
    for k in range(inner.num_loops):
        for j, layer in enumerate(layers):
            h = layer(h, mask, cache[k * len(layers) + j])
            out.append(h)
        if not inner.skip_loop_final_norm:
            h = inner.norm(h)
            if k < inner.num_loops - 1:
                out[-1] = h
    return [x[0] for x in out]


@pytest.mark.parametrize("skip_norm", [False, True])
def test_taps_index_the_unrolled_stream(tmp_path, skip_norm):
    path = make_tiny_target(tmp_path / "t", family="nanbeige", skip_loop_final_norm=skip_norm)
    target = outrider.load(str(path), mode="baseline").target
    assert (target.family.name, target.loops, target.num_layers) == ("looped_depth", 2, 2)
    ids = target.tokenizer.encode(PROMPT)
    taps = (-1, 0, 1, 2, 3)  # the embedding, loop 0's two layers, loop 1's two
    target.install_taps(taps)
    logits, got = target.forward(mx.array(ids, dtype=mx.uint32), target.make_cache(), taps)
    stream = unrolled(target, ids)
    embed = target.model.model.embed_tokens(mx.array(ids))
    want = mx.concatenate([embed, *stream], axis=-1)
    assert got.shape == want.shape
    assert mx.array_equal(got, want).item()
    plain = target.model(mx.array(ids)[None])[0]
    assert mx.array_equal(logits, plain).item()  # tapping changes nothing


def test_a_tap_past_the_unrolled_stream_is_refused(tmp_path):
    path = make_tiny_target(tmp_path / "t", family="nanbeige")
    drafter = make_tiny_drafter(tmp_path / "d", path, "dspark", "deepspec", block_size=4)
    cfg = json.loads((drafter / "config.json").read_text())
    assert cfg["num_target_layers"] == 4  # two layers, two loops
    cfg.update(target_layer_ids=[0, 1, 4], num_target_layers=8)
    (drafter / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(OutriderError, match=r"taps target layer 4, but the target has 4 layers"):
        outrider.load(str(path), str(drafter), mode="dspark")


def test_dspark_on_a_looped_target_equals_plain_greedy(tmp_path):
    """A drafter tapping both loops (the boundary included), at every cap and in a batch."""
    from conftest import plain_greedy

    path = make_tiny_target(tmp_path / "t", family="nanbeige")
    drafter = make_tiny_drafter(tmp_path / "d", path, "dspark", "deepspec", block_size=6,
                                target_layer_ids=[0, 1, 2])  # fmt: skip
    pipe = outrider.load(str(path), str(drafter), mode="dspark")
    prompts = [pipe.encode(PROMPT), pipe.encode("Rollback must be exact.")]
    want = [plain_greedy(path, ids, 32) for ids in prompts]
    for cap in (1, 3, 6):
        got = pipe.generate(prompts[0], max_tokens=32, max_draft=cap, stop_tokens=set())
        assert got.tokens == want[0], f"cap {cap}"
    batch = pipe.generate_batch(prompts, max_tokens=32, stop_tokens=set())
    assert [r.tokens for r in batch] == want
