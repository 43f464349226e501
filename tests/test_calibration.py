"""Calibration: a machine's verify curve and drafter cost, measured once, kept, and used by
`--max-draft auto` (which it makes the default); nothing it decides changes a token."""

from __future__ import annotations

import json
from dataclasses import replace

import mlx.core as mx
import pytest
from conftest import PROMPTS, plain_greedy
from live_server import wait_ready
from typer.testing import CliRunner

import outrider
from outrider import cli
from outrider.core import calibration, cuda_graphs
from outrider.core.calibration import Calibration
from outrider.core.device import on_cuda_gpu
from outrider.core.schedule import AutoCap


@pytest.fixture(scope="module")
def pipe(qwen3_target, drafters):
    return outrider.load(str(qwen3_target), str(drafters["dspark"]), mode="dspark")


def test_measure_keeps_a_curve_per_context_and_a_drafter_cost(pipe, tmp_path):
    passes, width = [], calibration.needed_width(pipe)
    cal = calibration.measure(
        pipe, contexts=(16, 48), max_width=width, repeats=1, progress=lambda *p: passes.append(p)
    )
    # one run of timed passes over both contexts (a slow moment lands on each alike), not
    # one context's passes after the other's
    assert passes and [d for d, _ in passes] == list(range(1, passes[0][1] + 1))
    assert sorted(cal.verify_ms) == [16, 48]
    assert all(len(v) == width and all(t > 0 for t in v) for v in cal.verify_ms.values())
    assert cal.draft_ms > 0  # a drafter round costs something; lookup's would be 0
    assert sorted(cal.plain_ms) == [16, 48] and all(t > 0 for t in cal.plain_ms.values())
    assert cal.round_cost(0, 16) == pytest.approx(cal.plain_ms[16] / 1000)
    assert cal.key["mode"] == "dspark" and cal.key["drafter"] == pipe.drafter_ref
    path = calibration.save(cal, tmp_path)
    assert calibration.load(pipe, tmp_path) == cal
    assert [c.path for c in calibration.stored(tmp_path)] == [path]
    other = outrider.load(str(pipe.target.name), mode="lookup", target=pipe.target)
    assert calibration.load(other, tmp_path) is None  # another mode: not this one's
    path.write_text("{not json")
    assert calibration.load(pipe, tmp_path) is None and calibration.stored(tmp_path) == []


def test_a_slow_machines_inline_measurement_is_quick(pipe, tmp_path, monkeypatch):
    """A first run's measurement estimated to outlast INLINE_SECONDS times one context at a
    few widths (with MLX's reference BLAS on 2 cores SmolLM2's whole one took 286 s, 47 s
    quick); the curve still covers every width, on lines between those timed, and the note
    says how to measure it whole. Within the bound, or asked for whole, nothing changes."""
    width = calibration.needed_width(pipe)
    timed: list[int] = []
    real = calibration._verify
    monkeypatch.setattr(
        calibration, "_verify", lambda t, c, block, taps: (timed.append(block.shape[0]), real(t, c, block, taps))
    )  # fmt: skip
    quick = calibration.measure(pipe, contexts=(16, 48), max_width=width, repeats=1, within=0.0)
    assert quick.quick and sorted(quick.verify_ms) == [16] and sorted(quick.plain_ms) == [16]
    measured = sorted({w for w in calibration.QUICK_WIDTHS if w <= width} | {width})
    assert sorted(set(timed)) == measured and len(measured) < width
    curve = quick.verify_ms[16]
    assert len(curve) == width and all(t > 0 for t in curve)
    for w in range(2, width):
        if w not in measured:  # on the line through its measured neighbours
            lo, hi = max(m for m in measured if m < w), min(m for m in measured if m > w)
            line = curve[lo - 1] + (w - lo) / (hi - lo) * (curve[hi - 1] - curve[lo - 1])
            assert curve[w - 1] == pytest.approx(line, abs=1e-3)
    assert "quick" in quick.measured_note() and "outrider calibrate" in quick.measured_note()
    path = calibration.save(quick, tmp_path)
    assert calibration.load(pipe, tmp_path) == quick and json.loads(path.read_text())["quick"]
    timed.clear()
    whole = calibration.measure(pipe, contexts=(16, 48), max_width=width, repeats=1, within=1e6)
    assert not whole.quick and sorted(whole.verify_ms) == [16, 48]
    assert sorted(set(timed)) == list(range(1, width + 1))
    assert "quick" not in whole.measured_note()


