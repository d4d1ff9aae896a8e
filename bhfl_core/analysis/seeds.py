"""Statistics over seeds: a config's runs with different seeds summarised, and configs compared pairwise.

One run is one draw: its partition, cohorts, data order and initialisation all follow
its seed (bhfl_core/rng.py), so a single run cannot tell a real difference between two
configs from the luck of the draw. Here the runs of each config are grouped by the
config *without* its seed, and for every headline metric we report

- ``n`` (runs that have the metric; a run that lacks it, NaN, is left out and counted
  as ``missing`` so a table can show it), the mean, the sample standard deviation
  (``ddof=1``), and the 95% Student-t interval of the mean::

      mean ± t(0.975, n − 1) · std / √n

  which is exact for normally distributed run results and honest about how few seeds
  there usually are (t(0.975, 2) = 4.30 for three seeds, not the normal 1.96). One run
  gives no spread and no interval: ``std`` and the half-width are NaN, never invented.
- paired differences against a baseline config: per seed both configs ran, ``config −
  baseline``, summarised the same way. Pairing removes what the seed does to both
  (the same partition and initialisation), so "B-HFL beats HierFAVG by x ± y" is
  read off one row, with an interval that is usually much tighter than the two
  configs' intervals side by side.
- where a metric is bounded (accuracy in [0, 1]; the difference of two accuracies in
  [-1, 1]), the interval as reported (``interval``) is clipped to the bound: a
  symmetric t-interval from two seeds easily reaches past it (``[-0.65, 0.76]``),
  and an accuracy below 0 is not a value the data allow. The unclipped ends are kept,
  so a table marks the clipped end; the mean and std are never touched.

A config's identity (``config_identity``) is a hash of its resolved, flattened config
(the MLflow params of the run) without the keys that do not change results: ``seed``
(what varies inside a group), ``name`` (a label, not a setting) and ``runtime.*``
("none of these keys changes the results of a run", bhfl_core/config/schema.py
``RuntimeConfig``), at top level or inside a pipeline's ``stages.<stage>.``. Rows are
plain mappings (column -> value), as ``bhfl compare`` builds them, so a sweep report
can pass its own.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

CONFIDENCE = 0.95
CONFIG = "config"  # row column: the config identity (``config_identity``)
SEED = "seed"  # row column: the run's seed (int)
RUN = "run_id"  # row column: the run's id (named in errors)
_STAGE_PREFIX = "stages."


class SeedStatsError(ValueError):
    """Rows that cannot be summarised as asked (unknown baseline, a seed twice, a non-number); says which."""


@dataclass(frozen=True)
class Summary:
    """One metric over runs (or over paired differences): ``n`` values, NaN ones left out and counted."""

    n: int
    missing: int
    mean: float
    std: float  # sample standard deviation (ddof=1); NaN for n < 2
    half_width: float  # of the 95% t-interval of the mean; NaN for n < 2 (no interval from one run)

    @property
    def lo(self) -> float:
        return self.mean - self.half_width

    @property
    def hi(self) -> float:
        return self.mean + self.half_width

    @property
    def has_interval(self) -> bool:
        return self.n >= 2


Bounds = tuple[float, float]  # (low, high): the values a metric can take


@dataclass(frozen=True)
class Interval:
    """A summary's 95% interval as reported: ``lo``/``hi`` clipped to the metric's bounds, ``*_raw`` the t-interval."""

    lo: float
    hi: float
    lo_raw: float
    hi_raw: float

    @property
    def lo_clipped(self) -> bool:
        return self.lo > self.lo_raw  # False for NaN (no interval)

    @property
    def hi_clipped(self) -> bool:
        return self.hi < self.hi_raw

    @property
    def clipped(self) -> bool:
        return self.lo_clipped or self.hi_clipped


def interval(s: Summary, bounds: Bounds | None = None) -> Interval:
    """``s``'s 95% interval with each end clipped to ``bounds`` (None: unbounded, e.g. perplexity, bytes, times).

    Only the ends move: the t-interval is symmetric around the mean, so with few seeds it
    runs past a bound the values cannot cross; reporting that part would claim
    impossible values, dropping the interval would hide how few the seeds are.
    """
    lo, hi = s.lo, s.hi
    if bounds is None or not s.has_interval:
        return Interval(lo, hi, lo, hi)
    low, high = bounds
    return Interval(max(lo, low), min(hi, high), lo, hi)


def difference_bounds(bounds: Bounds | None) -> Bounds | None:
    """Where ``a − b`` lies for ``a``, ``b`` within ``bounds``: ``[low − high, high − low]`` ([-1, 1] for [0, 1])."""
    if bounds is None:
        return None
    low, high = bounds
    return (low - high, high - low)


@dataclass(frozen=True)
class GroupStats:
    """A config's runs (one per seed) and each metric's summary over them."""

    config: str
    seeds: tuple[int, ...]
    run_ids: tuple[str, ...]
    metrics: Mapping[str, Summary] = field(default_factory=dict)


@dataclass(frozen=True)
class PairedStats:
    """``config − baseline`` per seed both ran, summarised per metric (``missing``: seeds where either lacks it)."""

    config: str
    baseline: str
    seeds: tuple[int, ...]
    metrics: Mapping[str, Summary] = field(default_factory=dict)


def t_half_width(std: float, n: int, confidence: float = CONFIDENCE) -> float:
    """Half-width of the Student-t interval of a mean of ``n`` values with sample std ``std`` (NaN for n < 2)."""
    if n < 2 or math.isnan(std):
        return math.nan
    from scipy import stats  # here: scipy.stats takes a second to import, most users of this module never need it

    quantile = float(stats.t.ppf(0.5 + confidence / 2, n - 1))
    return quantile * std / math.sqrt(n)


def summarise(values: Iterable[float]) -> Summary:
    """Mean, sample std and 95% t-interval of the non-NaN ``values`` (NaN ones counted as ``missing``)."""
    all_values = list(values)
    present = [v for v in all_values if not math.isnan(v)]
    n = len(present)
    if n == 0:
        return Summary(0, len(all_values), math.nan, math.nan, math.nan)
    mean = math.fsum(present) / n
    std = math.sqrt(math.fsum((v - mean) ** 2 for v in present) / (n - 1)) if n > 1 else math.nan
    return Summary(n, len(all_values) - n, mean, std, t_half_width(std, n))


def _number(row: Mapping[str, object], column: str) -> float:
    value = row.get(column)
    if value is None or value == "":
        return math.nan
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise SeedStatsError(f"run {row.get(RUN, '?')}: {column} = {value!r} is not a number")
    try:
        return float(value)
    except ValueError:
        raise SeedStatsError(f"run {row.get(RUN, '?')}: {column} = {value!r} is not a number") from None


def _seed(row: Mapping[str, object]) -> int:
    value = row.get(SEED)
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise SeedStatsError(f"run {row.get(RUN, '?')}: seed {value!r} is not an integer")
    try:
        return int(value)
    except ValueError:
        raise SeedStatsError(f"run {row.get(RUN, '?')}: seed {value!r} is not an integer") from None


def by_config(rows: Iterable[Mapping[str, object]]) -> dict[str, dict[int, Mapping[str, object]]]:
    """Rows grouped by their ``config`` column, then by seed (first-seen config order, seeds sorted).

    Two runs of one config with the same seed would count one draw twice: an error
    naming both (keep the one you mean, e.g. the latest).
    """
    groups: dict[str, dict[int, Mapping[str, object]]] = {}
    for row in rows:
        config = str(row.get(CONFIG, ""))
        if not config:
            raise SeedStatsError(f"run {row.get(RUN, '?')}: no {CONFIG!r} identity to group it by")
        seed = _seed(row)
        group = groups.setdefault(config, {})
        if seed in group:
            raise SeedStatsError(
                f"config {config}: seed {seed} twice (runs {group[seed].get(RUN, '?')} and {row.get(RUN, '?')}); "
                "keep one run per seed"
            )
        group[seed] = row
    return {config: dict(sorted(group.items())) for config, group in groups.items()}


def aggregate(rows: Iterable[Mapping[str, object]], metrics: Sequence[str]) -> list[GroupStats]:
    """Per config (first-seen order): each metric's mean, std and 95% interval over its seeds."""
    out = []
    for config, group in by_config(rows).items():
        summaries = {m: summarise(_number(r, m) for r in group.values()) for m in metrics}
        out.append(GroupStats(config, tuple(group), tuple(str(r.get(RUN, "")) for r in group.values()), summaries))
    return out


