"""Held-out acceptance: the real decode loop, greedy, on prompts the drafter never trained on.

The drafter is read back from its folder through the DeepSpec format plugin and built by the
dspark / dflash strategy exactly as `outrider generate --drafter DIR` would, so the number also
proves the checkpoint loads and runs.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..api import pipeline_from_parts
from ..core.drafter_spec import DrafterSpec
from ..core.plugins import Plugins
from ..core.target import Target
from ..loaders import load_drafter


@dataclass
class Acceptance:
    """Mean accept length (accepted drafts + 1 per target forward, averaged over rounds)."""

    mean_accept_len: float
    rounds: int
    tokens: int
    per_prompt: list[float] = field(default_factory=list)
    outputs: list[list[int]] = field(default_factory=list, repr=False)

    def to_json(self) -> dict:
        out = asdict(self)
        out.pop("outputs")
        out["mean_accept_len"] = round(self.mean_accept_len, 4)
        out["per_prompt"] = [round(x, 4) for x in self.per_prompt]
        return out


def acceptance(
    target: Target,
    spec: DrafterSpec,
    prompts: list[list[int]],
    max_tokens: int,
    plugins: Plugins | None = None,
) -> Acceptance:
    """Greedy generation of every prompt with the drafter (unquantised, full block)."""
    plugins = plugins or Plugins()
    strategy = plugins.strategy(spec.kind)
    proposer = strategy.build(target, spec, {"drafter_bits": 16, "confidence_threshold": 0.0})
    pipe = pipeline_from_parts(target, proposer, mode=spec.kind)
    rounds = accepted = tokens = 0
    per_prompt, outputs = [], []
    for prompt in prompts:
        result = pipe.generate(list(prompt), max_tokens=max_tokens)
        rounds += len(result.rounds)
        accepted += sum(r.accepted + 1 for r in result.rounds)
        tokens += len(result.tokens)
        per_prompt.append(result.mean_accept_len)
        outputs.append(result.tokens)
    mean = accepted / rounds if rounds else 0.0
    return Acceptance(mean, rounds, tokens, per_prompt, outputs)


def checkpoint_acceptance(
    target: Target,
    path: Path,
    prompts: list[list[int]],
    max_tokens: int,
    plugins: Plugins | None = None,
) -> Acceptance:
    """Acceptance of the drafter saved at `path`, loaded the way `--drafter` loads it."""
    plugins = plugins or Plugins()
    spec = load_drafter(plugins, str(path), download=False)
    return acceptance(target, spec, prompts, max_tokens, plugins)


def plain_outputs(target: Target, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """The target's own greedy outputs (baseline mode), to check the drafter changed nothing."""
    plugins = Plugins()
    proposer = plugins.strategy("baseline").build(target, None, {})
    pipe = pipeline_from_parts(target, proposer, mode="baseline", max_draft=0)
    return [pipe.generate(list(p), max_tokens=max_tokens).tokens for p in prompts]
