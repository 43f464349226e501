"""DFlash 2: detection and translation, the dynamic convolution and the selector walk against
direct computations, refusal of damaged checkpoints, and losslessness (greedy and sampled)."""

from __future__ import annotations

import json
import shutil
import struct

import mlx.core as mx
import numpy as np
import pytest
from conftest import PROMPTS, plain_greedy
from sampling_check import assert_follows_target

import outrider
from outrider.api import load_drafter
from outrider.core.drafter_spec import DrafterSpec
from outrider.core.errors import CheckpointError
from outrider.core.plugins import Plugins
from outrider.core.sampling import SamplingParams
from outrider.plugins.formats.zlab import ZLabFormat
from outrider.plugins.strategies.dflash2 import top_candidates, walk
from outrider.plugins.strategies.dflash2_drafter import (
    CandidateSelector,
    DFlash2Attention,
    GroupedDynamicCausalConv,
    WindowContextCache,
)
from outrider.plugins.strategies.draft_context import ContextCache, visibility
from outrider.registry import Pair
from outrider.testing import make_tiny_drafter

FIXTURE_DFLASH_KEYS = {  # z-lab/dflash tests/fixtures/dflash2-config.json, dflash_config
    "block_size",
    "conv_group_size",
    "conv_kernel_size",
    "final_logit_softcapping",
    "mask_token_id",
    "output_multiplier",
    "selector_rank",
    "selector_top_k",
    "target_layer_ids",
}


@pytest.fixture(scope="module")
def plugins():
    return Plugins(load_entrypoints=False)


@pytest.fixture(scope="module")
def dflash2_drafter(models_dir, qwen3_target):
    return make_tiny_drafter(models_dir / "dflash2", qwen3_target, "dflash2", "zlab")


@pytest.fixture(scope="module")
def pipe(qwen3_target, dflash2_drafter):
    return outrider.load(str(qwen3_target), str(dflash2_drafter), mode="dflash2")


def safetensors_header(path) -> dict:
    raw = (path / "model.safetensors").read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n])


