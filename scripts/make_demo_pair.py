"""Build outrider's embedded demo pair from scratch, offline, with one command.

    python scripts/make_demo_pair.py --preset demo            # the shipped pair (GPU: ~10 min)
    python scripts/make_demo_pair.py --preset tiny --out DIR  # seconds on a CPU (tests)
    python scripts/make_demo_pair.py --preset demo --target outrider/demo/pair/target
                                                              # new drafters, same target

Stages: (1) corpus: the Python standard library's own .py sources (PSF licence, copied next to
the corpus manifest), plus chat examples made from its functions (user: `def name(`, assistant:
the whole function); (2) a byte-level BPE tokenizer trained with `tokenizers`, with the chat
special tokens and template; (3) a qwen3 model of mlx-lm's own class, trained from scratch with
mlx-lm's trainer; (4) quantised with mlx-lm and saved as a normal mlx-lm folder; (5) DSpark and
DFlash drafters trained by `outrider train` side by side, one process each, on the target's own
answers to function-header prompts (skip with --skip-drafters), and stored 4-bit.
Writes OUT/target, OUT/dspark, OUT/dflash and OUT/recipe.json (sizes, losses, times, hardware).
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import os
import platform
import random
import shutil
import sys
import sysconfig
import tempfile
import textwrap
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

SIZE_LIMIT_MB = 16.0
SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "__pycache__"}


@dataclass(frozen=True)
class Preset:
    corpus_bytes: int  # 0: the whole standard library
    vocab_size: int  # including the special tokens
    hidden_size: int
    num_layers: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    seq_len: int
    batch_size: int
    steps: int
    lr: float
    warmup: int
    bits: int  # target quantisation
    dtype: str  # the saved target's float dtype (scales, norms)
    minutes: float  # the target's training stops here even if steps remain
    drafter_steps: int
    drafter_batch: int
    drafter_seq_len: int
    drafter_lr: float
    drafter_warmup: int
    drafter_layers: int
    block_size: int
    prompts: int  # self-distillation prompts for the drafters
    max_new_tokens: int
    held_out: int


PRESETS = {
    "tiny": Preset(
        corpus_bytes=250_000,
        vocab_size=512,
        hidden_size=64,
        num_layers=2,
        intermediate_size=128,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        seq_len=96,
        batch_size=4,
        steps=40,
        lr=3e-3,
        warmup=6,
        bits=8,
        dtype="float32",
        minutes=2.0,
        drafter_steps=20,
        drafter_batch=4,
        drafter_seq_len=96,
        drafter_lr=3e-3,
        drafter_warmup=2,
        drafter_layers=1,
        block_size=4,
        prompts=8,
        max_new_tokens=32,
        held_out=2,
    ),
    "demo": Preset(
        corpus_bytes=0,
        vocab_size=4096,
        hidden_size=256,
        num_layers=8,
        intermediate_size=768,
        num_heads=4,
        num_kv_heads=2,
        head_dim=64,
        seq_len=512,
        batch_size=32,
        steps=2000,
        lr=2e-3,
        warmup=100,
        bits=8,
        dtype="float32",  # float16 runs ~30x slower on MLX's CPU backend (fresh CPU installs)
        minutes=5.0,
        drafter_steps=4000,
        drafter_batch=16,
        drafter_seq_len=512,
        drafter_lr=6e-4,
        drafter_warmup=100,
        drafter_layers=1,
        block_size=8,
        prompts=4096,
        max_new_tokens=256,
        held_out=16,
    ),
}


def log(message: str) -> None:
    print(f"[make_demo_pair] {message}", flush=True)


# --- 1. corpus -------------------------------------------------------------------------------


def stdlib_sources(limit: int) -> list[tuple[str, str]]:
    """(relative path, text) of the standard library's .py files, sorted, tests left out."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if SKIP_DIRS & set(rel.parts[:-1]):
            continue
        try:
            files.append((rel.as_posix(), path.read_text(encoding="utf-8")))
        except (UnicodeDecodeError, OSError):
            continue
    if limit:
        kept, total = [], 0
        for rel, text in files:
            if total >= limit:
                break
            kept.append((rel, text))
            total += len(text)
        files = kept
    return files


