"""Every target family: greedy output equals plain decoding in every mode, and rollback is exact.

Each family is a tiny random-weight model of the real mlx-lm / mlx-vlm class, with sliding
windows of 8 tokens, so the generations below wrap every window many times over.
"""

from __future__ import annotations

import json
from collections import Counter

import mlx.core as mx
import pytest
from conftest import HALF_STEP, fp32_close, plain_greedy, same_bits
from mlx_lm.models.cache import trim_prompt_cache

import outrider
from outrider.core.acceptance import accept_greedy
from outrider.core.device import compute_dtype, on_cuda_gpu
from outrider.core.errors import OutriderError
from outrider.core.plugins import Plugins
from outrider.core.sampling import greedy
from outrider.plugins.targets.caches import is_rotating
from outrider.testing import SLIDING_WINDOW, OracleProposer, make_tiny_drafter, make_tiny_target

FAMILIES = {  # make_tiny_target family -> the family plugin that must run it
    "qwen3_5": "gated_delta",
    "qwen3_5_moe": "gated_delta",
    "qwen3_next": "gated_delta",
    "prism_hadamard_qwen35": "gated_delta",
    "qwen3_moe": "dense",
    "nemotron_h": "nemotron_h",
    "lfm2": "short_conv",
    "lfm2_moe": "short_conv",
    "nanbeige": "looped_depth",
    "gemma4_text": "gemma4",
    "gemma4": "gemma4",  # mlx-vlm checkpoint: its language tower
    "gemma3_text": "gemma3",
    "gemma2": "gemma2",
    "muse_glimmer": "muse_glimmer",
    "muse_glimmer_vlm": "muse_glimmer",  # mlx-vlm checkpoint: its language tower
}
# in the full suite only: their quick-tier cousins cover the same cache kinds (lfm2 for
# lfm2_moe; tests/test_looped_depth.py for nanbeige)
SLOW_FAMILIES = {"lfm2_moe", "nanbeige"}
FAMILY_PARAMS = [
    pytest.param(f, marks=pytest.mark.slow) if f in SLOW_FAMILIES else f for f in FAMILIES
]
N_TOKENS = 5 * SLIDING_WINDOW  # generations well past the window
PROMPT = "def fibonacci(n): return fibonacci(n - 1) + fibonacci(n - 2)"

_BUILT: dict = {}


def built(models_dir, family: str):
    """(target path, dspark drafter path), built once per session. On a CUDA GPU the tiny
    Hadamard pack computes in float16, as real packs do: MLX 0.32 there cannot launch a 2-bit
    product of float32 activations over more than 8 rows, which a prompt needs
    ("cuGraphAddKernelNode ... invalid argument"), and runs it for float16 ones
    (docs/testing-on-gpu.md). On the CPU it stays float32: float16 arithmetic is ten times
    slower there, and the float16 pack has its own test in the slow tier."""
    if family not in _BUILT:
        target = make_tiny_target(models_dir / f"fam-{family}", family=family)
        if family == "prism_hadamard_qwen35" and on_cuda_gpu():
            cast_checkpoint(target, mx.float16)
        drafter = make_tiny_drafter(
            models_dir / f"fam-{family}-dspark", target, "dspark", "deepspec", block_size=8
        )
        _BUILT[family] = target, drafter
    return _BUILT[family]


def cast_checkpoint(path, dtype) -> None:
    """Cast a model folder's floating tensors (not its packed weights) to `dtype` in place."""
    weights = mx.load(str(path / "model.safetensors"))
    cast = {k: v.astype(dtype) if mx.issubdtype(v.dtype, mx.floating) else v
            for k, v in weights.items()}  # fmt: skip
    mx.save_safetensors(str(path / "model.safetensors"), cast, metadata={"format": "mlx"})


@pytest.mark.parametrize("family", FAMILY_PARAMS)
def test_every_mode_matches_plain_greedy(models_dir, family):
    every_mode_matches_plain_greedy(family, *built(models_dir, family))


