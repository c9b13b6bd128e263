"""Choosing each round's budget: the one that maximises expected committed tokens per second.

Expected tokens come from the acceptance model (`spec_decode.acceptance`: the drafter's own prediction
at every budget, made on the device inside each drafting round and read with its tokens),
calibrated by the accepted lengths observed; seconds come from the measured cost table
(`runner.cost`). Budget 0 is a decode round: one token per row, and the drafter's context still
fed, so speculation resumes losslessly whenever the choice changes.

The prediction for a round is known only once an earlier drafting round has been read, so the
choice lags by a round (two with overlapped rounds). The moving averages run over rounds, not over
observations: an observation after n rounds without one weighs more than EMA, since the text moved
on while the engine decoded plainly; as a local-level filter weighs it (0.22 after 16 rounds), not
as n rounds of the average would (0.81), since one τ is a noisy sample and at that weight its noise
alone keeps probes coming where drafting loses. While decoding plainly no prediction is fresh, so
now and then one round drafts (a probe) at the budget the stale estimate ranks best among the
drafting ones. A probe loses, by that estimate, its round's seconds less those of the plain rounds
that would commit its expected tokens; probes come as often as keeps that loss within PROBE_SHARE
of the plain rounds' time. Where drafting is estimated to lose little (a GPU at
batch 1, where a round at budget 31 costs about 2.3 plain steps and accepts 2-5 tokens) that is
every few rounds, so a run of short acceptances does not keep the engine plain for long; where it
loses much (two CPU cores: about four plain steps for 1.5 tokens) every hundred or more.

Each round's seconds, launch (or the previous read, where rounds overlap) to read, correct the
table: the cost of a (bucket, plain or drafting, pick) is scaled by the moving average of
observed/measured, and one not yet observed by that of every round. Start-up timings on a
shared machine, or a sampler the table timed too cheaply, would otherwise keep a losing budget
chosen (on two shared cores a start-up under a passing load timed a decode step at 254 ms that
then ran at 54, and the choice kept drafting at T = 1 at 0.68x plain); and the table times graph
replays alone, where a round also pays the host's launch and read.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from drafttree.runner.cost import CostTable
from drafttree.spec_decode.acceptance import PRED_SCALE

PROBE_SHARE = 0.02   # of the plain rounds' time, at most, lost to probes (as estimated)
PROBE_MAX = 256
EMA = 0.1           # weight of a new round in the calibration and the predictions
DRIFT = EMA ** 2 / (1 - EMA)   # the level's variance added per round: a gain of EMA round after round


@dataclass
class Calibration:
    """Per temperature bucket (greedy, sampled): the drafted tokens accepted (τ - 1; the bonus
    token is certain) against those predicted, as a ratio of exponential moving averages, and
    the latest predictions at every budget (a moving average too)."""
    observed: float = 0.0
    predicted: float = 0.0
    pred: list[float] | None = None    # expected τ at spec.budgets[i], uncalibrated
    seen: int = 0                      # the chooser's round at the latest observation
    var: float = EMA                   # the averages' uncertainty, in one observation's variance

    @property
    def ratio(self) -> float:
        return self.observed / self.predicted if self.predicted > 1e-6 else 1.0

    def expected(self, i: int) -> float:
        """Calibrated expected τ at spec.budgets[i]."""
        return 1.0 + self.ratio * (self.pred[i] - 1.0)

    def observe(self, tau: int, pred_at_budget: float, preds: list[float], round_: int) -> None:
        # A local-level filter: the level drifts by DRIFT a round; an observation's weight is the
        # filter's gain. Rows read in the same round count as consecutive rounds, so one
        # observation a round weighs EMA; one after n rounds without, (EMA + n DRIFT) / (1 + EMA + n DRIFT).
        if self.pred is None:
            w = 1.0
        else:
            self.var += DRIFT * max(round_ - self.seen, 1)
            w = self.var / (self.var + 1.0)
            self.var = w
        self.seen = round_
        self.observed += w * (tau - 1 - self.observed)
        self.predicted += w * (pred_at_budget - 1 - self.predicted)
        self.pred = preds if self.pred is None else [p + w * (q - p) for p, q in zip(self.pred, preds)]


@dataclass
class BudgetChooser:
    """The adaptive choice (`SpecConfig.adaptive`); a fixed spec takes the largest budget its
    bucket and the requests' caps allow."""
    costs: CostTable | None
    budgets: tuple[int, ...]          # spec.budgets: the columns of a round's predictions
    adaptive: bool = True
    cal: dict[bool, Calibration] = field(default_factory=lambda: {True: Calibration(), False: Calibration()})
    plain_rounds: int = 0
    cost_ratio: dict[tuple[int, bool, bool], float] = field(default_factory=dict)   # observed/measured
    any_ratio: float = 1.0            # the same over every round observed
    rounds: int = 0                   # rounds chosen so far

    def round_seconds(self, bucket: int, budget: int, sampled: bool) -> float:
        ratio = self.cost_ratio.get((bucket, budget > 0, sampled), self.any_ratio)
        return self.costs.round_seconds(bucket, budget, sampled) * ratio

    def observe_round(self, bucket: int, budget: int, sampled: bool, seconds: float) -> None:
        """A round's own seconds: launch (or the previous read, where rounds overlap) to read."""
        if self.costs is None or not self.adaptive:
            return
        # Drafting rounds share a ratio whatever their budget: the table times the budgets'
        # relative costs well, and what it misses (the host's share, the machine's load) is
        # common to them; with one per budget, a budget priced up by one slow round was never
        # chosen again to be priced back down.
        key = (bucket, budget > 0, sampled)
        prev = self.cost_ratio.get(key, self.any_ratio)
        # from the ratio so far, not from the first round, and by at most a factor of 2 a round:
        # a pause of the host (a collection, another process) is not the round's cost
        r = min(max(seconds / self.costs.round_seconds(bucket, budget, sampled), prev / 2), 2 * prev)
        self.cost_ratio[key] = prev + EMA * (r - prev)
        self.any_ratio += EMA * (r - self.any_ratio)

    def expected_tokens(self, budget: int, greedy_rows: int, sampled_rows: int) -> float | None:
        """Tokens a round at `budget` is expected to commit over its rows (None: no prediction
        yet for a kind of row it has)."""
        if budget == 0:
            return float(greedy_rows + sampled_rows)
        i = self.budgets.index(budget)
        total = 0.0
        for greedy, n in ((True, greedy_rows), (False, sampled_rows)):
            c = self.cal[greedy]
            if n == 0:
                continue
            if c.pred is None:
                return None
            total += n * c.expected(i)
        return total

    def choose(self, bucket: int, allowed: tuple[int, ...], greedy_rows: int, sampled_rows: int,
               cap: int | None = None) -> int:
        """The round's budget among `allowed` (spec.budgets_at, ascending, 0 first) and at most
        `cap` (the smallest of the requests' max_budget)."""
        options = [b for b in allowed if cap is None or b <= cap]
        self.rounds += 1
        if not self.adaptive or len(options) == 1:
            return options[-1]
        speculative = options[1:]
        tokens, seconds = {}, {}
        for b in options:
            tokens[b] = self.expected_tokens(b, greedy_rows, sampled_rows)
            if tokens[b] is None:
                return speculative[-1]   # no prediction for this kind of row yet: draft to get one
            seconds[b] = self.round_seconds(bucket, b, sampled_rows > 0)
        rank = lambda b: (tokens[b] / seconds[b], -b)
        best = max(options, key=rank)
        if best > 0:
            self.plain_rounds = 0
            return best
        self.plain_rounds += 1
        probe = max(speculative, key=rank)
        if self.plain_rounds < probe_every(tokens[probe], seconds[probe], tokens[0], seconds[0]):
            return 0
        self.plain_rounds = 0
        return probe

    def observe(self, greedy: bool, budget: int, tau: int, preds: list[int]) -> None:
        """A row's drafting round at `budget` was read: its τ, and the predictions its draft made
        (in 1/PRED_SCALE tokens, at every budget)."""
        p = [x / PRED_SCALE for x in preds]
        self.cal[greedy].observe(tau, p[self.budgets.index(budget)], p, self.rounds)


def probe_every(tokens: float, seconds: float, plain_tokens: float, plain_seconds: float) -> int:
    """Plain rounds per probe that commits `tokens` in `seconds`: its estimated loss (its seconds
    less those of the plain rounds that would commit its tokens) over PROBE_SHARE of a plain round."""
    lost = seconds - tokens * plain_seconds / plain_tokens
    return min(PROBE_MAX, max(1, math.ceil(lost / (PROBE_SHARE * plain_seconds))))
