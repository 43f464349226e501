"""`outrider train`: a trained drafter is accepted far more often than its untrained init, its
checkpoint reloads through the DeepSpec format and decodes losslessly, and a run resumes
exactly. Tiny fp32 models, CPU, short runs."""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from conftest import plain_greedy, run_folder, same_bits, toy_train_config
from filelock import FileLock
from typer.testing import CliRunner

import outrider
from outrider import cli
from outrider.api import load_drafter
from outrider.core.errors import Interrupted, OutriderError
from outrider.core.plugins import Plugins
from outrider.plugins.strategies.block_drafter import BlockDrafter
from outrider.train import TrainConfig, train_drafter
from outrider.train import data as D
from outrider.train.config import TrainReport
from outrider.train.objectives import block_forward, sample_anchors


def config(toy, out: Path, **overrides) -> TrainConfig:
    return toy_train_config(toy, out, **overrides)


# the tests that read one training run: `dspark_run` trains once a test run whatever worker they
# land on; --dist loadgroup would keep them on one (it does not under pytest 9.2, conftest.py)
DSPARK_RUN = pytest.mark.xdist_group("dspark_run")


@pytest.fixture(scope="session")
def dspark_run(toy, tmp_path_factory, worker_id):
    """One training run for the whole test run: the first worker to get here trains (its
    own toy pair, the same weights every worker builds) and leaves the checkpoint, the
    report and the events in the folder the workers share; the others read them."""
    root = run_folder(tmp_path_factory, worker_id) / "dspark_run"
    out, kept = root / "dspark", root / "run.json"
    with FileLock(f"{root}.lock"):
        if not kept.is_file():
            events: list[dict] = []
            # uncompiled: on a fresh MLX kernel cache the compiled step costs ~40 s of kernel
            # compiles on 2 cores (`test_the_compiled_step_trains_as_uncompiled` checks it)
            report = train_drafter(
                config(toy, out, kind="dspark", compile=False), on_event=events.append
            )
            kept.write_text(json.dumps({"report": report.to_json(), "events": events}))
        run = json.loads(kept.read_text())
    return out, TrainReport(**run["report"]), run["events"]


@DSPARK_RUN  # one worker trains it once
def test_trained_dspark_beats_its_untrained_init(dspark_run):
    out, report, events = dspark_run
    # measured by the real loop on held-out prompts; the block gives at most 5 + 1 per round
    assert report.accept_trained >= report.accept_init + 1.5, (report.init, report.trained)
    assert report.accept_trained >= 3.0  # measured: 1.94 -> 3.88 (DFlash below: 1.94 -> 5.17)
    assert report.lossless
    steps = [e for e in events if e["event"] == "step"]
    assert steps[-1]["loss"] < steps[0]["loss"]
    assert json.loads((out / "train_report.json").read_text()) == report.to_json()


@pytest.mark.slow  # compiles the step's kernels: ~40 s on a fresh MLX kernel cache, 2 cores
def test_the_compiled_step_trains_as_uncompiled(toy, tmp_path):
    """`mx.compile` of the training step (TrainConfig's default) fuses its elementwise work
    and must change nothing else: the same run, compiled and not, logs the same losses."""
    losses = {}
    for compiled in (True, False):
        events: list[dict] = []
        settings = dict(kind="dspark", steps=6, log_every=1, compile=compiled)
        train_drafter(config(toy, tmp_path / str(compiled), **settings), on_event=events.append)
        losses[compiled] = [e["loss"] for e in events if e["event"] == "step"]
    assert len(losses[True]) == 6
    assert losses[True] == pytest.approx(losses[False], rel=1e-4)
    assert losses[True][-1] < losses[True][0]  # and it learns


