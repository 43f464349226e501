"""Bucketed attention: half-precision multi-row calls at a few fixed shapes stay exact.

On a CUDA GPU a half-precision forward of 3 to 511 rows over a plain KV cache runs at a
bucketed shape (query rows padded, keys padded to the cache's buffer of whole 256-key steps,
a causal softmax that gives every padded key weight zero), so MLX reuses its kernels instead of
meeting a new shape every round (plugins/targets/verify_attention.py). OUTRIDER_ATTENTION=split
installs it here on the CPU, where the arithmetic is the same as the GPU's but for the softmax
kernel, which a CUDA-only test checks against the CPU's form.
"""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import pytest
from conftest import PROMPTS, decoder_layers, fp32_close, plain_greedy
from mlx_lm.models.cache import KVCache

import outrider
from outrider.core.device import (
    ATTENTION_ENV,
    BUCKETS_ENV,
    KERNELS_ENV,
    attention_buckets,
    batch_buckets,
    fused_attention,
    on_cuda_gpu,
)
from outrider.core.errors import OutriderError
from outrider.plugins.targets import verify_attention
from outrider.plugins.targets.attention_forms import (
    KEY_STEP,
    Buckets,
    bucket_buffers,
    bucket_rows,
    bucketed_attention,
    reserve,
)
from outrider.plugins.targets.verify_attention import ChunkedAttention
from outrider.testing import make_tiny_target


def filled_cache(prefix: int, rows: int, dtype=mx.float32, seed: int = 0):
    """A KVCache holding `prefix` keys laid as a restored prefix leaves them (buffers exactly
    that long), then `rows` more added the way the wrapper adds them; and the queries."""
    keys = mx.random.split(mx.random.key(seed), 5)
    cache = KVCache()
    cache.keys = mx.random.normal((1, 2, prefix, 32), key=keys[0]).astype(dtype)
    cache.values = mx.random.normal((1, 2, prefix, 32), key=keys[1]).astype(dtype)
    cache.offset = prefix
    reserve(cache, rows)
    k = mx.random.normal((1, 2, rows, 32), key=keys[2]).astype(dtype)
    v = mx.random.normal((1, 2, rows, 32), key=keys[3]).astype(dtype)
    cache.update_and_fetch(k, v)
    q = mx.random.normal((1, 8, rows, 32), key=keys[4]).astype(dtype)
    return cache, q


@pytest.mark.parametrize("prefix,rows", [(40, 3), (255, 5), (300, 8), (511, 17), (700, 97)])
def test_bucketed_attention_is_the_causal_attention(prefix, rows):
    cache, q = filled_cache(prefix, rows, seed=prefix)
    s = prefix + rows
    k, v = cache.keys[..., :s, :], cache.values[..., :s, :]
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.2, mask="causal")
    got = bucketed_attention(q, cache, 0.2, Buckets())
    assert got.shape == want.shape
    assert mx.allclose(got, want, atol=1e-5).item(), f"{prefix}+{rows}"
    # the check can fail: attention that forgets the causal limit parts from it
    loose = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.2)
    assert not mx.allclose(loose, want, atol=1e-3).item()
    # the buffers are whole steps; the cache's own view of its keys is unchanged
    assert cache.keys.shape[2] % KEY_STEP == 0 and cache.keys.shape[2] >= s
    assert mx.array_equal(cache.keys_and_values()[0], k).item()


def test_reserve_and_bucket_buffers_keep_the_cache_and_whole_steps():
    cache, _ = filled_cache(300, 5)  # a restored 300 keys: reserve laid them into 512
    assert cache.keys.shape[2] == 512 and cache.offset == 305
    before = [mx.array(a) for a in cache.keys_and_values()]
    keys, values = bucket_buffers(cache)
    assert keys is cache.keys and values is cache.values  # already bucketed: no copy
    # a buffer mlx-lm grew from an offset off the step (300 + 256) is re-laid into 512
    cache.keys = mx.pad(cache.keys[..., :305, :], [(0, 0), (0, 0), (0, 251), (0, 0)])
    cache.values = mx.pad(cache.values[..., :305, :], [(0, 0), (0, 0), (0, 251), (0, 0)])
    keys, values = bucket_buffers(cache)
    assert keys.shape[2] == values.shape[2] == 512 and cache.keys is keys
    assert all(mx.array_equal(a, b).item() for a, b in zip(cache.keys_and_values(), before))
    # an empty cache is mlx-lm's to allocate
    empty = KVCache()
    reserve(empty, 7)
    assert empty.keys is None


