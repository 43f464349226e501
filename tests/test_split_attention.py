"""Split attention (for MLX's CUDA kernels) computes the same attention and stays lossless.

On a CUDA GPU outrider splits a verify's causal attention into chunks the fused kernel takes
and folds a drafter block's rows into heads; OUTRIDER_ATTENTION=split forces both here on the
CPU, where the arithmetic is the same and every mode must still equal plain greedy decoding.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from conftest import PROMPTS, decoder_layers, fp32_close, plain_greedy

import outrider
from outrider.core.device import ATTENTION_ENV, split_attention
from outrider.core.errors import OutriderError
from outrider.plugins.targets import verify_attention
from outrider.plugins.targets.attention_forms import Buckets, chunked_causal_attention
from outrider.plugins.targets.verify_attention import ChunkedAttention
from outrider.testing import cast_model


def attentions(pipe) -> list[nn.Module]:
    return [layer.self_attn for layer in decoder_layers(pipe.target)]


@pytest.mark.parametrize("rows", [2, 3, 4, 5, 8, 12])
@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_chunks_give_the_one_call_causal_attention(rows, chunk):
    mx.random.seed(rows * 10 + chunk)
    q = mx.random.normal((1, 4, rows, 64))
    k = mx.random.normal((1, 2, 30, 64))
    v = mx.random.normal((1, 2, 30, 64))
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.125, mask="causal")
    got = chunked_causal_attention(q, k, v, 0.125, chunk)
    assert got.shape == want.shape
    assert mx.allclose(got, want, atol=1e-5).item()
    # and the last row is the plain one-row attention over every key
    last = mx.fast.scaled_dot_product_attention(q[:, :, -1:], k, v, scale=0.125)
    assert mx.allclose(got[:, :, -1:], last, atol=1e-5).item()


def test_the_choice_follows_the_environment(monkeypatch):
    monkeypatch.setenv(ATTENTION_ENV, "split")
    assert split_attention()
    monkeypatch.setenv(ATTENTION_ENV, "native")
    assert not split_attention()
    monkeypatch.setenv(ATTENTION_ENV, "auto")
    assert split_attention() == (mx.default_device() == mx.gpu and mx.cuda.is_available())
    monkeypatch.setenv(ATTENTION_ENV, "fast")
    with pytest.raises(OutriderError, match="OUTRIDER_ATTENTION must be auto, split or native"):
        split_attention()


def test_native_attention_leaves_the_model_alone(monkeypatch, qwen3_target):
    monkeypatch.setenv(ATTENTION_ENV, "native")
    pipe = outrider.load(str(qwen3_target), mode="baseline")
    assert not any(isinstance(a, ChunkedAttention) for a in attentions(pipe))


@pytest.mark.parametrize(
    "family_fixture",
    ["qwen3_target"]
    + [pytest.param(f, marks=pytest.mark.slow) for f in ("llama_target", "qwen2_target")],
)
def test_split_verify_is_lossless_in_every_mode(request, tmp_path, monkeypatch, family_fixture):
    from outrider.testing import make_tiny_drafter

    monkeypatch.setenv(ATTENTION_ENV, "split")
    target = request.getfixturevalue(family_fixture)
    dspark = make_tiny_drafter(tmp_path / "ds", target, "dspark", "deepspec", block_size=8)
    dflash = make_tiny_drafter(tmp_path / "df", target, "dflash", "deepspec", block_size=8)
    pipes = [outrider.load(str(target), str(dspark), mode="dspark")]
    pipes.append(outrider.load(str(target), str(dflash), mode="dflash", target=pipes[0].target))
    eagle3 = make_tiny_drafter(tmp_path / "e3", target, "eagle3", "deepspec")
    pipes.append(outrider.load(str(target), str(eagle3), mode="eagle3", target=pipes[0].target))
    pipes.append(outrider.load(str(target), mode="lookup", target=pipes[0].target))
    assert all(isinstance(a, ChunkedAttention) for a in attentions(pipes[0]))
    assert all(layer.self_attn.fold_rows for layer in pipes[0].proposer.drafter.layers)
    assert all(layer.self_attn.split_rows for layer in pipes[2].proposer.drafter.layers)
    for pipe in pipes:
        # EAGLE-3's split is in its drafter alone (what it drafts, never what is committed):
        # one cap checks it decodes; test_split_eagle3_catch_up_rows_... checks its attention
        for cap in (4,) if pipe.mode == "eagle3" else (2, 4, 7):
            for prompt in PROMPTS[:2]:
                ids = pipe.encode(prompt)
                want = plain_greedy(target, ids, 40)
                got = pipe.generate(ids, max_tokens=40, max_draft=cap, stop_tokens=set())
                assert got.tokens == want, f"{pipe.mode} cap {cap} diverged on {prompt!r}"


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_split_verify_logits_match_the_models_own(monkeypatch, qwen3_target, dtype):
    monkeypatch.setenv(ATTENTION_ENV, "split")
    target = outrider.load(str(qwen3_target), mode="baseline").target
    cast_model(target.model, dtype)  # bfloat16 rows go one per kernel call
    layers = decoder_layers(target)
    prompt = target.tokenizer.encode(PROMPTS[1])
    for rows in (2, 5, 9, 16, 17):  # 17 rows is past MAX_ROWS: MLX's own attention
        ids = mx.array(list(range(3, 3 + rows)), dtype=mx.uint32)
        out = []
        for split in (True, False):
            set_wrappers(layers, **({"half": True} if split else {}))
            cache = target.make_cache()
            target.prefill(prompt, cache)
            out.append(target.forward(ids, cache)[0].astype(mx.float32))
        tol = 1e-4 if dtype == mx.float32 else 5e-2 * mx.abs(out[1]).max().item()
        assert fp32_close(out[0], out[1], atol=tol), f"{rows} rows"


def test_a_probe_that_disagrees_keeps_the_models_attention(monkeypatch, qwen3_target):
    monkeypatch.setenv(ATTENTION_ENV, "split")

    def wrong(q, k, v, scale, chunk=None):  # forgets the causal limit of each chunk
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale)

    monkeypatch.setattr(verify_attention, "chunked_causal_attention", wrong)
    pipe = outrider.load(str(qwen3_target), mode="baseline")
    assert not any(isinstance(a, ChunkedAttention) for a in attentions(pipe))


def test_a_probe_that_fails_keeps_the_models_attention(monkeypatch, qwen3_target):
    """A layout that only looks like a known one (here: the re-stated forward raises) leaves
    the model as it was, and loading goes on."""
    monkeypatch.setenv(ATTENTION_ENV, "split")

    def broken(q, k, v, scale, chunk=None):
        raise ValueError("[broadcast_shapes] shapes cannot be broadcast")

    monkeypatch.setattr(verify_attention, "chunked_causal_attention", broken)
    pipe = outrider.load(str(qwen3_target), mode="baseline")
    assert not any(isinstance(a, ChunkedAttention) for a in attentions(pipe))
    assert pipe.generate("hello", max_tokens=4).tokens


def test_only_the_known_attention_layout_is_wrapped():
    assert not verify_attention.fits(nn.Linear(4, 4))
    assert not verify_attention.install(nn.Linear(4, 4), [nn.Linear(4, 4)], list)


def test_folded_block_rows_give_the_same_draft_attention(drafters, qwen3_target):
    pipe = outrider.load(str(qwen3_target), str(drafters["dflash-deepspec"]), mode="dflash")
    proposer = pipe.proposer
    prompt = pipe.encode(PROMPTS[0])
    tap_ids = tuple(proposer.tap_layer_ids)
    cache = pipe.target.make_cache()
    _, taps = pipe.target.prefill(prompt, cache, tap_ids)
    hidden = []
    for fold in (False, True):
        for layer in proposer.drafter.layers:
            layer.self_attn.fold_rows = fold
        block = pipe.target.embed(mx.array([prompt[-1]] + [0] * 7, dtype=mx.uint32))[None]
        hidden.append(proposer.drafter.backbone(block, taps, proposer.drafter.make_cache()))
    assert fp32_close(hidden[0], hidden[1], atol=1e-5)


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_split_eagle3_catch_up_rows_give_the_same_drafter_output(tmp_path, qwen3_target, dtype):
    """EAGLE-3 catches up on a verify's committed rows several at a time; split into one-query
    kernel calls (3 float32 rows, 1 half-precision row a call) they attend as one call does."""
    from outrider.testing import make_tiny_drafter

    eagle3 = make_tiny_drafter(tmp_path / "e3", qwen3_target, "eagle3", "deepspec")
    pipe = outrider.load(str(qwen3_target), str(eagle3), mode="eagle3")
    drafter = pipe.proposer.drafter
    cast_model(drafter, dtype)
    keys = mx.random.split(mx.random.key(0))
    g = mx.random.normal((1, 24, drafter.layers[0].hidden_norm.weight.shape[0]), key=keys[0])
    embeds = mx.random.normal(g.shape, key=keys[1]).astype(dtype)
    out = []
    for split in (False, True):
        drafter.layers[0].self_attn.split_rows = split
        cache = drafter.make_cache()
        rows = [drafter.step(embeds[:, :17], g[:, :17], cache)]  # a prompt: MLX's own call
        for a, b in ((17, 19), (19, 24)):  # catch-ups of 2 and 5 rows
            rows.append(drafter.step(embeds[:, a:b], g[:, a:b], cache))
        out.append(mx.concatenate(rows, axis=1).astype(mx.float32))
    tol = 1e-5 if dtype == mx.float32 else 3e-2
    assert mx.allclose(out[0], out[1], atol=tol, rtol=tol).item()


def test_half_precision_splits_verify_rows_and_unfuses_the_rest_on_a_cuda_gpu(
    monkeypatch, qwen3_target
):
    """Where attention is rerouted (`auto` on a CUDA GPU), a half-precision model's verify rows
    go one per kernel call and its other multi-row calls take matmul attention; `native`
    leaves it alone."""
    monkeypatch.setenv(ATTENTION_ENV, "native")
    target = outrider.load(str(qwen3_target), mode="baseline").target
    cast_model(target.model, mx.bfloat16)
    layers = decoder_layers(target)  # the blocks, behind compiled layers on a CUDA GPU
    assert not verify_attention.install(target.model, layers, target.make_cache)
    monkeypatch.setattr(verify_attention, "split_attention", lambda: True)  # as on a CUDA GPU
    monkeypatch.setenv(ATTENTION_ENV, "auto")
    assert verify_attention.install(target.model, layers, target.make_cache)
    assert all(
        isinstance(layer.self_attn, ChunkedAttention)
        and layer.self_attn.half
        and layer.self_attn.unfused
        for layer in layers
    )


@pytest.mark.parametrize("shape", [(1, 4, 2, 9, 16), (1, 4, 4, 30, 16), (2, 8, 2, 40, 64)])
def test_matmul_attention_gives_the_fused_causal_attention(shape):
    b, h, kv, n, d = shape
    keys = mx.random.split(mx.random.key(n), 3)
    q = mx.random.normal((b, h, n, d), key=keys[0])
    k = mx.random.normal((b, kv, 50, d), key=keys[1])
    v = mx.random.normal((b, kv, 50, d), key=keys[2])
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=d**-0.5, mask="causal")
    got = verify_attention.matmul_attention(q, k, v, d**-0.5)
    assert got.shape == want.shape
    assert mx.allclose(got, want, atol=1e-5).item()


def set_wrappers(layers: list, **kwargs) -> None:
    """Wrap every layer's attention in `ChunkedAttention(**kwargs)`, or unwrap it (none)."""
    for layer in layers:
        attn = layer.self_attn
        inner = attn.attention if isinstance(attn, ChunkedAttention) else attn
        layer.self_attn = ChunkedAttention(inner, **kwargs) if kwargs else inner


