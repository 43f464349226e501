"""Loop efficiency on random-weight targets of real sizes.

(a) baseline mode vs mlx-lm's own generation (`mlx_lm.generate.generate_step`), same model,
    same prompt: decode tokens/s and their ratio.
(b) the oracle proposer at 100% acceptance: decode tokens/s at cap k against the cost-model
    ideal (k+1) / (t_draft + t_verify(k+1)), with t_verify(w) measured in the same run
    (one target forward of width w at the same context, evaluated, then rolled back) and t_draft
    the oracle's own time per round. `w/1` is t_verify(k+1) over the same forward at one row,
    timed alike (issue 13's bar: at most 1.25 for the 8B 4-bit shape at cap 4).

Every outrider run is checked token for token against the baseline (lossless); a mismatch
fails the run. Prints a table; --json writes the numbers.

`x plain` is the oracle's median over baseline's median, each from its own trials; `x pair`
is the median over trials of the oracle's tokens/s over a baseline run made just before it,
so a host whose speed drifts between the two sets of trials moves both alike.

    python benchmarks/loop_efficiency.py --shapes 0.6b,8b --dtypes bf16,4bit --caps 1,2,4,8

`--pipelined both` times each cap with pipelined rounds (the default: the next round queued
before this one is read, core/loop.py) and without, the two arms taking turns trial by trial.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

import outrider  # noqa: E402, F401 - first: it picks MLX's CPU BLAS (core/blas.py)

# isort: split
import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from outrider.core import compiled_layers, row_kernels
from outrider.core.device import PADDED_FROM, matmul_choice, verify_pad
from outrider.core.proposer import DraftContext
from outrider.core.sampling import SamplingParams, greedy
from outrider.core.target import Target
from outrider.plugins.kernels import cuda_rows
from outrider.plugins.strategies.baseline import PlainProposer
from outrider.plugins.targets import verify_attention
from outrider.plugins.targets.dense import DenseFamily
from outrider.testing import OracleProposer, build_model

SHAPES = {
    "tiny": dict(
        hidden_size=64,
        num_hidden_layers=4,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=True,
    ),  # a smoke test of the script itself
    "0.6b": dict(
        hidden_size=1024,
        num_hidden_layers=28,
        intermediate_size=3072,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=True,
    ),
    "8b": dict(
        hidden_size=4096,
        num_hidden_layers=36,
        intermediate_size=12288,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=False,
    ),
    "32b": dict(  # bf16: 65 GB, built without a float32 copy (build_model's dtype)
        hidden_size=5120,
        num_hidden_layers=64,
        intermediate_size=25600,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=False,
    ),
}


def qwen3_config(shape: str) -> dict:
    cfg = dict(
        model_type="qwen3",
        vocab_size=151936,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        max_position_embeddings=40960,
    )
    cfg.update(SHAPES[shape])
    return cfg


def make_target(shape: str, dtype: str) -> Target:
    half = None if dtype == "fp32" else mx.bfloat16  # fp32 for CPUs (slow bf16 matmuls there)
    model = build_model(qwen3_config(shape), seed=0, scale=1.0, dtype=half)
    if dtype == "4bit":
        nn.quantize(model, group_size=64, bits=4)
    mx.eval(model.parameters())
    family = DenseFamily()
    # what loading it chooses: the verify attention (OUTRIDER_ATTENTION) and padding
    verify_attention.install(model, family.layers(model), lambda: make_prompt_cache(model))
    # a few-row kernel where OUTRIDER_MATMUL asks for one, as loading a target decides it
    note = row_kernels.apply(model, [cuda_rows.CudaRows()], matmul_choice())
    if note or row_kernels.installed(model):
        print(f"  {note or 'quantized products of a few rows run the rows kernel'}", flush=True)
    # last, as loading does: compiled layers where OUTRIDER_COMPILED_LAYERS asks (a CUDA GPU)
    compiled_layers.install(model, family)
    target = Target(model, None, family, qwen3_config(shape), name=f"qwen3-{shape}-{dtype}")
    target.pad_verifies(verify_pad(model), PADDED_FROM)
    return target


class Timed:
    """Tokens of one generation and the wall-clock gap before each arrival after the first.

    `tps` is decode tokens/s over the whole run; `steady_tps` is tokens/s from the median gap
    per token, which a burst of host noise (seen on the shared GPU host) cannot drag around.
    """

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.gaps: list[tuple[float, int]] = []  # (seconds, tokens that arrived)
        self._last: float | None = None
        self._first: float | None = None

    def arrive(self, toks: list[int]) -> None:
        now = time.perf_counter()
        if self._last is not None and toks:
            self.gaps.append((now - self._last, len(toks)))
        if self._first is None:
            self._first = now
        self._last = now
        self.tokens.extend(toks)

    @property
    def tps(self) -> float:
        return sum(n for _, n in self.gaps) / (self._last - self._first)

    @property
    def steady_tps(self) -> float:
        return 1.0 / statistics.median(dt / n for dt, n in self.gaps)


def mlx_lm_decode_tps(target: Target, prompt: list[int], n: int) -> tuple[Timed, list[int]]:
    """mlx-lm's generation on the target's model, through mlx-lm's own layers."""
    from mlx_lm.generate import generate_step

    timed = Timed()
    with compiled_layers.bypassed(target.model):
        for tok, _ in generate_step(mx.array(prompt), target.model, max_tokens=n):
            timed.arrive([int(tok)])
            if len(timed.tokens) == n:
                break
    return timed, timed.tokens


