"""EAGLE-3: every packaging detected, translated and run losslessly; context bookkeeping exact."""

from __future__ import annotations

import json
import random
from collections import Counter

import mlx.core as mx
import pytest
from conftest import PROMPTS, plain_greedy

import outrider
from outrider.api import load_drafter
from outrider.core.errors import CheckpointError
from outrider.core.plugins import Plugins
from outrider.core.proposer import DraftContext, Proposal
from outrider.core.sampling import SamplingParams
from outrider.plugins.strategies.eagle3 import Eagle3Proposer
from outrider.plugins.strategies.eagle3_drafter import load_eagle3_drafter
from outrider.testing import cast_model, make_tiny_drafter, make_tiny_target

TAPS = (0, 1, 2)  # the tiny target has 4 layers; DeepSpec never taps the last
REDUCED = 100  # a draft vocabulary of 100 of the target's 262 ids

# name -> (packaging, writer overrides)
DRAFTERS = {
    "deepspec": ("deepspec", {}),
    "speculators": ("speculators", {}),
    "specforge": ("specforge", {}),
    "speculators-llama-reduced": (
        "speculators",
        {"layer": "llama", "draft_vocab_size": REDUCED, "embedding": False},
    ),
    "specforge-reduced": ("specforge", {"draft_vocab_size": REDUCED}),
}


@pytest.fixture(scope="module")
def eagle3_drafters(tmp_path_factory, qwen3_target):
    root = tmp_path_factory.mktemp("eagle3")
    return {
        name: make_tiny_drafter(root / name, qwen3_target, "eagle3", packaging, **overrides)
        for name, (packaging, overrides) in DRAFTERS.items()
    }


@pytest.fixture(scope="module")
def eagle3_pipes(qwen3_target, eagle3_drafters):
    """One pipeline per drafter, all on one loaded target."""
    first = outrider.load(str(qwen3_target), str(eagle3_drafters["deepspec"]), mode="eagle3")
    pipes = {"deepspec": first}
    for name, path in eagle3_drafters.items():
        if name not in pipes:
            pipes[name] = outrider.load(
                str(qwen3_target), str(path), mode="auto", target=first.target
            )
    return pipes


def test_each_packaging_is_detected_and_translated(eagle3_drafters):
    plugins = Plugins()
    for name, path in eagle3_drafters.items():
        config = json.loads((path / "config.json").read_text())
        claimed = [f.name for f in plugins.formats.values() if f.detect(config)]
        assert claimed == ["eagle3"], f"{name} claimed by {claimed}"
        spec = load_drafter(plugins, str(path), download=False)
        packaging, overrides = DRAFTERS[name]
        assert (spec.kind, spec.format, spec.num_layers) == ("eagle3", packaging, 1)
        assert spec.target_layer_ids == TAPS  # each packaging's own indexing, translated
        assert spec.ttt_length == (3 if packaging == "speculators" else 7)
        # SpecForge's SGLang export drops the embedding; speculators may leave it out
        assert spec.own_embedding == overrides.get("embedding", packaging != "specforge")
        assert spec.own_lm_head
        assert spec.draft_vocab_size == overrides.get("draft_vocab_size")
        assert ("d2t" in spec.weights) == ("draft_vocab_size" in overrides)
        assert "t2d" not in spec.weights
        llama = packaging == "specforge" or overrides.get("layer") == "llama"
        assert spec.backbone == ("llama" if llama else "qwen3")
    speculators = json.loads((eagle3_drafters["speculators"] / "config.json").read_text())
    assert speculators["eagle_aux_hidden_state_layer_ids"] == [j + 1 for j in TAPS]


def test_published_layouts(eagle3_drafters):
    """Tensor names and dtypes as each publisher saves them."""
    deepspec = mx.load(str(eagle3_drafters["deepspec"] / "model.safetensors"))
    assert "layers.0.self_attn.q_norm.weight" in deepspec and "embed_tokens.weight" in deepspec
    assert deepspec["layers.0.self_attn.q_proj.weight"].shape[1] == 2 * 64  # [E ; g]
    assert deepspec["fc.weight"].shape == (64, 3 * 64)
    assert all(v.dtype == mx.bfloat16 for v in deepspec.values())
    forge = mx.load(str(eagle3_drafters["specforge-reduced"] / "model.safetensors"))
    assert "midlayer.hidden_norm.weight" in forge and "embed_tokens.weight" not in forge
    assert not any(k.startswith("layers.") or "q_norm" in k for k in forge)
    assert forge["lm_head.weight"].shape == (REDUCED, 64)
    assert (forge["d2t"].dtype, forge["d2t"].shape) == (mx.int64, (REDUCED,))
    assert (forge["t2d"].dtype, int(forge["t2d"].sum().item())) == (mx.bool_, REDUCED)


