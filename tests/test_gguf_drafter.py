"""DSpark drafters shipped as GGUF (PrismML's layout): converted once into DeepSpec's layout in
outrider's cache, run losslessly, refused by name when damaged; and `outrider convert`."""

from __future__ import annotations

import dataclasses
import json

import mlx.core as mx
import numpy as np
import pytest
from conftest import PROMPTS, plain_greedy
from typer.testing import CliRunner

import outrider
from outrider.api import load_drafter
from outrider.cli import app
from outrider.convert.deepspec import refusal
from outrider.core.errors import CheckpointError
from outrider.core.gguf_drafter import cache_dir, converted_drafter, deepspec_name
from outrider.core.plugins import Plugins
from outrider.testing import make_tiny_drafter
from outrider.testing.drafters import WRITERS
from outrider.testing.gguf import make_tiny_gguf


@pytest.fixture(scope="module", autouse=True)
def outrider_cache(tmp_path_factory):
    """Conversions land in a private cache, never the user's."""
    folder = tmp_path_factory.mktemp("outrider-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OUTRIDER_CACHE", str(folder))
        yield folder


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory, qwen3_target):
    """The -bf16 file as PrismML ships it, and the same weights in F32 beside a DeepSpec folder."""
    d = tmp_path_factory.mktemp("gguf-drafters")
    return {
        "bf16": make_tiny_drafter(d / "bf16", qwen3_target, "dspark", "gguf", block_size=8),
        "f32": make_tiny_drafter(
            d / "f32.gguf", qwen3_target, "dspark", "gguf", quant="F32", seed=4, block_size=8
        ),
        "deepspec": make_tiny_drafter(
            d / "ds", qwen3_target, "dspark", "deepspec", seed=4, block_size=8
        ),
    }


@pytest.fixture(scope="module")
def bf16_pipe(qwen3_target, ggufs):
    return outrider.load(str(qwen3_target), str(ggufs["bf16"]), mode="dspark")


def drafts(pipe, prompt: str, n: int = 30, cap: int = 8) -> tuple[list[int], list[list[int]]]:
    res = pipe.generate(pipe.encode(prompt), max_tokens=n, max_draft=cap, stop_tokens=set())
    return res.tokens, [list(r.drafted) for r in res.rounds]


def test_writer_lays_out_prismml_file(ggufs):
    from outrider.core.gguf_header import read_header

    header = read_header(ggufs["bf16"])
    assert ggufs["bf16"].suffix == ".gguf" and header.arch == "dspark"
    assert header.metadata["dspark.dspark.block_size"] == 8
    taps = json.loads((ggufs["deepspec"] / "config.json").read_text())["target_layer_ids"]
    assert header.metadata["dspark.dspark.target_layers"].tolist() == taps
    types = {t.name: t.type for t in header.tensors.values()}
    assert types["token_embd.weight"] == "BF16" and types["blk.0.attn_q.weight"] == "BF16"
    assert (
        types["blk.0.attn_norm.weight"] == "F32" and types["dspark.confidence_head.bias"] == "F32"
    )
    assert {"dspark.markov_head_a.weight", "dspark.fc.weight", "output.weight"} <= set(types)


@pytest.mark.parametrize("cap", [1, 3, 8])
def test_gguf_dspark_matches_plain_greedy(bf16_pipe, qwen3_target, cap):
    ids = bf16_pipe.encode(PROMPTS[1])
    got = bf16_pipe.generate(ids, max_tokens=20, max_draft=cap, stop_tokens=set())
    assert got.tokens == plain_greedy(qwen3_target, ids, 20)
    assert bf16_pipe.mode == "dspark" and bf16_pipe.drafter.kind == "dspark"
    assert max(len(r.drafted) for r in got.rounds) == cap


