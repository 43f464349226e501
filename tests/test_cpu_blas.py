"""MLX's CPU backend with an optimized BLAS (core/blas.py) and quantized weights run dense
(core/device.py's `dense_on_cpu`).

The in-process tests run on whatever BLAS this test process has (conftest imports MLX first, so
MLX's reference one: the bit-for-bit comparisons of forwards of different widths elsewhere in
the suite rely on it). What a user's process gets, with outrider imported first, is checked in
fresh interpreters here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import mlx.core as mx
import mlx.nn as nn
import pytest

from outrider.core import blas, device

_CHILD_ENV = {**os.environ, "OUTRIDER_MATMUL": "auto"}


def _run(code: str, **env: str) -> dict:
    """Run `code` in a fresh interpreter; it prints one JSON line last."""
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={**_CHILD_ENV, **env},
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


STATE = "import json, outrider; from outrider.core import blas; print(json.dumps(blas.state().as_dict()))"


def _optimized_blas_installed() -> bool:
    return _run(STATE, OUTRIDER_BLAS="")["optimized"]


def _quantized_model() -> nn.Module:
    mx.random.seed(0)
    model = nn.Sequential(nn.Embedding(64, 64), nn.Linear(64, 128), nn.Linear(128, 64))
    nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())
    return model


def test_make_dense_keeps_the_quantized_values_in_float32() -> None:
    model = _quantized_model()
    ids = mx.array([[1, 5, 9, 33]])
    before = model(ids)
    linear = model.layers[1]
    want = mx.dequantize(
        linear.weight, linear.scales.astype(mx.float32), linear.biases.astype(mx.float32), 32, 4
    )
    device.make_dense(model)
    modules = [m for _, m in model.named_modules()]
    assert not any(isinstance(m, (nn.QuantizedLinear, nn.QuantizedEmbedding)) for m in modules)
    assert isinstance(model.layers[1], nn.Linear) and isinstance(model.layers[0], nn.Embedding)
    assert mx.array_equal(model.layers[1].weight, want).item()
    assert all(p.dtype == mx.float32 for _, p in _flat(model))
    after = model(ids)
    assert mx.allclose(after, before, atol=1e-4, rtol=1e-4).item()


def _flat(model: nn.Module) -> list:
    from mlx.utils import tree_flatten

    return tree_flatten(model.parameters())


def test_dense_on_cpu_needs_an_optimized_blas_a_quantized_model_and_room(monkeypatch) -> None:
    model = _quantized_model()
    monkeypatch.setattr(blas, "state", lambda: blas.BlasState(path="/lib/libopenblas.so.0"))
    monkeypatch.delenv(device.MATMUL_ENV, raising=False)
    was = mx.default_device()
    mx.set_default_device(mx.cpu)  # the rule is the CPU's (on a GPU it is always no)
    try:
        assert device.dense_on_cpu(model)
        monkeypatch.setenv(device.MATMUL_ENV, "native")
        assert not device.dense_on_cpu(model)
        monkeypatch.delenv(device.MATMUL_ENV)
        monkeypatch.setattr(device, "DENSE_MEMORY_SHARE", 0.0)
        assert not device.dense_on_cpu(model)
        monkeypatch.setattr(device, "DENSE_MEMORY_SHARE", 0.25)
        assert not device.dense_on_cpu(nn.Sequential(nn.Linear(64, 64)))
        monkeypatch.setattr(blas, "state", lambda: blas.BlasState(note="reference"))
        assert not device.dense_on_cpu(model)
    finally:
        mx.set_default_device(was)


def test_a_blas_that_cannot_load_leaves_mlx_working_and_says_why() -> None:
    code = (
        "import json, outrider, mlx.core as mx; from outrider.core import blas; "
        "s = blas.state().as_dict(); s['sum'] = (mx.ones((3, 4)) @ mx.ones((4, 2))).sum().item(); "
        "print(json.dumps(s))"
    )
    got = _run(code, OUTRIDER_BLAS="/nonexistent/libnothing.so")
    assert not got["optimized"]
    assert "/nonexistent/libnothing.so" in got["note"]
    assert got["sum"] == 24.0
    assert _run(STATE, OUTRIDER_BLAS="reference") == {
        "optimized": False,
        "path": "",
        "note": "OUTRIDER_BLAS=reference",
    }


def test_mlx_imported_first_keeps_its_own_blas_and_doctor_says_so() -> None:
    code = "import mlx.core, json, outrider; from outrider.core import blas; print(json.dumps(blas.state().as_dict()))"
    got = _run(code, OUTRIDER_BLAS="")
    assert not got["optimized"]
    assert "imported before outrider" in got["note"]


def test_an_installed_openblas_is_what_outrider_loads_for_mlx() -> None:
    if not _optimized_blas_installed():
        pytest.skip("no optimized BLAS on this machine (Debian/Ubuntu: apt install libopenblas0)")
    code = (
        "import json, outrider; from outrider.core import blas; s = blas.state().as_dict(); "
        "s['mapped'] = s['path'] in open('/proc/self/maps').read(); print(json.dumps(s))"
    )
    got = _run(code, OUTRIDER_BLAS="")
    assert got["optimized"] and got["mapped"]
    assert "blas" in os.path.basename(got["path"]).lower()


# Greedy output of every mode equals plain decoding of the same (dense) target, in the process a
# user gets: outrider imported first, the demo pair's quantized target and drafters run dense.
# On the CPU device, also on a machine with a GPU (where weights stay quantized).
LOSSLESS = """
import json, outrider
import mlx.core as mx
import mlx.nn as nn
mx.set_default_device(mx.cpu)
from outrider.api import load
from outrider.core import blas
prompts = ["def fibonacci(n):", "Write a short poem about the sea."]
out = {"blas": blas.state().optimized, "modes": {}}
base = load("outrider-demo/target", None, "baseline")
quantized = lambda m: any(isinstance(x, (nn.QuantizedLinear, nn.QuantizedEmbedding))
                          for _, x in m.named_modules())