@pytest.mark.parametrize("name", list(DRAFTERS))
def test_greedy_matches_plain(eagle3_pipes, qwen3_target, name):
    pipe = eagle3_pipes[name]
    assert pipe.mode == "eagle3"
    ids = pipe.encode(PROMPTS[1])
    want = plain_greedy(qwen3_target, ids, 24)
    for cap in (1, 5) if name == "deepspec" else (3,):
        got = pipe.generate(ids, max_tokens=24, max_draft=cap, stop_tokens=set())
        assert got.tokens == want, f"{name} cap {cap} diverged"
        assert max(len(r.drafted) for r in got.rounds) == cap


SWEEP = [(name, cap) for name in DRAFTERS for cap in range(1, 9)]  # every packaging, caps 1-8


@pytest.mark.slow
@pytest.mark.parametrize("name,cap", SWEEP)
def test_greedy_every_cap(eagle3_pipes, qwen3_target, name, cap):
    pipe = eagle3_pipes[name]
    for i, prompt in enumerate(PROMPTS[:2]):
        n = (24, 41)[i]
        ids = pipe.encode(prompt)
        got = pipe.generate(ids, max_tokens=n, max_draft=cap, stop_tokens=set())
        assert got.tokens == plain_greedy(qwen3_target, ids, n), f"prompt {i} diverged"
        assert max(len(r.drafted) for r in got.rounds) == cap


@pytest.mark.parametrize(
    "a,b", [("deepspec", "speculators"), ("specforge-reduced", "speculators-llama-reduced")]
)
def test_same_weights_same_drafts_in_two_packagings(eagle3_pipes, a, b):
    """The same weights packed two ways draft the same tokens, round by round."""
    ids = eagle3_pipes[a].encode(PROMPTS[0])
    rounds = {}
    for name in (a, b):
        res = eagle3_pipes[name].generate(ids, max_tokens=20, max_draft=4, stop_tokens=set())
        rounds[name] = [r.drafted for r in res.rounds]
    assert rounds[a] == rounds[b]
    assert sum(len(d) for d in rounds[a]) >= 16


def test_speculators_norm_options(eagle3_pipes, eagle3_drafters, qwen3_target, tmp_path):
    """speculators' norm_before_residual / fc_norm / norm_output (Eagle 3.1) load and change
    the drafts, and stay lossless."""

    def options(cfg):
        cfg.update(norm_before_residual=True, fc_norm=True, norm_output=True)

    def fc_norms(tensors):
        mx.random.seed(5)
        return {f"fc_norm.{i}.weight": mx.random.uniform(0.5, 1.5, (64,)) for i in range(3)}

    path = _rewrite(eagle3_drafters["speculators"], tmp_path / "d", config=options, set_=fc_norms)
    target = eagle3_pipes["deepspec"].target
    pipe = outrider.load(str(qwen3_target), str(path), mode="eagle3", target=target)
    assert pipe.proposer.drafter.norm_feedback and "fc_norm" in pipe.proposer.drafter
    ids = pipe.encode(PROMPTS[0])
    got = pipe.generate(ids, max_tokens=16, max_draft=3, stop_tokens=set())
    assert got.tokens == plain_greedy(qwen3_target, ids, 16)
    plain = eagle3_pipes["speculators"].generate(ids, max_tokens=16, max_draft=3, stop_tokens=set())
    assert [r.drafted for r in got.rounds] != [r.drafted for r in plain.rounds]