@DSPARK_RUN  # one worker trains it once
def test_checkpoint_is_deepspec_and_decodes_losslessly(toy, dspark_run):
    out, report, _ = dspark_run
    spec = load_drafter(Plugins(load_entrypoints=False), str(out))
    assert (spec.format, spec.kind, spec.block_size, spec.logits_start) == (
        "deepspec",
        "dspark",
        5,
        0,
    )
    assert spec.markov_rank > 0 and spec.confidence_head
    target_weights = mx.load(str(toy["target"] / "model.safetensors"))
    assert mx.array_equal(spec.weights["lm_head.weight"], target_weights["lm_head.weight"])
    for bits in (16, 4):  # as `outrider generate --drafter OUT` loads it (4-bit by default)
        pipe = outrider.load(str(toy["target"]), str(out), "dspark", drafter_bits=bits)
        for words in (["sun", "tree", "code"], ["map", "alpha", "sea"]):
            ids = pipe.encode(" ".join(words))
            result = pipe.generate(ids, max_tokens=24)
            assert result.tokens == plain_greedy(toy["target"], ids, 24)
            if bits == 16:
                assert result.mean_accept_len > 2.5


@pytest.mark.slow  # a second training run, through the CLI: the full suite's
def test_dflash_through_the_cli_with_json_progress(toy):
    out = toy["root"] / "dflash"
    # batches of 4 windows of 64 (the toy config's are 8 of 96) cost under half as much and learn
    # as far: measured 1.94 -> 4.43 at step 12 and 5.17 at step 24, as 8 of 96 reach at 24
    args = ["train", "--model", str(toy["target"]), "--kind", "dflash", "--data"]
    args += [str(toy["prompts"]), "--out", str(out), "--steps", "24", "--batch-size", "4"]
    args += ["--seq-len", "64", "--lr", "1e-2", "--block-size", "5", "--max-new-tokens", "40"]
    args += ["--held-out", "3", "--eval-tokens", "32", "--seed", "0", "--no-compile", "--json"]
    args += ["--eval-every", "12"]
    result = CliRunner().invoke(cli.app, args)
    assert result.exit_code == 0, result.output
    events = [json.loads(line) for line in result.stdout.splitlines()]
    assert {"data", "start", "step", "eval", "checkpoint", "done"} <= {e["event"] for e in events}
    evals = [(e["which"], e["step"]) for e in events if e["event"] == "eval"]
    assert evals == [("init", 0), ("trained", 12), ("trained", 24)]
    done = events[-1]
    assert done["event"] == "done" and done["kind"] == "dflash" and done["lossless"]
    assert done["trained"]["mean_accept_len"] >= done["init"]["mean_accept_len"] + 1.5
    assert all(e["tokens_per_s"] > 0 for e in events if e["event"] == "step")
    gen = CliRunner().invoke(
        cli.app,
        ["generate", "--model", str(toy["target"]), "--drafter", str(out), "--mode", "dflash"]
        + ["--prompt", "sea map", "--max-tokens", "16", "--json"],
    )
    assert gen.exit_code == 0, gen.output
    run = json.loads(gen.stdout)
    assert run["mode"] == "dflash"
    assert run["tokens"] == plain_greedy(toy["target"], run["prompt_tokens"], 16)


@DSPARK_RUN  # one worker trains it once
def test_init_fine_tunes_an_existing_drafter(toy, dspark_run, tmp_path):
    out, trained, _ = dspark_run
    with pytest.raises(OutriderError, match="is a dspark drafter, not dflash"):
        train_drafter(config(toy, tmp_path / "x", kind="dflash", init=str(out)))
    report = train_drafter(config(toy, tmp_path / "tuned", init=str(out), steps=2, compile=False))
    # the starting point is the given drafter itself: same weights, same held-out prompts
    assert report.init == trained.trained
    before = json.loads((out / "config.json").read_text())
    after = json.loads((tmp_path / "tuned" / "config.json").read_text())
    assert after == before