def test_the_mask_sees_each_rows_own_keys_and_no_padding():
    mask = Buckets().mask(s=10, n=3, rows=8, keys=256)
    assert mask.shape == (8, 256)
    seen = [int(mask[i].sum().item()) for i in range(8)]
    assert seen == [8, 9, 10, 10, 10, 10, 10, 10]  # rows 0-2 causal; padded rows every real key
    assert not mask[:, 10:].any().item()


@pytest.mark.parametrize("n,rows", [(3, 8), (8, 8), (9, 16), (16, 16), (17, 32), (97, 112)])
def test_rows_pad_to_few_shapes(n, rows):
    assert bucket_rows(n) == rows


def test_the_switch_follows_the_environment(monkeypatch):
    from outrider import doctor

    monkeypatch.delenv(BUCKETS_ENV, raising=False)
    monkeypatch.setenv(ATTENTION_ENV, "split")
    assert attention_buckets()
    assert doctor.doctor_report()["attention_buckets"] is True
    monkeypatch.setenv(ATTENTION_ENV, "native")  # nothing rerouted, nothing bucketed
    assert doctor.doctor_report()["attention_buckets"] is False
    assert not batch_buckets()  # `on`: one sequence's cache only
    monkeypatch.setenv(BUCKETS_ENV, "off")
    assert not attention_buckets() and not batch_buckets()
    monkeypatch.setenv(BUCKETS_ENV, "all")
    assert attention_buckets() and batch_buckets()
    monkeypatch.setenv(BUCKETS_ENV, "maybe")
    with pytest.raises(OutriderError, match="OUTRIDER_ATTENTION_BUCKETS must be on, all or off"):
        attention_buckets()


@pytest.mark.skipif(not on_cuda_gpu(), reason="the softmax kernel is CUDA's (mx.fast.cuda_kernel)")
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16, mx.float32])
def test_the_cuda_softmax_kernel_gives_the_masked_softmax(dtype):
    """The one-pass kernel equals `mx.where` + `mx.softmax(precise=True)` to a rounding of the
    output type, and weighs padded keys exactly zero."""
    scores = (4 * mx.random.normal((1, 2, 4 * 16, 512), key=mx.random.key(1))).astype(dtype)
    got = Buckets(kernel=True).softmax(scores, s=300, n=11, rows=16)
    mask = Buckets().mask(s=300, n=11, rows=16, keys=512)  # stacked rows: 4 heads of 16
    stacked = scores.reshape(1, 2, 4, 16, 512)
    want = mx.softmax(mx.where(mask, stacked, -mx.inf), axis=-1, precise=True).reshape(scores.shape)
    assert got.dtype == dtype and got.shape == want.shape
    assert mx.allclose(got.astype(mx.float32), want.astype(mx.float32), atol=4e-3).item()
    assert (got[..., 300:] == 0).all().item()


@pytest.mark.skipif(not on_cuda_gpu(), reason="the fused kernels are CUDA's (mx.fast.cuda_kernel)")
@pytest.mark.parametrize(
    "b,heads,kv_heads,n,d,s,dtype",
    [
        (1, 32, 8, 5, 128, 261, mx.bfloat16),  # an 8B verify of cap 4
        (1, 32, 8, 16, 128, 4229, mx.bfloat16),  # 64 vectors a KV head, a long context
        (1, 64, 8, 8, 128, 300, mx.bfloat16),  # 8 query heads a KV head (a 32B's)
        (2, 8, 2, 3, 64, 64, mx.float16),  # two batch rows, one tile exactly
        (1, 16, 16, 4, 128, 5, mx.bfloat16),  # no grouping, one key before the rows
        (1, 4, 4, 1, 64, 100, mx.bfloat16),  # one row
    ],
)
def test_the_fused_cuda_attention_is_the_causal_attention(b, heads, kv_heads, n, d, s, dtype):
    """Two kernels' attention of n rows over the first s keys of longer buffers equals float32
    matmul attention to the activation type's rounding; keys past s (here large) never count."""
    from outrider.plugins.targets.attention_forms import matmul_attention
    from outrider.plugins.targets.fused_attention import MAX_KEYS, FusedAttention

    room = whole_steps_past(s)
    r = mx.random.split(mx.random.key(s), 3)
    q = mx.random.normal((b, heads, n, d), key=r[0]).astype(dtype)
    keys = mx.random.normal((b, kv_heads, room, d), key=r[1]).astype(dtype)
    values = mx.random.normal((b, kv_heads, room, d), key=r[2]).astype(dtype)
    junk = mx.full((b, kv_heads, room - s, d), 50.0, dtype=dtype)  # what a buffer may hold
    keys = mx.concatenate([keys[:, :, :s], junk], axis=2)
    values = mx.concatenate([values[:, :, :s], junk], axis=2)
    fused = FusedAttention()
    assert fused.takes(q, keys, min(s, MAX_KEYS))  # right past MAX_KEYS too, only slower
    got = fused(q, keys, values, s, d**-0.5)
    f32 = lambda a: a.astype(mx.float32)  # noqa: E731
    want = matmul_attention(f32(q), f32(keys[:, :, :s]), f32(values[:, :, :s]), d**-0.5)
    assert got.shape == want.shape and got.dtype == dtype
    assert (mx.abs(f32(got) - want).max() / mx.abs(want).max()).item() <= 1e-2