@pytest.fixture
def half_target(monkeypatch, qwen3_target):
    """The tiny qwen3 in bfloat16, its decoder layers, and a list that hears every
    `matmul_attention` call (the query length, or the mask's shape where one is given)."""
    target = outrider.load(str(qwen3_target), mode="baseline").target
    cast_model(target.model, mx.bfloat16)
    layers = decoder_layers(target)
    calls = []
    matmul = verify_attention.matmul_attention

    def counted(q, k, v, scale, mask=None):
        calls.append(q.shape[2] if mask is None else mask.shape)
        return matmul(q, k, v, scale, mask)

    monkeypatch.setattr(verify_attention, "matmul_attention", counted)
    return target, layers, calls


def test_mid_size_half_precision_forwards_take_matmul_attention(half_target):
    """In half precision a verify, a prefix hit's suffix or a prefill's last chunk (2 rows to
    fewer than a prefill chunk) runs as matmul attention, with the model's own logits; one
    row and full prefill chunks keep MLX's kernels."""
    target, layers, calls = half_target
    prompt = list(range(5, 45))
    for rows in (1, 8, 40, verify_attention.UNFUSED_BELOW):
        ids = mx.array([5 + i % 250 for i in range(rows)], dtype=mx.uint32)
        out = []
        for wrap in (True, False):
            set_wrappers(layers, **({"unfused": True} if wrap else {}))
            cache = target.make_cache()
            target.prefill(prompt, cache)  # its chunk of 39 rows before the last token
            assert calls == ([39] * len(layers) if wrap else [])
            calls.clear()
            out.append(target.forward(ids, cache)[0].astype(mx.float32))
            if wrap:
                wrapped = list(calls)
                calls.clear()
        tol = 5e-2 * mx.abs(out[1]).max().item()
        assert fp32_close(out[0], out[1], atol=tol), f"{rows} rows"
        assert wrapped == ([rows] * len(layers) if rows in (8, 40) else []), f"{rows} rows"


