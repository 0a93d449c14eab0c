"""What every config section is built from: `Section` (unknown keys are errors, assignments are validated, no
inf or nan), the markers that say how a field enters the fingerprints (HOW_NOT_WHAT, SINCE_DEFAULT), and the
config's warnings (`warn`, `moved`: a line once per process, held back while load_config reads a config).

The section modules (config_inputs, config_generate, config_reward, config_train, config_publish, config_infra)
build on it; tasks/core/config.py assembles them into the whole config.
More: docs/internals.md (tasks/core/config_base.py): the fingerprint markers and the held-back warnings.
"""

from __future__ import annotations

import math
import sys
import threading
from types import UnionType
from typing import Annotated, Any, ClassVar, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, field_validator, model_validator

from tasks.core.errors import printable


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False, populate_by_name=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_truth_value_for_a_number(cls, v: Any, info) -> Any:
        """`run.iterations: true` is a mistake, not 1 (pydantic's lax mode reads true as 1 and false as 0); so is
        `cost.hourly_usd: {train: true}`, a mapping's or a list's value."""
        annotation = cls.model_fields[info.field_name].annotation
        if isinstance(v, bool) and _a_number_only(annotation):
            raise ValueError("expected a number, not true or false")
        container, args = get_origin(annotation), get_args(annotation)
        if container in (dict, list, tuple) and args and _a_number_only(get_args(args[-1])[0] if get_origin(
                args[-1]) is Annotated else args[-1]):
            values = v.values() if isinstance(v, dict) else v if isinstance(v, list | tuple) else ()
            if any(isinstance(x, bool) for x in values):
                raise ValueError("expected numbers, not true or false")
        return v


def plain_json(value: Any, where: str = "") -> Any:
    """`value` where it is what JSON holds (text, numbers, true/false, null, lists, mappings with text keys), else
    a ValueError naming where in it: YAML reads `2020-01-01` as a date, `!!set` and `!!binary` as a set and bytes,
    which a free-form mapping (a function's kwargs, a task's config) would pass on to fail as a traceback later
    (in the fingerprint, or the worker's setup)."""
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise ValueError(f"{where or 'a key'}: key {k!r} is {type(k).__name__}; expected text keys")
            plain_json(v, f"{where}.{k}" if where else k)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            plain_json(v, f"{where}[{i}]")
    elif isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"{where or 'the value'}: {value} is not a finite number (JSON holds none)")
    elif value is not None and not isinstance(value, str | int | float | bool):
        raise ValueError(f"{where or 'the value'}: {value!r} is a {type(value).__name__}; expected text, a number, "
                         f"true/false, null, a list or a mapping (quote a date: '2020-01-01')")
    return value


def has_control_character(text: str) -> bool:
    """Whether `text` holds a control character (a newline, a tab, NUL, DEL): what no name or URI may."""
    return any(ord(c) < 32 or ord(c) == 127 for c in text)


def _a_number_only(annotation) -> bool:
    """Whether a field's type holds an int or a float but not a bool (Optional and unions looked into)."""
    if annotation in (int, float):
        return True
    args = get_args(annotation)
    if get_origin(annotation) in (Union, UnionType) and bool not in args:
        return any(_a_number_only(a) for a in args)
    return False


# A field that changes how a result is computed, not the result (tested bit-identical): left out of the
# fingerprints, so a run may switch it between two flow runs without "made from a different config".
HOW_NOT_WHAT = {"fingerprint": False}
# A field added after runs already existed: left out of the fingerprints while it has its default (which is
# what those runs did), so they resume across the upgrade; a run that sets it is fingerprinted with it.
SINCE_DEFAULT = {"fingerprint": "when-set"}


# A field whose values were renamed: fingerprinted with the names a run stored before the rename wrote (the
# mapping: new -> old), so those runs resume. (Where new values would be fingerprinted as written, no marker.)
def values_as_before(renamed: dict[str, str]) -> dict:
    return {"fingerprint": "values-as-before", "before": renamed}


SERVICE_PLACES = ("stage", "local", "sky")


def service_where(v: str) -> str:
    """A service's `where` (env.where, reward.models[].where): stage, local, sky, or the http(s):// URL of a
    server you run (rlflow starts none)."""
    if v in SERVICE_PLACES:
        return v
    if is_url(v) and (has_control_character(v) or any(c.isspace() for c in v)):
        raise ValueError("a URL with a space or a control character; expected http(s)://HOST[:PORT][/PATH]")
    if is_url(v) and len(v.split("://", 1)[1].strip()) > 0:
        return v
    raise ValueError("expected stage, local, sky, or the http(s):// URL of a server you run")


def is_url(where: str) -> bool:
    return where.startswith(("http://", "https://"))


class ServedSection(Section):
    """A section whose `where` places a service (env, each reward model): stage, local, sky, or the http(s):// URL
    of a server you run (`url`). The key that held that URL before issue 41 (OLD_URL_KEY: how a user wrote its
    section, the key) is read as `where` with one line."""

    OLD_URL_KEY: ClassVar[tuple[str, str]]

    @model_validator(mode="before")
    @classmethod
    def _old_url_is_where(cls, data: Any) -> Any:
        section, old = cls.OLD_URL_KEY
        return renamed_key(data, section, old, "where")

    @field_validator("where", check_fields=False)
    @classmethod
    def _a_place_or_a_url(cls, v: str) -> str:
        return service_where(v)

    @property
    def url(self) -> str | None:
        """The URL of the server you run (`where` given as one), else None."""
        return self.where if is_url(self.where) else None


def renamed_key(data: object, section: str, old: str, new: str) -> object:
    """A before-validator's step: key `old` of a section's input read as `new` (one warning), refused when both
    are given with different values."""
    if not isinstance(data, dict) or old not in data:
        return data
    data = dict(data)
    value = data.pop(old)
    moved(f"{section}.{old}", f"{section}.{new}")
    if value is None:
        return data
    if new in data and data[new] != value:      # (both given: which was meant cannot be told, even at the default)
        raise ValueError(f"{old} is now {new}; give {new} alone (both were given)")
    data[new] = value
    return data


def moved(old: str, new: str, what: str = "key") -> None:
    """One warning line on stderr per old key (or value: `what`) and process: it is read, its new name is `new`."""
    warn(f"warning: config: {old} is now {new} (read as that; write the new {what})")


_SAID: set[str] = set()
_HELD = threading.local()        # .lines: warnings of a load_config under way, said only if the config is accepted


def without_effect(rules: list[tuple[BaseModel, str, str, bool, str]]) -> None:
    """Each (section, its dotted name, key, whether the rest of the config reads it, why not) whose key was given a
    value other than its default and is not read: one warning line, as the config is read (a stage process handed
    the config says nothing again). TRL ignores such settings silently: a value tuned there is lost."""
    if getattr(_HELD, "lines", None) is None:
        return
    import json

    for section, name, key, used, why in rules:
        field = type(section).model_fields.get(key)
        if field is None or used or key not in section.model_fields_set:
            continue
        value = getattr(section, key)
        if value != field.get_default(call_default_factory=True):
            shown = json.dumps(value.model_dump(mode="json") if isinstance(value, BaseModel) else value, default=str)
            warn(f"warning: config: {name}.{key} is set to {shown} but has no effect: {why}")


def warn(line: str) -> None:
    """A warning about the config, once per process: on stderr now, or, while load_config reads one, once it
    accepts it (a refused config's refusal is its only line)."""
    line = printable(line)
    held = getattr(_HELD, "lines", None)
    if held is not None:
        held.append(line)
    elif line not in _SAID:
        _SAID.add(line)
        print(line, file=sys.stderr)
