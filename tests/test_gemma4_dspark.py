"""DeepSpec's Gemma4DSparkModel: written as DeepSpec saves it, detected, translated, run
losslessly on Gemma-4 targets (mlx-lm gemma4_text and the mlx-vlm gemma4 language tower), its
forward checked against a direct computation of DeepSpec's definition, damage refused."""

from __future__ import annotations

import json
import shutil

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from conftest import PROMPTS, plain_greedy

import outrider
from outrider.api import load_drafter
from outrider.core.device import on_cuda_gpu
from outrider.core.errors import CheckpointError
from outrider.core.plugins import Plugins
from outrider.plugins.formats.deepspec import DeepSpecFormat
from outrider.plugins.strategies.block_drafter import load_block_drafter
from outrider.plugins.strategies.gemma4_block_drafter import (
    Gemma4BlockDrafter,
    ScaledQuantizedEmbedding,
    SoftcappedQuantizedHead,
)
from outrider.testing import make_tiny_drafter, make_tiny_target

N_TOKENS = 24  # three times the tiny targets' sliding window


@pytest.fixture(scope="module")
def plugins():
    return Plugins(load_entrypoints=False)


@pytest.fixture(scope="module")
def gemma4(models_dir):
    """Targets and drafters: name -> (target, drafter)."""
    d = models_dir / "g4ds"
    text = make_tiny_target(d / "text", family="gemma4_text")
    vlm = make_tiny_target(d / "vlm", family="gemma4", seed=2)
    return {
        "text": (text, make_tiny_drafter(d / "text-dspark", text, "dspark", block_size=8)),
        "vlm": (vlm, make_tiny_drafter(d / "vlm-dspark", vlm, "dspark", block_size=8)),
        "text-kv": (
            text,
            make_tiny_drafter(
                d / "text-kv",
                text,
                "dspark",
                attention_k_eq_v=True,
                num_global_key_value_heads=2,  # the target has 1 KV head: a mix-up shows
                markov_type="rnn",
            ),
        ),
        "text-dflash": (text, make_tiny_drafter(d / "text-dflash", text, "dflash", block_size=8)),
    }


def read(path) -> tuple[dict, dict]:
    return json.loads((path / "config.json").read_text()), mx.load(str(path / "model.safetensors"))


# ---- layout, detection, translation -----------------------------------------------------------


def test_written_like_deepspec_saves_it(gemma4):
    cfg, tensors = read(gemma4["text"][1])
    assert cfg["architectures"] == ["Gemma4DSparkModel"]
    assert (cfg["model_type"], cfg["target_model_type"], cfg["target_text_model_type"]) == (
        "gemma4_text",
        "gemma4",
        "gemma4_text",
    )
    assert cfg["tie_word_embeddings"] is False
    assert (
        cfg["layer_types"]
        == ["full_attention"] * cfg["num_hidden_layers"]
        == ["full_attention"] * 2
    )
    assert (cfg["head_dim"], cfg["global_head_dim"], cfg["num_target_layers"]) == (16, 32, 4)
    # the fields build_draft_config requires of the target's text config are all there
    for key in ("num_global_key_value_heads", "attention_k_eq_v", "enable_moe_block",
                "hidden_activation", "hidden_size_per_layer_input", "num_kv_shared_layers",
                "use_double_wide_mlp", "rope_parameters", "attention_dropout"):  # fmt: skip
        assert key in cfg, key
    assert cfg["rope_parameters"]["full_attention"]["rope_type"] == "proportional"
    assert cfg["rope_parameters"]["rope_theta"] == 10000.0  # the target's stray top-level theta
    layer0 = {k.removeprefix("layers.0.") for k in tensors if k.startswith("layers.0.")}
    assert layer0 == {
        "input_layernorm.weight",
        "post_attention_layernorm.weight",
        "pre_feedforward_layernorm.weight",
        "post_feedforward_layernorm.weight",
        "layer_scalar",
        "self_attn.q_proj.weight",
        "self_attn.k_proj.weight",
        "self_attn.v_proj.weight",
        "self_attn.o_proj.weight",
        "self_attn.q_norm.weight",
        "self_attn.k_norm.weight",
        "mlp.gate_proj.weight",
        "mlp.up_proj.weight",
        "mlp.down_proj.weight",
    }
    assert tensors["layers.0.self_attn.q_proj.weight"].shape == (4 * 32, 64)
    assert tensors["layers.0.self_attn.k_proj.weight"].shape == (1 * 32, 64)
    assert tensors["layers.1.layer_scalar"].tolist() == [1.0]
    assert {t.dtype for t in tensors.values()} == {mx.bfloat16}
    assert {"embed_tokens.weight", "lm_head.weight", "fc.weight", "hidden_norm.weight"} <= set(
        tensors
    )
    kv_cfg, kv_tensors = read(gemma4["text-kv"][1])
    assert kv_cfg["attention_k_eq_v"] is True and kv_cfg["num_global_key_value_heads"] == 2
    assert kv_tensors["layers.0.self_attn.k_proj.weight"].shape == (2 * 32, 64)
    assert not any("v_proj" in k or "v_norm" in k for k in kv_tensors)
    # the multimodal target's drafter copies its text_config alone
    vlm_cfg, _ = read(gemma4["vlm"][1])
    assert "vision_config" not in vlm_cfg and "image_token_id" not in vlm_cfg


