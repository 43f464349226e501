"""`outrider benchmark` on tiny fp32 models: the receipt's fields, the lossless check passing on
every arm, and failing loudly when a mode really does change the output."""

from __future__ import annotations

import json
from dataclasses import replace

import mlx.core as mx
import pytest
from conftest import plain_greedy
from typer.testing import CliRunner

from outrider import cli
from outrider.benchmark.records import Cell, Run, TrialStats
from outrider.benchmark.runner import BenchConfig, LosslessError, check_lossless, run_benchmark
from outrider.benchmark.suites import SUITES, load_suite
from outrider.core.device import on_cuda_gpu
from outrider.core.plugins import Plugins
from outrider.core.target import Target
from outrider.testing import make_tiny_drafter, make_tiny_target

ARMS = ["baseline", "dspark", "dflash", "lookup", "mlx-lm", "mlx-lm-spec"]
CELL_KEYS = {"suite", "mode", "accept_len", "decode_tps", "speedup", "ttft_s", "peak_memory_gb"}


@pytest.fixture(scope="module")
def peer_draft(models_dir):
    """A one-layer model with the target's tokenizer, for mlx-lm's speculative decoding."""
    return make_tiny_target(models_dir / "peer-draft", seed=7, num_hidden_layers=1)


@pytest.fixture(scope="module")
def shallow(models_dir) -> dict:
    """A 2-layer target and one-layer drafters for the runs over the shipped suites, whose
    prompts run to hundreds of tokens: every prefill and verify costs per layer, and what these
    tests check (the receipt, the lossless check) does not depend on depth."""
    target = make_tiny_target(models_dir / "bench-target", num_hidden_layers=2)
    return {
        "target": target,
        "dspark": make_tiny_drafter(
            models_dir / "bench-dspark", target, "dspark", "deepspec", block_size=8, num_layers=1
        ),
        "dflash": make_tiny_drafter(
            models_dir / "bench-dflash", target, "dflash", "deepspec", block_size=8, num_layers=1
        ),
    }


def bench_args(target, *extra: str) -> list[str]:
    return ["benchmark", "--model", str(target), "--trials", "1", "--max-tokens", "6"] + [
        "--prompts-per-suite",
        "2",
        *extra,
    ]


def test_shipped_suites_take_turns_between_their_sources():
    for suite, sources in SUITES.items():
        prompts = load_suite(suite)
        assert len(prompts) == 10 * len(sources)
        assert [p.source for p in prompts[: len(sources)]] == list(sources)
        assert all(p.text.strip() for p in prompts)


def test_receipt_has_every_field_and_every_arm_is_lossless(tmp_path, shallow, peer_draft):
    receipt_path = tmp_path / "receipt.json"
    args = bench_args(
        shallow["target"],
        "--modes",
        "baseline,dspark,dflash,lookup",
        "--dspark-drafter",
        str(shallow["dspark"]),
        "--dflash-drafter",
        str(shallow["dflash"]),
        "--peer-draft-model",
        str(peer_draft),
        "--json",
        str(receipt_path),
    )
    result = CliRunner().invoke(cli.app, args)
    assert result.exit_code == 0, result.output
    assert "36 token-identical" in result.output  # 3 suites x 2 prompts x 6 arms
    receipt = json.loads(receipt_path.read_text())

    assert receipt["schema"] == "outrider-benchmark/1"
    assert receipt["command"].startswith("outrider benchmark --model ")
    assert "--peer-draft-model" in receipt["command"]
    backend = "cuda" if on_cuda_gpu() else "cpu"
    assert receipt["device"]["chip"] and receipt["device"]["backend"] == backend
    assert receipt["os"] and receipt["python"]
    assert set(receipt["versions"]) == {"mlx", "mlx_lm", "outrider"}
    assert all(receipt["versions"].values())
    assert receipt["model"]["dtype"] == "float32" and receipt["model"]["quantization"] is None
    settings = receipt["settings"]
    assert settings["modes"] == ARMS
    assert settings["suites"] == {"chat": 2, "code": 2, "math": 2}
    assert settings["caps"]["dspark"] >= 1 and settings["caps"]["mlx-lm-spec"] == 2
    assert receipt["lossless"] == {"runs_checked": 36, "identical": 36, "fp_ties": []}

    cells = {(c["suite"], c["mode"]): c for c in receipt["results"]}
    assert set(cells) == {(s, a) for s in ("chat", "code", "math") for a in ARMS}
    for (_suite, arm), cell in cells.items():
        assert CELL_KEYS <= set(cell)
        assert cell["decode_tps"] > 0 and cell["ttft_s"] > 0 and cell["peak_memory_gb"] > 0
        assert cell["accept_len"] >= 1.0
        assert cell["speedup"] == pytest.approx(
            cell["decode_tps"] / cells[(_suite, "baseline")]["decode_tps"], rel=1e-3
        )
        if arm in ("baseline", "mlx-lm"):
            assert cell["accept_len"] == 1.0
            assert cell["accept_counts"] == []  # plain decoding: no speculative rounds
            assert cell["drafted_share"] is None
        else:  # rounds by accept length: one trial, so the mean is the cell's accept length
            counts = cell["accept_counts"]
            assert counts and all(c >= 0 for c in counts) and counts[-1] > 0
            rounds = sum(counts)
            assert rounds >= 2  # at least one round per prompt
            mean = sum((k + 1) * c for k, c in enumerate(counts)) / rounds
            assert mean == pytest.approx(cell["accept_len"], abs=1e-4)
            # the rounds made every token after each prompt's first (the last round's accept
            # length may run past --max-tokens, where the stopper cuts it)
            assert sum((k + 1) * c for k, c in enumerate(counts)) >= cell["tokens"] - 2
            if arm != "mlx-lm-spec":
                assert len(counts) - 1 <= settings["caps"][arm]
            # fixed caps never park: rounds committed every decoded token
            assert cell["drafted_share"] == pytest.approx(1.0)
    # every timed run, in run order, on one clock: 3 suites x 2 prompts per arm
    timeline = receipt["timeline"]
    assert set(timeline) == set(ARMS)
    starts = sorted(t for points in timeline.values() for t, _ in points)
    assert len(starts) == 36 and len(set(starts)) == 36 and starts[0] >= 0
    for arm, points in timeline.items():
        assert len(points) == 6 and [t for t, _ in points] == sorted(t for t, _ in points)
        assert all(tps > 0 for _, tps in points), arm