def test_an_interrupted_run_resumes_exactly(toy, tmp_path):
    small = dict(steps=6, save_every=3, log_every=1, batch_size=4, held_out=1, eval_tokens=8)
    small.update(seq_len=64)  # short windows: resuming exactly does not depend on their width
    small.update(compile=False)  # the straight and the resumed run take the same path
    straight = train_drafter(config(toy, tmp_path / "straight", **small))

    def interrupt_after_4(event):  # Ctrl-C between steps 4 and 5
        if event["event"] == "step" and event["step"] == 4:
            raise KeyboardInterrupt

    with pytest.raises(Interrupted, match="after step 4: checkpoint saved"):
        train_drafter(config(toy, tmp_path / "resumed", **small), on_event=interrupt_after_4)
    with pytest.raises(OutriderError, match="--resume"):
        train_drafter(config(toy, tmp_path / "resumed", **small))
    events: list[dict] = []
    resumed = train_drafter(config(toy, tmp_path / "resumed", resume=True, **small), events.append)
    assert [e["step"] for e in events if e["event"] == "resume"] == [4]
    assert any(e["event"] == "data" and e["reused"] for e in events)
    a = mx.load(str(tmp_path / "straight" / "model.safetensors"))
    b = mx.load(str(tmp_path / "resumed" / "model.safetensors"))
    assert a.keys() == b.keys()
    assert all(same_bits(a[k], b[k]) for k in a)
    assert same_bits(mx.array(resumed.final_loss), mx.array(straight.final_loss))


# --- the pieces -------------------------------------------------------------------------------


def test_training_forward_is_the_inference_forward(drafters):
    """Every block of the batched training forward equals the cached inference backbone fed
    the context rows before its anchor (the semantics that silently cost acceptance)."""
    spec = load_drafter(Plugins(load_entrypoints=False), str(drafters["dspark"]))
    model = BlockDrafter(spec)
    model.load_weights(list(spec.weights.items()))
    mx.random.seed(3)
    taps = mx.random.normal((2, 20, len(spec.target_layer_ids) * spec.hidden_size))
    anchors = mx.array([[1, 9, 15], [4, 5, 19]])
    ids = mx.random.randint(0, spec.vocab_size, (2, 3, spec.block_size)).astype(mx.uint32)
    hidden = block_forward(model, taps, ids, anchors)
    for b in range(2):
        for j in range(3):
            a = anchors[b, j].item()
            ref = model.backbone(
                model.embed_tokens(ids[b, j])[None], taps[b, :a], model.make_cache()
            )
            assert mx.allclose(hidden[b, j], ref, atol=1e-5)
    assert not mx.allclose(hidden[0, 0], hidden[0, 1], atol=1e-3)


def test_anchors_are_supervised_positions():
    mask = np.zeros((2, 12), dtype=bool)
    mask[0, 4:10] = True  # candidates 4..8 (the next token must be supervised too)
    mask[1, 2:4] = True  # one candidate: 2
    anchors, keep = sample_anchors(mask, 3, np.random.default_rng(0))
    assert keep[0].all() and set(anchors[0]) <= {4, 5, 6, 7, 8}
    assert list(anchors[0]) == sorted(anchors[0]) and len(set(anchors[0])) == 3
    assert list(keep[1]) == [True, False, False] and anchors[1, 0] == 2