def test_same_weights_as_deepspec_give_identical_drafts(qwen3_target, ggufs):
    a = outrider.load(str(qwen3_target), str(ggufs["f32"]), drafter_bits=16)
    b = outrider.load(str(qwen3_target), str(ggufs["deepspec"]), drafter_bits=16)
    assert a.mode == b.mode == "dspark"  # auto picks the kind the converted config declares
    tokens_a, rounds_a = drafts(a, PROMPTS[0])
    tokens_b, rounds_b = drafts(b, PROMPTS[0])
    assert rounds_a == rounds_b and tokens_a == tokens_b
    assert len(rounds_a) > 1


def test_conversion_keeps_each_tensors_stored_dtype(ggufs, qwen3_target, tmp_path):
    f16 = make_tiny_drafter(tmp_path / "f16.gguf", qwen3_target, "dspark", "gguf", quant="F16")
    ref = mx.load(str(make_tiny_drafter(tmp_path / "ds", qwen3_target) / "model.safetensors"))
    for path, dtype in ((ggufs["bf16"], mx.bfloat16), (f16, mx.float16)):
        folder, _ = converted_drafter(path)
        got = mx.load(str(folder / "model.safetensors"))
        assert set(got) == set(ref)
        for name, arr in ref.items():
            want = arr.astype(dtype if arr.ndim == 2 else mx.float32)
            assert got[name].dtype == want.dtype, name
            assert mx.array_equal(got[name], want), name


def test_second_load_reuses_the_cache_and_a_changed_file_converts_again(tmp_path, qwen3_target):
    path = make_tiny_drafter(tmp_path / "d.gguf", qwen3_target, "dspark", "gguf", seed=7)
    folder, converted = converted_drafter(path)
    assert converted and folder.parent == cache_dir()
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert converted_drafter(path) == (folder, False)
    spec = load_drafter(Plugins(load_entrypoints=False), str(path))  # the --drafter path
    assert spec.format == "deepspec" and spec.kind == "dspark"
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp  # not written again
    config = json.loads((folder / "config.json").read_text())
    assert config["converted_from"] == "d.gguf" and config["architectures"] == ["Qwen3DSparkModel"]

    make_tiny_drafter(path, qwen3_target, "dspark", "gguf", seed=8)  # same name, new weights
    new_folder, converted = converted_drafter(path)
    assert converted and new_folder != folder
    old = mx.load(str(folder / "model.safetensors"))["fc.weight"]
    assert not mx.array_equal(mx.load(str(new_folder / "model.safetensors"))["fc.weight"], old)


def _truncate(path, keep: int) -> None:
    path.write_bytes(path.read_bytes()[:keep])


def _rename(path, old: bytes, new: bytes) -> None:
    """Rename a tensor in place (same length, so every offset stays valid)."""
    path.write_bytes(path.read_bytes().replace(old, new))


DAMAGE = {
    "truncated data": (dict(), lambda p: _truncate(p, -1000), "is truncated"),
    "truncated header": (dict(), lambda p: _truncate(p, 60), "is truncated"),
    "not a gguf": (dict(), lambda p: p.write_bytes(b"PK\x03\x04" + bytes(60)), "is not a GGUF"),
    "unknown architecture": (dict(architecture="dsparkle"), None, "'dsparkle' is not a DSpark"),
    "unsupported type": (dict(types={"blk.1.attn_q.weight": "Q8_1"}), None, "stored as Q8_1"),
    "missing tensor": (dict(drop=("blk.1.ffn_up.weight",)), None, "lacks the tensor"),
    "log-snr tensors, no flag": (
        dict(log_snr=True, metadata={"dspark.dspark.log_snr_conditioning": False}),
        None,
        "carries log-SNR tensors",
    ),
    "missing metadata": (
        dict(metadata={"dspark.dspark.mask_token_id": None}),
        None,
        "lacks the metadata key 'dspark.dspark.mask_token_id'",
    ),
    "unknown tensor": (
        dict(),
        lambda p: _rename(p, b"dspark.hidden_norm", b"dspark.hidden_nrm2"),
        "unknown DSpark GGUF tensor 'dspark.hidden_nrm2.weight'",
    ),
    "wrong shape": (dict(), "shape", "has shape"),
}


