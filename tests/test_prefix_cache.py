"""The prefix cache: a hit of every kind, on every cache kind, gives exactly the fresh output.

Tiny float32 models on the CPU: a cached prefix plus a suffix prefill computes the same rows as
one fresh prefill (the same kernels on the same rows, chunked differently), so greedy outputs
are compared token for token, with no tie rule. Checkpoints every 8 tokens and sliding windows
of 8 make a divergence at token 21 fall inside a snapshot interval of a wrapped window.
"""

from __future__ import annotations

import json
import os
import warnings

import anthropic
import mlx.core as mx
import openai
import pytest
import requests
from conftest import plain_greedy
from live_server import live_server
from test_families import built

import outrider
from outrider.core.prefix_cache import PrefixCache
from outrider.server.engine import LoadSpec

FAMILIES = {  # family -> whether every layer's cache trims (else: checkpoints)
    "qwen3": True,
    "qwen3_5": False,  # gated-delta
    "nemotron_h": False,  # Mamba-2
    "lfm2": False,  # short convolutions
    "gemma4_text": False,  # sliding window
    "gemma3_text": False,  # sliding window
}
INTERVAL = 8
N = 10
SYSTEM = list(range(30, 70))  # a 40-token "system prompt"
FIRST = SYSTEM + [100, 101, 102]
DIVERGE = 21  # inside the checkpoint interval [16, 24)


def run(pipe, ids, n=N, **kw):
    return pipe.generate(ids, max_tokens=n, max_draft=4, stop_tokens=set(), **kw)


def pipes(models_dir, family, mode):
    target, drafter = built(models_dir, family)
    cached = outrider.load(str(target), str(drafter) if mode == "dspark" else None, mode=mode)
    fresh = outrider.load(
        str(target), str(drafter) if mode == "dspark" else None, mode=mode, target=cached.target
    )
    cached.enable_prefix_cache(gb=1, interval=INTERVAL)
    return target, cached, fresh


