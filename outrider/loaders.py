"""What to load for a model and a drafter: the format plugin that reads a drafter checkpoint,
the family plugin that loads a target, whether the two fit, and which mode `auto` means."""

from __future__ import annotations

from pathlib import Path

from .core import compiled_layers, generation_config, gguf, gguf_header, row_kernels
from .core.checkpoint import code_it_runs, open_checkpoint, read_config
from .core.cpu_fusion import fuse_for_cpu
from .core.device import (
    PADDED_FROM,
    dense_on_cpu,
    dense_single_groups,
    make_dense,
    matmul_choice,
    verify_pad,
)
from .core.drafter_spec import DrafterSpec
from .core.errors import (
    CheckpointError,
    FamilyDeclined,
    ModelNotFoundError,
    OutriderError,
    UnsupportedTargetError,
)
from .core.hub import resolve_model
from .core.plugins import Plugins
from .core.target import Target
from .registry import Pair, find_pair

LONGEST_COPY = 256  # --lookup-long-draft at most: one verify of this many rows


def detect_format(plugins: Plugins, path: Path):
    if gguf_header.is_gguf(path):  # a DSpark GGUF: converted once into DeepSpec's layout (cached)
        from .core.gguf_drafter import converted_drafter

        path = converted_drafter(path)[0]
    ckpt = open_checkpoint(path)
    for fmt in plugins.formats.values():
        if fmt.detect(ckpt.config):
            return fmt, ckpt
    archs = ckpt.config.get("architectures")
    causal_lm = _plain_causal_lm(ckpt.config)
    if causal_lm is not None:
        raise CheckpointError(
            f"{path} is a plain causal LM ({causal_lm}), not a drafter checkpoint: a small "
            "model with the target's tokenizer drafts in draft mode, --mode draft "
            f"--draft-model {path}"
        )
    raise CheckpointError(
        f"no drafter format recognises {path} (architectures {archs!r}); installed formats: "
        + ", ".join(sorted(plugins.formats))
    )


# Config keys that mark a checkpoint as some speculative drafter, never a plain causal LM.
_DRAFTER_KEYS = (
    "draft_vocab_size", "dflash_config", "eagle_config", "speculators_config", "block_size",
    "target_layer_ids", "target_hidden_size", "speculators_model_type",
)  # fmt: skip


def _plain_causal_lm(config: dict) -> str | None:
    """The architecture of a config mlx-lm can load as a causal LM and that has no drafter
    fields (such a model drafts in mode draft, not as a --drafter), else None."""
    import importlib.util

    archs = [str(a) for a in config.get("architectures") or []]
    mtype = config.get("model_type")
    if not mtype or any(k in config for k in _DRAFTER_KEYS):
        return None
    if not any(a.endswith("ForCausalLM") for a in archs):
        return None
    from mlx_lm.utils import MODEL_REMAPPING

    mtype = MODEL_REMAPPING.get(mtype, mtype)
    try:
        known = importlib.util.find_spec(f"mlx_lm.models.{mtype}") is not None
    except (ImportError, ValueError):
        known = False
    return archs[0] if known else None


def load_drafter(plugins: Plugins, drafter: str, download: bool = True) -> DrafterSpec:
    """Read a drafter checkpoint through the format plugin that claims it."""
    fmt, ckpt = detect_format(plugins, resolve_model(drafter, "drafter", download))
    return fmt.translate(ckpt)