def test_a_quantized_drafter_gguf_is_read_dequantized(tmp_path, qwen3_target):
    """Q8_0 and Q4_1 tensors come back as llama.cpp's reference dequantizes them (float32),
    and the drafter stays lossless."""
    import gguf

    path = make_tiny_drafter(
        tmp_path / "q.gguf",
        qwen3_target,
        "dspark",
        "gguf",
        types={"blk.0.attn_q.weight": "Q8_0", "blk.1.ffn_down.weight": "Q4_1"},
    )
    folder, _ = converted_drafter(path)
    converted = mx.load(str(folder / "model.safetensors"))
    checked = set()
    for t in gguf.GGUFReader(str(path)).tensors:
        if t.tensor_type.name in ("Q8_0", "Q4_1"):
            want = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
            got = converted[deepspec_name(t.name)]
            assert got.dtype == mx.float32 and np.array_equal(np.array(got), want)
            checked.add(t.tensor_type.name)
    assert checked == {"Q8_0", "Q4_1"}
    pipe = outrider.load(str(qwen3_target), str(path), mode="dspark")
    ids = pipe.encode(PROMPTS[0])
    got = pipe.generate(ids, max_tokens=20, max_draft=4, stop_tokens=set())
    assert got.tokens == plain_greedy(qwen3_target, ids, 20)


@pytest.mark.parametrize("case", sorted(DAMAGE))
def test_damaged_gguf_is_refused_with_one_line(case, tmp_path, qwen3_target):
    overrides, damage, reason = DAMAGE[case]
    path = make_tiny_drafter(tmp_path / "x.gguf", qwen3_target, "dspark", "gguf", **overrides)
    if damage == "shape":  # a metadata head count that does not fit the stored q_proj
        import gguf

        reader = gguf.GGUFReader(str(path), "r+")
        reader.fields["dspark.attention.head_count"].parts[-1][0] = 2
        reader.data.flush()
        del reader
    elif damage is not None:
        damage(path)
    with pytest.raises(CheckpointError) as err:
        outrider.load(str(qwen3_target), str(path), mode="dspark")
    message = str(err.value)
    assert reason in message and "\n" not in message, message
    if case == "unsupported type":
        assert "blk.1.attn_q.weight" in message
    if case == "missing tensor":
        assert "blk.1.ffn_up.weight" in message
    assert not list(cache_dir().glob(".*"))  # no half-written folder left behind


def test_log_snr_conditioning_is_folded_into_the_embeddings(tmp_path, qwen3_target):
    """Bonsai's conditioning (per mlx-dspark's `log_snr_features` / `LogSnrEmbed`) recomputed
    here from the file's own MLP: every row gains the anchor's vector, the mask row the masks'."""
    import gguf

    path = make_tiny_drafter(
        tmp_path / "b.gguf", qwen3_target, "dspark", "gguf", quant="F32", log_snr=True, seed=4
    )
    folder, _ = converted_drafter(path)
    config = json.loads((folder / "config.json").read_text())
    assert config["log_snr_folded_into_embeddings"] == {"min_log_snr": -9.0, "max_log_snr": 9.0}
    got = np.array(mx.load(str(folder / "model.safetensors"))["embed_tokens.weight"])

    raw = {t.name: np.array(t.data) for t in gguf.GGUFReader(str(path)).tensors}
    w1, b1 = raw["dspark.log_snr_fc1.weight"], raw["dspark.log_snr_fc1.bias"]
    w2, b2 = raw["dspark.log_snr_fc2.weight"], raw["dspark.log_snr_fc2.bias"]
    freqs = 10000.0 ** (-np.arange(64) / 64)

    def vector(snr: float) -> np.ndarray:
        t = (snr - -9.0) / (9.0 - -9.0) * 1000.0
        x = np.concatenate([np.sin(t * freqs), np.cos(t * freqs)]) @ w1.T + b1
        return (x / (1 + np.exp(-x))) @ w2.T + b2

    embed = raw["token_embd.weight"]
    mask = config["mask_token_id"]
    want = embed + vector(9.0)
    want[mask] = embed[mask] + vector(-9.0)
    assert not np.allclose(want, embed, atol=1e-2)  # the conditioning is not negligible
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=5e-4)  # float32 angles up to 1000

    plain = make_tiny_drafter(tmp_path / "p.gguf", qwen3_target, "dspark", "gguf", seed=4)
    conditioned = outrider.load(str(qwen3_target), str(path), mode="dspark")
    ids = conditioned.encode(PROMPTS[0])
    res = conditioned.generate(ids, max_tokens=24, max_draft=8, stop_tokens=set())
    assert res.tokens == plain_greedy(qwen3_target, ids, 24)
    unconditioned = outrider.load(str(qwen3_target), str(plain), mode="dspark")
    assert drafts(conditioned, PROMPTS[0], 24)[1] != drafts(unconditioned, PROMPTS[0], 24)[1]


