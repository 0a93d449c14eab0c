"""Prompts: loading a dataset with `datasets`, checking its columns, and the seeded order prompts are visited in.

The order is a pure function of (seed, position): iteration i takes positions
[(i-1)·P, i·P) of an endless stream of per-epoch permutations, so any stage on any machine picks the same
prompts for the same iteration, and the data cursor saved with a checkpoint is just that position.
"""

from __future__ import annotations

import collections
import contextlib
import csv
import functools
import io
import json
import re
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from tasks.core.errors import UserError, disk_full
from tasks.core.process_wide import set_variable

if TYPE_CHECKING:
    from tasks.core.config import Config

_LOCAL_FORMATS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
ROLES = ("system", "user", "assistant", "tool")         # a chat message's roles (prompts, demonstrations)


_CUT_SAID: list[int] = []           # the length of the first prompt this process cut (said once)


def cut_prompt(ids: list[int], max_length: int) -> list[int]:
    """A prompt's token ids cut to their last `max_length` (generate.max_prompt_length, as TRL cuts them), said once
    per process: a cut prompt loses its beginning (a chat prompt its template's start, its system turn)."""
    if len(ids) <= max_length:
        return ids
    if not _CUT_SAID:
        _CUT_SAID.append(len(ids))
        print(f"warning: generate.max_prompt_length: a prompt of {len(ids)} tokens is cut to its last {max_length} "
              f"(it loses its beginning: a chat prompt its template's start); raise generate.max_prompt_length "
              f"where the model's context has room (it and max_completion_length together at most the context: "
              f"`rlflow plan` says), else shorten the prompts (said once)", file=sys.stderr)
    return ids[-max_length:]


def row(i: int) -> str:
    """How a message names the row at index `i` of a table: counting from 1, as an editor counts lines and a
    spreadsheet rows (the first row is row 1: line 1 of a JSON Lines file without blank lines, line 2 of a CSV)."""
    return f"row {i + 1}"


def message_fault(m) -> str | None:
    """What keeps chat message `m` from a chat template, or None: it must be a mapping whose role is one of
    ROLES and whose content is text (a string or a list of parts), or absent beside tool_calls. One rule for
    prompts (data), demonstrations (the warm start) and what an environment's reset returns."""
    if not isinstance(m, dict):
        return f"expected a {{\"role\": ..., \"content\": ...}} mapping, got {type(m).__name__}"
    if m.get("role") not in ROLES:
        return f"role {m.get('role')!r}, expected one of {ROLES}"
    if (calls := m.get("tool_calls")) is not None:
        bad = next((k for k, c in enumerate(calls) if not _a_tool_call(c)), None) if isinstance(calls, list) else -1
        if bad is not None:
            got = json.dumps(calls if bad < 0 else calls[bad], default=str)[:120]
            return (f"tool_calls{'' if bad < 0 else f'[{bad}]'} {got}, expected a list of "
                    f'{{"type": "function", "function": {{"name": ..., "arguments": {{...}}}}}}')
    content = m.get("content")
    if isinstance(content, list):
        for k, part in enumerate(content):
            if not (isinstance(part, dict) and isinstance(part.get("type"), str)):
                return f"content part {k} {json.dumps(part, default=str)[:40]}, expected a mapping with a \"type\""
            if part["type"] == "text" and not isinstance(part.get("text"), str):
                return f"content part {k}'s text {json.dumps(part.get('text'), default=str)[:40]}, expected a string"
        return None
    if isinstance(content, str) or content is None and m.get("tool_calls"):
        return None
    return (f"content {json.dumps(content, default=str)[:40]}, expected a string (or a list of parts, or none "
            f"beside tool_calls)")


def message_text(content) -> str:
    """A message's text: its content as a string, or its text parts' joined (None: no text)."""
    if isinstance(content, list):
        return "".join(str(part.get("text") or "") for part in content if isinstance(part, dict))
    return content if isinstance(content, str) else ""


def _a_tool_call(call) -> bool:
    """A tool call as chat templates read it (OpenAI's and TRL's form, or the function itself): a function with a
    name and arguments (an object, or its JSON text; none: no arguments)."""
    fn = call.get("function", call) if isinstance(call, dict) else None     # (Qwen's templates take it flat too)
    return (isinstance(fn, dict) and isinstance(fn.get("name"), str) and bool(fn["name"].strip())
            and isinstance(fn.get("arguments") or {}, dict | str))


