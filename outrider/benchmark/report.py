"""Benchmark reports people can read: charts and one self-contained HTML page from a receipt.

Everything here reads a receipt dict (what `outrider benchmark --json` writes), so receipts
written before a field existed still render: what they lack is drawn as "not recorded in this
receipt", never guessed. Three charts:

- speed-up over plain decoding (decode tok/s over baseline's), per suite and mode;
- acceptance per draft position: the share of a drafting mode's rounds whose i-th drafted token
  was accepted, from the receipt's per-cell `accept_counts` (rounds by accept length);
- decode tok/s over time: each timed run in run order, against the seconds since the first
  timed run began (`timeline`); for older receipts, each trial's pooled tok/s per suite.

matplotlib is optional (`pip install 'outrider[plot]'`) and imported only when a chart is drawn;
charts are drawn on the Agg canvas and never touch pyplot's global state.
"""

from __future__ import annotations

import html
import io
import json
from pathlib import Path
from typing import Any

from ..core.errors import OutriderError

PLOT_FORMATS = {".png": "png", ".svg": "svg"}
NOT_RECORDED = "not recorded in this receipt"
NEEDS_MATPLOTLIB = "charts need matplotlib, which is not installed: pip install 'outrider[plot]'"
BASELINE_COLOR = "#7f7f7f"
PALETTE = (
    "#1f77b4",
    "#d62728",
    "#2ca02c",
    "#ff7f0e",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#17becf",
    "#bcbd22",
)


# --- reading a receipt ---------------------------------------------------------------------------


def load_receipt(path: str | Path) -> dict:
    """A receipt from disk, or one OutriderError line saying why it is not one."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise OutriderError(f"--from-receipt {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else type(e).__name__
        raise OutriderError(f"--from-receipt {path}: cannot read it ({reason})") from None
    try:
        receipt = json.loads(text)
    except json.JSONDecodeError as e:
        raise OutriderError(f"--from-receipt {path}: not JSON (line {e.lineno}: {e.msg})") from None
    check_receipt(receipt, f"--from-receipt {path}")
    return receipt


def check_receipt(receipt: Any, where: str = "receipt") -> None:
    """Refuse JSON that is not an `outrider benchmark` receipt with results to show."""
    schema = receipt.get("schema") if isinstance(receipt, dict) else None
    if not isinstance(schema, str) or not schema.startswith("outrider-benchmark/"):
        raise OutriderError(
            f'{where}: not an outrider benchmark receipt (no "schema": '
            '"outrider-benchmark/1"; write one with `outrider benchmark --json FILE`)'
        )
    results = receipt.get("results")
    if not isinstance(results, list) or not all(
        isinstance(r, dict) and "suite" in r and "mode" in r for r in results
    ):
        raise OutriderError(f'{where}: its "results" is not a list of suite × mode rows')
    if not results:
        raise OutriderError(f"{where}: it has no results to show")


def plot_format(path: str | Path) -> str:
    """'png' or 'svg' from the file's extension, else one error line."""
    suffix = Path(path).suffix.lower()
    if suffix not in PLOT_FORMATS:
        raise OutriderError(
            f"--plot {path}: the file must end in .png or .svg (got {suffix or 'no extension'})"
        )
    return PLOT_FORMATS[suffix]


