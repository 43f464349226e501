"""LiquidAI's DSpark packaging (Lfm2DSparkDraftModel) over an LFM2 target (gated short
convolutions between attention layers): read as published, decoded losslessly, refused by name
where the config is broken."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from checkpoint_edits import edited
from conftest import plain_greedy

import outrider
from outrider.api import load_drafter
from outrider.core.errors import CheckpointError, OutriderError
from outrider.core.plugins import Plugins
from outrider.testing import make_tiny_drafter, make_tiny_target

PROMPT = "def fibonacci(n): return fibonacci(n - 1) + fibonacci(n - 2)"


@pytest.fixture(scope="module")
def lfm2(tmp_path_factory):
    """(an LFM2 target, its DSpark drafter in LiquidAI's packaging, the same in NeoX rope)."""
    d = tmp_path_factory.mktemp("lfm2")
    target = make_tiny_target(d / "t", family="lfm2")
    drafter = make_tiny_drafter(d / "liquid", target, "dspark", "liquid", block_size=5)
    neox = make_tiny_drafter(d / "neox", target, "dspark", "liquid", block_size=5, neox=True)
    return target, drafter, neox


def test_the_packaging_is_read_as_published(lfm2):
    target, drafter, neox = lfm2
    cfg = json.loads((drafter / "config.json").read_text())
    assert "mask_token_id" not in cfg and "projector_type" not in cfg["dflash_config"]
    spec = load_drafter(Plugins(load_entrypoints=False), str(drafter))
    assert (spec.format, spec.kind, spec.logits_start) == ("liquid-dspark", "dspark", 0)
    assert spec.max_draft == spec.block_size == 5  # the anchor slot predicts, as DeepSpec's
    assert not spec.own_embedding and not spec.own_lm_head  # the target's tied embedding
    assert spec.target_layer_ids == tuple(cfg["dflash_config"]["target_layer_ids"])
    assert spec.mask_token_id == cfg["dflash_config"]["mask_token_id"]
    # a confidence head reads the Markov head unless the config says otherwise (vLLM's rule)
    assert spec.confidence_head and spec.confidence_with_markov and spec.markov_rank > 0
    assert spec.rope_traditional
    assert not load_drafter(Plugins(load_entrypoints=False), str(neox)).rope_traditional


def test_the_drafter_ropes_as_its_config_says(lfm2):
    """rope_is_neox_style false reaches every draft layer as interleaved pairs."""
    target, drafter, neox = lfm2
    for path, traditional in ((drafter, True), (neox, False)):
        pipe = outrider.load(str(target), str(path), mode="dspark")
        layers = pipe.proposer.inner.drafter.layers
        assert [layer.self_attn.rope.traditional for layer in layers] == [traditional] * len(layers)


def test_dspark_over_lfm2_equals_plain_greedy(lfm2):
    """Auto mode takes the drafter's kind; every cap, and a batch of two, give mlx-lm's plain
    greedy tokens (the short-convolution state rolls back by replay)."""
    target, drafter, _ = lfm2
    pipe = outrider.load(str(target), str(drafter))
    assert (pipe.mode, pipe.target.family.name) == ("dspark", "short_conv")
    prompts = [pipe.encode(PROMPT), pipe.encode("Rollback must be exact.")]
    want = [plain_greedy(target, ids, 32) for ids in prompts]
    for cap in (1, 3, 5):
        got = pipe.generate(prompts[0], max_tokens=32, max_draft=cap, stop_tokens=set())
        assert got.tokens == want[0], f"cap {cap}"
    assert any(r.accepted < len(r.drafted) for r in got.rounds)  # rounds that rolled back
    batch = pipe.generate_batch(prompts, max_tokens=32, stop_tokens=set())
    assert [r.tokens for r in batch] == want


@pytest.mark.parametrize(
    "change,reason",
    [
        (lambda c: c["dflash_config"].pop("mask_token_id"), "no dflash_config.mask_token_id"),
        (lambda c: c["dflash_config"].pop("target_layer_ids"), "dflash_config.target_layer_ids"),
        (lambda c: c["dflash_config"].update(target_layer_ids=[0, 9]), "outside the target's"),
        (lambda c: c.update(rope_is_neox_style="no"), "rope_is_neox_style must be true or false"),
        (lambda c: c.update(markov_head_type="lstm"), "unknown markov_head_type 'lstm'"),
        (lambda c: c.update(block_size=0), "block_size must be >= 1"),
    ],
)
def test_a_broken_config_is_refused_by_name(lfm2, tmp_path, change, reason):
    with pytest.raises(CheckpointError, match=reason):
        load_drafter(Plugins(load_entrypoints=False), edited(lfm2[1], tmp_path / "d", change))


def test_a_drafter_for_another_vocabulary_is_refused(lfm2, tmp_path):
    """The drafter reads and writes the target's ids through its tied embedding: a drafter made
    for another vocabulary is refused at load, not run."""
    target, drafter, _ = lfm2
    path = edited(drafter, tmp_path / "d", lambda c: c.update(vocab_size=c["vocab_size"] + 8))
    with pytest.raises(OutriderError, match="vocabulary"):
        outrider.load(str(target), path, mode="dspark")


def test_convert_refuses_the_interleaved_rope(lfm2, tmp_path):
    """DeepSpec's layout ropes by halves and has no field for interleaved pairs: `outrider
    convert` says so instead of writing a drafter that would draft wrong."""
    from outrider.convert.deepspec import deepspec_checkpoint

    target, drafter, neox = lfm2
    spec = load_drafter(Plugins(load_entrypoints=False), str(drafter))
    with pytest.raises(OutriderError, match="interleaved rope"):
        deepspec_checkpoint(spec, target)
    config, tensors, _ = deepspec_checkpoint(
        load_drafter(Plugins(load_entrypoints=False), str(neox)), target
    )
    assert config["architectures"] == ["Qwen3DSparkModel"]
    assert tensors["embed_tokens.weight"].shape == (spec.vocab_size, spec.hidden_size)
    assert mx.array_equal(tensors["embed_tokens.weight"], tensors["lm_head.weight"]).item()
