"""Whole-prompt hits: an exact repeat starts from the logits kept with the cache, no forward.

A counting target (a `Target` subclass: every prefill chunk and every verify or plain step goes
through `_run`) shows what a request forwards. Tiny float32 models on the CPU compute the same
logits however the rows are grouped, so outputs are compared token for token (and log-probs
float for float).
"""

from __future__ import annotations

import json
import warnings

import mlx.core as mx
import pytest
from conftest import plain_greedy
from test_families import built
from test_prefix_cache import FIRST, INTERVAL, SYSTEM, N, run

import outrider
from outrider.core.logits import Penalties
from outrider.core.prefix_disk import FORMAT, file_sha
from outrider.core.target import HIT_TAIL, Target


class CountingTarget(Target):
    """The same model, counting the target forwards it runs."""

    def __init__(self, base: Target) -> None:
        super().__init__(base.model, base.tokenizer, base.family, base.config, base.name)
        self.forwards = 0

    def _run(self, ids, cache, tap_ids, verify=False):
        self.forwards += 1
        return super()._run(ids, cache, tap_ids, verify)


def counted(models_dir, family: str, mode: str = "baseline"):
    """(target path, a pipeline on a counting target with the prefix cache on, a fresh
    pipeline without it)."""
    path, drafter = built(models_dir, family)
    drafter = str(drafter) if mode == "dspark" else None
    target = CountingTarget(outrider.load(str(path), mode="baseline").target)
    pipe = outrider.load(str(path), drafter, mode=mode, target=target)
    pipe.enable_prefix_cache(gb=1, interval=INTERVAL)
    fresh = outrider.load(str(path), drafter, mode=mode)
    return path, pipe, fresh


def first_token(pipe, ids, **kw):
    """(the result of a one-token generation, the target forwards it ran)."""
    pipe.target.forwards = 0
    got = pipe.generate(ids, max_tokens=1, max_draft=4, stop_tokens=set(), **kw)
    return got, pipe.target.forwards


@pytest.mark.parametrize(
    "family,mode",
    [
        ("qwen3", "baseline"),
        ("qwen3_5", "baseline"),  # gated-delta: recurrent state restored at the prompt's end
        ("gemma4_text", "baseline"),  # sliding windows
        ("qwen3", "dspark"),  # the drafter starts on the stored taps
        ("qwen3_5", "dspark"),
    ],
)
def test_an_exact_repeat_forwards_nothing_and_equals_a_fresh_run(models_dir, family, mode):
    path, pipe, fresh = counted(models_dir, family, mode)
    want = run(fresh, FIRST).tokens
    assert want == plain_greedy(path, FIRST, N)
    assert run(pipe, FIRST).tokens == want  # a miss: prefilled, stored with its last logits

    one, forwards = first_token(pipe, FIRST)
    assert forwards == 0 and one.cached_tokens == len(FIRST) and one.tokens == want[:1]
    repeat = run(pipe, FIRST)
    assert repeat.cached_tokens == len(FIRST) and repeat.tokens == want
    # the counter counts: a prompt the cache has never seen is prefilled
    other = [7, 8, 9, *SYSTEM[::-1]]
    miss, forwards = first_token(pipe, other)
    assert miss.cached_tokens == 0 and forwards >= 1
    assert miss.tokens == run(fresh, other).tokens[:1]
    assert pipe.prefix_cache.stats["whole_hits"] == 2


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
@pytest.mark.parametrize("tail,forwards_wanted", [(HIT_TAIL, 1), (1, 2)])
def test_a_short_suffix_after_a_hit(models_dir, family, tail, forwards_wanted):
    """A partial hit forwards the new tokens and the last one together (a GPU's choice), or
    the last one alone after them (the CPU's); the output is the same."""
    path, pipe, fresh = counted(models_dir, family)
    pipe.target.hit_tail = tail
    first = run(pipe, FIRST)
    turn = FIRST + first.tokens + [110, 111, 112]  # 56 tokens: no recurrent checkpoint inside
    got, forwards = first_token(pipe, turn)
    assert got.cached_tokens == len(FIRST) + N and forwards == forwards_wanted
    assert got.tokens == run(fresh, turn).tokens[:1]
    assert run(pipe, turn).tokens == run(fresh, turn).tokens == plain_greedy(path, turn, N)