def require_matplotlib() -> None:
    """Fail with the install hint before any work is done, when matplotlib is missing."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        raise OutriderError(NEEDS_MATPLOTLIB)


def modes_of(receipt: dict) -> list[str]:
    """Every arm in run order (settings.modes, else the order of the results)."""
    order = list((receipt.get("settings") or {}).get("modes") or [])
    for row in receipt["results"]:
        if row["mode"] not in order:
            order.append(row["mode"])
    return order


def suites_of(receipt: dict) -> list[str]:
    return list(dict.fromkeys(row["suite"] for row in receipt["results"]))


def caps_of(receipt: dict) -> dict[str, int]:
    caps = dict((receipt.get("settings") or {}).get("caps") or {})
    for arm in receipt.get("arms") or []:
        caps.setdefault(arm.get("mode"), arm.get("cap"))
    return {m: int(c) for m, c in caps.items() if isinstance(c, (int, float))}


def speedups(receipt: dict) -> dict[str, dict[str, float]]:
    """mode -> suite -> speed-up over baseline (rows without one are left out)."""
    out: dict[str, dict[str, float]] = {}
    for row in receipt["results"]:
        if row.get("speedup") is not None:
            out.setdefault(row["mode"], {})[row["suite"]] = float(row["speedup"])
    return out


def accept_histograms(receipt: dict) -> dict[str, list[int]] | None:
    """mode -> rounds by accept length, summed over suites (element k: rounds that accepted k
    drafts); None when the receipt predates `accept_counts`. Plain arms have no rounds."""
    if not any("accept_counts" in row for row in receipt["results"]):
        return None
    out: dict[str, list[int]] = {}
    for row in receipt["results"]:
        counts = [int(c) for c in row.get("accept_counts") or []]
        if not counts:
            continue
        have = out.setdefault(row["mode"], [])
        have.extend([0] * (len(counts) - len(have)))
        for k, c in enumerate(counts):
            have[k] += c
    return out


def position_acceptance(counts: list[int], positions: int) -> list[float]:
    """Share of rounds whose draft position i (1..positions) was accepted: rounds that accepted
    at least i drafts, over all rounds."""
    total = sum(counts)
    if not total:
        return [0.0] * positions
    return [sum(counts[i:]) / total for i in range(1, positions + 1)]


def mean_accept(counts: list[int]) -> float:
    total = sum(counts)
    return sum((k + 1) * c for k, c in enumerate(counts)) / total if total else 0.0


def timeline_of(receipt: dict) -> dict[str, list[tuple[float, float]]] | None:
    """mode -> (seconds since the first timed run began, decode tok/s) per timed run; None when
    the receipt predates `timeline`."""
    timeline = receipt.get("timeline")
    if not isinstance(timeline, dict) or not any(timeline.values()):
        return None
    return {m: [(float(t), float(v)) for t, v in pts] for m, pts in timeline.items() if pts}


def trial_series(receipt: dict) -> tuple[list[str], dict[str, list[float | None]]] | None:
    """The older receipts' stand-in for a timeline: each trial's pooled decode tok/s per suite,
    in the order they ran (trial by trial, suite by suite). (labels, mode -> values)."""
    rows = [r for r in receipt["results"] if r.get("trials_decode_tps")]
    if not rows:
        return None
    suites = suites_of(receipt)
    trials = max(len(r["trials_decode_tps"]) for r in rows)
    cell = {(r["suite"], r["mode"]): r["trials_decode_tps"] for r in rows}
    labels = [f"{s} {t + 1}" for t in range(trials) for s in suites]
    series: dict[str, list[float | None]] = {}
    for mode in modes_of(receipt):
        values: list[float | None] = []
        for t in range(trials):
            for s in suites:
                tps = cell.get((s, mode)) or []
                values.append(float(tps[t]) if t < len(tps) else None)
        if any(v is not None for v in values):
            series[mode] = values
    return labels, series


# --- drawing -------------------------------------------------------------------------------------


def _colors(receipt: dict) -> dict[str, str]:
    colors, i = {}, 0
    for mode in modes_of(receipt):
        if mode == "baseline":
            colors[mode] = BASELINE_COLOR
        else:
            colors[mode] = PALETTE[i % len(PALETTE)]
            i += 1
    return colors


def _note(ax, title: str, text: str) -> None:
    ax.set_title(title, loc="left", fontsize=11)
    ax.set_axis_off()
    ax.text(0.5, 0.5, text, ha="center", va="center", fontsize=10, color="#555555", wrap=True)


def draw_speedup(ax, receipt: dict) -> None:
    title = "Speed-up over plain decoding (decode tok/s ÷ baseline's), per suite"
    ups = speedups(receipt)
    modes = [m for m in modes_of(receipt) if m != "baseline" and m in ups]
    suites = suites_of(receipt)
    if not modes:
        _note(ax, title, f"speed-ups: {NOT_RECORDED}")
        return
    colors = _colors(receipt)
    width = 0.8 / len(modes)
    for j, mode in enumerate(modes):
        xs = [i - 0.4 + width * (j + 0.5) for i, s in enumerate(suites) if s in ups[mode]]
        ys = [ups[mode][s] for s in suites if s in ups[mode]]
        bars = ax.bar(xs, ys, width * 0.92, label=mode, color=colors[mode])
        ax.bar_label(bars, labels=[f"{y:.2f}×" for y in ys], fontsize=7, padding=2)
    ax.axhline(1.0, color="black", linewidth=1, linestyle="--", label="plain decoding (1.0)")
    ax.set_xticks(range(len(suites)), suites)
    ax.set_xlim(-0.5, len(suites) - 0.5)
    top = max(max(v.values()) for v in ups.values() if v)
    ax.set_ylim(0, max(top, 1.0) * 1.15)
    ax.set_ylabel("speed-up (×)")
    trials = (receipt.get("settings") or {}).get("trials")
    ax.set_title(title + (f", median of {trials} trials" if trials else ""), loc="left")
    ax.legend(fontsize=8, ncols=min(len(modes) + 1, 6), loc="upper left")
    ax.grid(axis="y", alpha=0.3)


def draw_acceptance(ax, receipt: dict) -> None:
    title = "Acceptance per draft position (share of rounds whose i-th draft was accepted)"
    hists = accept_histograms(receipt)
    if hists is None:
        _note(
            ax,
            title,
            f"acceptance per draft position: {NOT_RECORDED}\n(it predates per-round accept "
            "counts; a new `outrider benchmark --json` run records them)",
        )
        return
    modes = [m for m in modes_of(receipt) if hists.get(m)]
    if not modes:
        _note(ax, title, "no drafting mode in this receipt: plain decoding accepts no drafts")
        return
    caps = caps_of(receipt)
    colors = _colors(receipt)
    positions = {m: caps.get(m) or len(hists[m]) - 1 for m in modes}
    most = max(max(positions.values()), 1)
    width = 0.8 / len(modes)
    for j, mode in enumerate(modes):
        counts = hists[mode]
        shares = position_acceptance(counts, positions[mode])
        xs = [i + 1 - 0.4 + width * (j + 0.5) for i in range(len(shares))]
        label = (
            f"{mode} (cap {positions[mode]}, mean accept {mean_accept(counts):.2f}, "
            f"{sum(counts)} rounds)"
        )
        ax.bar(xs, shares, width * 0.92, label=label, color=colors[mode])
    ax.set_xticks(range(1, most + 1))
    ax.set_xlim(0.5, most + 0.5)
    ax.set_ylim(0, 1.05)
    ax.set_xlabel("draft position")
    ax.set_ylabel("share of rounds accepted")
    ax.set_title(title + ", all suites", loc="left")
    ax.legend(fontsize=8, loc="upper right")
    ax.grid(axis="y", alpha=0.3)


def draw_timeline(ax, receipt: dict) -> None:
    colors = _colors(receipt)
    timeline = timeline_of(receipt)
    if timeline is not None:
        for mode in modes_of(receipt) + [m for m in timeline if m not in modes_of(receipt)]:
            points = timeline.get(mode)
            if not points:
                continue
            xs, ys = zip(*points)
            color = colors.get(mode, BASELINE_COLOR)
            ax.plot(xs, ys, "o-", color=color, label=mode, markersize=3, linewidth=0.7)
        ax.set_xlabel("seconds since the first timed run began")
        ax.set_title("Decode tok/s of every timed run, in the order they ran", loc="left")
    else:
        trials = trial_series(receipt)
        if trials is None:
            _note(ax, "Decode tok/s over time", f"tokens/s over time: {NOT_RECORDED}")
            return
        labels, series = trials
        for mode, values in series.items():
            xs = [i for i, v in enumerate(values) if v is not None]
            ys = [v for v in values if v is not None]
            ax.plot(xs, ys, "o-", color=colors.get(mode), label=mode, markersize=4, linewidth=1)
        ax.set_xticks(range(len(labels)), labels, rotation=45, ha="right", fontsize=8)
        ax.set_xlabel("trial, suite (in run order)")
        ax.set_title(
            f"Decode tok/s per trial and suite, in run order (per-run timeline {NOT_RECORDED})",
            loc="left",
        )
    ax.set_ylim(bottom=0)
    ax.set_ylabel("decode tok/s")
    ax.legend(fontsize=8, ncols=3, loc="lower right")
    ax.grid(alpha=0.3)


PANELS = (draw_speedup, draw_acceptance, draw_timeline)
# whether each panel has a chart to draw (else a one-line note, drawn short)
SHOWN = (
    lambda r: any(m != "baseline" for m in speedups(r)),
    lambda r: any((accept_histograms(r) or {}).values()),
    lambda r: timeline_of(r) is not None or trial_series(r) is not None,
)
NOTE_HEIGHT = 0.3


def heading(receipt: dict) -> str:
    model = (receipt.get("model") or {}).get("id") or "?"
    device = receipt.get("device") or {}
    where = device.get("chip") or "?"
    if device.get("backend"):
        where += f" ({device['backend']})"
    created = str(receipt.get("created") or "")[:10]
    return " · ".join(p for p in ("outrider benchmark", model, where, created) if p)


def _figure(size: tuple[float, float], heights: list[float] | None = None):
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise OutriderError(NEEDS_MATPLOTLIB) from None
    fig = Figure(figsize=size, layout="constrained")
    FigureCanvasAgg(fig)
    rows = len(heights or [1])
    return fig, fig.subplots(rows, 1, squeeze=False, height_ratios=heights)[:, 0]


def _rc():
    try:
        import matplotlib
    except ImportError:
        raise OutriderError(NEEDS_MATPLOTLIB) from None
    # SVG text stays text (searchable, small; the viewer's sans-serif font draws it) and the
    # output is the same from one run to the next.
    return matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "outrider"})


def _save(fig, target, fmt: str) -> None:
    metadata = {"Date": None} if fmt == "svg" else {"Software": None}
    fig.savefig(target, format=fmt, dpi=100, metadata=metadata)


def write_plot(receipt: dict, path: str | Path) -> Path:
    """All three charts in one figure, as PNG or SVG by the file's extension."""
    fmt = plot_format(path)
    check_receipt(receipt)
    with _rc():
        heights = [1.0 if shown(receipt) else NOTE_HEIGHT for shown in SHOWN]
        fig, axes = _figure((11, 4.5 * sum(heights)), heights)
        for ax, draw in zip(axes, PANELS):
            draw(ax, receipt)
        fig.suptitle(heading(receipt), fontsize=13)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        _save(fig, path, fmt)
    return path