def functions(source: str, lo: int = 60, hi: int = 2000) -> list[tuple[str, str]]:
    """(prompt `def name(`, whole function) for each function of a module of sane length."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    lines, out = source.splitlines(keepends=True), []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.decorator_list:
            text = "".join(lines[node.lineno - 1 : node.end_lineno])
            if lo <= len(text) <= hi:
                body = textwrap.dedent(text)
                head = body[: body.find("(") + 1]
                if head.lstrip().startswith(("def ", "async def ")):
                    out.append((head, body))
    return out


def write_corpus(work: Path, files: list[tuple[str, str]]) -> dict:
    """corpus/ holds the licence and a manifest, so the provenance travels with the data."""
    corpus = work / "corpus"
    corpus.mkdir(parents=True, exist_ok=True)
    licence = Path(sysconfig.get_paths()["stdlib"]) / "LICENSE.txt"
    if licence.is_file():
        shutil.copy(licence, corpus / "LICENSE-PSF.txt")
    manifest = {
        "source": "Python standard library .py sources (sysconfig stdlib path; tests excluded)",
        "licence": "PSF-2.0 (Python Software Foundation License Version 2)",
        "python": platform.python_version(),
        "files": len(files),
        "bytes": sum(len(t) for _, t in files),
    }
    (corpus / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return manifest


# --- 2. tokenizer ----------------------------------------------------------------------------


def train_tokenizer(texts: list[str], vocab_size: int, out: Path):
    """Byte-level BPE; the special tokens go last, so <|mask|> is the last id (drafters' mask)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from outrider.testing import CHAT_TEMPLATE, SPECIAL_TOKENS

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
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[1:],
    )
    fast.chat_template = CHAT_TEMPLATE
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


def documents(files, tokenizer, seed: int) -> tuple[list[str], list[str], list[tuple[str, str]]]:
    """Train and validation texts (every 20th file held out) and the training chat pairs."""
    rng, chat = random.Random(seed), ChatFormat(tokenizer)
    train, valid, pairs = [], [], []
    for i, (_, text) in enumerate(files):
        docs = [text + "<|endoftext|>"]
        fns = functions(text)
        docs += [chat(p, a, rng.random() < 0.25) for p, a in fns]
        (valid if i % 20 == 0 else train).extend(docs)
        if i % 20:
            pairs.extend(fns)
    rng.shuffle(train)
    return train, valid, pairs


def pack(texts: list[str], tokenizer, seq_len: int) -> list[tuple[list[int], int]]:
    """One token stream cut into seq_len+1 windows, in mlx-lm's (tokens, offset) item form."""
    stream: list[int] = []
    for text in texts:
        stream.extend(tokenizer.encode(text, add_special_tokens=False))
    n = seq_len + 1
    return [(stream[i : i + n], 0) for i in range(0, len(stream) - n + 1, n)]


# --- 3./4. target ----------------------------------------------------------------------------


def target_config(p: Preset, tokenizer) -> dict:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": p.hidden_size,
        "num_hidden_layers": p.num_layers,
        "intermediate_size": p.intermediate_size,
        "num_attention_heads": p.num_heads,
        "num_key_value_heads": p.num_kv_heads,
        "head_dim": p.head_dim,
        "rms_norm_eps": 1e-6,
        "vocab_size": len(tokenizer),
        "max_position_embeddings": 4096,
        "rope_theta": 10000.0,
        "tie_word_embeddings": True,
        "bos_token_id": None,
        "eos_token_id": tokenizer.convert_tokens_to_ids("<|im_end|>"),
        "torch_dtype": p.dtype,
    }