def test_detected_and_translated(plugins, gemma4):
    assert "Gemma4DSparkModel" in DeepSpecFormat.architectures
    spec = load_drafter(plugins, str(gemma4["text"][1]))
    assert (spec.format, spec.kind, spec.backbone, spec.logits_start) == (
        "deepspec",
        "dspark",
        "gemma4",
        0,
    )
    assert (spec.head_dim, spec.num_heads, spec.num_kv_heads) == (32, 4, 1)
    assert spec.rope_theta == 1_000_000.0  # full_attention's, not the stray top-level 10000
    assert spec.rope_scaling["partial_rotary_factor"] == 0.25
    assert spec.final_logit_softcapping == 30.0
    assert spec.extra["attention_k_eq_v"] is False
    assert spec.layer_types == ("full_attention",) * 2
    assert spec.own_embedding and spec.own_lm_head
    kv = load_drafter(plugins, str(gemma4["text-kv"][1]))
    assert kv.extra["attention_k_eq_v"] is True and kv.markov_type == "rnn"
    assert kv.num_kv_heads == 2
    assert load_drafter(plugins, str(gemma4["text-dflash"][1])).kind == "dflash"
    # the text fields nested under text_config translate alike
    cfg, _ = read(gemma4["text"][1])
    drafter = {k: v for k, v in cfg.items() if k in ("architectures", "block_size")}
    nested = DeepSpecFormat().translate(
        _Ckpt({**drafter, **_drafter_fields(cfg), "text_config": cfg})
    )
    assert (nested.head_dim, nested.rope_theta, nested.backbone) == (32, 1e6, "gemma4")


class _Ckpt:
    def __init__(self, config):
        self.config, self.tensors = config, {}


def _drafter_fields(cfg):
    keys = ("mask_token_id", "target_layer_ids", "num_target_layers", "markov_rank",
            "markov_head_type", "enable_confidence_head", "confidence_head_with_markov")  # fmt: skip
    return {k: cfg[k] for k in keys}


# ---- the forward against DeepSpec's definition -------------------------------------------------


def _rms(x, w=None, eps=1e-6):
    y = x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)
    return y if w is None else y * w