def panel_svgs(receipt: dict) -> list[str]:
    """Each chart as an inline `<svg>` element (no XML prolog)."""
    out = []
    with _rc():
        for draw, shown in zip(PANELS, SHOWN):
            fig, (ax,) = _figure((10, 4.6 if shown(receipt) else 4.6 * NOTE_HEIGHT))
            draw(ax, receipt)
            buf = io.StringIO()
            _save(fig, buf, "svg")
            text = buf.getvalue()
            out.append(text[text.index("<svg") :])
    return out


# --- the HTML page -------------------------------------------------------------------------------

CSS = """
body { font-family: system-ui, sans-serif; max-width: 1000px; margin: 2em auto; color: #222;
  padding: 0 1em; }
h1 { font-size: 1.4em; } h2 { font-size: 1.15em; margin-top: 1.6em; }
table { border-collapse: collapse; font-size: 0.9em; }
th, td { padding: 0.25em 0.7em; border-bottom: 1px solid #ddd; }
td.n, th.n { text-align: right; font-variant-numeric: tabular-nums; }
tr.first td { border-top: 2px solid #999; }
.up { color: #157a2c; font-weight: 600; }
pre { background: #f5f5f5; padding: 0.6em; white-space: pre-wrap; word-break: break-all; }
figure { margin: 1em 0; } svg { max-width: 100%; height: auto; }
dl { display: grid; grid-template-columns: max-content auto; gap: 0.2em 1em; }
dt { font-weight: 600; } dd { margin: 0; }
"""