def looks_local(path: str) -> bool:
    """Whether a data path names a local file (a data file's suffix, or an absolute or relative path), not a hub id."""
    return Path(path).suffix.lower() in _LOCAL_FORMATS or path.startswith(("/", "./", "../", "~"))


@functools.lru_cache(maxsize=4)
def load_table(path: str, name: str | None, split: str, field: str = "data.path",
               text_columns: tuple[str, ...] = ()):
    """A local data file or a hub dataset, as `datasets` loads it (once per arguments in this process); a mistake is
    one UserError line naming `field` (data.path, eval.path, warmup.path: the warm start's demonstrations).
    `text_columns`: columns a CSV holds as text whatever its cells look like (the prompt column: `12` is a prompt)."""
    import datasets

    datasets.disable_progress_bars()
    suffix = Path(path).suffix.lower()
    if not Path(path).exists() and looks_local(path):
        raise UserError(f"{field}: {path}: no such file (a path that looks local is not looked up on the hub)")
    offline = False
    try:
        if Path(path).exists():
            if any((Path(path) / f).exists() for f in ("dataset_dict.json", "state.json")):
                return _saved(datasets, path, split)        # (a folder `save_to_disk` wrote)
            if suffix not in _LOCAL_FORMATS:
                raise UserError(f"{field}: {path}: expected a .json/.jsonl/.csv/.parquet file (or a folder that "
                                f"datasets' save_to_disk wrote)")
            if not Path(path).is_file() and not Path(path).is_dir():     # (reading a named pipe waits for ever)
                raise UserError(f"{field}: {path}: not a regular file (a named pipe, a device or a socket); expected "
                                f"a .json/.jsonl/.csv/.parquet file")
            small = Path(path).is_file() and Path(path).stat().st_size <= _READ_FIRST_BYTES
            content = _text_of(Path(path)) if small else None           # (read once, for both checks below)
            if content is not None and (fault := _row_fault(Path(path), content)) is not None:
                raise UserError(f"{field}: {path}: {fault}")           # (what datasets would misread or say badly)
            # A file up to _READ_FIRST_BYTES is read into memory through a cache folder removed at once: nothing is
            # left in datasets' cache (~/.cache/huggingface) for a file that is refused (a column missing, a bad
            # row) or edited later, and a .map() of it writes no cache files either. A larger one keeps datasets'
            # Arrow cache, which spares each stage process parsing it again.
            with tempfile.TemporaryDirectory(prefix="rlflow-data-") if small else contextlib.nullcontext() as cache:
                try:
                    datasets.logging.set_verbosity(datasets.logging.CRITICAL)    # (it logs the error we report)
                    kinds = _csv_kinds(content, text_columns) if content is not None and suffix == ".csv" else {}
                    table = datasets.load_dataset(_LOCAL_FORMATS[suffix], split=split,    # (test[:100]: a slice)
                                                  data_files={split.split("[", 1)[0].strip() or split: path},
                                                  cache_dir=cache, keep_in_memory=small, **kinds)
                    table.data.table.validate(full=True)  # (JSON strings that are not UTF-8 load, and fail when read)
                    return table
                except Exception as e:  # noqa: BLE001 - said as one line, with the file's line or row
                    if disk_full(e) is not None:      # (the temporary cache folder's disk, not the file: said below)
                        raise
                    if "[" in split and "nstruction" in str(e):      # (a slice of the split: its mistake)
                        raise UserError(f"{field.rsplit('.', 1)[0]}.split: {split!r} of {path}: "
                                        f"{str(e).strip().splitlines()[0][:200]}") from None
                    raise UserError(f"{field}: {path}: {_where_unreadable(Path(path), e)}") from None
                finally:
                    datasets.logging.set_verbosity(datasets.logging.WARNING)
        offline = not _hub_reachable()
        if offline:          # (else datasets retries for ~25 s, printing each retry): the local cache alone
            _go_offline(datasets)
        return datasets.load_dataset(path, name, split=split)
    except UserError:
        raise
    except Exception as e:  # datasets raises many types for a bad path/split; the user sees one line
        if (full := disk_full(e)) is not None:      # (a hub download's, or the temporary folder's, disk)
            raise full from e
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        why = " (the Hugging Face Hub is not reachable from here: only its local cache was tried)" if offline else ""
        raise UserError(f"{field}: cannot load {path!r} split {split!r}{why}: {msg[:200]}") from None