def damaged(src, dst, config=None, tensors=None):
    shutil.copytree(src, dst)
    if config is not None:
        cfg = json.loads((dst / "config.json").read_text())
        config(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    if tensors is not None:
        t = dict(mx.load(str(dst / "model.safetensors")))
        tensors(t)
        mx.save_safetensors(str(dst / "model.safetensors"), t)
    return dst


# ---- packaging --------------------------------------------------------------------------------


def test_written_like_the_published_checkpoint_and_detected(plugins, dflash2_drafter):
    cfg = json.loads((dflash2_drafter / "config.json").read_text())
    assert cfg["architectures"] == ["DFlash2DraftModel"] and cfg["is_causal"] is False
    assert set(cfg["dflash_config"]) == FIXTURE_DFLASH_KEYS
    assert set(cfg["layer_types"]) == {"sliding_attention"}
    header = safetensors_header(dflash2_drafter)
    assert "candidate_selector.predecessor_codebook" in header  # no .weight, as published
    assert "candidate_selector.successor_codebook" in header
    assert header["layers.0.attention_conv.base_kernel"]["shape"] == [2, 2, 64]
    assert header["layers.1.mlp_conv.kernel_projection.weight"]["shape"] == [2 * 2 * 4, 64]
    assert {v["dtype"] for k, v in header.items() if k != "__metadata__"} == {"BF16"}
    assert not any("embed" in k or "lm_head" in k for k in header)
    assert not ZLabFormat().detect(cfg)  # z-lab's DFlash 1 format leaves it to dflash2

    spec = load_drafter(plugins, str(dflash2_drafter))
    assert (spec.format, spec.kind, spec.logits_start, spec.max_draft) == (
        "dflash2",
        "dflash2",
        1,
        8,
    )
    assert not spec.own_embedding and not spec.own_lm_head
    assert (spec.conv_kernel_size, spec.conv_group_size) == (2, 16)
    assert (spec.selector_rank, spec.selector_top_k) == (16, 16)
    assert (spec.output_multiplier, spec.final_logit_softcapping) == (0.5, 20.0)
    assert spec.layer_types == ("sliding_attention",) * 2 and spec.sliding_window == 16
    assert spec.extra["is_causal"] is False


def test_auto_mode_runs_dflash2(qwen3_target, dflash2_drafter):
    assert outrider.load(str(qwen3_target), str(dflash2_drafter)).mode == "dflash2"
    # A registry row whose mode is dflash2 (and no --drafter) runs it too.
    row = Pair("tiny", str(qwen3_target), "dense", "dflash2", {"dflash2": str(dflash2_drafter)})
    pipe = outrider.load(str(qwen3_target), mode="auto", registry=[row])
    assert pipe.mode == "dflash2" and pipe.drafter.kind == "dflash2"


def _cfg(**changes):
    def edit(cfg):
        for key, value in changes.items():
            if value is None:
                cfg["dflash_config"].pop(key, None)
            else:
                cfg["dflash_config"][key] = value

    return edit


DAMAGE = [
    (
        "missing codebook",
        None,
        lambda t: t.pop("candidate_selector.successor_codebook"),
        "missing tensor candidate_selector.successor_codebook",
    ),
    (
        "wrong conv shape",
        None,
        lambda t: t.update({"layers.1.mlp_conv.base_kernel": mx.zeros((2, 3, 64))}),
        r"layers.1.mlp_conv.base_kernel has shape \(2, 3, 64\), expected \(2, 2, 64\)",
    ),
    (
        "wrong kernel projection",
        None,
        lambda t: t.update({"layers.0.attention_conv.kernel_projection.weight": mx.zeros((8, 64))}),
        r"kernel_projection.weight has shape \(8, 64\)",
    ),
    (
        "codebook rank",
        None,
        lambda t: t.update({"candidate_selector.predecessor_codebook": mx.zeros((262, 8))}),
        r"predecessor_codebook has shape \(262, 8\)",
    ),
    ("top_k over vocab", _cfg(selector_top_k=300), None, "selector_top_k 300 exceeds"),
    ("group does not divide", _cfg(conv_group_size=24), None, "conv_group_size 24 does not divide"),
    ("no selector rank", _cfg(selector_rank=None), None, "lacks dflash_config.selector_rank"),
    ("zero kernel", _cfg(conv_kernel_size=0), None, "conv_kernel_size must be >= 1"),
    ("text softcap", _cfg(final_logit_softcapping="20"), None, "must be a number"),
    (
        "unknown layer type",
        lambda c: c.update(layer_types=["chunked", "sliding_attention"]),
        None,
        "unknown layer type 'chunked'",
    ),
]


@pytest.mark.parametrize("what,config,tensors,reason", DAMAGE, ids=[d[0] for d in DAMAGE])
def test_damaged_checkpoint_is_refused_with_one_line(
    plugins, dflash2_drafter, tmp_path, what, config, tensors, reason
):
    ck = damaged(dflash2_drafter, tmp_path / "d", config, tensors)
    with pytest.raises(CheckpointError, match=reason) as err:
        load_drafter(plugins, str(ck))
    assert "\n" not in str(err.value)


def test_truncated_weights_are_refused(plugins, dflash2_drafter, tmp_path):
    ck = damaged(dflash2_drafter, tmp_path / "d")
    f = ck / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-1000])
    with pytest.raises(CheckpointError, match="not a readable safetensors file") as err:
        load_drafter(plugins, str(ck))
    assert "\n" not in str(err.value)


def test_codebooks_saved_with_weight_suffix_are_read(plugins, dflash2_drafter, tmp_path):
    def rename(t):
        for name in ("predecessor_codebook", "successor_codebook"):
            t[f"candidate_selector.{name}.weight"] = t.pop(f"candidate_selector.{name}")

    spec = load_drafter(plugins, str(damaged(dflash2_drafter, tmp_path / "d", tensors=rename)))
    assert "candidate_selector.successor_codebook" in spec.weights
    assert "candidate_selector.successor_codebook.weight" not in spec.weights


def test_missing_backbone_tensor_is_refused_at_load(qwen3_target, dflash2_drafter, tmp_path):
    ck = damaged(
        dflash2_drafter, tmp_path / "d", tensors=lambda t: t.pop("layers.0.mlp.up_proj.weight")
    )
    with pytest.raises(CheckpointError, match="missing tensor layers.0.mlp.up_proj.weight"):
        outrider.load(str(qwen3_target), str(ck), mode="dflash2")


# ---- the pieces against direct computations ---------------------------------------------------


