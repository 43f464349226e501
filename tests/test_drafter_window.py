"""The drafter's context window (`--drafter-window`): a DSpark / DFlash block sees only the
latest N context rows. The window is a mask over the rows' positions, so batched rows see what
they see alone, and output never changes."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from cli_runner import invoke
from conftest import PROMPTS, plain_greedy
from draft_layers import attention_spec

import outrider
from outrider.core.errors import OutriderError
from outrider.plugins.strategies.block_drafter import DraftAttention
from outrider.plugins.strategies.block_proposer import DEFAULT_CONTEXT_WINDOW
from outrider.plugins.strategies.draft_context import ContextRows
from outrider.registry import Pair


def reference(attn, block, context, visible) -> mx.array:
    """The block's attention output by the definition: softmax over the visible keys."""
    n, ctx = block.shape[1], context.shape[1]
    ck, cv = attn._kv(context, 0)
    bk, bv = attn._kv(block, ctx)
    q = attn.q_norm(attn.q_proj(block).reshape(1, n, attn.n_heads, -1)).transpose(0, 2, 1, 3)
    q = attn.rope(q, offset=ctx)
    reps = attn.n_heads // attn.n_kv
    k = mx.repeat(mx.concatenate([ck, bk], axis=2), reps, axis=1)
    v = mx.repeat(mx.concatenate([cv, bv], axis=2), reps, axis=1)
    scores = mx.where(mx.array(visible), (q @ k.swapaxes(-1, -2)) * attn.scale, -mx.inf)
    out = mx.softmax(scores, axis=-1) @ v
    return attn.o_proj(out.transpose(0, 2, 1, 3).reshape(1, n, -1))


@pytest.mark.parametrize("causal", [False, True])
def test_a_block_sees_the_latest_rows_of_its_context(causal):
    spec = attention_spec(causal_block=causal)
    mx.random.seed(2)
    attn = DraftAttention(spec)
    context, block = mx.random.normal((1, 11, 32)), mx.random.normal((1, 4, 32))
    rows = ContextRows(1, limit=5)
    rows.add(None, 0)
    rows.begin([11], 4, [0])
    got = attn(block, context[0:1], rows.layers[0])
    rows.end()
    visible = np.ones((4, 15), bool)
    visible[:, :6] = False  # context rows 0..5 lie before the latest 5 (6..10)
    if causal:
        visible[:, 11:] &= np.tril(np.ones((4, 4), bool))
    want = reference(attn, block, context, visible)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def pair(qwen3_target, drafters):
    return str(qwen3_target), str(drafters["dspark"])


def test_the_window_is_4096_rows_unless_asked(pair):
    target, drafter = pair
    default = outrider.load(target, drafter, mode="dspark", lookup_drafts=False)
    assert default.proposer.context_window == DEFAULT_CONTEXT_WINDOW == 4096
    assert (
        outrider.load(
            target, drafter, mode="dspark", drafter_window=0
        ).proposer.inner.context_window
        is None
    )
    row = Pair("tiny", target, "dense", "dspark", {"dspark": drafter}, drafter_window=64)
    pipe = outrider.load(target, mode="auto", registry=[row], lookup_drafts=False)
    assert pipe.proposer.context_window == 64  # the row's
    with pytest.raises(OutriderError, match="--drafter-window must be >= 0"):
        outrider.load(target, drafter, mode="dspark", drafter_window=-1)
    lookup = outrider.load(target, mode="lookup", drafter_window=8)
    assert any("--drafter-window does nothing in lookup mode" in n for n in lookup.notes)


def test_a_window_changes_drafts_never_output(pair, qwen3_target):
    """A window of 6 rows over a 40-token answer drafts otherwise than the whole context does,
    and both give plain greedy tokens."""
    target, drafter = pair
    whole = outrider.load(target, drafter, mode="dspark", drafter_window=0, lookup_drafts=False)
    short = outrider.load(target, drafter, mode="dspark", drafter_window=6, lookup_drafts=False)
    ids = whole.encode(PROMPTS[1])
    want = plain_greedy(qwen3_target, ids, 40)
    runs = [p.generate(ids, max_tokens=40, stop_tokens=set()) for p in (whole, short)]
    assert [r.tokens for r in runs] == [want, want]
    drafted = [[list(r.drafted) for r in run.rounds] for run in runs]
    assert drafted[0] != drafted[1]


def test_generate_takes_the_flag(pair):
    target, drafter = pair
    res = invoke("generate", "-m", target, "-d", drafter, "--mode", "dspark", "-p", "x",
                 "-n", "4", "--drafter-window", "-3")  # fmt: skip
    assert res.exit_code != 0 and "--drafter-window must be >= 0" in res.output