@pytest.mark.parametrize("family", ["gemma2", "gemma3_text", "gemma4_text", "qwen3_5"])
def test_embed_and_project_are_the_models_own(models_dir, family):
    """Drafters that share the target's embedding and head read them through the family: its
    `embed` must be the model's embedding output (tap -1), scale and all, and `project` of the
    final-normed last layer the model's own logits, soft-capping and all."""
    from outrider.plugins.targets.base import decoder

    target = outrider.load(str(built(models_dir, family)[0]), mode="baseline").target
    ids = mx.array(list(range(5, 25)), dtype=mx.uint32)
    last = target.num_layers - 1
    target.install_taps((-1, last))
    logits, taps = target.forward(ids, target.make_cache(), (-1, last))
    width = target.hidden_size
    assert mx.allclose(target.embed(ids), taps[:, :width], atol=1e-5).item()
    final = decoder(target.model).norm(taps[:, width:])
    assert mx.allclose(target.project(final), logits, atol=1e-4).item()


@pytest.mark.slow
def test_the_float16_hadamard_pack_matches_plain_greedy(models_dir):
    """The pack in float16, as real packs compute and as a CUDA GPU runs the tiny one
    (`built`); in the slow tier, since float16 is slow on the CPU."""
    target = make_tiny_target(models_dir / "fam-prism-f16", family="prism_hadamard_qwen35")
    cast_checkpoint(target, mx.float16)
    assert compute_dtype(outrider.load(str(target), mode="baseline").target.model) == mx.float16
    drafter = make_tiny_drafter(
        models_dir / "fam-prism-f16-dspark", target, "dspark", "deepspec", block_size=8
    )
    every_mode_matches_plain_greedy("prism_hadamard_qwen35", target, drafter)


def every_mode_matches_plain_greedy(family: str, target, drafter) -> None:
    pipes = {
        "dspark": outrider.load(str(target), str(drafter), mode="dspark"),
        "lookup": outrider.load(str(target), mode="lookup"),
        "baseline": outrider.load(str(target), mode="baseline"),
    }
    assert pipes["baseline"].target.family.name == FAMILIES[family]
    ids = pipes["baseline"].encode(PROMPT)
    want = plain_greedy(target, ids, N_TOKENS)
    assert len(set(want)) > 4  # the toy model says something, not one token over and over
    for mode, pipe in pipes.items():
        got = pipe.generate(ids, max_tokens=N_TOKENS, max_draft=4, stop_tokens=set())
        assert got.tokens == want, f"{family}: {mode} diverged from plain decoding"
    # the oracle proposer covers every acceptance rate, with partial accepts in most rounds
    target_obj = pipes["baseline"].target
    for rate in (0.0, 0.5, 0.9, 1.0):
        oracle = OracleProposer(ids + want, rate, vocab_size=262, max_draft=8, seed=7)
        pipe = outrider.pipeline_from_parts(target_obj, oracle, "oracle", max_draft=6)
        got = pipe.generate(ids, max_tokens=N_TOKENS, stop_tokens=set())
        assert got.tokens == want, f"{family}: oracle at {rate:.0%} diverged"
        accepted = sum(r.accepted for r in got.rounds)
        drafted = sum(len(r.drafted) for r in got.rounds)
        if rate == 1.0:
            assert accepted == drafted
        assert accepted == 0 if rate == 0.0 else accepted > 0


def cache_tensors(c) -> list[mx.array]:
    """What a layer's cache holds for the next token (rotating: its rows in temporal order)."""
    if hasattr(c, "cache"):  # recurrent: conv window and state
        return list(c.cache)
    if is_rotating(c):
        return [c.keys, c.values]
    return [c.keys[..., : c.offset, :], c.values[..., : c.offset, :]]


