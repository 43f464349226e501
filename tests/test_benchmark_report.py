"""`outrider benchmark --plot / --html / --from-receipt`: charts and a page drawn from real H200
receipts, old receipts drawn with "not recorded" notes, and one error line for each bad input."""

from __future__ import annotations

import json
import struct
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from outrider import cli
from outrider.benchmark import report

DOCS = Path(__file__).resolve().parent.parent / "docs"
# the same benchmark on the H200: written with accept counts and timeline, and written before them
NEW = DOCS / "receipts" / "outrider-demo_h200_report.json"
OLD = DOCS / "receipts" / "outrider-demo_h200_run3.json"
MODES = ["baseline", "dspark", "dflash", "lookup", "mlx-lm"]
SUITES = ["chat", "code", "math"]


def bench(*args: str):
    return CliRunner().invoke(cli.app, ["benchmark", *args])


@pytest.fixture(scope="session")  # kept across modules: built once a worker
def drawn(tmp_path_factory):
    """The new receipt through the command (PNG and HTML), the old one as SVG."""
    out = tmp_path_factory.mktemp("report")
    result = bench(
        "--from-receipt", str(NEW), "--plot", str(out / "r.png"), "--html", str(out / "r.html")
    )
    assert result.exit_code == 0, result.output
    report.write_plot(report.load_receipt(OLD), out / "old.svg")
    return out, result.output