def test_a_quick_measurement_drops_widths_before_contexts():
    whole = (list(range(1, 17)), [128, 1024])
    sparse = list(calibration.QUICK_WIDTHS)
    # a one-row forward 50 ms, sixteen rows 110, a prefill 6 ms a token (the 2-core CPU with
    # OpenBLAS, SmolLM2): whole ~19.6 s, sparse ~14 s, sparse at 128 alone ~4 s
    args = (0.050, 0.110, 0.006, 3)
    assert calibration._plan(whole, 20.0, *args) == whole
    assert calibration._plan(whole, 17.0, *args) == (sparse, [128, 1024])
    assert calibration._plan(whole, 10.0, *args) == (sparse, [128])
    assert calibration._plan(whole, 0.0, *args) == (sparse, [128])  # the least there is
    assert calibration._plan(([1, 2, 3, 4, 5], [128]), 0.0, *args) == ([1, 2, 3, 4, 5], [128])


def test_a_first_uses_measurement_is_bounded(pipe, monkeypatch, tmp_path):
    """On the CPU; a GPU measures whole (its curve's steps decide padding)."""
    monkeypatch.setenv("OUTRIDER_CACHE", str(tmp_path))
    monkeypatch.setattr(calibration, "INLINE_SECONDS", 0.0)
    monkeypatch.setattr(calibration, "computes_on_host", lambda: False)
    whole, fresh = calibration.calibrated(pipe)
    assert fresh and not whole.quick
    whole.path.unlink()
    monkeypatch.setattr(calibration, "computes_on_host", lambda: True)
    cal, fresh = calibration.calibrated(pipe)
    assert fresh and cal.quick and len(cal.verify_ms) == 1
    assert calibration.calibrated(pipe) == (cal, False)  # kept: not measured again
    runner = CliRunner()
    doctor = runner.invoke(cli.app, ["doctor", "--json"])
    assert [c["quick"] for c in json.loads(doctor.stdout)["calibrations"]] == [True]
    assert "1 quick" in runner.invoke(cli.app, ["doctor"]).output


def test_timed_passes_run_every_measurement_once_a_pass():
    order = []
    runs = [lambda i=i: order.append(i) for i in range(3)]
    medians = calibration._interleaved(runs, repeats=2, budget=0.0)
    assert len(medians) == 3 and order == [0, 1, 2] * 3  # the untimed pass, then two timed


def test_a_curve_narrower_than_the_pipelines_rounds_is_measured_again(pipe, tmp_path):
    """`outrider calibrate --max-width 4` for a drafter that drafts 8 stored a curve that
    read every wider round at 4 rows' cost (the curve stops there), so `auto` took wide caps for
    cheap. Such a curve is not this pipeline's: loading it finds none (the command's note is
    checked in `test_calibrate_command_and_doctor`)."""
    need = calibration.needed_width(pipe)
    assert need == pipe.proposer.max_draft + 1 > 4
    narrow = calibration.measure(pipe, contexts=(16,), max_width=4, repeats=1)
    calibration.save(narrow, tmp_path)
    assert calibration.load(pipe, tmp_path) is None
    wide = replace(narrow, verify_ms={16: narrow.verify_ms[16] + [1.0] * (need - 4)})
    calibration.save(wide, tmp_path)
    assert calibration.load(pipe, tmp_path) == wide
    assert calibration.stored(tmp_path) == [wide]
    calibration.save(replace(wide, version=calibration.VERSION - 1), tmp_path)  # an older one
    assert calibration.load(pipe, tmp_path) is None and calibration.stored(tmp_path) == []