def _saved(datasets, path: str, split: str):
    """A folder `save_to_disk` wrote, as load_from_disk reads it: a DatasetDict's split (a slice as load_dataset
    takes it, `train[:100]`), or the Dataset."""
    table, base = datasets.load_from_disk(path), split.split("[", 1)[0].strip()
    if isinstance(table, datasets.DatasetDict):
        if base not in table:
            raise ValueError(f"no split {base!r} (it has {', '.join(table)})")
        table = table[base]
    cut = datasets.ReadInstruction.from_spec(split).to_absolute({base: len(table)})[0] if "[" in split else None
    return table.select(range(cut.from_, cut.to)) if cut is not None else table


def _where_unreadable(path: Path, error: Exception) -> str:
    """Why `datasets` could not read a local file, with where: the first JSON Lines line that does not parse
    (1-based, as an editor shows it), else the innermost cause, which names the row or line (pyarrow's JSON
    rows count from 0; pandas' CSV lines from 1)."""
    if path.suffix.lower() in (".jsonl", ".json", ".csv"):
        raw = path.read_bytes()
        if not raw.strip():
            return "no rows (the file is empty)"
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            line = raw.count(b"\n", 0, e.start) + 1
            return f"line {line}: not UTF-8 text ({e.reason} at byte {e.start})"
        if path.suffix.lower() == ".csv" and len([ln for ln in text.splitlines() if ln.strip()]) == 1:
            return "no rows (only a header line)"
        if path.suffix.lower() == ".json" and text.strip().replace(" ", "").replace("\n", "") in ("[]", "{}"):
            return f"no rows (the file is an empty {'array' if text.strip()[0] == '[' else 'object'})"
        if (fault := _row_fault(path, text)) is not None:
            return fault
    elif path.suffix.lower() == ".parquet":
        with contextlib.suppress(Exception):        # (not Parquet: the reader's own message, below, says so)
            import pyarrow.parquet as pq
            if pq.ParquetFile(path).metadata.num_rows == 0:
                return "no rows (the Parquet file holds none)"
    inner = error
    while (inner.__cause__ or inner.__context__) is not None:
        inner = inner.__cause__ or inner.__context__
    msg = (str(inner).strip().splitlines() or [""])[0] or (str(error).strip().splitlines() or [""])[0]
    return f"cannot read it: {msg[:300] or type(inner).__name__}"


_READ_FIRST_BYTES = 256 << 20     # local JSON and CSV files up to this size are read row by row first


class _Unfit(ValueError):
    """A JSON value no table column holds (an int past 64 bits, a float past its range, NaN or Infinity), said
    with what to write instead."""


def _fit_int(text: str) -> int:
    if not -(1 << 63) <= (value := int(text)) < 1 << 63:
        raise _Unfit(f"the integer {text[:24]}{'...' if len(text) > 24 else ''} does not fit in 64 bits (write it "
                     f"as a string)")
    return value


def _fit_float(text: str) -> float:
    if (value := float(text)) in (float("inf"), float("-inf")):
        raise _Unfit(f"the number {text[:24]} is past a float's range (write it as a string)")
    return value


def _no_constant(text: str):
    raise _Unfit(f"{text} is not JSON (a missing value is null; or write it as a string)")


def _one_document(text: str) -> bool:
    try:
        json.loads(text)
        return True
    except ValueError:
        return False


def _once_each(pairs: list[tuple[str, Any]]) -> dict:
    seen = set()
    for key, value in pairs:
        if key in seen:
            raise _Unfit(f"key {key!r} appears twice in one object (JSON readers keep one of them; write it once)")
        seen.add(key)
        for text in (key, value):
            if (half := _lone_surrogate(text)) is not None:
                raise _Unfit(f"{'key' if text is key else f'the value of {key!r}'} holds a lone surrogate "
                             f"{half!r} (half of a \\uXXXX pair, not a character: pandas and pyarrow refuse it)")
    return dict(pairs)