def test_target_gguf_as_drafter_and_drafter_gguf_as_model_are_refused(
    tmp_path, qwen3_target, ggufs
):
    model = make_tiny_gguf(tmp_path / "llama.gguf", family="llama")
    with pytest.raises(CheckpointError, match="is a llama model GGUF, not a drafter; pass it as"):
        outrider.load(str(qwen3_target), str(model), mode="dspark")
    with pytest.raises(CheckpointError, match="is a DSpark drafter GGUF; pass it as --drafter"):
        outrider.load(str(ggufs["bf16"]), mode="lookup")


def cli(*args: str):
    return CliRunner().invoke(app, ["convert", *args])


def test_convert_gguf_to_deepspec_folder_same_drafts(ggufs, qwen3_target, tmp_path):
    out = tmp_path / "out"
    res = cli(str(ggufs["f32"]), "--out", str(out))
    assert res.exit_code == 0, res.output
    assert "DSpark GGUF dspark drafter" in res.output and f"wrote {out}" in res.output
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen3DSparkModel"]
    a = outrider.load(str(qwen3_target), str(out), drafter_bits=16)
    b = outrider.load(str(qwen3_target), str(ggufs["deepspec"]), drafter_bits=16)
    assert a.drafter.format == "deepspec" and drafts(a, PROMPTS[2]) == drafts(b, PROMPTS[2])

    refused = cli(str(ggufs["f32"]), "--out", str(out))
    assert refused.exit_code == 2 and "is not empty; pass --force" in refused.output
    (out / "model-00002-of-00002.safetensors").write_bytes(b"stale")
    forced = cli(str(ggufs["bf16"]), "--out", str(out), "--force")
    assert forced.exit_code == 0, forced.output
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]


def test_convert_zlab_dflash_needs_target_then_same_drafts(drafters, qwen3_target, tmp_path):
    out = tmp_path / "zlab-as-deepspec"
    res = cli(str(drafters["dflash-zlab"]), "--out", str(out))
    assert res.exit_code == 2 and "pass --target MODEL" in res.output
    assert not out.exists()
    res = cli(str(drafters["dflash-zlab"]), "--out", str(out), "--target", str(qwen3_target))
    assert res.exit_code == 0, res.output
    assert "zlab dflash drafter" in res.output and "logits_start 1" in res.output
    weights = mx.load(str(out / "model.safetensors"))
    assert {"embed_tokens.weight", "lm_head.weight"} <= set(weights)
    a = outrider.load(str(qwen3_target), str(out), drafter_bits=16)
    b = outrider.load(str(qwen3_target), str(drafters["dflash-zlab"]), drafter_bits=16)
    assert a.drafter.format == "deepspec" and a.mode == b.mode == "dflash"
    assert a.proposer.max_draft == b.proposer.max_draft == 8
    assert drafts(a, PROMPTS[0]) == drafts(b, PROMPTS[0])


