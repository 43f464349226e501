"""Each packaging is detected and loads; damaged or foreign checkpoints are refused by name."""

from __future__ import annotations

import json

import mlx.core as mx
import pytest
from checkpoint_edits import copy_ckpt, edit_config, edit_tensors
from conftest import PROMPTS, plain_greedy

import outrider
from outrider.api import load_drafter
from outrider.core.device import on_cuda_gpu
from outrider.core.errors import CheckpointError, OutriderError
from outrider.core.plugins import Plugins
from outrider.plugins.formats.zlab import default_layer_ids


@pytest.fixture(scope="module")
def plugins():
    return Plugins(load_entrypoints=False)


@pytest.mark.parametrize(
    "name,fmt,kind,logits_start,own_head",
    [
        ("dspark", "deepspec", "dspark", 0, True),
        ("dflash-deepspec", "deepspec", "dflash", 0, True),
        ("dflash-zlab", "zlab", "dflash", 1, False),
        ("dspark-rnn", "deepspec", "dspark", 0, True),
    ],
)
def test_each_packaging_is_detected(plugins, drafters, name, fmt, kind, logits_start, own_head):
    spec = load_drafter(plugins, str(drafters[name]))
    assert (spec.format, spec.kind, spec.logits_start) == (fmt, kind, logits_start)
    assert spec.own_embedding == own_head and spec.own_lm_head == own_head
    # DeepSpec: B inputs -> B drafts; z-lab: B inputs -> B - 1 drafts
    assert spec.max_draft == spec.block_size - logits_start


def test_auto_mode_picks_the_drafters_kind(qwen3_target, drafters):
    assert outrider.load(str(qwen3_target), str(drafters["dspark"])).mode == "dspark"
    assert outrider.load(str(qwen3_target), str(drafters["dflash-zlab"])).mode == "dflash"
    assert outrider.load(str(qwen3_target)).mode == "lookup"  # no registry row, no drafter


def test_zlab_block_slicing_uses_the_slot_after_the_anchor(qwen3_target, drafters):
    """z-lab discards the anchor slot: draft i comes from slot i (slot 0 is the anchor)."""
    pipe = outrider.load(str(qwen3_target), str(drafters["dflash-zlab"]), mode="dflash")
    prop = pipe.proposer
    assert prop.spec.logits_start == 1 and prop.max_draft == 8
    ids = pipe.encode("slot check")
    target = pipe.target
    target.install_taps(prop.tap_layer_ids)
    logits, taps = target.prefill(ids, target.make_cache(), prop.tap_layer_ids)
    anchor = int(mx.argmax(logits).item())
    prop.start(ids, taps)
    from outrider.core.proposer import DraftContext
    from outrider.core.sampling import SamplingParams

    drafts = prop.propose(DraftContext(ids + [anchor], 3, SamplingParams())).tokens.tolist()
    block = mx.array([anchor] + [prop.spec.mask_token_id] * (prop.spec.block_size - 1))
    hidden = prop.drafter.backbone(target.embed(block)[None], taps, prop.drafter.make_cache())
    logits = target.project(hidden).astype(mx.float32)
    by_slot = mx.argmax(logits, axis=-1).tolist()
    if not on_cuda_gpu():
        assert drafts == by_slot[1:4]
    else:  # TF32 matmuls over 3 rows and over 8 may break a near-tie differently
        for i, d in enumerate(drafts, 1):
            row = logits[i]
            assert row[d].item() >= row.max().item() - 2e-3 * mx.abs(row).max().item()


def test_zlab_default_layer_rule():
    assert default_layer_ids(36, 5) == [1, 9, 17, 25, 33]
    assert default_layer_ids(40, 5) == [1, 10, 19, 28, 37]
    assert default_layer_ids(36, 1) == [18]


def test_zlab_sliding_layers_slide_both_ways(plugins, qwen3_target, drafters, tmp_path):
    """z-lab's attention is bidirectional with the config's window on its sliding layers (as
    transformers' Qwen3Config reads `use_sliding_window`); output stays plain greedy's."""
    ck = copy_ckpt(drafters["dflash-zlab"], tmp_path / "d")
    n = load_drafter(plugins, str(ck)).num_layers
    types = ["sliding_attention"] + ["full_attention"] * (n - 1)
    edit_config(ck, layer_types=types, sliding_window=6, use_sliding_window=True)
    spec = load_drafter(plugins, str(ck))
    assert spec.layer_types == tuple(types) and spec.sliding_window == 6
    pipe = outrider.load(str(qwen3_target), str(ck), mode="dflash")
    attn = [layer.self_attn for layer in pipe.proposer.inner.drafter.layers]
    assert [(a.causal, a.window) for a in attn] == [(False, 6)] + [(False, None)] * (n - 1)
    ids = pipe.encode(PROMPTS[1] + " # a window six tokens wide")
    want = plain_greedy(qwen3_target, ids, 24)
    assert pipe.generate(ids, max_tokens=24, stop_tokens=set()).tokens == want
    edit_config(ck, use_sliding_window=False)  # Qwen3Config then keeps no window
    assert load_drafter(plugins, str(ck)).sliding_window is None
    edit_config(ck, use_sliding_window=True, layer_types=types[:1] * (n + 1))
    with pytest.raises(CheckpointError, match="one entry per draft layer"):
        load_drafter(plugins, str(ck))


def test_missing_tensor_is_named(plugins, drafters, tmp_path):
    ck = copy_ckpt(drafters["dspark"], tmp_path / "d")
    edit_tensors(ck, lambda t: t.pop("layers.1.mlp.down_proj.weight"))
    with pytest.raises(CheckpointError, match="missing tensor layers.1.mlp.down_proj.weight"):
        outrider.load(str(drafters["dspark"].parent / "qwen3"), str(ck), mode="dspark")