def test_a_rounds_drafter_cost_is_a_fixed_call_plus_a_cost_per_further_draft():
    cal = Calibration(key={}, verify_ms={128: [10.0] * 8}, draft_ms=2.0, draft_ms_per_token=0.5)
    assert cal.round_cost(1, 128) == pytest.approx((2.0 + 10.0) / 1000)
    assert cal.round_cost(5, 128) == pytest.approx((2.0 + 4 * 0.5 + 10.0) / 1000)
    assert Calibration.from_dict(cal.as_dict()) == cal  # kept and read back


def test_a_chain_drafter_is_timed_on_the_same_context_every_call(qwen3_target, tmp_path):
    """EAGLE-3 keeps the rows it drafts until their verification is observed; timing it call
    after call must not pile them up (it raised "context out of step" on the second call),
    and auto then runs it losslessly."""
    from outrider.testing import make_tiny_drafter

    drafter = make_tiny_drafter(tmp_path / "e3", qwen3_target, "eagle3", "deepspec")
    pipe = outrider.load(str(qwen3_target), str(drafter), "eagle3")
    cal = calibration.measure(pipe, contexts=(16,), max_width=8, repeats=2)
    assert cal.draft_ms > 0
    # the chain runs its layer once a draft: a round's drafter cost grows with its cap
    assert cal.draft_ms_per_token > 0 and cal.draft_cost(7) > cal.draft_cost(1)
    pipe.calibration = cal
    ids = pipe.encode(PROMPTS[0])
    got = pipe.generate(ids, max_tokens=20, max_draft="auto", stop_tokens=set())
    assert got.tokens == plain_greedy(qwen3_target, ids, 20)


def test_auto_measures_once_then_is_the_default_and_stays_lossless(qwen3_target, drafters):
    auto = outrider.load(str(qwen3_target), str(drafters["dspark"]), "dspark", max_draft="auto")
    said = auto.calibration.measured_note() if auto.calibration is not None else None
    assert said is not None and said in auto.info
    assert not any("measured this machine" in n for n in auto.notes)  # said, not warned
    again = outrider.load(str(qwen3_target), str(drafters["dspark"]), mode="dspark")
    assert again.auto_cap and again.calibration == auto.calibration
    assert not any("measured this machine" in n for n in again.info)  # kept, not measured
    ids = again.encode(PROMPTS[1])
    got = again.generate(ids, max_tokens=30, stop_tokens=set())
    assert got.tokens == plain_greedy(qwen3_target, ids, 30)
    report = got.to_json()
    assert report["max_draft"] == "auto" and report["calibration"]["file"]
    assert report["calibration"]["quick"] is False  # a tiny model: the whole curve in time


def test_the_cli_calibrates_on_first_use_and_a_library_load_waits_to_be_asked(
    qwen3_target, drafters, monkeypatch, tmp_path
):
    """`outrider generate` with no cap measures this machine once, so `auto` runs from the
    first run (a fixed cap can run slower than plain decoding where drafting does not pay);
    a given cap measures nothing, and `load` measures only when asked."""
    monkeypatch.setenv("OUTRIDER_CACHE", str(tmp_path))
    monkeypatch.setenv("OUTRIDER_CALIBRATE", "auto")  # the default (the suite's is off)
    target, drafter = str(qwen3_target), str(drafters["dspark"])
    fixed = outrider.load(target, drafter, "dspark")
    assert not fixed.auto_cap and fixed.calibration is None and not calibration.stored(tmp_path)
    runner = CliRunner()
    args = ["generate", "-m", target, "-d", drafter, "--mode", "dspark", "-p", PROMPTS[0]]
    given = runner.invoke(cli.app, [*args, "--max-draft", "3", "--max-tokens", "8", "--json"])
    assert given.exit_code == 0, given.output
    assert json.loads(given.stdout)["max_draft"] == 3 and not calibration.stored(tmp_path)
    first = runner.invoke(cli.app, [*args, "--max-tokens", "8", "--json"])
    assert first.exit_code == 0, first.output
    assert "note: calibrating this machine" in first.stderr  # said before the wait
    assert "measured this machine's costs" in first.stderr
    assert (
        json.loads(first.stdout)["max_draft"] == "auto" and len(calibration.stored(tmp_path)) == 1
    )
    again = runner.invoke(cli.app, [*args, "--max-tokens", "8", "--json"])
    assert json.loads(again.stdout)["max_draft"] == "auto"
    assert "measured this machine" not in again.stderr  # kept, not measured again
    assert outrider.load(target, drafter, "dspark").auto_cap  # kept: the library's default too