@pytest.mark.parametrize(
    "family,mode",
    [(f, "baseline") for f in FAMILIES] + [("qwen3", "dspark"), ("qwen3_5", "dspark")],
)
def test_every_hit_kind_equals_a_fresh_run(models_dir, family, mode):
    target, pipe, fresh = pipes(models_dir, family, mode)
    first = run(pipe, FIRST)
    assert first.cached_tokens == 0
    repeat = run(pipe, FIRST)  # exact repeat: the whole prompt reused, nothing forwarded
    turn = FIRST + first.tokens + [110, 111, 112, 113]  # the conversation goes on
    extended = run(pipe, turn)
    diverged_ids = SYSTEM[:DIVERGE] + [200, 201, 202]
    diverged = run(pipe, diverged_ids)

    assert repeat.cached_tokens == len(FIRST)
    # the whole first exchange is held (its last token was never forwarded in drafting modes)
    assert extended.cached_tokens >= len(FIRST) + N - 1
    trims = FAMILIES[family]
    assert diverged.cached_tokens == (DIVERGE if trims else DIVERGE // INTERVAL * INTERVAL)
    for ids, got in ((FIRST, first), (FIRST, repeat), (turn, extended), (diverged_ids, diverged)):
        want = run(fresh, ids).tokens
        assert got.tokens == want, f"{family}/{mode}: a hit of {got.cached_tokens} diverged"
        assert want == plain_greedy(target, ids, N)
    stats = pipe.prefix_cache.snapshot_stats()
    assert stats["hits"] == 3 and stats["misses"] == 1 and stats["whole_hits"] == 1
    assert stats["bytes"] > 0


def test_lru_budget_evicts_and_zero_caches_nothing(models_dir):
    target, pipe, fresh = pipes(models_dir, "qwen3", "baseline")
    run(pipe, FIRST)
    one = pipe.prefix_cache.bytes
    assert one > 0
    pipe.enable_prefix_cache(gb=1.5 * one / (1 << 30))  # room for one sequence, not two
    store = pipe.prefix_cache
    run(pipe, FIRST)
    other = [7, 8, 9] + SYSTEM[::-1]
    run(pipe, other)  # unrelated: the first one goes
    assert store.stats["evictions"] == 1 and store.entries == 1
    assert 0 < store.bytes <= store.max_bytes
    assert run(pipe, FIRST).cached_tokens == 0  # evicted
    assert run(pipe, other).cached_tokens == 0  # evicted in turn by FIRST

    pipe.enable_prefix_cache(gb=0)
    for _ in range(2):
        got = run(pipe, FIRST)
        assert got.cached_tokens == 0 and got.tokens == run(fresh, FIRST).tokens
    assert pipe.prefix_cache.entries == 0 and pipe.prefix_cache.bytes == 0


def test_a_conversation_too_big_for_its_checkpoints_is_kept_thinned(models_dir):
    """A recurrent layer's snapshot weighs the same wherever it is taken, so a long
    conversation's checkpoints outgrow the budget; the sequence is then kept with fewer of them
    (spread out, prompt ends last) instead of not at all, and every hit still equals a fresh
    run. It used to be left out of the cache entirely."""
    target, pipe, fresh = pipes(models_dir, "qwen3_5", "baseline")
    turns = [FIRST]
    for i in range(3):  # a conversation of four turns, one entry holding them all
        turns.append(turns[-1] + run(pipe, turns[-1]).tokens + [110 + i, 120 + i])
    run(pipe, turns[-1])
    entry = next(iter(pipe.prefix_cache._entries.values()))
    full, snaps = entry.nbytes, len(entry.checkpoints)
    assert snaps > 8  # one every INTERVAL tokens of every prefill, and each turn's ends
    held = sum(s.nbytes for ck in entry.checkpoints.values() for s in ck if s is not None)
    # a budget the whole sequence overflows, whose half holds it with some checkpoints
    budget = (2 * (full - held) + full) / 2
    assert 2 * (full - held) < budget < full
    pipe.enable_prefix_cache(gb=budget / (1 << 30), interval=INTERVAL)
    store = pipe.prefix_cache
    for ids in turns[:-1]:
        run(pipe, ids)
    last = run(pipe, turns[-1])
    kept = next(iter(store._entries.values()))
    assert store.entries == 1 and kept.nbytes <= store.max_bytes // 2
    assert store.stats["checkpoints_dropped"] > 0 and 0 < len(kept.checkpoints) < snaps
    assert last.cached_tokens >= len(turns[-2])  # the previous turn's exchange reused
    assert run(pipe, turns[-1]).cached_tokens == len(turns[-1])  # the latest prompt end kept
    early = SYSTEM[:DIVERGE] + [200, 201, 202]
    for ids in (turns[-1], early):
        assert run(pipe, ids).tokens == run(fresh, ids).tokens


THINKING_TEMPLATE = (  # Qwen3's habit: the turn it opens thinks; the history shows answers only
    "{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
    "'<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n<think>\\n' }}{%- endif %}"
)


def test_a_snapshot_where_the_last_message_ended_serves_the_next_turn(models_dir, tmp_path):
    """A thinking template opens `<think>` for the answer, but the next turn renders that
    answer without it: the prompt's end is not a prefix of the next prompt, and on a target
    whose state cannot be cut back a hit resumed from the last interval snapshot (here: none,
    so nothing was reused). The server now passes where the last message ended
    (`Rendered.boundary`) and the prefill snapshots there too, so the next turn reuses
    everything up to it, and answers as a fresh request does."""
    import shutil

    target, _ = built(models_dir, "qwen3_5")
    folder = tmp_path / "thinks"
    shutil.copytree(target, folder)
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    cfg.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))
    (folder / "chat_template.jinja").write_text(THINKING_TEMPLATE)
    turn = [{"role": "user", "content": "Name a sea."}]
    with live_server(LoadSpec(str(folder), mode="baseline")) as (url, engine):
        engine.set_prefix_cache(PrefixCache(1 << 30))  # snapshots every 512 tokens: none here
        oai = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        first = oai.chat.completions.create(model="thinks", messages=turn, max_tokens=6)
        turn += [{"role": "assistant", "content": "The Sargasso."},
                 {"role": "user", "content": "Another?"}]  # fmt: skip
        second = oai.chat.completions.create(model="thinks", messages=turn, max_tokens=6)
        engine.set_prefix_cache(None)
        fresh = oai.chat.completions.create(model="thinks", messages=turn, max_tokens=6)
    pipe = outrider.load(str(folder), mode="baseline")
    from outrider.chat.render import render_chat

    rendered = render_chat(pipe.tokenizer, turn[:1])
    opener = pipe.tokenizer.encode("<|im_start|>assistant\n<think>\n", add_special_tokens=False)
    assert rendered.boundary == len(rendered.ids) - len(opener) > 0
    assert first.usage.prompt_tokens == len(rendered.ids)
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached == rendered.boundary  # where the first turn's last message ended
    assert second.choices[0].message.content == fresh.choices[0].message.content


