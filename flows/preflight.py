"""Preflight: everything a user can get wrong, checked before the first byte of a run is written.

    preflight(cfg)        # raises UserError (one line naming the field, exit 2) or returns; writes nothing

The CLI calls it before Prefect's server starts (a mistake costs no start-up; flows/cli.py: checked_config, for
`rlflow run` and `rlflow plan` alike, so plan refuses what run refuses), the flow again at its start (a
deployment's run has no CLI in front of it). It reaches into every layer a run will use (the store, the
datasets and reward functions, the environment factory or server, the model's tokenizer, the sandbox, the
engines, the launcher's recipes), which is why it is a module of its own and not part of the loop.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch

from flows.launch import recipe_path, recipes_folder
from tasks.core.config import Config
from tasks.core.config_base import has_control_character, warn
from tasks.core.config_infra import tracking_scheme
from tasks.core.curriculum import check as check_curriculum
from tasks.core.data import load_prompts, prompt_of, row
from tasks.core.errors import UserError
from tasks.core.models import base_path, check_lora_targets, engine_context, load_tokenizer, parts_as_text
from tasks.core.paths import REPO_ROOT, require_creatable
from tasks.core.placement import placement_of
from tasks.core.store import open_store
from tasks.engines.sampling import sampling_engine
from tasks.engines.training import training_engine
from tasks.envs.runtime.sources import source_of
from tasks.scoring.functions import WorkerSetupFailed, functions_of, load_functions, start_worker
from tasks.scoring.signatures import columns_needed


def check_tracking_server(cfg: Config, timeout: float = 10.0) -> None:
    """tracking.uri an http(s) MLflow server: it answers as MLflow (MLflow's client would retry a refused
    connection for minutes, saying nothing); a sqlite database: a path where one can be made, or one (a folder
    there retried for minutes after the lease; another file failed the run after its first stage); another
    database: its driver is installed. tracking.experiment not deleted there (read, not written)."""
    uri = cfg.tracking.uri
    if tracking_scheme(uri) in ("postgresql", "mysql", "mssql"):
        _require_driver(uri)
    elif not uri.startswith(("http://", "https://")):
        from tasks.core.paths import require_creatable
        from tasks.core.tracking import local_folder
        from tasks.core.tracking_db import sqlite_file

        if (folder := local_folder(uri)) is not None:      # a sqlite database's folder, or a file store
            require_creatable(folder, "tracking.uri")
        if (database := sqlite_file(uri)) is not None and database.exists():
            try:
                with open(database, "rb") as f:
                    head, size = f.read(100), os.fstat(f.fileno()).st_size
            except OSError as e:
                raise UserError(f"tracking.uri: {uri}: {database} cannot be read as a database "
                                f"({e.strerror or type(e).__name__}); expected a sqlite database file, or a path "
                                f"where none is yet") from None
            if head and head[:16] != b"SQLite format 3\x00":
                raise UserError(f"tracking.uri: {uri}: {database} is not a sqlite database (another kind of file); "
                                f"expected a sqlite database file, or a path where none is yet") from None
            if (short := _cut_short(head, size)) is not None:
                raise UserError(f"tracking.uri: {uri}: {database} is cut short ({size} bytes of the {short} its "
                                f"header says: truncated or damaged); restore it, or name another database")
            if head and size <= QUICK_CHECK_BYTES and (damage := _damaged(database)) is not None:
                raise UserError(f"tracking.uri: {uri}: {database} is damaged (sqlite: {damage}); restore it, or name "
                                f"another database")
            if head and _deleted_in(database, cfg.tracking.experiment):
                raise UserError(f"tracking.experiment: {cfg.tracking.experiment!r} was deleted in MLflow ({uri}); "
                                f"restore it (`mlflow experiments restore`) or name another")
        return
    from tasks.core.tracking import require_answer

    require_answer(uri, "tracking.uri", timeout, experiment=cfg.tracking.experiment)


def _cut_short(head: bytes, size: int) -> int | None:
    """The size a sqlite file's header says it has where the file is smaller (a copy or a disk cut short: a
    traceback from SQLAlchemy after the lease), else None. The header's page count is read only where it is
    valid (its version-valid-for number equals the change counter)."""
    if len(head) < 100 or head[92:96] != head[24:28]:
        return None
    page = int.from_bytes(head[16:18], "big")
    want = (65536 if page == 1 else page) * int.from_bytes(head[28:32], "big")
    return want if size < want else None


def _require_driver(uri: str) -> None:
    """A database URI SQLAlchemy can parse, whose driver (DBAPI module) is installed: imported, not connected."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, NoSuchModuleError

    shown = uri.split("@")[-1]
    try:
        url = make_url(uri)
        shown = url.render_as_string(hide_password=True)
        url.get_dialect().import_dbapi()
    except (ArgumentError, NoSuchModuleError, ValueError) as e:
        raise UserError(f"tracking.uri: {shown}: {str(e).splitlines()[0]}; expected a database URL SQLAlchemy "
                        f"reads (postgresql://USER@HOST/DB)") from None
    except ImportError as e:
        hint = {"postgresql": " (pip install psycopg2-binary)", "mysql": " (pip install mysqlclient)"}.get(
            url.get_backend_name(), "")
        raise UserError(f"tracking.uri: {shown}: its database driver is not installed ({e.name or e}); install it "
                        f"in this environment{hint}") from None


