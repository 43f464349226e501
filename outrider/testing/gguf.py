"""Tiny GGUF targets, written the way llama.cpp's converter writes a Hugging Face checkpoint.

`make_tiny_gguf` takes a tiny target folder (`make_tiny_target`: mlx-lm weights in the Hugging
Face layout) and writes it with gguf-py: llama.cpp's tensor names and metadata keys, Q/K rows of
`llama` files permuted as `convert_hf_to_gguf.py` (`LlamaModel.permute`) does, the tokenizer's
vocabulary, merges, special ids and chat template in the metadata, and 2-D weights stored as any
GGML type (F32, F16, Q8_0, Q4_0, Q4_1, ...). Types gguf-py cannot quantize get random blocks of
the right size, which is enough to test that a loader refuses them.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np

from .targets import make_tiny_target

_GLOBAL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_BLOCK = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "mlp.gate": "ffn_gate_inp",
    "mlp.switch_mlp.gate_proj": "ffn_gate_exps",
    "mlp.switch_mlp.up_proj": "ffn_up_exps",
    "mlp.switch_mlp.down_proj": "ffn_down_exps",
    "self_attn.qkv_proj": "attn_qkv",  # phi3's fused projections
    "mlp.gate_up_proj": "ffn_up",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",  # qwen2moe's shared expert and its gate
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "block_sparse_moe.gate": "ffn_gate_inp",  # Mixtral's names for the same
    "block_sparse_moe.switch_mlp.gate_proj": "ffn_gate_exps",
    "block_sparse_moe.switch_mlp.up_proj": "ffn_up_exps",
    "block_sparse_moe.switch_mlp.down_proj": "ffn_down_exps",
}
ARCH = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "mixtral": "llama", "gemma3_text": "gemma3"}  # fmt: skip
GEMMAS = ("gemma2", "gemma3")  # norms stored plus one, llama.cpp's names for the four norms
# Gemma 3's four norms a layer: llama.cpp calls the one before the MLP `ffn_norm`
_GEMMA3 = {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def gguf_name(name: str, arch: str = "") -> str:
    """llama.cpp's name for an mlx-lm (Hugging Face) tensor name of a model of `arch`."""
    module, kind = name.rsplit(".", 1)
    if module in _GLOBAL:
        return f"{_GLOBAL[module]}.{kind}"
    _, _, layer, rest = module.split(".", 3)  # model.layers.N.<rest>
    table = {**_BLOCK, **_GEMMA3} if arch in GEMMAS else _BLOCK
    return f"blk.{layer}.{table[rest]}.{kind}"


def permute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Rotate-half row order -> GGML's adjacent-pair order, per head (the converter's permute):
    within each head, row j * half + i moves to row 2 * i + j."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tokenizer_metadata(folder: Path) -> dict:
    data = json.loads((folder / "tokenizer.json").read_text())
    vocab = dict(data["model"]["vocab"])
    specials = {}
    for tok in data.get("added_tokens", []):
        vocab[tok["content"]] = tok["id"]
        specials[tok["id"]] = 3 if tok.get("special") else 4  # control / user-defined
    tokens = [""] * (max(vocab.values()) + 1)
    for token, idx in vocab.items():
        tokens[idx] = token
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"].get("merges", [])]
    config = json.loads((folder / "tokenizer_config.json").read_text())
    template = folder / "chat_template.jinja"  # where transformers 5 saves it

    def content(token):  # a plain string, or an AddedToken's serialisation
        return token["content"] if isinstance(token, dict) else token

    return {
        "tokens": tokens,
        "types": [specials.get(i, 1) for i in range(len(tokens))],
        "merges": merges,
        "eos": vocab[content(config["eos_token"])],
        "pad": vocab[content(config["pad_token"])],
        "chat_template": (
            template.read_text() if template.is_file() else config.get("chat_template")
        ),
    }