def test_drafter_that_copies_a_bigram_target_is_always_accepted(tmp_path):
    """A qwen3 whose attention and MLP outputs are zero is a bigram model: its next token is
    argmax head(norm(E[x])). An EAGLE-3 layer can copy it exactly: attention that looks only at
    its own row (Qwen3's per-head q/k norms) and passes the token's normed embedding through
    (v = o = identity; the target has 4 KV heads of 16 = H), a zero residual (speculators'
    norm_before_residual with a zero hidden_norm), no MLP, the target's final norm and head. Row t reads token t+1 and must
    predict token t+2, so a pairing or chaining slip would show as rejections."""
    target = make_tiny_target(tmp_path / "t", family="qwen3", num_key_value_heads=4, seed=2)
    tw = dict(mx.load(str(target / "model.safetensors")))
    silent = {k: mx.zeros_like(v) for k, v in tw.items() if k.endswith(("o_proj.weight", "down_proj.weight"))}  # fmt: skip
    mx.save_safetensors(str(target / "model.safetensors"), {**tw, **silent})
    path = make_tiny_drafter(tmp_path / "d", target, "eagle3", "speculators")

    def copy_weights(w):
        h = 64
        own_token = mx.concatenate([mx.eye(h), mx.zeros((h, h))], axis=1)  # [E ; g] -> E
        out = {
            "fc.weight": mx.zeros_like(w["fc.weight"]),
            "layers.0.hidden_norm.weight": mx.zeros((h,)),
            "layers.0.self_attn.q_proj.weight": own_token,
            # per-head normed q and k: a row's key matches its own query best; a sharp
            # softmax (q_norm x 16) leaves the other rows out
            "layers.0.self_attn.q_norm.weight": mx.full((16,), 16.0),
            "layers.0.self_attn.k_proj.weight": own_token,
            "layers.0.self_attn.v_proj.weight": own_token,
            "layers.0.self_attn.o_proj.weight": mx.eye(h),
            "layers.0.mlp.down_proj.weight": mx.zeros_like(w["layers.0.mlp.down_proj.weight"]),
            "norm.weight": tw["model.norm.weight"],
            "embed_tokens.weight": tw["model.embed_tokens.weight"],
            "lm_head.weight": tw["lm_head.weight"],
        }
        return out  # float32, as the target: no rounding can split near-tied logits

    def residual_off(cfg):
        cfg["norm_before_residual"] = True

    copy = _rewrite(path, tmp_path / "copy", config=residual_off, set_=copy_weights)
    pipe = outrider.load(str(target), str(copy), mode="eagle3", drafter_bits=16)
    ids = pipe.encode(PROMPTS[0])
    got = pipe.generate(ids, max_tokens=40, max_draft=4, stop_tokens=set())
    assert got.tokens == plain_greedy(target, ids, 40)
    assert all(r.accepted == len(r.drafted) for r in got.rounds)  # every draft accepted
    assert got.mean_accept_len > 4.5


class CheckedProposer:
    """Runs the real EAGLE-3 proposer, checks its cache after every call, and checks each
    round's drafts against a drafter built from scratch on the whole committed context; then
    hands the loop the known answer's tokens (right with probability `rate`) so that rounds
    accept a varying number of drafts."""

    def __init__(self, inner: Eagle3Proposer, target, reference: list[int], rate: float):
        self.name = "eagle3-checked"
        self.inner = inner
        self.target = target
        self.tap_layer_ids = inner.tap_layer_ids
        self.max_draft = 8
        self.reference = reference
        self.rate = rate
        self.rng = random.Random(3)
        self.accepted: list[int] = []

    def start(self, prompt: list[int], taps: mx.array | None) -> None:
        self.inner.start(prompt, taps)
        self.prompt, self.taps = prompt, [taps]
        assert self.inner.cached_rows == 0 and self.inner.context_rows == len(prompt)

    def propose(self, ctx: DraftContext) -> Proposal:
        n = len(ctx.tokens)
        proposal = self.inner.propose(ctx)
        # committed context (all but the anchor's row) plus the chained steps but the last
        assert self.inner.cached_rows == (n - 1) + (proposal.k - 1)
        taps = mx.concatenate(self.taps)
        fresh = Eagle3Proposer("fresh", self.target, self.inner.drafter)
        fresh.start(self.prompt, taps)
        assert fresh.propose(ctx).tokens.tolist() == proposal.tokens.tolist()
        # DeepSpec's evaluator written out: row t = (taps at t, token t+1) at RoPE position t,
        # the last row's output predicts the first draft
        net = self.inner.drafter
        rows = self.target.embed(mx.array(ctx.tokens[1:], dtype=mx.uint32))[None]
        h = net.step(rows, net.project(taps), net.make_cache())[0, -1:]
        first = mx.argmax(net.lm_head(net.head_input(h)), axis=-1)
        assert self.inner.vocab.to_target(first).item() == proposal.tokens[0].item()
        self.n = n
        truth = self.reference[n : n + proposal.k]
        vocab = self.inner.spec.vocab_size
        drafts = [t if self.rng.random() < self.rate else (t + 1) % vocab for t in truth]
        return Proposal.from_list(drafts)

    def observe(self, accepted: int, taps: mx.array | None) -> None:
        self.inner.observe(accepted, taps)
        self.taps.append(taps)
        self.accepted.append(accepted)
        assert self.inner.cached_rows == self.n - 1  # the chained rows are gone
        assert self.inner.context_rows == self.n + accepted  # committed tokens - 1


