"""Split attention on Gemma-4 (mlx-lm gemma4_text): sliding windows, global layers, KV sharing.

`SharedKVAttention` re-states Gemma-4's attention around the keys its cache's update returns
and the mask the model made for the layer: a "causal" mark (a global layer; a sliding one
before its window fills) splits a verify's rows as `ChunkedAttention` does; a window's band
or a batch's mask (boolean arrays) goes to matmul attention as it is, in half precision. The
tiny models' windows are 8 tokens, so every prompt here wraps them. OUTRIDER_ATTENTION=split
forces the wrappers on the CPU.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from conftest import PROMPTS, decoder_layers, fp32_close, plain_greedy
from mlx_lm.generate import generate_step
from mlx_lm.models.cache import QuantizedKVCache

import outrider
from outrider.core.device import ATTENTION_ENV
from outrider.plugins.targets import verify_attention
from outrider.plugins.targets.verify_attention import ChunkedAttention, SharedKVAttention
from outrider.testing import SLIDING_WINDOW, cast_model, make_tiny_target

# The tiny Gemma-4 (sliding, global) x 2, and one with what larger Gemma-4s add: global layers
# with k = v (and their own KV-head count), and a last (sliding, global) pair that reads the
# keys and values of the last earlier layer of its kind.
MODELS = {
    "gemma4_text": {},
    "shared_kv": {
        "num_hidden_layers": 6,
        "layer_types": ["sliding_attention", "full_attention"] * 3,
        "num_kv_shared_layers": 2,
        "attention_k_eq_v": True,
        "num_global_key_value_heads": 2,
    },
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def gemma4_path(request, tmp_path_factory):
    return make_tiny_target(
        tmp_path_factory.mktemp("g4split") / request.param,
        family="gemma4_text",
        **MODELS[request.param],
    )


def rewrap(target, dtype: mx.Dtype) -> list:
    """Cast the target to `dtype` and install the wrappers again, as loading a model of that
    dtype does (the probe included); returns its decoder layers."""
    layers = decoder_layers(target)
    unwrap(layers)
    cast_model(target.model, dtype)
    installed = verify_attention.install(target.model, layers, target.make_cache)
    if not installed and mx.default_device() == mx.gpu:
        # On the H200 the tiny bfloat16 Gemma-4's verify logits through matmul attention part
        # from MLX's own by ~10% of the largest logit, and MLX's own from float32 as far: the
        # probe keeps MLX's attention, every layer as it was (docs/testing-on-gpu.md).
        assert not any(isinstance(layer.self_attn, ChunkedAttention) for layer in layers)
        pytest.skip("the probe kept MLX's own attention for the tiny bfloat16 Gemma-4 here")
    assert installed
    return layers


def unwrap(layers: list) -> None:
    for layer in layers:
        if isinstance(layer.self_attn, ChunkedAttention):
            layer.self_attn = layer.self_attn.attention


@pytest.fixture
def calls(monkeypatch):
    """Every re-stated attention call: ("matmul", rows, keys, the mask's shape or None) or
    ("chunks", rows, keys, rows per kernel call)."""
    heard = []
    matmul, chunks = verify_attention.matmul_attention, verify_attention.chunked_causal_attention

    def counted_matmul(q, k, v, scale, mask=None):
        heard.append(("matmul", q.shape[2], k.shape[2], None if mask is None else mask.shape))
        return matmul(q, k, v, scale, mask)

    def counted_chunks(q, k, v, scale, chunk=None):
        heard.append(("chunks", q.shape[2], k.shape[2], chunk))
        return chunks(q, k, v, scale, chunk)

    monkeypatch.setattr(verify_attention, "matmul_attention", counted_matmul)
    monkeypatch.setattr(verify_attention, "chunked_causal_attention", counted_chunks)
    return heard


@pytest.fixture
def half_gemma4(monkeypatch, gemma4_path):
    """The tiny Gemma-4 loaded with OUTRIDER_ATTENTION=split, then cast to bfloat16 and
    wrapped again; (target, decoder layers)."""
    monkeypatch.setenv(ATTENTION_ENV, "split")
    target = outrider.load(str(gemma4_path), mode="baseline").target
    return target, rewrap(target, mx.bfloat16)


def test_every_gemma4_attention_layer_is_wrapped_and_each_call_takes_its_path(half_gemma4, calls):
    """Sliding layers past their window get the model's band mask into matmul attention
    (verify rows too: they see different keys); global layers split a verify one row per
    kernel call and run a wider forward as causal matmul attention; KV-shared layers take the
    path of the layer they read. One row and a full 512-row prefill chunk keep MLX's own."""
    target, layers = half_gemma4
    assert all(isinstance(layer.self_attn, SharedKVAttention) for layer in layers)
    assert all(layer.self_attn.half and layer.self_attn.unfused for layer in layers)
    pairs = len(layers) // 2  # (sliding, global) in turn
    cache = target.make_cache()
    target.prefill(list(range(5, 25)), cache)  # 19 rows, then the last token alone
    assert calls == [("matmul", 19, 19, (19, 19)), ("matmul", 19, 19, None)] * pairs
    calls.clear()
    window = SLIDING_WINDOW - 1  # the keys a wrapped window keeps before the new rows
    for rows, done in ((8, 20), (20, 28)):
        target.forward(mx.array(list(range(30, 30 + rows)), dtype=mx.uint32), cache)
        band = ("matmul", rows, window + rows, (rows, window + rows))
        wide = ("chunks", rows, done + rows, 1) if rows <= 16 else ("matmul", rows, 48, None)
        assert calls == [band, wide] * pairs, f"{rows} rows"
        calls.clear()
    for rows in (1, verify_attention.UNFUSED_BELOW):
        target.forward(mx.array([7] * rows, dtype=mx.uint32), cache)
        assert calls == [], f"{rows} rows"


def test_gemma4_verify_logits_match_the_models_own_after_the_window_wraps(half_gemma4):
    """After a prefill that wrapped every window and one plain step (which rotates it), an
    8-row verify and a 20-row forward give the model's own bfloat16 logits."""
    target, layers = half_gemma4
    prompt = target.tokenizer.encode(PROMPTS[1])
    assert len(prompt) > 2 * SLIDING_WINDOW
    out = []
    for wrapped in (True, False):
        if not wrapped:
            unwrap(layers)
        cache = target.make_cache()
        target.prefill(prompt, cache)
        target.forward(mx.array([11], dtype=mx.uint32), cache)
        verify = target.forward(mx.array(list(range(40, 48)), dtype=mx.uint32), cache)[0]
        wide = target.forward(mx.array(list(range(50, 70)), dtype=mx.uint32), cache)[0]
        out.append(mx.concatenate([verify, wide]).astype(mx.float32))
    got, want = out
    tol = 5e-2 * mx.abs(want).max().item()
    assert fp32_close(got, want, atol=tol)
    assert not fp32_close(got, want * 1.5, atol=tol)  # the check can fail


def own_greedy(model, ids: list[int], n: int) -> list[int]:
    """The loaded model's own plain greedy decoding (mlx-lm's, one row a step)."""
    out = []
    for token, _ in generate_step(mx.array(ids), model, max_tokens=n):
        out.append(int(token))
    return out[:n]


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_gemma4_speculative_decoding_stays_lossless_with_split_attention(
    monkeypatch, tmp_path, gemma4_path, calls, dtype
):
    """DSpark and lookup on a wrapped Gemma-4 give its plain greedy decoding at caps 2 and 5,
    its windows wrapped all along: in float32 global layers split verify rows into 3-row
    chunks (banded windows keep MLX's call); in bfloat16 verify rows also take the windows'
    bands as matmul attention, and the reference is the bfloat16 model's own decoding."""
    from outrider.testing import make_tiny_drafter

    monkeypatch.setenv(ATTENTION_ENV, "split")
    dspark = make_tiny_drafter(tmp_path / "ds", gemma4_path, "dspark", block_size=8)
    pipes = [outrider.load(str(gemma4_path), str(dspark), mode="dspark")]
    pipes.append(outrider.load(str(gemma4_path), mode="lookup", target=pipes[0].target))
    target = pipes[0].target
    ids = pipes[0].encode(PROMPTS[2])
    if dtype == mx.float32:
        want = plain_greedy(gemma4_path, ids, 32)
    else:
        unwrap(decoder_layers(target))
        cast_model(target.model, dtype)
        want = own_greedy(target.model, ids, 32)
        rewrap(target, dtype)
    assert all(isinstance(x.self_attn, SharedKVAttention) for x in decoder_layers(target))
    for pipe in pipes:
        for cap in (2, 5):
            calls.clear()
            got = pipe.generate(ids, max_tokens=32, max_draft=cap, stop_tokens=set())
            assert got.tokens == want, f"{pipe.mode} cap {cap}"
            verify = [c for c in calls if 1 < c[1] <= cap + 1]  # not the prompt's chunk
            if dtype == mx.float32:  # 2 and 3 rows are one kernel call: MLX's own
                assert all(c[0] == "chunks" and c[3] == 3 for c in verify)
                assert verify or cap < 3
            else:
                bands = [c for c in verify if c[0] == "matmul" and len(c[3] or ()) == 2]
                assert bands and all(c[2] == SLIDING_WINDOW - 1 + c[1] for c in bands)


def test_batched_gemma4_rows_take_matmul_attention_with_the_models_masks(half_gemma4, calls):
    """Batched rows (a `WindowRows` for the sliding layers, a `BatchKVCache` for the global
    ones), shorter and longer than the window: a verify block, then per-row rollback and
    another block, run as matmul attention under the model's own masks and give the model's
    own logits for every row."""
    target, layers = half_gemma4
    prompts = [list(range(5, 5 + n)) for n in (3, 9, 14)]
    block = mx.array([[40 + r + c for c in range(5)] for r in range(3)], dtype=mx.uint32)
    out = []
    for wrapped in (True, False):
        if not wrapped:
            unwrap(layers)
        caches = []
        for ids in prompts:
            caches.append(target.make_cache())
            target.prefill(ids, caches[-1])
        rows = target.merge_rows(caches)
        target.forward_rows(block[:, :1], rows)  # one column: every window rotates
        calls.clear()
        first = target.forward_rows(block, rows)[0]
        target.rollback_rows(rows, [1, 4, 2])
        second = target.forward_rows(block[:, :4], rows)[0]
        out.append(mx.concatenate([first, second], axis=1).astype(mx.float32))
        if wrapped:
            assert {c[0] for c in calls} == {"matmul"}
            masks = [c[3] for c in calls]
            assert masks[: len(layers)] == [
                (3, 1, 5, SLIDING_WINDOW - 1 + 5) if i % 2 == 0 else (3, 1, 5, 14 + 1 + 5)
                for i in range(len(layers))
            ]
            assert all(m[:3] == (3, 1, 4) for m in masks[len(layers) :])
            assert len(calls) == 2 * len(layers)
    got, want = out
    tol = 5e-2 * mx.abs(want).max().item()
    assert fp32_close(got, want, atol=tol)
    assert not fp32_close(got, want * 1.5, atol=tol)  # the check can fail


@pytest.mark.parametrize("window", [SLIDING_WINDOW, 300])
def test_a_probe_that_ignores_the_window_keeps_gemma4s_attention(monkeypatch, tmp_path, window):
    """A matmul attention that drops the window's band (every earlier key seen) parts the
    probe's logits: install leaves every layer as it was. A window longer than the probe's
    first 32 tokens (as real Gemma-4's 512 and 1024 are) is filled past first, in chunks,
    and the band is checked after it wraps."""
    monkeypatch.setenv(ATTENTION_ENV, "split")
    path = make_tiny_target(tmp_path / "g4", family="gemma4_text", sliding_window=window)
    target = outrider.load(str(path), mode="baseline").target
    layers = decoder_layers(target)
    unwrap(layers)
    cast_model(target.model, mx.bfloat16)
    matmul = verify_attention.matmul_attention
    bands = []

    def windowless(q, k, v, scale, mask=None):
        if mask is not None and mask.ndim == 2:
            bands.append(mask.shape)
            mask = None
        return matmul(q, k, v, scale, mask)

    monkeypatch.setattr(verify_attention, "matmul_attention", windowless)
    assert not verify_attention.install(target.model, layers, target.make_cache)
    assert not any(isinstance(layer.self_attn, ChunkedAttention) for layer in layers)
    # the probe's forwards after the fill: a verify and a wider one over the wrapped window
    assert bands[-4:] == [(8, window + 7)] * 2 + [(20, window + 19)] * 2


def test_quantized_kv_and_cacheless_calls_pass_through(half_gemma4, calls):
    """A quantized KV cache (--kv-bits: mlx-lm's own quantized attention) and a call without
    a cache go to the wrapped module unchanged."""
    target, layers = half_gemma4
    x = mx.random.normal((1, 12, target.config["hidden_size"]), key=mx.random.key(1))
    x = x.astype(mx.bfloat16)
    wrapper = layers[1].self_attn  # a global layer
    for make in (lambda: QuantizedKVCache(group_size=32, bits=8), lambda: None):
        out = []
        for module in (wrapper, wrapper.attention):
            cache = make()
            if cache is not None:
                module(x[:, :4], mask="causal", cache=cache)
            out.append(module(x[:, 4:], mask="causal", cache=cache)[0])
        assert calls == []
        assert mx.array_equal(out[0], out[1]).item()
    wrapper(x[:, 4:], mask="causal", cache=target.make_cache()[1])  # its own KV cache
    assert calls == [("chunks", 8, 8, 1)]  # so the check can fail


def test_mlx_vlms_gemma4_tower_keeps_its_attention(monkeypatch, tmp_path):
    """The multimodal checkpoint's language tower (mlx-vlm's own attention class) is not a
    layout the wrappers know: loading it leaves it alone."""
    monkeypatch.setenv(ATTENTION_ENV, "split")
    path = make_tiny_target(tmp_path / "vlm", family="gemma4", seed=2)
    target = outrider.load(str(path), mode="baseline").target
    layers = decoder_layers(target)
    assert layers and not any(isinstance(layer.self_attn, ChunkedAttention) for layer in layers)
    assert not verify_attention.fits(layers[0].self_attn)