def test_a_new_conversation_resumes_where_the_shared_system_prompt_ended(models_dir):
    """A new conversation of the same agent shares only its system prompt (Claude Code's runs
    to tens of thousands of tokens): the chat routes snapshot where it ends, so on a target
    whose state cannot be cut back the next conversation resumes there, not from the last
    interval snapshot (here: none, 512 tokens apart)."""
    target, _ = built(models_dir, "qwen3_5")
    system = {"role": "system", "content": "You are a terse sailor. " * 6}
    first = [system, {"role": "user", "content": "Name a sea."}]
    other = [system, {"role": "user", "content": "Name a river."}]
    with live_server(LoadSpec(str(target), mode="baseline")) as (url, engine):
        engine.set_prefix_cache(PrefixCache(1 << 30))
        oai = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        name = requests.get(url + "/health").json()["model"]
        oai.chat.completions.create(model=name, messages=first, max_tokens=4)
        second = oai.chat.completions.create(model=name, messages=other, max_tokens=4)
        engine.set_prefix_cache(None)
        fresh = oai.chat.completions.create(model=name, messages=other, max_tokens=4)
    from outrider.chat.render import render_chat

    pipe = outrider.load(str(target), mode="baseline")
    rendered = render_chat(pipe.tokenizer, other)
    alone = pipe.tokenizer.encode(
        f"<|im_start|>system\n{system['content']}<|im_end|>\n", add_special_tokens=False
    )
    assert rendered.system_end == len(alone) and rendered.marks[0] == len(alone)
    assert second.usage.prompt_tokens_details.cached_tokens == rendered.system_end
    assert second.choices[0].message.content == fresh.choices[0].message.content


def test_python_chats_mark_their_system_prompt_and_last_message_by_themselves(models_dir):
    """`Pipeline.generate` takes a conversation's messages (or a user turn and `system`) and,
    with the prefix cache on, snapshots where the system prompt and the last message ended, as
    the server does for a chat request: on a target whose state cannot be cut back, a new
    conversation resumes where the shared system prompt ended and the next turn where the
    last message ended, and each answers as a fresh pipeline does."""
    from outrider.chat.render import render_chat

    target, pipe, fresh = pipes(models_dir, "qwen3_5", "baseline")
    pipe.enable_prefix_cache(gb=1)  # snapshots every 512 tokens: none at these lengths
    system = "You are a terse sailor. " * 6

    def chat(p, prompt, **kw):
        return p.generate(prompt, max_tokens=4, stop_tokens=set(), **kw)

    first = chat(pipe, "Name a sea.", system=system)  # a user turn and a system prompt
    other = [{"role": "system", "content": system}, {"role": "user", "content": "Name a river."}]
    second = chat(pipe, other)  # a new conversation of the same system prompt
    rendered = render_chat(pipe.tokenizer, other)
    assert 0 < rendered.system_end < len(rendered.ids)
    assert second.cached_tokens == rendered.system_end
    assert second.tokens == chat(fresh, other).tokens
    turn = other + [
        {"role": "assistant", "content": pipe.tokenizer.decode(second.tokens)},
        {"role": "user", "content": "Another?"},
    ]
    third = chat(pipe, turn)  # the next turn of that conversation
    assert third.cached_tokens >= rendered.boundary > rendered.system_end
    assert third.tokens == chat(fresh, turn).tokens
    assert first.prompt_tokens == pipe.encode("Name a sea.", system=system)
    with pytest.raises(outrider.OutriderError, match="raw takes a text prompt"):
        pipe.encode(other, raw=True)
    with pytest.raises(outrider.OutriderError, match="token ids .ints. or chat messages"):
        pipe.encode([1, "two"])


