"""vLLM speculators' DSpark / DFlash packaging, reduced draft vocabularies, and drafters that
use the target's embedding and head: detected, lossless, refused by name when damaged."""

from __future__ import annotations

import json
import re

import mlx.core as mx
import pytest
from checkpoint_edits import copy_ckpt, edit_config, edit_tensors
from conftest import PROMPTS, plain_greedy
from sampling_check import PARAMS, assert_follows_target

import outrider
from outrider.api import load_drafter
from outrider.core.errors import CheckpointError, OutriderError
from outrider.core.plugins import Plugins
from outrider.core.proposer import DraftContext
from outrider.core.sampling import SamplingParams
from outrider.testing import make_tiny_drafter, make_tiny_target

REDUCED = 200  # of the tiny target's 262 ids


@pytest.fixture(scope="module")
def plugins():
    return Plugins(load_entrypoints=False)


@pytest.fixture(scope="module")
def spec_drafters(tmp_path_factory, qwen3_target):
    """Blocks large enough for caps up to 8 whichever slots draft."""
    d = tmp_path_factory.mktemp("speculators")
    t = qwen3_target
    return {
        "dspark": make_tiny_drafter(d / "dspark", t, "dspark", "speculators", block_size=8),
        "dspark-reduced": make_tiny_drafter(
            d / "dspark-reduced", t, "dspark", "speculators", block_size=8, draft_vocab_size=REDUCED
        ),
        "dspark-mask-slots-shared": make_tiny_drafter(
            d / "dspark-ms",
            t,
            "dspark",
            "speculators",
            block_size=9,
            sample_from_anchor=False,
            share_target_head=True,
            draft_vocab_size=150,
            markov_type="rnn",
            architecture="DSparkDraftModel",
        ),
        "dflash": make_tiny_drafter(d / "dflash", t, "dflash", "speculators", block_size=9),
        "dflash-anchor-reduced": make_tiny_drafter(
            d / "dflash-ar",
            t,
            "dflash",
            "speculators",
            block_size=8,
            sample_from_anchor=True,
            draft_vocab_size=REDUCED,
        ),
        "deepspec-shared": make_tiny_drafter(
            d / "deepspec-shared", t, "dspark", "deepspec", block_size=8, share_target_head=True
        ),
        "specforge-dspark": make_tiny_drafter(
            d / "specforge-dspark", t, "dspark", "specforge", block_size=9, markov_type="gated"
        ),
    }


MODES = {
    "dspark": "dspark",
    "dspark-reduced": "dspark",
    "dspark-mask-slots-shared": "dspark",
    "dflash": "dflash",
    "dflash-anchor-reduced": "dflash",
    "deepspec-shared": "dspark",
    "specforge-dspark": "dspark",
}


@pytest.fixture(scope="module")
def pipelines(qwen3_target, spec_drafters):
    return {
        name: outrider.load(str(qwen3_target), str(spec_drafters[name]), mode=MODES[name])
        for name in MODES
    }


# ---- layout and detection -----------------------------------------------------------------


def test_writer_lays_out_what_speculators_saves(spec_drafters):
    cfg = json.loads((spec_drafters["dspark-reduced"] / "config.json").read_text())
    assert cfg["architectures"] == ["DSparkSpeculator"]
    assert cfg["speculators_model_type"] == "dspark" and cfg["sample_from_anchor"] is True
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 8
    assert cfg["transformer_layer_config"]["num_hidden_layers"] == 2
    tensors = mx.load(str(spec_drafters["dspark-reduced"] / "model.safetensors"))
    assert tensors["d2t"].dtype == mx.int64 and tensors["d2t"].shape == (REDUCED,)
    assert tensors["t2d"].dtype == mx.bool_ and tensors["t2d"].shape == (262,)
    assert tensors["lm_head.weight"].shape == (REDUCED, 64)
    assert tensors["embed_tokens.weight"].shape == (262, 64)
    assert tensors["markov_head.markov_w1.weight"].shape[0] == 262  # indexed by target ids
    assert tensors["markov_head.markov_w2.weight"].shape[0] == REDUCED  # writes draft ids
    assert tensors["fc.weight"].dtype == mx.bfloat16
    shared = mx.load(str(spec_drafters["dspark-mask-slots-shared"] / "model.safetensors"))
    assert "embed_tokens.weight" not in shared and "lm_head.weight" not in shared


