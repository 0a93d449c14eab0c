"""What a reward function's signature must take to be called as TRL calls it (every argument by keyword: TRL's
keywords, the dataset's columns, the configured kwargs), checked before anything runs; and the columns each
function needs (preflight: a column that a split lacks)."""

from __future__ import annotations

import inspect
from collections.abc import Iterable
from typing import TYPE_CHECKING

from tasks.core.errors import UserError
from tasks.core.paths import import_user

if TYPE_CHECKING:
    from tasks.core.config import Config

TRL_KEYWORDS = ("prompts", "completions", "completion_ids", "trainer_state", "log_extra", "log_metric")


def columns_needed(cfg: Config, columns: Iterable[str]) -> list[tuple[str, str]]:
    """(the function, the column) for each of the dataset's `columns` a reward function needs: an argument of it
    without a default, not a configured kwarg (the functions imported already: load_functions)."""
    needed = []
    for i, spec in enumerate(cfg.reward.functions):
        try:
            params = inspect.signature(import_user(spec.fn, f"reward.functions[{i}].fn", noun="function")).parameters
        except (TypeError, ValueError):
            continue
        needed += [(f"reward.functions[{i}] ({spec.fn})", p.name) for p in params.values()
                   if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
                   and p.name in columns and p.name not in spec.kwargs]
    return needed


def check_signature(what: str, fn, available: set[str], columns: list[str], kwargs: dict | None = None,
                    kwargs_field: str = "kwargs", prompt_column: str = "prompt") -> None:
    """One UserError line if `fn` cannot be called the way TRL calls it: a required argument that is neither
    one of TRL's keywords nor a dataset column (nor a configured kwarg), or one that only takes a position; or
    a configured keyword (`kwargs`) that it cannot take (no such parameter and no **kwargs), which the worker
    would otherwise drop without a word."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return                                  # a builtin or C callable: nothing to read, it is tried at run time
    if not any(p.kind is p.VAR_KEYWORD for p in params):
        takes = [p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        if not takes:
            raise UserError(f"{what}: takes no argument by name (only *args, or none); reward functions are "
                            f"called with every argument by keyword, as TRL calls them")
        for key in kwargs or {}:
            if key not in takes:
                raise UserError(f"{kwargs_field}.{key}: {what.rsplit(': ', 1)[-1]} takes no argument {key!r} "
                                f"(it takes {', '.join(takes) or 'none'}, and no **kwargs)")
    for p in params:
        if p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.kind is p.POSITIONAL_ONLY:
            raise UserError(f"{what}: argument {p.name!r} is positional-only; reward functions are called with "
                            f"every argument by keyword, as TRL calls them")
        if p.name not in available and p.name == prompt_column != "prompt":
            raise UserError(f"data.prompt_column: {p.name!r} is read as the prompt (reward functions get it as "
                            f"`prompts`, not by its name), and {what} needs an argument {p.name!r}; expected another "
                            f"column as the prompt, or a function that reads `prompts`")
        if p.name not in available:
            raise UserError(f"{what}: needs argument {p.name!r}, which is neither a dataset column (the data has "
                            f"{columns or 'no column but its prompt'}) nor one of the keywords reward functions get "
                            f"({', '.join(TRL_KEYWORDS)})")