def test_context_bookkeeping_and_rollback(eagle3_pipes, eagle3_drafters, qwen3_target):
    """Drafter cache = committed tokens - 1 after every round, whatever was accepted, and
    incremental drafting equals drafting from scratch (float32, so no rounding ties)."""
    target = eagle3_pipes["deepspec"].target
    spec = load_drafter(Plugins(), str(eagle3_drafters["speculators-llama-reduced"]), False)
    model = load_eagle3_drafter(spec, bits=16)
    cast_model(model, mx.float32)
    inner = Eagle3Proposer("eagle3", target, model)
    ids = target.tokenizer.encode(PROMPTS[2])
    n = 40
    want = plain_greedy(qwen3_target, ids, n + 8)
    checked = CheckedProposer(inner, target, ids + want, rate=0.7)
    pipe = outrider.pipeline_from_parts(target, checked, "eagle3", max_draft=5)
    got = pipe.generate(ids, max_tokens=n, stop_tokens=set())
    assert got.tokens == want[:n]
    assert len(set(checked.accepted)) >= 3  # rounds accepted different numbers of drafts


def _rewrite(src, dst, *, config=None, drop=(), reshape=None, truncate=False, set_=None):
    dst.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    if config:
        config(cfg)
    (dst / "config.json").write_text(json.dumps(cfg))
    data = (src / "model.safetensors").read_bytes()
    if truncate:
        (dst / "model.safetensors").write_bytes(data[: len(data) // 2])
        return dst
    tensors = dict(mx.load(str(src / "model.safetensors")))
    for name in drop:
        del tensors[name]
    if reshape:
        tensors[reshape] = tensors[reshape][:, :-1]
    if set_:
        tensors.update(set_(tensors))
    mx.save_safetensors(str(dst / "model.safetensors"), tensors)
    return dst


DAMAGE = {
    "missing tensor": (
        "deepspec",
        dict(drop=["layers.0.hidden_norm.weight"]),
        "missing tensor layers.0.hidden_norm.weight",
    ),
    "wrong shape": ("speculators", dict(reshape="fc.weight"), "fc.weight has shape"),
    "midlayer missing": ("specforge", dict(drop=["midlayer.mlp.up_proj.weight"]), "up_proj"),
    "truncated file": ("deepspec", dict(truncate=True), "not a readable safetensors"),
    "unknown architecture": (
        "deepspec",
        dict(config=lambda c: c.update(architectures=["Qwen3Eagle9Model"])),
        "no drafter format recognises",
    ),
    "gemma4": (
        "deepspec",
        dict(config=lambda c: c.update(architectures=["Gemma4Eagle3Model"])),
        "Gemma4Eagle3Model",
    ),
    "two layers": (
        "deepspec",
        dict(config=lambda c: c.update(num_hidden_layers=2)),
        "2 layers are not supported",
    ),
    "no taps": (
        "speculators",
        dict(config=lambda c: c.pop("eagle_aux_hidden_state_layer_ids")),
        "eagle_aux_hidden_state_layer_ids",
    ),
    "no d2t": ("specforge-reduced", dict(drop=["d2t"]), "no d2t table"),
    "d2t/t2d disagree": (
        "speculators-llama-reduced",
        dict(set_=lambda t: {"t2d": mx.logical_not(t["t2d"])}),
        "t2d",
    ),
}


@pytest.mark.parametrize("case", list(DAMAGE))
def test_damaged_checkpoints_are_refused_in_one_line(
    eagle3_pipes, eagle3_drafters, qwen3_target, tmp_path, case
):
    source, how, reason = DAMAGE[case]
    bad = _rewrite(eagle3_drafters[source], tmp_path / "bad", **how)
    with pytest.raises(CheckpointError) as err:
        outrider.load(
            str(qwen3_target), str(bad), mode="eagle3", target=eagle3_pipes["deepspec"].target
        )
    message = str(err.value)
    assert reason in message and "\n" not in message


@pytest.mark.parametrize("name", ["deepspec", "speculators", "specforge"])
def test_drafter_passed_as_target_is_refused(eagle3_drafters, name):
    with pytest.raises(CheckpointError, match="is a drafter checkpoint"):
        outrider.load(str(eagle3_drafters[name]), mode="lookup")


def test_unpublished_pair_is_refused_by_name(tmp_path, qwen3_target):
    with pytest.raises(ValueError, match="zlab packaging has no eagle3"):
        make_tiny_drafter(tmp_path / "x", qwen3_target, "eagle3", "zlab")


@pytest.mark.slow
def test_sampled_reduced_vocabulary_matches_target_distribution(
    eagle3_pipes, qwen3_target, tmp_path
):
    """Rejection sampling with q widened from a reduced head to the target's 262 ids.

    The head covers the 12 ids the target most often samples after the first token, so drafts
    are often accepted and q's exact placement matters (placed at the draft ids instead of
    their target ids, this test's statistic is several times its critical value)."""
    from sampling_check import chi2_critical, chi_square, exact_joint

    target = eagle3_pipes["deepspec"].target
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=5)
    prompt, depth, n = [30 + 7 * i % 200 for i in range(12)], 3, 400
    expected = exact_joint(target, prompt, params, depth)
    later = Counter()
    for outcome, p in expected.items():
        for tok in outcome[1:]:
            later[tok] += p
    ids = [tok for tok, _ in later.most_common(12)]
    path = make_tiny_drafter(
        tmp_path / "d", qwen3_target, "eagle3", "speculators", draft_vocab_size=len(ids),
        draft_vocab_ids=ids,
    )  # fmt: skip
    pipe = outrider.load(str(qwen3_target), str(path), mode="eagle3", target=target)
    counts, drafted, accepted = Counter(), 0, 0
    for seed in range(n):
        res = pipe.generate(
            prompt, max_tokens=depth + 1, max_draft=depth, temperature=params.temperature,
            top_p=params.top_p, top_k=params.top_k, seed=seed, stop_tokens=set(),
        )  # fmt: skip
        counts[tuple(res.tokens[:depth])] += 1
        drafted += sum(len(r.drafted) for r in res.rounds)
        accepted += sum(r.accepted for r in res.rounds)
    assert 0.03 * drafted < accepted < drafted  # both acceptance and rejection exercised
    stat, dof = chi_square(counts, expected, n)
    assert stat < chi2_critical(dof), f"chi2 {stat:.1f} with {dof} dof"


def test_a_drafter_for_a_quantized_target_gets_its_embedding_and_head_dequantized(tmp_path):
    """The shipped demo target stores its embedding 8-bit quantized: a test drafter made for
    it carries the dequantized table (the packed one has another shape), loads, and decodes
    what plain decoding does."""
    from outrider.demo import pair_dir

    target = pair_dir() / "target"
    path = make_tiny_drafter(tmp_path / "e3", target, "eagle3", "deepspec")
    hidden = json.loads((target / "config.json").read_text())["hidden_size"]
    assert mx.load(str(path / "model.safetensors"))["embed_tokens.weight"].shape[-1] == hidden
    pipe = outrider.load(str(target), str(path), mode="eagle3", max_draft=3)
    prompt = "def add(a, b):"
    plain = outrider.load(str(target), mode="baseline", target=pipe.target)
    assert (
        pipe.generate(prompt, max_tokens=12).tokens == plain.generate(prompt, max_tokens=12).tokens
    )