@pytest.mark.parametrize(
    "name,fmt,kind,start,vocab,own",
    [
        ("dspark", "speculators", "dspark", 0, None, True),
        ("dspark-reduced", "speculators", "dspark", 0, REDUCED, True),
        ("dspark-mask-slots-shared", "speculators", "dspark", 1, 150, False),
        ("dflash", "speculators", "dflash", 1, None, True),
        ("dflash-anchor-reduced", "speculators", "dflash", 0, REDUCED, True),
        ("deepspec-shared", "deepspec", "dspark", 0, None, False),
        ("specforge-dspark", "specforge-dspark", "dspark", 0, None, False),  # slot 0 drafts
    ],
)
def test_detection_and_translation(plugins, spec_drafters, name, fmt, kind, start, vocab, own):
    spec = load_drafter(plugins, str(spec_drafters[name]))
    assert (spec.format, spec.kind, spec.logits_start) == (fmt, kind, start)
    assert spec.draft_vocab_size == vocab
    assert spec.own_embedding == own and spec.own_lm_head == own
    cfg = json.loads((spec_drafters[name] / "config.json").read_text())
    if fmt == "speculators":  # aux ids index HF hidden_states: one more than DeepSpec's taps
        assert [j + 1 for j in spec.target_layer_ids] == cfg["aux_hidden_state_layer_ids"]


def test_speculative_tokens_decides_the_slots_without_sample_from_anchor(
    plugins, spec_drafters, tmp_path
):
    ck = copy_ckpt(spec_drafters["dflash"], tmp_path / "d")
    cfg = json.loads((ck / "config.json").read_text())
    del cfg["sample_from_anchor"]
    cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] = 9
    (ck / "config.json").write_text(json.dumps(cfg))
    assert load_drafter(plugins, str(ck)).logits_start == 0
    cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] = 5
    (ck / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="speculative_tokens 5 does not fit block_size 9"):
        load_drafter(plugins, str(ck))


def test_eagle3_speculators_are_left_to_the_eagle3_format(spec_drafters):
    from outrider.plugins.formats.speculators import SpeculatorsFormat
    from outrider.plugins.formats.zlab import ZLabFormat

    cfg = json.loads((spec_drafters["dflash"] / "config.json").read_text())
    assert SpeculatorsFormat().detect(cfg) and not ZLabFormat().detect(cfg)
    assert not SpeculatorsFormat().detect({**cfg, "speculators_model_type": "eagle3"})


# ---- lossless -----------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(MODES))
def test_greedy_matches_plain(pipelines, qwen3_target, name):
    pipe = pipelines[name]
    ids = pipe.encode(PROMPTS[1])
    want = plain_greedy(qwen3_target, ids, 24)
    got = pipe.generate(ids, max_tokens=24, max_draft=8, stop_tokens=set())
    assert got.tokens == want
    assert max(len(r.drafted) for r in got.rounds) == 8


# Every cap for each slot convention and head (anchor / mask slots, reduced / shared, the three
# Markov heads); the rest at the extremes.
EVERY_CAP = ["dspark-reduced", "dspark-mask-slots-shared", "dflash", "specforge-dspark"]
CAPS = [(n, c) for n in EVERY_CAP for c in range(1, 9)] + [
    (n, c) for n in MODES if n not in EVERY_CAP for c in (1, 8)
]


@pytest.mark.slow
@pytest.mark.parametrize("name,cap", CAPS)
def test_every_cap_matches_plain(pipelines, qwen3_target, name, cap):
    pipe = pipelines[name]
    ids = pipe.encode(PROMPTS[0])
    got = pipe.generate(ids, max_tokens=33, max_draft=cap, stop_tokens=set())
    assert got.tokens == plain_greedy(qwen3_target, ids, 33), f"{name} cap {cap}"
    assert max(len(r.drafted) for r in got.rounds) == cap


@pytest.mark.parametrize("name", ["dspark-reduced", "dflash-anchor-reduced"])
def test_reduced_head_drafts_only_its_ids_and_q_is_zero_elsewhere(pipelines, name):
    pipe = pipelines[name]
    prop, target = pipe.proposer, pipe.target
    allowed = set(prop.vocab.target_ids.tolist())
    assert len(allowed) == REDUCED
    ids = pipe.encode(PROMPTS[0])
    target.install_taps(prop.tap_layer_ids)
    _, taps = target.prefill(ids, target.make_cache(), prop.tap_layer_ids)
    for greedy in (True, False):
        prop.start(ids, taps)
        params = SamplingParams() if greedy else PARAMS
        ctx = DraftContext(ids + [ids[-1]], 6, params, mx.random.key(3))
        proposal = prop.propose(ctx)
        drafted = proposal.tokens.tolist()
        assert len(drafted) == 6 and set(drafted) <= allowed
        if not greedy:
            q = proposal.probs
            assert q.shape == (6, 262)
            outside = [i for i in range(262) if i not in allowed]
            assert mx.all(q[:, mx.array(outside)] == 0).item()
            assert mx.allclose(q.sum(axis=-1), mx.ones(6), atol=1e-5).item()
            assert all(q[i, t].item() > 0 for i, t in enumerate(drafted))