class Budget:
    """Ends mlx-lm's training loop when the time budget is spent (the batches stop coming)."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.start, self.stopped_at = seconds, time.perf_counter(), None

    def batches(self, iterate):
        def wrapped(*args, **kwargs):
            for i, batch in enumerate(iterate(*args, **kwargs)):
                if kwargs.get("loop") and time.perf_counter() - self.start > self.seconds:
                    self.stopped_at = i
                    return
                yield batch

        return wrapped


class Losses:
    """mlx-lm training callback that keeps the reported losses for the summary."""

    def __init__(self) -> None:
        self.train: list[tuple[int, float]] = []
        self.val: list[tuple[int, float]] = []
        self.tokens_per_second = 0.0

    def on_train_loss_report(self, info: dict) -> None:
        self.train.append((info["iteration"], info["train_loss"]))
        self.tokens_per_second = info["tokens_per_second"]

    def on_val_loss_report(self, info: dict) -> None:
        self.val.append((info["iteration"], info["val_loss"]))


def train_target(p: Preset, config: dict, train_set, valid_set, work: Path, seed: int):
    import mlx.core as mx
    import mlx.optimizers as optim
    from mlx_lm.models import qwen3
    from mlx_lm.tuner.trainer import TrainingArgs, iterate_batches, train

    mx.random.seed(seed)
    model = qwen3.Model(qwen3.ModelArgs.from_dict(config))
    decay = optim.cosine_decay(p.lr, max(1, p.steps - p.warmup), p.lr * 0.1)
    warm = optim.linear_schedule(p.lr * 0.01, p.lr, max(1, p.warmup))
    schedule = optim.join_schedules([warm, decay], [p.warmup])
    optimizer = optim.AdamW(learning_rate=schedule, weight_decay=0.01)
    args = TrainingArgs(
        batch_size=p.batch_size,
        iters=p.steps,
        val_batches=8,
        steps_per_report=max(1, p.steps // 20),
        steps_per_eval=max(1, p.steps // 4),
        steps_per_save=p.steps + 1,
        max_seq_length=p.seq_len + 1,
        adapter_file=str(work / "target-float.safetensors"),
    )
    losses, budget = Losses(), Budget(p.minutes * 60)
    train(
        model,
        optimizer,
        train_set,
        valid_set,
        args=args,
        iterate_batches=budget.batches(iterate_batches),
        training_callback=losses,
    )
    return model, losses, budget


def val_loss(model, valid_set, p: Preset) -> float:
    from mlx_lm.tuner.trainer import evaluate

    return evaluate(model, valid_set, p.batch_size, 8, max_seq_length=p.seq_len + 1)


def quantize_and_save(model, config: dict, p: Preset, out: Path) -> dict:
    """Cast to the preset's dtype, quantise with mlx-lm, save as a normal mlx-lm folder."""
    import mlx.core as mx
    from mlx.utils import tree_map
    from mlx_lm.utils import quantize_model, save_config, save_model

    dtype = getattr(mx, p.dtype)
    model.update(tree_map(lambda a: a.astype(dtype), model.parameters()))
    model, config = quantize_model(model, config, group_size=64, bits=p.bits)
    save_model(out, model)
    save_config(config, out / "config.json")
    return config


# --- 5. drafters -----------------------------------------------------------------------------


def drafter_data(work: Path, pairs, p: Preset, seed: int) -> list[Path]:
    """Prompts the target answers itself: the drafters learn the target's own greedy text
    (self-distillation), which is what they must predict at generation time."""
    rng = random.Random(seed)
    chosen = rng.sample(pairs, min(p.prompts, len(pairs)))
    prompts = work / "drafter-prompts.jsonl"
    prompts.write_text("".join(json.dumps({"turns": [head]}) + "\n" for head, _ in chosen))
    return [prompts]


