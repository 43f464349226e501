"""Shared tiny models: real mlx-lm architectures at toy size, random weights, built offline."""

from __future__ import annotations

import gc
import os
import tempfile
from pathlib import Path

# Float32 products in full float32 on every backend. MLX's CUDA backend (and Apple's M5 neural
# accelerators) otherwise run them in TF32, a 10-bit mantissa, where a batch of rows and one row
# alone round apart by ~1e-3 of the logits' scale: random tiny models have top-two gaps that
# small every few dozen tokens, so the token-for-token comparisons below would compare ties,
# not the algorithm. Production keeps MLX's default; the benchmark's own lossless check reads
# a divergence under TF32 as a tie when it is one (`outrider/benchmark/runner.py`, `fp_tie`).
# Set before MLX is imported: MLX reads it once. Subprocesses inherit it.
os.environ.setdefault("MLX_ENABLE_TF32", "0")

# MLX before outrider, on purpose: this process keeps MLX's bundled reference BLAS
# (outrider/core/blas.py loads an optimized one only into processes that import outrider
# first), whose rows come out bit for bit the same at every forward width, which the rollback
# and split-verify tests compare. tests/test_cpu_blas.py checks the optimized BLAS in fresh
# processes; subprocess tests (the CLI, the server) run on whatever this machine has.
import mlx.core as mx
import pytest

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# rich draws tables as wide as the terminal; the tests read them at one width, whether run in a
# terminal or in a pytest-xdist worker (which has none, so rich would fall back to 80 columns)
os.environ["COLUMNS"] = "200"
# outrider's own cache (calibrations, converted drafters) never touches the user's: a fresh
# folder for the session, and one per test (below) for what tests store there.
os.environ["OUTRIDER_CACHE"] = tempfile.mkdtemp(prefix="outrider-cache-")
# MLX's compiled CUDA kernels: the `outrider` command keeps them in OUTRIDER_CACHE where nobody
# chose a folder (core/paths.py `keep_kernels`), here a fresh one per test, so each command a
# test runs would compile them again (minutes on a GPU): every process of the run shares MLX's
# own folder instead (imported after the settings above: huggingface-hub reads its own at import)
from outrider.core import paths  # noqa: E402

os.environ.setdefault(paths.PTX_CACHE_ENV, str(paths.mlx_kernel_cache()))
# `outrider generate` and `serve` measure a calibration on first use; tests of a fixed cap's
# accounting would each pay for one (tests/test_calibration.py turns it on where it checks it)
os.environ["OUTRIDER_CALIBRATE"] = "off"

from outrider.testing import make_tiny_drafter, make_tiny_target  # noqa: E402

PROMPTS = [
    "Write a short poem about the sea.",
    "def fibonacci(n):",
    "What is 12 times 7? Answer: 12 times 7 is",
]


def _freeze_what_lives_on() -> None:
    """Move every object alive now (imported modules, collected tests) out of the cyclic
    garbage collector's reach: they live for the whole session, and with half a million of them
    each full collection took ~0.3 s (18 s of a quick run, most inside the server tests). Garbage
    is collected first, so nothing that is freed is kept; objects made later are collected as
    usual."""
    gc.collect()
    gc.freeze()


_freeze_what_lives_on()  # pytest, mlx and outrider: the test modules' imports come next


def pytest_collection_finish(session):
    _freeze_what_lives_on()  # the test modules and what they import


@pytest.fixture(autouse=True)
def own_outrider_cache(tmp_path, monkeypatch):
    """Each test's calibrations (which make `--max-draft auto` the default) stay its own."""
    monkeypatch.setenv("OUTRIDER_CACHE", str(tmp_path / "outrider-cache"))


@pytest.fixture(scope="session")
def models_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def qwen3_target(models_dir):
    return make_tiny_target(models_dir / "qwen3", family="qwen3")


@pytest.fixture(scope="session")
def llama_target(models_dir):
    return make_tiny_target(models_dir / "llama", family="llama", seed=3)


@pytest.fixture(scope="session")
def qwen2_target(models_dir):
    return make_tiny_target(models_dir / "qwen2", family="qwen2", seed=5)


