"""The qwen3_5-native DSpark fork (Ornith's `Qwen35DSparkModel` with
`enable_qwen35_gated_q_proj`) over a Qwen3.5 target: gated queries laid out per head, partial
rotary, norms stored as offsets from one. Read as published, attending as Qwen3.5 defines it,
lossless, refused by name where broken."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from checkpoint_edits import edited
from conftest import plain_greedy
from draft_layers import attention_spec

import outrider
from outrider.api import load_drafter
from outrider.core.batch import fork
from outrider.core.drafter_spec import DrafterSpec
from outrider.core.errors import CheckpointError, OutriderError
from outrider.core.loop import prefill
from outrider.core.plugins import Plugins
from outrider.core.proposer import DraftContext
from outrider.core.sampling import SamplingParams
from outrider.plugins.strategies.block_drafter import DraftAttention
from outrider.plugins.strategies.draft_context import ContextCache
from outrider.testing import make_tiny_drafter, make_tiny_target

PROMPT = "def fibonacci(n): return fibonacci(n - 1) + fibonacci(n - 2) if n > 1 else n"


@pytest.fixture(scope="module")
def ornith(tmp_path_factory):
    d = tmp_path_factory.mktemp("ornith")
    target = make_tiny_target(d / "t", family="qwen3_5")
    return target, make_tiny_drafter(d / "d", target, "dspark", "ornith")


def read(path) -> DrafterSpec:
    return load_drafter(Plugins(load_entrypoints=False), str(path))


def test_the_fork_is_read_as_published(ornith):
    target, drafter = ornith
    cfg = json.loads((drafter / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen35DSparkModel"] and cfg["model_type"] == "qwen3_5"
    spec = read(drafter)
    assert (spec.format, spec.kind, spec.logits_start, spec.block_size) == (
        "deepspec",
        "dspark",
        0,
        7,
    )
    assert spec.gated_q and spec.rope_dims == spec.head_dim // 4  # partial_rotary_factor 0.25
    assert spec.rope_scaling is None  # the copied mrope sections are the target's, ignored
    raw = mx.load(str(drafter / "model.safetensors"))
    norms = [n for n in raw if n.endswith("norm.weight")]
    assert {"hidden_norm.weight", "norm.weight", "layers.0.self_attn.q_norm.weight"} <= set(norms)
    for name in norms:  # stored as offsets from one; the network reads (1 + stored)
        assert mx.array_equal(spec.weights[name], raw[name] + 1)
    assert (
        spec.weights["layers.0.self_attn.q_proj.weight"].shape[0]
        == 2 * spec.num_heads * spec.head_dim
    )


def test_confidence_temperatures_calibrate_each_slot(ornith, tmp_path):
    """Slot j's estimate is sigmoid(logit / T_j): the same head with its temperatures taken out
    estimates sigmoid(logit), so the two estimates' logits differ by exactly T_j per slot."""
    target, drafter = ornith
    assert read(drafter).confidence_temperatures == (1.5, 0.9, 1.5, 1.6, 0.9, 1.4, 1.6)
    bare = edited(drafter, tmp_path / "d", lambda cfg: cfg.pop("confidence_temperatures"))
    logits = []
    for path in (drafter, bare):
        pipe = outrider.load(str(target), str(path), mode="dspark", lookup_drafts=False)
        ids, greedy = pipe.encode(PROMPT), SamplingParams()
        proposer = fork(pipe.proposer)
        started = prefill(pipe.target, proposer, ids, greedy, None, [], 0, None)
        ctx = DraftContext([*ids, started.first.item()], 7, greedy, extras={"confidence": True})
        c = np.array(proposer.propose(ctx).confidence)
        logits.append(np.log(c / (1 - c)))
    temps = np.array(read(drafter).confidence_temperatures)
    np.testing.assert_allclose(logits[0] * temps, logits[1], rtol=1e-4, atol=1e-4)
    assert not np.allclose(logits[0], logits[1], rtol=1e-2, atol=1e-2)