def train_drafter(kind: str, target: Path, data: list[Path], out: Path, p: Preset, seed: int):
    """`outrider train` in this process, with its plain progress lines (same flags as the CLI:
    `--steps --batch-size --seq-len --lr --warmup --block-size --layers --max-new-tokens
    --held-out --seed`)."""
    from outrider.train import TrainConfig, train_drafter
    from outrider.train.progress import PlainLines

    cfg = TrainConfig(
        model=str(target),
        data=[str(f) for f in data],
        out=str(out),
        kind=kind,
        steps=p.drafter_steps,
        batch_size=p.drafter_batch,
        seq_len=p.drafter_seq_len,
        lr=p.drafter_lr,
        warmup=p.drafter_warmup,
        block_size=p.block_size,
        layers=p.drafter_layers,
        max_new_tokens=p.max_new_tokens,
        held_out=p.held_out,
        seed=seed,
    )  # thinking left default: the prompt form `generate` uses
    log(f"outrider train --kind {kind}: {p.drafter_steps} steps")
    view = PlainLines()
    try:
        report = train_drafter(cfg, on_event=view)
    finally:
        view.close()
    return report.to_json()


# --- summary ---------------------------------------------------------------------------------


def folder_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 1e6


def hardware() -> dict:
    import mlx.core as mx

    info = {"platform": platform.platform(), "python": platform.python_version()}
    info["mlx"] = getattr(mx, "__version__", "?")
    info["device"] = str(mx.default_device())
    try:
        info["device_info"] = {
            k: v for k, v in mx.device_info().items() if isinstance(v, (str, int, float))
        }
    except Exception:
        pass
    info["cpus"] = os.cpu_count()
    return info


