"""NVIDIA's DSpark packaging (its Nemotron-3.5-Lightning head) over a Mamba-2 hybrid target:
DeepSpec's layout with the DFlash lineage's block attention (bonus-token anchor, causal block,
sliding window, per-head sinks), quantised by modelopt to NVFP4. Read as published, decoded
exactly, attending as defined, lossless, refused by name where broken."""

from __future__ import annotations

import copy
import json
import shutil
import struct

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
from outrider.core.errors import CheckpointError
from outrider.core.plugins import Plugins
from outrider.plugins.strategies.block_drafter import DraftAttention
from outrider.plugins.strategies.draft_context import ContextCache
from outrider.testing import make_tiny_drafter, make_tiny_target

PROMPT = "def fibonacci(n): return fibonacci(n - 1) + fibonacci(n - 2) if n > 1 else n"
WINDOW = 8  # tokens: every prompt here is longer, so the window bites from the first round


@pytest.fixture(scope="module")
def nemotron(tmp_path_factory):
    """(a nemotron_h target, its DSpark head as NVIDIA ships it, the same head in float)."""
    d = tmp_path_factory.mktemp("nemotron")
    target = make_tiny_target(d / "t", family="nemotron_h")
    head = make_tiny_drafter(d / "nvfp4", target, "dspark", "nvidia", window=WINDOW)
    flat = make_tiny_drafter(d / "bf16", target, "dspark", "nvidia", window=WINDOW, nvfp4=False)
    return target, head, flat


def read(path) -> DrafterSpec:
    return load_drafter(Plugins(load_entrypoints=False), str(path))


def header(path) -> dict:
    raw = (path / "model.safetensors").read_bytes()
    (size,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + size])


def test_the_packaging_is_read_as_published(nemotron):
    target, head, flat = nemotron
    cfg = json.loads((head / "config.json").read_text())
    assert "enable_confidence_head" not in cfg and "mask_token_id" not in cfg  # as NVIDIA's
    assert header(head)["fc.weight_scale"]["dtype"] == "F8_E4M3"  # as modelopt writes it
    spec = read(head)
    assert (spec.format, spec.kind, spec.block_size, spec.logits_start) == (
        "deepspec",
        "dspark",
        8,
        1,
    )
    assert spec.max_draft == 7  # the anchor is the bonus token; slots 1.. draft
    assert spec.causal_block and spec.attention_sinks
    assert spec.sliding_window == WINDOW and set(spec.layer_types) == {"sliding_attention"}
    assert spec.mask_token_id == cfg["dflash_config"]["mask_token_id"]
    assert spec.own_embedding and not spec.own_lm_head  # the target's output head
    # no config field for it: the tensors say there is a confidence head reading the Markov one
    assert spec.confidence_head and spec.confidence_with_markov and spec.markov_rank > 0
    assert not any(n.endswith(("_scale", "_scale_2")) for n in spec.weights)


E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def e4m3(byte: int) -> float:
    """FP8 E4M3 (OCP "fn": no infinities) by its definition."""
    sign = -1.0 if byte & 0x80 else 1.0
    exp, man = (byte >> 3) & 0xF, byte & 0x7
    if exp == 0:
        return sign * man / 8 * 2.0**-6
    return sign * (1 + man / 8) * 2.0 ** (exp - 7)


def test_nvfp4_decodes_as_modelopt_defines_it(nemotron):
    """Each quantised weight equals E2M1(code) * E4M3(block scale) * tensor scale, decoded
    here from the raw bytes by the formats' definitions, the lower nibble first."""
    target, head, flat = nemotron
    raw = mx.load(str(head / "model.safetensors"))
    spec = read(head)
    names = [n[: -len(".weight_scale_2")] for n in raw if n.endswith(".weight_scale_2")]
    assert {"fc", "layers.0.mlp.down_proj", "markov_head.markov_w2"} <= set(names)
    for stem in names:
        codes = np.array(raw[f"{stem}.weight"])
        nibbles = np.stack([codes & 0xF, codes >> 4], axis=-1).reshape(codes.shape[0], -1)
        scales = np.vectorize(e4m3)(np.array(raw[f"{stem}.weight_scale"])).astype(np.float32)
        want = E2M1[nibbles] * np.repeat(scales, 16, axis=1) * float(raw[f"{stem}.weight_scale_2"])
        got = spec.weights[f"{stem}.weight"]
        assert got.dtype == mx.bfloat16  # the checkpoint's float type
        np.testing.assert_array_equal(np.array(got.astype(mx.float32)), np.array(
            mx.array(want).astype(mx.bfloat16).astype(mx.float32)))  # fmt: skip
    # and the packed head holds what the float one does, to NVFP4's precision
    w = read(flat).weights["fc.weight"].astype(mx.float32)
    err = mx.abs(spec.weights["fc.weight"].astype(mx.float32) - w).max().item()
    assert 0 < err < 0.2 * mx.abs(w).max().item()