def outrider_timed(
    target: Target, proposer, prompt: list[int], n: int, cap: int, pipelined: bool = True
) -> Timed:
    pipe = outrider.pipeline_from_parts(target, proposer, proposer.name, max_draft=cap)
    pipe.pipelined_rounds = pipelined
    timed = Timed()
    for chunk in pipe.stream(prompt, max_tokens=n, stop_tokens=set()):
        timed.arrive(chunk.tokens)
        if chunk.result is not None:
            timed.result = chunk.result
    return timed


def outrider_run(target: Target, proposer, prompt: list[int], n: int, cap: int):
    return outrider_timed(target, proposer, prompt, n, cap).result


def verify_times(target: Target, prompt: list[int], widths: list[int], reps: int) -> dict:
    """Median seconds of one target forward of width w at the prompt's context, evaluated."""
    cache = target.make_cache()
    logits, _ = target.prefill(prompt, cache)
    mx.eval(logits)
    out = {}
    for w in widths:
        ids = mx.array(prompt[:w], dtype=mx.uint32)
        times = []
        for i in range(reps + 2):
            t = time.perf_counter()
            lg, _ = target.forward(ids, cache)
            mx.eval(greedy(lg))  # the greedy choice per row, as the acceptor computes it
            dt = time.perf_counter() - t
            target.rollback(cache, w)
            if i >= 2:  # warm-up
                times.append(dt)
        out[w] = statistics.median(times)
    return out


def fp_tie(target: Target, ids: list[int], a: int, b: int, rel: float = 0.05) -> bool:
    """True when tokens a and b are both at the top of the target's logits after `ids`, within a
    few bf16 ulps (rel 0.05 ~ 6 ulps): a divergence there is floating-point noise, which on the
    CUDA backend even separates two runs of mlx-lm itself (the run reports how often)."""
    logits, _ = target.forward(mx.array(ids, dtype=mx.uint32), target.make_cache())
    row = logits[-1].astype(mx.float32)
    la, lb, top = row[a].item(), row[b].item(), mx.max(row).item()
    print(f"  divergence check: logit {la:.4f} vs {lb:.4f} (max {top:.4f})")
    tol = rel * max(abs(top), 1e-6)
    return abs(la - lb) <= tol and min(la, lb) >= top - tol


def oracle_reference(target, prompt, reference, k, n, ties: list) -> list[int]:
    """A continuation the oracle can follow at 100% at cap k: start from the baseline output;
    where the verify width breaks an fp tie the other way, check it is a tie and follow it."""
    ref = reference
    for _ in range(6):
        res = outrider_run(
            target, OracleProposer(prompt + ref, 1.0, 151936, max_draft=k), prompt, n, k
        )
        if res.tokens == ref:
            return ref
        i = next(j for j, (x, y) in enumerate(zip(res.tokens, ref)) if x != y)
        if not fp_tie(target, prompt + ref[:i], ref[i], res.tokens[i]):
            sys.exit(f"LOSSLESS CHECK FAILED: cap {k} diverges at token {i} without an fp tie")
        ties.append({"cap": k, "position": i})
        ref = res.tokens
    return ref


# A run whose output left the oracle's path at an fp tie (checked) measured a lower acceptance,
# not the 100% this table is about: MLX's CUDA backend breaks a one-ulp tie either way from one
# run to the next, even in the prefill (mlx-lm against its own first run, printed above). Such a
# run is timed again, up to this many times; the table counts the reruns.
TIE_RERUNS = 3


def median(xs):
    return statistics.median(xs)