def test_thinning_keeps_marks_and_prompt_ends_longest_and_spreads_the_rest():
    """Checkpoints where nothing ended go first (the closest to the one before, so the rest
    stay spread), then marks and prompt ends, oldest first; a dropped prompt end takes its
    logits row with it (no whole hit there without its checkpoint)."""
    import numpy as np

    from outrider.core.family import LayerSnapshot
    from outrider.core.prefix_entry import Entry

    def snap(trimmable: bool = False) -> list[LayerSnapshot]:
        return [LayerSnapshot("kv", [mx.zeros((256,), dtype=mx.float32)], {}, trimmable)]

    positions = [8, 16, 20, 32, 40, 48, 56]  # 1 KiB each; the entry's own state 1 KiB
    entry = Entry(np.arange(64), snap(), {p: snap() for p in positions})
    entry.logits = {40: mx.zeros((4,)), 56: mx.zeros((4,))}  # prompts ended at 40 and 56
    entry.marks = {16, 48}  # a caller's marks (a system prompt's end, a message's)
    entry.nbytes = entry._count()
    kept = []
    for _ in positions:  # one checkpoint at a time
        assert entry.thin(entry.nbytes - 1024) == 1
        kept.append(sorted(entry.checkpoints))
    assert kept == [
        [8, 16, 32, 40, 48, 56],  # 20, 4 tokens after 16: the closest to the one before it
        [16, 32, 40, 48, 56],  # 8 (8 after the start), before 32 (16 after 16)
        [16, 40, 48, 56],  # 32, the last where nothing ended or was marked
        [16, 48, 56],  # then ends and marks, oldest first: 40 ...
        [16, 56],  # ... and 48, but not the first mark and the newest
        [56],  # the first mark (a system prompt's end) goes before the newest
        [],
    ]
    assert entry.logits == {} and entry.thin(0) == 0


def test_a_long_prefill_takes_at_most_eight_checkpoints():
    """Every `interval` tokens up to 8 of them; a longer prompt spaces them wider (multiples of
    the interval), since each holds a whole recurrent state until the entry is stored."""
    from outrider.core.prefix_cache import Record

    record = Record([True, False], 512, ())
    short, _ = record.prefill_stops(None, None, 0, 3000)
    assert sorted(short) == [512, 1024, 1536, 2048, 2560]
    long, _ = record.prefill_stops(None, None, 100, 40_100)  # a hit of 100 tokens, 40k more
    assert len(long) <= 8 and sorted(long)[0] == 5120 - 100  # 512 x 10, counted from 0
    assert all((p + 100) % 5120 == 0 for p in long)
    assert Record([True], 512, ()).prefill_stops(None, None, 0, 9999) == ((), None)


def test_a_disk_entry_keeps_its_marks_and_is_thinned_into_a_smaller_budget(models_dir, tmp_path):
    """An entry read back from the disk tier under a smaller budget than it was written for is
    thinned like a fresh one (it used to be refused), and keeps the marks its request set."""
    target, pipe, fresh = pipes(models_dir, "qwen3_5", "baseline")
    pipe.enable_prefix_cache(gb=1, directory=tmp_path, interval=INTERVAL)
    mark = len(SYSTEM) - 3  # not a multiple of the interval: only the mark snapshots there
    ids = FIRST + [120, 121, 122, 123] * 6
    for turn in range(3):  # one entry, checkpoints from three prefills
        ids = ids + run(pipe, ids, snapshot_at=(mark,)).tokens + [130 + turn] * 20
    assert pipe.prefix_cache.entries == 1 and len(list(tmp_path.glob("*.safetensors"))) == 1
    written = next(iter(pipe.prefix_cache._entries.values()))
    assert mark in written.marks and mark in written.checkpoints
    held = sum(s.nbytes for ck in written.checkpoints.values() for s in ck if s is not None)
    one = held / len(written.checkpoints)
    budget = 2 * (written.nbytes - held + 2.5 * one)  # half of it holds two checkpoints
    assert budget < written.nbytes  # which the whole entry overflows
    pipe.enable_prefix_cache(gb=budget / (1 << 30), directory=tmp_path, interval=INTERVAL)
    probe = SYSTEM[:mark] + [7, 7, 7]  # diverges right after the mark
    got = run(pipe, probe)
    store = pipe.prefix_cache
    assert store.stats["disk_hits"] == 1 and store.stats["checkpoints_dropped"] > 0
    assert got.cached_tokens == mark and got.tokens == run(fresh, probe).tokens
    read = next(iter(store._entries.values()))
    assert mark in read.marks and read.nbytes <= store.max_bytes // 2


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_disk_tier_survives_and_refuses_bad_files(models_dir, tmp_path, family):
    target, pipe, fresh = pipes(models_dir, family, "baseline")
    want = run(fresh, FIRST).tokens
    pipe.enable_prefix_cache(gb=1, directory=tmp_path, interval=INTERVAL)
    run(pipe, FIRST)
    files = list(tmp_path.glob("*.safetensors"))
    assert len(files) == 1 and pipe.prefix_cache.stats["disk_writes"] == 1

    def new_store_run():
        pipe.enable_prefix_cache(gb=1, directory=tmp_path, interval=INTERVAL)  # a "restart"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = run(pipe, FIRST)
        assert got.tokens == want
        return got, pipe.prefix_cache.stats, [str(w.message) for w in caught]

    got, stats, _ = new_store_run()
    assert got.cached_tokens == len(FIRST) and stats["disk_hits"] == 1

    # damaged: a byte flipped in the data is refused, deleted, and rebuilt by the request
    data = bytearray(files[0].read_bytes())
    data[-5] ^= 0xFF
    files[0].write_bytes(bytes(data))
    got, stats, said = new_store_run()
    assert got.cached_tokens == 0 and stats["disk_refused"] == 1 and stats["disk_hits"] == 0
    assert any("checksum" in s for s in said)
    assert files[0].exists() and files[0].read_bytes() != bytes(data)  # rebuilt

    # foreign: a consistent file whose metadata names another model is refused too
    arrays, meta = mx.load(str(files[0]), return_metadata=True)
    mx.save_safetensors(str(files[0]), arrays, {**meta, "identity": "another-model"})
    side = files[0].with_suffix(".json")
    record = json.loads(side.read_text())
    from outrider.core.prefix_disk import file_sha

    side.write_text(json.dumps({**record, "sha256": file_sha(files[0])}))
    got, stats, said = new_store_run()
    assert got.cached_tokens == 0 and stats["disk_refused"] == 1
    assert any("another model" in s for s in said)
    assert json.loads(side.read_text())["sha256"] == file_sha(files[0])  # rebuilt, ours again
    got, stats, _ = new_store_run()
    assert got.cached_tokens == len(FIRST) and stats["disk_hits"] == 1


