"""The registry: rows resolve whatever organisation and quantisation a model id carries, every
row names a packaging an installed format claims, `outrider registry check` passes on the
shipped rows and names each problem of a broken row or receipt, `registry add` drafts a row
that checks clean, and `--mode auto` falls back row mode -> other drafter modes -> lookup."""

from __future__ import annotations

import json
import shutil
import sys

import pytest
from typer.testing import CliRunner

from outrider.api import load
from outrider.cli import app
from outrider.core.plugins import Plugins
from outrider.registry import find_pair, load_pairs
from outrider.registry.resolver import Pair, pairs_from_rows, quant_of, receipts_dir
from outrider.registry.validate import claimed_architectures
from outrider.testing import make_tiny_drafter

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

DEMO_RECEIPT = "outrider-demo_h200.json"
GOOD_ROW = """
[[pair]]
id = "tiny"
target = "someone/tiny"
family = "dense"
mode = "dspark"
dspark = { repo = "outrider-demo/dspark", architecture = "Qwen3DSparkModel" }
cap = 4
receipt = "r.json"
source = "receipt: r.json"
"""


def _check(path) -> tuple[int, list[str], str]:
    result = CliRunner().invoke(app, ["registry", "check", "--file", str(path)])
    problems = [line for line in result.stderr.splitlines() if line.startswith("problem: ")]
    return result.exit_code, problems, result.stdout


@pytest.fixture
def contributed(tmp_path):
    """A registry folder as a pull request would make it: one row and the receipt it cites."""
    (tmp_path / "receipts").mkdir()
    shutil.copy(receipts_dir() / DEMO_RECEIPT, tmp_path / "receipts" / "r.json")
    (tmp_path / "targets.toml").write_text(GOOD_ROW)
    return tmp_path


def _edit_receipt(folder, change) -> None:
    path = folder / "receipts" / "r.json"
    receipt = json.loads(path.read_text())
    change(receipt)
    path.write_text(json.dumps(receipt))


def test_the_shipped_registry_checks_clean():
    result = CliRunner().invoke(app, ["registry", "check"])
    assert result.exit_code == 0, result.stderr
    assert "rows and" in result.stdout and "receipts valid" in result.stdout


def test_every_row_names_a_packaging_an_installed_format_claims():
    claims = claimed_architectures(Plugins(load_entrypoints=False))
    named = 0
    for pair in load_pairs():
        for variant in [pair, *(pair.for_quant(q) for q in pair.quants)]:
            for mode, ref in variant.drafter_refs().items():
                assert ref.architecture in claims, (pair.id, mode, ref)
                named += 1
    assert named >= 15  # the rows really name drafters (not an empty loop)


def test_a_contributed_row_with_its_receipt_checks_clean(contributed):
    code, problems, out = _check(contributed / "targets.toml")
    assert (code, problems) == (0, []) and "1 rows and 1 receipts valid" in out


BROKEN_ROWS = {
    "unknown architecture": (
        ('architecture = "Qwen3DSparkModel"', 'architecture = "MysteryDraftModel"'),
        "has architecture 'MysteryDraftModel', which no installed format claims",
    ),
    "no architecture": (
        (
            'dspark = { repo = "outrider-demo/dspark", architecture = "Qwen3DSparkModel" }',
            'dspark = "outrider-demo/dspark"',
        ),
        "names no architecture",
    ),
    "unknown mode": (('mode = "dspark"', 'mode = "warp"'), "unknown mode 'warp'"),
    "unknown family": (('family = "dense"', 'family = "nosuch"'), "unknown family 'nosuch'"),
    "missing receipt": (
        ('receipt = "r.json"', 'receipt = "gone.json"'),
        "gone.json: receipt not found",
    ),
    "cap mismatch": (("cap = 4", "cap = 5"), "cap 5 differs from r.json's dspark cap 4"),
    "mode not measured": (
        (
            'mode = "dspark"',
            'mode = "eagle3"\neagle3 = { repo = "x/e", architecture = "Qwen3Eagle3Model" }',
        ),
        "mode 'eagle3' was not measured in r.json",
    ),
    "missing key": (('family = "dense"\n', ""), "missing required key 'family'"),
    "typo key": (("cap = 4", "cap = 4\ncpa = 4"), "unknown keys ['cpa']"),
    "drafter not measured": (
        ('repo = "outrider-demo/dspark"', 'repo = "someone/other-dspark"'),
        "r.json measured dspark with drafter outrider-demo/dspark, not someone/other-dspark",
    ),
    "bad toml": (("cap = 4", "cap = = 4"), "not valid TOML"),
}