def verify_round(target, prompt, right: int, k: int = 6):
    """Prefill, verify [anchor, k drafts] of which `right` are right, and roll back."""
    cache = target.make_cache()
    logits, _ = target.prefill(prompt, cache)
    anchor = int(mx.argmax(logits).item())
    truth, probe, tok = [], target.make_cache(), anchor
    target.prefill(prompt, probe)
    for _ in range(k):
        lg, _ = target.forward(mx.array([tok]), probe)
        tok = int(mx.argmax(lg[-1]).item())
        truth.append(tok)
    drafts = truth[:right] + [(t + 1) % 262 for t in truth[right:]]
    logits, _ = target.forward(mx.array([anchor, *drafts]), cache)
    a = accept_greedy(greedy(logits).tolist(), drafts)
    assert a == right
    return cache, anchor, drafts[:a], k - a


@pytest.mark.parametrize("family", FAMILY_PARAMS)
def test_rollback_is_bit_exact(models_dir, family):
    target_path, _ = built(models_dir, family)
    target = outrider.load(str(target_path), mode="baseline").target
    prompt = target.tokenizer.encode("Rollback must be exact, even after the window wraps around.")
    assert len(prompt) > 4 * SLIDING_WINDOW
    cache, anchor, accepted, rejected = verify_round(target, prompt, right=3)
    target.rollback(cache, rejected)

    # a fresh cache fed the same prompt, then only the accepted text in one forward
    fresh = target.make_cache()
    target.prefill(prompt, fresh)
    target.forward(mx.array([anchor, *accepted]), fresh)
    # and one forward over the whole accepted text
    whole = target.make_cache()
    target.model(mx.array([prompt + [anchor, *accepted]]), cache=whole)
    kinds, computes_in = set(), compute_dtype(target.model)
    for ours, same, one in zip(cache, fresh, whole, strict=True):
        kinds.add(type(ours).__name__)
        assert getattr(ours, "offset", None) == getattr(same, "offset", None)
        for got, want, alt in zip(cache_tensors(ours), cache_tensors(same), cache_tensors(one)):
            assert got.shape == want.shape
            assert same_bits(got, want), (
                f"{type(ours).__name__} differs by {mx.abs(got - want).max()}"
            )
            # one long forward sums in another order (chunked attention, matmul tiling): the
            # same values up to the rounding of the type the model computes in (a float16
            # pack's float32 recurrent state carries float16's: GPU run 11 parted by ~0.4%);
            # a rotating cache keeps only the window's tail
            alt = alt[..., -got.shape[-2] :, :] if is_rotating(ours) else alt
            tol = 8 * HALF_STEP.get(computes_in, 0.0) * float(mx.abs(alt).max().item())
            assert fp32_close(got, alt, atol=max(2e-5, tol), rtol=1e-5), (
                f"{type(ours).__name__} parts from one long forward by {mx.abs(got - alt).max()}"
            )
    assert kinds & {"RecordingArraysCache", "RotatingKVCache", "KVCache"}

    # mlx-lm's own rollback helper leaves these caches as they were after the verify
    naive, *_ = verify_round(target, prompt, right=3)
    trim_prompt_cache(naive, rejected)
    if family not in ("qwen3_moe", "nanbeige", "gemma2"):  # plain KV: mlx-lm's trim is right
        assert any(
            getattr(n, "offset", 0) != getattr(f, "offset", 0)
            or any(
                a.shape != b.shape or not same_bits(a, b)
                for a, b in zip(cache_tensors(n), cache_tensors(f))
            )
            for n, f in zip(naive, fresh)
        )