def test_a_measurement_asked_for_is_a_note_not_a_warning(
    qwen3_target, drafters, monkeypatch, tmp_path
):
    """`--max-draft auto` on a fresh machine measures at load; the CLI says so as a `note:`
    (what happened), keeping `warning:` for what a user should act on."""
    monkeypatch.setenv("OUTRIDER_CACHE", str(tmp_path))
    args = ["generate", "-m", str(qwen3_target), "-d", str(drafters["dspark"]), "--mode"]
    run = CliRunner().invoke(
        cli.app, [*args, "dspark", "-p", PROMPTS[0], "--max-draft", "auto", "--max-tokens", "4"]
    )
    assert run.exit_code == 0, run.output
    assert "note: measured this machine's costs" in run.stderr and "warning:" not in run.stderr


def test_a_server_load_calibrates_on_first_use(
    qwen3_target, drafters, monkeypatch, tmp_path, capsys
):
    """`outrider serve` (and /admin/load) measure a pair on its first load on a machine, in
    the load's `calibrating` phase, and serve `auto`; a given cap, or OUTRIDER_CALIBRATE=off,
    measures nothing."""
    from outrider.server.engine import Engine, LoadSpec
    from outrider.server.warnings import collect as collect_warnings

    monkeypatch.setenv("OUTRIDER_CACHE", str(tmp_path))
    phases = []

    real = calibration.calibrated

    def calibrated(pipe, *args, **kwargs):
        phases.append(engine.phase)  # the load's phase while it measures
        return real(pipe, *args, **kwargs)

    monkeypatch.setattr(calibration, "calibrated", calibrated)
    engine = Engine().start()  # the default loader, as `outrider serve` has
    try:
        spec = LoadSpec(str(qwen3_target), str(drafters["dspark"]), "dspark")

        def serving(spec: LoadSpec):
            engine.load(spec)
            wait_ready(engine)
            assert engine.state == "ready", engine.error
            return engine.pipeline

        assert not serving(spec).auto_cap and not calibration.stored(tmp_path)  # the suite's off
        monkeypatch.setenv("OUTRIDER_CALIBRATE", "auto")
        assert not serving(replace(spec, max_draft=3)).auto_cap
        assert not calibration.stored(tmp_path) and not phases
        pipe = serving(spec)
        assert pipe.auto_cap and pipe.calibration is not None and phases == ["calibrating"]
        assert [c.path for c in calibration.stored(tmp_path)] == [pipe.calibration.path]
        assert "note: calibrating this machine" in capsys.readouterr().err
        assert serving(spec).auto_cap and phases == ["calibrating"]  # kept: measured once
        # asked for (`--max-draft auto`) on a fresh machine, the load measures: a note, not one
        # of /health's warnings
        for kept in calibration.stored(tmp_path):
            kept.path.unlink()
        capsys.readouterr()
        assert serving(replace(spec, max_draft="auto")).auto_cap
        err = capsys.readouterr().err
        assert "note: measured this machine's costs" in err and "warning:" not in err
        assert [w for w in collect_warnings(engine) if w["code"] == "load_note"] == []
    finally:
        engine.stop()
    monkeypatch.setenv("OUTRIDER_CALIBRATE", "sometimes")
    with pytest.raises(outrider.OutriderError, match="OUTRIDER_CALIBRATE must be auto or off"):
        calibration.on_first_use()


