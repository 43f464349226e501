"""The canonical drafter description every drafter-format plugin translates to.

A format is packaging (how to read files); a strategy is behaviour (how to propose). They meet
here: a block drafter (DSpark / DFlash backbone with context K/V injection) described by its
dimensions, its block semantics and its optional sequential and confidence heads, plus weights
under canonical names (DeepSpec's own tensor names, without prefix).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx


@dataclass
class DrafterSpec:
    format: str  # which format plugin read it, e.g. "deepspec", "zlab"
    kind: str  # "dspark" (sequential head), "dflash" (parallel block), "dflash2", "eagle3"
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    block_size: int  # input slots per draft call: anchor + (block_size - 1) masks
    logits_start: int  # first slot whose output is a draft (DeepSpec 0, z-lab 1)
    mask_token_id: int
    target_layer_ids: tuple[int, ...]  # DeepSpec convention (j = output of layer j)
    rope_scaling: dict | None = None
    rope_traditional: bool = False  # interleaved (GPT-J) pairs instead of rotate-half (NeoX)
    max_position_embeddings: int = 32768
    attention_bias: bool = False
    own_embedding: bool = True  # False: bind the target's embedding
    own_lm_head: bool = True  # False: bind the target's output head
    markov_rank: int = 0
    markov_type: str = "vanilla"  # vanilla | gated | rnn
    confidence_head: bool = False
    confidence_with_markov: bool = False
    # Per draft slot, the confidence head's calibration: slot j's estimate is
    # sigmoid(logit / T_j) (temperature scaling, DSpark paper §3.2.1). Empty: T = 1.
    confidence_temperatures: tuple[float, ...] = ()
    # Reduced draft vocabulary (speculators, SpecForge): the head has draft_vocab_size rows and
    # weights["d2t"] maps them to target ids (core/draft_vocab.py). None: the full vocabulary.
    draft_vocab_size: int | None = None
    # The backbone's conventions: "qwen3" (DeepSpec / z-lab) or "gemma4" (Gemma4DSparkModel).
    backbone: str = "qwen3"
    layer_types: tuple[str, ...] = ()  # per draft layer: full_attention | sliding_attention
    sliding_window: int | None = None
    # DFlash-lineage block attention (NVIDIA's Nemotron DSpark head): slot k sees only slots
    # <= k, and each layer has a learned per-head sink logit (`attention_sink_bias`).
    causal_block: bool = False
    attention_sinks: bool = False
    # sliding layers causal within the block, full ones not (vllm-project/speculators' rule)
    causal_sliding: bool = False
    # The qwen3_5-native fork (Ornith's): q_proj yields [q ‖ gate] per head and the attention
    # output is scaled by sigmoid(gate); rope turns only the first `rope_dims` of each head.
    gated_q: bool = False
    rope_dims: int | None = None
    # DFlash 2 (dflash_config): grouped dynamic causal convs and the candidate path selector.
    conv_kernel_size: int = 0
    conv_group_size: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    # EAGLE-3: sequential single-token steps per round.
    ttt_length: int = 0
    # Settings of one backbone or kind that no other reads (e.g. Gemma-4's conventions).
    extra: dict = field(default_factory=dict)
    weights: dict[str, mx.array] = field(default_factory=dict, repr=False)

    @property
    def max_draft(self) -> int:
        """Drafts one call yields: B for DeepSpec (anchor slot predicts), B-1 for z-lab."""
        return self.block_size - self.logits_start
