"""A toy drafter spec for tests of one draft attention layer: 4 heads over 2 KV heads of 8
dimensions, a hidden size of 32; a test states only what it is about."""

from __future__ import annotations

from outrider.core.drafter_spec import DrafterSpec


def attention_spec(**changes) -> DrafterSpec:
    base = dict(
        format="t", kind="dspark", hidden_size=32, num_layers=1, num_heads=4, num_kv_heads=2,
        head_dim=8, intermediate_size=16, vocab_size=10, rms_norm_eps=1e-6, rope_theta=1e4,
        block_size=4, logits_start=0, mask_token_id=9, target_layer_ids=(0,),
    )  # fmt: skip
    return DrafterSpec(**{**base, **changes})