QUICK_CHECK_BYTES = 256 << 20     # (sqlite's quick check reads every page: a bigger database is not looked into)


def _damaged(database: Path) -> str | None:
    """What sqlite's quick check finds wrong inside a database whose header is whole (pages overwritten: a
    traceback from SQLAlchemy after the lease), else None; read only, and a database locked by a writer is not
    looked into."""
    import sqlite3

    try:
        with contextlib.closing(sqlite3.connect(f"{database.as_uri()}?mode=ro", uri=True)) as db:
            found = [line for row in db.execute("PRAGMA quick_check(3)").fetchall()
                     for line in str(row[0]).splitlines() if line and not line.startswith("***")]
    except sqlite3.OperationalError:                  # (locked, busy, unreadable: others say so, or it works)
        return None
    except sqlite3.DatabaseError as e:
        return str(e)
    return None if found == ["ok"] else "; ".join(found)[:300]


def _deleted_in(database: Path, experiment: str) -> bool:
    """Whether MLflow's sqlite database holds `experiment` as deleted (read only; a database without MLflow's
    tables yet: no)."""
    import sqlite3

    try:
        with contextlib.closing(sqlite3.connect(f"{database.as_uri()}?mode=ro", uri=True)) as db:
            row = db.execute("SELECT lifecycle_stage FROM experiments WHERE name = ?", (experiment,)).fetchone()
    except sqlite3.Error:
        return False
    return row is not None and row[0] == "deleted"