def test_conv_is_causal_within_the_block_and_slot0_reads_zero_padding():
    mx.random.seed(0)
    h, k, g, n = 32, 2, 8, 6
    conv = GroupedDynamicCausalConv(h, k, g)
    conv.base_kernel = mx.random.normal((2, k, h))
    conv.kernel_projection.weight = 0.3 * mx.random.normal((2 * k * h // g, h))
    x = mx.random.normal((1, n, h))
    y, dyn_out = conv.prepare(x)
    # direct: y_t[c] = sum_o (base[0, o, c] + D[t, 0, o, c // g]) * x_{t-o}[c], zero before row 0
    xn = np.array(x[0])
    d = np.array(conv.kernel_projection(x)[0]).reshape(n, 2, k, h // g)
    base = np.array(conv.base_kernel)
    want = np.zeros((n, h))
    for t in range(n):
        for o in range(k):
            if t - o >= 0:
                want[t] += (base[0, o] + np.repeat(d[t, 0, o], g)) * xn[t - o]
    np.testing.assert_allclose(np.array(y[0]), want, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.array(dyn_out[0]), d[:, 1], rtol=1e-5, atol=1e-5)
    # slot 0 sees only itself; a change at row t reaches rows t..t+k-1 only
    for t in range(n):
        bumped = x.at[0, t].add(1.0)
        changed = np.abs(np.array(conv.prepare(bumped)[0][0] - y[0])).max(axis=-1) > 1e-6
        assert changed.tolist() == [t <= r < t + k for r in range(n)]
    z = conv.finish(x, dyn_out)
    want_first = (base[1, 0] + np.repeat(d[0, 1, 0], g)) * xn[0]
    np.testing.assert_allclose(np.array(z[0, 0]), want_first, rtol=1e-4, atol=1e-4)


def _selector(v=40, h=24, r=8, top_k=6) -> CandidateSelector:
    spec = DrafterSpec(
        format="t", kind="dflash2", hidden_size=h, num_layers=1, num_heads=2, num_kv_heads=1,
        head_dim=8, intermediate_size=16, vocab_size=v, rms_norm_eps=1e-6, rope_theta=1e4,
        block_size=5, logits_start=1, mask_token_id=v - 1, target_layer_ids=(0,),
        selector_rank=r, selector_top_k=top_k,
    )  # fmt: skip
    sel = CandidateSelector(spec)
    mx.random.seed(3)
    sel.predecessor_codebook = mx.random.normal((v, r))
    sel.successor_codebook = mx.random.normal((v, r))
    sel.hidden_projection.weight = mx.random.normal((r, h))
    return sel


def _numpy_scores(sel, hidden, logits, prev, t, top_k):
    cand = np.argsort(-logits[t], kind="stable")[:top_k]
    ph = np.array(sel.hidden_projection.weight) @ hidden[t]
    a = np.array(sel.predecessor_codebook)[prev]
    s = np.array(sel.successor_codebook)[cand]
    return cand, logits[t, cand] + s @ (a * ph)


def test_selector_walk_matches_numpy():
    sel = _selector()
    mx.random.seed(4)
    hidden, logits = mx.random.normal((4, 24)), 3 * mx.random.normal((4, 40))
    unary, cands = top_candidates(logits, sel.top_k)
    hn, ln = np.array(hidden), np.array(logits)
    for t in range(4):  # each slot's top-k, in descending order of logit
        assert set(np.array(cands[t]).tolist()) == set(np.argsort(-ln[t])[: sel.top_k].tolist())
        assert (np.diff(np.array(unary[t])) <= 0).all()
    tokens, q = walk(sel, hidden, unary, cands, anchor=7)
    assert q is None
    prev = 7
    for t, tok in enumerate(np.array(tokens).tolist()):
        cand, scores = _numpy_scores(sel, hn, ln, prev, t, sel.top_k)
        assert tok == int(cand[np.argmax(scores)])
        prev = tok
    # sampled: each q row is softmax(score / T) over the slot's candidates, given the drawn path
    temp = 0.7
    tokens, q = walk(sel, hidden, unary, cands, anchor=7, temperature=temp, key=mx.random.key(1))
    prev = 7
    for t, tok in enumerate(np.array(tokens).tolist()):
        cand, scores = _numpy_scores(sel, hn, ln, prev, t, sel.top_k)
        e = np.exp((scores - scores.max()) / temp)
        want = dict(zip(cand.tolist(), (e / e.sum()).tolist()))
        got = dict(zip(np.array(cands[t]).tolist(), np.array(q[t]).tolist()))
        assert got == pytest.approx(want, abs=1e-5)
        assert tok in want
        prev = tok


def test_sliding_layer_keeps_window_rows_and_masks_by_position():
    ok = np.array(visibility(mx.arange(5, 7), mx.arange(0, 7), causal=False, window=3))
    # queries at 5, 6; keys 0..6: |q - k| < 3
    assert ok.tolist() == [[abs(q - k) < 3 for k in range(7)] for q in (5, 6)]
    ok = np.array(visibility(mx.arange(5, 7), mx.arange(0, 7), causal=True, window=None))
    assert ok.tolist() == [[k <= q for k in range(7)] for q in (5, 6)]

    spec = DrafterSpec(
        format="t", kind="dflash2", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
        head_dim=16, intermediate_size=16, vocab_size=10, rms_norm_eps=1e-6, rope_theta=1e4,
        block_size=3, logits_start=1, mask_token_id=9, target_layer_ids=(0,),
        sliding_window=4, extra={"is_causal": False},
    )  # fmt: skip
    mx.random.seed(5)
    attn = DFlash2Attention(spec, "sliding_attention")
    assert (attn.causal, attn.window) == (False, 4)  # is_causal: false, as published
    # without is_causal, sliding layers are causal and full ones bidirectional (z-lab's rule)
    spec.extra = {"is_causal": None}
    assert DFlash2Attention(spec, "sliding_attention").causal
    assert not DFlash2Attention(spec, "full_attention").causal
    assert DFlash2Attention(spec, "full_attention").window is None
    windowed, full = WindowContextCache(4), ContextCache()
    for rows in (2, 3, 1, 4):  # context arrives a round at a time; only 3 rows stay kept
        ctx, block = mx.random.normal((1, rows, 32)), mx.random.normal((1, 3, 32))
        a, b = attn(block, ctx, windowed), attn(block, ctx, full)
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-5, atol=1e-5)
        assert windowed.fetch()[0].shape[2] == min(3, full.offset)
        assert windowed.offset == full.offset


def test_per_round_drafts_do_not_depend_on_the_cap(pipe):
    ids = pipe.encode(PROMPTS[1])
    first = {
        cap: pipe.generate(ids, max_tokens=12, max_draft=cap, stop_tokens=set()).rounds[0].drafted
        for cap in (3, 8)
    }
    assert first[8][:3] == first[3] and len(first[8]) == 8
    assert len(set(first[8])) > 1  # random weights still draft more than one token


def test_sampled_proposal_q_is_the_selectors_distribution(pipe):
    from outrider.core.proposer import DraftContext

    ids = pipe.encode(PROMPTS[0])
    proposer = pipe.proposer
    _, taps = pipe.target.forward(
        mx.array(ids[:-1]), pipe.target.make_cache(), proposer.tap_layer_ids
    )
    proposer.start(ids, taps)
    params = SamplingParams(temperature=0.9)
    prop = proposer.propose(DraftContext(ids, 5, params, mx.random.key(2)))
    q = np.array(prop.probs)
    assert q.shape == (5, 262)
    np.testing.assert_allclose(q.sum(axis=-1), 1.0, rtol=1e-5)
    assert ((q > 0).sum(axis=-1) <= 16).all()  # supported on the selector's top-k candidates
    assert all(q[i, tok] > 0 for i, tok in enumerate(np.array(prop.tokens).tolist()))


# ---- losslessness -----------------------------------------------------------------------------


def test_greedy_matches_plain_greedy(pipe, qwen3_target):
    ids = pipe.encode(PROMPTS[0])
    want = plain_greedy(qwen3_target, ids, 30)
    got = pipe.generate(ids, max_tokens=30, max_draft=8, stop_tokens=set())
    assert got.tokens == want
    assert max(len(r.drafted) for r in got.rounds) == 8


@pytest.fixture(scope="module")
def references(pipe, qwen3_target):
    """(prompt ids, plain greedy continuation) per prompt, computed once for every cap."""
    out = []
    for prompt, n in zip(PROMPTS, (24, 57, 90)):
        ids = pipe.encode(prompt)
        out.append((ids, plain_greedy(qwen3_target, ids, n)))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("cap", [1, 2, 3, 4, 5, 6, 7, 8])
def test_greedy_matches_plain_greedy_every_cap(pipe, references, cap):
    for i, (ids, want) in enumerate(references):
        got = pipe.generate(ids, max_tokens=len(want), max_draft=cap, stop_tokens=set())
        assert got.tokens == want, f"cap {cap} prompt {i}"
        assert max(len(r.drafted) for r in got.rounds) == cap
        assert all(len(r.drafted) <= cap for r in got.rounds)


@pytest.mark.slow
def test_sampled_output_follows_the_target_distribution(pipe):
    depth, n = 3, 400
    prompt = [30 + 7 * i % 200 for i in range(12)]
    drafted, accepted = assert_follows_target(pipe, prompt, depth, n)
    assert 0 < accepted < drafted  # both acceptance and rejection were exercised (~2% accepted)
