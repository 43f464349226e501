"""`--max-draft auto`: each round's cap from what this machine and this generation measure.

A round that drafts k tokens costs c(k) seconds (drafter + a verify forward of k+1 rows + the
sync) and commits E(k) = 1 + s_1 + ... + s_k tokens on average, where s_j is the chance that the
first j drafts are all accepted. The policy picks the k that maximises E(k) / c(k), and drafts
nothing (a plain step, k = 0) when no k beats plain decoding's 1 / c(0): speculation is parked,
then probed again after `probe_every` plain steps, because acceptance changes with the text. The
interval doubles while probes keep saying no, up to what keeps a failed probe's cost under
`PROBE_BUDGET` of the plain steps around it (a few dozen steps on a launch-bound GPU, where a
probe costs about one extra forward; hundreds on a CPU, where every verify row costs), and
falls back to `probe_every` when a probe's drafts are all accepted (the text may have turned
easy; one such probe moves the acceptance estimate only a little). A probe drafts the cap that
would pay were the text easy to draft (one draft where none would), its drafts past the
first cut to what the plain steps since the last probe can afford to lose (`affordable`): on
a CPU, where every verify row costs about a plain step, early probes draft one token and only
a long parked run affords the full cap. One policy serves every
generation of a pipeline, so what it measured carries over; a new generation that finds it
parked probes after `probe_every` steps again, because the text that parked it was another.
Over all of that, a probe bank keeps failed probes within PROBE_BUDGET of the plain steps:
each parked step pays in PROBE_BUDGET of its cost, each probe takes out what it lost,
measured (the drafter taking in what it missed while parked included), and a probe waits
until the bank holds one (`probe_due`).

Acceptance moves slowly (`ACCEPT_EMA`) and the first `LEARN` drafting rounds run at the start
cap: the opening tokens of an answer are often the hardest to draft, and a handful of them must
not park a drafter that pays over the rest. The first drafting round after plain steps is not
timed: a model drafter first catches up on the plain tokens' hidden states there, a cost the
rounds that follow do not pay. A round that keeps all its k drafts lifts the estimate at
position k+1 a little (`OPTIMISM`): no round at cap k reaches that position, so without it a
policy that hard text (a chat) left at a small cap would stay there on easy text (code, math)
that follows it in the same pipeline. A probe's acceptance weighs more than a drafting
round's (`PROBE_EMA`): it samples text the estimates have not seen for tens of steps, and at
the drafting rounds' weight a drafter parked by hard text took several probes, spaced ever
further apart, to notice easy text (benchmarks/policy_replay.py measured both).

With a calibration (core/calibration.py: the verify cost at every width, measured once per
machine and model), c(k) comes from its curve at the current context length, scaled by what
live rounds cost against it, and no plain steps are spent measuring plain decoding. Drafting
rounds of every cap share one live scale (plain steps, pipelined, have their own): the curve
already says how cost moves with width, and what live rounds add (a busy host, the sync) moves
every width alike. A scale per cap went stale: a cap whose few rounds ran slow (a kernel
compile, a busy minute) kept that estimate, was never chosen again, so never re-measured, and
on the H200 a cap-7 round read 3x its curve while cap 4 read 1.9x and plain steps 1.6x. Without
one, both halves are measured on the fly: c(k) is a running mean of this row's round times at each
k (a straight line through the measured ks estimates the others), and s_j comes from running
per-position acceptance (the chance that draft j is accepted once drafts 1..j-1 were). The cap
only decides how many drafts are verified, never which token is committed, so every choice is
lossless. A timed round moves a cost estimate by a bounded step (`OUTLIER`): on a GPU the first
round at a new verify width can pay a kernel compile hundreds of times its cost, and the policy
is shared by every generation of a pipeline. Plain steps come by the dozen, so theirs is the
median of the latest `PLAIN_WINDOW`: a burst of slow steps moves it a rank or two. Whether a
machine is hopeless for drafting (no cap pays even at full acceptance) is read off the
calibration alone, never off live rounds.

A batch's rounds add a second, later cut (`core/batch_schedule.py`, DSpark's prefix
scheduler): after every row has drafted, each row verifies only the drafts worth widening the
batch's one padded forward for. Whether a greedy round is queued behind the one in flight is
`core/ahead_gate.py`'s.
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .round import Step

EMA = 0.25  # weight of the newest cost measurement
OUTLIER = 2.0  # a timed round counts as at most this factor off the running estimate
PLAIN_WINDOW = 32  # a plain step costs the median of this many latest timed steps
ACCEPT_EMA = 0.15  # weight of the newest round in the acceptance estimates
PROBE_EMA = 0.4  # a probe's weight: it samples text the estimates have not seen for a while
LEARN = 6  # drafting rounds at the start cap (after the warm-up ones) before the first choice
MARGIN = 1.03  # a cap must beat plain decoding by 3% to be worth its variance
MAX_INTERVAL = 256  # plain steps between probes, at most
PROBE_ACCEPT = 0.9  # a probe drafts the cap that would pay at this acceptance (else one)
PROBE_BUDGET = 0.015  # a failed probe may cost at most this share of the plain steps before it
PRIOR_ACCEPT = 0.7  # a draft position's acceptance before any round has reached it
BANKED_PROBES = 1.5  # failed probes' losses the probe bank holds at most (above 1: one fits)
PROBE_OUTLIER = 4.0  # a probe counts as losing at most this many times what probes have lost
OPTIMISM = 0.25  # a round that keeps all k drafts lifts position k+1 by this share of a hit


@dataclass
class AutoCap:
    """The cap policy of one generation (one row)."""

    ceiling: int  # the most the proposer drafts a round
    start: int = 4  # the cap of the first rounds (while nothing is measured)
    probe_every: int = 16  # plain steps before the first probe once parked
    warmup: int = 2  # first rounds at each k: compile and cache warm-up, not timed
    # k drafted -> seconds a round (without a calibration)
    costs: dict[int, float] = field(default_factory=dict)
    # with a calibration: drafting round? -> live time over the calibrated curve at the context
    # it ran at (so what was measured short carries to long contexts), one scale for all caps
    scale: dict[bool, float] = field(default_factory=dict)
    # a lookup copy's round: live time over the calibrated verify of its rows (None: none
    # timed yet); a copy's verify carries the drafter's intake, not a drafted block
    copy_scale: float | None = None
    rounds: dict[int, int] = field(default_factory=dict)  # k drafted -> rounds seen
    # the latest timed plain steps (over the curve with a calibration, else seconds): their
    # median is the plain step's cost (`_timed`)
    plain_steps: deque = field(default_factory=lambda: deque(maxlen=PLAIN_WINDOW))
    drafting: int = 0  # rounds that drafted something
    accept: list[float] = field(default_factory=list)  # per position: P(accept | reached)
    parked: int = 0  # plain steps since the last probe (or since parking)
    interval: int = 0  # plain steps between probes now
    catching_up: bool = False  # plain steps ran since the last drafting round
    probing: bool = False  # the round chosen last is a probe
    # seconds a step spends outside the loop (whoever consumes the generation: detokenising,
    # streaming, the benchmark's bookkeeping), once per step whatever it commits; running mean
    outside: float = 0.0
    # seconds a parked run's first plain step costs beyond a steady one (it waits for a forward
    # nothing queued ahead); running mean, what a copy breaking a run adds to its cost
    restart: float = 0.0
    restarts: int = 0  # parked runs' first steps timed
    # Costs measured up front on this machine (core/calibration.py), and the context length
    # the next round runs at: live measurements rescale the calibrated curve instead of a line.
    calibration: Any = None
    context: int | None = None
    probes: int = 0  # probes taken since the policy began
    # seconds failed probes may still lose (`probe_due`): parked plain steps pay in
    # PROBE_BUDGET of their cost, each probe takes out what it lost; None: full, untouched
    bank: float | None = None
    # what a probe lost, measured (its seconds beyond the plain steps its tokens replaced:
    # the drafter taking in what it missed while parked included); running mean, None: none yet
    probe_loss: float | None = None
    paid: tuple[int, float] = (0, 0.0)  # the last plain run's steps and what they paid in

    def __post_init__(self) -> None:
        self.accept = [PRIOR_ACCEPT] * self.ceiling  # a prior the first rounds overwrite
        self.start = max(1, min(self.start, self.ceiling))
        self.interval = self.probe_every

    def choose(self, limit: int) -> int:
        """The cap for the next round, at most `limit` (tokens left to generate, minus one);
        0 means plain steps (`plain_run` says how many)."""
        limit = min(limit, self.ceiling)
        if limit <= 0:
            return 0
        if self.hopeless(limit):
            return 0
        if self.drafting < self.warmup + LEARN and (
            self.calibration is None or self.best(limit, PROBE_ACCEPT)
        ):
            return min(limit, self.start)  # learn acceptance and a drafting round's cost first
        if self.calibration is None and self.rounds.get(0, 0) < self.warmup + 2:
            return 0  # and plain decoding's (a calibration knows it)
        best = self.best(limit)
        if best:
            self.parked, self.interval = 0, self.probe_every
            return best
        if self.parked >= self.interval and self.probe_due() == 0:  # does drafting pay again?
            steps, self.parked = self.parked, 0
            probe = self.affordable(self.best(limit, PROBE_ACCEPT) or 1, steps)
            self.interval = min(2 * self.interval, self.longest_gap(probe))
            self.probing = True
            self.probes += 1
            return probe
        return 0

    def snapshot(self) -> dict[str, Any]:
        """What the policy believes now, for a receipt: per-position acceptance, each cap's
        round cost (ms, at the last context; with a calibration also the live/calibrated
        ratio), the time outside the loop, rounds seen per cap, probes (what one lost, what the
        bank holds; None: none yet, full), and whether it is parked. Where a benchmark's
        `auto` parked or drafted, this says why."""
        caps = sorted(self.rounds)
        out: dict[str, Any] = {
            "accept": [round(a, 3) for a in self.accept],
            "round_ms": {str(k): round(self.cost(k) * 1e3, 3) for k in range(self.ceiling + 1)},
            "outside_ms": round(self.outside * 1e3, 3),
            "restart_ms": round(self.restart * 1e3, 3),
            "rounds": {str(k): self.rounds[k] for k in caps},
            "probes": self.probes,
            "probe_loss_ms": None if self.probe_loss is None else round(self.probe_loss * 1e3, 3),
            "probe_bank_ms": None if self.bank is None else round(self.bank * 1e3, 3),
            "parked": self.best(self.ceiling) == 0,
        }
        if self.calibration is not None:
            out["live_over_calibrated"] = {
                ("drafting" if k else "plain"): round(v, 3) for k, v in sorted(self.scale.items())
            }
        return out

    def new_generation(self) -> None:
        """Another text starts (a pipeline's policy serves them all): if speculation is
        parked, it probes again after `probe_every` steps (what parked it was another text),
        not at once (an answer's opening tokens are its hardest to draft)."""
        self.parked, self.interval = 0, self.probe_every
        self.probing = False  # a probe the last generation chose and never ran

    def hopeless(self, limit: int) -> bool:
        """Whether this machine's calibration says no cap up to `limit` pays even if every
        draft were accepted (then nothing is worth drafting, learning or probing). It reads
        the calibrated curve alone: live rounds rescale it for `best`, but a verdict nothing
        will revisit must not rest on them (one round that paid a kernel compile would park a
        pipeline's drafter for good)."""
        if self.calibration is None:
            return False
        return not self.best(min(limit, self.ceiling), 1.0, live=False)

    def longest_gap(self, probe: int) -> int:
        """Plain steps between probes at most: enough that a probe at cap `probe` accepting
        nothing costs under PROBE_BUDGET of the steps around it."""
        plain = self.cost(0)
        lost = max(0.0, self.cost(probe) - plain)
        gap = lost / (PROBE_BUDGET * plain) if plain > 0 else MAX_INTERVAL
        return int(max(self.probe_every, min(MAX_INTERVAL, gap)))

    def affordable(self, cap: int, steps: int) -> int:
        """The widest probe up to `cap` whose drafts past the first, should it accept
        nothing, cost at most PROBE_BUDGET of the `steps` plain steps since the last probe.
        Probing at all costs a one-draft round (`longest_gap` spaces those); the width is what
        this bounds. On a launch-bound GPU, where a wider verify costs little more, probes
        keep the full cap; on a CPU, where every verify row costs about a plain step, early
        probes draft one token and only a long parked run affords the cap."""
        allowance = PROBE_BUDGET * steps * self.cost(0)
        one = self.cost(1)
        while cap > 1 and self.cost(cap) - one > allowance:
            cap -= 1
        return cap

    def copy_pays(self, drafts: int, kept: float) -> bool:
        """Whether a lookup copy of `drafts` tokens, whose round should commit `kept` tokens,
        beats the plain steps it interrupts: its round, one plain step (the forward queued past
        the plain run is built and dropped) and what the run after the round pays for starting
        without a forward queued ahead of it (`restart`, measured) against `kept` plain steps,
        by MARGIN. On a launch-bound GPU a short copy of chat text loses there; a long one of
        code pays. Without a calibration a drafting round's live cost (`cost`) stands in for the
        copy's once drafting rounds have been timed; before that every copy is taken: timings
        of pipelined plain steps alone are too rough to turn one down."""
        if self.calibration is None and not self._drafting_timed():
            return True
        plain = self.cost(0)
        return kept / (self.copy_cost(drafts) + plain + self.restart) > MARGIN / plain

    def _drafting_timed(self) -> bool:
        return any(k > 0 for k in self._measured())

    def observe_restart(self, seconds: float) -> None:
        """A parked run's first plain step took `seconds`: it waited for a forward launched just
        before it, where a steady step's forward was queued a step earlier and ran while the
        host worked. What it cost beyond a steady step moves `restart` (the forward's own
        launch is the token's work either way, so it is not counted). A hiccup moves it a
        bounded step: at most OUTLIER plain steps."""
        plain = self._loop_cost(0)
        excess = min(max(0.0, seconds - plain), OUTLIER * plain)
        self.restart += (EMA if self.restarts else 1.0) * (excess - self.restart)
        self.restarts += 1

    def copy_cost(self, drafts: int) -> float:
        """Seconds of a lookup copy's round of `drafts` drafts: with a calibration, its
        verify, times what copy rounds have cost against it here (`observe_copy`; until one
        is timed, the verify alone), plus the time outside the loop. Without a calibration, a
        drafting round's live cost at that many drafts."""
        if self.calibration is None:
            return self.cost(drafts)
        verify = self.calibration.verify_cost(drafts + 1, self.context)
        return verify * (self.copy_scale or 1.0) + self.outside

    def untold(self) -> None:
        """A round has been taught (`round.teach` calls this after each): if `observe` was not
        told of it (a lookup copy took it, the drafter made no drafts, a reasoning budget
        closed or forced it, the batch scheduler set its width), a probe chosen for it did not
        run, so the next drafting round is not charged as one."""
        self.probing = False

    def observe_copy(self, drafts: int, seconds: float) -> None:
        """A lookup copy's round of `drafts` drafts took `seconds` (it teaches acceptance
        nothing: the drafts were not the drafter's)."""
        if self.calibration is None or drafts <= 0:
            return
        curve = self.calibration.verify_cost(drafts + 1, self.context)
        if curve > 0:
            self.copy_scale = self._moved(self.copy_scale, seconds / curve)

    def plain_run(self, remaining: int) -> int:
        """How many plain steps to take now: up to the next probe (at least one)."""
        n = max(1, min(max(self.interval - self.parked, self.probe_due()), remaining))
        self.parked += n
        self.catching_up = True
        self.paid = (n, self._pay_in(n))
        return n

    def plain_unused(self, steps: int) -> None:
        """A plain run ended `steps` short of what `plain_run` granted (a lookup copy turned
        up): they do not count toward the next probe."""
        self.parked -= steps
        granted, paid = self.paid
        if self.bank is not None and granted:  # back what they paid in, not what the cap kept
            self.bank -= paid * min(1.0, steps / granted)

    def probe_due(self) -> int:
        """Parked plain steps still to pay into the probe bank before a probe may run (0: it
        may run now).

        The interval alone let probes cost more than PROBE_BUDGET: it restarts at
        `probe_every` with every generation and doubles from there, so a pipeline answering
        short texts probed two or three times an answer, and a probe costs more than its
        round: it is the first round after plain steps, where a model drafter takes in every
        token it missed (a whole prompt, at a generation's first probe). On the 2-core CPU
        without an optimized BLAS that left DSpark at 0.94x and DFlash at 0.91x of plain
        decoding on the demo pair, drafting 6-9% of the tokens. The bank holds what failed
        probes may lose: each parked step pays in PROBE_BUDGET of its cost, up to
        BANKED_PROBES probes' worth, and each probe takes out what it lost, measured. A full
        bank leaves the intervals as they were (a new text is still probed after
        `probe_every` steps); an empty one spaces probes so that their losses stay within
        the budget."""
        if self.bank is None:
            return 0
        short = self._probe_cost() - self.bank
        earn = PROBE_BUDGET * self.cost(0)
        if short <= 0 or earn <= 0:
            return 0
        return min(MAX_INTERVAL, int(short / earn) + 1)

    def _probe_cost(self) -> float:
        """What a probe loses: the running mean of what probes lost (those that paid for
        themselves count as nothing lost), else a one-draft round over a plain step."""
        if self.probe_loss is not None:
            return self.probe_loss
        return max(0.0, self.cost(1) - self.cost(0))

    def _pay_in(self, steps: int) -> float:
        """`steps` parked steps pay into the bank, up to its cap -> what went in."""
        if self.bank is None:
            return 0.0  # full: the cap moves with the costs measured
        top = max(self.bank, BANKED_PROBES * self._probe_cost())
        before = self.bank
        self.bank = min(top, self.bank + steps * PROBE_BUDGET * self.cost(0))
        return self.bank - before

    def _take_out(self, seconds: float, tokens: int) -> None:
        """A probe took `seconds` in the loop (and the caller's `outside` once) for `tokens`
        committed: what it lost against the plain steps those tokens replaced (each with its
        `outside`) leaves the bank, and teaches what a probe costs. One probe that paid a
        kernel compile counts as at most PROBE_OUTLIER times what probes have lost."""
        lost = max(0.0, seconds + self.outside - tokens * self.cost(0))
        lost = min(lost, PROBE_OUTLIER * max(self._probe_cost(), self.cost(0)))
        first = self.probe_loss is None
        self.probe_loss = lost if first else self.probe_loss + EMA * (lost - self.probe_loss)
        full = BANKED_PROBES * self._probe_cost() if self.bank is None else self.bank
        self.bank = full - lost

    def best(self, limit: int, accept: float | None = None, live: bool = True) -> int:
        """argmax_k E(k) / c(k) over 0..limit (0 unless some k beats plain by MARGIN), with the
        measured acceptance, or with `accept` at every position (a probe's optimistic view:
        the cap that would pay if the text turned easy to draft). `live=False` reads the
        calibrated costs without what live rounds measured."""
        cost = self.cost if live else self.calibrated_cost
        plain = 1.0 / cost(0)
        best_k, best_rate = 0, plain * MARGIN
        survive, expected = 1.0, 1.0
        for k in range(1, limit + 1):
            survive *= self.accept[k - 1] if accept is None else accept
            expected += survive
            rate = expected / cost(k)
            if rate > best_rate:
                best_k, best_rate = k, rate
        return best_k

    def calibrated_cost(self, k: int) -> float:
        """Seconds a round at cap k per the calibration alone (at this context)."""
        return self.calibration.round_cost(k, self.context)

    def cost(self, k: int) -> float:
        """Seconds a round at cap k: measured, else on the line through the measured drafting caps;
        with a calibration, the calibrated curve at this context times what live rounds cost
        against it (they add the host's own work: sampling, acceptance, the sync). Either way
        plus the time a step spends outside the loop (`observe_outside`)."""
        return self._loop_cost(k) + self.outside

    def _loop_cost(self, k: int) -> float:
        if self.calibration is not None:
            return self.calibration.round_cost(k, self.context) * self.scale.get(k > 0, 1.0)
        measured = self._measured()
        if k in measured:
            return measured[k]
        # a drafting round is not a plain step plus drafts (it pays a drafter call and a sync
        # that pipelined plain steps do not): its line goes through drafting rounds only, and
        # with one of them measured, other caps cost the same until measured (so they get tried)
        same = {j: c for j, c in measured.items() if (j > 0) == (k > 0)} or measured
        if not same:
            return 1.0
        if len(same) == 1:
            return next(iter(same.values()))
        xs, ys = list(same), list(same.values())
        mx_, my = sum(xs) / len(xs), sum(ys) / len(ys)
        var = sum((x - mx_) ** 2 for x in xs)
        slope = sum((x - mx_) * (y - my) for x, y in zip(xs, ys)) / var if var else 0.0
        return max(my + slope * (k - mx_), min(ys) * 0.5)

    def _measured(self) -> dict[int, float]:
        """Seconds a round at each cap timed past its warm-up rounds (without a calibration)."""
        return {k: c for k, c in self.costs.items() if self.rounds.get(k, 0) > self.warmup}

    def observe_outside(self, seconds: float) -> None:
        """Time from handing a step to the caller until the loop resumed. A plain step pays it
        per token and a round once for all it commits, so it counts toward both costs: the
        loop's own timings miss it, and on a launch-bound GPU it is a third of a plain step."""
        if not self.outside:
            self.outside = seconds
            return
        seconds = min(seconds, OUTLIER * self.outside)  # a hiccup of the caller's moves it a step
        self.outside += EMA * (seconds - self.outside)

    def observe_unverified(self, k: int, accepted: int) -> None:
        """A draft of k tokens that was not verified but checked against the tokens that
        followed (a host drafter's, while parked): `accepted` of them matched. It teaches
        acceptance only; no round ran, so nothing about cost."""
        if 0 < k <= self.ceiling:
            learn_acceptance(self.accept, k, accepted)

    def observe(self, k: int, accepted: int, seconds: float) -> None:
        """What a round at cap k did: `accepted` drafts kept, in `seconds`. Lookup copies
        never come here (the loop skips `Proposal.copied`: they are not the drafter's); a k
        past the drafter's ceiling, where the per-position estimates stop, is ignored."""
        if k > self.ceiling:
            return
        seen = self.rounds.get(k, 0)
        self.rounds[k] = seen + 1
        self.drafting += k > 0
        probe = self.probing and k > 0
        timed = seen >= self.warmup and not (k > 0 and self.catching_up)
        if probe:
            self._take_out(seconds, accepted + 1)
        if k > 0:
            self.catching_up = False
            if self.probing and accepted >= k:  # a probe taken whole: look again soon
                self.interval = self.probe_every
            self.probing = False
        if timed:
            self._timed(k, seconds, self._curve(k))
        learn_acceptance(self.accept, k, accepted, PROBE_EMA if probe else ACCEPT_EMA)

    def observe_plain(self, seconds: list[float]) -> None:
        """A run of plain steps, each step's seconds: what `observe(0, 0, s)` for each would
        do, with the calibrated curve read once (the loop sets `context` once a run). The loop
        reports a parked run when it ends, not step by step: on a launch-bound GPU each call
        in the step's own loop costs it (about 20 us a step on the CI machine, of ~55 us of
        bookkeeping)."""
        curve = self._curve(0)
        for step in seconds:
            seen = self.rounds.get(0, 0)
            self.rounds[0] = seen + 1
            if seen >= self.warmup:
                self._timed(0, step, curve)

    def _curve(self, k: int) -> float | None:
        """The calibrated seconds of a round at cap k at this context (None: no calibration)."""
        return None if self.calibration is None else self.calibration.round_cost(k, self.context)

    def _timed(self, k: int, seconds: float, curve: float | None) -> None:
        """A timed round at cap k moves its cost: the live scale of drafting rounds or of plain
        steps against `curve`, or without a calibration the measured cost at k.

        A plain step's cost is the median of the latest PLAIN_WINDOW steps, not a running
        mean: steps come by the dozen, and a burst of slow ones (a host hiccup a few steps
        long) pulled a running mean to twice their cost on an H100. A policy that believes
        plain steps dear keeps drafting, so it never times plain steps again to learn
        otherwise: the demo pair's DFlash on chat drafted at 1.8x the true plain cost for the
        rest of a benchmark (docs/performance.md, "A plain step's cost: a median")."""
        value = seconds if curve is None else seconds / curve if curve > 0 else 1.0
        if k == 0:
            self.plain_steps.append(value)
            median = statistics.median(self.plain_steps)
            if curve is None:
                self.costs[0] = median
            else:
                self.scale[False] = median
        elif curve is None:
            self.costs[k] = self._moved(self.costs.get(k), seconds)
        else:
            self.scale[True] = self._moved(self.scale.get(True), value)

    def _moved(self, old: float | None, seconds: float) -> float:
        """The running cost estimate after one more timed round. One outlier (a kernel
        compile, a host hiccup) moves it a bounded step: a round counts as at most OUTLIER
        times off the estimate, and a calibrated curve's ratio starts from 1."""
        if old is None and self.calibration is None:
            return seconds
        anchor = 1.0 if old is None else old
        seconds = min(max(seconds, anchor / OUTLIER), anchor * OUTLIER)
        return seconds if old is None else old + EMA * (seconds - old)


def learn_acceptance(
    accept: list[float], k: int, accepted: int, weight: float = ACCEPT_EMA
) -> None:
    """Move the running per-position acceptance (P(draft j accepted | drafts before it were))
    by a round that verified k drafts and kept `accepted`. Only the positions the round reached
    move, so a round cut short teaches nothing about the drafts it did not verify."""
    accept.extend([PRIOR_ACCEPT] * (k - len(accept)))
    for j in range(min(accepted + 1, k)):  # positions reached: 1..accepted+1
        hit = 1.0 if j < accepted else 0.0
        accept[j] += weight * (hit - accept[j])
    if 0 < k == accepted and k < len(accept):
        # Every draft kept: the text may now go further than the estimate past the cap says,
        # and no round at this cap reaches that position to correct it (a policy that hard text
        # left at cap 1 would stay there on easy text). Lift it a little, as a hit at a
        # quarter of the weight; the wider rounds this buys teach the truth there.
        accept[k] += OPTIMISM * weight * (1.0 - accept[k])


def handed(step: Step, policy: AutoCap | None) -> Iterator[Step]:
    """Yield `step`, and tell the policy how long the caller kept it (`observe_outside`)."""
    t = time.perf_counter()
    yield step
    if policy is not None:
        policy.observe_outside(time.perf_counter() - t)