def preflight(cfg: Config) -> None:
    """Raise UserError for any input mistake; writes nothing."""
    place = placement_of(cfg)              # where each stage and service runs (tasks/core/placement.py)
    episode_stages = ["generate"] + (["evaluate"] if cfg.eval.every else [])
    if cfg.model.dtype == "float16":
        raise UserError("model.dtype: float16 weights trained by AdamW with no loss scaling become NaN/inf (measured: "
                        "every tensor of the first policy, at lr 1e-6 too); expected bfloat16 or float32")
    store = open_store(cfg)
    store.check()                          # made (else one line), reachable, the bucket there, credentials taken
    if (root := getattr(store, "path", None)) is not None:     # (a folder store: the run's and the lease's
        for sub in (cfg.run.name, ".locks"):                            # folders in it, where they are files)
            require_creatable(root / sub, f"store.uri ({sub} in it)")
    check_tracking_server(cfg)             # an MLflow server that does not answer: one line, not a silent hang
    check_curriculum(cfg)                  # prompts with stable ids (not a hub dataset): one line
    if cfg.publish.register_model:
        check_registered_model_name(cfg)
    datasets = [load_prompts(cfg)] + ([load_prompts(cfg, split="eval", whole=True)] if cfg.eval.every else [])
    # The functions imported in their worker first (kept for the first batch where the reward stage runs here): a
    # module that crashes as it is imported (a signal, a broken C extension) ends that process, not this one. One
    # that raises, waits or exits by Python is said below by this process's own import, naming the function.
    deferred = None
    if place.where("reward") != "sky":
        try:
            start_worker(functions_of(cfg), keep=place.where("reward") == "inline")
        except WorkerSetupFailed as e:
            if e.crashed:
                raise
            deferred = e
    # every split's rows reach the reward functions: each split is checked, and a column missing from the
    # evaluation split alone is reported naming that split's file
    functions = load_functions(cfg, columns=set(datasets[0].column_names) - {cfg.data.prompt_column})
    if len(datasets) > 1:
        try:
            load_functions(cfg, columns=set(datasets[1].column_names) - {cfg.data.prompt_column})
        except UserError as e:
            source = (f"eval.path {cfg.eval.path}" if cfg.eval.path else "data.reasoning_gym"
                      if cfg.data.reasoning_gym is not None else f"data.path {cfg.data.path}")
            split = f"the evaluation split ({source}, split {cfg.eval.split!r})"
            said = str(e)           # (a clash of a column's name: "data: column ..." named the training data)
            raise UserError(f"{split}: {said[6:]}" if said.startswith("data: ") else
                            said.replace("the data has ", f"{split} has ")) from None
        # a held-out split's rows that are training prompts too are left out (said once); all of them: one line
        datasets[1] = load_prompts(cfg, split="eval")
    _check_needed_values(cfg, datasets)
    if cfg.eval.every:
        from tasks.evaluate import check_named_rewards

        check_named_rewards(cfg, functions.all_names, functions.weights)    # eval.pass_reward, .format_reward
    if cfg.reward.models:
        from tasks.scoring.judges import check_models

        check_models(cfg)          # pins, classifier or not, URLs that answer, key variables: one line, exit 2
        if on_vllm := [(i, m) for i, m in enumerate(cfg.reward.models)
                       if place.judges[m.name] == "local" and m.engine == "vllm"]:
            from tasks.engines.vllm_offline import installed_python

            (i, m), *_ = on_vllm      # a judge server on vLLM here, and no vLLM environment: one line naming it
            installed_python(cfg, f"reward.models[{i}] ({m.name}).engine: vllm")
    if place.env == "local" and any(place.where(s) == "sky" for s in episode_stages):
        raise UserError("env.where: local serves the environments on this machine, which the generate cluster "
                        "(launcher: sky) cannot reach; use env.where: sky, or the URL of a server of yours")
    if cfg.warmup is not None:
        check_warmup(cfg)                  # the demonstrations, every row (tasks/sft.py: check): one line, exit 2
    path = base_path(cfg)
    if cfg.generate.streaming is not None and cfg.generate.engine == "hf" and not Path(path).is_dir():
        raise UserError(f"model.name_or_path: {cfg.model.name_or_path} is a hub id, and generate.streaming's hf "
                        f"sampler loads each policy in place into a model folder's weights; download it first "
                        f"(`hf download {cfg.model.name_or_path} --local-dir DIR`) and name the folder")
    if place.replicas_where == "local" and cfg.generate.engine == "hf":
        check_replicas_fit(cfg, path, place.replicas)     # N processes each with the model: within this machine's
    tokenizer = load_tokenizer(path)
    # the rollouts' source (prompts, environments, an agent): its factory, server or agent, one line, exit 2
    source_of(cfg).check(cfg, datasets, path, tokenizer)
    _check_chat_rows(cfg, datasets, path, tokenizer)
    if place.where("train") != "sky":
        if cfg.train.device == "cuda" and not torch.cuda.is_available():
            raise UserError("train.device: cuda, but this machine has no CUDA device (torch.cuda.is_available() "
                            "is False); use auto or cpu")
        if cfg.train.lora_r:
            check_lora_targets(cfg, path)
    if (cfg.reward.sandbox.isolation == "bubblewrap" or cfg.reward.sandbox.python) and place.where("reward") != "sky":
        from tasks.scoring import sandbox

        sandbox.runner(cfg.reward.sandbox)     # bubblewrap or an interpreter asked for, not working: one line, exit 2
    if deferred is not None:               # (what failed in the worker alone: one line, after this process's checks)
        raise deferred
    # The recipes install the engines on their clusters; a stage that runs here needs them here.
    if any(place.where(s) != "sky" for s in episode_stages):
        sampling_engine(cfg).check_installed(cfg)
    if place.where("train") != "sky":
        training_engine(cfg).check_installed(cfg)
    if cfg.train.learner.offline():
        from tasks.engines.training import offline_rollouts

        offline_rollouts(cfg, store)            # not scored rollouts, or a row with no reward: one line, exit 2
    remote = [s for s in place.stages if place.where(s) != "inline"]    # (a routed one too)
    sky_stages = any(place.where(s) == "sky" for s in remote)
    served = place.services_on_sky()       # env, replica, judge: servers the flow starts on SkyPilot
    if sky_stages or served:
        check_sky_python(cfg)             # the SkyPilot environment (.venv-sky): one line naming what builds it
    if sky_stages and not cfg.store.uri.startswith("s3://"):
        raise UserError(f"store.uri: {cfg.store.uri}: the sky launcher needs a store the clusters can reach "
                        f"(s3://...), not a local folder")
    if (served or sky_stages) and recipes_folder(cfg) != Path(cfg.launcher.recipes).expanduser():
        # (found in the checkout, not here: fine for the `local` launcher, which runs on this machine)
        raise UserError(f"launcher.recipes: {cfg.launcher.recipes} is not a folder of the working directory "
                        f"({Path.cwd()}): the sky recipes send their workdir `.`, the working directory, to the "
                        f"clusters, which must be the project that holds them; run from {REPO_ROOT}")
    for stage in remote + served:
        recipe_path(cfg, stage)              # (each recipe parsed: one line naming the file and line)
    check_context(cfg, path)               # (last: the hf engine's is a warning, not said before a refusal)


