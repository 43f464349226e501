"""Stage 2: a byte-level BPE tokenizer with the chat special tokens and a ChatML template."""

from __future__ import annotations

from pathlib import Path


def train_tokenizer(texts: list[str], vocab_size: int, out: Path):
    """Byte-level BPE; the special tokens go last, so <|mask|> is the last id (drafters' mask)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from outrider.testing import CHAT_TEMPLATE, SPECIAL_TOKENS, chat_tokenizer

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_special_tokens(SPECIAL_TOKENS)
    fast = chat_tokenizer(tok, CHAT_TEMPLATE)
    fast.save_pretrained(str(out), save_jinja_files=False)  # template in tokenizer_config
    return fast


class ChatFormat:
    """Chat examples exactly as the model sees them at inference: the template's generation
    prompt around the user's text, then the answer and <|im_end|>. The template is rendered
    once per variant (thinking on/off) and reused, since rendering per example is slow."""

    def __init__(self, tokenizer) -> None:
        self.parts = {}
        for off in (False, True):
            kwargs = {"enable_thinking": False} if off else {}
            head = tokenizer.apply_chat_template(
                [{"role": "user", "content": "\x00"}],
                tokenize=False,
                add_generation_prompt=True,
                **kwargs,
            )
            self.parts[off] = head.split("\x00")

    def __call__(self, prompt: str, answer: str, thinking_off: bool = False) -> str:
        before, after = self.parts[thinking_off]
        return f"{before}{prompt}{after}{answer}<|im_end|>\n"