def _config(tmp_path, **config):
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_family_detection_and_refusals(tmp_path):
    plugins = Plugins(load_entrypoints=False)
    by_type = {
        "qwen3": "dense",
        "qwen3_5": "gated_delta",
        "nemotron_h": "nemotron_h",
        "lfm2": "short_conv",
        "lfm2_moe": "short_conv",
        "gemma4_text": "gemma4",
        "gemma3_text": "gemma3",
        "gemma3": "gemma3",
        "muse_glimmer": "muse_glimmer",
    }
    ordered = sorted(plugins.families.values(), key=lambda f: -getattr(f, "priority", 0))
    for model_type, name in by_type.items():
        chosen = next(f for f in ordered if f.supports({"model_type": model_type}))
        assert chosen.name == name
    nested = {"model_type": "gemma4", "text_config": {"model_type": "gemma4_text"}}
    assert next(f for f in ordered if f.supports(nested)).name == "gemma4"
    # mlx-lm knows this one but no family vouches for its taps: lookup/baseline only
    assert next(f for f in ordered if f.supports({"model_type": "recurrent_gemma"})).name == (
        "mlx_lm"
    )
    with pytest.raises(OutriderError, match="'not_a_model'.*--mode lookup and --mode baseline"):
        outrider.load(str(_config(tmp_path, model_type="not_a_model")), mode="baseline")


def test_fallback_family_refuses_drafters_but_runs_lookup(models_dir, tmp_path):
    from outrider.plugins.targets.fallback import MlxLmFallbackFamily

    target_path, drafter = built(models_dir, "qwen3_moe")
    pipe = outrider.load(str(target_path), mode="lookup")
    pipe.target.family = MlxLmFallbackFamily()  # as if no family plugin knew qwen3_moe
    ids = pipe.encode(PROMPT)
    got = pipe.generate(ids, max_tokens=16, stop_tokens=set())
    assert got.tokens == plain_greedy(target_path, ids, 16)
    with pytest.raises(OutriderError, match="--mode lookup and --mode baseline still work"):
        pipe.target.install_taps((0, 1))


def test_registry_rows_name_installed_families():
    from outrider.registry.resolver import load_pairs

    installed = set(Plugins(load_entrypoints=False).families)
    pairs = load_pairs()
    assert {p.family for p in pairs} <= installed
    assert {"gated_delta", "nemotron_h", "gemma4", "muse_glimmer", "dense"} <= {
        p.family for p in pairs
    }
    for p in pairs:  # every number says where it came from; a row without one says so
        kinds = ("published:", "receipt:") + (() if p.speedup else ("unmeasured:",))
        assert p.source.startswith(kinds), p.id


def test_doctor_and_models_list_the_families():
    from typer.testing import CliRunner

    from outrider.cli import app

    want = {"dense", "gated_delta", "nemotron_h", "short_conv", "gemma4", "muse_glimmer", "mlx_lm"}
    doctor = json.loads(CliRunner().invoke(app, ["doctor", "--json"]).stdout)
    assert want <= set(doctor["target_families"])
    models = json.loads(CliRunner().invoke(app, ["models", "--json"]).stdout)
    assert want <= set(models["families"])
    shown = CliRunner().invoke(app, ["doctor"]).stdout
    assert "gated_delta" in shown and "nemotron_h" in shown


def test_sampled_output_follows_the_target_after_rollback(models_dir):
    """On a recurrent hybrid, one draft per round, so the third token is sampled from a
    rolled-back recurrent state whenever the first draft was rejected."""
    from test_lossless_sampled import (
        PARAMS,
        TargetLikeProposer,
        chi2_critical,
        chi_square,
        exact_joint,
    )

    from outrider.core.sampling import SamplingParams

    # two layers, a gated-delta (recurrent) one and a full-attention one: the hybrid at half
    # the cost of each of the 400 runs
    target_path = make_tiny_target(
        models_dir / "fam-qwen3_5-2-layers", family="qwen3_5", num_hidden_layers=2
    )
    target = outrider.load(str(target_path), mode="baseline").target
    assert sorted(hasattr(c, "cache") for c in target.make_cache()) == [False, True]  # 1 recurrent
    proposer = TargetLikeProposer(target, SamplingParams(temperature=1.6, top_k=5))
    spec = outrider.pipeline_from_parts(target, proposer, "target-like", max_draft=1)
    prompt = [30 + 7 * i % 200 for i in range(2 * SLIDING_WINDOW + 3)]
    expected = exact_joint(target, prompt, PARAMS, 3)
    counts, n, rejected = Counter(), 400, 0
    for seed in range(n):
        res = spec.generate(
            prompt,
            max_tokens=3,
            temperature=PARAMS.temperature,
            top_p=PARAMS.top_p,
            top_k=PARAMS.top_k,
            seed=seed,
            stop_tokens=set(),
        )
        counts[tuple(res.tokens[:3])] += 1
        rejected += sum(len(r.drafted) - r.accepted for r in res.rounds)
    assert rejected > n // 10  # rollbacks really happened
    stat, dof = chi_square(counts, expected, n)
    assert stat < chi2_critical(dof), f"chi2 {stat:.1f} with {dof} dof"