def test_the_fused_kernels_are_asked_for_by_name(monkeypatch):
    """OUTRIDER_ATTENTION_KERNELS: `fused` (the default) or `softmax`; doctor says which, and a
    wrong value is named."""
    from outrider import doctor

    def shown(kernels):  # what doctor says: the kernels where they run, else that none do
        return kernels if on_cuda_gpu() else f"none here ({kernels} on CUDA)"

    monkeypatch.delenv(KERNELS_ENV, raising=False)
    assert fused_attention() and doctor.doctor_report()["attention_kernels"] == shown("fused")
    assert Buckets(kernel=False, fused=True).fused is None  # no CUDA kernels: none of them
    monkeypatch.setenv(KERNELS_ENV, "softmax")
    assert not fused_attention()
    assert doctor.doctor_report()["attention_kernels"] == shown("softmax")
    monkeypatch.setenv(KERNELS_ENV, "flash")
    with pytest.raises(OutriderError, match="OUTRIDER_ATTENTION_KERNELS must be fused or softmax"):
        fused_attention()


def whole_steps_past(s: int) -> int:
    """A buffer length of whole KEY_STEPs with room past s."""
    return (s // KEY_STEP + 1) * KEY_STEP


def test_the_fused_attention_takes_what_its_shared_memory_holds():
    """Half precision, heads of 64 or 128, at most 64 query vectors a KV head, at most
    MAX_KEYS keys; the rest keeps the softmax kernel's bucketed attention (this check needs no
    GPU)."""
    from outrider.plugins.targets.fused_attention import MAX_KEYS, FusedAttention

    def takes(heads, kv_heads, n, d, dtype=mx.bfloat16, s=200):
        q = mx.zeros((1, heads, n, d), dtype=dtype)
        return FusedAttention.takes(q, mx.zeros((1, kv_heads, 256, d), dtype=dtype), s)

    assert takes(32, 8, 16, 128) and takes(64, 8, 8, 64) and takes(4, 4, 3, 64, mx.float16)
    assert not takes(32, 8, 17, 128)  # 68 query vectors
    assert not takes(8, 2, 3, 256)  # a head of 256
    assert not takes(8, 2, 3, 128, mx.float32)
    assert takes(32, 8, 5, 128, s=MAX_KEYS) and not takes(32, 8, 5, 128, s=MAX_KEYS + 1)


@pytest.fixture(scope="module")
def bf16_target(tmp_path_factory):
    """The tiny qwen3 with its weights stored in bfloat16 (what a half-precision checkpoint
    loads as)."""
    path = make_tiny_target(tmp_path_factory.mktemp("bf16") / "qwen3", family="qwen3", seed=7)
    weights = mx.load(str(path / "model.safetensors"))  # the file's, not a loaded (wrapped) model's
    weights = {k: v.astype(mx.bfloat16) for k, v in weights.items()}
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "mlx"})
    return path