def draft_seconds(reference: list[int], prompt: list[int], k: int) -> float:
    """The oracle's own time per round (its propose call, evaluated)."""
    oracle = OracleProposer(prompt + reference, 1.0, 151936, max_draft=k)
    ctx = DraftContext(prompt + reference[:1], k, SamplingParams())
    t0 = time.perf_counter()
    for _ in range(100):
        mx.eval(oracle.propose(ctx).tokens)
    return (time.perf_counter() - t0) / 100


def compare_or_tie(target, prompt, got, want, what: str, ties: list) -> None:
    """Equal, or different only from a floating-point tie (checked), else fail the run."""
    i = next((j for j, (x, y) in enumerate(zip(got, want)) if x != y), None)
    if i is None:
        return
    if not fp_tie(target, prompt + want[:i], want[i], got[i]):
        sys.exit(f"LOSSLESS CHECK FAILED: {what} diverges at token {i} without an fp tie")
    ties.append({"what": what, "position": i})


def run(
    shape: str, dtype: str, caps: list[int], prompt_len: int, n: int, trials: int,
    arms: tuple[bool, ...] = (True,),
) -> dict:  # fmt: skip
    target = make_target(shape, dtype)
    rng = mx.random.randint(0, 150000, (prompt_len,), key=mx.random.key(1))
    prompt = rng.tolist()
    # warm-up both paths
    mlx_lm_decode_tps(target, prompt, 16)
    outrider_run(target, PlainProposer(), prompt, 16, 0)

    peer, ours, ties, reference, self_diff = [], [], [], None, []
    peer_steady, ours_steady = [], []
    for _ in range(trials):  # interleaved, so drift hits both alike
        timed, ref = mlx_lm_decode_tps(target, prompt, n)
        peer.append(timed.tps)
        peer_steady.append(timed.steady_tps)
        if reference is not None:  # is mlx-lm itself deterministic here?
            self_diff.append(
                next((j for j, (x, y) in enumerate(zip(ref, reference)) if x != y), None)
            )
        mine = outrider_timed(target, PlainProposer(), prompt, n, 0)
        res = mine.result
        ours.append(mine.tps)
        ours_steady.append(mine.steady_tps)
        compare_or_tie(target, prompt, res.tokens, ref, "baseline vs mlx-lm", ties)
        reference = reference or ref
    row = {
        "shape": shape,
        "dtype": dtype,
        "prompt_len": prompt_len,
        "new_tokens": n,
        "mlx_lm_tps": median(peer),
        "baseline_tps": median(ours),
        "baseline_ratio": median(ours) / median(peer),
        "mlx_lm_steady_tps": median(peer_steady),
        "baseline_steady_tps": median(ours_steady),
        "baseline_steady_ratio": median(ours_steady) / median(peer_steady),
        "mlx_lm_trials": peer,
        "baseline_trials": ours,
        "baseline_fp_ties": ties,
        "mlx_lm_self_divergence": self_diff,
        "oracle": [],
    }
    for k in caps:
        ties: list = []
        ref_k = oracle_reference(target, prompt, reference, k, n, ties)
        t_draft = draft_seconds(ref_k, prompt, k)
        cells = {p: {"tps": [], "eff": [], "tv": [], "ties": list(ties), "steady": [], "s_eff": [],
                    "acceptance": [], "reruns": 0, "tv1": [], "paired": []}
                 for p in arms}  # fmt: skip
        paired_base = []  # a baseline run before each trial's arms: the ratio `x pair` reads
        for _ in range(trials):  # the arms take turns trial by trial, so noise hits both
            base = outrider_timed(target, PlainProposer(), prompt, n, 0)
            compare_or_tie(
                target, prompt, base.result.tokens, reference, "baseline", row["baseline_fp_ties"]
            )
            paired_base.append(base.tps)
            for pipelined in arms:
                cell = cells[pipelined]
                for attempt in range(TIE_RERUNS + 1):
                    # t_verify measured right before each timed run, with one row's beside it
                    tv = verify_times(target, prompt, [1, k + 1], reps=15)
                    t_verify, t_one = tv[k + 1], tv[1]
                    oracle = OracleProposer(prompt + ref_k, 1.0, 151936, max_draft=k)
                    timed = outrider_timed(target, oracle, prompt, n, k, pipelined)
                    res = timed.result
                    what = f"oracle cap {k}"
                    compare_or_tie(target, prompt, res.tokens, ref_k, what, cell["ties"])
                    if res.tokens == ref_k or attempt == TIE_RERUNS:
                        break
                    cell["reruns"] += 1  # a tie moved this run off the oracle's path
                ideal = (k + 1) / (t_draft + t_verify)
                cell["tps"].append(timed.tps)
                cell["eff"].append(timed.tps / ideal)
                cell["steady"].append(timed.steady_tps)
                cell["s_eff"].append(timed.steady_tps / ideal)
                cell["tv"].append(t_verify)
                cell["tv1"].append(t_one)
                cell["paired"].append(timed.tps / base.tps)
                cell["acceptance"].append(
                    sum(r.accepted for r in res.rounds)
                    / max(sum(len(r.drafted) for r in res.rounds), 1)
                )
        for pipelined in arms:
            cell = cells[pipelined]
            row["oracle"].append(
                {
                    "cap": k,
                    "pipelined": pipelined,
                    "decode_tps": median(cell["tps"]),
                    "ideal_tps": (k + 1) / (t_draft + median(cell["tv"])),
                    "efficiency": median(cell["eff"]),
                    "steady_tps": median(cell["steady"]),
                    "steady_efficiency": median(cell["s_eff"]),
                    "t_verify_ms": median(cell["tv"]) * 1e3,
                    # the same forward at one row: issue 13's bar is t_verify(5) / t_verify(1)
                    "t_verify_1_ms": median(cell["tv1"]) * 1e3,
                    "t_draft_ms": t_draft * 1e3,
                    "acceptance": median(cell["acceptance"]),
                    "reruns": cell["reruns"],
                    "fp_ties": cell["ties"],
                    "trials_tps": cell["tps"],
                    # each trial over the baseline run made just before it
                    "paired_ratio": median(cell["paired"]),
                    "paired_baseline_tps": paired_base,
                }
            )
    del target
    mx.clear_cache()
    return row


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--shapes", default="0.6b")
    ap.add_argument("--dtypes", default="bf16,4bit")
    ap.add_argument("--caps", default="1,2,4,8")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=200)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument(
        "--pipelined",
        choices=("on", "off", "both"),
        default="on",
        help="oracle rounds pipelined (the default), not, or both arms in turn",
    )
    ap.add_argument("--json", default=None, help="write results here")
    args = ap.parse_args()
    arms = {"on": (True,), "off": (False,), "both": (True, False)}[args.pipelined]
    caps = [int(c) for c in args.caps.split(",")]
    header = {
        "device": str(mx.default_device()),
        "mlx": mx.__version__,
        "outrider": outrider.__version__,
        "platform": platform.platform(),
        "command": " ".join(sys.argv),
    }
    print(json.dumps(header))
    rows = []
    for shape in args.shapes.split(","):
        for dtype in args.dtypes.split(","):
            t = time.perf_counter()
            row = run(shape, dtype, caps, args.prompt_len, args.new_tokens, args.trials, arms)
            rows.append(row)
            print(f"\n== qwen3-{shape} {dtype} ({time.perf_counter() - t:.0f}s) ==")
            print(
                f"mlx-lm {row['mlx_lm_tps']:.1f} tok/s | outrider baseline "
                f"{row['baseline_tps']:.1f} tok/s | ratio {row['baseline_ratio']:.3f}"
            )
            print(
                f"steady (median gap): mlx-lm {row['mlx_lm_steady_tps']:.1f} | outrider "
                f"{row['baseline_steady_tps']:.1f} | ratio {row['baseline_steady_ratio']:.3f}"
            )
            print(
                f"fp ties (baseline vs mlx-lm): {len(row['baseline_fp_ties'])}; mlx-lm vs its "
                f"own first run diverges at: {row['mlx_lm_self_divergence']}"
            )
            print(
                f"{'cap':>4} {'pipe':>4} {'tok/s':>9} {'x plain':>7} {'x pair':>6} {'ideal':>9} {'eff':>6} {'t_verify ms':>11} {'w/1':>5} {'t_draft ms':>10} {'accept':>7} {'steady':>8} {'s-eff':>6} ties reruns"
            )
            for o in row["oracle"]:
                print(
                    f"{o['cap']:>4} {'on' if o['pipelined'] else 'off':>4} "
                    f"{o['decode_tps']:>9.1f} {o['decode_tps'] / row['baseline_tps']:>7.2f} "
                    f"{o['paired_ratio']:>6.2f} "
                    f"{o['ideal_tps']:>9.1f} "
                    f"{o['efficiency']:>6.3f} {o['t_verify_ms']:>11.2f} "
                    f"{o['t_verify_ms'] / o['t_verify_1_ms']:>5.2f} {o['t_draft_ms']:>10.3f} "
                    f"{o['acceptance']:>7.3f} {o['steady_tps']:>8.1f} "
                    f"{o['steady_efficiency']:>6.3f} {len(o['fp_ties']):>4} {o['reruns']:>6}"
                )
            sys.stdout.flush()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({**header, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