@pytest.fixture(scope="session")
def fallback_target(models_dir):
    """A model no family plugin claims (cohere2's sliding caches): the mlx-lm fallback runs
    it, one row at a time and without taps."""
    return make_tiny_target(
        models_dir / "fallback", family="llama", model_type="cohere2", head_dim=16,
        sliding_window=8, sliding_window_pattern=2,
    )  # fmt: skip


@pytest.fixture(scope="session")
def drafters(models_dir, qwen3_target):
    """Every packaging and head kind, blocks large enough for caps up to 8."""
    d = models_dir
    return {
        "dspark": make_tiny_drafter(d / "dspark", qwen3_target, "dspark", "deepspec", block_size=8),
        "dspark-gated": make_tiny_drafter(
            d / "dspark-gated", qwen3_target, "dspark", "deepspec", markov_type="gated"
        ),
        "dspark-rnn": make_tiny_drafter(
            d / "dspark-rnn", qwen3_target, "dspark", "deepspec", markov_type="rnn"
        ),
        "dflash-deepspec": make_tiny_drafter(
            d / "dflash-ds", qwen3_target, "dflash", "deepspec", block_size=8
        ),
        "dflash-zlab": make_tiny_drafter(
            d / "dflash-zlab", qwen3_target, "dflash", "zlab", block_size=9
        ),
    }


_PLAIN_CACHE: dict = {}  # model path -> mlx-lm model
_PLAIN_RUNS: dict = {}  # (model path, prompt, max_tokens) -> plain greedy tokens


def run_folder(tmp_path_factory, worker_id: str) -> Path:
    """A folder every pytest-xdist worker of this run shares (the workers' base folders sit in
    one per run); without xdist, this process's own. What one worker builds there under a
    `FileLock` the others read instead of building it again: `--dist loadgroup`'s groups
    do not keep such tests on one worker under pytest 9.2 (pytest-dev/pytest-xdist#1386)."""
    base = tmp_path_factory.getbasetemp()
    return base if worker_id == "master" else base.parent


@pytest.fixture(scope="session")  # kept across modules: built once a worker
def toy(tmp_path_factory) -> dict:
    """A target whose greedy choices are learnable, and a prompt file (training tests)."""
    from outrider.testing import make_toy_training_set

    root = tmp_path_factory.mktemp("train")
    target, prompts = make_toy_training_set(root)
    return {"root": root, "target": target, "prompts": prompts}


def toy_train_config(toy: dict, out, **overrides):
    """`outrider.testing.toy_train_config` for the `toy` fixture's pair."""
    from outrider.testing import toy_train_config as config

    return config(toy["target"], toy["prompts"], out, **overrides)


def decoder_layers(target) -> list:
    """A loaded target's decoder layers, the model's own blocks: looking through the tap
    wrappers and compiled layers (core/compiled_layers.py, on by default on a CUDA GPU) in
    front of them, so that a test that swaps a block's submodule swaps what every path runs."""
    from outrider.core.compiled_layers import CompiledLayer
    from outrider.core.taps import TappedLayer

    layers = [
        x.layer if isinstance(x, TappedLayer) else x for x in target.family.layers(target.model)
    ]
    return [x.layer if isinstance(x, CompiledLayer) else x for x in layers]


def fp32_close(a: mx.array, b: mx.array, atol: float, rtol: float = 0.0) -> bool:
    """`allclose` for float32 results of two computation orders. Where float32 matmuls run in
    TF32 (a 10-bit mantissa: MLX's CUDA backend, unless MLX_ENABLE_TF32=0) two orders agree to
    ~1e-3 of the values' scale, not to float32 rounding, so the bound grows to that; values
    held in half precision (a float16 pack on a GPU) agree to a few of their own steps;
    elsewhere it is the one given."""
    from outrider.core.device import tf32_matmuls

    scale = max(mx.abs(a).max().item(), mx.abs(b).max().item(), 1e-6)
    if tf32_matmuls():
        atol, rtol = max(atol, 2e-3 * scale), max(rtol, 2e-3)
    step = HALF_STEP.get(a.dtype)
    if step:
        atol, rtol = max(atol, 4 * step * scale), max(rtol, 4 * step)
    return mx.allclose(a, b, atol=atol, rtol=rtol).item()


# the spacing of half-precision values next to 1 (float16: 10 mantissa bits, bfloat16: 7)
HALF_STEP = {mx.float16: 2.0**-10, mx.bfloat16: 2.0**-7}


