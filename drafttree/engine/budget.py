"""Choosing each round's budget: the one that maximises expected committed tokens per second.

Expected tokens come from the acceptance model (`spec_decode.acceptance`: the drafter's own prediction
at every budget, made on the device inside each drafting round and read with its tokens),
calibrated per budget against what the target's sampler gave the verified tree (the expected τ
at every budget up to the one verified, computed in the verify from the target's logits at the
row's temperature, top-k and top-p: for a greedy row the realised τ), kept per sampler setting
(temperature, top-p, top-k): a probe at T = 1 measures the acceptance a T = 1 round will see,
not a noisy sample of it, and a tree's deep nodes, which the target's sampling accepts far less
often than its argmax does, are calibrated apart from its shallow ones. A setting not seen yet
starts from the pooled calibration of its kind (greedy or sampled). A constrained request's rounds
(its tree grown along the grammar, its picks masked) are observed under its sampler setting too,
pooled with free ones (docs/decisions.md). Rows read in one round are
one observation per setting, whatever the batch size. Seconds come from the measured cost table
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
loses much (two CPU cores: about four plain steps for 1.5 tokens) every hundred or more. Between
observations the choice does not change unless its inputs do (the batch, the caps) or REFRESH
rounds pass: a plain round of a speculative engine spends no more host time choosing than it must.

Each round's seconds, launch (or the previous read, where rounds overlap) to read, correct the
table: the cost of a (bucket, plain or drafting, pick) is scaled by the moving average of
observed/measured, and one not yet observed by that of every round. Start-up timings on a
shared machine, or a sampler the table timed too cheaply, would otherwise keep a losing budget
chosen (on two shared cores a start-up under a passing load timed a decode step at 254 ms that
then ran at 54, and the choice kept drafting at T = 1 at 0.68x plain); and the table times graph
replays alone, where a round also pays the host's launch and read. Plain rounds' price is
corrected only by plain rounds, so while drafting wins, one round in PLAIN_STALE decodes where
plain rounds were not observed for that long (a passing load that priced them up would otherwise
keep drafting chosen for good), and a kind observed after a while weighs its round by the
filter's gain.
"""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field

from drafttree.runner.cost import CostTable
from drafttree.sampling import SamplingParams
from drafttree.spec_decode.acceptance import PRED_SCALE

PROBE_SHARE = 0.01   # of the plain rounds' time, at most, lost to probes (as estimated)
PROBE_MAX = 256
EMA = 0.1           # weight of a new round in the calibration and the predictions
# the level's variance added per round (in one observation's): with an observation every round the
# level's variance after each is EMA and its gain EMA
DRIFT = EMA ** 2 / (1 - EMA)
REFRESH = 16        # rounds a choice is kept while nothing it depends on is observed
PLAIN_STALE = 64    # drafting rounds in a row after which one decodes, if plain rounds' price is that old
SETTINGS_MAX = 64   # sampler settings calibrated apart; past them, the pooled calibration
# Rates within this share of the best drafting budget's count as a tie won by the largest budget
# (0: off), over the square root of the round's rows: the estimates a near-tie is decided on are
# means over the rows, their noise falling as one over that root (a batch of 16: a quarter of the
# margin). Off by default until a GPU bench: it gains at batch 1 in replays (docs/decisions.md).
DRAFT_MARGIN = 0.0

SamplerKey = tuple[float, float, int]   # temperature, top-p, top-k (greedy: 0, 1, 0)
Extra = tuple[str, ...]                 # a round's extra work: () or of "constrained", "processed"
Kind = tuple[int, bool, bool, Extra]    # batch bucket, drafting, sampled pick, extra work


def extra_work(constrained: bool, processed: bool) -> Extra:
    """A round's extra work, which the measured table does not time: its kind apart."""
    return ("constrained",) * constrained + ("processed",) * processed
GREEDY: SamplerKey = (0.0, 1.0, 0)


def sampler_key(p: SamplingParams) -> SamplerKey:
    """The sampler setting a request's acceptance is calibrated under."""
    if p.greedy:
        return GREEDY
    return round(p.temperature, 2), round(p.top_p, 2), max(p.top_k, 0)