def wrapped_and_not(target, layers: list, prompts: list, block: mx.array, calls: list) -> list:
    """One forward of `block` over the rows of `prompts` (prefilled; several rows merged into a
    batch, one row alone), with the half-precision wrappers on, then off: [(float32 logits,
    the `calls` that forward made)] for each."""
    out = []
    for wrap in (True, False):
        set_wrappers(layers, **({"half": True, "unfused": True} if wrap else {}))
        caches = []
        for ids in prompts:
            caches.append(target.make_cache())
            target.prefill(ids, caches[-1])
        calls.clear()  # the prefills' own chunks are not what is checked
        if len(prompts) > 1:
            logits = target.forward_rows(block, target.merge_rows(caches))[0]
        else:
            logits = target.forward(block[0], caches[0])[0]
        out.append((logits.astype(mx.float32), list(calls)))
    return out


def test_batched_half_precision_rows_take_matmul_attention(half_target):
    """A batch's multi-row forward (left-padded rows, each masked to its own columns) runs as
    matmul attention in half precision and gives the model's own logits for every row."""
    target, layers, calls = half_target
    prompts = [list(range(5, 5 + n)) for n in (9, 23, 14)]
    block = mx.array([[40 + r + c for c in range(5)] for r in range(3)], dtype=mx.uint32)
    (wrapped, heard), (own, _) = wrapped_and_not(target, layers, prompts, block, calls)
    assert heard == [(3, 1, 5, 23 + 5)] * len(layers)  # every row, its own mask
    tol = 5e-2 * mx.abs(own).max().item()
    assert fp32_close(wrapped, own, atol=tol)