@pytest.mark.slow  # the sequential head: each draft's q also depends on the draft before it
def test_sampling_with_reduced_vocabulary_follows_the_target(pipelines):
    pipe = pipelines["dspark-reduced"]
    depth, n = 3, 600
    prompt = [30 + 7 * i % 200 for i in range(12)]
    drafted, accepted = assert_follows_target(pipe, prompt, depth, n)
    assert 0 < accepted < drafted  # both acceptance and rejection were exercised


# ---- one network, two packagings ----------------------------------------------------------


def as_bf16(path):
    """Store a checkpoint's float tensors in bf16, as speculators does."""
    edit_tensors(
        path,
        lambda t: t.update(
            {k: v.astype(mx.bfloat16) for k, v in t.items() if mx.issubdtype(v.dtype, mx.floating)}
        ),
    )


@pytest.mark.parametrize(
    "kind,other,options",
    [
        ("dspark", "deepspec", {"block_size": 8}),  # anchor slot drafts in both
        ("dflash", "zlab", {"block_size": 9}),  # anchor slot discarded, the target's head
        ("dspark", "specforge", {"block_size": 9, "sample_from_anchor": True}),  # slot 0 drafts
    ],
)
def test_same_weights_in_two_packagings_draft_the_same(
    qwen3_target, tmp_path, kind, other, options
):
    shared = {"share_target_head": True} if other in ("zlab", "specforge") else {}
    ref_options = {k: v for k, v in options.items() if k != "sample_from_anchor"}
    ref = make_tiny_drafter(tmp_path / "ref", qwen3_target, kind, other, seed=4, **ref_options)
    as_bf16(ref)
    spc = make_tiny_drafter(
        tmp_path / "spc", qwen3_target, kind, "speculators", seed=4, **options, **shared
    )
    runs = []
    for path in (ref, spc):
        pipe = outrider.load(str(qwen3_target), str(path), mode=kind)
        ids = pipe.encode(PROMPTS[2])
        runs.append(pipe.generate(ids, max_tokens=20, max_draft=8, stop_tokens=set()))
    ref_run, spc_run = runs
    assert ref_run.tokens == spc_run.tokens
    assert len(ref_run.rounds) == len(spc_run.rounds) > 1
    assert len(ref_run.rounds[0].drafted) == 8
    assert [r.drafted for r in ref_run.rounds] == [r.drafted for r in spc_run.rounds]


# ---- refusals -------------------------------------------------------------------------------


def refusal(fn) -> str:
    with pytest.raises((CheckpointError, OutriderError)) as err:
        fn()
    message = str(err.value)
    assert "\n" not in message  # one line naming the reason
    return message


@pytest.mark.parametrize(
    "damage,reason",
    [
        (lambda t: t.pop("layers.0.mlp.up_proj.weight"), "missing tensor layers.0.mlp.up_proj"),
        (
            lambda t: t.update({"lm_head.weight": mx.zeros((REDUCED + 1, 64), mx.bfloat16)}),
            r"lm_head.weight has shape \(201, 64\)",
        ),
        (lambda t: t.pop("d2t"), "no d2t table"),
        (
            lambda t: t.update({"d2t": t["d2t"] + 1000}),
            "outside the target's vocabulary of 262",
        ),
        (lambda t: t.update({"d2t": -mx.arange(REDUCED).astype(mx.int64)}), "same target id"),
        (lambda t: t.update({"d2t": t["d2t"][:-1]}), r"d2t has shape \(199,\)"),
        (lambda t: t.update({"t2d": mx.ones((262,), mx.bool_)}), "t2d and d2t disagree"),
    ],
)
def test_damaged_checkpoints_are_refused(qwen3_target, spec_drafters, tmp_path, damage, reason):
    ck = copy_ckpt(spec_drafters["dspark-reduced"], tmp_path / "d")
    edit_tensors(ck, damage)
    message = refusal(lambda: outrider.load(str(qwen3_target), str(ck), mode="dspark"))
    assert re.search(reason, message), message