def test_unusable_or_full_disk_degrades_to_memory_only(models_dir, tmp_path):
    target, pipe, fresh = pipes(models_dir, "qwen3", "baseline")
    want = run(fresh, FIRST).tokens
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    full = tmp_path / "full"
    full.mkdir()
    good = tmp_path / "good"
    pipe.enable_prefix_cache(gb=1, directory=good)
    run(pipe, FIRST)
    stem = next(good.glob("*.safetensors")).stem
    # every write of that entry lands on /dev/full: no space left
    os.symlink("/dev/full", full / f".{stem}.tmp.safetensors")
    for where in (not_a_dir, full):
        pipe.enable_prefix_cache(gb=1, directory=where)
        with pytest.warns(UserWarning, match="disk tier off"):
            assert run(pipe, FIRST).tokens == want
        assert pipe.prefix_cache.directory is None  # memory only from here on
        again = run(pipe, FIRST)
        assert again.tokens == want and again.cached_tokens == len(FIRST)
    assert not list(full.glob("*.safetensors"))


@pytest.fixture(scope="module")
def server(models_dir):
    target, _ = built(models_dir, "qwen3")
    with live_server(LoadSpec(str(target), mode="lookup")) as (url, engine):
        engine.set_prefix_cache(PrefixCache(1 << 30))
        yield url, engine


def test_openai_and_anthropic_sdks_report_cached_tokens(server):
    url, _ = server
    oai = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    messages = [
        {"role": "system", "content": "You are terse. " * 8},
        {"role": "user", "content": "Say something about the sea."},
    ]
    answers = []
    for _ in range(2):
        r = oai.chat.completions.create(
            model="fam-qwen3", messages=messages, max_tokens=12, temperature=0
        )
        answers.append((r.choices[0].message.content, r.usage))
    (first, u1), (second, u2) = answers
    assert first == second
    assert u1.prompt_tokens_details.cached_tokens == 0
    assert u2.prompt_tokens_details.cached_tokens == u2.prompt_tokens  # a whole-prompt hit

    claude = anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
    said = []
    for _ in range(2):
        m = claude.messages.create(
            model="fam-qwen3",
            system="You are terse. " * 8,
            messages=[{"role": "user", "content": "Say something about the sea."}],
            max_tokens=12,
        )
        said.append((m.content[0].text if m.content else "", m.usage))
    (first, u1), (second, u2) = said
    assert first == second
    assert u2.cache_read_input_tokens > 0 and u2.input_tokens == 0
    assert u2.input_tokens + u2.cache_read_input_tokens == u1.input_tokens + (
        u1.cache_read_input_tokens or 0
    )
    metrics = requests.get(url + "/metrics").text
    hits = [ln for ln in metrics.splitlines() if ln.startswith("outrider_prefix_cache_hits_total")]
    assert hits and float(hits[0].split()[-1]) >= 2
    assert "outrider_prefix_cache_bytes" in metrics


