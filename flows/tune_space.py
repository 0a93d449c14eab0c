"""`rlflow tune`'s search space and what is checked before any trial (flows/tune.py runs the trials): SPACE.yaml
read into distributions over config keys, the arguments, the metric, and a resumed study's metric, direction and
space against what it was started with (one line, exit 2, before anything is written). Each bound and choice is
checked alone against the config's schema and `rlflow run`'s preflight, the corners of the space together against
the rules that tie keys (a trial of the study would fail on them), and a key the config ignores (another learner's
setting) is refused: a dimension that changes nothing.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from tasks.core.config import Config, load_config
from tasks.core.config_base import _HELD
from tasks.core.config_inputs import NAME
from tasks.core.errors import UserError

TYPES = ("log_uniform", "uniform", "int", "categorical")


@dataclass(frozen=True)
class Param:
    key: str
    kind: str
    low: float | int | None = None
    high: float | int | None = None
    choices: tuple | None = None
    log: bool = False

    def distribution(self):
        """Optuna's distribution of this parameter (what a study records for each trial)."""
        from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

        if self.kind == "categorical":
            return CategoricalDistribution(list(self.choices))
        if self.kind == "int":
            return IntDistribution(int(self.low), int(self.high), log=self.log)
        return FloatDistribution(float(self.low), float(self.high), log=self.kind == "log_uniform" or self.log)

    def suggest(self, trial) -> Any:
        if self.kind == "categorical":
            return trial.suggest_categorical(self.key, list(self.choices))
        if self.kind == "int":
            return trial.suggest_int(self.key, int(self.low), int(self.high), log=self.log)
        log = self.kind == "log_uniform" or self.log
        return trial.suggest_float(self.key, float(self.low), float(self.high), log=log)


def not_set_by(overrides: list[str], keys: list[str]) -> list[str]:
    """The user's overrides but those of `keys` (or under them), which a trial sets itself: a key is given once
    (a mapping given for a section, `-o 'run={name: a, iterations: 2}'`, opened into its keys first)."""
    from tasks.core.config import leaf_overrides

    return [o for o in leaf_overrides(overrides)
            if not any(f"{o.partition('=')[0].strip()}.".startswith(f"{k}.") for k in keys)]


def override_of(key: str, value: Any) -> str:
    """The `-o key=value` that sets `key` to `value` (JSON: a string stays a string)."""
    return f"{key}={json.dumps(value)}"


CORNERS = 256       # the most corners of a space checked together (every key at a bound or a choice)


def values_of(param: Param) -> list:
    """The values a check tries for a parameter: its choices, or its bounds."""
    return list(param.choices) if param.kind == "categorical" else [param.low, param.high]


def _read(config: str, overrides: list[str]) -> tuple[Config, list[str]]:
    """load_config, its warnings kept (returned, not said): whether the config ignores a tuned key."""
    outer = getattr(_HELD, "lines", None)
    _HELD.lines = lines = []
    try:
        return load_config(config, overrides), lines
    finally:
        _HELD.lines = outer


def _ignored_as(key: str, lines: list[str]) -> str | None:
    """The warning, among a config's, that says `key` itself is ignored or has no effect (its subject: not a
    warning about another key that names this one as the reason), or None."""
    for line in lines:
        said = line.removeprefix("warning: ").removeprefix("config: ")
        if said.startswith(f"{key} ") and ("ignored" in said or "no effect" in said):
            return said
    return None


def corners(space: dict[str, Param]) -> Iterator[tuple]:
    """The configs a check tries together, as values of the space's keys in order: every corner (each key at a
    bound or a choice) where they are at most CORNERS; otherwise each pair of keys at every pair of their values,
    the others at their first (the rules that tie keys tie two)."""
    keys, values = list(space), [values_of(space[k]) for k in space]
    if math.prod(map(len, values)) <= CORNERS:
        yield from itertools.product(*values)
        return
    for a, b in itertools.combinations(range(len(keys)), 2):
        for va, vb in itertools.product(values[a], values[b]):
            corner = [v[0] for v in values]
            corner[a], corner[b] = va, vb
            yield tuple(corner)