def parse(argv: list[str] | None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", choices=sorted(PRESETS), default="demo")
    ap.add_argument("--out", type=Path, default=ROOT / "outrider" / "demo" / "pair")
    ap.add_argument("--work", type=Path, help="keep scratch files here (default: a temp dir)")
    ap.add_argument("--steps", type=int, help="target training steps (overrides the preset)")
    ap.add_argument("--drafter-steps", type=int, help="drafter training steps (overrides)")
    ap.add_argument("--minutes", type=float, help="target training time budget (overrides)")
    ap.add_argument("--bits", type=int, choices=(4, 8), help="target quantisation (overrides)")
    ap.add_argument("--prompts", type=int, help="drafters' self-distillation prompts (overrides)")
    ap.add_argument("--skip-drafters", action="store_true", help="stop after the target")
    ap.add_argument(
        "--target", type=Path, help="train drafters for this already-built target (skips 1-4)"
    )
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    p = PRESETS[args.preset]
    for name in ("steps", "drafter_steps", "minutes", "bits", "prompts"):
        if getattr(args, name) is not None:
            if getattr(args, name) <= 0:
                ap.error(f"--{name.replace('_', '-')} must be > 0")
            p = replace(p, **{name: getattr(args, name)})
    return args, p


def main(argv: list[str] | None = None) -> dict:
    args, p = parse(argv)
    if not args.skip_drafters and importlib_missing("outrider.train"):
        sys.exit(
            "error: `outrider train` is not in this checkout; pass --skip-drafters to build the "
            "target alone"
        )
    if args.work is not None:
        return build(args, p, args.work.resolve())
    with tempfile.TemporaryDirectory(prefix="outrider-demo-") as work:
        return build(args, p, Path(work))


def build(args: argparse.Namespace, p: Preset, work: Path) -> dict:
    """Every stage, in order; scratch files (float weights, drafter data) go to `work`."""
    t0 = time.perf_counter()
    out: Path = args.out.resolve()
    work.mkdir(parents=True, exist_ok=True)
    log(f"preset {args.preset}: {json.dumps(asdict(p))}")
    reuse = args.target.resolve() if args.target is not None else None
    parts = ("dspark", "dflash") if reuse is not None else ("target", "dspark", "dflash")
    for part in parts:
        shutil.rmtree(out / part, ignore_errors=True)
    if reuse is not None:
        summary, pairs = reuse_target(reuse, out, p)
    else:
        summary, pairs = make_target(args, p, out, work)
    times = summary["seconds"]

    drafters: dict[str, dict] = {}
    if not args.skip_drafters:
        data = drafter_data(work, pairs, p, args.seed)
        t = time.perf_counter()
        drafters = train_drafters(out / "target", data, out, p, args.seed)
        times["drafters"] = round(time.perf_counter() - t, 2)
        for kind, d in drafters.items():
            times[f"{kind}_training"] = d.pop("seconds")

    sizes = {part: round(folder_mb(out / part), 2) for part in ("target", "dspark", "dflash")}
    total = round(sum(sizes.values()), 2)
    summary.update(
        {
            "preset": args.preset,
            "settings": asdict(p),
            "drafters": drafters,
            "sizes_mb": sizes,
            "total_mb": total,
            "total_seconds": round(time.perf_counter() - t0, 1),
            "hardware": hardware(),
            "command": " ".join(["python", "scripts/make_demo_pair.py", *args.argv]),
        }
    )
    (out / "recipe.json").write_text(json.dumps(summary, indent=2))
    print_summary(summary)
    if total > SIZE_LIMIT_MB:
        sys.exit(f"error: the pair is {total} MB, over the {SIZE_LIMIT_MB} MB limit")
    return summary


def make_target(args: argparse.Namespace, p: Preset, out: Path, work: Path):
    """Stages 1-4: corpus, tokenizer, target training, quantisation. Returns the summary so
    far and the training chat pairs (the drafters' prompts come from them)."""
    (out / "target").mkdir(parents=True)
    times: dict[str, float] = {}

    def lap(name: str, since: float) -> float:
        now = time.perf_counter()
        times[name] = round(now - since, 2)
        return now

    t = time.perf_counter()
    files = stdlib_sources(p.corpus_bytes)
    manifest = write_corpus(work, files)
    shutil.copy(work / "corpus" / "manifest.json", out / "target" / "corpus.json")
    if (work / "corpus" / "LICENSE-PSF.txt").is_file():
        shutil.copy(work / "corpus" / "LICENSE-PSF.txt", out / "target" / "CORPUS-LICENSE.txt")
    log(f"corpus: {manifest['files']} stdlib files, {manifest['bytes'] / 1e6:.1f} MB (PSF-2.0)")
    tokenizer = train_tokenizer([t for _, t in files], p.vocab_size, out / "target")
    t = lap("tokenizer", t)
    log(f"tokenizer: byte-level BPE, {len(tokenizer)} tokens ({times['tokenizer']} s)")

    train_texts, valid_texts, pairs = documents(files, tokenizer, args.seed)
    train_set = pack(train_texts, tokenizer, p.seq_len)
    valid_set = pack(valid_texts, tokenizer, p.seq_len)
    if len(train_set) < p.batch_size or len(valid_set) < p.batch_size:
        sys.exit("error: the corpus is too small for one batch; raise corpus_bytes")
    tokens = len(train_set) * (p.seq_len + 1)
    log(f"data: {tokens:,} training tokens ({len(pairs)} chat examples), {len(valid_set)} val rows")
    t = lap("data", t)

    config = target_config(p, tokenizer)
    model, losses, budget = train_target(p, config, train_set, valid_set, work, args.seed)
    float_loss = val_loss(model, valid_set, p)
    t = lap("target_training", t)
    steps_done = budget.stopped_at if budget.stopped_at is not None else p.steps
    log(f"target: {steps_done} steps in {times['target_training']} s, val loss {float_loss:.3f}")
    if budget.stopped_at is not None:
        log(f"target: time budget of {p.minutes} min reached at step {steps_done}")

    quantize_and_save(model, config, p, out / "target")
    from mlx_lm.utils import load

    qmodel, _ = load(str(out / "target"))
    quant_loss = val_loss(qmodel, valid_set, p)
    t = lap("quantise", t)
    log(f"target: {p.bits}-bit, val loss {quant_loss:.3f} ({folder_mb(out / 'target'):.2f} MB)")
    first_val = losses.val[0][1] if losses.val else math.nan
    summary = {
        "corpus": manifest,
        "vocab_size": len(tokenizer),
        "target_steps": steps_done,
        "target_tokens_per_second": round(losses.tokens_per_second, 1),
        "train_loss": [(i, round(v, 4)) for i, v in losses.train],
        "val_loss_start": round(first_val, 4),
        "val_loss_float": round(float_loss, 4),
        "val_loss_quantized": round(quant_loss, 4),
        "seconds": times,
    }
    return summary, pairs


def reuse_target(target: Path, out: Path, p: Preset):
    """--target: drafters for an already-built target (stages 1-4 skipped). The chat pairs
    are rebuilt from the same standard-library files the corpus manifest lists."""
    if not (target / "config.json").is_file():
        sys.exit(f"error: --target {target} is not a model folder (no config.json)")
    if target != (out / "target").resolve():
        shutil.rmtree(out / "target", ignore_errors=True)
        shutil.copytree(target, out / "target")
    files = stdlib_sources(p.corpus_bytes)
    pairs = [pair for i, (_, text) in enumerate(files) if i % 20 for pair in functions(text)]
    log(f"target: reusing {target} ({len(pairs)} chat examples for the drafters' prompts)")
    return {"target_reused": str(target), "seconds": {}}, pairs


def train_drafters(target: Path, data: list[Path], out: Path, p: Preset, seed: int) -> dict:
    """DSpark and DFlash side by side, one process each: a small drafter's training is bound
    by the host's kernel launches, so two runs share one GPU (or CPU) well."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    ctx = multiprocessing.get_context("spawn")  # a fresh MLX per child, no forked device state
    kinds = ("dspark", "dflash")
    with ProcessPoolExecutor(len(kinds), mp_context=ctx) as pool:
        jobs = {k: pool.submit(drafter_job, k, target, data, out / k, p, seed) for k in kinds}
        return {k: job.result() for k, job in jobs.items()}


def drafter_job(kind: str, target: Path, data: list[Path], out: Path, p: Preset, seed: int):
    from outrider.core.quantized import quantize_checkpoint

    t = time.perf_counter()
    report = train_drafter(kind, target, data, out, p, seed)
    shutil.rmtree(out / "checkpoints", ignore_errors=True)
    quantize_checkpoint(out, bits=4)
    seconds = round(time.perf_counter() - t, 2)
    log(f"{kind}: {folder_mb(out):.2f} MB in {seconds} s")
    return {"mb": round(folder_mb(out), 2), "report": report, "seconds": seconds}


def importlib_missing(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is None


def accept_numbers(report: dict, prefix: str = "") -> list[tuple[str, float]]:
    """Every acceptance figure in a train report, nested ones named by their path."""
    found = []
    for key, value in report.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            found += accept_numbers(value, name + ".")
        elif "accept" in name and isinstance(value, (int, float)) and not isinstance(value, bool):
            found.append((name, float(value)))
    return found


def print_summary(s: dict) -> None:
    hw = s["hardware"]
    lines = [
        f"preset       {s['preset']}",
        f"hardware     {hw.get('device_info', {}).get('device_name', hw['device'])} · "
        f"{hw['platform']} · python {hw['python']} · mlx {hw['mlx']}",
    ]
    if "target_reused" in s:
        lines.append(f"target       reused from {s['target_reused']}")
    else:
        lines += [
            f"corpus       {s['corpus']['files']} files, {s['corpus']['bytes'] / 1e6:.1f} MB, "
            f"{s['corpus']['licence']}",
            f"target       {s['target_steps']} steps, {s['target_tokens_per_second']:,.0f} "
            f"tok/s, val loss {s['val_loss_start']:.3f} → {s['val_loss_float']:.3f} "
            f"({s['settings']['bits']}-bit: {s['val_loss_quantized']:.3f})",
        ]
    for kind, d in s["drafters"].items():
        acc = ", ".join(f"{k} {v:.3g}" for k, v in accept_numbers(d["report"]))
        lines.append(f"{kind:<12} {d['mb']} MB {acc}")
    lines.append(
        "sizes MB     "
        + ", ".join(f"{k} {v}" for k, v in s["sizes_mb"].items())
        + f" · total {s['total_mb']} (limit {SIZE_LIMIT_MB})"
    )
    lines.append(
        "time s       "
        + ", ".join(f"{k} {v}" for k, v in s["seconds"].items())
        + f" · total {s['total_seconds']}"
    )
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
