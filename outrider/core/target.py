"""A loaded target model: its forwards (plain, verify, prefill, batched rows), cache
operations and hidden-state taps (core/taps.py), over the family plugin that knows its
architecture."""

from __future__ import annotations

import atexit
import threading
from collections.abc import Callable, Collection
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache

from .device import kv_attention, matmul_choice, release_streams
from .errors import Cancelled, OutriderError, UnsupportedTargetError
from .family import (
    BatchedCache,
    LayerSnapshot,
    TargetFamily,
    default_restore,
    default_snapshot,
)
from .generation_config import SamplingDefaults
from .kv_quant import KV_GROUP_SIZE, quantized_kv
from .row_kernels import dense_rows
from .row_kernels import installed as rows_installed
from .stopping import opener_ids
from .taps import TapSink, wrap

# Rows per prefill forward. Small enough that a cancel (a client that went away, Ctrl-C) is
# seen within one chunk of a long prompt; large enough that each chunk's matmuls stay
# compute-bound on a GPU.
PREFILL_CHUNK = 512
# After a prefix hit on a GPU, the prefill's final forward takes up to this many of the
# prompt's last tokens with its last one: one forward fewer than a fresh prefill, which forwards
# the last token alone as mlx-lm does (`Target.hit_tail`). The bound keeps the work of the last
# layer and the output head, computed for every row of that forward, small.
HIT_TAIL = 128