def load_target(plugins: Plugins, model: str, download: bool = True) -> Target:
    path = resolve_model(model, "model", download)
    if gguf_header.is_gguf(path) and gguf_header.read_header(path).arch == "dspark":
        raise CheckpointError(f"{model} is a DSpark drafter GGUF; pass it as --drafter")
    config = gguf.read_config(path) if gguf_header.is_gguf(path) else read_config(path)
    if (runs := code_it_runs(config)) is not None:
        raise CheckpointError(f"{model} is refused: {runs}")
    archs = [str(a) for a in config.get("architectures") or []]
    if any(
        a.endswith(("DSparkModel", "DraftModel", "Speculator", "Eagle3Model", "Eagle3"))
        for a in archs
    ):
        raise CheckpointError(f"{model} is a drafter checkpoint ({archs[0]}); pass it as --drafter")
    declined = None
    for family in sorted(plugins.families.values(), key=lambda f: -getattr(f, "priority", 0)):
        if family.supports(config):
            try:
                model_obj, tokenizer = family.load(path, config)
            except FamilyDeclined as e:
                declined = declined or e  # a later family (the mlx-lm fallback) may take it
                continue
            except OutriderError:
                raise
            except Exception as e:
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise CheckpointError(f"could not load model {model}: {first}") from e
            if dense_on_cpu(model_obj):
                make_dense(model_obj)
            dense_single_groups(model_obj)  # an MLX CUDA kernel's wrong case (core/device.py)
            rows = row_kernels.apply(model_obj, plugins.kernels.values(), matmul_choice())
            fuse_for_cpu(model_obj)  # MLX's CPU backend runs norms and ropes unfused
            # last: the traces take in the modules swapped above (core/compiled_layers.py)
            compiled_layers.install(model_obj, family)
            target = Target(model_obj, tokenizer, family, config, name=model)
            target.sampling_defaults, target.notes = generation_config.read(path)
            target.notes += [rows] if rows else []
            if target.pads_verify:
                target.pad_verifies(verify_pad(model_obj), PADDED_FROM)  # until a calibration says
            return target
    if declined is not None:
        raise declined
    mtype = config.get("model_type") or (config.get("text_config") or {}).get("model_type")
    raise UnsupportedTargetError(
        f"model_type {mtype!r} is not supported by any installed target-family plugin "
        f"(installed: {', '.join(sorted(plugins.families))}); --mode lookup and --mode baseline "
        "work on any model mlx-lm can load"
    )


def check_pair(target: Target, spec: DrafterSpec) -> None:
    if spec.hidden_size != target.hidden_size:
        raise OutriderError(
            f"drafter hidden size {spec.hidden_size} does not match the target's "
            f"{target.hidden_size}: this drafter was made for another model"
        )
    vocab = target.config.get("vocab_size") or (target.config.get("text_config") or {}).get(
        "vocab_size"
    )
    if spec.own_lm_head and vocab and spec.vocab_size != vocab:
        raise OutriderError(
            f"drafter vocabulary ({spec.vocab_size}) differs from the target's ({vocab})"
        )
    owned = (("embedding", spec.own_embedding), ("head", spec.own_lm_head))
    shared = [name for name, own in owned if not own]
    if shared and vocab:  # the drafter reads and writes the target's token ids directly
        uses = f"the target's {' and '.join(shared)}"
        if spec.vocab_size != vocab:
            raise OutriderError(
                f"drafter uses {uses} but was made for a vocabulary of {spec.vocab_size} "
                f"tokens; the target's has {vocab}"
            )
        if not 0 <= spec.mask_token_id < vocab:
            raise OutriderError(
                f"drafter uses {uses} but its mask_token_id {spec.mask_token_id} is outside "
                f"the target's vocabulary of {vocab}"
            )


def resolve_mode(
    plugins: Plugins,
    model: str,
    mode: str,
    drafter: str | None,
    registry: list[Pair] | None = None,
) -> tuple[str, str | None, Pair | None]:
    """(mode, drafter, registry row): auto takes an explicit drafter's kind, else the row's mode,
    else drafter-free lookup (`load` falls back further when the row's drafter cannot be had).
    `registry` replaces the shipped rows (tests, a contributor's draft)."""
    pair = find_pair(model, registry)
    if mode == "auto":
        if drafter is not None:
            return "auto-drafter", drafter, pair
        if pair and pair.mode in plugins.strategies and pair.drafters.get(pair.mode):
            return pair.mode, pair.drafters[pair.mode], pair
        return "lookup", None, pair
    strategy = plugins.strategy(mode)
    if strategy.needs_drafter and drafter is None:
        if pair and pair.drafters.get(mode):
            drafter = pair.drafters[mode]
        else:
            raise OutriderError(
                f"--mode {mode} needs a drafter: pass --drafter (no registry pair names a "
                f"{mode} drafter for {model}), or use --mode lookup"
            )
    return mode, drafter, pair