@pytest.mark.parametrize("case", sorted(BROKEN_ROWS))
def test_a_broken_row_fails_with_a_line_naming_it(contributed, case):
    (old, new), expected = BROKEN_ROWS[case]
    toml = contributed / "targets.toml"
    assert old in toml.read_text()
    toml.write_text(toml.read_text().replace(old, new))
    code, problems, _ = _check(toml)
    assert code == 1
    assert any(expected in line for line in problems), problems


BROKEN_RECEIPTS = {
    "lossless != runs": (
        lambda r: r["lossless"].update(identical=r["lossless"]["runs_checked"] - 3),
        "lossless count 222 identical + 0 fp ties != 225 runs checked",
    ),
    "no device stamp": (lambda r: r.pop("device"), "r.json: no device stamp"),
    "empty device stamp": (lambda r: r["device"].update(chip=""), "r.json: no device stamp"),
    "not greedy": (lambda r: r["settings"].update(greedy=False), "settings/greedy"),
    "wrong schema": (lambda r: r.update(schema="other/2"), "schema: schema:"),
}


@pytest.mark.parametrize("case", sorted(BROKEN_RECEIPTS))
def test_a_broken_receipt_fails_with_a_line_naming_it(contributed, case):
    change, expected = BROKEN_RECEIPTS[case]
    _edit_receipt(contributed, change)
    code, problems, _ = _check(contributed / "targets.toml")
    assert code == 1
    assert any(expected in line and "row 1 (tiny)" in line for line in problems), problems


def test_an_uncited_receipt_in_the_folder_is_validated_too(contributed):
    (contributed / "receipts" / "stray.json").write_text('{"schema": "outrider-benchmark/1"}')
    code, problems, _ = _check(contributed / "targets.toml")
    assert code == 1 and any(p.startswith("problem: stray.json: no device stamp") for p in problems)


def test_a_row_without_a_cap_is_checked_at_its_strategys_default_cap(contributed):
    toml = contributed / "targets.toml"
    toml.write_text(toml.read_text().replace("cap = 4\n", ""))
    assert _check(toml)[:2] == (0, [])  # the receipt ran dspark at 4, its default
    _edit_receipt(contributed, lambda r: r["settings"]["caps"].update(dspark=7))
    code, problems, _ = _check(toml)
    assert code == 1
    expected = "cap 4 (dspark's default; the row sets none) differs from r.json's dspark cap 7"
    assert any(expected in p for p in problems), problems


def test_a_quant_override_is_checked_against_its_receipt(contributed):
    toml = contributed / "targets.toml"
    toml.write_text(toml.read_text() + "\n[pair.quant.8bit]\ncap = 7\n")
    code, problems, _ = _check(toml)
    assert code == 1
    assert any("[quant.8bit]: cap 7 differs from r.json's dspark cap 4" in p for p in problems)


def test_two_rows_answering_to_one_name_fail(contributed):
    toml = contributed / "targets.toml"
    second = GOOD_ROW.replace('id = "tiny"', 'id = "tiny2"\naliases = ["tiny"]')
    toml.write_text(GOOD_ROW + second)
    code, problems, _ = _check(toml)
    assert code == 1 and any("name 'tiny' is already row 1 (tiny)'s" in p for p in problems)


# --- registry add -------------------------------------------------------------------------------