def same_bits(a: mx.array, b: mx.array) -> bool:
    """Equal bit for bit on the CPU; on a GPU, equal to float32 rounding (rtol 1e-4).

    For results that a forward of another width or a resumed run computes the same way. On the
    CPU a row's products do not depend on how many rows share them, so they are bitwise equal.
    A GPU picks its matmul and reduction kernels by problem shape (MLX's CUDA backend: cuBLAS
    tilings by row count, atomic sums in scatter-adds), so the same arithmetic rounds apart in
    the last bits there (the H200's suite run, docs/testing-on-gpu.md)."""
    if mx.default_device() == mx.cpu:
        return mx.array_equal(a, b).item()
    scale = max(mx.abs(a).max().item(), mx.abs(b).max().item(), 1e-6)
    return a.shape == b.shape and mx.allclose(a, b, atol=1e-5 * scale, rtol=1e-4).item()


def load_kv_bits(path, bits: int, **kwargs):
    """`outrider.load(path, kv_bits=bits, ...)`, or None where this device refuses the flag at
    load: a CUDA GPU, where MLX 0.32 computes attention over a quantized cache wrongly, or any
    device where the load check fails (`Target.quantize_kv`, docs/testing-on-gpu.md). Any other
    error still raises."""
    import outrider
    from outrider.core.errors import UnsupportedTargetError

    try:
        return outrider.load(str(path), kv_bits=bits, **kwargs)
    except UnsupportedTargetError as e:
        assert "MLX cannot run attention over a quantized cache" in str(e)
        return None


def plain_greedy(model_path, prompt_ids: list[int], max_tokens: int) -> list[int]:
    """mlx-lm's own plain greedy generation (the reference every mode must equal).

    Greedy decoding is deterministic and a model folder's weights never change during the
    session (the loaded model is kept per path too), so each (model, prompt, length) is
    generated once and every later call gets a copy of the same tokens."""
    from mlx_lm.generate import generate_step

    key = str(model_path)
    run = (key, tuple(int(t) for t in prompt_ids), max_tokens)
    if run in _PLAIN_RUNS:
        return list(_PLAIN_RUNS[run])
    if key not in _PLAIN_CACHE:
        _PLAIN_CACHE[key] = _load_plain(key)
    model = _PLAIN_CACHE[key]
    out = []
    for tok, _ in generate_step(mx.array(prompt_ids), model, max_tokens=max_tokens):
        out.append(int(tok))
        if len(out) == max_tokens:
            break
    _PLAIN_RUNS[run] = tuple(out)
    return out


def _load_plain(path: str):
    """mlx-lm's model, or for a multimodal checkpoint mlx-vlm's language model (ids -> logits),
    or for a GGUF file mlx-lm's model class over the file as outrider reads it (a separately
    built instance). A toy model's quantized layers one group wide are dequantized on a CUDA
    GPU, as outrider's loader does: the same weights, without MLX's wrong kernel for them."""
    import json
    from pathlib import Path

    from outrider.core import gguf, gguf_header
    from outrider.core.device import dense_single_groups

    if gguf_header.is_gguf(Path(path)):
        model = gguf.build_model(Path(path))
        dense_single_groups(model)
        return model
    if "vision_config" in json.loads((Path(path) / "config.json").read_text()):
        from mlx_vlm.utils import load_model

        from outrider.plugins.targets.sliding import LanguageTower

        return LanguageTower(load_model(Path(path)).language_model)
    from mlx_lm.utils import load

    model = load(path)[0]
    dense_single_groups(model)  # MLX's wrong CUDA kernel for one-group rows (core/device.py)
    return model


def pip_install_example(folder, site) -> None:
    """pip-install an example plugin into a private folder (no network, no build isolation)."""
    import subprocess
    import sys

    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation"]
        + ["--no-index", "--target", str(site), str(folder)],
        check=True,
        capture_output=True,
    )


@pytest.fixture
def ctrl_c_as_in_a_terminal():
    """SIGINT as a terminal's foreground command has it, however the suite was started: a
    script's background job (`pytest &`, some CI runners) has SIGINT ignored, and outrider leaves
    an ignored Ctrl-C ignored (tests/test_interrupt.py tests that), so a test of Ctrl-C would
    see nothing."""
    import signal

    before = signal.getsignal(signal.SIGINT)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)