def make_tiny_gguf(
    path: str | Path,
    source: str | Path | None = None,
    *,
    family: str = "llama",
    quant: str = "F32",
    types: dict[str, str] | None = None,
    architecture: str | None = None,
    seed: int = 0,
    tokenizer_pre: str = "gpt2",
    bos_token: str | None = None,
    add_bos: bool | None = False,
    space_prefix: bool | None = None,
    sampling: dict[str, float] | None = None,
    **overrides,
) -> Path:
    """Write `path` (a .gguf file) from the tiny target folder `source`, or from a new one made
    beside it (`make_tiny_target(..., family, seed, **overrides)`).

    `quant` is the GGML type of every 2-D and 3-D (experts) weight (norms and biases stay F32,
    as the converter keeps them); `types` overrides it per GGUF tensor name. `architecture`
    overrides general.architecture (to test refusals). `tokenizer_pre` is tokenizer.ggml.pre, or
    "sentencepiece" for a `llama` vocabulary of pieces and scores (`spm_vocabulary`); `bos_token`
    (a special token's text) sets the BOS id, and `add_bos` tokenizer.ggml.add_bos_token (None
    leaves the key out, as converters do when the tokenizer config says nothing), and
    `space_prefix` tokenizer.ggml.add_space_prefix (None leaves it out). `sampling` writes
    general.sampling.<key> for each key (temp, top_p, top_k: a publisher's recommendation).
    Returns `path`.
    """
    import gguf
    from gguf import GGMLQuantizationType as Q

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if source is None:
        source = make_tiny_target(
            path.with_name(path.stem + "-hf"), family=family, seed=seed, **overrides
        )
    source = Path(source)
    cfg = json.loads((source / "config.json").read_text())
    arch = cfg["model_type"]
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads")
    kv_heads = kv_heads or heads
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    tok = _tokenizer_metadata(source)

    w = gguf.GGUFWriter(str(path), architecture or ARCH.get(arch, arch))
    w.add_name(f"tiny {arch}")
    for key, value in (sampling or {}).items():
        add = w.add_int32 if key == "top_k" else w.add_float32
        add(f"general.sampling.{key}", value)
    w.add_context_length(cfg.get("max_position_embeddings", 4096))
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    if "num_experts_per_tok" in cfg:
        w.add_expert_count(cfg.get("num_experts", cfg.get("num_local_experts")))
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        if "moe_intermediate_size" in cfg:
            w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        if "shared_expert_intermediate_size" in cfg:
            w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    rotated = int(head_dim * cfg.get("partial_rotary_factor", 1.0))
    w.add_rope_dimension_count(rotated)
    w.add_rope_freq_base(cfg.get("rope_theta", 10000.0))
    scaling = cfg.get("rope_scaling") or {}
    if scaling.get("type") == "longrope":  # Phi-3's per-pair factors, as tensors
        w.add_tensor("rope_factors_long.weight", np.array(scaling["long_factor"], np.float32))
        w.add_tensor("rope_factors_short.weight", np.array(scaling["short_factor"], np.float32))
        w.add_rope_scaling_orig_ctx_len(cfg["original_max_position_embeddings"])
    if scaling.get("rope_type") == "llama3":  # llama.cpp stores the stretch per rotated pair
        from ..core.gguf import llama3_factors

        factors = llama3_factors(scaling, head_dim, cfg.get("rope_theta", 10000.0))
        w.add_tensor("rope_freqs.weight", factors.astype(np.float32))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    if "sliding_window" in cfg:
        w.add_sliding_window(cfg["sliding_window"])
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg["attn_logit_softcapping"])
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
    if tokenizer_pre == "sentencepiece":  # llama.cpp's `llama` vocabulary: pieces and scores
        spm = spm_vocabulary(cfg["vocab_size"], seed)
        w.add_tokenizer_model("llama")
        w.add_token_list(spm["tokens"])
        w.add_token_scores(spm["scores"])
        w.add_token_types(spm["types"])
        w.add_unk_token_id(0)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_chat_template(SPM_TEMPLATE)
    else:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre(tokenizer_pre)
        w.add_token_list(tok["tokens"])
        w.add_token_types(tok["types"])
        if tok["merges"]:
            w.add_token_merges(tok["merges"])
        w.add_eos_token_id(tok["eos"])
        w.add_pad_token_id(tok["pad"])
        if bos_token is not None:
            w.add_bos_token_id(tok["tokens"].index(bos_token))
        if tok["chat_template"]:
            w.add_chat_template(tok["chat_template"])
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    if space_prefix is not None:  # Gemma's converter writes false
        w.add_add_space_prefix(space_prefix)

    weights = mx.load(str(source / "model.safetensors"))
    for name in sorted(weights):
        arr = np.array(weights[name].astype(mx.float32))
        if ARCH.get(arch, arch) == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
            arr = permute_rows(arr, heads)
        elif ARCH.get(arch, arch) == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
            arr = permute_rows(arr, kv_heads)
        gname = gguf_name(name, ARCH.get(arch, arch))
        if ".ffn_gate_inp_shexp." in gname:  # one row: llama.cpp's files hold it [n_embd], F32
            arr = arr.reshape(-1)
        if ARCH.get(arch, arch) in GEMMAS and name.endswith("norm.weight"):
            arr = arr + 1  # the converter's Gemma norm shift (Gemma3RMSNorm scales by 1 + w)
        qtype = Q[(types or {}).get(gname, quant if arr.ndim >= 2 else "F32")]
        if qtype == Q.F32:
            w.add_tensor(gname, arr)
        elif qtype == Q.F16:
            w.add_tensor(gname, arr.astype(np.float16))
        else:
            try:
                data = gguf.quants.quantize(arr, qtype)
            except (NotImplementedError, gguf.quants.QuantError):  # IQ2_XXS, K-quants
                data = random_blocks(qtype.name, arr.shape, seed)
            w.add_tensor(gname, data, raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# Where a K-quant block keeps its float16 super-block scales: (byte offset, value) pairs.
SCALE_FIELDS = {
    "Q4_K": ((0, 2e-4), (2, 1e-4)),  # d, dmin: weights d·sc·q − dmin·m stay within ±0.2
    "Q5_K": ((0, 1e-4), (2, 1e-4)),
    "Q6_K": ((208, 2e-4),),  # d: weights d·sc·(q − 32), sc a signed byte
}


def random_blocks(qtype: str, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    """Blocks of GGML type `qtype` for a tensor of `shape`, for types gguf-py cannot quantize
    to: random bytes, with a K-quant's float16 scales set to small finite values so the
    weights are those of a usable model (random bytes would put NaNs and huge values there).
    Rows narrower than one block come out empty: a malformed file, for refusal tests."""
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    rows = int(np.prod(shape[:-1]))
    data = np.random.default_rng(seed).integers(0, 256, (rows, shape[-1] // block, size), np.uint8)
    for at, value in SCALE_FIELDS.get(qtype, ()):
        data[..., at : at + 2] = np.frombuffer(np.float16(value).tobytes(), np.uint8)
    return data.reshape(*shape[:-1], -1)


SPM_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }}"
    " [/INST]{% else %} {{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}"
)
SPM_CORPUS = "the quick brown fox jumps over the lazy dog, then the dog sleeps and the fox runs"


def spm_vocabulary(size: int, seed: int = 0) -> dict:
    """A SentencePiece vocabulary of exactly `size` entries, laid out as Llama 2's: <unk>, <s>,
    </s>, the 256 byte pieces <0x00>.., then "▁" and the corpus' characters, then random
    substrings (2-6 characters) of its words with random scores, so that pieces overlap and
    compete for the same characters and a long piece may outrank its parts (as a unigram
    model's do)."""
    rng = np.random.default_rng(seed)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    words = ["\u2581" + w for w in SPM_CORPUS.replace(",", " ,").split()]
    pieces = sorted({c for w in words for c in w})
    spans = sorted({w[i:j] for w in words for i in range(len(w)) for j in range(i + 2, i + 7)})
    spans = [s for s in spans if len(s) >= 2 and s not in pieces]
    room = size - len(tokens) - len(pieces)
    if room < 0 or room > len(spans):
        raise ValueError(f"a vocabulary of {size} needs {len(tokens) + len(pieces)} to "
                         f"{len(tokens) + len(pieces) + len(spans)} entries")  # fmt: skip
    chosen = [spans[i] for i in sorted(rng.choice(len(spans), room, replace=False))]
    scores = [0.0] * len(tokens) + [-1.0] * len(pieces)  # single characters: the fallback
    scores += [float(x) for x in rng.uniform(-50.0, 0.0, room)]
    return {
        "tokens": tokens + pieces + chosen,
        "scores": scores,
        "types": types + [1] * (len(pieces) + room),
    }