def test_gated_attention_is_qwen35s():
    """Each head's q_proj rows are [q ‖ gate]: the output is o_proj(sigmoid(gate) * attention
    of the q half), the attention that of an ungated head whose q_proj is those q rows; rope
    turns only the first rope_dims of each head."""
    mx.random.seed(7)
    gated = DraftAttention(attention_spec(rope_dims=4, gated_q=True))
    plain = DraftAttention(attention_spec(rope_dims=4))
    rows = gated.q_proj.weight.reshape(4, 2, 8, 32)  # [head, q | gate, head_dim, hidden]
    plain.update({k: v for k, v in gated.parameters().items() if k != "q_proj"})
    plain.q_proj.weight = rows[:, 0].reshape(32, 32)
    context, block = mx.random.normal((1, 6, 32)), mx.random.normal((1, 4, 32))
    got = gated(block, context, ContextCache())

    captured = {}
    plain.o_proj = lambda out: captured.setdefault("out", out)  # the attention before o_proj
    plain(block, context, ContextCache())
    gate = block @ rows[:, 1].reshape(32, 32).T  # [1, 4 slots, heads · head_dim]
    want = gated.o_proj(captured["out"] * mx.sigmoid(gate))
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-6)

    x = mx.random.normal((1, 4, 3, 8))
    turned = gated.rope(x, offset=5)
    assert mx.array_equal(turned[..., 4:], x[..., 4:])
    assert not mx.allclose(turned[..., :4], x[..., :4])


def test_dspark_over_qwen35_equals_plain_greedy(ornith):
    """Auto mode drafts with the fork's head; every cap and a batch of two give mlx-lm's plain
    greedy tokens (the gated-delta state rolls back by replay)."""
    target, drafter = ornith
    pipe = outrider.load(str(target), str(drafter))
    assert (pipe.mode, pipe.target.family.name) == ("dspark", "gated_delta")
    prompts = [pipe.encode(PROMPT), pipe.encode("Offsets from one, gates per head.")]
    want = [plain_greedy(target, ids, 24) for ids in prompts]
    for cap in (1, 4, 7):
        got = pipe.generate(prompts[0], max_tokens=24, max_draft=cap, stop_tokens=set())
        assert got.tokens == want[0], f"cap {cap}"
    batch = pipe.generate_batch(prompts, max_tokens=24, stop_tokens=set())
    assert [r.tokens for r in batch] == want


@pytest.mark.parametrize(
    "change,reason",
    [
        ({"partial_rotary_factor": 0, "rope_parameters": {}}, "must be in \\(0, 1\\]"),
        ({"rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.1}}, "even number"),
        ({"enable_qwen35_gated_q_proj": "yes"}, "must be true or false"),
        ({"confidence_temperatures": [1.0] * 6}, "has 6 values; this head drafts 7"),
        ({"confidence_temperatures": [1.0] * 6 + [0]}, "list of positive numbers"),
        ({"confidence_temperatures": "1.5"}, "list of positive numbers"),
    ],
)
def test_a_broken_config_is_refused_by_name(ornith, tmp_path, change, reason):
    with pytest.raises(CheckpointError, match=reason):
        read(edited(ornith[1], tmp_path / "d", lambda cfg: cfg.update(change)))


def test_the_fork_without_its_flag_is_refused_at_load(ornith, tmp_path):
    """Without `enable_qwen35_gated_q_proj` the doubled q_proj cannot be a plain head's: the
    load names the tensor, instead of drafting from half of it."""
    path = edited(ornith[1], tmp_path / "d", lambda cfg: cfg.pop("enable_qwen35_gated_q_proj"))
    with pytest.raises(OutriderError, match="q_proj.weight has shape"):
        outrider.load(str(ornith[0]), path, mode="dspark")


def test_convert_refuses_the_fork(ornith):
    from outrider.convert.deepspec import deepspec_checkpoint

    target, drafter = ornith
    with pytest.raises(OutriderError, match="qwen3_5-native fork"):
        deepspec_checkpoint(read(drafter), target)


def test_a_stock_heads_temperatures_survive_convert(drafters, tmp_path):
    """A DeepSpec-stock head may ship them too; `outrider convert` writes them back."""
    from outrider.convert.deepspec import deepspec_checkpoint

    temps = [1.25, 2.0, 0.5, 1.0, 1.5, 3.0, 0.75, 1.0]  # the fixture's head drafts 8
    path = edited(
        drafters["dspark"], tmp_path / "d", lambda c: c.update(confidence_temperatures=temps)
    )
    spec = read(path)
    assert not spec.gated_q and spec.confidence_temperatures == tuple(temps)
    config, _, _ = deepspec_checkpoint(spec)
    assert config["confidence_temperatures"] == temps