def test_what_deepspec_cannot_hold_is_refused_by_name(drafters):
    spec = load_drafter(Plugins(load_entrypoints=False), str(drafters["dspark"]))
    assert refusal(spec) is None
    cases = {
        "reduced draft vocabulary": dict(draft_vocab_size=64),
        "DFlash 2": dict(kind="dflash2", conv_kernel_size=3),
        "eagle3 drafters have no DeepSpec layout": dict(kind="eagle3"),
        "sliding-window": dict(layer_types=("sliding_attention",) * 2, sliding_window=8),
        "gemma4 backbone": dict(backbone="gemma4"),
    }
    for reason, change in cases.items():
        assert reason in refusal(dataclasses.replace(spec, **change))


def test_convert_refuses_a_file_as_out(drafters, tmp_path):
    (tmp_path / "f").write_text("x")
    res = cli(str(drafters["dspark"]), "--out", str(tmp_path / "f"))
    assert res.exit_code == 2 and "is a file" in res.output


# --- full tier ---------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("kind,packaging", sorted(WRITERS))
def test_convert_every_packaging(kind, packaging, qwen3_target, tmp_path):
    """Block drafters of every packaging become DeepSpec folders that draft the same; the rest
    are refused by name."""
    src = make_tiny_drafter(tmp_path / "src", qwen3_target, kind, packaging)
    out = tmp_path / "out"
    res = cli(str(src), "--out", str(out), "--target", str(qwen3_target))
    if packaging == "liquid":  # LiquidAI's interleaved rope: DeepSpec ropes by halves
        assert res.exit_code == 2 and "interleaved rope" in res.output and not out.exists()
        src = make_tiny_drafter(tmp_path / "neox", qwen3_target, kind, packaging, neox=True)
        res = cli(str(src), "--out", str(out), "--target", str(qwen3_target))
    if kind not in ("dspark", "dflash"):
        assert res.exit_code == 2 and "cannot write this" in res.output and not out.exists()
        assert ("DFlash 2" if kind == "dflash2" else f"{kind} drafters have no") in res.output
        return
    unwritable = {  # attention DeepSpec's layout has no field for
        "nvidia": "sliding-window draft layers",
        "ornith": "gated queries / partial rotary",
    }
    if packaging in unwritable:
        assert res.exit_code == 2 and unwritable[packaging] in res.output and not out.exists()
        return
    assert res.exit_code == 0, res.output
    a = outrider.load(str(qwen3_target), str(out), drafter_bits=16)
    b = outrider.load(str(qwen3_target), str(src), drafter_bits=16)
    assert a.drafter.format == "deepspec" and a.mode == b.mode == kind
    assert drafts(a, PROMPTS[1], 20) == drafts(b, PROMPTS[1], 20)


@pytest.mark.slow
def test_convert_refuses_a_reduced_draft_vocabulary(qwen3_target, tmp_path):
    src = make_tiny_drafter(
        tmp_path / "src", qwen3_target, "dspark", "speculators", draft_vocab_size=128
    )
    res = cli(str(src), "--out", str(tmp_path / "out"))
    assert res.exit_code == 2 and "reduced draft vocabulary (128 of" in res.output


@pytest.mark.slow
@pytest.mark.parametrize("cap", [1, 2, 3, 4, 5, 6, 7, 8])
def test_gguf_dspark_every_cap_every_prompt(bf16_pipe, qwen3_target, cap):
    for i, prompt in enumerate(PROMPTS):
        n = (24, 40, 40)[i]
        ids = bf16_pipe.encode(prompt)
        got = bf16_pipe.generate(ids, max_tokens=n, max_draft=cap, stop_tokens=set())
        assert got.tokens == plain_greedy(qwen3_target, ids, n), f"cap {cap} prompt {i}"
        assert max(len(r.drafted) for r in got.rounds) == cap


@pytest.mark.slow
def test_gguf_dspark_sampling_matches_target_distribution(bf16_pipe):
    from sampling_check import assert_follows_target

    depth, n = 3, 300
    prompt = [30 + 7 * i % 200 for i in range(12)]
    drafted, _ = assert_follows_target(bf16_pipe, prompt, depth, n)
    assert drafted > 0