def paired(rows: Iterable[Mapping[str, object]], metrics: Sequence[str], baseline: str) -> list[PairedStats]:
    """Per config other than ``baseline`` (a config identity): ``config − baseline`` over the seeds both ran.

    A config that shares no seed with the baseline gets a row with no seeds and n = 0
    (a sweep still being run); if none shares a seed, or ``baseline`` is not one of the
    configs, that is an error naming it.
    """
    groups = by_config(rows)
    if baseline not in groups:
        raise SeedStatsError(f"baseline config {baseline!r} is not among the configs {sorted(groups)}")
    base = groups[baseline]
    out = []
    for config, group in groups.items():
        if config == baseline:
            continue
        common = tuple(s for s in group if s in base)
        summaries = {m: summarise(_number(group[s], m) - _number(base[s], m) for s in common) for m in metrics}
        out.append(PairedStats(config, baseline, common, summaries))
    if out and not any(p.seeds for p in out):
        raise SeedStatsError(
            f"baseline config {baseline!r} (seeds {sorted(base)}) shares no seed with any other config "
            f"({', '.join(f'{c}: {sorted(g)}' for c, g in groups.items() if c != baseline)})"
        )
    return out


# ---------------------------------------------------------------- config identity and labels


def is_setting(key: str) -> bool:
    """Whether a flattened config key can change a run's results (not seed, name or runtime.*)."""
    if key.startswith(_STAGE_PREFIX):  # a pipeline's params: stages.<stage>.<config key>
        parts = key.split(".", 2)
        if len(parts) == 3:
            key = parts[2]
    return key not in ("seed", "name") and not key.startswith("runtime.")


