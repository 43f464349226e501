"""The roofline (core/roofline.py) and `GET /machine`: plain decoding's memory ceiling for the
loaded model on this machine, and how close a calibrated plain step comes to it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import requests
from live_server import live_server

import outrider
from outrider.core.calibration import Calibration
from outrider.core.roofline import (
    BANDWIDTH_ENV,
    Roofline,
    kv_bytes_per_token,
    peak_bandwidth,
    weight_bytes,
)
from outrider.server import machine
from outrider.server.engine import LoadSpec


@pytest.mark.parametrize(
    "name,gb_s",
    [
        ("NVIDIA H100 80GB HBM3", 3350.0),
        ("NVIDIA H100 PCIe", 2000.0),
        ("NVIDIA H200", 4800.0),
        ("NVIDIA GH200 480GB", 4000.0),
        ("NVIDIA L40", 864.0),
        ("NVIDIA L4", 300.0),
        ("Apple M2 Max", 400.0),
        ("Apple M2", 100.0),
        ("Apple M4 Pro", 273.0),
    ],
)
def test_peak_bandwidth_names_the_most_specific_chip(monkeypatch, name, gb_s):
    monkeypatch.delenv(BANDWIDTH_ENV, raising=False)
    assert peak_bandwidth(name) == (gb_s, "spec")


def test_an_unknown_chip_has_no_peak_unless_the_environment_gives_one(monkeypatch):
    monkeypatch.delenv(BANDWIDTH_ENV, raising=False)
    assert peak_bandwidth("a CPU") == (None, "unknown")
    monkeypatch.setenv(BANDWIDTH_ENV, "51.2")
    assert peak_bandwidth("a CPU") == (51.2, "env")
    monkeypatch.setenv(BANDWIDTH_ENV, "fast")  # not a number: ignored
    assert peak_bandwidth("a CPU") == (None, "unknown")


def test_ceiling_and_verdict_bands():
    roof = Roofline(1000.0, "spec", weights=8 * 10**9, kv_per_token=100_000)
    assert roof.ceiling(0) == pytest.approx(125.0)  # 1000 GB/s over 8 GB a step
    assert roof.ceiling(10_000) == pytest.approx(1000e9 / 9e9)
    assert roof.achieved_gb_s(10.0, 0) == pytest.approx(800.0)
    assert roof.verdict(10.0, 0)["level"] == "healthy"  # MBU 0.8
    assert roof.verdict(13.0, 0)["level"] == "ok"  # 0.62
    slow = roof.verdict(40.0, 0)
    assert slow["level"] == "structural" and slow["mbu"] == pytest.approx(0.2)
    assert roof.verdict(None, 0)["level"] == "unmeasured"
    blind = Roofline(None, "unknown", weights=8 * 10**9, kv_per_token=0)
    assert blind.ceiling(0) is None and blind.verdict(10.0, 0)["level"] == "unknown_peak"


def test_the_report_of_a_loaded_model(qwen3_target, monkeypatch):
    monkeypatch.setenv(BANDWIDTH_ENV, "100")
    pipe = outrider.load(str(qwen3_target), mode="baseline")
    weights = weight_bytes(pipe.target.model)
    kv = kv_bytes_per_token(pipe.target.config)
    cfg = pipe.target.config
    # keys and values of every layer, each kv head's head_dim, float32 on this machine's build
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    assert kv == 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 4
    assert weights > 0
    engine = SimpleNamespace(pipeline=pipe, context_window=256)
    got = machine.report(SimpleNamespace(engine=engine))
    assert got["bandwidth"] == {"gb_s": 100.0, "source": "env"}
    assert got["model"]["target_weight_bytes"] == weights
    assert got["roofline"]["tokens_per_sec_at_zero"] == pytest.approx(100e9 / weights, rel=1e-3)
    assert got["baseline"] is None and got["verdict"]["level"] == "unmeasured"
    pipe.calibration = Calibration(key={}, verify_ms={128: [2.0]}, plain_ms={128: 2.0, 1024: 3.0})
    got = machine.report(SimpleNamespace(engine=engine))
    base = got["baseline"]
    assert base["context"] == 128 and base["tokens_per_sec"] == 500.0
    assert base["achieved_gb_s"] == pytest.approx((weights + 128 * kv) / 2e-3 / 1e9, rel=1e-3)
    assert got["verdict"]["mbu"] == pytest.approx(base["achieved_gb_s"] / 100, rel=1e-2)


def test_machine_route_with_and_without_a_model(qwen3_target):
    with live_server(None) as (url, engine):
        empty = requests.get(url + "/machine", timeout=30).json()
        assert empty["model"] is None and empty["verdict"] is None
        assert empty["memory"]["mlx_active_bytes"] >= 0
        engine.load(LoadSpec(str(qwen3_target), mode="baseline"))
        from live_server import wait_ready

        wait_ready(engine)
        loaded = requests.get(url + "/machine", timeout=30).json()
        assert loaded["model"]["target"] == qwen3_target.name
        assert loaded["model"]["kv_bytes_per_token"] > 0


def test_health_warns_where_a_plain_step_is_far_below_the_ceiling(qwen3_target, monkeypatch):
    from outrider.server.metrics import Metrics
    from outrider.server.warnings import collect

    pipe = outrider.load(str(qwen3_target), mode="baseline")
    engine = SimpleNamespace(warning=None, warm_up_error=None, pipeline=pipe, prefix_cache=None,
                             metrics=Metrics())  # fmt: skip
    assert collect(engine) == []  # no calibration: nothing measured, nothing to say
    pipe.calibration = Calibration(key={}, verify_ms={128: [2.0]}, plain_ms={128: 2.0})
    step_gb_s = (pipe.target.weight_bytes + 128 * kv_bytes_per_token(pipe.target.config)) / 2e-3
    monkeypatch.setenv(BANDWIDTH_ENV, str(step_gb_s / 1e9 * 10))  # MBU 0.1
    (got,) = collect(engine)
    assert got["code"] == "host_bound" and "MBU 0.10" in got["message"]
    monkeypatch.setenv(BANDWIDTH_ENV, str(step_gb_s / 1e9 * 1.1))  # MBU 0.91: memory-bound
    assert collect(engine) == []