def draft_mode(mode: str, drafter: str | None, draft_model: str | None) -> str:
    """The mode a --draft-model asks for (draft; auto becomes draft), refusing mixed flags."""
    if draft_model is None:
        if mode == "draft":
            raise OutriderError(
                "--mode draft needs a draft model: pass --draft-model M (a small mlx-lm model "
                "with the target's tokenizer)"
            )
        return mode
    if mode not in ("auto", "draft"):
        raise OutriderError(f"--draft-model drafts in --mode draft, not --mode {mode}")
    if drafter is not None:
        raise OutriderError(
            "--drafter and --draft-model both given: --drafter takes a drafter checkpoint, "
            "--draft-model a small causal LM (mode draft); pass one"
        )
    return "draft"


def auto_drafter(
    plugins: Plugins, pair: Pair, download: bool, notes: list[str]
) -> tuple[str, str | None, DrafterSpec | None]:
    """(mode, drafter, spec) for --mode auto on a registry row: the row's mode, else the first
    other drafter mode the row names whose strategy is installed and whose drafter loads, else
    lookup. A fallback adds one line to `notes` saying which and why."""
    if pair.mode not in pair.drafters:  # a drafter-free row
        return ("baseline" if pair.mode == "baseline" else "lookup"), None, None
    why: list[str] = []
    for mode in [pair.mode, *(m for m in pair.drafters if m != pair.mode)]:
        repo = pair.drafters[mode]
        if mode not in plugins.strategies:
            why.append(f"{mode}: no {mode} strategy is installed")
            continue
        try:
            spec = load_drafter(plugins, repo, download)
        except (ModelNotFoundError, CheckpointError) as e:
            why.append(f"{mode}: {repo}: {e}")
            continue
        if why:
            notes.append(f"--mode auto runs {mode} ({repo}) for {pair.id}: " + "; ".join(why))
        return mode, repo, spec
    notes.append(f"--mode auto runs lookup for {pair.id}: " + "; ".join(why))
    return "lookup", None, None


def check_options(
    max_draft: int | str | None,
    num_draft_tokens: int | None,
    drafter_bits: int,
    lookup_long_draft: int | None,
    confidence_threshold: float | None,
    drafter_window: int | None,
    kv_bits: int | None,
) -> int | str | None:
    """Refuse a loading option out of its range, each with a message naming its flag, before
    anything loads; returns the cap asked for (`--num-draft-tokens` is mlx-lm's name for it)."""
    if drafter_bits not in (4, 8, 16):
        raise OutriderError(f"--drafter-bits must be 16, 8 or 4, got {drafter_bits}")
    if num_draft_tokens is not None:
        if max_draft not in (None, num_draft_tokens):
            raise OutriderError("--num-draft-tokens and --max-draft disagree; pass one of them")
        max_draft = num_draft_tokens
    if max_draft not in (None, "auto", "full") and (
        isinstance(max_draft, bool) or not isinstance(max_draft, int) or max_draft < 0
    ):
        raise OutriderError(f"--max-draft must be >= 0, auto or full, got {max_draft!r}")
    if lookup_long_draft is not None and not 1 <= lookup_long_draft <= LONGEST_COPY:
        raise OutriderError(
            f"--lookup-long-draft must be in 1..{LONGEST_COPY}, got {lookup_long_draft}"
        )
    if confidence_threshold is not None and not 0.0 <= confidence_threshold <= 1.0:
        raise OutriderError(f"--confidence-threshold must be in [0, 1], got {confidence_threshold}")
    if drafter_window is not None and (
        isinstance(drafter_window, bool)
        or not isinstance(drafter_window, int)
        or drafter_window < 0
    ):
        raise OutriderError(
            f"--drafter-window must be >= 0 (0: the whole context), got {drafter_window!r}"
        )
    if kv_bits not in (None, 4, 8):
        raise OutriderError(f"--kv-bits must be 8 or 4, got {kv_bits}")
    return max_draft
