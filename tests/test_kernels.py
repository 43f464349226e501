"""Warming MLX's CUDA quantized kernels at load (core/kernels.py): what runs, and that it
changes nothing a generation sees."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

import outrider
from outrider.core import kernels
from outrider.core.device import compute_dtype, on_cuda_gpu
from outrider.testing import make_tiny_target
from outrider.testing.targets import build_model, tiny_config


def _quantized(seed: int = 1, bits: int = 4) -> nn.Module:
    model = build_model(tiny_config("qwen3"), seed=seed)
    nn.quantize(model, group_size=64, bits=bits)
    return model


def test_one_product_per_distinct_quantized_shape():
    model = _quantized()
    shapes = {
        (m.weight.shape[0], m.weight.shape[-1] * 32 // m.bits)
        for _, m in model.named_modules()
        if isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding))
    }
    products = kernels.quantized_products([model, model])  # a model named twice counts once
    assert len(products) == len(shapes) > 1
    assert {(p[0].shape[0], p[5]) for p in products} == shapes
    # another bit width is another kernel
    assert len(kernels.quantized_products([model, _quantized(bits=8)])) == 2 * len(shapes)
    assert kernels.quantized_products([build_model(tiny_config("qwen3"), seed=1)]) == []


def test_products_run_at_the_type_the_model_computes_in_not_the_scales_type():
    """A GGUF target keeps float16 scales but float32 norms: its activations are float32, and
    the quantized products see float32 inputs, so that is the type to warm (warming float16
    compiled kernels no generation used)."""
    model = build_model(tiny_config("qwen3"), seed=1)
    model.set_dtype(mx.float16)
    nn.quantize(model, group_size=64, bits=4)
    for _, m in model.named_modules():
        if isinstance(m, nn.RMSNorm):
            m.weight = m.weight.astype(mx.float32)
    assert compute_dtype(model) == mx.float32
    products = kernels.quantized_products([model])
    assert {p[1].dtype for p in products} == {mx.float16}  # the scales
    assert {p[6] for p in products} == {mx.float32}
    # and float32 is what the first layer's projections receive: the normed embedding
    embedded = model.model.embed_tokens(mx.array([[1, 2, 3]]))
    assert embedded.dtype == mx.float16
    assert model.layers[0].input_layernorm(embedded).dtype == mx.float32
    # a model quantized whole (scales and norms in one type) warms in that type
    assert {p[6] for p in kernels.quantized_products([_quantized()])} == {mx.float32}


def test_warming_runs_each_product_at_each_row_tile_and_matches_the_layer():
    model = _quantized()
    n = len(kernels.quantized_products([model]))
    assert kernels.warm_quantized_kernels([model]) == n * len(kernels.TILE_ROWS)
    # the product it runs is the layer's own: same result for the same rows
    layer = next(m for _, m in model.named_modules() if isinstance(m, nn.QuantizedLinear))
    w, scales, biases, group, bits, width, dtype = kernels.quantized_products([layer])[0]
    x = mx.random.normal((17, width)).astype(dtype)
    direct = mx.quantized_matmul(x, w, scales, biases, True, group, bits)
    assert mx.array_equal(direct, layer(x) - (layer["bias"] if "bias" in layer else 0)).item()


def test_pipeline_models_finds_the_drafter_inside_lookup_assistance(qwen3_target, drafters):
    pipe = outrider.load(str(qwen3_target), str(drafters["dspark"]), mode="dspark", max_draft=4)
    models = kernels.pipeline_models(pipe.target, pipe.proposer)
    assert models[0] is pipe.target.model
    assert len(models) == 2 and type(models[1]).__name__ == "BlockDrafter"
    plain = outrider.load(str(qwen3_target), mode="lookup")
    assert kernels.pipeline_models(plain.target, plain.proposer) == [plain.target.model]


def test_pipeline_models_finds_a_draft_model(qwen3_target, models_dir):
    draft = make_tiny_target(models_dir / "kernels-draft", "qwen3", seed=7, num_hidden_layers=1)
    pipe = outrider.load(str(qwen3_target), mode="draft", draft_model=str(draft))
    models = kernels.pipeline_models(pipe.target, pipe.proposer)
    assert len(models) == 2 and models[0] is pipe.target.model
    assert models[1] is not models[0] and len(models[1].layers) == 1


def test_load_warms_only_on_a_cuda_gpu_and_output_is_unchanged():
    # the shipped pair: an 8-bit target (kept quantized in this process, whose BLAS is MLX's
    # reference one) and a DSpark drafter quantized to 4 bits at load
    pipe = outrider.load("outrider-demo/target", "outrider-demo/dspark", mode="dspark")
    models = kernels.pipeline_models(pipe.target, pipe.proposer)
    products = kernels.quantized_products(models)
    assert {p[4] for p in products} == {8, 4}  # the target's and the drafter's
    ran = kernels.warm_at_load(pipe.target, pipe.proposer)[0]
    assert ran == (len(products) * len(kernels.TILE_ROWS) if on_cuda_gpu() else 0)
    prompt = "def fibonacci(n):"
    before = pipe.generate(prompt, max_tokens=12, max_draft=4)
    assert kernels.warm_quantized_kernels(models) == len(products) * len(kernels.TILE_ROWS)
    after = pipe.generate(prompt, max_tokens=12, max_draft=4)
    plain = outrider.load("outrider-demo/target", mode="baseline", target=pipe.target)
    assert after.tokens == before.tokens == plain.generate(prompt, max_tokens=12).tokens


class _Toy(nn.Module):
    """A tied embedding and two linears: 64-wide inputs are one group of 64, 128-wide two."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 64)
        self.body = nn.Sequential(nn.Linear(64, 128), nn.Linear(128, 64))

    def __call__(self, ids: mx.array) -> mx.array:
        return self.embed.as_linear(self.body(self.embed(ids)))


def test_single_group_quantized_layers_run_dense_on_a_cuda_gpu(monkeypatch):
    """Layers whose weight rows are one quantization group (a toy model's 64-wide inputs at
    group 64) are dequantized on a CUDA GPU, where MLX's kernel for them computed wrong values;
    wider ones stay quantized, and the output is the quantized layers' own as MLX's CPU backend
    computes them."""
    from outrider.core import device

    mx.random.seed(0)
    model = _Toy()
    nn.quantize(model, group_size=64, bits=4)
    ids = mx.array([[1, 5, 9, 30]])
    with mx.stream(mx.cpu):  # the reference: MLX's CPU kernels, right at every shape
        want = model(ids)
        mx.eval(want)
    ran = device.dense_single_groups(model)
    if not on_cuda_gpu():
        assert ran == 0  # MLX's own products are right here: nothing changes
        monkeypatch.setattr(device, "on_cuda_gpu", lambda: True)
        ran = device.dense_single_groups(model)
    assert ran == 2  # the embedding (also the head) and the first linear
    assert type(model.embed) is nn.Embedding and type(model.body.layers[0]) is nn.Linear
    assert type(model.body.layers[1]) is nn.QuantizedLinear
    assert mx.allclose(model(ids), want, atol=1e-5).item()
    assert device.dense_single_groups(model) == 0  # nothing left to change