# each hybrid family's tiny model, and where its layers keep their attention module
HYBRIDS = {"qwen3_5": "self_attn", "nemotron_h": "mixer", "lfm2": "self_attn"}


@pytest.fixture(scope="module", params=sorted(HYBRIDS))
def hybrid_target(request, tmp_path_factory):
    """A tiny hybrid: gated-delta (qwen3_5) or Mamba-2 (nemotron_h) layers between attention
    ones. Returns (its folder, the attribute its attention sits under)."""
    from outrider.testing import make_tiny_target

    family = request.param
    path = make_tiny_target(tmp_path_factory.mktemp("hybrid") / family, family=family)
    return path, HYBRIDS[family]


def attention_layers(target, attr: str) -> list:
    """The decoder layers whose `attr` is an attention module (wrapped or not)."""
    layers = decoder_layers(target)
    return [
        layer
        for layer in layers
        if isinstance(layer.get(attr), ChunkedAttention) or verify_attention.fits(layer.get(attr))
    ]


def test_a_hybrids_attention_layers_are_split_and_stay_lossless(
    monkeypatch, tmp_path, hybrid_target
):
    """Qwen3.5's attention layers (qwen3_next's gated layout) and Nemotron-H's (no rope) are
    wrapped and their recurrent ones left alone; DSpark and lookup still give plain greedy
    decoding at every cap."""
    from outrider.testing import make_tiny_drafter

    path, attr = hybrid_target
    monkeypatch.setenv(ATTENTION_ENV, "split")
    dspark = make_tiny_drafter(tmp_path / "ds", path, "dspark", "deepspec", block_size=8)
    pipes = [outrider.load(str(path), str(dspark), mode="dspark")]
    pipes.append(outrider.load(str(path), mode="lookup", target=pipes[0].target))
    target = pipes[0].target
    layers = decoder_layers(target)
    wrapped = [layer for layer in layers if isinstance(layer.get(attr), ChunkedAttention)]
    assert wrapped and len(wrapped) < len(layers)
    assert wrapped == attention_layers(target, attr)
    for pipe in pipes:
        for cap in (2, 5):
            ids = pipe.encode(PROMPTS[1])
            got = pipe.generate(ids, max_tokens=32, max_draft=cap, stop_tokens=set())
            assert got.tokens == plain_greedy(path, ids, 32), f"{pipe.mode} cap {cap}"