def test_wrong_shape_is_named(drafters, qwen3_target, tmp_path):
    ck = copy_ckpt(drafters["dspark"], tmp_path / "d")
    edit_tensors(ck, lambda t: t.update({"fc.weight": mx.zeros((64, 10))}))
    with pytest.raises(CheckpointError, match=r"fc.weight has shape \(64, 10\)"):
        outrider.load(str(qwen3_target), str(ck), mode="dspark")


def test_a_rope_scaling_without_a_field_it_needs_is_named(drafters, qwen3_target, tmp_path):
    ck = copy_ckpt(drafters["dspark"], tmp_path / "d")
    edit_config(ck, rope_scaling={"rope_type": "llama3"})  # no factor
    with pytest.raises(CheckpointError, match="rope_scaling \\(llama3\\) lacks 'factor'"):
        outrider.load(str(qwen3_target), str(ck), mode="dspark")


def test_unexpected_tensor_is_named(drafters, qwen3_target, tmp_path):
    ck = copy_ckpt(drafters["dflash-zlab"], tmp_path / "d")
    edit_tensors(ck, lambda t: t.update({"mystery.weight": mx.zeros((2, 2))}))
    with pytest.raises(CheckpointError, match="unexpected tensor mystery.weight"):
        outrider.load(str(qwen3_target), str(ck), mode="dflash")


def test_unknown_architecture_is_refused(plugins, drafters, tmp_path):
    ck = copy_ckpt(drafters["dspark"], tmp_path / "d")
    edit_config(ck, architectures=["MysteryDraftNet"])
    with pytest.raises(CheckpointError, match="no drafter format recognises .*MysteryDraftNet"):
        load_drafter(plugins, str(ck))


def test_dflash2_is_refused_with_reason(plugins, drafters, tmp_path):
    ck = copy_ckpt(drafters["dflash-zlab"], tmp_path / "d")
    edit_config(ck, architectures=["DFlash2DraftModel"])
    with pytest.raises(CheckpointError, match="DFlash 2"):
        load_drafter(plugins, str(ck))


def test_pickle_weights_are_refused_and_never_loaded(plugins, drafters, tmp_path):
    ck = copy_ckpt(drafters["dspark"], tmp_path / "d")
    (ck / "model.safetensors").unlink()
    marker = tmp_path / "executed"
    # A pickle that would create a file if it were ever unpickled.
    import pickle

    class Boom:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    (ck / "pytorch_model.bin").write_bytes(pickle.dumps(Boom()))
    with pytest.raises(CheckpointError, match="pickle-based weights .*pytorch_model.bin"):
        load_drafter(plugins, str(ck))
    assert not marker.exists()


def test_remote_code_in_checkpoint_is_never_run(qwen3_target, drafters, tmp_path):
    """z-lab repos ship auto_map + Python files; loading must not import them."""
    ck = copy_ckpt(drafters["dflash-zlab"], tmp_path / "d")
    marker = tmp_path / "ran"
    (ck / "dflash.py").write_text(f"open({str(marker)!r}, 'w').write('x')\n")
    pipe = outrider.load(str(qwen3_target), str(ck), mode="dflash")
    pipe.generate("hi", max_tokens=4)
    assert not marker.exists()


def test_damaged_files_are_refused(plugins, drafters, tmp_path):
    ck = copy_ckpt(drafters["dspark"], tmp_path / "d")
    (ck / "model.safetensors").write_bytes(b"\x00\x01 not a safetensors file")
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        load_drafter(plugins, str(ck)).weights  # noqa: B018
    bad = copy_ckpt(drafters["dspark"], tmp_path / "e")
    (bad / "config.json").write_text("{ not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_drafter(plugins, str(bad))


@pytest.mark.parametrize(
    "change,reason",
    [
        ({"target_layer_ids": [3, 1]}, "strictly increasing"),
        ({"target_layer_ids": "1,2"}, "list of integers"),
        ({"block_size": "seven"}, "must be an integer"),
        ({"markov_head_type": "lstm"}, "unknown markov_head_type"),
        # the qwen3_5-native fork's flag on a plain head: named by its q_proj shape at load
        # (tests/test_formats_ornith.py reads the fork itself)
    ],
)
def test_bad_config_values_are_named(plugins, drafters, tmp_path, change, reason):
    ck = copy_ckpt(drafters["dspark"], tmp_path / "d")
    edit_config(ck, **change)
    with pytest.raises(CheckpointError, match=reason):
        load_drafter(plugins, str(ck))


def test_missing_required_field_is_named(plugins, drafters, tmp_path):
    ck = copy_ckpt(drafters["dspark"], tmp_path / "d")
    cfg = json.loads((ck / "config.json").read_text())
    del cfg["mask_token_id"]
    (ck / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="mask_token_id"):
        load_drafter(plugins, str(ck))


def test_drafter_for_another_model_is_refused(drafters, tmp_path):
    from outrider.testing import make_tiny_target

    wider = make_tiny_target(tmp_path / "wide", hidden_size=96, num_attention_heads=6)
    with pytest.raises(OutriderError, match="hidden size 64 does not match the target's 96"):
        outrider.load(str(wider), str(drafters["dspark"]), mode="dspark")
    shallow = make_tiny_target(tmp_path / "shallow", num_hidden_layers=2)
    with pytest.raises(OutriderError, match="taps target layer 2, but the target has 2 layers"):
        outrider.load(str(shallow), str(drafters["dspark"]), mode="dspark").generate(
            "x", max_tokens=2
        )


def test_drafter_passed_as_model_is_explained(drafters):
    with pytest.raises(CheckpointError, match="pass it as --drafter"):
        outrider.load(str(drafters["dspark"]))
