"""Mode draft: a small model with the target's tokenizer drafts; output equals plain decoding."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import mlx.core as mx
import pytest
from conftest import PROMPTS, plain_greedy
from sampling_check import chi2_critical, chi_square, exact_joint
from typer.testing import CliRunner

import outrider
from outrider import cli
from outrider.api import load_target
from outrider.core.errors import OutriderError
from outrider.core.loop import begin_row, prefill
from outrider.core.plugins import Plugins
from outrider.core.round import verify_round
from outrider.core.sampling import KeyStream, SamplingParams
from outrider.core.stopping import Stopper
from outrider.testing import make_tiny_target


def perturbed_copy(src: Path, dst: Path, noise: float, seed: int = 1) -> Path:
    """A copy of a tiny model with noise on its projections: a draft model that agrees with
    the original often but not always, so rounds accept some drafts and reject others."""
    shutil.copytree(src, dst, dirs_exist_ok=True)
    weights = dict(mx.load(str(dst / "model.safetensors")))
    mx.random.seed(seed)
    for name, w in weights.items():
        if "proj" in name and mx.issubdtype(w.dtype, mx.floating):
            weights[name] = w + noise * w.std() * mx.random.normal(w.shape)
    mx.save_safetensors(str(dst / "model.safetensors"), weights, metadata={"format": "mlx"})
    return dst


@pytest.fixture(scope="module")
def near_draft(models_dir, qwen3_target) -> Path:
    return perturbed_copy(qwen3_target, models_dir / "draft-near", 0.3)


@pytest.fixture(scope="module")
def small_draft(models_dir) -> Path:
    """Another, smaller model of the same tokenizer (one layer, its own random weights)."""
    return make_tiny_target(models_dir / "draft-small", "qwen3", seed=7, num_hidden_layers=1)


@pytest.fixture(scope="module")
def near_pipe(qwen3_target, near_draft):
    return outrider.load(str(qwen3_target), mode="draft", draft_model=str(near_draft))


def generate_matches_plain(pipe, model, prompt: str, n: int, cap: int):
    ids = pipe.encode(prompt)
    got = pipe.generate(ids, max_tokens=n, max_draft=cap, stop_tokens=set())
    assert got.tokens == plain_greedy(model, ids, n), f"cap {cap} diverged"
    assert all(len(r.drafted) <= cap for r in got.rounds)
    return got


# --- greedy: token-identical to plain decoding ---------------------------------------------------


@pytest.mark.parametrize("cap", [1, 3, 8])
def test_greedy_matches_plain(near_pipe, qwen3_target, cap):
    got = generate_matches_plain(near_pipe, qwen3_target, PROMPTS[0], 40, cap)
    assert near_pipe.mode == "draft"
    accepted = [r.accepted for r in got.rounds]
    assert max(accepted) >= 1  # some drafts kept (the draft cache keeps them)...
    assert any(a < len(r.drafted) for a, r in zip(accepted, got.rounds))  # ...some rolled back


def test_greedy_with_a_smaller_model(qwen3_target, small_draft):
    pipe = outrider.load(str(qwen3_target), draft_model=str(small_draft), num_draft_tokens=4)
    assert pipe.mode == "draft" and pipe.max_draft == 4  # --mode auto + --draft-model
    generate_matches_plain(pipe, qwen3_target, PROMPTS[1], 24, 4)


@pytest.mark.slow
def test_auto_is_calibrated_with_the_draft_models_own_cost(qwen3_target, small_draft):
    """A draft model runs a forward a draft: the calibration times its calls (it took them as
    free, as lookup's host drafts are, so `auto` priced every cap at the verify's cost alone)."""
    pipe = outrider.load(
        str(qwen3_target), mode="draft", draft_model=str(small_draft), max_draft="auto"
    )
    cal = pipe.calibration
    assert cal.draft_ms > 0 and cal.draft_ms_per_token > 0
    assert cal.round_cost(4) > cal.draft_cost(1) + cal.verify_cost(5)  # three more drafts
    ids = pipe.encode(PROMPTS[1])
    got = pipe.generate(ids, max_tokens=24, stop_tokens=set())
    assert got.tokens == plain_greedy(qwen3_target, ids, 24)


@pytest.mark.parametrize("cap", range(1, 9))
def test_every_cap_every_prompt(near_pipe, qwen3_target, cap):
    for i, prompt in enumerate(PROMPTS):
        generate_matches_plain(near_pipe, qwen3_target, prompt, (24, 57, 90)[i], cap)


@pytest.fixture(scope="module")
def family_pairs(models_dir) -> dict[str, tuple[Path, Path]]:
    """Targets whose draft model rolls back through its family: recurrent state (qwen3_5)
    and sliding windows that wrap (gemma4_text), each drafting for itself slightly off."""
    out = {}
    for family, noise in (("qwen3_5", 0.05), ("gemma4_text", 0.05)):
        target = make_tiny_target(models_dir / f"dm-{family}", family, seed=2)
        out[family] = (target, perturbed_copy(target, models_dir / f"dm-{family}-draft", noise))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_5", "gemma4_text"])
def test_family_draft_models_every_cap(family_pairs, family):
    target, draft = family_pairs[family]
    pipe = outrider.load(str(target), mode="draft", draft_model=str(draft))
    kept = 0
    for cap in range(1, 9):
        got = generate_matches_plain(pipe, target, PROMPTS[0], 40, cap)
        kept += sum(r.accepted for r in got.rounds)
    assert kept > 0


@pytest.mark.slow
def test_sliding_window_draft_model_for_a_dense_target(models_dir, qwen3_target):
    draft = make_tiny_target(models_dir / "dm-gemma-for-qwen3", "gemma4_text", seed=4)
    pipe = outrider.load(str(qwen3_target), mode="draft", draft_model=str(draft))
    for cap in (2, 8):
        generate_matches_plain(pipe, qwen3_target, PROMPTS[2], 40, cap)


# --- the draft cache follows the committed tokens ------------------------------------------------


def run_rounds(pipe, prompt: list[int], n: int) -> list[tuple[list[int], list[int], int]]:
    """Drive the loop round by round; after each: (history, draft cache tokens, its length)."""
    target, proposer = pipe.target, pipe.proposer
    stopper = Stopper(n, set(), ())
    sampling = SamplingParams()
    started = prefill(target, proposer, prompt, sampling, None, [], 0, None)
    row, _ = begin_row(
        started, proposer, prompt, stopper, sampling, None, pipe.max_draft, [], 0, None
    )
    states = []
    while not row.done:
        verify_round(target, [row], started.cache)
        cached = proposer.cached_tokens
        length = next(c.offset for c in proposer.cache if hasattr(c, "offset"))
        states.append((list(row.history), cached, length))
    return states


def check_draft_cache(pipe, prompt: list[int], n: int, most_behind: int = 2) -> None:
    """After every round the draft cache holds committed tokens only, at most `most_behind`
    short of the history: the bonus token, and the last draft when all were kept (mlx-lm's
    rewind); a draft model with windows or recurrent state gets its pre-draft snapshot back
    instead, so the drafts it kept go in again with the next round's bonus."""
    states = run_rounds(pipe, prompt, n)
    assert len(states) > 3
    for history, cached, length in states:
        assert length == len(cached)  # what the cache holds is what we think it holds
        assert cached == history[: len(cached)]  # committed tokens only, in order
        assert 1 <= len(history) - len(cached) <= most_behind
    # the rolled-back cache gives exactly the logits of a fresh pass over the same tokens
    history, cached, _ = states[-1]
    draft = pipe.proposer.draft
    rest = mx.array(history[len(cached) :], dtype=mx.uint32)
    logits, _ = draft.forward(rest, pipe.proposer.cache)
    fresh, _ = draft.forward(mx.array(history, dtype=mx.uint32), draft.make_cache())
    assert mx.allclose(logits[-1], fresh[-1], atol=1e-4).item()