def test_the_answers_end_without_logits_falls_back_to_one_forward(models_dir):
    """A prompt equal to everything a generation left (its prompt and answer) has no kept
    logits at its end when the loop did not report them: its last token is forwarded again,
    as before there were kept logits."""
    path, pipe, fresh = counted(models_dir, "qwen3")
    first = run(pipe, FIRST)
    held = FIRST + first.tokens  # plain decoding forwards every answer token
    got, forwards = first_token(pipe, held)
    assert got.cached_tokens == len(held) - 1 and forwards == 1
    assert run(pipe, held).tokens == run(fresh, held).tokens


def test_logits_reported_at_the_answers_end_serve_a_whole_hit(models_dir):
    """`Record.grow(..., logits)`: the row the loop reports for the cache's new end is kept,
    and a prompt equal to what the cache held starts from it."""
    path, pipe, _ = counted(models_dir, "qwen3")
    target, store = pipe.target, pipe.prefix_cache
    record = store.record(target, ())
    cache = target.make_cache()
    logits, _ = target.prefill(FIRST, cache)
    nxt = int(mx.argmax(logits).item())
    tokens = [*FIRST, nxt]
    record.track(cache, tokens, len(FIRST))
    after, _ = target.forward(mx.array([nxt], dtype=mx.uint32), cache)
    record.grow(1, None, after[-1])
    store.put(target, record)
    hit = store.lookup(target, tokens)
    assert hit.length == len(tokens) and hit.logits is not None
    assert mx.array_equal(hit.logits, after[-1]).item()
    again = store.lookup(target, FIRST)  # the prompt's own end was not reported: no logits
    assert again.length == len(FIRST) - 1 and again.logits is None


def test_sampled_logprobs_and_penalties_from_kept_logits_equal_a_fresh_run(models_dir):
    path, pipe, fresh = counted(models_dir, "qwen3")
    kw = dict(
        max_draft=4,
        stop_tokens=set(),
        temperature=0.9,
        top_p=0.95,
        seed=11,
        logprobs=3,
        penalties=Penalties(presence=0.7, frequency=0.3),
    )

    def sampled(p, max_tokens=N, **over):
        """(tokens, each token's log-prob record, the target forwards it ran)."""
        p.target.forwards = 0 if p is pipe else None
        steps = [c.step for c in p.stream(FIRST, max_tokens=max_tokens, **{**kw, **over})]
        tokens = [t for s in steps for t in s.committed]
        logprobs = [lp for s in steps for lp in (s.logprobs or [])]
        return tokens, logprobs, getattr(p.target, "forwards", None)

    want, want_lp, _ = sampled(fresh)
    assert len(want_lp) == N and len(set(want)) > 1
    assert sampled(pipe)[:2] == (want, want_lp)  # a miss, stored
    one, one_lp, forwards = sampled(pipe, 1)
    assert forwards == 0 and one == want[:1] and one_lp == want_lp[:1]
    assert pipe.prefix_cache.stats["whole_hits"] == 1
    got, got_lp, _ = sampled(pipe)
    assert got == want and got_lp == want_lp
    # other seeds draw otherwise from the same kept logits (the draw itself is not stored)
    assert len({tuple(sampled(pipe, 1, seed=s)[0]) for s in range(12)}) > 1


