"""Compiled decoder layers (core/compiled_layers.py) compute what the model's own layers do.

On a CUDA GPU a dense target's layers run their fixed-shape parts compiled; here
OUTRIDER_COMPILED_LAYERS=on forces it on the CPU, where every mode, a batch of rows and the
rerouted verify attention must still give mlx-lm's own greedy tokens.
"""

from __future__ import annotations

import copy

import mlx.core as mx
import pytest
from conftest import PROMPTS, plain_greedy

import outrider
from outrider.core import compiled_layers
from outrider.core.compiled_layers import ENV, CompiledLayer
from outrider.core.device import ATTENTION_ENV
from outrider.core.errors import OutriderError
from outrider.core.taps import TappedLayer
from outrider.core.wrapper import routes
from outrider.plugins.targets.verify_attention import ChunkedAttention
from outrider.testing import cast_model


def decoder_layers(target) -> list:
    """A loaded target's layer list, looking through the tap wrappers only."""
    return [
        x.layer if isinstance(x, TappedLayer) else x for x in target.family.layers(target.model)
    ]


def test_the_choice_follows_the_environment(monkeypatch):
    monkeypatch.setenv(ENV, "on")
    assert compiled_layers.compiled_layers()
    monkeypatch.setenv(ENV, "off")
    assert not compiled_layers.compiled_layers()
    monkeypatch.setenv(ENV, "auto")
    on_cuda = mx.default_device() == mx.gpu and mx.cuda.is_available()
    assert compiled_layers.compiled_layers() == on_cuda
    monkeypatch.setenv(ENV, "always")
    with pytest.raises(OutriderError, match="OUTRIDER_COMPILED_LAYERS must be auto, on or off"):
        compiled_layers.compiled_layers()


def test_doctor_says_whether_layers_run_compiled(monkeypatch):
    from outrider import doctor

    monkeypatch.setenv(ENV, "on")
    assert doctor.doctor_report()["compiled_layers"].startswith("on: llama, qwen2 and qwen3")
    monkeypatch.setenv(ENV, "off")
    assert doctor.doctor_report()["compiled_layers"].startswith("off")
    monkeypatch.setenv(ENV, "sometimes")
    report = doctor.doctor_report()
    assert report["compiled_layers"] is None
    assert any("OUTRIDER_COMPILED_LAYERS must be auto, on or off" in p for p in report["problems"])


def test_off_leaves_the_layers_alone(monkeypatch, qwen3_target):
    monkeypatch.setenv(ENV, "off")
    target = outrider.load(str(qwen3_target), mode="baseline").target
    assert not any(isinstance(x, CompiledLayer) for x in decoder_layers(target))
    assert "compiled" not in routes(target.model)


@pytest.mark.parametrize(
    "family_fixture",
    ["qwen3_target"]
    + [pytest.param(f, marks=pytest.mark.slow) for f in ("llama_target", "qwen2_target")],
)
def test_compiled_layers_are_lossless_in_every_mode(request, tmp_path, monkeypatch, family_fixture):
    """With the verify's attention rerouted too (OUTRIDER_ATTENTION=split), so that a compiled
    layer runs the split chunks it is handed."""
    from outrider.testing import make_tiny_drafter

    monkeypatch.setenv(ENV, "on")
    monkeypatch.setenv(ATTENTION_ENV, "split")
    target = request.getfixturevalue(family_fixture)
    dspark = make_tiny_drafter(tmp_path / "ds", target, "dspark", "deepspec", block_size=8)
    pipes = [outrider.load(str(target), str(dspark), mode="dspark")]
    pipes.append(outrider.load(str(target), mode="lookup", target=pipes[0].target))
    layers = decoder_layers(pipes[0].target)
    assert all(isinstance(x, CompiledLayer) for x in layers)
    assert all(isinstance(x.self_attn, ChunkedAttention) for x in layers)
    assert "compiled" in routes(pipes[0].target.model)
    for pipe in pipes:
        for cap in (2, 7):
            for prompt in PROMPTS[:2]:
                ids = pipe.encode(prompt)
                want = plain_greedy(target, ids, 40)
                got = pipe.generate(ids, max_tokens=40, max_draft=cap, stop_tokens=set())
                assert got.tokens == want, f"{pipe.mode} cap {cap} diverged on {prompt!r}"


def test_a_batch_of_rows_beside_compiled_layers_decodes_each_rows_own(
    monkeypatch, qwen3_target, drafters
):
    """A batch's rows (a `BatchKVCache`) take the layers' own path, each row's prefill the
    compiled one: every row still gives its plain greedy tokens."""
    monkeypatch.setenv(ENV, "on")
    target = qwen3_target
    pipe = outrider.load(str(target), str(drafters["dspark"]), mode="dspark")
    assert all(isinstance(x, CompiledLayer) for x in decoder_layers(pipe.target))
    rows = [pipe.encode(p) for p in PROMPTS[:3]]
    batch = pipe.generate_batch(rows, max_tokens=24, max_draft=4, stop_tokens=set())
    for ids, got in zip(rows, batch):
        assert got.tokens == plain_greedy(target, ids, 24)


