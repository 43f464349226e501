"""What a training run is asked for (`TrainConfig`) and what it reports (`TrainReport`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import mlx.core as mx

from ..core.errors import OutriderError

KINDS = ("dspark", "dflash", "eagle3")
DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}


@dataclass
class TrainConfig:
    """Everything `outrider train` takes; the defaults follow DeepSpec where they can."""

    model: str
    data: list[str]
    out: str
    kind: str = "dspark"
    steps: int = 1000
    batch_size: int = 8
    seq_len: int = 512
    lr: float = 6e-4
    warmup: int | None = None  # default: 4% of the steps
    block_size: int = 7
    layers: int | None = None  # default: from the target's depth
    init: str | None = None
    max_new_tokens: int = 256
    regenerate: bool = True
    continue_text: bool = False  # documents are self-distilled too (the target continues them)
    thinking: bool | None = None
    held_out: int = 8
    seed: int = 42
    resume: bool = False
    anchors: int | None = None  # per window; default seq_len // 8 (DeepSpec: 512 per 4096)
    markov_rank: int = 256
    markov_type: str = "vanilla"
    dtype: str = "auto"  # auto = the target's own (float32 stays float32, bf16 stays bf16)
    eval_every: int = 0  # 0: before and after training only
    eval_tokens: int = 128
    save_every: int = 0  # 0: every 10% of the steps
    log_every: int = 10
    grad_clip: float = 1.0
    weight_decay: float = 0.0
    compile: bool = True
    # self-distillation asks the target this many prompts at a time and keeps each chunk's
    # answers on disk as it finishes (what an interrupted run's --resume continues from)
    distill_chunk: int = 256

    def check(self) -> None:
        if self.kind not in KINDS:
            raise OutriderError(f"--kind must be dspark, dflash or eagle3, got {self.kind!r}")
        if self.kind == "eagle3" and self.layers not in (None, 1):
            raise OutriderError(f"EAGLE-3 drafters have one layer; --layers {self.layers}")
        for name in (
            "steps",
            "batch_size",
            "block_size",
            "eval_tokens",
            "log_every",
            "distill_chunk",
        ):
            if getattr(self, name) < 1:
                raise OutriderError(f"--{name.replace('_', '-')} must be >= 1")
        if self.seq_len < 16:
            raise OutriderError(f"--seq-len must be >= 16, got {self.seq_len}")
        if self.lr <= 0:
            raise OutriderError(f"--lr must be > 0, got {self.lr}")
        if self.warmup is not None and not 0 <= self.warmup < self.steps:
            raise OutriderError(f"--warmup must be in [0, --steps), got {self.warmup}")
        if self.layers is not None and self.layers < 1:
            raise OutriderError(f"--layers must be >= 1, got {self.layers}")
        if self.max_new_tokens < 1:
            raise OutriderError(f"--max-new-tokens must be >= 1, got {self.max_new_tokens}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise OutriderError(f"--dtype must be auto, {', '.join(DTYPES)}; got {self.dtype!r}")
        if self.markov_type not in ("vanilla", "gated", "rnn"):
            raise OutriderError("--markov-type must be vanilla, gated or rnn")
        if not self.data:
            raise OutriderError("--data is required (a jsonl, text file or folder)")


@dataclass
class TrainReport:
    out: str
    kind: str
    steps: int
    windows: int
    held_out_prompts: int
    seconds: float
    tokens_per_second: float
    final_loss: float
    init: dict
    trained: dict
    lossless: bool
    evals: list[dict] = field(default_factory=list)

    @property
    def accept_init(self) -> float:
        return self.init["mean_accept_len"]

    @property
    def accept_trained(self) -> float:
        return self.trained["mean_accept_len"]

    def to_json(self) -> dict:
        return asdict(self)