def settings(params: Mapping[str, str]) -> dict[str, str]:
    """The flattened config without the keys that do not change results (``is_setting``), sorted by key."""
    return {k: str(v) for k, v in sorted(params.items()) if is_setting(k)}


def config_identity(params: Mapping[str, str]) -> str:
    """A short hash of the config without seed, name and runtime: equal for the seeds of one config."""
    text = json.dumps(settings(params), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def differing_keys(configs: Iterable[Mapping[str, str]]) -> list[str]:
    """Setting keys whose value is not the same in every config (a key one config lacks counts as differing)."""
    listed = [settings(c) for c in configs]
    keys = sorted({k for c in listed for k in c})
    return [k for k in keys if len({c.get(k) for c in listed}) > 1]


def _short_keys(keys: Sequence[str]) -> dict[str, str]:
    """Each key's shortest dotted suffix no other key ends with (``tree.edge.eta_down`` -> ``eta_down``)."""
    out = {}
    for key in keys:
        parts = key.split(".")
        for i in range(len(parts) - 1, -1, -1):
            suffix = ".".join(parts[i:])
            if not any(o != key and (o == suffix or o.endswith("." + suffix)) for o in keys):
                break
        out[key] = suffix
    return out


def _label(name: str, values: Mapping[str, str], shown: Sequence[str], short: Mapping[str, str]) -> str:
    return " ".join([name, *(f"{short[k]}={values.get(k, '∅')}" for k in shown)])


def labels(configs: Mapping[str, tuple[str, Mapping[str, str]]]) -> dict[str, str]:
    """Readable, unique labels: ``config id -> name [key=value ...]``.

    ``configs``: config id -> (config name, flattened config). A config whose name is
    unique is labelled by its name; configs sharing a name add the keys in which they
    differ from each other, shortened to an unambiguous suffix (``bhfl eta_down=0.5``),
    where possible only those in which a config departs from the others' most common
    value (an ablation's default stays plain ``bhfl``).
    """
    by_name: dict[str, list[str]] = {}
    for config, (name, _) in configs.items():
        by_name.setdefault(name, []).append(config)
    out: dict[str, str] = {}
    for name, members in by_name.items():
        if len(members) == 1:
            out[members[0]] = name
            continue
        values = {c: settings(configs[c][1]) for c in members}
        keys = differing_keys(values.values())
        short = _short_keys(keys)
        modes = {}
        for k in keys:
            counts = Counter(values[c].get(k) for c in members).most_common(2)
            if len(counts) == 1 or counts[0][1] > counts[1][1]:
                modes[k] = counts[0][0]
        departing = {c: [k for k in keys if k not in modes or values[c].get(k) != modes[k]] for c in members}
        minimal = {c: _label(name, values[c], departing[c], short) for c in members}
        full = {c: _label(name, values[c], keys, short) for c in members}
        for candidate in (minimal, full):
            if len(set(candidate.values())) == len(members):
                out.update(candidate)
                break
        else:  # identities that do not come from the settings: the hash tells them apart
            out.update({c: f"{full[c]} [{c[:8]}]" for c in members})
    return out