def test_the_policy_reads_costs_off_the_calibrated_curve_rescaled_by_live_rounds():
    verify = {100: [10.0, 10.5, 11.0, 11.5, 12.0], 1000: [20.0, 30.0, 40.0, 50.0, 60.0]}
    cal = Calibration(key={}, verify_ms=verify, draft_ms=2.0)
    assert cal.round_cost(0, 100) == pytest.approx(0.010)
    assert cal.round_cost(2, 550) == pytest.approx(0.002 + 0.011 + 0.5 * (0.040 - 0.011))
    policy = AutoCap(4, calibration=cal, context=100, warmup=0)
    assert policy.cost(3) == pytest.approx(0.002 + 0.0115)
    policy.observe(1, 1, 2 * cal.round_cost(1, 100))  # live rounds cost twice the curve
    assert policy.cost(3) == pytest.approx(2 * (0.002 + 0.0115))
    policy.accept = [0.9] * 4
    assert policy.best(4) == 4  # cheap rows at a short context: draft the most
    policy.context = 1000
    policy.accept = [0.5] * 4
    assert policy.best(4) == 0  # at a long context every row costs: park


def test_calibrate_command_and_doctor(qwen3_target):
    runner = CliRunner()
    args = ["calibrate", "-m", str(qwen3_target), "--mode", "lookup"]
    out = runner.invoke(cli.app, [*args, "--contexts", "16,32", "--max-width", "3", "--json"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    assert set(data["verify_ms"]) == {"16", "32"} and len(data["verify_ms"]["16"]) == 3
    assert set(data["plain_ms"]) == {"16", "32"}
    table = runner.invoke(cli.app, [*args, "--contexts", "16,32", "--max-width", "2"])
    assert table.exit_code == 0 and "plain step, pipelined" in table.output
    assert "narrower than the 16 rows" in table.output  # lookup drafts 16: auto measures anew
    doctor = json.loads(runner.invoke(cli.app, ["doctor", "--json"]).stdout)
    assert [c["file"] for c in doctor["calibrations"]] == [data["file"]]
    assert [c["quick"] for c in doctor["calibrations"]] == [False]  # the command's is whole
    bad = runner.invoke(cli.app, [*args, "--contexts", "16,x"])
    assert bad.exit_code == 2 and "--contexts takes integers" in bad.output


def test_a_plain_step_costs_what_pipelined_decoding_measured():
    """Decoding queues each plain step's forward before reading the token before it, so on a
    GPU a plain step costs less than a one-row verify, which waits for its result: the policy
    weighs drafting rounds against the step as it runs, measured per context (a calibration
    from before that measurement falls back to the one-row verify)."""
    verify = {100: [10.0, 10.5, 11.0], 1000: [20.0, 30.0, 40.0]}
    cal = Calibration(key={}, verify_ms=verify, draft_ms=2.0, plain_ms={100: 6.0, 1000: 8.0})
    assert cal.round_cost(0, 100) == pytest.approx(0.006)
    assert cal.round_cost(0, 550) == pytest.approx(0.007)
    assert cal.round_cost(0, 5000) == pytest.approx(0.008)
    assert cal.round_cost(1, 100) == pytest.approx(0.002 + 0.0105)  # drafting rounds: as before
    again = Calibration.from_dict(json.loads(json.dumps(cal.as_dict())))
    assert again == cal
    old = cal.as_dict()
    del old["plain_ms"]
    assert Calibration.from_dict(old).round_cost(0, 100) == pytest.approx(0.010)
    policy = AutoCap(2, calibration=cal, context=100)
    policy.accept = [0.5, 0.5]  # 1.75 tokens a 13 ms round against one per 6 ms: park
    assert policy.best(2) == 0
    assert AutoCap(2, calibration=Calibration({}, verify, draft_ms=2.0), context=100).best(2, 0.9)


def test_the_key_names_the_attention_route_the_target_takes(qwen3_target, monkeypatch, tmp_path):
    """A curve timed with outrider's split attention is not one of MLX's own attention: the key
    names the route the loaded target's wrappers take, and neither loads the other's."""
    from outrider.core.compiled_layers import compiled_layers
    from outrider.core.device import ATTENTION_ENV

    monkeypatch.setenv(ATTENTION_ENV, "native")
    native = outrider.load(str(qwen3_target), mode="lookup")
    monkeypatch.setenv(ATTENTION_ENV, "split")  # the wrappers on the CPU too
    split = outrider.load(str(qwen3_target), mode="lookup")
    compiled = compiled_layers()  # a CUDA GPU's default: its route is named too
    assert calibration.calibration_key(native)["routes"] == ("compiled" if compiled else "native")
    assert (
        calibration.calibration_key(split)["routes"] == ("compiled," if compiled else "") + "split"
    )
    width = calibration.needed_width(split)
    cal = calibration.measure(split, contexts=(16,), max_width=width, repeats=1)
    assert cal.attention == "split"
    calibration.save(cal, tmp_path)
    assert calibration.load(split, tmp_path) == cal
    assert calibration.load(native, tmp_path) is None


def test_the_key_names_the_cpu_blas_so_installing_openblas_times_the_curve_again(
    qwen3_target, monkeypatch, tmp_path
):
    """On the CPU a verify's cost is mostly the BLAS's: a curve timed with MLX's reference BLAS
    (a multi-row verify at several one-row forwards) must not stand for OpenBLAS's (about one),
    or `auto` stays parked where drafting pays. The key names the BLAS MLX multiplies with;
    MLX's own is left unnamed, so curves timed on it before this field keep their key."""
    pipe = outrider.load(str(qwen3_target), mode="lookup")
    monkeypatch.setattr(calibration.blas, "state", lambda: calibration.blas.BlasState())
    reference = calibration.calibration_key(pipe)
    assert "cpu_blas" not in reference
    width = calibration.needed_width(pipe)
    cal = calibration.measure(pipe, contexts=(16,), max_width=width, repeats=1)
    calibration.save(cal, tmp_path)
    assert calibration.load(pipe, tmp_path) == cal
    openblas = calibration.blas.BlasState(path="/usr/lib/libopenblas.so.0", note="loaded")
    monkeypatch.setattr(calibration.blas, "state", lambda: openblas)
    if mx.default_device() != mx.cpu:  # a GPU's curve does not depend on the CPU's BLAS
        assert calibration.calibration_key(pipe) == reference
        return
    assert calibration.calibration_key(pipe)["cpu_blas"] == "/usr/lib/libopenblas.so.0"
    assert calibration.load(pipe, tmp_path) is None  # timed again, not the reference's curve


def test_the_key_names_cuda_graphs_switched_off(qwen3_target, monkeypatch):
    """A batching server turns MLX's CUDA graphs off, which doubles the demo target's plain
    step on an H100: its curve is kept apart from one timed with them on (their default). Off a
    CUDA GPU MLX never reads the switch, and the key ignores it."""
    pipe = outrider.load(str(qwen3_target), mode="lookup")
    monkeypatch.setenv(cuda_graphs.ENV, "1")
    on = calibration.calibration_key(pipe)
    assert "cuda_graphs" not in on  # the default's key is the one curves were timed under
    monkeypatch.setenv(cuda_graphs.ENV, "0")
    off = calibration.calibration_key(pipe)
    if on_cuda_gpu():
        assert off == {**on, "cuda_graphs": "off"}
        assert calibration.path_for(off) != calibration.path_for(on)
    else:
        assert off == on