def test_half_precision_forwards_take_bucketed_attention(monkeypatch, bf16_target):
    """Loaded with rerouted attention, a bfloat16 model's forwards of 3+ rows over a restored
    cache run bucketed with the model's own logits; two rows, one row and
    OUTRIDER_ATTENTION_BUCKETS=off do not."""
    monkeypatch.setenv(ATTENTION_ENV, "split")
    calls = []
    real = verify_attention.bucketed_attention

    def counted(q, cache, scale, buckets):
        calls.append(q.shape[2])
        return real(q, cache, scale, buckets)

    monkeypatch.setattr(verify_attention, "bucketed_attention", counted)
    reserved = []
    real_reserve = verify_attention.reserve

    def reserve_counted(cache, n):
        reserved.append(n)
        return real_reserve(cache, n)

    monkeypatch.setattr(verify_attention, "reserve", reserve_counted)
    target = outrider.load(str(bf16_target), mode="baseline").target
    layers = decoder_layers(target)
    assert all(isinstance(x.self_attn, ChunkedAttention) and x.self_attn.buckets for x in layers)
    prompt = target.tokenizer.encode(PROMPTS[1])
    for rows in (1, 2, 3, 9, 40):
        ids = mx.array([5 + i % 200 for i in range(rows)], dtype=mx.uint32)
        out = []
        for wrapped in (True, False):
            own = [x.self_attn for x in layers]
            if not wrapped:
                for x in layers:
                    x.self_attn = x.self_attn.attention
            cache = target.make_cache()
            target.prefill(prompt, cache)
            calls.clear()
            reserved.clear()
            out.append(target.forward(ids, cache)[0].astype(mx.float32))
            heard = list(calls)
            for x, a in zip(layers, own):
                x.self_attn = a
            if wrapped:
                assert heard == ([rows] * len(layers) if rows >= 3 else []), f"{rows} rows"
                assert reserved == heard  # room made before each bucketed update
        tol = 5e-2 * mx.abs(out[1]).max().item()
        assert fp32_close(out[0], out[1], atol=tol), f"{rows} rows"
    # a padded score matrix past UNFUSED_SCORES (a long context) keeps the other paths
    monkeypatch.setattr(verify_attention, "UNFUSED_SCORES", 1000)
    cache = target.make_cache()
    target.prefill(prompt, cache)
    calls.clear()
    target.forward(mx.array(list(range(5, 14)), dtype=mx.uint32), cache)
    assert calls == []
    monkeypatch.setenv(BUCKETS_ENV, "off")
    target = outrider.load(str(bf16_target), mode="baseline").target
    assert all(x.self_attn.buckets is None for x in decoder_layers(target))


def test_bucketed_verify_is_lossless(monkeypatch, tmp_path, bf16_target):
    """Every mode over the bfloat16 target, its verify rows and prompt chunks bucketed, gives
    mlx-lm's plain greedy tokens (mlx-lm's own attention, no wrapper). On a GPU, where
    mlx-lm's fused attention keeps its weights in float32 and the bucketed form rounds them to
    bfloat16, the two may part where two logits tie in bfloat16 (the benchmark's rule,
    `check_lossless`; GPU run 11 parted once at token 32); on the CPU they agree exactly."""
    from outrider.benchmark.runner import check_lossless
    from outrider.testing import make_tiny_drafter

    monkeypatch.setenv(ATTENTION_ENV, "split")
    dspark = make_tiny_drafter(tmp_path / "ds", bf16_target, "dspark", "deepspec", block_size=8)
    pipes = [outrider.load(str(bf16_target), str(dspark), mode="dspark")]
    pipes.append(outrider.load(str(bf16_target), mode="lookup", target=pipes[0].target))
    assert all(x.self_attn.buckets for x in decoder_layers(pipes[0].target))
    for pipe in pipes:
        for cap in (2, 7):  # verifies of 3 and 8 rows
            for prompt in PROMPTS[:2]:
                ids = pipe.encode(prompt)
                want = plain_greedy(bf16_target, ids, 40)
                got = pipe.generate(ids, max_tokens=40, max_draft=cap, stop_tokens=set())
                where = {"mode": pipe.mode, "suite": f"cap {cap}", "prompt": prompt, "trial": 0}
                tie = check_lossless(pipe.target, ids, got.tokens, want, where)  # else raises
                assert tie is None or mx.default_device() == mx.gpu, (where, tie)


def test_a_fake_cache_is_enough_for_the_benchmark():
    """benchmarks/verify_forward_ablation.py times bucketed attention over a bare namespace
    holding a cache's buffers and offset: the function reads nothing else."""
    cache, q = filled_cache(200, 4)
    fake = SimpleNamespace(keys=cache.keys, values=cache.values, offset=cache.offset)
    a = bucketed_attention(q, cache, 0.2, Buckets())
    b = bucketed_attention(q, fake, 0.2, Buckets())
    assert mx.array_equal(a, b).item()