REPLICA_PROCESS_BYTES = 350 << 20     # a replica's process besides its weights: Python, torch, transformers, its
                                      # server (measured about 400 MB resident with a 0.1M-parameter model)


def check_replicas_fit(cfg: Config, path: str, n: int) -> None:
    """`n` generate replicas on this machine (hf engine): n processes, each with the model's weights and a Python
    with torch, must fit in its memory, else the machine swaps or kills them one by one mid-run: one line."""
    if torch.cuda.is_available():       # (hf replicas sample on the GPU there: their weights are not host memory)
        return
    folder = Path(path)
    files = (list(folder.glob("*.safetensors")) or list(folder.glob("*.bin"))) if folder.is_dir() else []
    weights = sum(f.stat().st_size for f in files)      # (a hub download may hold both formats: one counted)
    each = weights + REPLICA_PROCESS_BYTES
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if n * each > total:
        raise UserError(f"generate.replicas: {n} replicas on this machine, each a process holding the model (about "
                        f"{each / 2**30:.1f} GiB: {weights / 2**30:.2f} GiB of weights and a Python with torch), "
                        f"need about {n * each / 2**30:.0f} GiB; this machine has {total / 2**30:.0f} GiB; expected "
                        f"at most {max(total // each, 1)} (or launcher.stages {{generate: sky}}: a cluster each)")


def check_context(cfg: Config, path: str) -> None:
    """The prompt and completion lengths within the model's context (tasks/core/models.py: engine_context, the
    bound vLLM derives; an episode's tokens after its first prompt are env.max_tokens). vllm: a
    generate.max_model_len above it keeps the engine from starting: one line, exit 2. Lengths past it otherwise
    are a warning (vLLM stops a completion there, and an actual prompt that long fails; a model with learned
    positions fails past them); hf runs rotary positions past it (degraded, as transformers allows): nothing."""
    if (found := engine_context(path)) is None:
        return
    context, key, rotary = found
    gc, episodic, after = cfg.generate, cfg.env.episodic(), cfg.completion_limit()
    need = cfg.sequence_limit()                  # (an episode: its first prompt and every token after it)
    model = f"the model's context ({context}, {key})"
    lengths = (f"generate.max_prompt_length: {gc.max_prompt_length} + "
               f"{'env.max_tokens' if episodic else 'max_completion_length'} {after} = {need} tokens")
    fits = f"expected at most {context} together" + (f" (max_prompt_length {context - after} or less)"
                                                     if after < context else "")
    if gc.engine == "vllm" and gc.max_model_len is not None and gc.max_model_len > context:
        raise UserError(f"generate.max_model_len: {gc.max_model_len} is above {model}, which vLLM refuses to start "
                        f"with; expected at most {context}, or null (max_prompt_length + the completion's limit, "
                        f"capped there)")
    if need > context and (gc.engine == "vllm" or not rotary):    # (hf runs rotary positions past it: said nothing)
        happens = ("is stopped at the context (vLLM's max_model_len), and a prompt as long as that fails the run"
                   if gc.engine == "vllm" else "fails (its learned positions end there)")
        warn(f"warning: {lengths} is above {model}: on the {gc.engine} engine a sequence that long {happens}; "
             f"{fits}")


