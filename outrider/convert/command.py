"""The `outrider convert` command: read a drafter in any packaging outrider reads (a DSpark GGUF
included), write it as a plain DeepSpec checkpoint a user can publish."""

from __future__ import annotations

from pathlib import Path

import typer

# What a converted folder holds; with --force these are replaced, nothing else is touched.
WRITTEN = ("config.json", "model.safetensors", "model.safetensors.index.json")


def convert(
    src: str = typer.Argument(
        ..., help="Drafter: folder, repo id, .gguf file or gguf:<owner>/<repo>/<file>.gguf."
    ),
    out: str = typer.Option(..., "--out", "-o", help="Folder for the DeepSpec checkpoint."),
    target: str | None = typer.Option(
        None, "--target", help="Target folder or repo id, for drafters that use its embed/head."
    ),
    force: bool = typer.Option(False, "--force", help="Write into a non-empty --out."),
) -> None:
    """Write a drafter as a DeepSpec checkpoint (config.json + model.safetensors)."""
    from ..cli_common import user_errors

    with user_errors():
        lines = convert_drafter(src, Path(out).expanduser(), target, force)
    for line in lines:
        typer.echo(line)


def convert_drafter(src: str, out: Path, target: str | None, force: bool) -> list[str]:
    """Convert `src` into `out`; returns the lines that say what was written."""
    from ..cli_common import plugins
    from ..core.checkpoint import Checkpoint
    from ..core.errors import OutriderError
    from ..core.gguf_drafter import (
        check_loadable,
        publish_atomically,
        read_gguf_checkpoint,
        write_deepspec_folder,
    )
    from ..core.gguf_header import is_gguf
    from ..core.hub import resolve_model
    from ..loaders import detect_format
    from ..plugins.formats.deepspec import DeepSpecFormat
    from .deepspec import deepspec_checkpoint

    if out.exists() and not out.is_dir():
        raise OutriderError(f"--out {out} is a file, not a folder")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise OutriderError(f"--out {out} is not empty; pass --force to write into it")
    path = resolve_model(src, "drafter")
    if is_gguf(path):  # read directly: no cache entry for an explicit conversion
        fmt, checkpoint = DeepSpecFormat(), read_gguf_checkpoint(path)
        packaging = "DSpark GGUF"
    else:
        fmt, checkpoint = detect_format(plugins(), path)
        packaging = fmt.name
    spec = fmt.translate(checkpoint)
    shares_target = not (spec.own_embedding and spec.own_lm_head)
    target_path = resolve_model(target, "model") if target and shares_target else None
    config, weights, notes = deepspec_checkpoint(spec, target_path)
    check_loadable(Checkpoint(out, config, weights))

    def write(folder: Path) -> None:
        write_deepspec_folder(folder, config, weights)

    if out.is_dir() and any(out.iterdir()):  # --force: replace only what a checkpoint reads
        for stale in [*out.glob("*.safetensors"), out / "config.json", out / WRITTEN[2]]:
            if stale.is_file():
                stale.unlink()
        write(out)
    else:
        if out.is_dir():
            out.rmdir()  # empty: the finished folder takes its place in one rename
        publish_atomically(out, write)
    size = (out / "model.safetensors").stat().st_size
    heads = ", ".join(
        h
        for h, on in (
            (f"{spec.markov_type} Markov head r={spec.markov_rank}", spec.markov_rank > 0),
            ("confidence head", spec.confidence_head),
        )
        if on
    )
    return [
        f"read {src}: {packaging} {spec.kind} drafter, {spec.num_layers} layers, block "
        f"{spec.block_size} ({spec.max_draft} drafts a call)" + (f", {heads}" if heads else ""),
        *(f"note: {n}" for n in notes),
        f"wrote {out}: config.json, model.safetensors ({len(weights)} tensors, "
        f"{size / 1e6:.1f} MB) in DeepSpec's layout (Qwen3DSparkModel)",
    ]