def _rewrite(path, metadata=None, drop=(), side_update=None, side_drop=()):
    """Rewrite a disk entry's safetensors file and sidecar consistently (checksum included)."""
    arrays, meta = mx.load(str(path), return_metadata=True)
    arrays = {k: v for k, v in arrays.items() if not any(k.startswith(d) for d in drop)}
    meta = {k: v for k, v in {**meta, **(metadata or {})}.items() if v is not None}
    mx.save_safetensors(str(path), arrays, meta)
    side = path.with_suffix(".json")
    record = json.loads(side.read_text())
    record = {k: v for k, v in {**record, **(side_update or {})}.items() if k not in side_drop}
    side.write_text(json.dumps({**record, "sha256": file_sha(path)}))


@pytest.mark.parametrize("family", ["qwen3", "qwen3_5"])
def test_disk_tier_keeps_the_logits_and_refuses_older_files(models_dir, tmp_path, family):
    path, pipe, fresh = counted(models_dir, family)
    want = run(fresh, FIRST).tokens
    pipe.enable_prefix_cache(gb=1, directory=tmp_path, interval=INTERVAL)
    run(pipe, FIRST)
    (file,) = tmp_path.glob("*.safetensors")
    arrays, meta = mx.load(str(file), return_metadata=True)
    assert f"logits.{len(FIRST)}" in arrays and meta["format"] == str(FORMAT)
    side = json.loads(file.with_suffix(".json").read_text())
    assert side["format"] == FORMAT and len(FIRST) in side["ends"]

    def restart_and_ask():
        pipe.enable_prefix_cache(gb=1, directory=tmp_path, interval=INTERVAL)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got, forwards = first_token(pipe, FIRST)
        assert got.tokens == want[:1]
        return got, forwards, pipe.prefix_cache.stats, [str(w.message) for w in caught]

    got, forwards, stats, _ = restart_and_ask()  # the round trip: no forward at all
    assert forwards == 0 and got.cached_tokens == len(FIRST)
    assert stats["disk_hits"] == 1 and stats["whole_hits"] == 1
    assert run(pipe, FIRST).tokens == want

    # an older file (format 1: no format field, no logits rows) is never read: it is deleted
    # when the store starts, the request prefills and writes its entry in this format
    _rewrite(file, {"format": None}, drop=("logits.",), side_drop=("format", "ends"))
    got, forwards, stats, _ = restart_and_ask()
    assert got.cached_tokens == 0 and forwards >= 1
    assert stats["disk_hits"] == 0 and stats["disk_refused"] == 1
    assert not file.exists() and not file.with_suffix(".json").exists()
    (file,) = tmp_path.glob("*.safetensors")
    assert json.loads(file.with_suffix(".json").read_text())["format"] == FORMAT
    got, forwards, stats, _ = restart_and_ask()
    assert forwards == 0 and stats["whole_hits"] == 1

    # a file whose sidecar says this format but whose data is of another is refused too
    _rewrite(file, {"format": "1"})
    got, forwards, stats, said = restart_and_ask()
    assert got.cached_tokens == 0 and stats["disk_refused"] == 1
    assert any("file format 1" in s for s in said)
    got, forwards, stats, _ = restart_and_ask()  # rebuilt by the refused request
    assert forwards == 0 and stats["disk_hits"] == 1


def test_batched_rows_start_from_kept_logits(models_dir):
    """Rows of a batch (`generate_batch`, the server's --max-batch) hit whole prompts too,
    and each equals its fresh output."""
    path, pipe, fresh = counted(models_dir, "qwen3")
    prompts = [FIRST, [*SYSTEM, 120, 121]]
    kw = dict(max_tokens=N, max_draft=4, stop_tokens=set())
    want = [r.tokens for r in fresh.generate_batch(prompts, **kw)]
    assert [r.tokens for r in pipe.generate_batch(prompts, **kw)] == want  # misses, stored
    got = pipe.generate_batch(prompts, **kw)
    assert [r.tokens for r in got] == want
    assert [r.cached_tokens for r in got] == [len(p) for p in prompts]
    assert pipe.prefix_cache.stats["whole_hits"] == 2
