"""What the fuzzer aims at and what it sends."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class FuzzTarget:
    """What the seeds name: the served model id, the folder /admin/load reloads, the API key."""

    model: str
    path: str
    api_key: str | None = None


@dataclass
class FuzzRequest:
    """One HTTP request: `route` is the report's label (the seed's route, "(unknown route)" or
    "(wrong method)"), `mutations` says what was done to the seed."""

    route: str
    method: str
    path: str
    body: bytes | None
    headers: dict[str, str]
    mutations: list[str] = field(default_factory=list)
    chunked: bool = False
    index: int = 0