@dataclass
class Calibration:
    """One sampler setting's (or one kind's, pooled): per budget of spec.budgets, moving averages
    of the drafted tokens the target's sampler accepts in expectation (τ - 1) and of those the
    drafter predicted in the same rounds, whose ratio calibrates it; and the latest predictions
    at every budget (a moving average too)."""
    observed: list[float] = field(default_factory=list)
    predicted: list[float] = field(default_factory=list)
    pred: list[float] | None = None    # expected τ at spec.budgets[i], uncalibrated
    seen: int = 0                      # the chooser's round at the latest observation
    var: float = EMA                   # the averages' uncertainty, in one observation's variance

    @classmethod
    def seeded(cls, prior: Calibration, round_: int) -> Calibration:
        """A new setting's calibration, starting from its stand-in's (`BudgetChooser.observe`) with
        the stand-in's certainty: a well-observed one moves by the filter's gain a round (one
        unlucky round, a first tree the target rejects whole, does not price drafting out for the
        hundreds of rounds between probes), while the new setting's own rounds accumulate."""
        return cls(list(prior.observed), list(prior.predicted), list(prior.pred), round_, prior.var)

    def ratio(self, i: int) -> float:
        """Observed over predicted at budgets[i] (1 before any observation)."""
        if not self.observed or self.predicted[i] <= 1e-6:
            return 1.0
        return self.observed[i] / self.predicted[i]

    def expected(self, i: int) -> float:
        """Calibrated expected τ at spec.budgets[i]."""
        return 1.0 + self.ratio(i) * (self.pred[i] - 1.0)

    def observe(self, preds: list[float], seen: list[float], round_: int) -> None:
        """One round's predictions at every budget and the expected τ the target's sampler gave
        its tree at every budget up to the one verified (0 past it)."""
        # A local-level filter: the level drifts by DRIFT a round; an observation's weight is the
        # filter's gain: one a round weighs EMA, one after n rounds without, (EMA + n DRIFT) / (1 + EMA + n DRIFT).
        if self.pred is None:
            # before any observation (and no stand-in, `seeded`): the drafter's own prediction, as
            # if observed once, so that the first round weighs about half, not whole
            self.observed, self.predicted = [p - 1 for p in preds], [p - 1 for p in preds]
            self.pred, self.var, self.seen = list(preds), 1.0, round_
        self.var += DRIFT * max(round_ - self.seen, 1)
        w = gain(self.var)
        self.var = w
        self.seen = round_
        ratio = 1.0
        for i, (p, o) in enumerate(zip(preds, seen)):
            if o > 0:
                ratio = (o - 1) / (p - 1) if p - 1 > 1e-6 else 1.0
            else:
                # past the verified budget: as if its ratio were the largest verified one's, so
                # that a budget not verified lately follows those that were
                o = 1 + ratio * (p - 1)
            self.observed[i] += w * (o - 1 - self.observed[i])
            self.predicted[i] += w * (p - 1 - self.predicted[i])
        self.pred = [p + w * (q - p) for p, q in zip(self.pred, preds)]