def check_corners(space: dict[str, Param], config: str, overrides: list[str]) -> None:
    """The space's corners (see `corners`) against the config's rules that tie keys together (a corner the config
    refuses is a trial that would fail), and a key the config ignores at every corner (another learner's setting
    under every algorithm tried): a dimension that changes nothing."""
    keys = list(space)
    ignored: dict[str, str | None] = dict.fromkeys(keys, "")        # ("": not seen yet; None: read somewhere)
    for corner in corners(space):
        try:
            _, lines = _read(config, [*overrides, *(override_of(k, v) for k, v in zip(keys, corner))])
        except UserError as e:
            given = ", ".join(f"{k}={json.dumps(v)}" for k, v in zip(keys, corner))
            raise UserError(f"--space: the corner {given} is refused: {str(e).removeprefix('config: ')} (narrow "
                            f"the ranges so that every trial's config is valid)") from None
        for key in keys:
            if ignored[key] is not None:
                ignored[key] = _ignored_as(key, lines)
    for key, why in ignored.items():
        if why:
            raise UserError(f"--space: {key}: the config ignores it ({why}): a dimension that changes nothing")


def load_space(path: str, config: str, overrides: list[str]) -> dict[str, Param]:
    """The search space, every bound and choice checked against the config's own schema (one line on error)."""
    from tasks.core.config import leaf_overrides
    from tasks.core.config_yaml import load_yaml, problem

    try:
        raw = load_yaml(Path(path).read_bytes().decode("utf-8-sig"), f"--space: {path}")
    except FileNotFoundError:
        raise UserError(f"--space: {path}: no such file") from None
    except UnicodeDecodeError as e:
        raise UserError(f"--space: {path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except yaml.YAMLError as e:
        raise UserError(f"--space: {path}{problem(e)}") from None
    if not isinstance(raw, dict) or not raw:
        raise UserError(f"--space: {path}: expected a mapping of config keys to distributions, e.g. "
                        f"train.lr: {{type: log_uniform, low: 1.0e-6, high: 1.0e-4}}")
    space = {}
    base = load_config(config, overrides)
    for key, spec in raw.items():
        where = f"--space: {key}"
        if key in ("run.name", "run.iterations") or not isinstance(key, str):
            raise UserError(f"{where}: not a key to tune (the tune sets run.name; run.iterations is the budget)")
        if _is_section(base, key):
            raise UserError(f"{where}: a section, not a key to tune; name one of its keys ({key}.<key>)")
        if set_too := [o for o in leaf_overrides(overrides) if o.partition("=")[0].strip() == key]:
            raise UserError(f"{where}: also set by -o {set_too[-1]}; a tuned key is set by each trial (drop one)")
        if not isinstance(spec, dict) or spec.get("type") not in TYPES:
            raise UserError(f"{where}: expected {{type: one of {list(TYPES)}, ...}}, got {spec!r}")
        kind = spec["type"]
        extra = set(spec) - ({"type", "choices"} if kind == "categorical" else {"type", "low", "high", "log"})
        if extra:
            raise UserError(f"{where}: unknown field(s) {sorted(extra)} for type {kind}")
        if kind == "categorical":
            choices = spec.get("choices")
            if not isinstance(choices, list) or not choices:
                raise UserError(f"{where}: categorical needs a non-empty list of choices")
            if odd := [c for c in choices if c is not None and not isinstance(c, bool | int | float | str)]:
                raise UserError(f"{where}: choices must be numbers, strings, booleans or null (what Optuna stores), "
                                f"got {odd[0]!r}")
            param = Param(key, kind, choices=tuple(choices))
            values = list(choices)
        else:
            low, high = spec.get("low"), spec.get("high")
            number = int if kind == "int" else (int, float)
            if any(isinstance(v, bool) or not isinstance(v, number) or not math.isfinite(v) for v in (low, high)):
                raise UserError(f"{where}: {kind} needs {'integer' if kind == 'int' else 'numeric'} low and high, "
                                f"got low={low!r} high={high!r}")
            if not low < high:
                raise UserError(f"{where}: empty range (low {low} must be below high {high})")
            if not isinstance(spec.get("log", False), bool):
                raise UserError(f"{where}: log: expected true or false, got {spec['log']!r}")
            if (kind == "log_uniform" or spec.get("log")) and low <= 0:
                raise UserError(f"{where}: a log scale needs low > 0, got {low}")
            param = Param(key, kind, low, high, log=spec.get("log", False))
            # (a float range draws fractional values: the field must take one, not only the bounds)
            values = [low, high] if kind == "int" else [low, high, low + (high - low) / math.pi]
        for value in values:                   # the key exists and its type takes the value
            try:
                _read(config, [*overrides, override_of(key, value)])
            except UserError as e:
                hint = (" (a whole-number field: use type: int)" if kind in ("uniform", "log_uniform")
                        and value == values[-1] else "")
                raise UserError(f"{where}: {value!r}: {str(e).removeprefix('config: ')}{hint}") from None
        space[key] = param
    check_corners(space, config, overrides)
    return space


def _is_section(cfg: Config, key: str) -> bool:
    """Whether `key` names a whole section of the config (which a trial's value would replace), not one key."""
    from pydantic import BaseModel

    node: Any = cfg
    for part in key.split("."):
        if not isinstance(node, BaseModel) or part not in type(node).model_fields:
            return False            # (not a key at all: said as the config says it, below)
        node = getattr(node, part)
    return isinstance(node, BaseModel)


def check_study(args, cfg: Config, space: dict[str, Param]) -> None:
    """A study resumed with another metric, direction or set of keys than it was started with, or a space whose
    distributions Optuna cannot mix with those its trials were drawn from (another type, a log scale changed,
    other choices), is refused, one line, before any trial: its best would be labelled with what it was not
    measured by, or Optuna would fail each trial. (A range widened or narrowed mixes: it is not refused.)"""
    import optuna
    from optuna.distributions import check_distribution_compatibility
    from sqlalchemy.engine import make_url

    storage = storage_url(args, out_folder(args, cfg))
    url = make_url(storage)
    if url.get_backend_name() == "sqlite" and not (url.database and Path(url.database).is_file()):
        return                                  # (a new study: nothing to compare, nothing made here)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    try:
        study = optuna.load_study(study_name=study_name(args, cfg), storage=storage)
    except KeyError:
        return                                  # (no such study in that database yet)
    except Exception as e:  # noqa: BLE001 - a file that is no database, a damaged one: said as one line
        why = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UserError(f"--storage: {storage}: cannot open the study's database ({why[:200]})") from None
    said = study.user_attrs                      # (what the study was started with: Tune.study)
    for what, now, then in (("--metric", args.metric, said.get("metric")),
                            ("--direction", args.direction, study.direction.name.lower() if said else None),
                            ("--space", sorted(space), said.get("space"))):
        if then is not None and now != then:
            then, now = (", ".join(v) if isinstance(v, list) else v for v in (then, now))
            raise UserError(f"{what}: the study {study.study_name!r} ({storage}) was started with {then}, not "
                            f"{now}; another is a new study (--study NAME)")
    for trial in study.get_trials(deepcopy=False):
        for key, old in trial.distributions.items():
            if key in space:
                try:
                    check_distribution_compatibility(old, space[key].distribution())
                except ValueError:
                    raise UserError(f"--space: {key}: the study {study.study_name!r} ({storage}) drew it from {old} "
                                    f"in trial {trial.number}; a changed space is a new study (--study NAME)") \
                        from None


def check_arguments(args) -> None:
    """The counts, --seed, --study and --storage as Optuna and the study's folder take them: one line, exit 2,
    before any trial (the last three were: a traceback from Optuna after the trials' folder was made, and a study
    written outside rlflow-tune/ for --study ../name)."""
    for flag, value in (("--trials", args.trials), ("--parallel", args.parallel), ("--window", args.window)):
        if value < 1:
            raise UserError(f"{flag}: expected a whole number of at least 1, got {value}")
    if not 0 <= args.seed < 2**32:
        raise UserError(f"--seed: expected a whole number from 0 to 2^32-1 (Optuna's samplers), got {args.seed}")
    if args.study is not None and not re.fullmatch(NAME, args.study):
        raise UserError(f"--study: {args.study!r}: expected a name of letters, digits, '.', '_' and '-' (at most "
                        f"100, starting with a letter or digit): it names the folder rlflow-tune/<study>")
    if args.storage is not None:
        from sqlalchemy.engine import make_url
        from sqlalchemy.exc import ArgumentError

        try:
            url = make_url(args.storage)
        except ArgumentError:
            raise UserError(f"--storage: {args.storage!r}: expected a database URL Optuna opens (SQLAlchemy's: "
                            f"sqlite:///path/study.db, postgresql://user@host/db)") from None
        _check_storage(args.storage, url)


def _check_storage(text: str, url) -> None:
    """The database opens: a sqlite file can be made where it would go (nothing made now); any other is connected
    to once (its driver installed, its server answering)."""
    from sqlalchemy import create_engine
    from sqlalchemy.exc import SQLAlchemyError

    from tasks.core.paths import check_path

    if url.get_backend_name() == "sqlite" and url.database not in (None, "", ":memory:"):
        if not Path(url.database).absolute().parent.is_dir():
            raise UserError(f"--storage: {text}: the folder {Path(url.database).absolute().parent} does not exist "
                            f"(sqlite makes the file, not its folder)")
        check_path("--storage", url.database, "file")
        return
    try:
        engine = create_engine(url, connect_args={"connect_timeout": 10} if url.get_backend_name() in (
            "postgresql", "mysql") else {})
        with engine.connect():
            pass
        engine.dispose()
    except (SQLAlchemyError, ImportError, TypeError) as e:      # (TypeError: a driver that takes no timeout)
        why = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UserError(f"--storage: {text}: cannot open it ({why[:200]})") from None


def check_metric(metric: str, cfg: Config) -> None:
    """--metric names a metric of the manifests a trial is read from (iteration_metric), and an eval/ one needs
    evaluations: one line, exit 2, before any trial."""
    if metric.split("/", 1)[0] not in ("reward", "train", "eval") or "/" not in metric:
        raise UserError(f"--metric: {metric!r}: expected a metric of each iteration's reward, train or eval "
                        f"manifest (reward/..., train/..., eval/...; e.g. reward/mean)")
    if metric.startswith("eval/") and not cfg.eval.every:
        raise UserError(f"--metric: {metric}: the config evaluates nothing (eval.every 0); expected a reward/ "
                        f"or train/ metric, or -o eval.every=N")


def window_warning(args, cfg: Config) -> str | None:
    """A --window the base run never fills, with the median pruner: no trial would ever be pruned."""
    if (window := args.window) >= (n := cfg.run.iterations) and args.pruner == "median":
        return (f"warning: --window {window} with run.iterations {n}: the median pruner waits {window} iterations, "
                f"so no trial is ever pruned; expected a window below run.iterations (or --pruner none)")
    return None


def study_name(args, cfg: Config) -> str:
    return args.study or f"{cfg.run.name}-tune"


def out_folder(args, cfg: Config) -> Path:
    """Where the study, the trials' logs and best.yaml go: --out, else rlflow-tune/<study>."""
    return Path(args.out or Path("rlflow-tune") / study_name(args, cfg))


def storage_url(args, out: Path) -> str:
    return args.storage or f"sqlite:///{(out / 'study.db').absolute()}"
