"""Quantized products of a few rows through a kernel of outrider's own (core/row_kernels.py,
plugins/kernels/cuda_rows.py).

On the CPU the CUDA kernel cannot run, so these tests use a kernel written in MLX's ops that
computes what the CUDA kernel computes (every weight dequantized to float32, the products
summed in float32, the result rounded once to the activation type) to check what stands
around it: which products reach the kernel, the load's probe, the setting, and that every
mode's greedy output through it equals plain decoding. The CUDA kernel itself (its choice of
form and launch, and on a CUDA GPU its products) is tests/test_cuda_rows.py's.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from conftest import PROMPTS
from mlx.utils import tree_flatten

import outrider
from outrider.core import row_kernels
from outrider.core.device import on_cuda_gpu
from outrider.testing import build_model, tiny_config


class ReferenceRows:
    """The CUDA kernel's arithmetic in MLX's ops, runnable anywhere; counts its calls."""

    name = "reference-rows"
    min_rows = 1
    max_rows = 8

    def __init__(self, wrong: bool = False) -> None:
        self.calls: list[int] = []
        self.wrong = wrong  # a planted mistake: each group read with its neighbour's scales

    def available(self) -> bool:
        return True

    def supports(self, width: int, bits: int, group_size: int, dtype: mx.Dtype) -> bool:
        return bits in (4, 8) and width % group_size == 0

    def preferred(self, width: int, bits: int, group_size: int, dtype: mx.Dtype) -> bool:
        return False  # measured slower than MLX's: `auto` keeps MLX's products

    def __call__(self, x, w, scales, biases, group_size, bits):
        self.calls.append(x.size // x.shape[-1])
        if self.wrong:
            scales = mx.roll(scales, 1, axis=-1)
        dense = mx.dequantize(
            w, scales.astype(mx.float32), biases.astype(mx.float32), group_size, bits
        )
        return (x.astype(mx.float32) @ dense.T).astype(x.dtype)


class GroupedReference(ReferenceRows):
    """ReferenceRows that also computes sibling layers' products in one call (`grouped`, as
    the CUDA kernel's tensor-core form does); counts those calls apart."""

    def __init__(self, wrong: bool = False) -> None:
        super().__init__()
        self.grouped_calls: list[tuple[int, int]] = []  # (rows, members)
        self.wrong_group = wrong

    def groups(self, width, bits, group_size, dtype):
        return self.supports(width, bits, group_size, dtype)

    def grouped(self, x, weights, group_size, bits):
        self.grouped_calls.append((x.size // x.shape[-1], len(weights)))
        if self.wrong_group:  # a planted mistake: the members' outputs in the wrong order
            weights = weights[::-1]
        single = super().__call__
        out = [single(x, w, s, b, group_size, bits) for w, s, b in weights]
        del self.calls[-len(weights) :]
        return out


def _quantized(bits: int = 4) -> nn.Module:
    model = build_model(tiny_config("qwen3"), seed=1)
    # groups of 32, so the hidden width (64) is two groups: MLX 0.32's CUDA backend computes
    # one-group-wide products wrong on Hopper GPUs (core/device.py, `one_group_wide`), and the
    # probe checks a kernel against MLX's product
    nn.quantize(model, group_size=32, bits=bits)
    mx.eval(model.parameters())
    return model


def test_a_wrapped_layer_sends_a_few_rows_to_the_kernel_and_more_to_mlx():
    model = _quantized()
    kernel = ReferenceRows()
    wrapped, failed = row_kernels.install(model, kernel, mx.float32)
    assert failed is None and wrapped == len(
        [m for _, m in _quantized().named_modules() if type(m) is nn.QuantizedLinear]
    )
    layer = model.layers[0].mlp.down_proj
    assert isinstance(layer, row_kernels.QuantizedRows)
    x = mx.random.normal((1, 9, row_kernels.width(layer.linear)), key=mx.random.key(2))
    kernel.calls.clear()
    for rows in (1, 5, 8):
        want = layer.linear(x[:, :rows])
        got = layer(x[:, :rows])
        assert got.shape == want.shape
        assert mx.allclose(got, want, rtol=1e-4, atol=1e-5).item()
    assert kernel.calls == [1, 5, 8]
    layer(x)  # 9 rows: MLX's own product
    assert kernel.calls == [1, 5, 8]
    kernel.min_rows = 2  # as CUDA's: one row stays MLX's (its host time is the smaller)
    layer(x[:, :1])
    layer(x[:, :2])
    assert kernel.calls == [1, 5, 8, 2]


class DenseFrom(ReferenceRows):
    """ReferenceRows that also says products of `rows` rows or more run dequantized."""

    def __init__(self, rows: int | None) -> None:
        super().__init__()
        self.rows = rows

    def dense_rows(self, width, bits, group_size, dtype):
        return self.rows


def test_products_of_many_rows_run_the_dequantized_weight_where_the_kernel_says(monkeypatch):
    model = _quantized()
    kernel = DenseFrom(12)
    row_kernels.install(model, kernel, mx.float32)
    layer = model.layers[0].mlp.down_proj
    assert layer.dense_from == 12
    dense_calls = []
    real = row_kernels.dense
    monkeypatch.setattr(
        row_kernels, "dense", lambda lin, x: dense_calls.append(x.shape) or real(lin, x)
    )
    x = mx.random.normal((1, 40, row_kernels.width(layer.linear)), key=mx.random.key(3))
    kernel.calls.clear()
    for rows in (5, 11, 12, 40):
        want = layer.linear(x[:, :rows])
        got = layer(x[:, :rows])
        assert got.shape == want.shape and got.dtype == want.dtype
        assert mx.allclose(got, want, rtol=1e-4, atol=1e-5).item()
    assert kernel.calls == [5]  # 11 rows: past the kernel's 8, MLX's own product
    assert [shape[1] for shape in dense_calls] == [12, 40]
    # the layers share one queue of dense bytes, which waits for the device past its bound
    queue = layer.queue
    assert queue is model.layers[1].self_attn.q_proj.queue
    product = layer.linear.weight.shape[0] * row_kernels.width(layer.linear) * 4  # float32
    waits, queue.limit = queue.waits, 2 * product
    queue.queued = 0
    layer(x[:, :12])
    assert queue.waits == waits and queue.queued > 0
    layer(x[:, :12])
    assert queue.waits == waits + 1 and queue.queued == 0
    # a kernel without the say (or saying None) leaves every wide product to MLX
    for quiet in (ReferenceRows(), DenseFrom(None)):
        row_kernels.install(model, quiet, mx.float32)
        assert model.layers[0].mlp.down_proj.dense_from is None


class WideRows(ReferenceRows):
    """ReferenceRows that takes up to `top` rows at every shape."""

    def __init__(self, top: int) -> None:
        super().__init__()
        self.top = top

    def rows_up_to(self, width, outputs, bits, group_size, dtype):
        return self.top


def test_a_kernel_that_takes_more_rows_at_a_shape_gets_them_and_is_probed_there():
    model = _quantized()
    kernel = WideRows(12)
    wrapped, failed = row_kernels.install(model, kernel, mx.float32)
    assert wrapped and failed is None
    assert max(kernel.calls) == 12  # the probe ran the widest product the kernel takes
    layer = model.layers[0].mlp.down_proj
    assert layer.max_rows == 12
    x = mx.random.normal((1, 13, row_kernels.width(layer.linear)), key=mx.random.key(4))
    kernel.calls.clear()
    for rows in (9, 12, 13):
        want = layer.linear(x[:, :rows])
        assert mx.allclose(layer(x[:, :rows]), want, rtol=1e-4, atol=1e-5).item()
    assert kernel.calls == [9, 12]  # 13: MLX's own

    # a mistake past 8 rows, which only a probe at the widest product meets, is refused
    class WrongPastEight(WideRows):
        def __call__(self, x, *weights):
            y = super().__call__(x, *weights)
            return y * 1.5 if x.size // x.shape[-1] > 8 else y

    count, failed = row_kernels.install(_quantized(), WrongPastEight(12), mx.float32)
    assert count == 0 and "12 rows" in failed


class WideGroups(GroupedReference):
    """GroupedReference that takes 12 rows where a launch computes at most 128 weight rows,
    10 where it computes more."""

    def rows_up_to(self, width, outputs, bits, group_size, dtype):
        return 12 if outputs <= 128 else 10


def test_a_groups_rows_stop_where_its_whole_launch_says():
    model = _quantized()  # q 64 + k 32 + v 32 rows in one launch; gate 128 + up 128 in another
    kernel = WideGroups()
    wrapped, failed = row_kernels.install(model, kernel, mx.float32)
    assert wrapped and failed is None
    layer = model.layers[0]
    assert [layer.self_attn.q_proj.max_rows, layer.self_attn.v_proj.max_rows] == [12, 12]
    assert [layer.mlp.gate_proj.max_rows, layer.mlp.up_proj.max_rows] == [10, 10]
    assert layer.mlp.down_proj.max_rows == 12  # alone: its own 64 rows
    assert (10, 2) in kernel.grouped_calls and (12, 2) not in kernel.grouped_calls  # probed there
    kernel.grouped_calls.clear()
    x = mx.random.normal((1, 11, 64), key=mx.random.key(5))
    want = layer.mlp.gate_proj.linear(x)
    assert mx.allclose(layer.mlp.gate_proj(x), want, rtol=1e-4, atol=1e-5).item()
    assert kernel.grouped_calls == []  # 11 rows: past the group's 10, MLX's own


def test_a_long_prompts_dense_prefill_keeps_greedy_output(monkeypatch):
    """Prefill chunks through the dequantized weight, verifies through the kernel: DSpark's
    greedy output equals mlx-lm's greedy decoding of the unwrapped model."""
    monkeypatch.setenv("OUTRIDER_MATMUL", "rows")  # the layers stay quantized on the CPU
    pipe = outrider.load("outrider-demo/target", "outrider-demo/dspark", mode="dspark")
    model = pipe.target.model
    ids = pipe.encode(" ".join(PROMPTS[:3]))
    assert len(ids) > 24
    want = plain_greedy_of(model, ids, 24)
    kernel = DenseFrom(16)
    wrapped, _ = row_kernels.install(model, kernel, mx.float32)
    assert wrapped
    widths = []
    real = row_kernels.dense
    monkeypatch.setattr(
        row_kernels, "dense", lambda lin, x: widths.append(x.size // x.shape[-1]) or real(lin, x)
    )
    got = pipe.generate(ids, max_tokens=24, stop_tokens=set())
    assert widths and min(widths) >= 16, "the prefill's chunk ran dequantized"
    assert any(1 < rows <= 5 for rows in kernel.calls), "verifies ran the kernel"
    assert got.tokens == want


def test_a_short_remainder_joins_the_last_prefill_chunk_where_products_run_dense(monkeypatch):
    """Past a prompt's last full chunk, a remainder shorter than the dense route's rows would
    run MLX's quantized product (slow on CUDA at hundreds of rows): it goes in with the chunk
    before it, and that chunk with the last token, in one forward. Where a stop (a prefix-cache
    snapshot) ends a chunk, the last token goes alone. Without a dense route the chunks are as
    before; greedy output is unchanged."""
    monkeypatch.setenv("OUTRIDER_MATMUL", "rows")  # the layers stay quantized on the CPU
    monkeypatch.setattr(outrider.core.target, "PREFILL_CHUNK", 16)
    pipe = outrider.load("outrider-demo/target", mode="baseline")
    target, model = pipe.target, pipe.target.model
    ids = pipe.encode(" ".join(PROMPTS))[:38]  # 16 + 16 + 5, then the last token alone
    assert len(ids) == 38
    want = plain_greedy_of(model, ids, 8)
    chunks = []
    run = target._run
    monkeypatch.setattr(
        target, "_run", lambda x, *args, **kw: chunks.append(x.shape[0]) or run(x, *args, **kw)
    )
    target.prefill(ids, target.make_cache())
    assert target.chunk_floor() == 0 and chunks == [16, 16, 5, 1]
    row_kernels.install(model, DenseFrom(16), mx.float32)
    assert target.chunk_floor() == 16
    chunks.clear()
    got = pipe.generate(ids, max_tokens=8, stop_tokens=set())
    assert chunks[:2] == [16, 22] and chunks[2:] == [1] * (len(chunks) - 2)
    assert got.tokens == want
    for prompt, stops, want_chunks in (
        (ids[:33], (), [16, 17]),  # a remainder of 16 with the last token: just within
        (ids[:34], (), [16, 18]),
        (ids[:20], (), [20]),  # one forward: at least the dense route's rows
        (ids[:15], (), [14, 1]),  # shorter: chunked as before
        (ids, (30,), [16, 14, 7, 1]),  # a stop at 30: the cache is snapshotted there
    ):
        chunks.clear()
        logits, _ = target.prefill(prompt, target.make_cache(), stops=stops)
        assert chunks == want_chunks, (len(prompt), stops)
        alone = model(mx.array(prompt)[None])
        assert mx.argmax(logits).item() == mx.argmax(alone[0, -1]).item()


def test_install_keeps_the_weights_and_uninstall_puts_the_layers_back():
    model = _quantized()
    before = dict(tree_flatten(model.parameters()))
    wrapped, _ = row_kernels.install(model, ReferenceRows(), mx.float32)
    assert row_kernels.installed(model)
    inner = {k.replace(".linear.", "."): v for k, v in tree_flatten(model.parameters())}
    assert inner.keys() == before.keys()
    assert all(inner[k] is before[k] or mx.array_equal(inner[k], before[k]) for k in before)
    assert row_kernels.uninstall(model) == wrapped
    assert not row_kernels.installed(model)
    assert dict(tree_flatten(model.parameters())).keys() == before.keys()
    assert all(type(m) is not row_kernels.QuantizedRows for _, m in model.named_modules())


def test_the_probe_refuses_a_kernel_that_computes_something_else():
    model = _quantized()
    wrapped, failed = row_kernels.install(model, ReferenceRows(wrong=True), mx.float32)
    assert wrapped == 0 and "part from MLX's by" in failed
    assert not row_kernels.installed(model)

    class Raising(ReferenceRows):
        def __call__(self, *args):
            raise RuntimeError("no kernel image is available for execution on the device")

    wrapped, failed = row_kernels.install(model, Raising(), mx.float32)
    assert wrapped == 0 and "RuntimeError: no kernel image" in failed
    assert not row_kernels.installed(model)


def test_siblings_that_read_one_input_take_one_launch_and_compute_the_same():
    """q, k and v, and gate and up, of every layer join a group: a forward of a few rows runs
    one grouped call for each and single calls for o and down, and gives the logits MLX's
    products give. A member called with another input computes that input's product."""
    from mlx_lm.models.cache import make_prompt_cache

    model = _quantized()
    kernel = GroupedReference()
    wrapped, failed = row_kernels.install(model, kernel, mx.float32)
    assert failed is None and wrapped
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    group = attn.q_proj._group
    assert group is not None and attn.k_proj._group is group and attn.v_proj._group is group
    assert [attn.q_proj._index, attn.k_proj._index, attn.v_proj._index] == [0, 1, 2]
    assert mlp.gate_proj._group is not None and mlp.gate_proj._group is mlp.up_proj._group
    assert attn.o_proj._group is None and mlp.down_proj._group is None

    ids = mx.array([[3, 1, 4, 1, 5, 9, 2]], dtype=mx.uint32)
    plain = _quantized()
    want = plain(ids[:, 5:], cache=_filled(plain, ids[:, :5], make_prompt_cache))
    kernel.calls.clear()
    cache = _filled(model, ids[:, :5], make_prompt_cache)  # 5 rows: through the kernel too
    kernel.calls.clear(), kernel.grouped_calls.clear()
    got = model(ids[:, 5:], cache=cache)
    layers = len(model.layers)
    assert sorted(kernel.grouped_calls) == sorted([(2, 3)] * layers + [(2, 2)] * layers)
    head = int(isinstance(getattr(model, "lm_head", None), row_kernels.QuantizedRows))
    assert kernel.calls == [2] * (2 * layers + head)  # o and down of each layer, the head
    assert mx.allclose(got, want, rtol=1e-4, atol=1e-4).item()
    assert group._x is None  # nothing held once every member took its product

    x = mx.random.normal((1, 3, row_kernels.width(attn.q_proj.linear)), key=mx.random.key(4))
    y = mx.random.normal(x.shape, key=mx.random.key(5))
    attn.q_proj(x)
    assert mx.allclose(attn.k_proj(y), attn.k_proj.linear(y), rtol=1e-4, atol=1e-5).item()
    assert mx.allclose(attn.v_proj(x), attn.v_proj.linear(x), rtol=1e-4, atol=1e-5).item()


def _filled(model, ids, make_prompt_cache):
    cache = make_prompt_cache(model)
    mx.eval(model(ids, cache=cache))
    return cache


def test_a_grouped_form_that_fails_its_probe_leaves_each_layer_alone():
    model = _quantized()
    wrapped, failed = row_kernels.install(model, GroupedReference(wrong=True), mx.float32)
    assert wrapped and "grouped" in failed and "each layer runs alone" in failed
    assert row_kernels.installed(model)
    assert all(
        m._group is None
        for _, m in model.named_modules()
        if isinstance(m, row_kernels.QuantizedRows)
    )
    model = _quantized()
    note = row_kernels.apply(model, [GroupedReference(wrong=True)], "rows")
    assert "each layer runs alone" in note and row_kernels.installed(model)

    class Faster(GroupedReference):
        def preferred(self, width, bits, group_size, dtype):
            return True

    for choice in ("auto", "rows"):  # a preferred kernel, grouped where it can (both settings)
        model = _quantized()
        assert row_kernels.apply(model, [Faster()], choice) is None
        assert model.layers[0].self_attn.q_proj._group is not None
    model = _quantized()  # grouping off: every layer alone, nothing failed
    assert row_kernels.install(model, GroupedReference(), mx.float32, group=False)[1] is None
    assert model.layers[0].self_attn.q_proj._group is None


def test_a_second_install_replaces_the_first_kernel():
    """One kernel a layer: installing another takes the first out rather than wrapping its
    wrappers (whose own kernel would then take every row the second was meant to see)."""
    model = _quantized()
    first, second = ReferenceRows(), GroupedReference()
    assert row_kernels.install(model, first, mx.float32)[0]
    wrapped, failed = row_kernels.install(model, second, mx.float32)
    assert wrapped == len(row_kernels.layers(_quantized(), second, mx.float32)) and failed is None
    assert not any(
        isinstance(m.linear, row_kernels.QuantizedRows)
        for _, m in model.named_modules()
        if isinstance(m, row_kernels.QuantizedRows)
    )
    first.calls.clear()
    ids = mx.array([[3, 1, 4, 1, 5, 9, 2]], dtype=mx.uint32)
    mx.eval(model(ids))
    assert not first.calls and second.calls and second.grouped_calls


def test_only_mlxs_own_affine_layers_at_shapes_the_kernel_takes_are_wrapped():
    model = _quantized()

    class Narrow(ReferenceRows):
        def supports(self, width, bits, group_size, dtype):
            return width == 64  # the tiny model's hidden width, not its MLP's

    found = row_kernels.layers(model, Narrow(), mx.float32)
    assert found and all(row_kernels.width(m) == 64 for _, m in found)
    assert not row_kernels.layers(build_model(tiny_config("qwen3"), seed=1), Narrow(), mx.float32)


def test_the_setting_decides_and_a_kernel_that_cannot_run_is_said():
    kernel = ReferenceRows()
    for choice in ("auto", "native"):
        model = _quantized()
        assert row_kernels.apply(model, [kernel], choice) is None
        assert not row_kernels.installed(model)
    model = _quantized()
    assert row_kernels.apply(model, [kernel], "rows") is None
    assert row_kernels.installed(model)

    class Elsewhere(ReferenceRows):
        def available(self):
            return False

    class Faster(ReferenceRows):
        def preferred(self, width, bits, group_size, dtype):
            return bits == 4

    for bits, used in ((4, True), (8, False)):  # `auto` uses a kernel where it was measured faster
        model = _quantized(bits)
        assert row_kernels.apply(model, [Faster()], "auto") is None
        assert row_kernels.installed(model) == used
    model = _quantized()
    assert row_kernels.apply(model, [Faster()], "native") is None
    assert not row_kernels.installed(model)

    model = _quantized()
    assert row_kernels.apply(model, [Elsewhere()], "auto") is None  # nothing asked, nothing said
    note = row_kernels.apply(model, [Elsewhere()], "rows")
    assert "no rows kernel runs on this device" in note and not row_kernels.installed(model)
    note = row_kernels.apply(model, [ReferenceRows(wrong=True)], "rows")
    assert "MLX's products are used" in note and not row_kernels.installed(model)


@pytest.mark.parametrize("mode", ["dspark", "lookup"])
def test_every_mode_through_the_kernel_keeps_plain_greedy_output(monkeypatch, mode):
    """The demo pair's 8-bit target with the kernel in front of its layers: each mode's greedy
    output equals plain greedy decoding of the same model, whose single rows run the kernel
    too. `OUTRIDER_MATMUL=rows` keeps the layers quantized on the CPU (where `auto` may run
    them dense) and says in the load's notes when no kernel of the device's can run."""
    monkeypatch.setenv("OUTRIDER_MATMUL", "rows")
    pipe = outrider.load(
        "outrider-demo/target", "outrider-demo/dspark" if mode == "dspark" else None, mode=mode
    )
    if not on_cuda_gpu():
        assert any("no rows kernel runs on this device" in n for n in pipe.notes)
    model = pipe.target.model
    kernel = GroupedReference()  # in place of the device's own kernel, where one was installed
    wrapped, failed = row_kernels.install(model, kernel, mx.float32)
    assert wrapped and failed is None
    for i, (prompt, cap) in enumerate(zip(PROMPTS[:2], (1, 4))):  # a cap a prompt
        ids = pipe.encode(prompt)
        want = plain_greedy_of(model, ids, 16)
        kernel.calls.clear()
        kernel.grouped_calls.clear()
        got = pipe.generate(ids, max_tokens=16, max_draft=cap, stop_tokens=set())
        if mode == "dspark":
            assert any(1 < rows <= cap + 1 for rows in kernel.calls), "verifies reach it"
            assert any(1 < rows <= cap + 1 for rows, _ in kernel.grouped_calls)
        assert got.tokens == want, f"{mode} cap {cap} diverged on prompt {i}"


def plain_greedy_of(model: nn.Module, ids: list[int], n: int) -> list[int]:
    """mlx-lm's greedy decoding of `model` as it stands (wrapped or not)."""
    from mlx_lm.generate import generate_step

    return [int(tok) for tok, _ in generate_step(mx.array(ids), model, max_tokens=n)]