def test_registry_add_prints_a_row_that_round_trips_and_checks_clean(tmp_path):
    receipt = receipts_dir() / DEMO_RECEIPT
    result = CliRunner().invoke(app, ["registry", "add", str(receipt)])
    assert result.exit_code == 0, result.stderr
    row = tomllib.loads(result.stdout)["pair"][0]
    # dspark has the best mean speed-up over the suites in this receipt (1.43x vs 1.33x)
    assert (row["target"], row["mode"], row["cap"]) == ("outrider-demo/target", "dspark", 4)
    assert row["dspark"] == {"repo": "outrider-demo/dspark", "architecture": "Qwen3DSparkModel"}
    assert row["receipt"] == DEMO_RECEIPT and row["speedup"].startswith("1.61x code")
    pair = pairs_from_rows([row])[0]
    assert pair.drafter_for("dspark") == "outrider-demo/dspark" and pair.receipt == DEMO_RECEIPT
    (tmp_path / "receipts").mkdir()
    shutil.copy(receipt, tmp_path / "receipts")
    (tmp_path / "targets.toml").write_text(result.stdout)
    code, problems, _ = _check(tmp_path / "targets.toml")
    assert (code, problems) == (0, [])


def test_registry_add_takes_a_mode_and_refuses_a_broken_receipt(tmp_path):
    ok = CliRunner().invoke(
        app, ["registry", "add", str(receipts_dir() / "smollm2_h200.json"), "--mode", "lookup"]
    )
    row = tomllib.loads(ok.stdout)["pair"][0]
    assert (row["mode"], row["cap"]) == ("lookup", 6) and "dspark" not in row
    bad = json.loads((receipts_dir() / DEMO_RECEIPT).read_text())
    bad["lossless"]["identical"] = 0
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    result = CliRunner().invoke(app, ["registry", "add", str(tmp_path / "bad.json")])
    assert result.exit_code == 1 and "lossless count 0 identical" in result.stderr


# --- resolution ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "row", "quant"),
    [
        ("mlx-community/gemma-4-12B-it-8bit", "gemma-4-12b", "8bit"),
        ("mlx-community/gemma-4-12b-it-4bit", "gemma-4-12b", "4bit"),
        ("unsloth/gemma-4-12b-it-GGUF", "gemma-4-12b", None),
        ("lmstudio-community/gemma-4-12b-it-qat-GGUF", "gemma-4-12b", None),
        ("google/gemma-4-12b-it", "gemma-4-12b", None),
        (
            "mlx-community/NVIDIA-Nemotron-3.5-Lightning-30B-A3B-4bit",
            "nemotron-3.5-lightning-30b-a3b",
            "4bit",
        ),
        (
            "nvidia/NVIDIA-Nemotron-3.5-Lightning-30B-A3B-FP8",
            "nemotron-3.5-lightning-30b-a3b",
            "fp8",
        ),
        ("lmstudio-community/Qwen3-8B-GGUF", "qwen3-8b", None),
        ("unsloth/Qwen3-8B-UD-Q4_K_XL", "qwen3-8b", "q4_k_xl"),
        ("Qwen3-8B-Q4_K_M.gguf", "qwen3-8b", "q4_k_m"),
        ("unsloth/Qwen3-4B-unsloth-bnb-4bit", "qwen3-4b", "4bit"),
        ("mlx-community/Qwen3-14B-MLX-4bit", "qwen3-14b", "4bit"),
        ("someone/Qwen3.6-35B-A3B-NVFP4", "qwen3.6-35b-a3b", "nvfp4"),
        ("mlx-community/Qwen3-4B-bf16", "qwen3-4b", "bf16"),
    ],
)
def test_ids_resolve_whatever_their_organisation_and_quantisation(model, row, quant):
    assert quant_of(model) == quant
    pair = find_pair(model)
    assert pair is not None and pair.id == row


def test_unknown_and_near_miss_ids_resolve_to_no_row():
    assert find_pair("mlx-community/Qwen3-32B-4bit") is None
    assert find_pair("mlx-community/gemma-4-27b-it-4bit") is None