def captions(receipt: dict) -> list[str]:
    """What each chart shows, under it in the HTML page (none under a "not recorded" note)."""
    timeline = (
        "Decode tok/s of each timed run against the benchmark's clock: drift of the machine, a "
        "slow first run, or one arm's outliers show here."
        if timeline_of(receipt) is not None
        else "Decode tok/s of each trial on each suite (pooled over its prompts), in the order "
        "they ran; this receipt predates the per-run timeline."
    )
    texts = (
        "Decode speed of each mode over plain decoding's (baseline), on the same suite in the "
        "same run; the dashed line is plain decoding. Above it is faster.",
        "For each drafting mode: the share of its rounds in which the i-th drafted token was "
        "accepted (it and every draft before it matched the target's own choice), over all "
        "suites and trials.",
        timeline,
    )
    return [text if shown(receipt) else "" for text, shown in zip(texts, SHOWN)]


def _esc(value: Any) -> str:
    return html.escape("" if value is None else str(value))


def _facts(receipt: dict) -> str:
    model = receipt.get("model") or {}
    device = receipt.get("device") or {}
    settings = receipt.get("settings") or {}
    versions = receipt.get("versions") or {}
    quant = model.get("quantization")
    rows = [
        (
            "model",
            f"{model.get('id', '?')} ({model.get('model_type') or '?'}, "
            f"{model.get('dtype') or '?'}"
            + (
                f", {quant.get('bits')}-bit"
                if isinstance(quant, dict) and quant.get("bits")
                else ""
            )
            + ")",
        ),
        (
            "device",
            f"{device.get('chip') or '?'} · {device.get('backend') or '?'}"
            + (f" · {device['memory_gb']} GB" if device.get("memory_gb") else ""),
        ),
        ("software", ", ".join(f"{k} {v}" for k, v in versions.items() if v)),
        (
            "settings",
            ", ".join(
                f"{k} {settings[k]}"
                for k in ("trials", "max_tokens", "drafter_bits", "attention")
                if settings.get(k) is not None
            ),
        ),
        ("created", receipt.get("created")),
    ]
    items = "".join(f"<dt>{_esc(k)}</dt><dd>{_esc(v)}</dd>" for k, v in rows if v)
    return f"<dl>{items}</dl>"