@pytest.mark.parametrize(
    "change,reason",
    [
        ({"speculators_model_type": "mtp"}, "speculators_model_type 'mtp' is not supported"),
        ({"aux_hidden_state_layer_ids": None}, "lacks aux_hidden_state_layer_ids"),
        ({"mask_token_id": None}, "no mask_token_id"),
        ({"draft_vocab_size": 999}, "draft_vocab_size 999 must be between"),
        ({"transformer_layer_config": "qwen3"}, "transformer_layer_config"),
        ({"sample_from_anchor": "yes"}, "sample_from_anchor must be true or false"),
        ({"mask_token_id": 262}, "mask_token_id 262 is outside the vocabulary of 262"),
    ],
)
def test_bad_configs_are_refused(plugins, spec_drafters, tmp_path, change, reason):
    ck = copy_ckpt(spec_drafters["dspark-reduced"], tmp_path / "d")
    edit_config(ck, **change)
    assert reason in refusal(lambda: load_drafter(plugins, str(ck)))


def test_shared_head_needs_the_vocabulary_it_was_made_for(qwen3_target, spec_drafters, tmp_path):
    wider = make_tiny_target(tmp_path / "wider", vocab_size=300)
    for name in ("deepspec-shared", "dspark-mask-slots-shared"):
        message = refusal(
            lambda n=name: outrider.load(str(wider), str(spec_drafters[n]), mode="dspark")
        )
        assert "uses the target's embedding and head" in message
        assert "vocabulary of 262 tokens; the target's has 300" in message
    ck = copy_ckpt(spec_drafters["deepspec-shared"], tmp_path / "mask")
    edit_config(ck, mask_token_id=4000)
    message = refusal(lambda: outrider.load(str(qwen3_target), str(ck), mode="dspark"))
    assert "mask_token_id 4000 is outside the target's vocabulary of 262" in message


def test_specforge_heads_under_the_old_logit_head_container_load(plugins, spec_drafters, tmp_path):
    ck = copy_ckpt(spec_drafters["specforge-dspark"], tmp_path / "d")
    edit_tensors(
        ck,
        lambda t: t.update(
            {"logit_head." + k: t.pop(k) for k in list(t) if k.startswith(("markov", "confid"))}
        ),
    )
    spec = load_drafter(plugins, str(ck))
    assert "markov_head.gate_proj.weight" in spec.weights
    assert not any(k.startswith("logit_head.") for k in spec.weights)


def test_layer_config_values_left_out_take_qwen3_defaults(plugins, spec_drafters, tmp_path):
    """Older transformers write `transformer_layer_config` with `to_diff_dict`, which drops
    every value equal to `Qwen3Config`'s default."""
    ck = copy_ckpt(spec_drafters["dflash"], tmp_path / "d")
    cfg = json.loads((ck / "config.json").read_text())
    for key in ("rms_norm_eps", "max_position_embeddings", "rope_parameters", "attention_bias"):
        del cfg["transformer_layer_config"][key]
    (ck / "config.json").write_text(json.dumps(cfg))
    spec = load_drafter(plugins, str(ck))
    assert (spec.rms_norm_eps, spec.max_position_embeddings) == (1e-6, 32768)
    assert spec.rope_theta == 10000.0 and spec.rope_scaling is None
    assert spec.hidden_size == 64  # stated values still win


def test_sliding_window_layers_are_read_and_run_losslessly(
    plugins, qwen3_target, spec_drafters, tmp_path
):
    """Muse-Glimmer-style heads: sliding layers causal within the block (unless the config
    says `sliding_window_non_causal`), full layers bidirectional; greedy output is the
    target's with the window biting from the first round."""
    ck = copy_ckpt(spec_drafters["dspark"], tmp_path / "d")
    cfg = json.loads((ck / "config.json").read_text())
    layers = cfg["transformer_layer_config"]
    layers.update(
        layer_types=["sliding_attention", "full_attention"],
        sliding_window=6,
        use_sliding_window=True,
    )
    (ck / "config.json").write_text(json.dumps(cfg))
    spec = load_drafter(plugins, str(ck))
    assert spec.layer_types == ("sliding_attention", "full_attention")
    assert spec.sliding_window == 6 and spec.causal_sliding and not spec.causal_block
    pipe = outrider.load(str(qwen3_target), str(ck), mode="dspark")
    attn = [layer.self_attn for layer in pipe.proposer.inner.drafter.layers]
    assert [(a.causal, a.window) for a in attn] == [(True, 6), (False, None)]
    ids = pipe.encode(PROMPTS[1] + " # the window is six tokens wide")
    want = plain_greedy(qwen3_target, ids, 24)
    assert pipe.generate(ids, max_tokens=24, stop_tokens=set()).tokens == want
    cfg["sliding_window_non_causal"] = True
    (ck / "config.json").write_text(json.dumps(cfg))
    assert not load_drafter(plugins, str(ck)).causal_sliding
    layers["layer_types"] = ["sliding_attention"]
    (ck / "config.json").write_text(json.dumps(cfg))
    assert "does not describe 2 full / sliding attention layers" in refusal(
        lambda: load_drafter(plugins, str(ck))
    )