def reference_attention(q, k, v, scale, allowed, sinks) -> mx.array:
    """softmax over the visible keys and one sink logit a head, by the definition."""
    scores = (q @ k.swapaxes(-1, -2)) * scale  # [1, heads, n, keys] (k, v tiled to heads)
    scores = mx.where(allowed, scores, -mx.inf)
    sink = mx.broadcast_to(sinks[None, :, None, None], scores.shape[:-1] + (1,))
    weights = mx.softmax(mx.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1]
    return weights @ v


@pytest.mark.parametrize(
    "causal,window,sinks", [(True, 5, True), (False, 5, False), (True, None, True)]
)
def test_block_attention_is_what_the_head_defines(causal, window, sinks):
    """A block query at position p sees a key at position k when p - k < window, and, in a
    causal block, k <= p; each head adds its sink logit to the softmax's denominator."""
    spec = attention_spec(
        logits_start=1, sliding_window=window, causal_block=causal, attention_sinks=sinks
    )
    mx.random.seed(3)
    attn = DraftAttention(spec, "sliding_attention" if window else "full_attention")
    if sinks:
        attn.attention_sink_bias = mx.random.normal((4,))
    context, block = mx.random.normal((1, 9, 32)), mx.random.normal((1, 4, 32))
    got = attn(block, context, ContextCache())

    ck, cv = attn._kv(context, 0)
    bk, bv = attn._kv(block, 9)
    q = attn.rope(
        attn.q_norm(attn.q_proj(block).reshape(1, 4, 4, -1)).transpose(0, 2, 1, 3), offset=9
    )
    k = mx.repeat(mx.concatenate([ck, bk], axis=2), 2, axis=1)
    v = mx.repeat(mx.concatenate([cv, bv], axis=2), 2, axis=1)
    p, key = np.arange(9, 13)[:, None], np.arange(13)[None, :]
    allowed = np.ones((4, 13), bool)
    if window:
        allowed &= (p - key < window) & (key - p < window)
    if causal:
        allowed &= key <= p
    sink = attn.attention_sink_bias if sinks else mx.full((4,), -mx.inf)
    out = reference_attention(q, k, v, attn.scale, mx.array(allowed), sink)
    want = attn.o_proj(out.transpose(0, 2, 1, 3).reshape(1, 4, -1))
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-5)


def test_dspark_over_nemotron_equals_plain_greedy(nemotron):
    """Every cap, and a batch of two, give mlx-lm's plain greedy tokens (the Mamba-2 state
    rolls back by replay); the NVFP4 head and its float twin alike."""
    target, head, flat = nemotron
    pipe = outrider.load(str(target), str(head))
    assert (pipe.mode, pipe.target.family.name) == ("dspark", "nemotron_h")
    prompts = [pipe.encode(PROMPT), pipe.encode("Rollback must be exact, window or not.")]
    assert min(len(p) for p in prompts) > WINDOW
    want = [plain_greedy(target, ids, 24) for ids in prompts]
    for cap in (1, 4, 7):
        got = pipe.generate(prompts[0], max_tokens=24, max_draft=cap, stop_tokens=set())
        assert got.tokens == want[0], f"cap {cap}"
    assert any(r.accepted < len(r.drafted) for r in got.rounds)  # rounds that rolled back
    batch = pipe.generate_batch(prompts, max_tokens=24, stop_tokens=set())
    assert [r.tokens for r in batch] == want
    twin = outrider.load(str(target), str(flat))
    assert twin.generate(prompts[1], max_tokens=24, stop_tokens=set()).tokens == want[1]


@pytest.mark.parametrize(
    "change,reason",
    [
        (lambda c: c["dflash_config"].pop("swa_window_size"), "'swa_window_size'"),
        (lambda c: c["dflash_config"].update(swa_window_size=1), "swa_window_size must be >= 2"),
        (lambda c: c["dflash_config"].update(causal="yes"), "'causal' must be true or false"),
        (lambda c: c.update(sample_from_anchor=True), "contradict each other"),
        (lambda c: c["quantization_config"].update(quant_algo="FP8"), "modelopt FP8"),
    ],
)
def test_a_broken_config_is_refused_by_name(nemotron, tmp_path, change, reason):
    with pytest.raises(CheckpointError, match=reason):
        read(edited(nemotron[1], tmp_path / "d", change))


@pytest.mark.parametrize(
    "damage,reason",
    [
        (lambda t: t.pop("fc.weight_scale_2"), "fc.weight_scale has no fc.weight_scale_2"),
        (lambda t: t.update({"fc.weight_scale": t["fc.weight_scale"][:, 1:]}), "expected"),
        (lambda t: t.pop("layers.0.self_attn.attention_sink_bias"), "missing tensor"),
    ],
)
def test_damaged_tensors_are_refused_by_name(nemotron, tmp_path, damage, reason):
    target, head, _ = nemotron
    tensors = mx.load(str(head / "model.safetensors"))
    damage(tensors)
    (tmp_path / "d").mkdir()
    shutil.copy(head / "config.json", tmp_path / "d" / "config.json")
    mx.save_safetensors(str(tmp_path / "d" / "model.safetensors"), tensors)
    with pytest.raises(CheckpointError, match=reason):
        outrider.load(str(target), str(tmp_path / "d"), mode="dspark")