def test_a_row_names_settings_and_drafters_per_quantisation():
    muse4, muse8 = (find_pair(f"mlx-community/Muse-Glimmer-30B-{q}") for q in ("4bit", "8bit"))
    assert (muse4.cap, muse8.cap) == (2, 4) and muse8.quant == "8bit"
    assert muse4.drafters == muse8.drafters  # the same drafter, a different measured cap
    row = pairs_from_rows(
        [
            {
                "id": "m",
                "target": "o/m",
                "family": "dense",
                "mode": "dspark",
                "dspark": {"repo": "o/m-dspark", "architecture": "Qwen3DSparkModel"},
                "quant": {"4bit": {"dspark": {"repo": "o/m-dspark-q4", "architecture": "X"}}},
            }
        ]
    )
    assert row[0].drafter_for("dspark") == "o/m-dspark"
    assert row[0].drafter_for("dspark", "4-bit") == "o/m-dspark-q4"
    assert find_pair("mlx-community/m-4bit", row).drafters["dspark"] == "o/m-dspark-q4"
    assert find_pair("mlx-community/m-8bit", row).drafters["dspark"] == "o/m-dspark"


# --- --mode auto fallback -----------------------------------------------------------------------


@pytest.fixture(scope="module")
def zlab_dflash(tmp_path_factory, qwen3_target):
    folder = tmp_path_factory.mktemp("registry") / "dflash"
    return make_tiny_drafter(folder, qwen3_target, "dflash", "zlab", block_size=4, num_layers=1)


def _row(target, mode, **drafters) -> list[Pair]:
    return [Pair(id="tiny", target=str(target), family="dense", mode=mode, drafters=drafters)]


def test_auto_runs_the_rows_mode_when_its_drafter_loads(qwen3_target, zlab_dflash):
    pipe = load(str(qwen3_target), registry=_row(qwen3_target, "dflash", dflash=str(zlab_dflash)))
    assert (pipe.mode, pipe.notes) == ("dflash", [])


def test_auto_falls_back_to_another_drafter_mode_that_loads(qwen3_target, zlab_dflash):
    from conftest import plain_greedy

    rows = _row(qwen3_target, "dspark", dspark="nobody/missing-dspark", dflash=str(zlab_dflash))
    pipe = load(str(qwen3_target), registry=rows)
    assert pipe.mode == "dflash" and pipe.drafter_ref == str(zlab_dflash)
    assert len(pipe.notes) == 1
    assert (
        pipe.notes[0].startswith("--mode auto runs dflash")
        and "nobody/missing-dspark" in pipe.notes[0]
    )
    ids = [1, 5, 9, 14]
    got = pipe.generate(ids, max_tokens=8, stop_tokens=set()).tokens
    assert got == plain_greedy(qwen3_target, ids, 8)


def test_auto_falls_back_to_lookup_naming_each_reason(qwen3_target, tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["MysteryDraftModel"]}')
    rows = _row(qwen3_target, "warp", warp="x/y", dspark=str(tmp_path), dflash="nobody/gone")
    pipe = load(str(qwen3_target), registry=rows)
    assert pipe.mode == "lookup" and len(pipe.notes) == 1
    note = pipe.notes[0]
    assert note.startswith("--mode auto runs lookup for tiny")
    assert "warp: no warp strategy is installed" in note and "MysteryDraftModel" in note
    assert "nobody/gone" in note


def test_a_receipt_of_an_auto_run_checks_clean(contributed):
    """`--max-draft auto` writes "auto" as the arm's cap: a valid receipt."""

    def lookup_auto(receipt):
        receipt["settings"]["caps"]["lookup"] = "auto"
        for arm in receipt["arms"]:
            if arm["mode"] == "lookup":
                arm["cap"] = "auto"

    _edit_receipt(contributed, lookup_auto)
    assert _check(contributed / "targets.toml")[:2] == (0, [])