def test_compiled_steps_give_the_layers_own_logits_bit_for_bit(monkeypatch, qwen3_target):
    """A prefill, a verify, then one-row steps at growing positions: the logits are the same
    bits with the compiled layers as with the layers they stand in front of."""
    monkeypatch.setenv(ENV, "on")
    target = outrider.load(str(qwen3_target), mode="baseline").target
    layers = target.family.layers(target.model)
    compiled = list(layers)
    assert all(isinstance(x, CompiledLayer) for x in compiled)
    got = compiled_layers._probe(target.model, target.make_cache)
    layers[:] = [x.layer for x in compiled]
    want = compiled_layers._probe(target.model, target.make_cache)
    assert all(mx.array_equal(a, b).item() for a, b in zip(got, want))


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_steps_far_into_a_context_give_the_layers_own_logits_bit_for_bit(
    monkeypatch, qwen3_target, dtype
):
    """The load's probe runs 15 positions; ropes and masks of a long context take other
    values. After a 700-token prefill (the layers' own path: too many rows to compile), a
    verify of 8 rows and one-row steps give the same bits compiled as the layers' own, in
    float32 and in bfloat16 (on an H100 the random 8B shapes' compiled and uncompiled steps
    parted in tokens, 46th and 48th sessions: this is the check to run there)."""
    monkeypatch.setenv(ENV, "on")
    target = outrider.load(str(qwen3_target), mode="baseline").target
    target.model.set_dtype(dtype)  # compiled parts read the weights afresh every call
    layers = target.family.layers(target.model)
    compiled = list(layers)
    assert all(isinstance(x, CompiledLayer) for x in compiled)

    def logits() -> list[mx.array]:
        cache, out = target.make_cache(), []
        ids = [3 + (5 * i) % 97 for i in range(700)]
        target.model(mx.array([ids]), cache=cache)
        for rows in (8, 1, 1, 3, 1):
            step = target.model(mx.array([ids[:rows]]), cache=cache)
            mx.eval(step)
            out.append(step)
        return out

    got = logits()
    layers[:] = [x.layer for x in compiled]
    want = logits()
    assert all(mx.array_equal(a, b).item() for a, b in zip(got, want, strict=True))


def test_a_probe_that_disagrees_keeps_the_models_layers(monkeypatch, qwen3_target):
    """A compiled layer that reads the rope one position late gives other logits: the probe
    drops the wrappers and the model keeps its own layers."""
    monkeypatch.setenv(ENV, "on")
    real = CompiledLayer.__call__

    def late(self, x, mask=None, cache=None):
        positions = self._positions
        self._positions = lambda offset: positions(offset) + 1
        try:
            return real(self, x, mask, cache)
        finally:
            self._positions = positions

    monkeypatch.setattr(CompiledLayer, "__call__", late)
    target = outrider.load(str(qwen3_target), mode="baseline").target
    assert not any(isinstance(x, CompiledLayer) for x in decoder_layers(target))
    assert "compiled" not in routes(target.model)


def test_only_the_known_dense_blocks_are_compiled(monkeypatch, models_dir):
    """A hybrid's layers (gated-delta blocks between the attention ones) are not re-stated."""
    from outrider.testing import make_tiny_target

    monkeypatch.setenv(ENV, "on")
    path = make_tiny_target(models_dir / "compiled-qwen3_next", family="qwen3_next")
    target = outrider.load(str(path), mode="baseline").target
    assert not any(isinstance(x, CompiledLayer) for x in decoder_layers(target))


def test_a_family_without_a_layer_list_loads_as_it_is(monkeypatch, fallback_target):
    """The mlx-lm fallback family (here cohere2's sliding caches) has no layer list to wrap."""
    monkeypatch.setenv(ENV, "on")
    path = fallback_target
    pipe = outrider.load(str(path), mode="baseline")
    assert pipe.target.family.name == "mlx_lm"
    assert not any(isinstance(m, CompiledLayer) for _, m in pipe.target.model.named_modules())
    got = pipe.generate([1, 2, 3], max_tokens=12, stop_tokens=set())
    assert got.tokens == plain_greedy(path, [1, 2, 3], 12)