def _files(cfg: Config) -> list[tuple[str, str | None]]:
    """The field and file of each split preflight reads (training's, then evaluation's); None: reasoning-gym's."""
    return [("data.path", cfg.data.path),
            ("eval.path" if cfg.eval.path else "data.path", cfg.eval.path or cfg.data.path)]


def _check_needed_values(cfg: Config, datasets: list) -> None:
    """A column a reward function needs with no value in some rows of a split (or all): a warning naming the
    first (the function is called with None there; one that does not take it fails its whole batch, an iteration
    without a training step, which went unsaid until then; TRL's multi-task functions return None for it)."""
    import pyarrow.compute as pc

    for ds, (field, file) in zip(datasets, _files(cfg)):
        if not file:             # (reasoning-gym's rows: rlflow's own, some tasks' answers None for their checker)
            continue
        where = f"{field}: {file}"
        for what, column in columns_needed(cfg, ds.column_names):
            values = ds.data.column(column)                     # (arrow's count: no row read into Python)
            if not (empty := values.null_count):
                continue
            first = pc.index(pc.is_null(values), True).as_py()
            rows = "every row" if empty == len(values) else \
                f"{row(first)}{f' and {empty - 1} more' if empty > 1 else ''}"
            warn(f"warning: {where} {rows} has no value in column {column!r}, which {what} needs: it is called "
                 f"with None there")


def _check_chat_rows(cfg: Config, datasets: list, path: str, tokenizer) -> None:
    """Every row's prompt as the model takes it: chat messages (or data.system_prompt) need a template, a content
    in parts a template that reads them or text parts alone; prompts sampled as they are (no environment, no
    agent) the template takes (tried once per shape of roles: one that must alternate them refused a row after
    the store was written) and text of some tokens (a tokenizer with no unknown token reads some as none: a
    traceback in generate). data.system_prompt beside rows that are messages already is a warning."""
    col, system, said, shapes = cfg.data.prompt_column, cfg.data.system_prompt, False, set()
    as_is = not (cfg.env.factory or cfg.env.agent)
    for ds, (field, file) in zip(datasets, _files(cfg)):
        def where(i: int, field=field, file=file) -> str:
            return f"{field}: {file} {row(i)} column {col!r}" if file else f"data.reasoning_gym {row(i)}"

        values = ds[col]
        if as_is and system is None:
            _check_some_tokens(values, tokenizer, where)
        for i, value in enumerate(values):
            if not isinstance(value, list) and system is None:
                continue
            if not tokenizer.chat_template:
                how = "" if isinstance(value, list) else " with data.system_prompt"
                raise UserError(f"model.name_or_path: {path}: its tokenizer has no chat template, but the prompts "
                                f"are chat messages ({where(i)}{how})")
            if isinstance(value, list) and system is not None and file and not said:
                said = True
                warn(f"warning: data.system_prompt applies to plain-text prompts only; {where(i)} is chat messages "
                     f"already, which keep their own (put the system message in the row)")
            messages = prompt_of(cfg, {col: value})
            try:
                messages = parts_as_text(tokenizer, messages)
            except ValueError as e:
                raise UserError(f"{where(i)}: {e}") from None
            shape = tuple((m.get("role"), type(m.get("content")).__name__, bool(m.get("tool_calls")))
                          for m in messages)
            if as_is and shape not in shapes:
                shapes.add(shape)
                try:
                    tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
                except Exception as e:  # noqa: BLE001 - the template's own refusal (jinja's raise_exception, ...)
                    said_why = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
                    raise UserError(f"{where(i)}: the model's chat template refuses it ({said_why}); roles "
                                    f"{[m.get('role') for m in messages]}") from None


PROBES = ("\u65e5", "\u00e9", "\U0001f642", "~", "\x07")     # (what a tokenizer of some characters drops)


def _check_some_tokens(values: list, tokenizer, where) -> None:
    """Each plain-text prompt is some tokens of the model's vocabulary (one line naming the first that is none);
    not looked at where the tokenizer reads any text (bytes, or an unknown token: each probe some tokens)."""
    if all(tokenizer(probe, add_special_tokens=False)["input_ids"] for probe in PROBES):
        return
    texts = [(i, v) for i, v in enumerate(values) if isinstance(v, str)]
    for at in range(0, len(texts), 1000):
        chunk = texts[at:at + 1000]
        ids = tokenizer([v for _, v in chunk], add_special_tokens=False)["input_ids"]
        for (i, v), got in zip(chunk, ids):
            if not got:
                raise UserError(f"{where(i)}: {v[:40]!r} is no tokens of this model's vocabulary (its tokenizer "
                                f"drops what it cannot read); expected text it reads")