def test_benchmark_reference_is_mlx_lm_plain_greedy(shallow):
    target = shallow["target"]
    config = BenchConfig(
        model=str(target),
        modes=["baseline", "dspark"],
        suites=["code"],
        trials=1,
        max_tokens=8,
        prompts_per_suite=3,
        drafter=str(shallow["dspark"]),
    )
    order: list[str] = []
    report = run_benchmark(
        config, Plugins(load_entrypoints=False), lambda arm, p, t: order.append(arm)
    )
    assert report.checked == 3 * 3  # baseline, dspark, mlx-lm on three prompts
    # each arm goes first on one prompt (none always runs after another), yet the reference
    # every run is checked against stays baseline's, whether baseline ran first or last
    assert sorted(order[::3]) == sorted(set(order)) and len(set(order)) == 3
    eos = json.loads((target / "config.json").read_text())["eos_token_id"]
    for out in report.outputs.values():
        plain = plain_greedy(target, out["prompt"], 8)
        tokens = out["tokens"]
        assert tokens == plain[: len(tokens)]
        assert len(tokens) == 8 or plain[len(tokens)] == eos


def test_a_mode_that_changes_the_output_fails_the_run(monkeypatch, shallow):
    # A real bug class: rejected drafts left in the target's KV cache (no rollback). Baseline
    # and mlx-lm never roll back, so only the speculative mode is wrong.
    monkeypatch.setattr(Target, "rollback", lambda self, cache, n: None)
    args = bench_args(
        shallow["target"], "--modes", "baseline,dspark", "--drafter", str(shallow["dspark"])
    )
    result = CliRunner().invoke(cli.app, args)
    assert result.exit_code == 1
    assert "lossless check failed: mode dspark" in result.output
    assert "not a floating-point tie" in result.output


def test_a_divergence_at_an_exact_logit_tie_is_reported_not_failed(qwen3_target):
    plugins = Plugins(load_entrypoints=False)
    from outrider.api import load_target

    target = load_target(plugins, str(qwen3_target))
    prompt = [5, 17, 42, 99]
    want = plain_greedy(qwen3_target, prompt, 3)
    head = target.model.lm_head
    a, b, c = want[1], (want[1] + 1) % 262, (want[1] + 2) % 262
    weight = head.weight
    head.weight = mx.concatenate(  # token b's row becomes token a's: their logits tie exactly
        [weight[:b], weight[a : a + 1], weight[b + 1 :]], axis=0
    )
    where = {"mode": "m", "suite": "s", "prompt": "p", "trial": 0}
    tie = check_lossless(target, prompt, [want[0], b, want[2]], want, where)
    assert tie is not None and tie["kind"] == "fp-tie" and tie["position"] == 1
    assert tie["logit_got"] == tie["logit_expected"] == tie["logit_max"]
    with pytest.raises(LosslessError, match="position 1"):
        check_lossless(target, prompt, [want[0], c, want[2]], want, where)
    assert check_lossless(target, prompt, list(want), want, where) is None


