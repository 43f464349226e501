"""`outrider train --kind eagle3`: the training-time-test chain is the inference chain, a trained
EAGLE-3 drafter is accepted far more often than its init, and it reloads through the EAGLE-3
format plugin and decodes losslessly. Tiny fp32 models, CPU, short runs."""

from __future__ import annotations

import json

import mlx.core as mx
import numpy as np
import pytest
from conftest import plain_greedy, toy_train_config

import outrider
from outrider.api import load_drafter
from outrider.core.device import on_cuda_gpu
from outrider.core.errors import OutriderError
from outrider.core.plugins import Plugins
from outrider.plugins.strategies.eagle3_drafter import load_eagle3_drafter
from outrider.testing import make_tiny_drafter
from outrider.train import train_drafter
from outrider.train.ttt import chain_anchors, chain_forward, check_chain_forward

# float32 here; MLX's CUDA backend runs float32 matmuls in TF32 (~1e-3 relative)
BOUND = 1e-2 if on_cuda_gpu() else 1e-5


@pytest.fixture(scope="module")
def eagle3_run(toy):
    out = toy["root"] / "eagle3"
    events: list[dict] = []
    # batches of 4 windows of 64 (the toy config's are 8 of 96) cost half as much: measured
    # 1.03 -> 3.58 (8 of 96: 4.23), well past what the assertions below ask
    config = toy_train_config(toy, out, kind="eagle3", batch_size=4, seq_len=64)
    report = train_drafter(config, on_event=events.append)
    return out, report, events


def _drafter(path, **extra):
    spec = load_drafter(Plugins(load_entrypoints=False), str(path))
    spec.extra.update(extra)
    model = load_eagle3_drafter(spec, bits=16)
    model.set_dtype(mx.float32)
    return model


@pytest.mark.parametrize(
    "layer, extra",
    [
        ("qwen3", {}),
        ("llama", {}),  # no q/k norms
        ("qwen3", {"norm_before_residual": True, "norm_feedback": True}),
    ],
)
def test_the_ttt_chain_is_the_inference_chain(tmp_path, qwen3_target, layer, extra):
    """Every step of the batched training chain, from every sampled row, equals the cached
    inference chain (`Eagle3Drafter.step`, as the proposer runs it) fed the same tokens."""
    path = make_tiny_drafter(tmp_path / "d", qwen3_target, "eagle3", "speculators", layer=layer)
    model = _drafter(path, **extra)
    assert check_chain_forward(model, depth=4, seq_len=16) < BOUND
    # and the chains of different rows differ (the check compares something)
    mx.random.seed(1)
    taps = mx.random.normal((1, 16, len(model.spec.target_layer_ids) * model.spec.hidden_size))
    ids = mx.random.randint(0, model.spec.vocab_size, (1, 16)).astype(mx.uint32)
    out = chain_forward(model, ids, taps, mx.array([[3, 9]]), 2)
    assert not mx.allclose(out[1][0, 0], out[1][0, 1], atol=1e-3)


def test_chain_rows_need_their_first_two_predictions_supervised():
    mask = np.zeros((1, 12), dtype=bool)
    mask[0, 5:9] = True  # rows 4..6 predict token 5 or 6 from 6 or 7 on: rows 4, 5, 6
    anchors, keep = chain_anchors(mask, 5, np.random.default_rng(0))
    assert set(anchors[0][keep[0]]) == {4, 5, 6}


@pytest.mark.slow  # an EAGLE-3 training run: the full suite's
def test_trained_eagle3_beats_its_untrained_init_and_decodes_losslessly(toy, eagle3_run, tmp_path):
    out, report, events = eagle3_run
    # the real loop on held-out prompts (depth 5, the chain drafts 7)
    assert report.accept_trained >= report.accept_init + 1.5, (report.init, report.trained)
    assert report.lossless
    steps = [e for e in events if e["event"] == "step"]
    assert steps[-1]["loss"] < steps[0]["loss"] and steps[-1]["tau"] > steps[0]["tau"]
    spec = load_drafter(Plugins(load_entrypoints=False), str(out))
    assert (spec.format, spec.kind, spec.num_layers, spec.ttt_length) == (
        "deepspec",
        "eagle3",
        1,
        5,
    )
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3Eagle3Model"]
    target_weights = mx.load(str(toy["target"] / "model.safetensors"))
    assert mx.array_equal(spec.weights["lm_head.weight"], target_weights["lm_head.weight"])
    for bits in (16, 4):  # as `outrider generate --drafter OUT` loads it (4-bit by default)
        pipe = outrider.load(str(toy["target"]), str(out), "auto", drafter_bits=bits)
        assert pipe.mode == "eagle3"
        ids = pipe.encode("sun tree code")
        result = pipe.generate(ids, max_tokens=24)
        assert result.tokens == plain_greedy(toy["target"], ids, 24)
        if bits == 16:
            assert result.mean_accept_len > 2.5
    # --init fine-tunes it: the starting point is the trained drafter itself
    tuned = train_drafter(
        toy_train_config(toy, tmp_path / "tuned", kind="eagle3", init=str(out), steps=2)
    )
    assert tuned.init == report.trained
    with pytest.raises(OutriderError, match="is a eagle3 drafter, not dspark"):
        train_drafter(toy_train_config(toy, tmp_path / "x", kind="dspark", init=str(out)))


def test_eagle3_has_one_layer(toy, tmp_path):
    with pytest.raises(OutriderError, match="one layer"):
        toy_train_config(toy, tmp_path / "x", kind="eagle3", layers=2).check()
    with pytest.raises(OutriderError, match="dspark, dflash or eagle3"):
        toy_train_config(toy, tmp_path / "x", kind="medusa").check()
