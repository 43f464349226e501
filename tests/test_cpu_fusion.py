"""Norms and ropes fused on MLX's CPU backend (core/cpu_fusion.py): bit-identical to MLX's own,
swapped into loaded models only, and only where asked."""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

import outrider
from outrider.core import calibration, cpu_fusion
from outrider.core.compiled_layers import bypassed
from outrider.core.cpu_fusion import (
    FusedLlama3RoPE,
    FusedRMSNorm,
    FusedRoPE,
    fuse_for_cpu,
    same_as_mlx,
)
from outrider.core.errors import OutriderError
from outrider.testing import build_model

pytestmark = pytest.mark.skipif(mx.default_device() != mx.cpu, reason="the CPU's swap")

DTYPES = (mx.float32, mx.bfloat16, mx.float16)


@pytest.fixture(autouse=True)
def fusion_on(monkeypatch):
    """The default, whatever the environment running the suite says."""
    monkeypatch.setenv(cpu_fusion.FUSION_ENV, "on")


def _fused_kinds(model: nn.Module) -> list[type]:
    fused = (FusedRMSNorm, FusedRoPE, FusedLlama3RoPE)
    return [type(m) for _, m in model.named_modules() if isinstance(m, fused)]


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_fused_norm_is_mlxs_bit_for_bit(dtype):
    for size in (16, 64, 96, 576):
        norm = nn.RMSNorm(size, eps=1e-6)
        norm.weight = (mx.random.normal((size,), key=mx.random.key(size)) + 1).astype(dtype)
        fused = FusedRMSNorm(norm)
        for shape in ((1, 1, size), (1, 9, size), (3, 5, size), (2, 1, 4, size)):
            x = (3 * mx.random.normal(shape, key=mx.random.key(sum(shape)))).astype(dtype)
            want, got = norm(x), fused(x)
            assert got.dtype == want.dtype and mx.array_equal(want, got).item(), (size, shape)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_fused_rope_is_mlxs_bit_for_bit(dtype):
    """Rotate-half and interleaved, partial rotary dims, a scaled base, int offsets from 0 to a
    long context, and a batch's per-row offsets (an array)."""
    key = iter(mx.random.split(mx.random.key(0), 64))
    for head, dims, traditional, base, scale in (
        (16, 16, False, 10000.0, 1.0),
        (64, 64, True, 10000.0, 1.0),
        (64, 32, False, 1e6, 0.25),
        (80, 80, False, 500000.0, 1.0),
    ):
        rope = nn.RoPE(dims, traditional=traditional, base=base, scale=scale)
        fused = FusedRoPE(rope)
        for shape in ((1, 4, 1, head), (1, 2, 9, head), (1, 2, 300, head)):
            x = mx.random.normal(shape, key=next(key)).astype(dtype)
            for offset in (0, 5, 4095):
                want, got = rope(x, offset=offset), fused(x, offset=offset)
                assert mx.array_equal(want, got).item(), (head, dims, shape, offset)
        rows = mx.random.normal((3, 4, 2, head), key=next(key)).astype(dtype)
        offsets = mx.array([0, 7, 100], dtype=mx.int32)
        assert mx.array_equal(rope(rows, offset=offsets), fused(rows, offset=offsets)).item()


def test_a_loaded_target_runs_fused_and_computes_what_mlx_lm_builds(qwen3_target):
    """Outrider's load swaps every norm and rope of the tiny Qwen3; its parameters keep their
    paths, and its logits over a prompt and a decode step equal those of the same weights
    built by mlx-lm and left alone, to the bit."""
    pipe = outrider.load(str(qwen3_target), mode="baseline")
    model = pipe.target.model
    kinds = _fused_kinds(model)
    layers = len(model.model.layers)
    assert kinds.count(FusedRMSNorm) == 4 * layers + 1  # input, post, q and k norms; the last
    assert kinds.count(FusedRoPE) == layers
    config = json.loads((qwen3_target / "config.json").read_text())
    plain = build_model(config, 0)
    plain.load_weights(str(qwen3_target / "model.safetensors"))
    assert not _fused_kinds(plain)
    with bypassed(model):  # the paths of the blocks themselves (OUTRIDER_COMPILED_LAYERS=on)
        paths = sorted(k for k, _ in tree_flatten(model.parameters()))
    assert paths == sorted(k for k, _ in tree_flatten(plain.parameters()))
    from mlx_lm.models.cache import make_prompt_cache

    ids = mx.array([[3, 14, 15, 92, 65, 35, 89, 79]])
    got, want = [], []
    for net, out in ((model, got), (plain, want)):
        cache = make_prompt_cache(net)
        out.append(net(ids, cache=cache))
        out.append(net(mx.array([[26]]), cache=cache))
    for g, w in zip(got, want):
        assert mx.array_equal(g, w).item()


def test_drafters_run_fused_too():
    pipe = outrider.load("outrider-demo/target", "outrider-demo/dspark", mode="dspark")
    kinds = _fused_kinds(pipe.proposer.drafter)
    assert FusedRMSNorm in kinds and FusedRoPE in kinds