def test_tie_precision_is_tf32_for_float32_logits_on_a_cuda_gpu(monkeypatch):
    from outrider.benchmark import runner

    monkeypatch.setenv("MLX_ENABLE_TF32", "1")
    monkeypatch.setattr(runner.mx, "default_device", lambda: mx.cpu)
    assert runner._mantissa_bits(mx.float32) == 23  # the CPU: full float32
    assert runner._mantissa_bits(mx.bfloat16) == 7
    monkeypatch.setattr(runner.mx, "default_device", lambda: mx.gpu)
    monkeypatch.setattr(runner.mx.cuda, "is_available", lambda: True)
    assert runner._mantissa_bits(mx.float32) == 10  # MLX CUDA's matmuls: TF32
    assert runner._mantissa_bits(mx.bfloat16) == 7  # never looser than the dtype's own
    monkeypatch.setenv("MLX_ENABLE_TF32", "0")  # MLX's switch back to full float32
    assert runner._mantissa_bits(mx.float32) == 23


def test_tie_precision_is_tf32_on_an_apple_gpu_with_neural_accelerators(monkeypatch):
    """MLX's Metal backend runs float32 products on the neural accelerators of an M5-class GPU
    (generation 17 or later, 18 for phone parts) from macOS 26.2, at TF32-like precision."""
    from outrider.benchmark import runner
    from outrider.core import device

    units = device.metal_matmul_units
    assert units("applegpu_g17s", "26.2") and units("applegpu_g17g", "26.3.1")
    assert not units("applegpu_g16s", "26.2")  # an M4: no accelerators
    assert not units("applegpu_g17s", "26.1")  # too old a macOS for MLX to use them
    assert not units("applegpu_g17p", "26.2") and units("applegpu_g18p", "27.0")
    assert not units("", "26.2") and not units("applegpu_g17s", "")

    monkeypatch.setenv("MLX_ENABLE_TF32", "1")
    monkeypatch.setattr(mx, "default_device", lambda: mx.gpu)
    monkeypatch.setattr(mx.cuda, "is_available", lambda: False)
    monkeypatch.setattr(mx.metal, "is_available", lambda: True)
    monkeypatch.setattr(mx, "device_info", lambda: {"architecture": "applegpu_g17s"})
    monkeypatch.setattr(device.platform, "mac_ver", lambda: ("26.2", ("", "", ""), "arm64"))
    assert runner._mantissa_bits(mx.float32) == 10
    monkeypatch.setattr(mx, "device_info", lambda: {"architecture": "applegpu_g16s"})
    assert runner._mantissa_bits(mx.float32) == 23  # an M4: full float32
    monkeypatch.setattr(mx, "device_info", lambda: {"architecture": "applegpu_g17s"})
    monkeypatch.setenv("MLX_ENABLE_TF32", "0")
    assert runner._mantissa_bits(mx.float32) == 23


def test_caps_run_one_arm_per_cap_each_checked_lossless(tmp_path, shallow):
    """`--caps 1,3,auto`: each drafting mode runs once per cap (arms named mode@cap), every
    arm's tokens checked against plain decoding; baseline runs once."""
    receipt_path = tmp_path / "receipt.json"
    args = bench_args(shallow["target"], "--modes", "baseline,dspark", "--suites", "code")
    args += ["--dspark-drafter", str(shallow["dspark"]), "--caps", "1,3,auto"]
    result = CliRunner().invoke(cli.app, [*args, "--json", str(receipt_path)])
    assert result.exit_code == 0, result.output
    receipt = json.loads(receipt_path.read_text())
    caps = {a["mode"]: a["cap"] for a in receipt["arms"]}
    assert caps["dspark@1"] == 1 and caps["dspark@3"] == 3 and caps["dspark@auto"] == "auto"
    assert "baseline" in caps and not any(m.startswith("baseline@") for m in caps)
    modes = {r["mode"] for r in receipt["results"]}
    assert {"dspark@1", "dspark@3", "dspark@auto"} <= modes
    assert receipt["lossless"]["runs_checked"] == receipt["lossless"]["identical"] > 0
    assert "--caps 1,3,auto" in receipt["command"]