@pytest.mark.parametrize("kernel", ["raises", "wrong"])
def test_a_softmax_kernel_that_fails_the_probe_gives_way_to_mlxs_own(
    monkeypatch, bf16_target, kernel
):
    """Where the CUDA softmax kernel cannot be built or run, or gives other weights than the
    softmax, the load's probe drops the kernel and keeps bucketed attention with MLX's own
    ops, rather than every rerouted path (on a CPU, told it is on a CUDA GPU, as on one)."""
    monkeypatch.setenv(ATTENTION_ENV, "split")
    monkeypatch.setenv(KERNELS_ENV, "fused")  # the fused kernels are tried, and dropped, first
    monkeypatch.setattr(verify_attention, "on_cuda_gpu", lambda: True)
    if kernel == "raises":

        def unbuildable(name, input_names, output_names, source):
            def run(*args, **kwargs):  # MLX compiles a kernel at its first call
                raise RuntimeError("NVRTC compilation failed")

            return run

        monkeypatch.setattr(mx.fast, "cuda_kernel", unbuildable)
    else:

        def uniform(name, input_names, output_names, source):
            def run(inputs, output_shapes, output_dtypes, **_):
                shape, dtype = output_shapes[0], output_dtypes[0]
                return [mx.full(shape, 1.0 / shape[-1], dtype=dtype)]

            return run

        monkeypatch.setattr(mx.fast, "cuda_kernel", uniform)
    target = outrider.load(str(bf16_target), mode="baseline").target
    layers = decoder_layers(target)
    assert all(isinstance(x.self_attn, ChunkedAttention) for x in layers)
    buckets = {id(x.self_attn.buckets) for x in layers}
    assert len(buckets) == 1 and layers[0].self_attn.buckets.kernel is None
    assert layers[0].self_attn.buckets.fused is None  # the fused kernels went first


def test_a_batchs_rows_bucketed_give_each_rows_own_logits(monkeypatch, bf16_target):
    """With OUTRIDER_ATTENTION_BUCKETS=all a batch's multi-row forward (left-padded rows of
    three lengths, each masked to its own columns) runs bucketed, and every row's logits are
    that row's alone; with `on` the batch keeps matmul attention."""
    monkeypatch.setenv(ATTENTION_ENV, "split")
    calls = []
    real = verify_attention.bucketed_rows_attention

    def counted(q, cache, mask, scale, buckets):
        calls.append(mask.shape)
        return real(q, cache, mask, scale, buckets)

    monkeypatch.setattr(verify_attention, "bucketed_rows_attention", counted)
    prompts = [list(range(5, 5 + n)) for n in (9, 23, 14)]
    block = mx.array([[40 + r + c for c in range(5)] for r in range(3)], dtype=mx.uint32)
    for choice in ("all", "on"):
        monkeypatch.setenv(BUCKETS_ENV, choice)
        target = outrider.load(str(bf16_target), mode="baseline").target
        layers = decoder_layers(target)
        caches = []
        for ids in prompts:
            caches.append(target.make_cache())
            target.prefill(ids, caches[-1])
        calls.clear()
        batched = target.forward_rows(block, target.merge_rows(caches))[0].astype(mx.float32)
        assert calls == ([(3, 1, 5, 28)] * len(layers) if choice == "all" else []), choice
        for i, ids in enumerate(prompts):
            alone = target.forward(
                mx.array(ids + block[i].tolist(), dtype=mx.uint32), target.make_cache()
            )[0]
            alone = alone[-5:].astype(mx.float32)
            tol = 5e-2 * mx.abs(alone).max().item()
            assert fp32_close(batched[i], alone, atol=tol), f"{choice}: row {i}"
            assert not fp32_close(batched[(i + 1) % 3], alone, atol=tol)  # rows differ


def test_batched_generation_with_bucketed_rows_equals_each_request_alone(
    monkeypatch, tmp_path, bf16_target
):
    """generate_batch over the bfloat16 target with every multi-row forward bucketed (rows
    joining as others finish) gives each prompt's own greedy tokens."""
    from outrider.testing import make_tiny_drafter

    monkeypatch.setenv(ATTENTION_ENV, "split")
    monkeypatch.setenv(BUCKETS_ENV, "all")
    dspark = make_tiny_drafter(tmp_path / "ds", bf16_target, "dspark", "deepspec", block_size=8)
    pipe = outrider.load(str(bf16_target), str(dspark), mode="dspark", max_draft=4)
    assert all(x.self_attn.batches for x in decoder_layers(pipe.target))
    prompts = [pipe.encode(p) for p in PROMPTS[:3]]
    got = pipe.generate_batch(prompts, max_batch=2, max_tokens=24, stop_tokens=set())
    for ids, result in zip(prompts, got):
        assert result.tokens == plain_greedy(bf16_target, ids, 24)
