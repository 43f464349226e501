"""`outrider models` (outrider/registry/listing.py) and `outrider doctor` (outrider/doctor.py)."""

from __future__ import annotations

import json

from cli_runner import invoke, run_module

from outrider import cli


def test_models_json_and_table():
    out = json.loads(invoke("models", "--json").stdout)
    row = next(r for r in out["pairs"] if r["id"] == "qwen3-8b")
    assert row["target"] == "Qwen/Qwen3-8B" and "dspark" in row["drafters"]
    assert "dense" in out["families"] and "lookup" in out["strategies"]
    table = invoke("models")
    assert table.exit_code == 0 and "qwen3-8b" in table.stdout and "strategies:" in table.stdout


def test_models_marks_what_is_cached(tmp_path):
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--Qwen--Qwen3-8B"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "snapshots" / commit / "config.json").write_text("{}")
    proc = run_module(
        "models",
        "--json",
        env={"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1", "HOME": str(tmp_path)},
    )
    assert proc.returncode == 0, proc.stderr
    rows = {r["id"]: r for r in json.loads(proc.stdout)["pairs"]}
    assert rows["qwen3-8b"]["target_local"] is True
    assert rows["qwen3-4b"]["target_local"] is False
    assert rows["qwen3-8b"]["drafters"]["dspark"]["local"] is False


def test_doctor():
    result = invoke("doctor", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["mlx_version"] and isinstance(report["problems"], list)
    assert report["problems"] == []
    for key in (
        "outrider_version",
        "python_version",
        "platform",
        "mlx_default_device",
        "metal_available",
        "mlx_lm_version",
        "plugins",
        "hf_cache",
        "lmstudio_dirs",
        "outrider_cache",
    ):
        assert key in report
    text = invoke("doctor")
    assert text.exit_code == 0 and "mlx version" in text.stdout


def test_doctor_says_whether_float32_products_run_in_tf32(monkeypatch):
    from outrider.core import device

    monkeypatch.setattr(device, "on_cuda_gpu", lambda: True)
    monkeypatch.setenv("MLX_ENABLE_TF32", "1")
    assert json.loads(invoke("doctor", "--json").stdout)["float32_matmuls"].startswith("tf32")
    monkeypatch.setenv("MLX_ENABLE_TF32", "0")
    assert json.loads(invoke("doctor", "--json").stdout)["float32_matmuls"] == "float32"


def test_doctor_says_whose_kernel_runs_quantized_products_of_a_few_rows(monkeypatch):
    from outrider.core.device import on_cuda_gpu

    here = "cuda-rows" if on_cuda_gpu() else "none"
    shown = json.loads(invoke("doctor", "--json").stdout)["quantized_rows"]
    used = "cuda-rows where measured faster (siblings grouped), else mlx"
    used = used if on_cuda_gpu() else "mlx"
    assert shown == f"{used} (OUTRIDER_MATMUL=auto; kernels that run here: {here})"
    monkeypatch.setenv("OUTRIDER_MATMUL", "rows")
    shown = json.loads(invoke("doctor", "--json").stdout)["quantized_rows"]
    assert shown.startswith("cuda-rows" if on_cuda_gpu() else "mlx (OUTRIDER_MATMUL=rows")
    monkeypatch.setenv("OUTRIDER_MATMUL", "fastest")
    report = json.loads(invoke("doctor", "--json").stdout)
    assert report["quantized_rows"] is None
    assert any("OUTRIDER_MATMUL must be" in p for p in report["problems"])


def test_models_shows_the_cap_that_runs():
    table = invoke("models", "--json")
    demo = next(r for r in json.loads(table.stdout)["pairs"] if r["id"] == "outrider-demo")
    assert demo["cap"] in (None, 0)  # the row leaves the cap to the strategy
    cap = cli.plugins().strategy(demo["mode"]).default_cap
    line = next(ln for ln in invoke("models").stdout.splitlines() if "outrider-demo " in ln)
    assert f" {cap} " in line and "—" not in line.split("dspark")[1].split("x")[0]