def test_memory_pressure_empties_the_prefix_cache_before_a_generation(server, monkeypatch):
    """When memory runs short, a request first gives MLX's buffer cache back, and only if
    that is not enough empties the prefix cache (counted in /metrics); answers are unchanged,
    only no longer cached."""
    from test_server_batching import metric

    from outrider.core import fit

    url, engine = server
    oai = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)

    def ask(text: str):
        r = oai.chat.completions.create(model="fam-qwen3", max_tokens=8, temperature=0,
                                        messages=[{"role": "user", "content": text}])  # fmt: skip
        return r.choices[0].message.content, r.usage.prompt_tokens_details.cached_tokens

    first = ask("Name a colour.")
    sheds = metric(url, "outrider_memory_sheds_total")
    readings = [(95, 100)]  # pressed once, then relieved by the buffer cache

    def relieved() -> tuple[int, int]:
        return readings.pop() if readings else (50, 100)

    monkeypatch.setattr(fit, "memory_in_use", relieved)
    text, cached = ask("Name a colour.")
    assert text == first[0] and cached > 0  # still a hit: the buffer cache was enough
    assert metric(url, "outrider_memory_sheds_total") == sheds
    assert metric(url, "outrider_prefix_cache_entries") > 0
    monkeypatch.setattr(fit, "memory_in_use", lambda: (95, 100))  # pressed throughout
    again = ask("Name a colour.")
    assert again == (first[0], 0)  # the same answer, its prefix no longer cached
    assert metric(url, "outrider_memory_sheds_total") == sheds + 1
    monkeypatch.setattr(fit, "memory_in_use", lambda: (50, 100))
    assert ask("Name a colour.")[1] > 0  # cached again, from the last request's entry
    assert metric(url, "outrider_memory_sheds_total") == sheds + 1
    guard = requests.get(url + "/health", timeout=30).json()["memory_guard"]
    assert guard["enabled"] and guard["threshold"] == 0.9 and guard["in_use"] == 0.5
    assert guard["sheds"] == sheds + 1 and guard["last_shed"] is not None
    # serve --no-memory-guard: nothing is shed, however short memory runs
    monkeypatch.setattr(fit, "memory_in_use", lambda: (99, 100))
    monkeypatch.setattr(engine, "memory_guard", False)
    assert ask("Name a colour.")[1] > 0
    assert metric(url, "outrider_memory_sheds_total") == sheds + 1
    assert requests.get(url + "/health", timeout=30).json()["memory_guard"]["enabled"] is False


@pytest.mark.slow  # a benchmark script's run: the full suite's
def test_the_ttft_benchmark_times_the_exact_repeat_in_its_cold_run(
    qwen3_target, tmp_path, monkeypatch, capsys
):
    """`benchmarks/prefix_cache.py --cold` (what `scripts/gpu_bench.sh turn5q` runs on a GPU)
    reports turn N and the exact repeat from one run, every answer with the cache on equal to
    the cache-off one."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "prefix_cache.py"
    spec = importlib.util.spec_from_file_location("prefix_cache_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "ttft.json"
    argv = ["prefix_cache.py", "--model", str(qwen3_target), "--cold", "--system-tokens", "96"]
    argv += ["--turns", "3", "--repeats", "2", "--answer-tokens", "6", "--json", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    bench.main()
    got = json.loads(out.read_text())
    names = [row["scenario"] for row in got["rows"]]
    assert names == [
        "turn 3 cold",
        "turn 3 vs warm off",
        "exact repeat",
        "exact repeat vs warm off",
    ]
    assert got["identical"] and len(got["repeats"]) == len(got["turns"]) == 2
    assert all(row["ttft_on_s"] > 0 and row["ttft_off_s"] > 0 for row in got["rows"])
    assert "exact repeat" in capsys.readouterr().out
