"""Warm, interleaved, checked runs of every arm over the prompt suites.

An *arm* is one way of generating: an outrider mode (baseline, dspark, dflash, lookup, a
plugin's strategy) or an mlx-lm peer (its plain generation; its speculative decoding with a
draft model). All arms share one loaded target. Each arm is warmed up on every prompt; then
trials run prompt by prompt, every arm in turn on the same prompt, so drift on a shared machine
hits all arms alike, and a different arm goes first on each prompt, so no arm always runs
after the same one. Every run's greedy tokens are compared with baseline's first run of that
prompt: a difference fails the benchmark, unless it starts at a floating-point tie of the
target's own logits, which is recorded as such (bf16 models on GPUs; the tests use fp32
models).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from ..api import Pipeline, calibrate_first_use, load
from ..core.compiled_layers import bypassed
from ..core.device import tf32_matmuls
from ..core.errors import OutriderError
from ..core.plugins import Plugins
from ..core.target import Target
from ..loaders import load_drafter, load_target
from ..registry import find_pair
from ..registry.resolver import DRAFTER_MODES
from .peers import load_draft_model, mlx_lm_plain, mlx_lm_speculative
from .records import Cell, Run, TrialStats
from .suites import BenchPrompt, load_suite, read_user_prompts

WARMUP_TOKENS = 16
MLX_LM_DRAFT_DEFAULT = 2  # mlx-lm's own default number of draft tokens
TIE_ULPS = 8  # a divergence within this many units in the last place of the top logit is a tie
TIE_FLOOR = 1e-4  # ... and never tighter than this relative gap (fp32 reductions reorder too)


class LosslessError(OutriderError):
    """An arm's greedy tokens differ from plain decoding's, and not at a floating-point tie."""


@dataclass
class BenchConfig:
    model: str
    modes: list[str] | None = None  # None: baseline, each drafter mode with a drafter, lookup
    suites: list[str] = field(default_factory=lambda: ["chat", "code", "math"])
    trials: int = 3
    max_tokens: int = 128
    prompts_per_suite: int | None = None
    drafter: str | None = None  # goes to the mode of its own kind
    drafters: dict[str, str] = field(default_factory=dict)  # mode -> drafter, explicit
    peer_draft_model: str | None = None
    draft_model: str | None = None  # mode draft's model; also the mlx-lm-spec peer's by default
    lookup_drafts: bool | None = None  # False: drafter rounds never take a lookup copy
    lookup_long_draft: int | None = None  # the longest lookup copy a round verifies
    drafter_window: int | None = None  # context rows a block drafter sees (0: all)
    max_draft: int | str | None = None  # a cap, or "auto" (core/schedule.py)
    caps: list[int | str] = field(default_factory=list)  # one arm per cap, each drafting mode
    drafter_bits: int = 4
    thinking: bool | None = None
    prompt_files: list[str] = field(default_factory=list)  # each file is one more suite

    def check(self) -> None:
        if self.trials < 1:
            raise OutriderError(f"--trials must be >= 1, got {self.trials}")
        if self.max_tokens < 1:
            raise OutriderError(f"--max-tokens must be >= 1, got {self.max_tokens}")
        if self.prompts_per_suite is not None and self.prompts_per_suite < 1:
            raise OutriderError(f"--prompts-per-suite must be >= 1, got {self.prompts_per_suite}")
        if self.caps and self.max_draft is not None:
            raise OutriderError("--caps and --max-draft: pass one of them")
        if len(set(map(str, self.caps))) < len(self.caps):
            raise OutriderError(f"--caps names a cap twice: {self.caps}")
        for cap in [self.max_draft, *self.caps]:
            if cap is not None and cap not in ("auto", "full"):
                if not isinstance(cap, int) or cap < 1:
                    raise OutriderError(f"--max-draft must be >= 1, auto or full, got {cap!r}")


@dataclass
class Arm:
    name: str
    generate: Callable[[list[int], int], Run]
    kind: str = "outrider"  # or "peer"
    cap: int | None = None
    drafter: str | None = None
    calibration: dict | None = None  # the machine's costs the arm's `auto` policy read
    policy: Callable[[], dict | None] | None = None  # what its `auto` policy believes now
    notes: list[str] = field(default_factory=list)  # its load's warnings (`Pipeline.notes`)


@dataclass
class Report:
    model: dict
    arms: list[dict]
    suites: dict[str, int]
    cells: list[Cell]
    divergences: list[dict]
    checked: int
    outputs: dict[str, dict] = field(default_factory=dict)  # prompt -> its ids and plain tokens
    # arm -> [seconds since the first timed run began, decode tok/s] per timed run, in run order
    timeline: dict[str, list[list[float]]] = field(default_factory=dict)


# --- building the arms -------------------------------------------------------------------------


def _pipeline_arm(pipe: Pipeline, drafter: str | None, name: str | None = None) -> Arm:
    stop = set(pipe.target.eos_token_ids)

    def generate(prompt: list[int], max_tokens: int) -> Run:
        result = pipe.generate(prompt, max_tokens=max_tokens, stop_tokens=stop)
        return Run.from_result(result)

    def policy() -> dict | None:
        if pipe.cap_policy is None:
            return None
        out = pipe.cap_policy.snapshot()
        learnt = getattr(pipe.proposer, "snapshot", None)  # what the proposer learnt (Proposer)
        if learnt is not None:
            out.update(learnt())
        return out

    cap = "auto" if pipe.auto_cap else pipe.max_draft
    cal = pipe.calibration
    return Arm(
        name or pipe.mode, generate, "outrider", cap, drafter, cal.as_dict() if cal else None,
        policy, list(pipe.notes),
    )  # fmt: skip


def _assign_drafters(config: BenchConfig, plugins: Plugins, modes: list[str] | None) -> dict:
    """mode -> drafter: the per-mode flags, then --drafter for the mode of its kind."""
    drafters = dict(config.drafters)
    for mode in drafters:
        if modes is not None and mode not in modes:
            raise OutriderError(f"--{mode}-drafter is given, but --modes has no {mode}")
    if config.drafter is not None:
        kind = load_drafter(plugins, config.drafter).kind
        if modes is not None and kind not in modes:
            raise OutriderError(
                f"--drafter {config.drafter} is a {kind} drafter, but --modes has no {kind}"
            )
        if kind in drafters and drafters[kind] != config.drafter:
            raise OutriderError(f"--drafter and --{kind}-drafter both name a {kind} drafter")
        drafters[kind] = config.drafter
    return drafters


def _default_modes(model: str, drafters: dict) -> list[str]:
    pair = find_pair(model)
    have = set(drafters) | (set(pair.drafters) if pair else set())
    return ["baseline", *[m for m in DRAFTER_MODES if m in have], "lookup"]


def build_arms(config: BenchConfig, plugins: Plugins) -> tuple[Target, list[Arm]]:
    """Load the target once and put every requested mode and peer on it (baseline first)."""
    modes = config.modes
    if modes is not None:
        for mode in modes:
            if mode == "auto":
                raise OutriderError("--modes takes named modes (auto picks one; name it instead)")
            plugins.strategy(mode)  # an unknown mode fails before anything loads
    drafters = _assign_drafters(config, plugins, modes)
    modes = list(dict.fromkeys(["baseline", *(modes or _default_modes(config.model, drafters))]))
    modes = _with_draft_mode(modes, config, explicit=config.modes is not None)
    target = load_target(plugins, config.model)
    arms = []
    for mode in modes:
        caps = config.caps if config.caps and mode != "baseline" else [config.max_draft]
        for cap in caps:  # --caps: one arm each, named mode@cap
            pipe = load(
                config.model,
                drafters.get(mode),
                mode,
                max_draft=_arm_cap(mode, cap),
                drafter_bits=config.drafter_bits,
                plugins=plugins,
                target=target,
                draft_model=config.draft_model if mode == "draft" else None,
                lookup_drafts=config.lookup_drafts,
                drafter_window=config.drafter_window if mode in ("dspark", "dflash") else None,
                lookup_long_draft=config.lookup_long_draft,
            )
            calibrate_first_use(pipe)  # no cap given: what `generate` runs on this machine
            drafter = drafters.get(mode) or (pipe.pair.drafters.get(mode) if pipe.pair else None)
            own = drafter if pipe.drafter else pipe.options.get("draft_model_name")
            name = f"{mode}@{cap}" if len(caps) > 1 else None
            arms.append(_pipeline_arm(pipe, own, name))
    stop = set(target.eos_token_ids)
    model = target.model

    def plain_peer(p: list[int], n: int) -> Run:
        with bypassed(model):  # mlx-lm's own layers, not outrider's compiled ones
            return mlx_lm_plain(model, p, n, stop)

    arms.append(Arm("mlx-lm", plain_peer, "peer", 0, None))
    peer_draft_model = config.peer_draft_model or config.draft_model
    if peer_draft_model is not None:
        draft = load_draft_model(peer_draft_model, target.config.get("vocab_size"))
        k = config.max_draft if isinstance(config.max_draft, int) else MLX_LM_DRAFT_DEFAULT

        def speculative_peer(p: list[int], n: int) -> Run:
            with bypassed(model):
                return mlx_lm_speculative(model, draft, p, n, stop, k)

        arms.append(Arm("mlx-lm-spec", speculative_peer, "peer", k, peer_draft_model))
    return target, arms


def _with_draft_mode(modes: list[str], config: BenchConfig, explicit: bool) -> list[str]:
    """Mode draft runs when --draft-model names its model (and only then)."""
    if config.draft_model is None:
        if "draft" in modes:
            raise OutriderError("--modes has draft, but no --draft-model names its model")
        return modes
    if "draft" not in modes:
        if explicit:
            raise OutriderError("--draft-model is given, but --modes has no draft")
        modes = [*modes, "draft"]
    return modes


def _arm_cap(mode: str, max_draft: int | str | None) -> int | str | None:
    """The cap of an arm: baseline drafts nothing; mode draft defaults to the mlx-lm peer's
    cap, so the two draft-model arms compare at one cap."""
    if mode == "baseline":
        return None
    if mode == "draft" and max_draft is None:
        return MLX_LM_DRAFT_DEFAULT
    return max_draft


# --- the lossless check --------------------------------------------------------------------------

_MANTISSA_BITS = {mx.float32: 23, mx.float16: 10, mx.bfloat16: 7}
_TF32_BITS = 10  # MLX's CUDA backend runs float32 matmuls in TF32 (a 10-bit mantissa)


def _mantissa_bits(dtype: mx.Dtype) -> int:
    """The precision the logits were computed at: float32 on a CUDA GPU is TF32 in the
    matmuls (unless MLX_ENABLE_TF32=0), so a verify block and a single row round differently by
    ~1e-3, not ~1e-7."""
    bits = _MANTISSA_BITS.get(dtype, 7)
    return min(bits, _TF32_BITS) if tf32_matmuls() else bits


def fp_tie(target: Target, ids: list[int], a: int, b: int) -> tuple[bool, dict]:
    """Whether tokens a and b tie at the top of the target's logits after `ids`: both within a
    few units in the last place (of the logits' own dtype) of the largest logit."""
    with mx.stream(target.stream):
        logits, _ = target.forward(mx.array(ids, dtype=mx.uint32), target.make_cache())
        row = logits[-1]
        bits = _mantissa_bits(row.dtype)
        row = row.astype(mx.float32)
    la, lb, top = row[a].item(), row[b].item(), mx.max(row).item()
    tol = max(TIE_ULPS * 2.0**-bits, TIE_FLOOR) * max(abs(top), 1.0)
    tie = abs(la - lb) <= tol and min(la, lb) >= top - tol
    return tie, {"logit_expected": la, "logit_got": lb, "logit_max": top, "tolerance": tol}


def first_difference(got: list[int], want: list[int]) -> int | None:
    """The first position where two token lists differ (a length difference counts)."""
    for i, (x, y) in enumerate(zip(got, want)):
        if x != y:
            return i
    return None if len(got) == len(want) else min(len(got), len(want))


def check_lossless(
    target: Target, prompt: list[int], got: list[int], want: list[int], where: dict
) -> dict | None:
    """None when equal; a divergence record when they part at an fp tie; else LosslessError."""
    i = first_difference(got, want)
    if i is None:
        return None
    label = (
        f"mode {where['mode']}, suite {where['suite']}, prompt {where['prompt']} "
        f"(trial {where['trial'] + 1})"
    )
    if i >= len(got) or i >= len(want):
        raise LosslessError(
            f"lossless check failed: {label} generated {len(got)} tokens, baseline "
            f"{len(want)}; they agree on the first {i}"
        )
    tie, logits = fp_tie(target, prompt + want[:i], want[i], got[i])
    if not tie:
        raise LosslessError(
            f"lossless check failed: {label} gives token {got[i]} at position {i} where plain "
            f"decoding gives {want[i]} (logits {logits['logit_got']:.7g} vs "
            f"{logits['logit_expected']:.7g}, max {logits['logit_max']:.7g}, tie tolerance "
            f"{logits['tolerance']:.3g}: not a floating-point tie)"
        )
    return {**where, "position": i, "expected": want[i], "got": got[i], "kind": "fp-tie", **logits}


# --- running -------------------------------------------------------------------------------------


def model_facts(target: Target, name: str) -> dict:
    """What the receipt says about the target: id, family, dtype, quantisation."""
    cfg = target.config
    quant = cfg.get("quantization") or cfg.get("quantization_config")
    dtype = next(
        (
            str(v.dtype).removeprefix("mlx.core.")
            for k, v in tree_flatten(target.model.parameters())
            if mx.issubdtype(v.dtype, mx.floating) and not k.endswith((".scales", ".biases"))
        ),
        None,
    )
    return {
        "id": name,
        "model_type": cfg.get("model_type"),
        "family": target.family.name,
        "dtype": dtype,
        "quantization": (
            {k: quant[k] for k in ("bits", "group_size", "mode") if k in quant} if quant else None
        ),
    }


ProgressFn = Callable[[str, BenchPrompt, int], None]


def run_benchmark(
    config: BenchConfig, plugins: Plugins, progress: ProgressFn | None = None
) -> Report:
    """Load, warm up, run the trials with the lossless check on every run, and summarise."""
    config.check()
    suites = {s: load_suite(s, config.prompts_per_suite) for s in config.suites}
    for path in config.prompt_files:
        own = read_user_prompts(path, config.prompts_per_suite)
        if own[0].suite in suites:
            raise OutriderError(f"--prompts {path}: a suite named {own[0].suite!r} already runs")
        suites[own[0].suite] = own
    target, arms = build_arms(config, plugins)
    encode = _encoder(target, config.thinking)
    ids = {(p.suite, p.source, p.index): encode(p.text) for ps in suites.values() for p in ps}

    # Every arm starts every prompt once, untimed: MLX builds some kernels on first use of a
    # shape (on the H200, a prompt of a new length once stalled its first run ~15 s), and the
    # prefill widths and drafter context widths are the prompts' own.
    for prompt_ids in ids.values():
        for arm in arms:
            arm.generate(prompt_ids, min(WARMUP_TOKENS, config.max_tokens))

    runs: dict[tuple[str, str, int], list[Run]] = {}
    reference: dict[tuple, list[int]] = {}
    divergences: list[dict] = []
    checked = 0
    timeline: dict[str, list[list[float]]] = {arm.name: [] for arm in arms}
    policies: dict[str, dict[str, dict]] = {}
    t0 = time.perf_counter()
    # which arm goes first on the next prompt: each in turn, so that no arm always runs right
    # after the same other one (on a GPU, MLX's cached graphs and the clocks carry over)
    turn = 0
    for trial in range(config.trials):
        for suite, prompts in suites.items():
            for p in prompts:
                key = (p.suite, p.source, p.index)
                done: dict[int, Run] = {}
                for i in [*range(turn, len(arms)), *range(turn)]:
                    if progress is not None:
                        progress(arms[i].name, p, trial)
                    start = time.perf_counter() - t0
                    run = done[i] = arms[i].generate(ids[key], config.max_tokens)
                    tps = run.decode_tokens / run.decode_s if run.decode_s > 0 else 0.0
                    timeline[arms[i].name].append([round(start, 4), round(tps, 2)])
                turn = (turn + 1) % len(arms)
                reference.setdefault(key, done[0].tokens)  # baseline's (arms[0]) first run
                for i, arm in enumerate(arms):
                    where = {
                        "mode": arm.name,
                        "suite": suite,
                        "prompt": f"{p.source}#{p.index}",
                        "trial": trial,
                    }
                    tie = check_lossless(target, ids[key], done[i].tokens, reference[key], where)
                    checked += 1
                    if tie is not None:
                        divergences.append(tie)
                    runs.setdefault((suite, arm.name, trial), []).append(done[i])
            for arm in arms:  # where each arm's `auto` stood after this suite
                state = arm.policy() if arm.policy is not None else None
                if state is not None:
                    policies.setdefault(arm.name, {})[f"{suite}#{trial + 1}"] = state

    cells = []
    for suite in suites:
        base = None
        for arm in arms:
            trials = [TrialStats.of(runs[(suite, arm.name, t)]) for t in range(config.trials)]
            cell = Cell(suite, arm.name, trials)
            if arm.name == "baseline":
                base = cell.decode_tps
            cell.speedup = cell.decode_tps / base if base else None
            cells.append(cell)
    return Report(
        model=model_facts(target, config.model),
        arms=[
            {
                "mode": a.name,
                "kind": a.kind,
                "cap": a.cap,
                "drafter": a.drafter,
                "calibration": a.calibration,
                "policy": policies.get(a.name),  # suite#trial -> what `auto` believed then
                "notes": a.notes,  # the load's warnings: a cap lowered, a flag ignored
            }
            for a in arms
        ],
        suites={s: len(ps) for s, ps in suites.items()},
        cells=cells,
        divergences=divergences,
        checked=checked,
        outputs={f"{k[0]}/{k[1]}#{k[2]}": {"prompt": ids[k], "tokens": reference[k]} for k in ids},
        timeline=timeline,
    )


def _encoder(target: Target, thinking: bool | None) -> Callable[[str], list[int]]:
    from ..prompts import encode_prompt

    def encode(text: str) -> list[int]:
        return encode_prompt(target.tokenizer, text, thinking=thinking)

    return encode


def summary(report: Report) -> dict[str, Any]:
    """The lossless check's tally (a run that fails the check raises before any report)."""
    return {
        "runs_checked": report.checked,
        "identical": report.checked - len(report.divergences),
        "fp_ties": report.divergences,
    }