@dataclass
class BudgetChooser:
    """The adaptive choice (`SpecConfig.adaptive`); a fixed spec takes the largest budget its
    bucket and the requests' caps allow."""
    costs: CostTable | None
    budgets: tuple[int, ...]          # spec.budgets: the columns of a round's predictions
    adaptive: bool = True
    cal: dict[SamplerKey, Calibration] = field(default_factory=dict)
    pooled: dict[bool, Calibration] = field(default_factory=lambda: {True: Calibration(), False: Calibration()})
    plain_rounds: int = 0
    probed: bool = False              # the latest choice was a probe: a drafting round amid plain ones
    # observed/measured per kind of round: (bucket, drafting, sampled, extra work)
    cost_ratio: dict[Kind, float] = field(default_factory=dict)
    any_ratio: float = 1.0            # the same over every free round observed
    timed: dict[Kind, int] = field(default_factory=dict)   # a kind's latest observed round
    # host seconds per drafted node that a kind's round spends between its draft and its verify
    # (a constrained round grows its trees along the grammar there): priced per node, apart from
    # the ratio, since a round at budget 4 grows an eighth of what one at 32 does
    host_node: dict[Extra, float] = field(default_factory=dict)
    rounds: int = 0                   # rounds chosen so far
    _kept: tuple | None = None        # (inputs, round, plain-or-drafting choice, probe, rounds per probe)
    _plain_probed: dict[Kind, int] = field(default_factory=dict)   # a kind's latest plain probe

    def reprice(self, costs: CostTable) -> None:
        """Price rounds from `costs` from now on (a table measured while idle in place of the
        start's provisional one): the observed ratios were to the old table's prices."""
        self.costs = costs
        self.cost_ratio.clear()
        self.any_ratio = 1.0
        self.timed.clear()

    def _ratio(self, key: Kind) -> float:
        """A kind's observed/measured ratio; a kind with extra work not yet observed starts from
        its free twin's."""
        r = self.cost_ratio.get(key)
        if r is None and key[3]:
            r = self.cost_ratio.get(key[:3] + ((),))
        return self.any_ratio if r is None else r

    def round_seconds(self, bucket: int, budget: int, sampled: bool, extra: Extra = (), host_rows: int = 0) -> float:
        """A round's price: the measured cost times its kind's observed ratio, plus its host
        seconds per drafted node over the `host_rows` rows whose trees the host grows (0: the
        bucket's). A round with extra work is a kind of its own: a constrained one's host grows
        the trees of its rows that follow a grammar, with their masks, between draft and verify, a
        processed one's steps process logits; the table times neither."""
        s = self.costs.round_seconds(bucket, budget, sampled) * self._ratio((bucket, budget > 0, sampled, extra))
        if budget and extra in self.host_node:
            s += self.host_node[extra] * (host_rows or bucket) * budget
        return s

    def observe_round(self, bucket: int, budget: int, sampled: bool, seconds: float, extra: Extra = (),
                      host_s: float = 0.0, host_rows: int = 0) -> None:
        """A round's own seconds: launch (or the previous read, where rounds overlap) to read;
        `host_s` of them the host spent between its draft and its verify growing the trees of
        `host_rows` rows."""
        if self.costs is None or not self.adaptive:
            return
        if budget and host_s > 0:
            per = host_s / ((host_rows or bucket) * budget)
            prev = self.host_node.get(extra)
            self.host_node[extra] = per if prev is None else prev + EMA * (per - prev)
            seconds -= host_s
        # Drafting rounds share a ratio whatever their budget: the table times the budgets'
        # relative costs well, and what it misses (the host's share, the machine's load) is
        # common to them; with one per budget, a budget priced up by one slow round was never
        # chosen again to be priced back down.
        key = (bucket, budget > 0, sampled, extra)
        prev = self._ratio(key)
        # from the ratio so far, not from the first round, and by at most a factor of 2 a round:
        # a pause of the host (a collection, another process) is not the round's cost
        r = min(max(seconds / self.costs.round_seconds(bucket, budget, sampled), prev / 2), 2 * prev)
        # a kind not observed for a while (plain rounds while drafting ran) weighs its observation
        # as the calibration's filter does: the machine's load may have moved meanwhile
        var = EMA + DRIFT * max(self.rounds - self.timed.get(key, self.rounds), 1)
        self.cost_ratio[key] = prev + gain(var) * (r - prev)   # EMA when observed a round ago
        if not extra:
            self.any_ratio += EMA * (r - self.any_ratio)
        self.timed[key] = self.rounds

    def calibration(self, key: SamplerKey) -> Calibration | None:
        """The setting's calibration, else its kind's pooled one; None before any prediction."""
        c = self.cal.get(key)
        if c is not None and c.pred is not None:
            return c
        pooled = self.pooled[key == GREEDY]
        return pooled if pooled.pred is not None else None

    def expected_tokens(self, budget: int, rows: Counter[SamplerKey]) -> float | None:
        """Tokens a round at `budget` is expected to commit over its rows, counted by sampler
        setting (None: no prediction yet for a kind of row it has)."""
        if budget == 0:
            return float(sum(rows.values()))
        i = self.budgets.index(budget)
        total = 0.0
        for key, n in rows.items():
            c = self.calibration(key)
            if c is None:
                return None
            total += n * c.expected(i)
        return total

    def choose(self, bucket: int, allowed: tuple[int, ...], rows: Counter[SamplerKey], cap: int | None = None,
               extra: Extra = (), host_rows: int = 0) -> int:
        """The round's budget among `allowed` (spec.budgets_at, ascending, 0 first) and at most
        `cap` (the smallest of the requests' max_budget), for rows counted by sampler setting;
        `extra`: the round's extra work ("constrained", "processed"), priced as its own kind;
        `host_rows`: a constrained round's rows that follow a grammar (their trees grow on the host)."""
        options = [b for b in allowed if cap is None or b <= cap]
        self.rounds += 1
        self.probed = False
        if not self.adaptive or len(options) == 1:
            return options[-1]
        inputs = (bucket, tuple(options), tuple(sorted(rows.items())), extra, host_rows)
        kept = self._kept
        if kept is None or kept[0] != inputs or self.rounds - kept[1] >= REFRESH:
            kept = self._kept = (inputs, self.rounds, *self._rank(bucket, options, rows, extra, host_rows))
        best, probe, every = kept[2:]
        if best > 0:
            self.plain_rounds = 0
            # Plain rounds' price is corrected only by plain rounds: one priced up by a passing
            # load would keep drafting chosen for good, so where it has not been observed for
            # PLAIN_STALE rounds, a round decodes (at most that round's gain lost in PLAIN_STALE).
            plain = (bucket, False, any(key != GREEDY for key in rows), extra)
            last = max(self.timed.get(plain, -1), self._plain_probed.setdefault(plain, self.rounds))
            if self.costs is not None and self.rounds - last >= PLAIN_STALE:
                self._plain_probed[plain] = self.rounds
                return 0
            return best
        self.plain_rounds += 1
        if self.plain_rounds < every:
            return 0
        self.plain_rounds = 0
        self.probed = True
        return probe

    def _rank(self, bucket: int, options: list[int], rows: Counter[SamplerKey],
              extra: Extra = (), host_rows: int = 0) -> tuple[int, int, int]:
        """(the best budget, the drafting budget a probe takes, plain rounds per probe)."""
        speculative = options[1:]
        tokens, seconds = {}, {}
        sampled = any(key != GREEDY for key in rows)
        for b in options:
            tokens[b] = self.expected_tokens(b, rows)
            if tokens[b] is None:   # no prediction for this kind of row yet: draft to get one
                return speculative[-1], speculative[-1], 1
            seconds[b] = self.round_seconds(bucket, b, sampled, extra, host_rows or sum(rows.values()))
        rank = lambda b: (tokens[b] / seconds[b], -b)
        best = max(options, key=rank)
        probe = max(speculative, key=rank)
        if DRAFT_MARGIN:   # the largest drafting budget within the margin of the best one's rate
            top = tokens[probe] / seconds[probe]
            margin = DRAFT_MARGIN / math.sqrt(sum(rows.values()))
            probe = max(b for b in speculative if tokens[b] / seconds[b] * (1 + margin) >= top)
            best = best and probe
        return best, probe, probe_every(tokens[probe], seconds[probe], tokens[0], seconds[0])

    def observe(self, key: SamplerKey, preds: list[float], seen: list[float]) -> None:
        """A drafting round was read: for its rows of one sampler setting, the mean of their
        predictions at every budget and of the expected τ their trees were seen to give (both in
        1/PRED_SCALE tokens; seen 0 past the budget verified)."""
        p = [x / PRED_SCALE for x in preds]
        o = [x / PRED_SCALE for x in seen]
        c = self.cal.get(key)
        if c is None:
            if len(self.cal) >= SETTINGS_MAX:
                self.cal.pop(next(iter(self.cal)))   # the oldest setting
            prior = self.calibration(key)   # its stand-in: its kind's pooled calibration
            c = self.cal[key] = Calibration() if prior is None else Calibration.seeded(prior, self.rounds)
        c.observe(p, o, self.rounds)
        self.pooled[key == GREEDY].observe(p, o, self.rounds)
        self._kept = None


def gain(var: float) -> float:
    """The local-level filter's weight of an observation, its level's variance `var` (in one
    observation's): EMA a round after the last, (EMA + n DRIFT) / (1 + EMA + n DRIFT) n rounds after."""
    return var / (var + 1.0)


def probe_every(tokens: float, seconds: float, plain_tokens: float, plain_seconds: float) -> int:
    """Plain rounds per probe that commits `tokens` in `seconds`: its estimated loss (its seconds
    less those of the plain rounds that would commit its tokens) over PROBE_SHARE of a plain round."""
    lost = seconds - tokens * plain_seconds / plain_tokens
    return min(PROBE_MAX, max(1, math.ceil(lost / (PROBE_SHARE * plain_seconds))))