def _table(receipt: dict) -> str:
    caps = caps_of(receipt)
    head = (
        "suite",
        "mode",
        "cap",
        "accept",
        "decode tok/s",
        "speed-up",
        "TTFT ms",
        "peak GB",
        "tokens",
    )
    numeric = set(head[2:])
    out = ["<table><thead><tr>"]
    out += [f'<th class="{"n" if h in numeric else ""}">{_esc(h)}</th>' for h in head]
    out.append("</tr></thead><tbody>")
    results = receipt["results"]
    for i, row in enumerate(results):
        first = i == 0 or results[i - 1]["suite"] != row["suite"]
        up = row.get("speedup")
        speed = "—" if up is None else f"{up:.2f}×"
        if up is not None and up >= 1.0 and row["mode"] != "baseline":
            speed = f'<span class="up">{speed}</span>'
        cells = [
            _esc(row["suite"]) if first else "",
            _esc(row["mode"]),
            _esc(caps.get(row["mode"]) or "—"),
            f"{row.get('accept_len', 0.0):.2f}",
            f"{row.get('decode_tps', 0.0):.1f}",
            speed,
            f"{row.get('ttft_s', 0.0) * 1e3:.1f}",
            f"{row.get('peak_memory_gb', 0.0):.2f}",
            _esc(row.get("tokens", "")),
        ]
        cls = ' class="first"' if first and i else ""
        out.append(f"<tr{cls}>")
        out += [f'<td class="{"n" if h in numeric else ""}">{c}</td>' for h, c in zip(head, cells)]
        out.append("</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def render_html(receipt: dict) -> str:
    """One self-contained page: the facts, the lossless line, three inline SVG charts, the
    table. No scripts, no external files."""
    from .table import summary_line

    check_receipt(receipt)
    svgs = panel_svgs(receipt)
    lossless = receipt.get("lossless")
    figures = "".join(
        f"<figure>{svg}<figcaption>{_esc(caption)}</figcaption></figure>"
        for svg, caption in zip(svgs, captions(receipt))
    )
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{_esc(heading(receipt))}</title><style>{CSS}</style></head><body>"
        f"<h1>{_esc(heading(receipt))}</h1>{_facts(receipt)}"
        f"<pre>{_esc(receipt.get('command') or '')}</pre>"
        + (f"<p>{_esc(summary_line(lossless))}</p>" if isinstance(lossless, dict) else "")
        + f"<h2>Charts</h2>{figures}<h2>Results</h2>{_table(receipt)}</body></html>\n"
    )


def write_html(receipt: dict, path: str | Path) -> Path:
    page = render_html(receipt)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page, encoding="utf-8")
    return path
