"""Pipelined rounds' gate: whether a greedy round is queued behind the one in flight
(core/loop.py `decode`), from what a kept and a dropped queued round cost on this machine."""

from __future__ import annotations

from .device import computes_on_host, pipelined_rounds
from .schedule import OUTLIER

HOLD_PRIOR = 0.5  # a generation's first rounds: as likely to hold as not
HOLD_EMA = 0.25  # weight of the newest round in the running hold rate and the timings
PRIOR_NEED = 0.6  # the hold rate asked for before a round has been timed
KINDS = ("alone", "held", "dropped")  # how a timed round began (`AheadGate.timed`)
RECHECK_HOLD = 0.9  # guesses holding this often, yet not queued: queue one now and then...
RECHECK_EVERY = 32  # ...after this many rounds, so a `held` cost timed slow is timed again


class AheadGate:
    """Whether to queue the next round before this one is read, from what both outcomes cost.

    A round costs `alone` seconds when nothing is queued, `held` when it was queued behind the
    one before and the guess held, `dropped` when the round before queued one for nothing
    (that forward ran on the device while this round waited). Queueing pays while the share p
    of guesses that hold satisfies p·held + (1 - p)·dropped < alone, i.e. p above
    `need` = (dropped - alone) / (dropped - held). The hold rate counts every round, queued or
    not (the guess is checked against what the round committed), so a generation that
    stopped queueing notices when its text turns easy again. `always`
    (OUTRIDER_PIPELINED_ROUNDS=on) skips the gate.

    The three costs are timed in the loop, whole rounds from start to result (`timed`); until
    one is, a model stands in, from H (the host's launch of a round, timed on every launch) and
    R (a round alone, launch to result), the device's part being D = R - H. On a GPU a kept
    round hides min(H, D) and one queued for nothing costs the device's D while the host builds
    the right round in H, so max(D - H, 0) more. On MLX's CPU backend (`shared`) the device is
    the host's own cores, and launching a round already computes much of it (measured with
    the demo pair on 2 cores: H 17-19 ms of an 18-23 ms round): a kept round hides at most the
    wait D, and one queued for nothing costs about a whole round R. (That rule queued the demo
    pair's DSpark blocks on the CPU at a hold rate of one half under the GPU's model, and took
    code's 1.97x to 1.35x.) On an H100 the GPU's model was wrong too: with the demo pair a round
    after a dropped one took 9 ms against 4.3 ms alone and 3.4-4.7 ms held (`step_times.py`),
    where the model said about 5 ms, so queueing at the model's hold rate of 0.4 slowed DSpark
    on chat to 0.55x of plain decoding. The timed costs replace the model's as they come in,
    and a pipeline keeps its gate across generations (`new_generation`), so what one answer
    measured the next one reads. Where guesses nearly always hold but a held round was timed
    no cheaper than one alone (two costs within noise of each other), the gate still queues
    one round in `RECHECK_EVERY`, so one slow reading cannot stop queueing for good."""

    def __init__(self, always: bool = False, shared: bool = False) -> None:
        self.always = always
        self.shared = shared
        self.hold = HOLD_PRIOR
        self.host: float | None = None  # seconds to launch a round (H), running mean
        self.round: float | None = None  # seconds of an unpipelined round (R), running mean
        self.took: dict[str, float] = {}  # kind (KINDS) -> seconds a whole round, running mean
        self.waited = 0  # rounds not queued since the last one that was

    @classmethod
    def for_this_device(cls, kept: AheadGate | None = None) -> AheadGate | None:
        """The gate OUTRIDER_PIPELINED_ROUNDS asks for: None when off; `kept` (a pipeline's,
        from its earlier generations) when given, starting a new generation."""
        choice = pipelined_rounds()
        if choice == "off":
            return None
        if kept is None:
            return cls(always=choice == "on", shared=computes_on_host())
        kept.always, kept.shared = choice == "on", computes_on_host()
        kept.new_generation()
        return kept

    def new_generation(self) -> None:
        """Another text: its guesses hold as often as they will (the costs carry over)."""
        self.hold = HOLD_PRIOR

    def costs(self) -> tuple[float, float, float] | None:
        """Seconds a round (alone, held, dropped): timed where timed, else the model's."""
        if self.host is None or self.round is None:
            if len(self.took) < len(KINDS):
                return None
        r, h = self.round or 0.0, self.host or 0.0
        d = max(r - h, 0.0)
        if self.shared:
            model = (r, r - d, 2 * r)
        else:
            model = (r, r - min(h, d), r + max(d - h, 0.0))
        alone, held, dropped = (self.took.get(k, m) for k, m in zip(KINDS, model))
        return alone, held, dropped

    @property
    def need(self) -> float:
        """The hold rate above which queueing pays (1.0: it never does here)."""
        costs = self.costs()
        if costs is None:
            return PRIOR_NEED
        alone, held, dropped = costs
        if dropped <= alone:
            return 0.0
        if held >= alone:
            return 1.0
        return (dropped - alone) / (dropped - held)

    def wanted(self) -> bool:
        """Whether to queue the next round now (counted: a run of rounds not queued on
        guesses that hold ends in one that is, `RECHECK_EVERY`)."""
        recheck = self.hold >= RECHECK_HOLD and self.waited >= RECHECK_EVERY
        if self.always or self.hold > self.need or recheck:
            self.waited = 0
            return True
        self.waited += 1
        return False

    def learn(self, held: bool | None) -> None:
        """A round settled: would a round queued behind it have held (None: no guess)."""
        if held is not None:
            self.hold += HOLD_EMA * (float(held) - self.hold)

    def timed_launch(self, seconds: float) -> None:
        self.host = _ema(self.host, seconds)

    def timed_round(self, seconds: float) -> None:
        """A round that ran alone, from its launch to its result."""
        self.round = _ema(self.round, seconds)

    def timed(self, kind: str, seconds: float) -> None:
        """A whole round of `kind` (KINDS), from the loop's start of it to its rollback. One
        slow round (a kernel's first compile) moves the estimate by a bounded step."""
        old = self.took.get(kind)
        if old is not None:
            seconds = min(seconds, OUTLIER * old)
        self.took[kind] = _ema(old, seconds)


def _ema(old: float | None, new: float) -> float:
    return new if old is None else old + HOLD_EMA * (new - old)