def _rope(x, pos, theta, partial):
    """transformers' proportional RoPE: rotate_half pairs (i, i + hd/2), the first
    partial*hd/2 frequencies rotate, the rest are zero."""
    hd = x.shape[-1]
    n = int(partial * hd // 2)
    inv = np.concatenate([1.0 / theta ** (np.arange(0, 2 * n, 2) / hd), np.zeros(hd // 2 - n)])
    emb = np.concatenate([pos[:, None] * inv] * 2, axis=-1)
    rot = np.concatenate([-x[..., hd // 2 :], x[..., : hd // 2]], axis=-1)
    return x * np.cos(emb) + rot * np.sin(emb)


def deepspec_logits(w: dict, spec, taps: np.ndarray, block_ids: list[int]) -> np.ndarray:
    """Gemma4DSparkModel._forward_backbone + compute_logits, written out in numpy."""
    hsz, nh, nkv, hd = spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim
    eps, k_eq_v = spec.rms_norm_eps, spec.extra["attention_k_eq_v"]
    theta, partial = spec.rope_theta, spec.rope_scaling["partial_rotary_factor"]
    ctx = _rms(taps @ w["fc.weight"].T, w["hidden_norm.weight"], eps)
    h = w["embed_tokens.weight"][block_ids] * np.sqrt(hsz)
    s, b = len(ctx), len(block_ids)
    pos = np.arange(s + b, dtype=np.float64)
    for i in range(spec.num_layers):

        def p(name: str, i: int = i) -> np.ndarray:
            return w[f"layers.{i}.{name}"]

        u = _rms(h, p("input_layernorm.weight"), eps)
        q = _rms(
            (u @ p("self_attn.q_proj.weight").T).reshape(b, nh, hd),
            p("self_attn.q_norm.weight"),
            eps,
        )
        x = np.concatenate([ctx, u])
        k_raw = (x @ p("self_attn.k_proj.weight").T).reshape(s + b, nkv, hd)
        v_raw = k_raw if k_eq_v else (x @ p("self_attn.v_proj.weight").T).reshape(s + b, nkv, hd)
        k = _rms(k_raw, p("self_attn.k_norm.weight"), eps).transpose(1, 0, 2)
        v = _rms(v_raw, None, eps).transpose(1, 0, 2)
        q = _rope(q.transpose(1, 0, 2), pos[s:], theta, partial)
        k = np.repeat(_rope(k, pos, theta, partial), nh // nkv, axis=0)
        v = np.repeat(v, nh // nkv, axis=0)
        scores = q @ k.transpose(0, 2, 1) * 1.0  # Gemma-4: scaling 1.0, no mask at inference
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        attn = (probs @ v).transpose(1, 0, 2).reshape(b, nh * hd) @ p("self_attn.o_proj.weight").T
        h = h + _rms(attn, p("post_attention_layernorm.weight"), eps)
        f = _rms(h, p("pre_feedforward_layernorm.weight"), eps)
        g = f @ p("mlp.gate_proj.weight").T
        g = 0.5 * g * (1 + np.tanh(np.sqrt(2 / np.pi) * (g + 0.044715 * g**3)))
        m = (g * (f @ p("mlp.up_proj.weight").T)) @ p("mlp.down_proj.weight").T
        h = (h + _rms(m, p("post_feedforward_layernorm.weight"), eps)) * p("layer_scalar")
    logits = _rms(h, w["norm.weight"], eps) @ w["lm_head.weight"].T
    cap = spec.final_logit_softcapping
    return cap * np.tanh(logits / cap)


@pytest.mark.parametrize("name", ["text", "text-kv"])
def test_forward_follows_deepspec_definition(plugins, gemma4, name):
    spec = load_drafter(plugins, str(gemma4[name][1]))
    rng = np.random.default_rng(0)
    for i in range(spec.num_layers):  # a trained-looking scalar, so skipping it would show
        spec.weights[f"layers.{i}.layer_scalar"] = mx.array([0.5 + i])
    spec.weights = {k: v.astype(mx.float32) for k, v in spec.weights.items()}
    ref_weights = {k: np.array(v, dtype=np.float64) for k, v in spec.weights.items()}
    model = load_block_drafter(spec, bits=16)
    assert isinstance(model, Gemma4BlockDrafter)
    taps = rng.normal(size=(7, len(spec.target_layer_ids) * spec.hidden_size)) * 2
    block_ids = [17, *[spec.mask_token_id] * (spec.block_size - 1)]
    cache = model.make_cache()
    # the context arrives in two rounds (the cache path), with a block drafted in between
    model.backbone(model.embed_tokens(mx.array(block_ids))[None], mx.array(taps[:4]), cache)
    hidden = model.backbone(
        model.embed_tokens(mx.array(block_ids))[None], mx.array(taps[4:]), cache
    )
    got = np.array(model.logits(hidden), dtype=np.float64)
    want = deepspec_logits(ref_weights, spec, taps, block_ids)
    assert np.abs(want).max() > 1.0  # not a degenerate comparison
    np.testing.assert_allclose(got, want, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("cuda", [False, True], ids=["here", "cuda-forced"])
def test_quantised_network_keeps_scale_and_softcap(plugins, gemma4, monkeypatch, cuda):
    """The quantised embedding keeps its scale and the head its soft cap. On a CUDA GPU (here,
    or forced) the tiny drafter's 64-wide layers, one quantization group wide, stay unquantized
    (MLX computes their products wrongly there: core/device.py), keeping their own classes; a
    wider layer is quantised all the same. The values hold either way."""
    from outrider.plugins.strategies import drafter_weights

    if cuda:
        monkeypatch.setattr(drafter_weights, "on_cuda_gpu", lambda: True)
    spec = load_drafter(plugins, str(gemma4["text"][1]))
    raw_embed = np.array(spec.weights["embed_tokens.weight"].astype(mx.float32))
    model = load_block_drafter(spec, bits=8)
    quantized = not (cuda or on_cuda_gpu())
    assert isinstance(model.embed_tokens, ScaledQuantizedEmbedding) == quantized
    assert isinstance(model.lm_head, SoftcappedQuantizedHead) == quantized
    assert isinstance(model.fc, nn.QuantizedLinear)  # 192 wide: three groups
    rows = np.array(model.embed_tokens(mx.array([3, 9])).astype(mx.float32))
    np.testing.assert_allclose(rows, raw_embed[[3, 9]] * 8.0, atol=0.05 * np.abs(rows).max())
    logits = model.lm_head(mx.ones((1, spec.hidden_size)) * 40.0)
    assert float(mx.abs(logits).max()) <= 30.0 + 1e-4


# ---- lossless on both Gemma-4 target families ----------------------------------------------------


def _check_greedy(target, drafter, mode, caps, n=N_TOKENS, prompts=PROMPTS[:1]):
    pipe = outrider.load(str(target), str(drafter), mode=mode)
    assert type(pipe.proposer.drafter) is Gemma4BlockDrafter
    for prompt in prompts:
        ids = pipe.encode(prompt)
        want = plain_greedy(target, ids, n)
        for cap in caps:
            got = pipe.generate(ids, max_tokens=n, max_draft=cap, stop_tokens=set())
            assert got.tokens == want, f"{mode} cap {cap} diverged from plain greedy"
            assert max(len(r.drafted) for r in got.rounds) == min(cap, pipe.proposer.max_draft)


@pytest.mark.parametrize("name,caps", [("text", (1, 3, 8)), ("vlm", (4,))])
def test_greedy_matches_plain(gemma4, name, caps):
    _check_greedy(*gemma4[name], "dspark", caps)


@pytest.mark.slow
@pytest.mark.parametrize("name,mode", [("text", "dspark"), ("vlm", "dspark"),
                                       ("text-kv", "dspark"), ("text-dflash", "dflash")])  # fmt: skip
def test_greedy_matches_plain_every_cap(gemma4, name, mode):
    _check_greedy(*gemma4[name], mode, range(1, 9), n=32)


@pytest.mark.slow
def test_sampled_follows_target_distribution(gemma4):
    from sampling_check import assert_follows_target

    target, drafter = gemma4["text"]
    pipe = outrider.load(str(target), str(drafter), mode="dspark")
    prompt, depth, n = [30 + 7 * i % 200 for i in range(12)], 3, 200
    drafted, _ = assert_follows_target(pipe, prompt, depth, n)
    assert drafted > 0


# ---- damage is refused with one line -----------------------------------------------------------


def _damaged(src, dst, config=None, tensors=None):
    shutil.copytree(src, dst)
    if config:
        cfg = json.loads((dst / "config.json").read_text())
        config(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    if tensors:
        t = dict(mx.load(str(dst / "model.safetensors")))
        tensors(t)
        mx.save_safetensors(str(dst / "model.safetensors"), t)
    return dst


def _refusal(exc) -> str:
    msg = str(exc.value)
    assert "\n" not in msg
    return msg


def test_damaged_weights_refused(gemma4, tmp_path):
    target, src = gemma4["text"]
    cases = {
        "missing": (
            lambda t: t.pop("layers.1.layer_scalar"),
            "missing tensor layers.1.layer_scalar",
        ),
        "shape": (
            lambda t: t.update({"layers.0.self_attn.q_norm.weight": mx.ones((16,))}),
            "layers.0.self_attn.q_norm.weight has shape (16,)",
        ),
        "v_proj": (  # a k_eq_v drafter must not carry V projections
            lambda t: t.update({"layers.0.self_attn.v_proj.weight": mx.zeros((32, 64))}),
            "unexpected tensor layers.0.self_attn.v_proj.weight",
        ),
    }
    for name, (edit, reason) in cases.items():
        base = gemma4["text-kv"][1] if name == "v_proj" else src
        bad = _damaged(base, tmp_path / name, tensors=edit)
        with pytest.raises(CheckpointError) as e:
            outrider.load(str(target), str(bad), mode="dspark")
        assert reason in _refusal(e), _refusal(e)


@pytest.mark.parametrize(
    "edit,reason",
    [
        (lambda c: c.update(enable_moe_block=True), "MoE blocks"),
        (lambda c: c.update(hidden_size_per_layer_input=256), "per-layer inputs"),
        (lambda c: c.update(attention_k_eq_v=True), "lacks num_global_key_value_heads"),
        (lambda c: c.pop("global_head_dim"), "'global_head_dim'"),
        (lambda c: c["rope_parameters"].pop("full_attention"), "rope_parameters.full_attention"),
        (lambda c: c.update(final_logit_softcapping=-1.0), "final_logit_softcapping"),
        (lambda c: c.update(hidden_activation="relu"), "activation 'relu'"),
    ],
)
def test_bad_gemma4_config_refused(plugins, gemma4, tmp_path, edit, reason):
    bad = _damaged(gemma4["text"][1], tmp_path / "bad", config=edit)
    with pytest.raises(CheckpointError) as e:
        load_drafter(plugins, str(bad))
    assert reason in _refusal(e)
