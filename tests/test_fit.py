"""Will it fit: weights from safetensors headers, the KV cache from config.json, this machine's
memory, and `outrider models`' size / fits / cached columns (no network: the Hub is faked)."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from typer.testing import CliRunner

from outrider.cli import app
from outrider.core import fit
from outrider.testing.configs import tiny_config


def test_a_tiny_model_folder_is_estimated_to_the_byte(qwen3_target, tmp_path):
    weights = sum(a.nbytes for a in mx.load(str(qwen3_target / "model.safetensors")).values())
    config = json.loads((qwen3_target / "config.json").read_text())
    # keys + values, 4 layers, 2 KV heads of 16, 4096 positions, float32
    assert (config["num_hidden_layers"], config["num_key_value_heads"]) == (4, 2)
    assert (config["head_dim"], config["max_position_embeddings"]) == (16, 4096)
    kv = 2 * 4 * 2 * 16 * 4096 * 4
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text("{}")
    mx.save_safetensors(str(drafter / "model.safetensors"), {"w": mx.zeros((3, 5), mx.float16)})
    est = fit.estimate(str(qwen3_target), str(drafter), memory=(10**12, "RAM"))
    assert (est.weights, est.kv_cache, est.window, est.drafter) == (weights, kv, 4096, 30)
    assert est.total == weights + kv + 30 and est.fits is True
    assert fit.estimate(str(qwen3_target), memory=(10**6, "RAM")).fits is False
    assert fit.estimate(str(qwen3_target), window=1024, memory=(0, "")).kv_cache == kv // 4
    assert fit.estimate("nobody/absent", memory=(10**12, "RAM")).fits is None  # offline: ?


def test_safetensors_headers_are_read_without_the_weights(tmp_path):
    path = tmp_path / "w.safetensors"
    mx.save_safetensors(str(path), {"a": mx.zeros((2, 3), mx.bfloat16), "b": mx.zeros((4,))})
    header = fit.read_safetensors_header(path)
    assert header["a"]["dtype"] == "BF16" and header["a"]["shape"] == [2, 3]
    assert fit.header_bytes(header) == 2 * 3 * 2 + 4 * 4
    assert fit.tensor_bytes("F16", [10, 10]) == 200  # no offsets: elements x width
    (tmp_path / "bad.safetensors").write_bytes(b"\xff" * 8 + b"junk")
    with pytest.raises(ValueError):
        fit.read_safetensors_header(tmp_path / "bad.safetensors")
    assert fit.local_weight_bytes(tmp_path) == 28 + 12  # an unreadable file counts its size


@pytest.mark.parametrize(
    ("family", "layers"),
    [
        ("qwen3", [(4096, 2, 16)] * 4),
        # gemma 4: sliding layers keep their window, full layers the global head dim
        ("gemma4_text", [(8, 1, 16), (4096, 1, 32)] * 2),
        ("gemma4", [(8, 1, 16), (4096, 1, 32)] * 2),  # nested text_config
        ("nemotron_h", [(4096, 2, 16)]),  # one "*" (attention) layer among Mamba and MoE
        ("qwen3_5", [(4096, 2, 16)] * 2),  # every other layer is linear attention
        ("lfm2", [(4096, 2, 16)] * 2),  # short convolutions between attention layers
    ],
)
def test_kv_cache_counts_only_attention_layers(family, layers):
    config = tiny_config(family)
    assert fit.cached_layers(config, 4096) == layers
    assert fit.kv_cache_bytes(config) == sum(2 * n * kv * d * 4 for n, kv, d in layers)


def test_machine_memory_is_known():
    memory, source = fit.machine_memory()
    assert memory and memory > 2**28 and source


def test_the_download_warning(monkeypatch):
    config = {"num_hidden_layers": 2, "num_attention_heads": 2, "head_dim": 8}
    monkeypatch.setattr(fit, "hub_weight_bytes", lambda repo: 20 * 10**9)
    monkeypatch.setattr(fit, "hub_config", lambda repo: config)
    monkeypatch.setattr(fit, "machine_memory", lambda: (16 * 10**9, "RAM"))
    line = fit.download_warning("someone/big")
    assert line == (
        "someone/big will likely not fit in this machine's memory: 20.0 GB weights (an "
        "estimate) against 16.0 GB of RAM; downloading anyway"
    )
    monkeypatch.setattr(fit, "machine_memory", lambda: (32 * 10**9, "RAM"))
    assert fit.download_warning("someone/big") is None
    monkeypatch.setattr(fit, "hub_weight_bytes", lambda repo: None)  # the Hub did not answer
    assert fit.download_warning("someone/big") is None


def test_models_json_has_size_fits_and_cached(monkeypatch):
    monkeypatch.setattr(fit, "machine_memory", lambda: (10**15, "RAM"))
    runner = CliRunner()
    out = runner.invoke(app, ["models", "--json"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    assert data["memory"] == {"bytes": 10**15, "source": "RAM"}
    rows = {r["id"]: r for r in data["pairs"]}
    demo = rows["outrider-demo"]  # package data: always on this machine
    assert demo["cached"] is True and demo["fits"] is True and demo["size_gb"] > 0
    assert demo["estimate"]["weights_bytes"] and demo["estimate"]["kv_cache_bytes"]
    assert demo["drafters"]["dspark"]["size_gb"] > 0 and demo["drafters"]["dspark"]["local"]
    absent = next(r for r in rows.values() if not r["cached"])
    assert absent["size_gb"] is None and absent["fits"] is None  # no network: unknown
    table = runner.invoke(app, ["models"]).stdout
    assert "fits" in table and "cached" in table and "size" in table
    line = next(ln for ln in table.splitlines() if "outrider-demo " in ln)
    assert " yes " in line and " MB" in line


def test_models_online_reads_the_hub_for_what_is_not_cached(monkeypatch):
    from outrider.registry.listing import model_rows

    config = {"num_hidden_layers": 2, "num_attention_heads": 2, "head_dim": 8}
    asked = []
    monkeypatch.setattr(fit, "hub_weight_bytes", lambda repo: asked.append(repo) or 9 * 10**9)
    monkeypatch.setattr(fit, "hub_config", lambda repo: {**config, "max_position_embeddings": 8})
    monkeypatch.setattr(fit, "machine_memory", lambda: (16 * 10**9, "RAM"))
    rows = {r["id"]: r for r in model_rows(online=True)}
    row = rows["qwen3-8b"]
    assert row["size_gb"] == 9.0 and row["drafters"]["dspark"]["size_gb"] == 9.0
    assert row["fits"] is False  # 9 GB target + 9 GB drafter > 16 GB
    assert "Qwen/Qwen3-8B" in asked and "outrider-demo/target" not in asked  # cached: local
    monkeypatch.setattr(fit, "hub_weight_bytes", lambda repo: None)  # the Hub did not answer
    assert model_rows(online=True)[0]["fits"] is None


def test_kv_bits_shrink_the_kv_estimate(qwen3_target):
    config = json.loads((qwen3_target / "config.json").read_text())
    plain = fit.kv_cache_bytes(config)
    assert plain == 2 * 4 * 2 * 16 * 4096 * 4  # float32 values
    # a value of b bits, plus a float32 scale and bias for every 64 values
    assert fit.kv_cache_bytes(config, kv_bits=8) == plain * (1 + 8 / 64) / 4
    assert fit.kv_cache_bytes(config, kv_bits=4) == plain * (0.5 + 8 / 64) / 4


def test_the_load_warning_names_what_would_fit(qwen3_target):
    """A loaded model whose KV cache at the full window (in every batched request) would not
    fit is told so, with the context window, --kv-bits and --max-batch that would."""
    weights, kv = fit.local_weight_bytes(qwen3_target), 2 * 4 * 2 * 16 * 4096 * 4
    target = str(qwen3_target)
    line = fit.load_warning(target, memory=(weights + kv // 2, "RAM"))  # half the window fits
    assert "KV cache at the full context window of 4,096 tokens" in line
    assert "--context-window 2048" in line and "--kv-bits 8" in line and "--kv-bits 4" in line
    assert "--max-batch" not in line
    assert fit.load_warning(target, memory=(weights + kv, "RAM")) is None
    assert fit.load_warning(target, kv_bits=4, memory=(weights + kv // 2, "RAM")) is None
    line = fit.load_warning(target, kv_bits=8, memory=(weights + kv // 4, "RAM"))
    assert "--kv-bits 4" in line and "--kv-bits 8" not in line  # 8 bits is what it has
    line = fit.load_warning(target, rows=4, memory=(weights + kv, "RAM"))
    assert "(4 requests decoding together)" in line and "--context-window 1024" in line
    assert "a smaller --max-batch" in line
    assert fit.load_warning(target, window=1024, rows=4, memory=(weights + kv, "RAM")) is None
    assert fit.load_warning("nobody/absent", memory=(1, "RAM")) is None  # unknown: no advice


def test_serve_warns_at_load_when_the_window_would_not_fit(qwen3_target, monkeypatch):
    """The server's load runs the same check, for the batch it will decode, and /health shows
    it; a context window that fits says nothing."""
    import requests
    from live_server import live_server

    from outrider.server.engine import LoadSpec

    weights, kv = fit.local_weight_bytes(qwen3_target), 2 * 4 * 2 * 16 * 4096 * 4
    monkeypatch.setattr(fit, "machine_memory", lambda: (weights + 2 * kv, "RAM"))
    with live_server(LoadSpec(str(qwen3_target), mode="lookup"), max_batch=4) as (url, _):
        warning = requests.get(url + "/health").json()["load"]["warning"]
        assert "(4 requests decoding together)" in warning and "--context-window 2048" in warning
    spec = LoadSpec(str(qwen3_target), mode="lookup", context_window=2048)
    with live_server(spec, max_batch=4) as (url, _):
        assert requests.get(url + "/health").json()["load"]["warning"] is None