def test_convert_refuses_what_deepspec_cannot_say(nemotron, tmp_path):
    """DeepSpec's layout is bidirectional, full-attention and sinkless: `outrider convert`
    names what it cannot write instead of writing a drafter that would draft otherwise."""
    from outrider.convert.deepspec import deepspec_checkpoint
    from outrider.core.errors import OutriderError

    target, head, _ = nemotron
    with pytest.raises(OutriderError, match="sliding-window"):
        deepspec_checkpoint(read(head), target)
    unwindowed = make_tiny_drafter(tmp_path / "d", target, "dspark", "nvidia", window=None)
    spec = read(unwindowed)
    assert spec.sliding_window is None and not spec.layer_types and spec.causal_block
    with pytest.raises(OutriderError, match="causal block / attention sinks"):
        deepspec_checkpoint(spec, target)


def test_a_causal_block_runs_only_the_slots_a_round_reads(nemotron):
    """A slot of a causal block sees only the slots before it, so a round at cap k runs the
    anchor and k masks, not the whole block, and drafts exactly what the whole block drafts."""
    from outrider.core.proposer import DraftContext
    from outrider.core.sampling import SamplingParams

    target, head, _ = nemotron
    pipe = outrider.load(
        str(target), str(head), mode="dspark", lookup_drafts=False, confidence_threshold=1e-9
    )
    proposer = pipe.proposer
    assert proposer._truncates
    dims = len(proposer.spec.target_layer_ids) * proposer.spec.hidden_size
    taps = mx.random.normal((20, dims), key=mx.random.key(5))
    widths, full = [], copy.copy(proposer)
    full._truncates = False
    drafter = proposer.drafter
    run = drafter.backbone_rows
    drafter.backbone_rows = lambda block, *a: widths.append(block.shape[1]) or run(block, *a)
    # On the CPU a row's products do not depend on how many rows share them. On a GPU a block
    # of 2 and one of 8 rows run the head's quantized layers through different kernels (MLX's
    # CUDA backend: a matrix-vector kernel below 8 rows, a tiled one from 8), which round apart:
    # 1.3e-3 of a confidence on the H200 (docs/testing-on-gpu.md, run 13)
    tol = {"atol": 1e-5} if mx.default_device() == mx.cpu else {"atol": 1e-5, "rtol": 5e-3}
    try:
        for cap in (1, 3, 7):
            short, whole = fork(proposer), fork(full)
            for p in (short, whole):
                p.start([1], taps)
            ctx = DraftContext([5, 9], cap, SamplingParams())
            a, b = short.propose(ctx), whole.propose(ctx)
            assert a.tokens.tolist() == b.tokens.tolist()
            np.testing.assert_allclose(np.array(a.confidence), np.array(b.confidence), **tol)
    finally:
        del drafter.backbone_rows
    assert widths == [2, 8, 4, 8, 8, 8]  # anchor + cap masks, against the whole block of 8


def test_the_markov_rank_reads_under_vllms_name_too(nemotron, tmp_path):
    """NVIDIA's config states the rank twice; `dspark_markov_rank` (vLLM's name) alone will do."""
    head = nemotron[1]
    rank = read(head).markov_rank
    path = edited(head, tmp_path / "d", lambda cfg: cfg.pop("markov_rank"))
    assert rank > 0 and read(path).markov_rank == rank


def test_sinks_stored_in_another_float_type_still_run():
    """MLX wants sinks in the attention's output type: float32 sinks in a bfloat16 head (a
    checkpoint may keep them so) are cast, not refused."""
    spec = attention_spec(logits_start=1, attention_sinks=True)
    attn = DraftAttention(spec)
    attn.set_dtype(mx.bfloat16)
    attn.attention_sink_bias = mx.ones((4,), dtype=mx.float32)
    block, context = (mx.random.normal(s).astype(mx.bfloat16) for s in ((1, 4, 32), (1, 6, 32)))
    out = attn(block, context, ContextCache())
    assert out.dtype == mx.bfloat16 and bool(mx.all(mx.isfinite(out)))


def test_a_block_wider_than_its_window_drafts_with_no_context_yet():
    """The window is by position: with no context row yet, a block of 8 under a window of 4
    sees the block's own nearby slots (both ways: the layer is not causal)."""
    from outrider.plugins.strategies.draft_context import ContextRows, visibility

    spec = attention_spec(
        block_size=8, logits_start=1, sliding_window=4, layer_types=("sliding_attention",)
    )
    attn = DraftAttention(spec, "sliding_attention")
    rows = ContextRows(1, positions=True)
    rows.add(None, 0)
    rows.begin([0], 8, [0])
    mask = rows.layers[0].mask(8, 8, False, 4)
    out = attn(mx.random.normal((1, 8, 32)), None, rows.layers[0])
    rows.end()
    want = visibility(mx.arange(8), mx.arange(8), False, 4)
    assert mask[0, 0].tolist() == want.tolist() and bool(mx.all(mx.isfinite(out)))