def test_data_files_and_masks(toy, tmp_path):
    from mlx_lm.utils import load

    _, tokenizer = load(str(toy["target"]))
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.py").write_text("def f(x):\n    return x * 2\n" * 4)
    (src / "notes.txt").write_text("plain text, one document")
    chats = tmp_path / "chats.jsonl"
    chats.write_text(json.dumps({"turns": ["hi there", "hello, how can I help?"]}) + "\n")
    records = D.read_records([src, chats])
    assert [r.turns is None for r in records] == [True, True, False]
    seqs = D.build_sequences(records, tokenizer, None, None)
    code, _, chat = seqs
    assert all(code.mask)
    answer = [t for t, m in zip(chat.ids, chat.mask) if m]
    assert tokenizer.decode(answer).startswith("hello, how can I help?")
    assert chat.mask[0] == 0 and tokenizer.eos_token_id in answer  # end of turn supervised
    wins = D.windows(seqs, 16)
    assert all(len(w.ids) <= 16 for w in wins)
    assert len(wins) < sum(-(-len(s.ids) // 16) for s in seqs)  # short windows are dropped


def test_documents_can_be_continued_by_the_target(toy):
    from mlx_lm.utils import load

    _, tokenizer = load(str(toy["target"]))
    doc = D.Record("doc", text="x = 1\n" * 30)  # 180 tokens: windows of 64 -> prompts of 32
    calls = []

    def generate(prompts, max_tokens=None):
        calls.append((len(prompts), max_tokens))
        return [[7] * max_tokens for _ in prompts]

    seqs = D.build_sequences([doc], tokenizer, generate, None, continue_text=64)
    assert calls == [(3, 32)]
    ids = tokenizer.encode(doc.text)
    for i, seq in enumerate(seqs):
        assert seq.ids[:32] == ids[i * 64 : i * 64 + 32] and seq.mask[:32] == [0] * 32
        assert seq.ids[32:] == [7] * 32 and seq.mask[32:] == [1] * 32


@pytest.mark.parametrize(
    "line,message",
    [
        ("{not json", "line 1 is not valid JSON"),
        ('{"prompt": "x"}', "neither 'turns' nor 'text'"),
        ('{"turns": []}', "'turns' must be a non-empty list"),
    ],
)
def test_bad_data_is_named(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(OutriderError, match=message):
        D.read_records([path])
    with pytest.raises(OutriderError, match="use JSON Lines"):
        D.read_records([path.rename(tmp_path / "bad.json")])


def test_cli_refuses_bad_options_before_loading(tmp_path):
    runner = CliRunner()
    base = ["train", "--model", str(tmp_path / "none"), "--data", str(tmp_path), "--out"]
    bad = runner.invoke(cli.app, [*base, str(tmp_path / "o"), "--kind", "medusa"])
    assert bad.exit_code == 2 and "error: --kind must be dspark, dflash or eagle3" in bad.output
    bad = runner.invoke(cli.app, [*base, str(tmp_path / "o"), "--kind", "eagle3", "--layers", "2"])
    assert bad.exit_code == 2 and "EAGLE-3 drafters have one layer" in bad.output
    bad = runner.invoke(cli.app, [*base, str(tmp_path / "o"), "--seq-len", "4"])
    assert bad.exit_code == 2 and "--seq-len must be >= 16" in bad.output
    missing = runner.invoke(cli.app, [*base, str(tmp_path / "o"), "--data", "nope.jsonl"])
    assert missing.exit_code == 2 and "error:" in missing.output


@DSPARK_RUN  # one worker trains it once
def test_progress_views_show_loss_speed_and_acceptance(dspark_run):
    import io

    from rich.console import Console

    from outrider.train.progress import PlainLines, RichProgress

    _, _, events = dspark_run
    plain = io.StringIO()
    view = PlainLines(plain)
    for event in events:
        view(event)
    text = plain.getvalue()
    assert "step 24/24 loss" in text and "tok/s" in text
    assert "held-out acceptance (trained, step 24)" in text and "done:" in text
    live = io.StringIO()
    console = Console(file=live, force_terminal=True, width=120)
    view = RichProgress(console)
    for event in events:
        view(event)
    shown = live.getvalue()
    assert "24/24" in shown and "accept" in shown and "held-out acceptance (init" in shown


@pytest.mark.slow  # another training run: the full suite's
def test_a_quantized_target_trains_from_its_dequantized_teacher(toy, tmp_path):
    """The teacher (a dequantized copy) answers and runs the training forwards; the drafter
    learns the quantized target's choices, measured by the real loop on that target."""
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_lm.utils import load_model

    model, cfg = load_model(Path(toy["target"]))
    nn.quantize(model, group_size=32, bits=8)
    quantized = tmp_path / "target-8bit"
    quantized.mkdir()
    for f in Path(toy["target"]).iterdir():
        if f.name not in ("model.safetensors", "config.json"):
            (quantized / f.name).write_bytes(f.read_bytes())
    mx.save_safetensors(
        str(quantized / "model.safetensors"), dict(tree_flatten(model.parameters()))
    )
    (quantized / "config.json").write_text(
        json.dumps({**cfg, "quantization": {"group_size": 32, "bits": 8}})
    )
    report = train_drafter(
        toy_train_config(
            {**toy, "target": quantized}, tmp_path / "drafter", kind="dflash", steps=12
        )
    )
    assert report.lossless
    assert report.accept_trained >= report.accept_init + 1.0, (report.init, report.trained)