def _in_row(text: str, fault: _Unfit) -> str:
    """`fault`, found in a JSON document, said with the row of its array that holds it when one can be told."""
    try:                    # (read again as Python reads JSON, each row written back and tried: the first that
        items = json.loads(text)    # fails is the fault's; a key twice is lost in that reading: said without a row)
    except ValueError:
        return str(fault)
    for i, item in enumerate(items if isinstance(items, list) and "appears twice" not in str(fault) else []):
        try:
            json.loads(json.dumps(item), parse_int=_fit_int, parse_float=_fit_float, parse_constant=_no_constant,
                       object_pairs_hook=_once_each)
        except _Unfit:
            return f"{row(i)} of its array: {fault}"
    return str(fault)


def _lone_surrogate(value: Any) -> str | None:
    """The first unpaired UTF-16 surrogate a JSON string (or a list's strings) holds: `\\ud800` alone is JSON that
    Python reads, and no UTF-8 writer can write."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            return value[e.start]
    elif isinstance(value, list):
        return next((half for item in value if (half := _lone_surrogate(item)) is not None), None)
    return None


def _text_of(path: Path) -> str | None:
    """A local .jsonl/.json/.csv file's text (None: another kind, or not UTF-8: _where_unreadable's to say)."""
    if path.suffix.lower() not in (".jsonl", ".json", ".csv"):
        return None
    try:
        return path.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError:
        return None


def _row_fault(path: Path, text: str | None = None) -> str | None:
    """What keeps a local .jsonl/.json/.csv file from being read as the rows it holds, with where, or None: a
    line that is not JSON, a row that is not a JSON object (a JSON array of strings would be read as a column
    `text`), a number no column holds, NaN or Infinity (not JSON; Python's json and datasets took them), a CSV
    line with more or fewer fields than its header (pandas would make the extra ones the index: each row
    shifted), a column named twice in a CSV header. Text that is not UTF-8 is _where_unreadable's to say."""
    suffix = path.suffix.lower()
    if suffix not in (".jsonl", ".json", ".csv") or (text := _text_of(path) if text is None else text) is None:
        return None
    if suffix == ".csv":
        csv.field_size_limit(1 << 31)                      # (pandas has no limit on a field)
        if (start := _unclosed_quote(text)) is not None:     # (read as one field to the end: said at the end)
            return f"line {start}: a quoted field begins here and its quote is never closed"
        records = csv.reader(io.StringIO(text))
        try:
            header = next(records, None)
            if header and (twice := next((c for c, k in collections.Counter(header).items() if k > 1 and c.strip()),
                                         None)):
                return f"line 1: column {twice!r} appears twice in the header (the second would be read as {twice}.1)"
            for record in records:
                if any(f.strip() for f in record) and header and len(record) != len(header):
                    return (f"line {records.line_num}: {len(record)} fields where the header has {len(header)} "
                            f"(a field that holds a comma must be quoted)")
        except csv.Error:
            return None                                    # (said as datasets says it)
        return None
    hooks = {"parse_int": _fit_int, "parse_float": _fit_float, "parse_constant": _no_constant,
             "object_pairs_hook": _once_each}
    text = text.lstrip("\ufeff")
    lines = [line.rstrip("\r") for line in text.split("\n")]    # (not splitlines: U+2028 is text in a string)
    if text.lstrip().startswith(("[", "{")):             # one document (an array of rows, an object), or JSON Lines
        try:
            items = json.loads(text, **hooks)
        except _Unfit as e:
            if text.lstrip().startswith("[") or _one_document(text):
                filled = [n for n, line in enumerate(lines, 1) if line.strip()]    # (JSON Lines of one row: its line)
                return f"line {filled[0]}: {e}" if len(filled) == 1 and text.lstrip()[0] == "{" else _in_row(text, e)
            items = None                                   # (said with its line below)
        except ValueError:
            items = None                                   # (not one document: JSON Lines)
        if isinstance(items, dict):
            return None                                    # (one object: datasets reads its own way)
        if isinstance(items, list):
            bad = next((i for i, item in enumerate(items) if not isinstance(item, dict)), None)
            return None if bad is None else (f"{row(bad)} of its array: expected a JSON object (one row), got "
                                             f"{type(items[bad]).__name__}")
    for n, line in enumerate(lines, 1):
        if line.strip():
            try:
                obj = json.loads(line, **hooks)
            except _Unfit as e:
                return f"line {n}: {e}"
            except ValueError as e:
                return f"line {n}: not JSON ({e})"
            if not isinstance(obj, dict):
                return f"line {n}: expected a JSON object (one row), got {type(obj).__name__}"
    return None


def _unclosed_quote(text: str) -> int | None:
    """The line where a CSV record whose quote is never closed begins, or None."""
    records, start = csv.reader(io.StringIO(text), strict=True), 1
    try:
        for _ in records:
            start = records.line_num + 1
    except csv.Error as e:
        return start if "end of data" in str(e) else None
    return None


_CSV_INT = re.compile(r"-?(0|[1-9][0-9]*)")
_CSV_FLOAT = re.compile(r"-?(0|[1-9][0-9]*)?(\.[0-9]+)?([eE][+-]?[0-9]+)?")
_CSV_BOOL = {"true", "false", "True", "False", "TRUE", "FALSE"}


def _csv_kinds(content: str, text_columns: tuple[str, ...] = ()) -> dict:
    """How a small CSV file's columns are read (load_dataset's keyword arguments): a column is a number only
    where every filled cell is written as that number is (pandas read `007` as 7 and a prompt `12` as an int), a
    truth value where each is true/false, else text as written (pandas read `NA`, `null`, `nan` and `None` as
    missing); an empty cell is missing. {} (pandas' own guesses) for a header with empty or repeated names."""
    import datasets

    try:
        records = list(csv.reader(io.StringIO(content)))
    except csv.Error:
        return {}                                          # (said as datasets says it)
    if not records or len(set(records[0])) != len(records[0]) or not all(records[0]):
        return {}
    rows = [r for r in records[1:] if r and (len(r) > 1 or r[0].strip())]     # (pandas skips blank lines)
    columns = {name: [r[i] for r in rows if i < len(r) and r[i] != ""] for i, name in enumerate(records[0])}
    blanks = {name: any(len(r) <= i or r[i] == "" for r in rows) for i, name in enumerate(records[0])}

    def kind(name: str, cells: list[str]) -> str:
        if not cells or name in text_columns:
            return "large_string"
        if all(_CSV_INT.fullmatch(c) for c in cells):
            if not all(len(c) <= 20 and -2**63 <= int(c) < 2**63 for c in cells):
                return "large_string"                                # (past int64: its digits, as written)
            return "float64" if blanks[name] else "int64"          # (pandas' int column with gaps: floats)
        if all(_CSV_FLOAT.fullmatch(c) and any(ch.isdigit() for ch in c.split("e")[0].split("E")[0])
               for c in cells):
            return "float64"
        return "bool" if not blanks[name] and all(c in _CSV_BOOL for c in cells) else "large_string"

    features = datasets.Features({name: datasets.Value(kind(name, cells)) for name, cells in columns.items()})
    return {"features": features, "keep_default_na": False, "na_values": [""],
            "true_values": sorted(_CSV_BOOL - {"false", "False", "FALSE"}),
            "false_values": ["false", "False", "FALSE"]}


@functools.lru_cache(maxsize=1)
def _hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hugging Face Hub answers a TCP connection here (offline mode set by the user counts as no)."""
    import os
    import socket
    from urllib.parse import urlparse

    if os.environ.get("HF_HUB_OFFLINE") == "1" or os.environ.get("HF_DATASETS_OFFLINE") == "1":
        return False
    host = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co")).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def _go_offline(datasets) -> None:
    """datasets and huggingface_hub read offline mode once, at import: set it where they look."""
    import huggingface_hub.constants

    set_variable("HF_HUB_OFFLINE", "1")
    huggingface_hub.constants.HF_HUB_OFFLINE = True
    datasets.config.HF_HUB_OFFLINE = True


def load_prompts(cfg: Config, split: str = "train", *, whole: bool = False):
    """The training split (or, with split="eval", the held-out one, less its training prompts unless `whole`:
    _without_training_prompts), checked: the prompt column exists and holds strings or chat message lists. With
    data.reasoning_gym, the task's generated splits (tasks/core/procedural.py)."""
    if cfg.data.reasoning_gym is not None and not (split == "eval" and cfg.eval.path):
        from tasks.core import procedural

        return procedural.load(cfg, split)         # made, not read: checked by construction
    if split == "eval":
        path, name, sp, field = (cfg.eval.path or cfg.data.path, cfg.eval.name or cfg.data.name, cfg.eval.split,
                                 "eval.path")
    else:
        path, name, sp, field = cfg.data.path, cfg.data.name, cfg.data.split, "data.path"
    ds = load_table(path, name, sp, field, (cfg.data.prompt_column,))
    col = cfg.data.prompt_column
    if col not in ds.column_names:
        raise UserError(f"data.prompt_column: column {col!r} not in {path} (columns: {ds.column_names})")
    if len(ds) == 0:
        raise UserError(f"{field}: {path} split {sp!r} has no rows")
    # A prompt past this many characters is a mistake in the data, not a long prompt: it is cut to
    # generate.max_prompt_length tokens anyway, after a tokenizer that may take GBs for it (a 50 MB row did).
    limit = cfg.generate.max_prompt_length * 1000
    for i, value in enumerate(ds[col]):             # every row: a bad one would fail an iteration hours in
        if isinstance(value, str):
            if not value.strip():
                raise UserError(f"{field}: {path} {row(i)} column {col!r}: an empty prompt (expected the text the "
                                f"model answers)")
            if len(value) > limit:
                raise UserError(f"{field}: {path} {row(i)} column {col!r}: {len(value):,} characters, over {limit:,} "
                                f"(1,000 per token of generate.max_prompt_length, where prompts are cut)")
            continue
        if not (isinstance(value, list) and value and all(isinstance(m, dict) for m in value)):
            raise UserError(f"{field}: {path} {row(i)} column {col!r}: expected a string or a list of chat "
                            f"messages, got {type(value).__name__}{' (empty)' if value == [] else ''}")
        for j, m in enumerate(value):
            if (fault := message_fault(m)) is not None:
                raise UserError(f"{field}: {path} {row(i)} column {col!r} message {j}: {fault}")
    _say_mixed_columns(ds, str(path), col)          # (train and eval from one file: said once)
    if split == "eval" and not whole and cfg.data.reasoning_gym is None and cfg.eval_is_held_out():
        ds = _without_training_prompts(cfg, ds, path, name, sp)
    return ds


def prompt_key(value) -> str:
    """A prompt as the held-out checks compare it: its text (a chat prompt: its messages' texts, space-joined),
    casefolded, each run of whitespace one space: `What is 2+2?` and ` what is  2+2? ` are one prompt."""
    if isinstance(value, list):
        value = " ".join(message_text(m.get("content")) for m in value if isinstance(m, dict))
    return " ".join(str(value or "").casefold().split())


def _identity(path: str) -> tuple:
    """What tells a local file's contents apart cheaply (size, modification time, inode); () for a hub id."""
    try:
        st = Path(path).expanduser().stat()
    except OSError:
        return ()
    return (st.st_size, st.st_mtime_ns, st.st_ino)


def _row_keys(ds, column: str, others: tuple[str, ...]) -> list[str]:
    """Each row's prompt_key, and with `others` (an environment's rows: the task is the whole row, the letters
    game's prompt is one sentence for every sequence) those columns' values too."""
    if not others:
        return [prompt_key(v) for v in ds[column]]
    return [prompt_key(r[column]) + "\x00" + prompt_key(json.dumps([r[c] for c in others], default=str))
            for r in ds]


@functools.lru_cache(maxsize=4)
def _training_keys(path: str, name: str | None, split: str, column: str, others: tuple[str, ...],
                   identity: tuple) -> frozenset[str]:
    """The training split's row keys, once per process and file version (`identity`: a file rewritten is read
    again); load_table's own memo spares reading the table a second time."""
    ds = load_table(path, name, split, "data.path", (column,))
    return frozenset(_row_keys(ds, column, others)) if column in ds.column_names else frozenset()


def training_prompt_keys(cfg: Config, others: tuple[str, ...] = ()) -> frozenset[str]:
    """The row keys (_row_keys) of the training split (data.path, data.name, data.split); empty for
    reasoning-gym tasks, whose held-out split is made apart."""
    if cfg.data.reasoning_gym is not None:
        return frozenset()
    d = cfg.data
    return _training_keys(d.path, d.name, d.split, d.prompt_column, others, _identity(d.path))


_OVERLAP_SAID: set[tuple] = set()


def _without_training_prompts(cfg: Config, ds, path: str, name: str | None, split: str):
    """The held-out split less its rows whose prompt is also a training prompt (prompt_key: the same text, case
    and spacing aside): a model is scored held-out only on prompts it never trained on, whatever the paths, hub
    names and split slices say. How many were left out is said once per process; every one of them: one line."""
    col, d = cfg.data.prompt_column, cfg.data
    trained = load_table(d.path, d.name, d.split, "data.path", (col,)).column_names if cfg.env.episodic() else []
    others = tuple(sorted(set(ds.column_names) & set(trained) - {col}))
    train = training_prompt_keys(cfg, others)
    keep = [i for i, k in enumerate(_row_keys(ds, col, others)) if k not in train]
    if len(keep) == len(ds):
        return ds
    field = "eval.path" if cfg.eval.path else "eval.split"
    where = (f"eval.path {path}" if cfg.eval.path else f"eval.split {split!r} of data.path {path}") + \
        (f" (eval.name {name})" if cfg.eval.name else "")
    if not keep:
        raise UserError(f"{field}: {path if cfg.eval.path else repr(split)}"
                        f"{f' (eval.name {name})' if cfg.eval.name else ''}: every held-out prompt ({len(ds)}) is "
                        f"also a training prompt (data.path {cfg.data.path} split {cfg.data.split!r}; the same text, "
                        f"case and spacing aside); expected prompts the model never trains on (another file or "
                        f"split), or eval.split {cfg.data.split!r} without eval.path to evaluate on the training set")
    said = (str(path), name, split, len(ds), len(keep))
    if said not in _OVERLAP_SAID:
        _OVERLAP_SAID.add(said)
        print(f"eval: {len(ds) - len(keep)} of {len(ds)} held-out prompts ({where}) are also training prompts "
              f"(same text): left out; scored on the other {len(keep)}", file=sys.stderr)
    return ds.select(keep)


def _say_mixed_columns(ds, where: str, prompt_column: str) -> None:
    """One warning per column whose rows hold values of different types (`datasets` gives such a column its Json
    feature: 5 in one row, "5" or [5] in another). Reward functions get each row's value as it is, as TRL's do,
    so a function written for one type fails (or scores 0) on the others: said before the run, with the first row
    of each type."""
    import datasets

    from tasks.core.config_base import warn

    for column, feature in ds.features.items():
        if column == prompt_column or not isinstance(feature, datasets.Json):
            continue
        first: dict[str, int] = {}
        for i, value in enumerate(ds[column]):
            first.setdefault(type(value).__name__, i)
        if len(first) > 1:
            seen = ", ".join(f"{kind} in {row(i)}" for kind, i in first.items())
            warn(f"warning: {where} column {column!r} mixes types ({seen}): reward functions get each row's value "
                 f"as it is (convert it there, e.g. str({column}))")


def indices(n_rows: int, seed: int | list[int], start: int, count: int, shuffle: bool = True) -> list[int]:
    """Row indices at stream positions [start, start+count) (`seed`: an int, or a list of ints for a stream of
    its own, as dynamic sampling's extra rounds have: tasks/core/curriculum.py)."""
    out = []
    for pos in range(start, start + count):
        epoch, offset = divmod(pos, n_rows)
        out.append(int(_permutation(n_rows, tuple(np.atleast_1d(seed).tolist()), epoch)[offset]) if shuffle
                   else offset)
    return out


@functools.lru_cache(maxsize=8)
def _permutation(n_rows: int, seed: tuple[int, ...], epoch: int) -> np.ndarray:
    return np.random.default_rng([*seed, epoch]).permutation(n_rows)


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