def test_off_keeps_mlxs_path_and_a_wrong_value_is_named(qwen3_target, monkeypatch):
    monkeypatch.setenv(cpu_fusion.FUSION_ENV, "off")
    pipe = outrider.load(str(qwen3_target), mode="baseline")
    assert not _fused_kinds(pipe.target.model)
    off = calibration.calibration_key(pipe)
    monkeypatch.setenv(cpu_fusion.FUSION_ENV, "on")
    assert "cpu_fusion" not in off and calibration.calibration_key(pipe)["cpu_fusion"] == "on"
    monkeypatch.setenv(cpu_fusion.FUSION_ENV, "fast")
    with pytest.raises(OutriderError, match="OUTRIDER_CPU_FUSION must be on or off"):
        outrider.load(str(qwen3_target), mode="baseline")


def test_a_kind_that_differs_from_mlxs_keeps_mlxs_path(monkeypatch):
    """The check before the swap: a fused norm of another eps is told apart, and where the
    check fails nothing of that kind is swapped."""
    norm = nn.RMSNorm(64, eps=1e-6)
    assert same_as_mlx(FusedRMSNorm(norm), norm)
    assert not same_as_mlx(FusedRMSNorm(nn.RMSNorm(64, eps=1e-1)), norm)
    assert same_as_mlx(FusedRoPE(nn.RoPE(32)), nn.RoPE(32))
    assert not same_as_mlx(FusedRoPE(nn.RoPE(32, base=500.0)), nn.RoPE(32))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.RMSNorm(64)
            self.layers = [nn.RoPE(32), nn.Linear(4, 4)]

    block = Block()
    monkeypatch.setattr(
        cpu_fusion, "same_as_mlx", lambda fused, original: isinstance(original, nn.RoPE)
    )
    assert fuse_for_cpu(block) == 1
    assert type(block.norm) is nn.RMSNorm and type(block.layers[0]) is FusedRoPE


def test_a_fused_model_deep_copies(qwen3_target):
    """The distillation teacher answers from a deep copy of the target (train/teacher.py)."""
    import copy

    model = outrider.load(str(qwen3_target), mode="baseline").target.model
    twin = copy.deepcopy(model)
    assert _fused_kinds(twin) == _fused_kinds(model)
    ids = mx.array([[3, 14, 15, 92]])
    assert mx.array_equal(twin(ids), model(ids)).item()
    twin.model.norm.weight = twin.model.norm.weight * 2  # its own weights, not shared
    assert not mx.array_equal(twin(ids), model(ids)).item()


def test_doctor_says_whether_norms_and_ropes_run_fused(monkeypatch):
    from typer.testing import CliRunner

    from outrider.cli import app

    def report() -> dict:
        return json.loads(CliRunner().invoke(app, ["doctor", "--json"]).stdout)

    assert report()["cpu_fusion"].startswith("norms and ropes")
    monkeypatch.setenv(cpu_fusion.FUSION_ENV, "off")
    assert report()["cpu_fusion"] == "off (OUTRIDER_CPU_FUSION)"
    monkeypatch.setenv(cpu_fusion.FUSION_ENV, "maybe")
    broken = report()
    assert broken["cpu_fusion"] is None
    assert any("OUTRIDER_CPU_FUSION must be on or off" in p for p in broken["problems"])


LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def test_llama_3s_rope_runs_fused_and_computes_what_mlx_lm_builds(tmp_path):
    """Llama 3.1 and later rope from a frequency table (mlx-lm's `Llama3RoPE`): fused, it
    computes the same logits as the model mlx-lm builds, to the bit, at positions where the
    scaled and smoothed frequencies matter."""
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.models.rope_utils import Llama3RoPE

    from outrider.testing import make_tiny_target

    path = make_tiny_target(tmp_path / "llama3", family="llama", rope_scaling=LLAMA3_SCALING)
    model = outrider.load(str(path), mode="baseline").target.model
    ropes = [m for _, m in model.named_modules() if isinstance(m, Llama3RoPE)]
    assert ropes and all(type(m) is FusedLlama3RoPE for m in ropes)
    plain = build_model(json.loads((path / "config.json").read_text()), 0)
    plain.load_weights(str(path / "model.safetensors"))
    assert not _fused_kinds(plain) and type(plain.model.layers[0].self_attn.rope) is Llama3RoPE
    ids = mx.array([[(7 * i) % 200 + 3 for i in range(90)]])
    outputs = []
    for net in (model, plain):
        cache = make_prompt_cache(net)
        outputs.append([net(ids, cache=cache), net(mx.array([[26]]), cache=cache)])
    for got, want in zip(*outputs):
        assert mx.array_equal(got, want).item()


def test_only_a_few_rows_take_the_compiled_rope():
    """A compiled rope keeps a trace per row count; a prompt's chunks (every length) would
    pile them up in a server, so wide ropes keep MLX's path (the same numbers either way)."""
    rope = nn.RoPE(32)
    fused = FusedRoPE(rope)
    calls = []
    compiled = fused._fused
    fused._fused = lambda x, offset: calls.append(x.shape[-2]) or compiled(x, offset)
    for rows in (1, 5, cpu_fusion.FUSED_ROWS, cpu_fusion.FUSED_ROWS + 1, 300):
        x = mx.random.normal((1, 2, rows, 32), key=mx.random.key(rows))
        assert mx.array_equal(fused(x, offset=3), rope(x, offset=3)).item()
    assert calls == [1, 5, cpu_fusion.FUSED_ROWS]