def test_what_an_arms_load_changed_is_said_and_kept(tmp_path, shallow):
    """A cap past what the drafter drafts runs at the drafter's own (as `generate` warns): the
    benchmark says so on stderr, once, and keeps it in the receipt's arm."""
    receipt_path = tmp_path / "receipt.json"
    args = bench_args(shallow["target"], "--modes", "baseline,dspark", "--suites", "code")
    args += ["--dspark-drafter", str(shallow["dspark"]), "--max-draft", "40"]
    result = CliRunner().invoke(cli.app, [*args, "--json", str(receipt_path)])
    assert result.exit_code == 0, result.output
    said = [line for line in result.stderr.splitlines() if line.startswith("warning: dspark:")]
    assert len(said) == 1 and "--max-draft 40 is more than dspark can draft" in said[0]
    notes = {a["mode"]: a["notes"] for a in json.loads(receipt_path.read_text())["arms"]}
    assert notes["baseline"] == [] and "--max-draft 40" in notes["dspark"][0]


def test_bad_benchmark_options_get_one_error_line(qwen3_target):
    for extra, message in (
        (["--suites", "poetry"], "unknown suite poetry"),
        (["--modes", "baseline,warp"], "warp"),
        (["--trials", "0"], "--trials must be >= 1"),
        (["--modes", "baseline", "--dflash-drafter", "x"], "--modes has no dflash"),
        (["--caps", "2,auto", "--max-draft", "3"], "--caps and --max-draft"),
        (["--caps", "2,two"], "--max-draft takes a number, auto or full, got 'two'"),
        (["--caps", "2,2"], "names a cap twice"),
        (["--caps", ","], "comma-separated list"),
    ):
        result = CliRunner().invoke(cli.app, bench_args(qwen3_target, *extra))
        assert result.exit_code == 2, (extra, result.output)
        assert "error:" in result.output and message in result.output


def test_device_stamp_names_the_gpu_but_not_the_card(monkeypatch):
    from outrider.benchmark import receipt

    cuda_info = {  # what mx.device_info() returned on the project's H200 machine
        "total_memory": 150754820096,
        "free_memory": 149557477376,
        "compute_capability_major": 9,
        "compute_capability_minor": 0,
        "pci_bus_id": "0000:00:06.0",
        "uuid": "GPU-00000000-0000-0000-0000-000000000000",
        "architecture": "sm_90",
        "device_name": "NVIDIA H200",
    }
    monkeypatch.setattr(receipt.mx, "device_info", lambda: cuda_info)
    stamp = receipt.device_stamp()
    assert stamp["chip"] == "NVIDIA H200" and stamp["memory_gb"] == 150.75
    assert stamp["device_info"]["architecture"] == "sm_90"
    assert not {"uuid", "pci_bus_id", "free_memory"} & set(stamp["device_info"])


def test_own_prompt_files_run_as_suites_and_bad_ones_are_refused(qwen3_target, tmp_path):
    mine = tmp_path / "mine.jsonl"
    mine.write_text(
        json.dumps({"prompt": "Sort a list."}) + "\n\n" + json.dumps({"turns": ["Hi.", "Bye."]})
    )
    receipt = tmp_path / "r.json"
    args = ["benchmark", "--model", str(qwen3_target), "--trials", "1", "--max-tokens", "4"]
    result = CliRunner().invoke(
        cli.app,
        [*args, "--modes", "baseline,lookup", "--prompts", str(mine), "--json", str(receipt)],
    )
    assert result.exit_code == 0, result.output
    out = json.loads(receipt.read_text())
    assert {c["suite"] for c in out["results"]} == {"mine"}
    assert f"--prompts {mine}" in out["command"] and "--suites" not in out["command"]
    bad = tmp_path / "bad.jsonl"
    for text, message in (
        ("{not json", "line 1: not JSON"),
        ('{"prompt": ""}', "line 1: a row needs"),
        ("\n", "no prompts"),
    ):
        bad.write_text(text)
        result = CliRunner().invoke(cli.app, [*args, "--prompts", str(bad)])
        assert result.exit_code == 2 and message in result.output, result.output
    result = CliRunner().invoke(cli.app, [*args, "--prompts", str(tmp_path / "none.jsonl")])
    assert result.exit_code == 2 and "cannot read it" in result.output


