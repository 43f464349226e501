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


def test_nanbeiges_repack_reads_its_fields_from_dflash_config(tmp_path):
    """Nanbeige4.2-3B-DSpark keeps DeepSpec's architecture (`Qwen3DSparkModel`, the anchor
    slot predicts) but puts the mask id and the taps in a SpecForge-style `dflash_config` and
    ships no embedding or head: it reads as the flat DeepSpec config of the same drafter, and
    drafts the same."""
    from conftest import plain_greedy

    from outrider.api import load_drafter
    from outrider.core.plugins import Plugins

    path = make_tiny_target(tmp_path / "t", family="nanbeige")
    flat = make_tiny_drafter(tmp_path / "flat", path, "dspark", "deepspec", block_size=6,
                             share_target_head=True)  # fmt: skip
    nested = tmp_path / "nested"
    nested.mkdir()
    (nested / "model.safetensors").write_bytes((flat / "model.safetensors").read_bytes())
    cfg = json.loads((flat / "config.json").read_text())
    moved = {k: cfg.pop(k) for k in ("mask_token_id", "target_layer_ids")}
    cfg["dflash_config"] = {"projector_type": "dspark", **moved}
    (nested / "config.json").write_text(json.dumps(cfg))
    plugins = Plugins(load_entrypoints=False)
    a, b = load_drafter(plugins, str(flat)), load_drafter(plugins, str(nested))
    assert (b.format, b.logits_start, b.own_embedding, b.own_lm_head) == (
        "deepspec",
        0,
        False,
        False,
    )
    assert (b.mask_token_id, b.target_layer_ids) == (a.mask_token_id, a.target_layer_ids)
    pipe = outrider.load(str(path), str(nested), mode="dspark")
    ids = pipe.encode(PROMPT)
    got = pipe.generate(ids, max_tokens=24, stop_tokens=set())
    assert got.tokens == plain_greedy(path, ids, 24)
    same = outrider.load(str(path), str(flat), mode="dspark").generate(
        ids, max_tokens=24, stop_tokens=set()
    )
    assert [r.drafted for r in got.rounds] == [r.drafted for r in same.rounds]
