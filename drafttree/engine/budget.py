"""Choosing each round's budget: the one that maximises expected committed tokens per second.

Expected tokens come from the acceptance model (`spec.acceptance`: the drafter's own prediction
at every budget, made on the device inside each drafting round and read with its tokens),
calibrated by the accepted lengths observed; seconds come from the measured cost table
(`runner.cost`). Budget 0 is a decode round: one token per row, and the drafter's context still
fed, so speculation resumes losslessly whenever the choice changes.

The prediction for a round is known only once an earlier drafting round has been read, so the
choice lags by a round (two with overlapped rounds). While decoding plainly no prediction is
fresh: every `probe_every` plain rounds one round drafts, verifying at the smallest budget (the
draft predicts every budget whatever the verify's width, so the cheapest verify refreshes them
all), and the interval doubles each time the probe does not win back (up to PROBE_MAX). On two
CPU cores a probe costs about four plain steps for about 1.5 tokens.

Where rounds are read one by one (no overlap: the CPU's default), the engine also reports each
round's seconds, and the table's cost of that (bucket, budget, pick) is scaled by the moving
average of observed/measured, and an entry not yet observed by that of every round: start-up
timings on a shared machine, or a sampler the table timed too cheaply, would otherwise keep a
losing budget chosen (on two shared cores a start-up under a passing load timed a decode step at
254 ms that then ran at 54, and the choice kept drafting at T = 1 at 0.68x plain).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from drafttree.runner.cost import CostTable
from drafttree.spec.acceptance import PRED_SCALE

PROBE_FIRST = 16
PROBE_MAX = 256
EMA = 0.1           # weight of a new round in the calibration and the predictions


@dataclass
class Calibration:
    """Per temperature bucket (greedy, sampled): the drafted tokens accepted (τ - 1; the bonus
    token is certain) against those predicted, as a ratio of exponential moving averages, and
    the latest predictions at every budget (a moving average too)."""
    observed: float = 0.0
    predicted: float = 0.0
    pred: list[float] | None = None    # expected τ at spec.budgets[i], uncalibrated

    @property
    def ratio(self) -> float:
        return self.observed / self.predicted if self.predicted > 1e-6 else 1.0

    def expected(self, i: int) -> float:
        """Calibrated expected τ at spec.budgets[i]."""
        return 1.0 + self.ratio * (self.pred[i] - 1.0)

    def observe(self, tau: int, pred_at_budget: float, preds: list[float]) -> None:
        w = EMA if self.pred is not None else 1.0
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
    probe_every: int = PROBE_FIRST
    cost_ratio: dict[tuple[int, int, bool], float] = field(default_factory=dict)   # observed/measured
    any_ratio: float = 1.0            # the same over every round observed

    def round_seconds(self, bucket: int, budget: int, sampled: bool) -> float:
        ratio = self.cost_ratio.get((bucket, budget, sampled), self.any_ratio)
        return self.costs.round_seconds(bucket, budget, sampled) * ratio

    def observe_round(self, bucket: int, budget: int, sampled: bool, seconds: float) -> None:
        """A round's own seconds (launch to read, nothing else between)."""
        if self.costs is None or not self.adaptive:
            return
        key = (bucket, budget, sampled)
        r = seconds / self.costs.round_seconds(bucket, budget, sampled)
        # from 1, not from the first round: one slow round (a first call of a shape) must not
        # price a budget out of every later choice
        prev = self.cost_ratio.get(key, self.any_ratio)
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
        if not self.adaptive or len(options) == 1:
            return options[-1]
        speculative = options[1:]
        rates = {}
        for b in options:
            tokens = self.expected_tokens(b, greedy_rows, sampled_rows)
            if tokens is None:
                return speculative[-1]   # no prediction for this kind of row yet: draft to get one
            rates[b] = tokens / self.round_seconds(bucket, b, sampled_rows > 0)
        best = max(options, key=lambda b: (rates[b], -b))
        if best > 0:
            self.plain_rounds, self.probe_every = 0, PROBE_FIRST
            return best
        self.plain_rounds += 1
        if self.plain_rounds < self.probe_every:
            return 0
        self.plain_rounds, self.probe_every = 0, min(2 * self.probe_every, PROBE_MAX)
        return speculative[0]

    def observe(self, greedy: bool, budget: int, tau: int, preds: list[int]) -> None:
        """A row's drafting round at `budget` was read: its τ, and the predictions its draft made
        (in 1/PRED_SCALE tokens, at every budget)."""
        p = [x / PRED_SCALE for x in preds]
        self.cal[greedy].observe(tau, p[self.budgets.index(budget)], p)