def test_benchmark_without_a_model_runs_the_demo_model(monkeypatch, tmp_path):
    """`outrider benchmark` with no --model benchmarks the shipped demo target."""
    from outrider.demo import demo_target

    monkeypatch.delenv("OUTRIDER_DEMO_DIR", raising=False)
    receipt = tmp_path / "r.json"
    args = ["benchmark", "--trials", "1", "--max-tokens", "4", "--prompts-per-suite", "1"]
    result = CliRunner().invoke(
        cli.app, [*args, "--suites", "code", "--modes", "baseline", "--json", str(receipt)]
    )
    assert result.exit_code == 0, result.output
    out = json.loads(receipt.read_text())
    assert out["command"].startswith(f"outrider benchmark --model {demo_target()}")


def test_drafted_share_counts_what_rounds_committed_against_parked_steps():
    # 10 tokens: the first from prefill, 3 from one round (2 drafts accepted), 6 plain steps
    parked = Run(list(range(10)), 0.01, 0.1, accepts=[3], drafted=3)
    drafting = Run(list(range(5)), 0.01, 0.1, accepts=[2, 2], drafted=4)
    cell = Cell("code", "dspark", [TrialStats.of([parked, drafting])])
    assert cell.drafted_share == pytest.approx(7 / 13)
    assert cell.to_json()["drafted_share"] == pytest.approx(0.5385, abs=1e-4)
    plain = Cell("code", "baseline", [TrialStats.of([Run(list(range(10)), 0.01, 0.1)])])
    assert plain.drafted_share is None


def test_with_no_cap_an_arm_runs_as_generate_would_on_this_machine(shallow, monkeypatch):
    """No --max-draft: a drafting arm measures its costs on first use, as `generate` does, so
    the benchmark times what a user's first run gets (`auto`), not the registry's fixed cap;
    given caps (--caps) measure nothing."""
    monkeypatch.setenv("OUTRIDER_CALIBRATE", "auto")  # the default (the suite's is off)
    config = BenchConfig(model=str(shallow["target"]), modes=["baseline", "lookup"],
                         suites=["code"], trials=1, max_tokens=8, prompts_per_suite=1)  # fmt: skip
    report = run_benchmark(config, Plugins(load_entrypoints=False))
    arms = {a["mode"]: a for a in report.arms}
    assert arms["lookup"]["cap"] == "auto" and arms["lookup"]["calibration"]["verify_ms"]
    assert arms["baseline"]["calibration"] is None
    fixed = run_benchmark(replace(config, caps=[3]), Plugins(load_entrypoints=False))
    assert [a["cap"] for a in fixed.arms if a["mode"] == "lookup"] == [3]


def test_an_auto_arm_keeps_its_calibration_in_the_receipt(tmp_path, shallow):
    """What an auto arm's policy read (the costs it weighed rounds against) travels with the
    receipt, so a run that parked can be explained afterwards; plain arms have none."""
    from outrider.plugins.strategies.lookup import LONGER

    receipt_path = tmp_path / "receipt.json"
    args = bench_args(shallow["target"], "--modes", "baseline,lookup", "--suites", "code")
    args += ["--max-draft", "auto", "--json", str(receipt_path)]
    result = CliRunner().invoke(cli.app, args)
    assert result.exit_code == 0, result.output
    arms = {a["mode"]: a for a in json.loads(receipt_path.read_text())["arms"]}
    assert arms["lookup"]["cap"] == "auto"
    cal = arms["lookup"]["calibration"]
    assert cal["verify_ms"] and cal["plain_ms"] and cal["key"]["mode"] == "lookup"
    assert all(ms > 0 for curve in cal["verify_ms"].values() for ms in curve)
    assert arms["baseline"]["calibration"] is None and arms["mlx-lm"]["calibration"] is None
    # and what the policy believed once the suite was done: acceptance, costs, probes, parked
    policy = arms["lookup"]["policy"]["code#1"]
    assert policy["accept"] and all(0.0 <= a <= 1.0 for a in policy["accept"])
    assert set(policy["round_ms"]) >= {"0", "1"} and all(v > 0 for v in policy["round_ms"].values())
    assert isinstance(policy["parked"], bool) and policy["probes"] >= 0
    assert sum(policy["rounds"].values()) > 0  # it saw the suite's rounds and plain steps
    # lookup's copies: what each kind of match kept, and how many checks taught it (a kind
    # for each match length 1-4, then the longer 4-token ones; `MatchRates`)
    copies = policy["copies"]
    assert len(copies["kept"]) == len(copies["checks"]) == 1 + 4 + LONGER
    assert all(k >= 0.0 for k in copies["kept"]) and all(c >= 0 for c in copies["checks"])
    assert arms["baseline"]["policy"] is None
