"""Prompts: loading a dataset with `datasets`, checking its columns, and the seeded order prompts are visited in.

The order is a pure function of (seed, position): iteration i takes positions
[(i-1)·P, i·P) of an endless stream of per-epoch permutations, so any stage on any machine picks the same
prompts for the same iteration, and the data cursor saved with a checkpoint is just that position.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from tasks.core.errors import UserError

if TYPE_CHECKING:
    from tasks.core.config import Config

_LOCAL_FORMATS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


@functools.lru_cache(maxsize=4)
def _load(path: str, name: str | None, split: str, field: str = "data.path"):
    import datasets

    datasets.disable_progress_bars()
    suffix = Path(path).suffix.lower()
    try:
        if Path(path).exists():
            if suffix not in _LOCAL_FORMATS:
                raise UserError(f"{field}: {path}: expected a .json/.jsonl/.csv/.parquet file")
            return datasets.load_dataset(_LOCAL_FORMATS[suffix], data_files={split: path}, split=split)
        return datasets.load_dataset(path, name, split=split)
    except UserError:
        raise
    except Exception as e:  # datasets raises many types for a bad path/split; the user sees one line
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"{field}: cannot load {path!r} split {split!r}: {msg[:200]}") from None


def load_prompts(cfg: Config, split: str = "train"):
    """The training split (or, with split="eval", the held-out one), checked: the prompt column exists and
    holds strings or chat message lists."""
    if split == "eval":
        path, name, sp, field = (cfg.eval.path or cfg.data.path, cfg.eval.name or cfg.data.name, cfg.eval.split,
                                 "eval.path")
    else:
        path, name, sp, field = cfg.data.path, cfg.data.name, cfg.data.split, "data.path"
    ds = _load(path, name, sp, field)
    col = cfg.data.prompt_column
    if col not in ds.column_names:
        raise UserError(f"data.prompt_column: column {col!r} not in {path} (columns: {ds.column_names})")
    if len(ds) == 0:
        raise UserError(f"{field}: {path} split {sp!r} has no rows")
    for i, value in enumerate(ds[col][:1000]):
        if not (isinstance(value, str) or (isinstance(value, list) and all(isinstance(m, dict) for m in value))):
            raise UserError(f"data: row {i} column {col!r}: expected a string or a list of chat messages, "
                            f"got {type(value).__name__}")
    return ds


def indices(n_rows: int, seed: int, start: int, count: int, shuffle: bool = True) -> list[int]:
    """Row indices at stream positions [start, start+count)."""
    out = []
    for pos in range(start, start + count):
        epoch, offset = divmod(pos, n_rows)
        if shuffle:
            perm = np.random.default_rng([seed, epoch]).permutation(n_rows)
            out.append(int(perm[offset]))
        else:
            out.append(offset)
    return out


def cursor(iteration: int, prompts_per_iteration: int) -> int:
    """Stream position of the first prompt of `iteration` (1-based)."""
    return (iteration - 1) * prompts_per_iteration


def prompt_of(cfg: Config, row: dict):
    """The prompt of a dataset row as the generator sees it: the prompt column, wrapped in chat messages with
    `data.system_prompt` when that is set and the column holds plain text."""
    prompt = row[cfg.data.prompt_column]
    if cfg.data.system_prompt is not None and isinstance(prompt, str):
        return [{"role": "system", "content": cfg.data.system_prompt}, {"role": "user", "content": prompt}]
    return prompt