@pytest.mark.slow  # about mlx-lm, not outrider: the full suite keeps it
def test_mlx_lm_speculative_decoding_corrupts_these_targets(models_dir):
    """Why rollback needed work: mlx-lm's own speculative decoding (0.32) refuses hybrids and,
    on sliding-window targets, silently diverges once the window is full (its trim gives up on
    a wrapped rotating cache); the same call on a dense target is exact. Ours equals plain
    decoding on all of them (test_every_mode_matches_plain_greedy)."""
    from mlx_lm.generate import speculative_generate_step
    from mlx_lm.utils import load

    draft, _ = load(str(make_tiny_target(models_dir / "fam-draft", family="qwen3", seed=11)))

    def mlx_lm_speculative(path, ids):
        model, _ = load(str(path))
        steps = speculative_generate_step(mx.array(ids), model, draft, num_draft_tokens=3)
        return [int(t) for (t, _, _), _ in zip(steps, range(N_TOKENS))]

    ids = [100, 101, 102]
    dense = make_tiny_target(models_dir / "fam-dense-control", family="qwen3", seed=9)
    assert mlx_lm_speculative(dense, ids) == plain_greedy(dense, ids, N_TOKENS)
    for family in ("gemma4_text", "muse_glimmer"):
        target, _ = built(models_dir, family)
        assert mlx_lm_speculative(target, ids) != plain_greedy(target, ids, N_TOKENS), family
    with pytest.raises(ValueError, match="trimmable"):
        mlx_lm_speculative(built(models_dir, "qwen3_5")[0], ids)


def test_nested_multimodal_qwen3_5_checkpoint_runs_its_text_model(models_dir, tmp_path):
    """Published Qwen3.5/3.6 checkpoints nest the text model under text_config beside a
    vision_config; the gated_delta family runs their text model through mlx-lm."""
    import shutil

    source, drafter = built(models_dir, "qwen3_5")
    nested = tmp_path / "qwen3_5-vl"
    shutil.copytree(source, nested)
    flat = json.loads((source / "config.json").read_text())
    config = {
        "model_type": "qwen3_5",
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "text_config": flat,
        "vision_config": {"model_type": "qwen3_5_vision", "depth": 1},
        "eos_token_id": flat["eos_token_id"],
    }
    (nested / "config.json").write_text(json.dumps(config))
    pipe = outrider.load(str(nested), str(drafter), mode="dspark")
    assert pipe.target.family.name == "gated_delta"
    ids = pipe.encode(PROMPT)
    got = pipe.generate(ids, max_tokens=16, max_draft=4, stop_tokens=set())
    assert got.tokens == plain_greedy(source, ids, 16)


def test_a_checkpoint_that_ships_its_own_code_is_refused_unrun(tmp_path):
    """A config.json naming a `model_file` asks mlx-lm to run the folder's Python: outrider
    refuses it in its own words before anything loads (the file, which would end the test
    run, never runs), for every mode."""
    folder = make_tiny_target(tmp_path / "coded")
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "model_file": "mine.py"}))
    (folder / "mine.py").write_text("raise SystemExit('the checkpoint ran its code')\n")
    for mode in ("baseline", "lookup"):
        with pytest.raises(OutriderError, match="never runs code from a checkpoint"):
            outrider.load(str(folder), mode=mode)