def check_warmup(cfg: Config) -> None:
    """The warm start's inputs: its base is a base model, not a policy of this run's own (v0 is made from the
    base; a run's later policies come from v0), and the demonstrations read, render and fit (tasks/sft.py)."""
    from tasks.core.models import registered_uri, store_key
    from tasks.sft import check, check_first, made_v0, resumable

    store = open_store(cfg)
    name = cfg.model.name_or_path
    if name.startswith("models:/"):                   # (a registered version of this run's own)
        name = registered_uri(cfg, name, "model.name_or_path")
    if (store_key(store, name, "model.name_or_path") or "").startswith(f"{cfg.run.name}/policy/"):
        raise UserError(f"model.name_or_path: {cfg.model.name_or_path} is a policy of this run ({cfg.run.name}), "
                        f"not the base its warm start trains; name the base model (the run's v0 is made from it)")
    # v0 made already: from the same inputs (else one line naming what changed), nothing more to check
    if made_v0(cfg, store) is None:
        check_first(cfg, store)
        check(cfg)
        resumable(cfg, store)


def check_sky_python(cfg: Config) -> None:
    """The Python the sky launcher calls SkyPilot's SDK in (launcher.sky_python, else .venv-sky) runs and has it:
    one line naming what it is instead (a folder, a file that cannot run, a name not on PATH), or the command that
    builds it (make demo builds only .venv)."""
    import shutil
    import subprocess

    from flows.launch import Sky
    from tasks.core.processes import run

    python = Sky(cfg).python
    expected = "expected a Python executable with SkyPilot (.venv-sky/bin/python; `make setup` builds it)"
    found = Path(python) if os.sep in python else shutil.which(python)
    if found is None:
        raise UserError(f"launcher.sky_python: {python}: no such command on PATH; {expected}")
    if Path(found).is_dir():
        raise UserError(f"launcher.sky_python: {python} is a folder; {expected}")
    if Path(found).exists() and not os.access(found, os.X_OK):
        raise UserError(f"launcher.sky_python: {python} is not executable; {expected}")
    try:
        probe = run([python, "-c", "import importlib.util, sys; sys.exit(importlib.util.find_spec('sky') is None)"],
                    capture_output=True, timeout=60) if Path(found).exists() else None
    except (OSError, subprocess.TimeoutExpired) as e:
        raise UserError(f"launcher.sky_python: {python} cannot be run "
                        f"({getattr(e, 'strerror', None) or type(e).__name__}); {expected}") from None
    if probe is None or probe.returncode != 0:
        raise UserError(f"launcher.sky_python: {python} has no SkyPilot; `make setup` builds .venv-sky (SkyPilot "
                        f"0.14.1 in an environment of its own), or set launcher.sky_python")


def check_registered_model_name(cfg: Config) -> None:
    """The MLflow registered model name (publish.registered_model_name, else run.name), by MLflow's own rules
    (those of every registry store, and the file store's): refused now, not after training."""
    from mlflow.exceptions import MlflowException

    try:                               # (the file store's rules: MLflow's general ones, no path separator or %)
        from mlflow.store.model_registry.file_store import _validate_model_name
    except ImportError:
        from mlflow.utils.validation import _validate_model_name

    from tasks.core.registry import registered_model_name

    name = registered_model_name(cfg)
    field = "publish.registered_model_name" if cfg.publish.registered_model_name is not None else \
        "run.name (the registered model name; set publish.registered_model_name)"
    try:
        _validate_model_name(name)
    except MlflowException as e:
        raise UserError(f"{field}: {name!r}: MLflow refuses it as a registered model name: "
                        f"{' '.join(e.message.split())}") from None
    if "@" in name:
        raise UserError(f"{field}: {name!r}: '@' would read as an alias in models:/NAME@ALIAS")
    if has_control_character(name) or len(name) > 256:
        raise UserError(f"{field}: {name[:60]!r}{'...' if len(name) > 60 else ''}: expected at most 256 characters "
                        f"(MLflow's database column) and no control characters (a newline, a tab)")