def test_draft_cache_length_equals_committed(near_pipe):
    check_draft_cache(near_pipe, near_pipe.encode(PROMPTS[1]), 30)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_5", "gemma4_text"])
def test_family_draft_cache_equals_committed(family_pairs, family):
    target, draft = family_pairs[family]
    pipe = outrider.load(str(target), mode="draft", draft_model=str(draft), max_draft=5)
    check_draft_cache(pipe, pipe.encode(PROMPTS[0]), 40, most_behind=pipe.max_draft + 1)


# --- sampled: the target's distribution ----------------------------------------------------------


@pytest.mark.slow
def test_sampled_follows_target_distribution(near_pipe):
    """The first two tokens over many seeds match the target's exact joint distribution
    (chi-square); the second comes from a round that drafts from the draft model's q."""
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=4)
    prompt = [30 + 7 * i % 200 for i in range(12)]
    expected = exact_joint(near_pipe.target, prompt, params, 2)
    n, counts, drafted = 300, Counter(), 0
    for seed in range(n):
        got = near_pipe.generate(
            prompt, max_tokens=3, max_draft=3, temperature=params.temperature,
            top_p=params.top_p, top_k=params.top_k, seed=seed, stop_tokens=set(),
        )  # fmt: skip
        counts[tuple(got.tokens[:2])] += 1
        drafted += sum(len(r.drafted) for r in got.rounds)
    assert drafted == n  # every run drafted its second token
    stat, dof = chi_square(counts, expected, n)
    assert stat < chi2_critical(dof), f"chi2 {stat:.1f} with {dof} dof"


