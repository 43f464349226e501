"""Draw measured verify-cost curves: what `--max-draft auto` and the batch scheduler read.

Each calibration (`outrider calibrate --json`, or a file from outrider's calibration cache) is
one panel: the time of a verify forward of w tokens, w = 1..16, at each measured context
length, with the plain decoding step (dashed) and the drafter's call (dotted) at the same
scale. A speculative round pays the drafter's call plus one verify forward, and commits the
accepted drafts plus one token; where that costs more than those tokens' plain steps, speculation
loses, and auto parks it. `--verify-receipt` adds a panel of a `benchmarks/quantized_verify.py`
receipt (verify forwards with and without padding to 8 rows).

    outrider calibrate --mode dspark --json > demo.json
    python scripts/plot_costs.py demo.json --out docs/images/cost_curves.png
    python scripts/plot_costs.py demo.json smollm2.json \\
        --verify-receipt docs/receipts/quantized_verify_8b_h200.json --out docs/images/cost_curves.png
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def calibration_panel(ax, cal: dict) -> None:
    key = cal["key"]
    widths = None
    for context, costs in sorted(cal["verify_ms"].items(), key=lambda kv: int(kv[0])):
        widths = list(range(1, len(costs) + 1))
        (line,) = ax.plot(
            widths, costs, marker="o", markersize=3, label=f"verify, context {context}"
        )
        plain = cal.get("plain_ms", {}).get(context)
        if plain is not None:
            ax.axhline(plain, color=line.get_color(), linestyle="--", linewidth=0.8)
    if cal.get("draft_ms") and widths:
        ax.axhline(cal["draft_ms"], color="gray", linestyle=":", label="drafter call")
    ax.set_xlabel("verify width w (anchor + drafts)")
    ax.set_ylabel("ms")
    where = key.get("device_name") or key.get("device", "?")
    drafter = f" + {key['drafter']}" if key.get("drafter") else ""
    ax.set_title(f"{key.get('target')}{drafter} · {where} · mlx {key.get('mlx')}", fontsize=9)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7, title="dashed: a plain step at that context", title_fontsize=7)
    ax.grid(alpha=0.3)


def receipt_panel(ax, receipt: dict, name: str) -> None:
    for label, costs in receipt["forward"].items():
        widths = sorted(int(w) for w in costs)
        pad = label.removeprefix("pad_")
        shown = "unpadded" if pad == "0" else f"padded to {pad} rows"
        ax.plot(widths, [costs[str(w)] for w in widths], marker="o", markersize=3, label=shown)
    ax.set_xlabel("verify width w")
    ax.set_ylabel("ms")
    ax.set_title(f"{name} · mlx {receipt.get('mlx')}", fontsize=9)
    ax.set_ylim(bottom=0)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("calibrations", nargs="*", type=Path, help="calibration JSON files")
    ap.add_argument("--verify-receipt", type=Path, help="a benchmarks/quantized_verify.py JSON")
    ap.add_argument("--receipt-name", default="random-weight Qwen3-8B shape, 4-bit, NVIDIA H200")
    ap.add_argument("--out", type=Path, required=True, help="the image (.png or .svg)")
    args = ap.parse_args()
    if not args.calibrations and not args.verify_receipt:
        raise SystemExit("nothing to draw: give calibration files and/or --verify-receipt")

    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    panels = len(args.calibrations) + bool(args.verify_receipt)
    fig = Figure(figsize=(7, 3.2 * panels), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(panels, 1, squeeze=False)[:, 0]
    for ax, path in zip(axes, args.calibrations):
        calibration_panel(ax, json.loads(path.read_text()))
    if args.verify_receipt:
        receipt_panel(axes[-1], json.loads(args.verify_receipt.read_text()), args.receipt_name)
    fig.savefig(args.out, dpi=110, metadata={"Software": None})
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