def test_bypassed_runs_the_layers_own_and_puts_the_compiled_back(
    monkeypatch, qwen3_target, drafters
):
    """What a benchmark's mlx-lm arm runs: no compiled layer in the tree, behind taps too, the
    same logits; afterwards the compiled layers stand where they stood."""
    monkeypatch.setenv(ENV, "on")
    pipe = outrider.load(str(qwen3_target), str(drafters["dspark"]), mode="dspark")
    model = pipe.target.model

    def compiled() -> list:
        return [m for _, m in model.named_modules() if isinstance(m, CompiledLayer)]

    before = compiled()
    assert len(before) == len(decoder_layers(pipe.target))
    ids = mx.array([[3, 4, 5, 6, 7]], dtype=mx.uint32)
    want = model(ids, cache=pipe.target.make_cache())
    with compiled_layers.bypassed(model):
        assert compiled() == []
        assert mx.array_equal(model(ids, cache=pipe.target.make_cache()), want).item()
    assert [id(m) for m in compiled()] == [id(m) for m in before]


@pytest.mark.parametrize("which", ["qwen3_target", "fallback_target"])
def test_a_benchmark_times_mlx_lms_own_layers_beside_compiled_ones(monkeypatch, request, which):
    """`outrider benchmark`'s mlx-lm arm runs the model's own layers (and a model no family
    lists the layers of benchmarks too); every arm stays plain greedy's."""
    from outrider.benchmark.runner import BenchConfig, run_benchmark
    from outrider.core.plugins import Plugins

    monkeypatch.setenv(ENV, "on")
    target = request.getfixturevalue(which)
    seen: list[int] = []
    real = outrider.benchmark.runner.mlx_lm_plain

    def counted(model, *args):
        seen.append(sum(isinstance(m, CompiledLayer) for _, m in model.named_modules()))
        return real(model, *args)

    monkeypatch.setattr(outrider.benchmark.runner, "mlx_lm_plain", counted)
    config = BenchConfig(
        model=str(target), modes=["baseline", "lookup"], suites=["code"], trials=1,
        max_tokens=8, prompts_per_suite=2,
    )  # fmt: skip
    report = run_benchmark(config, Plugins(load_entrypoints=False), lambda *a: None)
    assert report.checked == 2 * 3 and seen and set(seen) == {0}


def test_a_copy_holds_the_layers_themselves(monkeypatch, qwen3_target):
    """A deep copy (a training teacher's, made dense after copying) holds the model's own
    layers, not compiled ones, and computes what the original does with its own weights."""
    monkeypatch.setenv(ENV, "on")
    target = outrider.load(str(qwen3_target), mode="baseline").target
    model = target.model
    ids = mx.array([[3, 4, 5, 6]], dtype=mx.uint32)
    want = model(ids, cache=target.make_cache())
    twin = copy.deepcopy(model)
    assert all(isinstance(x, CompiledLayer) for x in target.family.layers(model))
    assert not any(isinstance(m, CompiledLayer) for _, m in twin.named_modules())
    assert mx.array_equal(twin(ids, cache=target.family.make_cache(twin)), want).item()
    mlp = target.family.layers(twin)[0].mlp
    mlp.down_proj.weight = mlp.down_proj.weight * 2
    assert not mx.array_equal(twin(ids, cache=target.family.make_cache(twin)), want).item()
    assert mx.array_equal(model(ids, cache=target.make_cache()), want).item()


@pytest.mark.parametrize("rows", [1, 8])
def test_weights_changed_after_load_are_the_ones_computed_with(monkeypatch, qwen3_target, rows):
    """The compiled parts take the weights as inputs: after a cast to bfloat16 (as benchmarks
    and tests do after loading) or a changed weight, a step and a verify compute with the new
    weights, as the layers' own path does."""
    monkeypatch.setenv(ENV, "on")
    target = outrider.load(str(qwen3_target), mode="baseline").target
    model = target.model
    ids = mx.array([[3, 4, 5, 6, 7, 8, 9, 10][:rows]], dtype=mx.uint32)

    def logits() -> tuple[mx.array, mx.array]:
        """(compiled, the layers' own) after the same 4-token prefix."""
        out = []
        for own in (False, True):
            cache = target.make_cache()
            model(mx.array([[1, 2, 3, 4]], dtype=mx.uint32), cache=cache)
            if own:
                with compiled_layers.bypassed(model):
                    out.append(model(ids, cache=cache))
            else:
                out.append(model(ids, cache=cache))
        return out[0], out[1]

    before, own = logits()
    assert mx.array_equal(before, own).item()
    cast_model(model, mx.bfloat16)
    got, own = logits()
    assert got.dtype == own.dtype == mx.bfloat16 and mx.array_equal(got, own).item()
    mlp = target.family.layers(model)[0].layer.mlp
    mlp.down_proj.weight = mlp.down_proj.weight * 2
    changed, own = logits()
    assert mx.array_equal(changed, own).item() and not mx.array_equal(changed, got).item()