def test_sampled_draft_probabilities_are_target_width(near_pipe):
    """q rows cover the target's vocabulary and sum to one; every draft has q > 0."""
    proposer = near_pipe.proposer
    ids = near_pipe.encode(PROMPTS[2])
    proposer.start(ids, None)
    from outrider.core.proposer import DraftContext

    params = SamplingParams(temperature=0.7, top_p=0.9)
    ctx = DraftContext(ids, 4, params, KeyStream(3).next())
    proposal = proposer.propose(ctx)
    vocab = near_pipe.target.config["vocab_size"]
    assert proposal.probs.shape == (4, vocab)
    assert mx.allclose(proposal.probs.sum(axis=-1), mx.ones(4), atol=1e-5).item()
    q = mx.take_along_axis(proposal.probs, proposal.tokens[:, None].astype(mx.int32), axis=-1)
    assert (q > 0).all().item()
    proposer.observe(1, None)
    assert proposer.cached_tokens == ids + proposal.tokens[:1].tolist()


# --- refusals ------------------------------------------------------------------------------------


def test_another_tokenizer_is_refused(models_dir, qwen3_target, small_draft):
    other = models_dir / "draft-other-tokenizer"
    shutil.copytree(small_draft, other, dirs_exist_ok=True)
    spec = json.loads((other / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    a, b = sorted(vocab)[10:12]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two ids swapped: same size, other tokenizer
    (other / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(OutriderError) as e:
        outrider.load(str(qwen3_target), mode="draft", draft_model=str(other))
    message = str(e.value)
    assert "\n" not in message and "another tokenizer" in message and "2 of" in message


def test_drafts_stay_inside_the_target_vocabulary(qwen3_target, small_draft):
    """A draft model with more logit rows (padding) never proposes an id the target lacks."""
    plugins = Plugins()
    target = load_target(plugins, str(qwen3_target))
    from outrider.plugins.strategies.draft_model import DraftModelProposer

    draft = load_target(plugins, str(small_draft))
    vocab = target.config["vocab_size"]
    narrow = DraftModelProposer(draft, vocab - 200)  # as if the target had 200 fewer rows
    pipe = outrider.pipeline_from_parts(target, narrow, "draft", max_draft=6)
    ids = pipe.encode(PROMPTS[0])
    got = pipe.generate(ids, max_tokens=30, stop_tokens=set())
    drafted = [t for r in got.rounds for t in r.drafted]
    assert drafted and max(drafted) < vocab - 200
    assert got.tokens == plain_greedy(qwen3_target, ids, 30)


def test_mode_draft_without_a_draft_model_is_refused(qwen3_target):
    with pytest.raises(OutriderError, match="--mode draft needs a draft model: pass --draft-model"):
        outrider.load(str(qwen3_target), mode="draft")


def test_draft_model_with_another_mode_is_refused(qwen3_target, small_draft):
    with pytest.raises(OutriderError, match="--draft-model drafts in --mode draft"):
        outrider.load(str(qwen3_target), mode="lookup", draft_model=str(small_draft))


# --- the command line ----------------------------------------------------------------------------


def invoke(*args: str):
    return CliRunner().invoke(cli.app, list(args))


def one_error_line(result) -> str:
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def test_causal_lm_as_drafter_says_draft_mode(qwen3_target, small_draft):
    result = invoke(
        "generate", "--model", str(qwen3_target), "--drafter", str(small_draft), "--prompt", "hi"
    )
    line = one_error_line(result)
    assert "ForCausalLM" in line and "plain causal LM" in line
    assert f"--mode draft --draft-model {small_draft}" in line


def test_cli_mode_draft_needs_draft_model(qwen3_target):
    line = one_error_line(
        invoke("generate", "--model", str(qwen3_target), "--mode", "draft", "--prompt", "hi")
    )
    assert "--draft-model" in line


def test_cli_generate_with_draft_model(qwen3_target, near_draft):
    result = invoke(
        "generate", "--model", str(qwen3_target), "--draft-model", str(near_draft),
        "--num-draft-tokens", "3", "--prompt", PROMPTS[0], "--max-tokens", "20", "--json",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    out = json.loads(result.stdout)
    assert out["mode"] == "draft" and out["max_draft"] == 3
    assert (
        out["tokens"][:20]
        == plain_greedy(qwen3_target, out["prompt_tokens"], 20)[: len(out["tokens"])]
    )


# --- the benchmark: mode draft beside mlx-lm's speculative decoding ------------------------------


def test_benchmark_runs_draft_beside_mlx_lm_spec(qwen3_target, near_draft):
    from outrider.benchmark.runner import BenchConfig, run_benchmark

    config = BenchConfig(
        model=str(qwen3_target), modes=None, suites=["chat"], trials=1, max_tokens=12,
        prompts_per_suite=1, draft_model=str(near_draft),
    )  # fmt: skip
    report = run_benchmark(config, Plugins())
    arms = {a["mode"]: a for a in report.arms}
    assert arms["draft"]["cap"] == arms["mlx-lm-spec"]["cap"] == 2  # one pair, one cap
    assert arms["draft"]["drafter"] == arms["mlx-lm-spec"]["drafter"] == str(near_draft)
    assert report.checked == len(arms) and not report.divergences  # every arm token-identical
    cell = next(c for c in report.cells if c.arm == "draft")
    assert cell.trials[0].accept_len > 1.0  # drafts were kept


def test_benchmark_draft_model_needs_mode_draft(qwen3_target, near_draft):
    from outrider.benchmark.runner import BenchConfig, build_arms

    config = BenchConfig(model=str(qwen3_target), modes=["baseline"], draft_model=str(near_draft))
    with pytest.raises(OutriderError, match="--modes has no draft"):
        build_arms(config, Plugins())


def test_server_loads_mode_draft(qwen3_target, small_draft):
    from outrider.server.engine import LoadSpec, default_loader

    pipe = default_loader(LoadSpec(str(qwen3_target), draft_model=str(small_draft)))
    assert pipe.mode == "draft" and pipe.proposer.draft.name == str(small_draft)