def test_from_receipt_prints_the_table_and_writes_a_png(drawn):
    out, output = drawn
    assert "outrider benchmark · outrider-demo/target · NVIDIA H200" in output
    assert "lossless: 225 runs checked against baseline, 225 token-identical" in output
    assert "1.61×" in output and "3.44" in output  # dspark on code: speed-up, accept length
    assert f"plot: {out / 'r.png'}" in output and f"html: {out / 'r.html'}" in output
    png = (out / "r.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 50_000
    width, height = struct.unpack(">II", png[16:24])  # the IHDR chunk
    assert width == 1100 and 1000 < height < 2000


def test_html_is_one_self_contained_page_with_charts_and_table(drawn):
    out, _ = drawn
    page = (out / "r.html").read_text()
    assert page.startswith("<!DOCTYPE html>") and page.count("<svg") == 3
    assert "<script" not in page and "src=" not in page and "<link" not in page
    assert "Acceptance per draft position" in page and "Decode tok/s of every timed run" in page
    assert "not recorded" not in page
    for mode in MODES:
        assert f"<td>{mode}</td>" in page.replace(' class=""', "")
        assert f">{mode}</text>" in page  # a legend entry, as SVG text
    for suite in SUITES:
        assert f"<td>{suite}</td>" in page.replace(' class=""', "")
    assert "dspark (cap 4, mean accept 2.79, 1722 rounds)" in page
    assert "225 token-identical" in page and "NVIDIA H200" in page


def test_an_old_receipt_draws_with_not_recorded_notes(drawn):
    out, _ = drawn
    svg = (out / "old.svg").read_text()
    assert svg.lstrip().startswith("<?xml") and "<svg" in svg
    assert "acceptance per draft position: not recorded in this receipt" in svg
    assert "per-run timeline not recorded in this receipt" in svg  # chart 3 from trials
    for name in [m for m in MODES if m != "baseline"] + SUITES + ["code 1", "math 3"]:
        assert f">{name}</text>" in svg, name


def test_chart_data_from_a_receipt():
    new, old = report.load_receipt(NEW), report.load_receipt(OLD)
    hists = report.accept_histograms(new)
    assert set(hists) == {"dspark", "dflash", "lookup"}  # plain arms have no rounds
    assert len(hists["dspark"]) == 5 and len(hists["dflash"]) == 9  # caps 4 and 8
    shares = report.position_acceptance(hists["dspark"], 4)
    assert shares == sorted(shares, reverse=True) and 0 < shares[-1] < shares[0] < 1
    assert report.position_acceptance([2, 1, 1], 3) == [0.5, 0.25, 0.0]
    assert report.mean_accept([2, 1, 1]) == pytest.approx((2 + 2 + 3) / 4)
    assert report.speedups(new)["dspark"]["code"] == pytest.approx(1.6082, abs=1e-3)
    timeline = report.timeline_of(new)
    assert set(timeline) == set(MODES) and all(len(v) == 45 for v in timeline.values())
    assert report.accept_histograms(old) is None and report.timeline_of(old) is None
    labels, series = report.trial_series(old)
    assert labels[:4] == ["chat 1", "code 1", "math 1", "chat 2"] and len(labels) == 9
    assert series["dspark"][1] == 32.356  # the first code trial's stall (docs/benchmarks.md)


def test_bad_receipts_and_plot_paths_get_one_error_line(tmp_path):
    (tmp_path / "broken.json").write_text("{")
    (tmp_path / "other.json").write_text(json.dumps({"schema": "something-else"}))
    (tmp_path / "empty.json").write_text(json.dumps({"schema": "outrider-benchmark/1"}))
    for args, message in (
        (["--from-receipt", str(tmp_path / "none.json")], "no such file"),
        (["--from-receipt", str(tmp_path)], "cannot read it"),
        (["--from-receipt", str(tmp_path / "broken.json")], "not JSON (line 1"),
        (["--from-receipt", str(tmp_path / "other.json")], "not an outrider benchmark receipt"),
        (["--from-receipt", str(tmp_path / "empty.json")], '"results" is not a list'),
        (["--from-receipt", str(OLD), "--plot", "r.pdf"], "must end in .png or .svg"),
        (["--from-receipt", str(OLD), "--model", "m"], "--model would do nothing"),
        # a bad --plot fails before any model loads
        (["--model", str(tmp_path / "no-model"), "--plot", "r.jpg"], "--plot r.jpg"),
    ):
        result = bench(*args)
        assert result.exit_code == 2, (args, result.output)
        lines = [line for line in result.output.splitlines() if line.strip()]
        assert lines == [lines[0]] and lines[0].startswith("error:"), result.output
        assert message in lines[0], (message, result.output)


def test_without_matplotlib_the_error_says_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now fails
    result = bench("--from-receipt", str(OLD), "--html", str(tmp_path / "r.html"))
    assert result.exit_code == 2
    assert "pip install 'outrider[plot]'" in result.output
    assert not (tmp_path / "r.html").exists()
    with pytest.raises(report.OutriderError, match=r"outrider\[plot\]"):
        report.write_plot(report.load_receipt(OLD), tmp_path / "r.png")


@pytest.mark.slow
def test_a_real_run_draws_every_chart(tmp_path, qwen3_target, drafters):
    """A tiny benchmark with --plot and --html: its receipt has everything the charts read."""
    args = ["--model", str(qwen3_target), "--trials", "2", "--max-tokens", "8"]
    args += ["--prompts-per-suite", "1", "--suites", "code,math", "--modes", "baseline,dspark"]
    args += ["--dspark-drafter", str(drafters["dspark"]), "--json", str(tmp_path / "r.json")]
    args += ["--plot", str(tmp_path / "r.svg"), "--html", str(tmp_path / "r.html")]
    result = bench(*args)
    assert result.exit_code == 0, result.output
    receipt = json.loads((tmp_path / "r.json").read_text())
    assert "--plot" in receipt["command"] and "--html" in receipt["command"]
    assert report.accept_histograms(receipt)["dspark"]
    assert [len(v) for v in receipt["timeline"].values()] == [4, 4, 4]  # 2 trials x 2 prompts
    for name in ("r.svg", "r.html"):
        text = (tmp_path / name).read_text()
        assert "not recorded" not in text and ">dspark</text>" in text
        assert "Acceptance per draft position" in text