class Target:
    """An mlx-lm (or family-provided) model plus its tokenizer, family and taps."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer: Any,
        family: TargetFamily,
        config: dict | None = None,
        name: str = "",
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.family = family
        self.config = config or {}
        self.name = name
        self._sink = TapSink()
        self._local = threading.local()
        self._tapped: set[int] = set()
        self._probed: set[int] = set()
        self.kv_bits: int | None = None  # quantize the KV cache (`quantize_kv`)
        self.kv_attention = "quantized"  # how attention reads it (core/kv_quant.py)
        self._windows: bool | None = None  # whether any layer keeps a sliding window
        self._weight_bytes: int | None = None  # its parameters' bytes (`weight_bytes`)
        # rows of a prefix hit's final prefill forward; None: HIT_TAIL on a GPU, 1 on the CPU
        self.hit_tail: int | None = None
        # a verify forward of n rows runs as verify_widths[n] rows, padded (core/device.py's
        # default, or the calibration's measured `padding`); empty: never
        self.verify_widths: dict[int, int] = {}
        # whether a calibration chose them (`Calibration.pad`): the first one decides for every
        # pipeline on this target, so what runs and what each policy's costs read agree
        self.widths_calibrated = False
        # what its publisher recommends for requests that set none (core/generation_config.py)
        self.sampling_defaults = SamplingDefaults()
        self.notes: list[str] = []  # said once at load: what of its files was ignored, and why
        self._openers: set[int] | None = None  # tool-response openers in its vocabulary

    @property
    def stream(self) -> mx.Stream:
        """The stream device work runs on, as mlx-lm's generation does; one per thread, since
        MLX streams belong to the thread that made them (a server generates on a worker thread
        other than the one that loaded the model)."""
        stream = getattr(self._local, "stream", None)
        if stream is None:
            stream = self._local.stream = mx.new_stream(mx.default_device())
            if threading.current_thread() is threading.main_thread():
                _release_at_exit()  # other threads release their own (server/engine.py)
        return stream

    # -- structure -------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.family.layers(self.model))

    @property
    def hidden_size(self) -> int:
        text = self.config.get("text_config", self.config)
        return int(text.get("hidden_size", self.config.get("hidden_size", 0)))

    @property
    def eos_token_ids(self) -> set[int]:
        """The tokens that end generation: the tokenizer's end-of-turn ids, and the opener of a
        tool's response where the vocabulary has one (`stopping.TOOL_RESPONSE_OPENERS`)."""
        ids = getattr(self.tokenizer, "eos_token_ids", None)
        if ids is None:
            eos = getattr(self.tokenizer, "eos_token_id", None)
            ids = [] if eos is None else [eos]
        if self._openers is None:
            self._openers = opener_ids(self.tokenizer)
        return set(int(i) for i in ids) | self._openers

    def make_cache(self) -> list:
        cache = self.family.make_cache(self.model)
        if self.kv_bits:
            cache = [quantized_kv(c, self.kv_bits, self.kv_attention) for c in cache]
        return cache

    def quantize_kv(self, bits: int | None) -> None:
        """Keep keys and values at `bits` (8 or 4; None: the model's dtype) from the first
        prompt token on, stored as mlx-lm's `QuantizedKVCache` stores them (groups of 64 along
        the head dim).

        Every position is quantized on its own, so dropping rejected positions is exact and
        a verify forward reads the same quantized keys one-row decoding would. Only plain KV
        layers change: sliding windows and recurrent state keep their own caches.

        Attention reads the cache as `kv_attention()` says for this device: through MLX's
        quantized product, or dequantized into MLX's dense attention (a CUDA GPU, where the
        quantized product cannot be trusted; core/kv_quant.py). Refused with one line wherever
        a forward over a fresh quantized cache raises at load (`_quantized_kv_failure`)."""
        if bits not in (None, 4, 8):
            raise OutriderError(f"--kv-bits must be 8 or 4, got {bits}")
        if bits:
            cache = self.family.make_cache(self.model)
            if not any(type(c) is KVCache for c in cache):
                raise UnsupportedTargetError(
                    f"--kv-bits: {self.name or 'this model'} has no plain KV cache to quantize"
                )
            head_dim = self.head_dim
            if head_dim is None or head_dim % KV_GROUP_SIZE:
                raise UnsupportedTargetError(
                    f"--kv-bits needs a head dimension divisible by {KV_GROUP_SIZE} (mlx-lm's "
                    f"quantization group); this model's is {head_dim}"
                )
            attention = kv_attention()
            failure = self._quantized_kv_failure(bits, attention, cache)
            if failure:
                raise UnsupportedTargetError(
                    f"--kv-bits {bits}: MLX cannot run attention over a quantized cache on "
                    f"this device ({failure}); run without --kv-bits"
                )
            self.kv_attention = attention
        self.kv_bits = bits

    def _quantized_kv_failure(self, bits: int, attention: str, fresh: list) -> str | None:
        """Run a 3-row and a 2-row forward over the fresh cache `fresh`, quantized; None if
        they run, else the first line of MLX's error (a backend with no kernel for a shape
        raises "No implementation for problem shape", as MLX 0.32's CUDA one does)."""
        cache = [quantized_kv(c, bits, attention) for c in fresh]
        try:
            with mx.stream(self.stream):
                for ids in ([1, 2, 3], [4, 5]):
                    mx.eval(self.model(mx.array([ids], dtype=mx.uint32), cache=cache))
        except (RuntimeError, ValueError) as e:
            return (str(e).strip().splitlines() or [type(e).__name__])[0]
        return None

    @property
    def head_dim(self) -> int | None:
        text = self.config.get("text_config", self.config)
        if text.get("head_dim"):
            return int(text["head_dim"])
        heads = text.get("num_attention_heads")
        return self.hidden_size // int(heads) if heads else None

    def rollback(self, cache: list, n: int) -> None:
        if n > 0:
            with mx.stream(self.stream):  # a recurrent family's rollback queues device work
                self.family.rollback(cache, n)

    def snapshot(self, cache: list) -> list[LayerSnapshot]:
        """A copy of every layer's cache (prefix cache); raises NotSnapshottable if a layer's
        kind has no snapshot."""
        take = getattr(self.family, "snapshot", None) or default_snapshot
        with mx.stream(self.stream):
            return take(cache)

    def restore(self, snapshots: list[LayerSnapshot], n: int) -> list:
        """A fresh cache holding the first n positions of `snapshots` (see family.py)."""
        cache = self.make_cache()
        put = getattr(self.family, "restore", None) or default_restore
        with mx.stream(self.stream):
            put(cache, snapshots, n)
        return cache

    # -- batches of rows (continuous batching) ----------------------------------------------
    @property
    def batches(self) -> bool:
        """Whether this target's family can hold several rows in one cache (with `kv_bits`
        too: plugins/targets/batched.py, `QuantizedRows`)."""
        return self.unbatched_reason is None

    @property
    def unbatched_reason(self) -> str | None:
        """Why this target decodes one row at a time, or None where it batches."""
        if not hasattr(self.family, "merge_rows"):
            return f"the {self.family.name} family does not batch"
        return None

    @staticmethod
    def is_batched(cache: list) -> bool:
        return isinstance(cache, BatchedCache)

    def merge_rows(self, caches: list[list]) -> BatchedCache:
        """One batched cache from one-row caches, rows in the order given."""
        with mx.stream(self.stream):
            return self.family.merge_rows(caches)

    def extend_rows(self, cache: BatchedCache, rows: BatchedCache) -> None:
        with mx.stream(self.stream):
            self.family.extend_rows(cache, rows)

    def filter_rows(self, cache: BatchedCache, keep: list[int]) -> None:
        with mx.stream(self.stream):
            self.family.filter_rows(cache, keep)

    def extract_row(self, cache: BatchedCache, row: int) -> list:
        with mx.stream(self.stream):
            return self.family.extract_row(cache, row)

    def rollback_rows(self, cache: BatchedCache, n: list[int]) -> None:
        """Drop the last n[i] positions of row i of a batched cache."""
        if any(n):
            with mx.stream(self.stream):
                self.family.rollback_rows(cache, n)

    def forward_rows(
        self, ids: mx.array, cache: BatchedCache, tap_ids: tuple[int, ...] = ()
    ) -> tuple[mx.array, mx.array | None]:
        """The verify forward of a batch: ids [B, W] -> (logits [B, W, V], taps [B, W, ·])."""
        begin = getattr(self.family, "begin_forward", None)
        if begin is not None:
            begin(cache, True)
        self._sink.active = bool(tap_ids)
        self._sink.clear()
        try:
            logits = self.model(ids, cache=cache)
        finally:
            self._sink.active = False
        if not tap_ids:
            return logits, None
        try:
            taps = mx.concatenate([self._sink.store[j] for j in tap_ids], axis=-1)
        finally:
            self._sink.clear()
        return logits, taps

    # -- taps ------------------------------------------------------------------------------
    @property
    def loops(self) -> int:
        """How many times a forward runs the decoder layer list (a looped-depth family's
        `loops`; 1 elsewhere): tap ids index that unrolled stream."""
        return getattr(self.family, "loops", lambda model: 1)(self.model)

    def install_taps(self, layer_ids: tuple[int, ...]) -> None:
        """Wrap the layers needed for `layer_ids` (idempotent), then probe them once."""
        layers = self.family.layers(self.model)
        n = len(layers)
        loops = self.loops
        boundary = getattr(self.family, "loop_boundary", lambda model: None)(self.model)
        for j in layer_ids:
            if not -1 <= j < n * loops:
                raise UnsupportedTargetError(
                    f"the drafter taps target layer {j}, but the target has {n * loops} layers"
                    + (f" ({n} run {loops} times)" if loops > 1 else "")
                    + " (is this drafter made for another model?)"
                )
        wrap(layers, self._sink, set(layer_ids) - self._tapped, loops, boundary)
        self._tapped.update(layer_ids)
        missing = tuple(j for j in layer_ids if j not in self._probed)
        if missing:
            self._probe(tuple(layer_ids))
            self._probed.update(layer_ids)

    def _probe(self, layer_ids: tuple[int, ...]) -> None:
        """Check on a short input that tapping changes nothing and captures every tap."""
        ids = mx.array([1, 2, 3, 4], dtype=mx.uint32)
        plain = self.model(ids[None], cache=self.make_cache())[0]
        tapped, taps = self.forward(ids, self.make_cache(), layer_ids)
        mx.eval(plain, tapped, taps)
        plain, tapped = plain.astype(mx.float32), tapped.astype(mx.float32)
        diff = mx.abs(plain - tapped).max().item()
        # relative to the logits' scale: the tapped forward may run another attention kernel
        # (split, padded), whose rounding differs by ~1e-4 of the logits on CUDA
        scale = max(1.0, mx.abs(plain).max().item())
        width = taps.shape[-1] if taps is not None else 0
        if (
            diff > 1e-3 * scale
            or taps is None
            or taps.shape[0] != 4
            or width != len(layer_ids) * self.hidden_size
        ):
            raise UnsupportedTargetError(
                f"hidden-state taps do not work on this target ({self.name or 'model'}): the "
                f"tapped forward differs from the model's own (max |Δlogit| {diff:.3g}) or "
                "missed a layer; use --mode lookup or --mode baseline"
            )

    # -- forward ---------------------------------------------------------------------------
    @property
    def trims(self) -> bool:
        """Whether the family's rollback is a trim of the last positions, whichever forwards
        wrote them (its `pads_verify`): rounds can then be padded, and pipelined."""
        return bool(getattr(self.family, "pads_verify", False))

    @property
    def pads_verify(self) -> bool:
        """Whether verify forwards may run padded here: the family's rollback is a trim (its
        `pads_verify`), and OUTRIDER_MATMUL is not `native`."""
        return getattr(self.family, "pads_verify", False) and matmul_choice() != "native"

    def pad_verifies(self, width: int, smallest: int = 2) -> None:
        """Run verify forwards of `smallest` to width - 1 rows padded to `width` (0: none)."""
        self.verify_widths = {n: width for n in range(max(2, smallest), width)}

    def forward(
        self, ids: mx.array, cache: list, tap_ids: tuple[int, ...] = ()
    ) -> tuple[mx.array, mx.array | None]:
        """ids [T] -> (logits [T, V], taps [T, len(tap_ids)·H] or None).

        This is the verify forward: `rollback` may follow it to drop its last rows. A width
        `verify_widths` maps wider runs padded (its last token repeated) and drops the padding
        from the cache at once: rows are causal, so the padding changes no row.
        """
        n = ids.shape[0]
        pad = max(0, self.verify_widths.get(n, n) - n)
        if pad:
            ids = mx.concatenate([ids, mx.repeat(ids[-1:], pad)])
        logits = self._run(ids, cache, tap_ids, verify=True)
        taps = self._collect(tap_ids)
        if not pad:
            return logits[0], taps
        self.rollback(cache, pad)
        return logits[0, :n], None if taps is None else taps[:n]

    def forward_batch(self, ids: mx.array, tap_ids: tuple[int, ...]) -> tuple[mx.array, mx.array]:
        """Whole sequences at once, no cache (training): ids [b, T] -> (logits [b, T, V],
        taps [b, T, len(tap_ids)·H])."""
        self._sink.active = True
        self._sink.clear()
        try:
            logits = self.model(ids)
            taps = mx.concatenate([self._sink.store[j] for j in tap_ids], axis=-1)
        finally:
            self._sink.active = False
            self._sink.clear()
        return logits, taps

    def _run(
        self, ids: mx.array, cache: list, tap_ids: tuple[int, ...], verify: bool = False
    ) -> mx.array:
        # a verify forward may be rolled back: families with recurrent state record for it
        begin = getattr(self.family, "begin_forward", None)
        if begin is not None:
            begin(cache, verify)
        self._sink.active = bool(tap_ids)
        self._sink.clear()
        try:
            return self.model(ids[None], cache=cache)
        finally:
            self._sink.active = False

    def _collect(self, tap_ids: tuple[int, ...]) -> mx.array | None:
        if not tap_ids:
            return None
        try:
            parts = [self._sink.store[j] for j in tap_ids]
        except KeyError:
            return None
        finally:
            self._sink.clear()
        # joined, then the batch row taken once: two graph nodes a forward, not one a tap
        # and a join (a parked plain step pays them on a launch-bound GPU)
        return mx.concatenate(parts, axis=-1)[0]

    def prefill(
        self,
        prompt: list[int],
        cache: list,
        tap_ids: tuple[int, ...] = (),
        cancelled: Callable[[], bool] | None = None,
        progress: Callable[[int, int], None] | None = None,
        stops: Collection[int] = (),
        at_stop: Callable[[int], None] | None = None,
        hit: bool = False,
    ) -> tuple[mx.array, mx.array | None]:
        """Process the prompt as mlx-lm does (chunks, then the last token alone).

        Returns the logits of the last prompt position [V] and the taps of every prompt row.
        Non-final chunks never evaluate the output head (only caches and taps are evaluated).
        `cancelled` is asked before each chunk; when it says yes, `Cancelled` is raised and the
        rest of the prompt is never computed. `progress(done, total)` hears after each chunk.
        A chunk also ends at each position in `stops` (before the last token), where
        `at_stop(done)` hears with the cache evaluated: the prefix cache snapshots it there.
        `cache` may already hold earlier positions (a prefix-cache hit): `prompt` is the rest,
        and with `hit` its last `final_rows(hit)` tokens go through one forward with the last.
        Where products run dequantized from `chunk_floor()` rows (a 4-bit target on CUDA), no
        chunk is shorter than that where it can be helped: a remainder joins the chunk before
        it, and a rest of `chunk_floor()` rows up to about two chunks goes in one forward with
        the last token.
        """
        ids = mx.array(prompt, dtype=mx.uint32)
        taps: list[mx.array] = []
        done = 0
        tail = self.final_rows(hit)  # tokens the final forward takes at most
        floor: int | None = None  # `chunk_floor`, asked once
        while True:
            rest = len(prompt) - done
            later = [p - done for p in stops if done < p < len(prompt)]
            if rest <= tail and not later:
                break
            if cancelled is not None and cancelled():
                raise Cancelled(f"cancelled after {done} of {len(prompt)} prompt tokens")
            floor = self.chunk_floor() if floor is None else floor
            if floor and not later and floor <= rest < PREFILL_CHUNK + floor + tail:
                # long enough for the fast route: the final forward takes it all, not a chunk
                # and then a final forward of up to `tail` rows through the slow one
                break
            n = min(PREFILL_CHUNK, rest - tail) if rest > tail else rest - 1
            if rest - tail > n and rest - tail - n < floor:
                n = rest - tail  # a remainder too short for the fast route joins this chunk
            n = min([n, *later])
            self._run(ids[done : done + n], cache, tap_ids)
            chunk_taps = self._collect(tap_ids)
            state = [c.state for c in cache]
            if chunk_taps is not None:
                taps.append(chunk_taps)
            mx.eval(state, taps)
            done += n
            if progress is not None:
                progress(done, len(prompt))
            if at_stop is not None and done in stops:
                at_stop(done)
        final = ids[done:]
        if final.shape[0] > tail:  # the rest of a dense-route prefill: a chunk, never rolled back
            logits, last_taps = self._run(final, cache, tap_ids)[0], self._collect(tap_ids)
        else:
            logits, last_taps = self.forward(final, cache, tap_ids)
        if last_taps is not None:
            taps.append(last_taps)
        all_taps = mx.concatenate(taps, axis=0) if taps else None
        return logits[-1], all_taps

    def prefill_rows(
        self, prompts: list[list[int]], budget: int = 8192
    ) -> tuple[mx.array, BatchedCache] | None:
        """Several prompts prefilled together, as mlx-lm's batched generation does: prompts of
        similar length left-padded into one forward of up to `budget` tokens (in chunks of
        PREFILL_CHUNK columns, then the last column alone), the groups' rows then joined into
        one cache, in the order given. Returns (the logits of every prompt's last position
        [B, V], the cache), or None where the family cannot pad rows (recurrent state, sliding
        windows, a quantized KV cache): prefill each prompt on its own then. A row's values
        differ from its one-row prefill by rounding only (the padding is masked)."""
        padded = getattr(self.family, "padded_rows", None)
        if padded is None or self.kv_bits or not prompts or min(map(len, prompts)) < 1:
            return None
        template = self.make_cache()
        if padded(template, [0]) is None:
            return None
        order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
        cache: BatchedCache | None = None
        last: list[mx.array] = []
        with mx.stream(self.stream):
            lo = 0
            while lo < len(order):
                hi = lo + 1
                while hi < len(order) and (hi - lo + 1) * len(prompts[order[hi]]) <= budget:
                    hi += 1
                group = order[lo:hi]
                width = len(prompts[group[-1]])
                pads = [width - len(prompts[i]) for i in group]
                ids = mx.array(
                    [[0] * pad + prompts[i] for pad, i in zip(pads, group)], dtype=mx.uint32
                )
                rows = padded(template, pads)
                for start in range(0, width - 1, PREFILL_CHUNK):
                    self.forward_rows(ids[:, start : min(start + PREFILL_CHUNK, width - 1)], rows)
                    mx.eval([c.state for c in rows])
                logits, _ = self.forward_rows(ids[:, -1:], rows)
                last.append(logits[:, -1])
                mx.eval(last[-1], [c.state for c in rows])
                if cache is None:
                    cache = rows
                else:
                    self.family.extend_rows(cache, rows)
                lo = hi
            back = [0] * len(order)  # the sorted position of each prompt
            for at, i in enumerate(order):
                back[i] = at
            self.family.filter_rows(cache, back)
            firsts = mx.concatenate(last, axis=0)[mx.array(back, dtype=mx.int32)]
        return firsts, cache

    def chunk_floor(self) -> int:
        """The fewest rows a prefill chunk should have: where some products run dequantized
        from a row count (`row_kernels.dense_rows`, a 4-bit target on CUDA), a shorter chunk
        runs them through MLX's quantized product, which is slow there at hundreds of rows,
        so a prompt's remainder past its last full chunk goes in with that chunk instead of
        alone, and with the last token where nothing stops the prefill before it (`prefill`).
        0 elsewhere: the chunks are as before.

        Only a target whose first decoder layer runs a rows kernel is searched whole (a walk
        of every module, milliseconds on a deep model): the others answer at once. A family
        that does not say its layers (the fallback's) is searched whole."""
        try:
            layers = self.family.layers(self.model)
        except OutriderError:
            layers = None
        if layers is not None and (not layers or not rows_installed(layers[0])):
            return 0
        return dense_rows(self.model) or 0

    def final_rows(self, hit: bool) -> int:
        """How many of a prefill's last tokens its final forward takes (at most).

        A fresh prefill forwards the last token alone (as mlx-lm does). After a prefix hit, on
        a GPU, where a short forward costs mostly the reading of every weight, the last
        `HIT_TAIL` tokens go in one forward (one forward and one host sync fewer, at the price
        of the last layer and the head computed on every row of it); on the CPU, where a
        forward's cost is its arithmetic, the last token alone is cheaper. The rows are the same either way,
        grouped otherwise: on the CPU the logits are bit-identical; on a GPU they may round
        differently, as any other chunking does. Sliding windows keep the last token alone (a
        one-token window update is computed differently from a many-token one)."""
        if not hit or self.windows:
            return 1
        if self.hit_tail is not None:
            return max(1, self.hit_tail)
        return HIT_TAIL if mx.default_device().type == mx.gpu else 1

    @property
    def weight_bytes(self) -> int:
        """Bytes of the model's parameters as they sit in memory (quantized ones packed): what
        one plain step reads (core/roofline.py). Counted once."""
        if self._weight_bytes is None:
            from .roofline import weight_bytes

            self._weight_bytes = weight_bytes(self.model)
        return self._weight_bytes

    @property
    def windows(self) -> bool:
        """Whether any layer's cache is a sliding window (a rotating KV cache)."""
        if self._windows is None:
            kinds = {type(c).__name__ for c in self.family.make_cache(self.model)}
            self._windows = bool(kinds & {"RotatingKVCache", "BatchRotatingKVCache"})
        return self._windows

    @property
    def context_window(self) -> int | None:
        """The model's own context length (max_position_embeddings), when its config says."""
        cfg = self.config
        native = cfg.get("max_position_embeddings") or (cfg.get("text_config") or {}).get(
            "max_position_embeddings"
        )
        return int(native) if native else None

    # -- shared embedding / head (for drafters that bind the target's) ------------------------
    def embed(self, ids: mx.array) -> mx.array:
        return self.family.embed(self.model, ids)

    def project(self, hidden: mx.array) -> mx.array:
        return self.family.project(self.model, hidden)


def _release_at_exit() -> None:
    """Have the interpreter release the main thread's streams as it exits (`release_streams`),
    registered once however many targets make one."""
    atexit.unregister(release_streams)
    atexit.register(release_streams)
