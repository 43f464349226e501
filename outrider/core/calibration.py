"""Calibration: what a round costs on this machine, measured once and kept.

`--max-draft auto` picks each round's cap from the cost of a round at each cap and the running
acceptance (`core/schedule.py`). Live rounds measure the costs too, but only at the caps they
run, and only after a few warm-up rounds; a calibration measures them all up front:

- the verify forward t(w) of w = 1..`max_width` rows, at a few context lengths (a forward's cost
  grows with the context it attends to), with the taps the drafter reads;
- one drafter call at its full cap (what a drafting round adds to the verify);
- a plain decoding step as decoding runs it (pipelined: the next forward is queued before the
  current token is read), which is what a drafting round competes with;
- which attention path `auto` takes here.

The curve also says where a narrower verify is cheaper run wider (`padding`): on MLX's CUDA
backend a quantized target's 8-row forward costs less than a 5-row one (about two one-row
forwards against three on the H200). A target whose rollback is a trim then runs those widths
padded (`Target.forward`), and the cost `auto` reads for them is the padded width's.

A calibration is a small JSON file under outrider's cache folder, keyed by device, MLX version,
target, drafter and mode, so every later run (generate, benchmark, the server) on this machine
starts from it. `outrider calibrate` measures one explicitly; `outrider doctor` lists them.
Nothing here changes which token is committed: a cap only decides how many drafts are checked.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import mlx.core as mx

from . import blas, cuda_graphs
from .cpu_fusion import cpu_fusion
from .device import computes_on_host, on_cuda_gpu
from .env import env_choice
from .paths import cache_root
from .proposer import DraftContext
from .sampling import SamplingParams
from .wrapper import routes

CONTEXTS = (128, 1024)  # context lengths the verify curve is measured at (capped by the window)
MAX_WIDTH = 16
REPEATS = 3  # timed passes over the widths at least
MAX_REPEATS = 15  # and at most, as many as fit PASS_BUDGET
PASS_BUDGET = 0.5  # seconds of timed passes per context length, where a pass is cheap
PLAIN_STEPS = 8  # pipelined plain steps timed together at each context
PAD_GAIN = 0.9  # a wider forward is worth padding to when it costs under this share
PAD_PROBE_WIDTH = 8  # on a GPU, inline calibrations of a padding target measure this wide
# An inline calibration (a first run's) estimated to take longer than this many seconds is
# measured quick: at QUICK_WIDTHS, the widths between on a line, and where that is still too
# long at the first context alone (each further context costs a prefill of its length). With
# MLX's reference BLAS on 2 CPU cores SmolLM2-135M's whole one took 286 s (a one-row forward
# 153 ms, sixteen rows 1,957, a 1,152-token prefill 125); where rows cost that much the curve
# is close to a line. A GPU's curve (with steps) is measured whole, in seconds (`calibrated`).
INLINE_SECONDS = 20.0
QUICK_WIDTHS = (1, 2, 3, 4, 6, 8, 12, 16)
# 2: pipelined plain steps measured (`plain_ms`); 3: the drafter timed at one draft and at its
# full cap (`draft_ms`, `draft_ms_per_token`); 4: half-precision targets on CUDA verify with
# rerouted attention (plugins/targets/verify_attention.py), so curves measured on MLX's own
# path no longer describe them; 5: Gemma-4's too (the same file's SharedKVAttention). Since 5
# the key also names the routes the target's wrappers take (`core/wrapper.py`, `routes`), so a
# family that newly reroutes, or a probe that declines where it accepted, measures again by
# itself; the version moves when a route's own arithmetic changes. 6: half-precision verify
# rows of 3 or more take bucketed attention (the same file; OUTRIDER_ATTENTION_BUCKETS).
# 7: every context is timed in every pass (`measure`), not one context after the other.
# 8: a drafter without taps that drafts on the device (mode draft's small model) is timed; it
# was taken as free, as lookup's host drafts are.
VERSION = 8


FIRST_USE_ENV = "OUTRIDER_CALIBRATE"


def on_first_use() -> bool:
    """OUTRIDER_CALIBRATE: `auto` (the default) lets `generate`, `serve` and `benchmark`
    measure a calibration where none is kept and no cap is given (`api.calibrate_first_use`);
    `off` leaves them at the registry's fixed cap until `outrider calibrate` has run (the test
    suite's setting: most tests check a fixed cap's accounting)."""
    return env_choice(FIRST_USE_ENV, ("auto", "off")) == "auto"


@dataclass
class Calibration:
    key: dict[str, str]
    verify_ms: dict[int, list[float]]  # context length -> t(w) for w = 1..len, milliseconds
    draft_ms: float = 0.0  # one drafter call that drafts one token
    # what each further draft adds to the call: a chain drafter (EAGLE-3) runs its layer once a
    # draft, a DSpark head steps once a slot; a block drafter's backbone call is the fixed part
    draft_ms_per_token: float = 0.0
    # context length -> one plain step as decoding runs it (the next forward queued before the
    # current token is read), milliseconds; empty: a one-row forward's verify cost stands in
    plain_ms: dict[int, float] = field(default_factory=dict)
    attention: str = "native"
    seconds: float = 0.0  # how long measuring took
    # measured quick (INLINE_SECONDS): at QUICK_WIDTHS, maybe one context; `outrider calibrate`
    # measures the whole curve
    quick: bool = False
    created: str = ""
    version: int = VERSION
    path: Path | None = field(default=None, compare=False)
    # the width each verify width runs at, when the target pads (`padding`); not stored
    widths: dict[int, int] = field(default_factory=dict, compare=False)

    def verify_cost(self, width: int, context: int | None = None) -> float:
        """Seconds of a verify forward of `width` rows at `context`, run at the width it
        pads to (`widths`)."""
        return self._cost(self.widths.get(width, width), context)

    def padding(self) -> dict[int, int]:
        """Verify widths n >= 2 worth running padded: n -> the measured width v > n whose
        forward costs least, where it costs under PAD_GAIN of n's own (summed over the
        measured contexts, so that one noisy point cannot decide it)."""
        curves = list(self.verify_ms.values())
        widest = min(len(c) for c in curves)
        total = [sum(c[w] for c in curves) for w in range(widest)]
        out = {}
        for n in range(2, widest + 1):
            v = min(range(n, widest + 1), key=lambda v: (total[v - 1], v))
            if v != n and total[v - 1] < PAD_GAIN * total[n - 1]:
                out[n] = v
        return out

    def pad(self, target: Any) -> None:
        """Run `target`'s verify forwards at the widths this curve says cost less, where it
        may pad (`Target.pads_verify`); `verify_cost` then reads the padded widths' costs.
        A target shared by several pipelines (a benchmark's arms) keeps the padding of the
        first calibration applied to it, and later ones read their costs at those widths: two
        measurements of one target's curve can differ by noise, and the target runs one."""
        if not target.pads_verify:
            return
        if not target.widths_calibrated:
            target.verify_widths, target.widths_calibrated = self.padding(), True
        self.widths = dict(target.verify_widths)

    def _cost(self, width: int, context: int | None = None) -> float:
        """Seconds of a forward of `width` rows as measured."""
        width = max(1, min(width, len(self.verify_ms[min(self.verify_ms)])))
        return _at_context({c: v[width - 1] for c, v in self.verify_ms.items()}, context) / 1000

    def plain_cost(self, context: int | None = None) -> float:
        """Seconds of one plain decoding step, pipelined as decoding runs it."""
        if not self.plain_ms:
            return self._cost(1, context)
        return _at_context(self.plain_ms, context) / 1000

    def batch_verify_cost(self, rows: int, width: int, context: int | None = None) -> float:
        """Seconds of a batched verify of `rows` rows padded to `width`, read off the one-row
        curve at rows x width tokens (the forward's work is its token count; past the widest
        measured width, on the line through the upper half of the curve: the last two points
        alone differ by noise, or by a kernel's tile boundary, and a batch of eight reads the
        line up to eight times past them)."""
        tokens = rows * width
        ctxs = sorted(self.verify_ms)
        widest = len(self.verify_ms[ctxs[0]])
        if tokens <= widest:  # a batch's forward is not padded: the curve as measured
            return self._cost(tokens, context)
        last = self._cost(widest, context)
        half = max(1, widest // 2)
        slope = (last - self._cost(half, context)) / (widest - half) if widest > 1 else last
        return last + max(slope, 0.0) * (tokens - widest)

    def round_cost(self, k: int, context: int | None = None) -> float:
        """Seconds of a round that drafts k tokens (k = 0: a plain step, as decoding runs it:
        on a GPU the host queues the next step while the device works, so it costs less than
        a one-row verify, which waits for its result)."""
        if k == 0:
            return self.plain_cost(context)
        return self.draft_cost(k) + self.verify_cost(k + 1, context)

    def draft_cost(self, k: int) -> float:
        """Seconds of the drafter's call when it drafts k >= 1 tokens."""
        return (self.draft_ms + self.draft_ms_per_token * max(0, k - 1)) / 1000

    def measured_note(self) -> str:
        """What measuring it took and where it is kept, said once where a run measured it."""
        where = f", kept in {self.path}" if self.path else ""
        quick = (
            " (quick: a slow machine; `outrider calibrate` measures the whole curve)"
            if self.quick
            else ""
        )
        return (
            f"measured this machine's costs in {self.seconds:.1f} s{quick}{where}; "
            "--max-draft auto picks each round's cap from them"
        )

    def summary(self) -> dict[str, Any]:
        """What a result reports: where it is kept, when it was made, the curve's shape."""
        ctx = min(self.verify_ms)
        curve = self.verify_ms[ctx]
        return {
            "file": str(self.path) if self.path else None,
            "created": self.created,
            "quick": self.quick,
            "context": ctx,
            "verify_ms_w1": curve[0],
            "verify_ms_wmax": curve[-1],
            "max_width": len(curve),
            "draft_ms": self.draft_ms,
            "plain_ms": self.plain_ms.get(ctx),
            "padding": {str(n): v for n, v in sorted(self.widths.items())},
        }

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("path")
        out.pop("widths")
        out["verify_ms"] = {str(c): v for c, v in self.verify_ms.items()}
        out["plain_ms"] = {str(c): v for c, v in self.plain_ms.items()}
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Calibration:
        verify = {int(c): [float(x) for x in v] for c, v in data["verify_ms"].items()}
        if not verify or any(not v for v in verify.values()):
            raise ValueError("a calibration without a verify curve")
        return cls(
            key=dict(data["key"]),
            verify_ms=verify,
            draft_ms=float(data.get("draft_ms", 0.0)),
            draft_ms_per_token=float(data.get("draft_ms_per_token", 0.0)),
            plain_ms={int(c): float(v) for c, v in data.get("plain_ms", {}).items()},
            attention=str(data.get("attention", "native")),
            seconds=float(data.get("seconds", 0.0)),
            quick=bool(data.get("quick", False)),
            created=str(data.get("created", "")),
            version=int(data.get("version", 0)),
        )


def calibration_key(pipe: Any) -> dict[str, str]:
    """What a calibration is valid for: this device and MLX, this target, drafter and mode, the
    routes its forward takes (split attention where the probe kept it), and on the CPU the BLAS
    MLX multiplies with (core/blas.py), named only where it is not MLX's own, and whether norms
    and ropes run fused there (core/cpu_fusion.py), named only where they do.

    The BLAS changes what a verify costs most of all: with MLX's reference BLAS a 5-row verify
    of the demo target cost 2.8 one-row forwards on a 2-core CPU, with OpenBLAS about one. A
    curve timed before OpenBLAS was installed kept `--max-draft auto` parked where cap 4 ran
    1.89x plain decoding. Likewise on CUDA with MLX's graphs off (`outrider serve` batching):
    the demo target's plain step took 2.1 ms there against 1.0 with them on."""
    key = {
        "device": str(mx.default_device()),
        "device_name": _device_name(),
        "mlx": mx.__version__,
        "target": str(pipe.target.name or ""),
        "drafter": str(pipe.drafter_ref or ""),
        "mode": str(pipe.mode),
        "kv_bits": str(getattr(pipe.target, "kv_bits", None) or ""),
        "routes": routes(pipe.target.model),
    }
    cpu_blas = blas.state().path if mx.default_device() == mx.cpu else None
    if cpu_blas:  # keys timed on MLX's own stay valid
        key["cpu_blas"] = cpu_blas
    if cpu_fusion():  # norms and ropes fused on the CPU (core/cpu_fusion.py): cheaper forwards
        key["cpu_fusion"] = "on"
    if on_cuda_gpu() and cuda_graphs.state() == "off":  # a batching server's (core/cuda_graphs.py)
        key["cuda_graphs"] = "off"
    return key


def _device_name() -> str:
    try:
        info = mx.device_info()
    except Exception:  # older MLX, or a backend without it
        return ""
    return str(info.get("device_name") or info.get("architecture") or "")


def path_for(key: dict[str, str], root: Path | None = None) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    return (root or cache_root()) / "calibration" / f"{digest}.json"


def needed_width(pipe: Any) -> int:
    """The widest verify this pipeline's `auto` rounds run: its drafter's full cap and the
    anchor (up to MAX_WIDTH)."""
    return max(1, min(MAX_WIDTH, pipe.proposer.max_draft + 1))


def load(pipe: Any, root: Path | None = None) -> Calibration | None:
    """The stored calibration of this pipeline on this machine, if there is a valid one: its
    key and version match, and its curve reaches every width the pipeline verifies (`outrider
    calibrate --max-width 4` for a drafter of 8 stored a curve that priced every round of 5 to
    9 rows at 4, so `auto` took its widest caps for cheap; such a curve is measured again)."""
    key = calibration_key(pipe)
    path = path_for(key, root)
    try:
        cal = Calibration.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if cal.key != key or cal.version != VERSION:
        return None
    if min(len(v) for v in cal.verify_ms.values()) < needed_width(pipe):
        return None
    cal.path = path
    return cal


def save(cal: Calibration, root: Path | None = None) -> Path | None:
    """Write it atomically; a cache folder that cannot be written is not an error."""
    path = path_for(cal.key, root)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(cal.as_dict(), indent=2) + "\n")
        tmp.replace(path)
    except OSError:
        return None
    cal.path = path
    return path


def _at_context(points: dict[int, float], context: int | None) -> float:
    """A value measured at a few context lengths, read at `context`: linear between them,
    the nearest one outside them."""
    ctxs = sorted(points)
    if context is None or context <= ctxs[0]:
        return points[ctxs[0]]
    if context >= ctxs[-1]:
        return points[ctxs[-1]]
    hi = next(c for c in ctxs if c >= context)
    lo = ctxs[ctxs.index(hi) - 1]
    return points[lo] + (context - lo) / (hi - lo) * (points[hi] - points[lo])


def stored(root: Path | None = None) -> list[Calibration]:
    """Every valid calibration in the cache folder (for `outrider doctor`): one of an older
    VERSION is measured again on its next use, so it is not counted."""
    out = []
    for path in sorted(((root or cache_root()) / "calibration").glob("*.json")):
        try:
            cal = Calibration.from_dict(json.loads(path.read_text()))
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if cal.version != VERSION:
            continue
        cal.path = path
        out.append(cal)
    return out


def _timed(fn, repeats: int) -> float:
    """Median seconds of `fn` (evaluated), after one untimed call."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(
    pipe: Any,
    contexts: tuple[int, ...] = CONTEXTS,
    max_width: int = MAX_WIDTH,
    repeats: int = REPEATS,
    progress: Any = None,
    within: float | None = None,
) -> Calibration:
    """Measure this pipeline's verify curve and drafter cost now (seconds on a GPU). With
    `within` (seconds), a measurement estimated to take longer is made quick (`Calibration.quick`:
    INLINE_SECONDS says why)."""
    t_start = time.perf_counter()
    target, proposer = pipe.target, pipe.proposer
    vocab = int(target.config.get("vocab_size") or 256)
    window = target.context_window
    tap_ids = tuple(proposer.tap_layer_ids)
    ctxs = sorted({min(c, window - max_width - 1) if window else c for c in contexts})
    ctxs = [c for c in ctxs if c > 1] or [2]
    widths_timed = list(range(1, max_width + 1))
    quick = False
    verify: dict[int, list[float]] = {}
    plain: dict[int, float] = {}
    widths, target.verify_widths = target.verify_widths, {}  # the curve as MLX runs it
    try:
        with mx.stream(target.stream):
            runs = []  # per context: the widths, then the plain steps
            for i, context in enumerate(list(ctxs)):
                if i >= len(ctxs):  # measured quick: the first context alone
                    break
                ids = mx.random.randint(1, vocab, (context + max_width,), key=mx.random.key(i))
                prompt = ids[:context].tolist()
                cache = target.make_cache()
                t_prefill = time.perf_counter()
                target.prefill(prompt, cache, tap_ids)
                mx.eval([c.state for c in cache])
                if i == 0 and within is not None:
                    block = ids[context:]
                    one, widest = (
                        _timed(partial(_verify, target, cache, block[:w], tap_ids), 1)
                        for w in (1, max_width)
                    )
                    prefill_rate = (time.perf_counter() - t_prefill) / context  # a bound
                    spent, planned = time.perf_counter() - t_start, (widths_timed, ctxs)
                    widths_timed, ctxs = _plan(
                        planned, within - spent, one, widest, prefill_rate, repeats
                    )
                    quick = (widths_timed, ctxs) != planned
                runs += [partial(_verify, target, cache, ids[context : context + w], tap_ids)
                         for w in widths_timed]  # fmt: skip
                first = ids[context : context + 1].astype(mx.uint32)
                runs.append(partial(_plain_steps, target, cache, first, tap_ids))
            # every context in every pass: timed one context after the other, a slow minute
            # of the machine reads as a context's cost (likely why the demo target's plain
            # step measured 1.62 ms at 1024 tokens on an H200, against 0.97 at 128 and 1.17
            # at 4079)
            timed = _interleaved(runs, repeats, PASS_BUDGET * len(ctxs), progress)
            n = len(widths_timed) + 1
            for i, context in enumerate(ctxs):
                part = timed[i * n : (i + 1) * n]
                verify[context] = _on_lines(dict(zip(widths_timed, part[:-1])), max_width)
                plain[context] = round(part[-1] / PLAIN_STEPS, 4)
    finally:
        target.verify_widths = widths
    with mx.stream(target.stream):
        draft_ms, per_token = _draft_ms(pipe, vocab, repeats)
    key = calibration_key(pipe)
    return Calibration(
        key=key,
        verify_ms=verify,
        draft_ms=draft_ms,
        draft_ms_per_token=per_token,
        plain_ms=plain,
        attention="split" if "split" in key["routes"].split(",") else "native",
        seconds=round(time.perf_counter() - t_start, 3),
        quick=quick,
        created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    )


def _plan(
    whole: tuple[list[int], list[int]],
    seconds: float,
    one: float,
    widest: float,
    prefill_rate: float,
    repeats: int,
) -> tuple[list[int], list[int]]:
    """The widths and contexts to time within `seconds`: all of them (`whole`) where their
    estimate fits, else QUICK_WIDTHS at every context, else those at the first alone."""
    widths, ctxs = whole
    sparse = sorted({w for w in QUICK_WIDTHS if w <= max(widths)} | {max(widths)})
    plans = [whole, (sparse, ctxs), (sparse, ctxs[:1])]
    for at, cs in plans:
        left = _estimate(one, widest, at, repeats, len(cs)) + prefill_rate * sum(cs[1:])
        if left <= seconds:
            return at, cs
    return plans[-1]


def _estimate(one: float, widest: float, widths: list[int], repeats: int, contexts: int) -> float:
    """Seconds the passes over `widths` at `contexts` context lengths should take, from one
    verify forward of one row and one of the widest (a line between them; a plain step as a
    one-row forward)."""
    top = max(widths)
    slope = (widest - one) / (top - 1) if top > 1 else 0.0
    a_pass = sum(one + slope * (w - 1) for w in widths) + one * PLAIN_STEPS
    return a_pass * (repeats + 1) * contexts  # the untimed pass too


def _on_lines(points: dict[int, float], max_width: int) -> list[float]:
    """Milliseconds at every width 1..max_width from those measured, linear between them."""
    known = sorted(points)
    out = []
    for w in range(1, max_width + 1):
        if w in points:
            out.append(points[w])
            continue
        hi = next(k for k in known if k > w)
        lo = known[known.index(hi) - 1]
        out.append(round(points[lo] + (w - lo) / (hi - lo) * (points[hi] - points[lo]), 4))
    return out


def _verify(target: Any, cache: list, block: mx.array, tap_ids: tuple[int, ...]) -> None:
    """One verify forward of `block` (evaluated), rolled back."""
    logits, taps = target.forward(block.astype(mx.uint32), cache, tap_ids)
    mx.eval(logits, *([] if taps is None else [taps]))
    target.rollback(cache, block.shape[0])


def _interleaved(
    runs: list, repeats: int, budget: float = PASS_BUDGET, progress: Any = None
) -> list[float]:
    """Median milliseconds of each run, timed in passes over all of them (one untimed pass
    first), so that a slow moment of the host lands on every width and context alike instead
    of on one. At least `repeats` passes, more (up to MAX_REPEATS) while they fit `budget`
    seconds; `progress(passes done, passes)` after each."""
    times: list[list[float]] = [[] for _ in runs]
    t0 = time.perf_counter()
    for run in runs:
        run()
    warm = time.perf_counter() - t0
    passes = max(repeats, min(MAX_REPEATS, int(budget / max(warm, 1e-6))))
    for done in range(passes):
        for run, seen in zip(runs, times):
            t = time.perf_counter()
            run()
            seen.append(time.perf_counter() - t)
        if progress is not None:
            progress(done + 1, passes)
    return [round(statistics.median(seen) * 1000, 4) for seen in times]


def _plain_steps(target: Any, cache: list, first: mx.array, tap_ids: tuple[int, ...]) -> None:
    """PLAIN_STEPS greedy steps as decoding runs them (each forward queued before the token
    before it is read), then the cache rolled back to where it was."""

    def step(y: mx.array) -> mx.array:
        logits, _ = target.forward(y.reshape(1).astype(mx.uint32), cache, tap_ids)
        nxt = mx.argmax(logits[-1])
        mx.async_eval(nxt)
        return nxt

    cur = step(first)
    for i in range(PLAIN_STEPS):
        following = step(cur) if i < PLAIN_STEPS - 1 else None
        cur.item()
        cur = following
    target.rollback(cache, PLAIN_STEPS)


def _draft_ms(pipe: Any, vocab: int, repeats: int) -> tuple[float, float]:
    """(ms of a drafter call that drafts one token, ms each further draft adds), from calls at
    one draft and at the pipeline's widest cap, on the context of a short generation."""
    proposer = pipe.proposer
    if not proposer.max_draft or getattr(proposer, "drafts_on_host", False):
        return 0.0, 0.0  # lookup drafts on the host, in microseconds
    widest = min(proposer.max_draft, pipe.max_draft or proposer.max_draft, MAX_WIDTH - 1)
    prompt = [int(t) for t in mx.random.randint(1, vocab, (32,), key=mx.random.key(1)).tolist()]
    result = pipe.generate(prompt, max_tokens=8, max_draft=widest, stop_tokens=set())
    history = prompt + result.tokens

    def call(cap: int) -> Callable[[], None]:
        ctx = DraftContext(history, cap, SamplingParams())

        def run() -> None:
            mx.eval(proposer.propose(ctx).tokens)
            # as if its verification accepted nothing and brought no taps: a chain drafter
            # (EAGLE-3) drops the rows it drafted, so the next call meets the same context
            proposer.observe(0, None)

        return run

    one = _timed(call(1), repeats) * 1000
    if widest <= 1:
        return round(one, 4), 0.0
    full = _timed(call(widest), repeats) * 1000
    return round(one, 4), round(max(0.0, full - one) / (widest - 1), 4)


def calibrated(pipe: Any, progress: Any = None) -> tuple[Calibration, bool]:
    """(the calibration, whether it was measured now): stored, else measured and stored."""
    cal = load(pipe)
    if cal is not None:
        return cal, False
    # inline, only the widths this pipeline can verify (`outrider calibrate` measures them all),
    # and on a GPU, where a wider forward can cost less, up to PAD_PROBE_WIDTH for a target
    # that could run its verifies padded
    width = needed_width(pipe)
    if mx.default_device() == mx.gpu and pipe.target.pads_verify:
        width = max(width, PAD_PROBE_WIDTH)
    # bounded on the CPU alone: a GPU's curve has steps (a quantized 8-row verify below a
    # 7-row one) that padding reads, and lines between a few widths would hide them
    within = INLINE_SECONDS if computes_on_host() else None
    cal = measure(pipe, max_width=width, progress=progress, within=within)
    save(cal)
    return cal, True