def test_a_hybrids_half_precision_attention_gives_its_own_output(hybrid_target):
    """The layouts re-stated (qwen3_next's gate split off the query projection, output times
    its sigmoid; Nemotron-H's attention without rope): after a 25-token prefix, 8 rows one
    per kernel call and 40 rows as matmul attention, and both bucketed (KV cache buffers of
    whole steps, rows padded), give the layer's own output in bfloat16
    (the module alone: Nemotron-H's experts do not run in bfloat16 on the CPU)."""
    from mlx_lm.models.cache import KVCache

    path, attr = hybrid_target
    target = outrider.load(str(path), mode="baseline").target
    attention = attention_layers(target, attr)[0][attr]
    if isinstance(attention, ChunkedAttention):  # wrapped at load, as on a CUDA GPU
        attention = attention.attention
    cast_model(attention, mx.bfloat16)
    width = target.config.get("hidden_size") or target.config["text_config"]["hidden_size"]
    x = mx.random.normal((1, 65, width), key=mx.random.key(3)).astype(mx.bfloat16)
    for rows in (8, 40):
        out = []
        for module in (
            ChunkedAttention(attention, half=True, unfused=True),
            ChunkedAttention(attention, half=True, unfused=True, buckets=Buckets()),
            attention,
        ):
            cache = KVCache()
            attention(x[:, :25], mask="causal", cache=cache)  # the same prefix for both
            out.append(module(x[:, 25 : 25 + rows], mask="causal", cache=cache))
        *wrapped, want = (o.astype(mx.float32) for o in out)
        tol = 5e-2 * mx.abs(want).max().item()
        for got in wrapped:  # one row per call or matmul attention; bucketed attention
            assert fp32_close(got, want, atol=tol), f"{rows} rows"
            assert not fp32_close(got, want * 1.5, atol=tol)  # the check can fail