out["target_dense"] = not quantized(base.target.model)
plain = [base.generate(p, max_tokens=40).tokens for p in prompts]
for mode in ("dspark", "dflash", "lookup"):
    pipe = load("outrider-demo/target", None if mode == "lookup" else f"outrider-demo/{mode}",
                mode, target=base.target)
    if mode != "lookup":
        out["drafter_dense_" + mode] = not quantized(pipe.proposer.drafter)
    out["modes"][mode] = [pipe.generate(p, max_tokens=40).tokens for p in prompts] == plain
print(json.dumps(out))
"""


@pytest.mark.slow  # a subprocess decoding every mode: the full suite's
def test_every_mode_matches_plain_decoding_on_a_dense_target_under_an_optimized_blas() -> None:
    if not _optimized_blas_installed():
        pytest.skip("no optimized BLAS on this machine (Debian/Ubuntu: apt install libopenblas0)")
    got = _run(LOSSLESS, OUTRIDER_BLAS="")
    assert got["blas"] and got["target_dense"]
    assert got["drafter_dense_dspark"] and got["drafter_dense_dflash"]
    assert got["modes"] == {"dspark": True, "dflash": True, "lookup": True}


def test_doctor_says_how_to_install_openblas_only_where_none_was_found(monkeypatch) -> None:
    from outrider.doctor import _blas_report

    monkeypatch.setattr(blas, "state", lambda: blas.BlasState(note=blas.NOT_FOUND))
    assert "apt install libopenblas0" in _blas_report()
    late = "MLX was imported before outrider: it keeps its bundled BLAS"
    monkeypatch.setattr(blas, "state", lambda: blas.BlasState(note=late))
    assert _blas_report() == f"MLX's own: {late}"
    monkeypatch.setattr(blas, "state", lambda: blas.BlasState(path="/lib/libopenblas.so.0"))
    assert _blas_report() == "/lib/libopenblas.so.0"
