"""A user's mistake ends with one line on stderr naming the field or row, exit code 2, and nothing written
to the store."""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import boto3
import pytest

from tasks.core import builtin_models
from tasks.core.config import load_config
from tasks.core.errors import UserError
from tests.conftest import TINY, run_cli, run_cli_many, s3_overrides
from tests.gguf_files import write_gguf

pytestmark = pytest.mark.slow
ARITH = TINY.parent / "smollm2-arith.yaml"


STRICT_TEMPLATE = ("{% for m in messages %}{% if (m['role'] == 'user') != (loop.index0 % 2 == 0) %}"
                   "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant') }}"
                   "{% endif %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                   "{% if add_generation_prompt %}<s>assistant: {% endif %}")


def _model_with_a_strict_template(tmp: Path) -> Path:
    """The tiny model with a chat template that refuses roles that do not alternate user/assistant (as Llama 2's,
    Mistral's and Gemma's do): no system message, no two user messages in a row."""
    dest = _model_without_chat_template(tmp).rename(tmp / "strict-chat-model")
    (dest / "chat_template.jinja").write_text(STRICT_TEMPLATE)
    return dest


def _model_without_chat_template(tmp: Path) -> Path:
    """The tiny model with its chat template removed: chat prompts cannot be rendered with it."""
    import shutil

    from tasks.core import builtin_models

    dest = tmp / "no-chat-model"
    shutil.copytree(builtin_models.resolve("builtin:tiny-lm"), dest)
    (dest / "chat_template.jinja").unlink(missing_ok=True)
    tok_cfg = dest / "tokenizer_config.json"
    tok_cfg.write_text(json.dumps({k: v for k, v in json.loads(tok_cfg.read_text()).items() if k != "chat_template"}))
    return dest


def _cases(tmp: Path) -> dict[str, tuple[list[str], str]]:
    (tmp / "unknown.yaml").write_text(TINY.read_text() + "\nbogus_section: {x: 1}\n")
    (tmp / "badyaml.yaml").write_text("run: [unclosed\n")
    (tmp / "no_tokenizer").mkdir(exist_ok=True)
    (tmp / "no_tokenizer" / "config.json").write_text('{"model_type": "llama"}')
    (tmp / "list.yaml").write_text("- run\n- data\n")
    (tmp / "blank.yaml").write_text("# a config still to be written\n")
    (tmp / "nocol.jsonl").write_text(json.dumps({"question": "a=", "answer": "bbb"}) + "\n")
    (tmp / "badrow.jsonl").write_text(json.dumps({"prompt": 5, "answer": "bbb"}) + "\n")
    (tmp / "badlist.jsonl").write_text(json.dumps({"prompt": ["a=", "b="], "answer": "bbb"}) + "\n")
    (tmp / "empty.jsonl").write_text("")
    (tmp / "latin.jsonl").write_bytes(b'{"prompt": "a=", "answer": "bbb"}\n{"prompt": "b=", "answer": "\xff"}\n')
    (tmp / "bot.jsonl").write_text(json.dumps({"prompt": [{"role": "user", "content": "a="},
                                                          {"role": "bot", "content": "b"}], "answer": "bbb"}) + "\n")
    (tmp / "prompts.txt").write_text("a=\n")
    (tmp / "no_interpreter").write_text("")
    (tmp / "no_interpreter").chmod(0o755)
    (tmp / "not_a.db").write_text("not a sqlite database")
    import sqlite3

    with contextlib.closing(sqlite3.connect(tmp / "whole.db")) as db:
        db.execute("CREATE TABLE t (x)")
        db.executemany("INSERT INTO t VALUES (?)", [("x" * 500,)] * 400)
        db.commit()
    (tmp / "cut.db").write_bytes((tmp / "whole.db").read_bytes()[:50_000])
    damaged = bytearray((tmp / "whole.db").read_bytes())       # (a page overwritten: the header is whole)
    damaged[10 * 4096 + 8:10 * 4096 + 4000] = random.Random(0).randbytes(3992)
    (tmp / "damaged.db").write_bytes(bytes(damaged))
    (tmp / "a_folder.db").mkdir(exist_ok=True)
    (tmp / "empty_array.json").write_text("[]")
    (tmp / "twice.csv").write_text("prompt,prompt\na=,b=\n")              # (pandas read the second as prompt.1)
    (tmp / "own.jsonl").write_text((TINY.parent / "data" / "letters.jsonl").read_text())
    (tmp / "chat.jsonl").write_text(json.dumps({"prompt": [{"role": "user", "content": "a="}], "answer": "bbb"}) + "\n")
    text_row = json.dumps({"prompt": "a=", "answer": "bbb"}) + "\n"          # (row 1 fine: rows after it were not looked at)
    os.mkfifo(tmp / "pipe.jsonl")                     # (reading it waited for ever)
    (tmp / "part_number.jsonl").write_text(json.dumps({"prompt": [{"role": "user", "content": [
        {"type": "text", "text": 5}]}], "answer": "bbb"}) + "\n")
    two_users = [{"role": "user", "content": "a="}, {"role": "user", "content": "b="}]
    (tmp / "two_users.jsonl").write_text(text_row * 3 + json.dumps({"prompt": two_users, "answer": "bbb"}) + "\n")
    (tmp / "no_tokens.jsonl").write_text(text_row + json.dumps({"prompt": "\u65e5\u672c", "answer": "bbb"}) + "\n")
    (tmp / "chat_second.jsonl").write_text(text_row + json.dumps({"prompt": [{"role": "user", "content": "b="}],
                                                                 "answer": "ccc"}) + "\n")
    (tmp / "image_second.jsonl").write_text(text_row + json.dumps({"prompt": [{"role": "user", "content": [
        {"type": "image", "url": "x.png"}]}], "answer": "ccc"}) + "\n")
    (tmp / "syntax_err.py").write_text("def f(completions, **kw)\n    return [0.0]\n")
    (tmp / "needs_col.py").write_text("def f(completions, solution, **kw):\n    return [0.0] * len(completions)\n")
    (tmp / "exits_on_import.py").write_text("import sys\nsys.exit(3)\n")
    (tmp / "os_exits_on_import.py").write_text("import os\nos._exit(0)\n")    # (was: exit 0, nothing done)
    # (a broken C extension: it took rlflow's own process with it as preflight imported it, exit 139, no line)
    (tmp / "crashes_on_import.py").write_text("import ctypes\nctypes.string_at(0)\n"
                                              "def f(completions, **kw):\n    return [0.0] * len(completions)\n")
    (tmp / "dies_in_worker.py").write_text("import os, signal, sys\nif sys.argv[0].endswith('worker.py'):\n"
                                           "    os.kill(os.getpid(), signal.SIGKILL)\n"
                                           "def f(completions, **kw):\n    return [0.0] * len(completions)\n")
    (tmp / "varargs.py").write_text("def f(*args):\n    return [0.0] * len(args)\n")
    (tmp / "not_a_function.py").write_text("class C:\n    def __init__(self, completions, **kw):\n        pass\n\n\n"
                                           "def g(completions, **kw):\n    yield 1.0\n\n\nTHRESHOLD = 42\n")
    (tmp / "chat_no_role.jsonl").write_text(json.dumps({"prompt": [{"role": "user", "content": "a="}], "answer": "b"})
                                            + "\n" + json.dumps({"prompt": [{"text": "a="}], "answer": "b"}) + "\n")
    (tmp / "broken.jsonl").write_text('{"prompt": "a="}\n\n{"prompt": "b=", \n{"prompt": "c="}\n')
    (tmp / "not_object.jsonl").write_text('{"prompt": "a="}\n["b="]\n')
    (tmp / "ragged.csv").write_text("prompt,answer\na=,bbb\nb=,ccc,extra\n")
    (tmp / "shifted.csv").write_text("prompt,answer\na=,bbb,extra,more\nc=,ddd,x,y\n")   # (pandas: 2 columns of index)
    (tmp / "strings.json").write_text('["a=", "b="]')                                  # (datasets: a column `text`)
    (tmp / "huge.jsonl").write_text('{"prompt": "a=", "answer": "b"}\n{"prompt": "b=", "answer": 1e999}\n')
    (tmp / "surrogate.jsonl").write_text('{"prompt": "a=", "answer": "b"}\n{"prompt": "b=\\ud800", "answer": "c"}\n')
    (tmp / "surrogate.json").write_text('[{"prompt": "a=", "answer": "b"},\n {"prompt": "b=", "answer": ["\\udc00"]}]')
    (tmp / "huge.json").write_text('[{"prompt": "a=", "answer": "b"},\n {"prompt": "b=", "answer": 1e999}]')
    (tmp / "nan.jsonl").write_text('{"prompt": "a=", "answer": "b"}\n{"prompt": "b=", "answer": NaN}\n')
    (tmp / "infinity.json").write_text('[{"prompt": "a=", "answer": "b"}, {"prompt": "b=", "answer": -Infinity}]')
    (tmp / "dup.yaml").write_text("run:\n  name: a\n  iterations: 2\n  name: b\n")
    (tmp / "latin1.yaml").write_bytes("run:\n  name: caf\u00e9\n".encode("latin-1"))
    (tmp / "a_file").write_text("not a folder\n")
    (tmp / "two_docs.yaml").write_text("run:\n  name: a\n---\nrun:\n  name: b\n")
    (tmp / "emptyprompt.jsonl").write_text(json.dumps({"prompt": "a=", "answer": "b"}) + "\n"
                                           + json.dumps({"prompt": "  ", "answer": "b"}) + "\n")
    (tmp / "header.csv").write_text("\ufeffprompt,answer\n")
    (tmp / "hugeprompt.jsonl").write_text(json.dumps({"prompt": "a=" * 300_000, "answer": "b"}) + "\n")
    (tmp / "bomb.yaml").write_text("x: [&a0 [lol,lol,lol,lol,lol,lol,lol,lol,lol]" + "".join(   # 9**6 values
        f", &a{i} [" + ",".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 7)) + "]\nrun: {name: *a6}\n")
    (tmp / "listkey.yaml").write_text("? [a, b]\n: 1\n")
    (tmp / "runfilestore").mkdir()
    (tmp / "runfilestore" / "tiny-demo").write_text("not a folder\n")
    (tmp / "deep.yaml").write_text("x: " + "{a: " * 1000 + "1" + "}" * 1000 + "\n")
    spaces = {"unknown_key": "train.learning_rate: {type: log_uniform, low: 1.0e-5, high: 1.0e-2}\n",
              "empty_range": "train.lr: {type: uniform, low: 0.01, high: 0.01}\n",
              "wrong_type": "train.lr: {type: categorical, choices: [fast, 0.01]}\n",
              "unknown_dist": "train.lr: {type: normal, low: 0, high: 1}\n",
              "not_a_mapping": "- train.lr\n",
              "ok": "train.lr: {type: log_uniform, low: 1.0e-5, high: 1.0e-2}\n",
              "twice": "train.lr: {type: uniform, low: 0.1, high: 0.2}\ntrain.lr: {type: uniform, low: 0.3, high: 0.4}\n",
              "log_text": "train.lr: {type: uniform, low: 0.001, high: 0.01, log: 'false'}\n",
              "section": "train: {type: categorical, choices: [{lr: 0.1}]}\n",
              "dict_choice": "train.learner: {type: categorical, choices: [{loss_type: grpo}]}\n",
              "float_on_int": "train.micro_batch_size: {type: uniform, low: 1, high: 8}\n",
              "linear": "train.lr: {type: uniform, low: 0.001, high: 0.01}\n",
              "date_choice": "train.lr: {type: categorical, choices: [2024-01-01]}\n",
              # (passed alone through the schema, refused by the run's preflight, together, or ignored: trials
              # failed, or searched a dimension that changed nothing, before)
              "missing_data": f"data.path: {{type: categorical, choices: [{TINY.parent}/data/successor.jsonl, "
                              f"{tmp}/missing.jsonl]}}\n",
              "corner": "data.curriculum.defer: {type: int, low: 1, high: 4}\n"
                        "run.max_staleness: {type: int, low: 0, high: 3}\n",
              "ignored": "train.learner.gamma: {type: uniform, low: 0.9, high: 1.0}\n"}
    for name, text in spaces.items():
        (tmp / f"space_{name}.yaml").write_text(text)
    _study_of_another_space(tmp / "oldstudy")
    (tmp / "space_latin1.yaml").write_bytes("train.lr: {type: uniform, low: 0.1, high: 0.2} # \xe9\n".encode("latin-1"))
    strict = _model_with_a_strict_template(tmp)
    no_chat = _model_without_chat_template(tmp)
    (tmp / "not-a-model.gguf").write_text("not GGUF at all\n")
    write_gguf(builtin_models.resolve("builtin:tiny-lm"), tmp / "bert.gguf", arch="bert")
    (tmp / "strict_sig.py").write_text("def f(completions, answer):\n    return [0.0] * len(completions)\n")
    (tmp / "badtools_env.py").write_text(BADTOOLS_ENV)
    (tmp / "withsol.jsonl").write_text(json.dumps({"prompt": "a=", "answer": "bbb", "solution": "bbb"}) + "\n")
    (tmp / "nosol.jsonl").write_text(json.dumps({"prompt": "a=", "answer": "bbb"}) + "\n")
    (tmp / "evalclash.jsonl").write_text(json.dumps({"prompt": "a=", "answer": "bbb", "trainer_state": 1}) + "\n")
    (tmp / "badrecipes").mkdir()
    (tmp / "badrecipes" / "generate.yaml").write_text("name: generate\nrun: python: -m tasks.generate\nenvs: {}\n")
    not_env_server = _http_server()
    offline = _offline_store(tmp / "offstore")
    ofl = ["-o", f"store.uri={tmp}/offstore", "-o", "train.algorithm=vtrace_awr", "-o"]
    rg = "data.reasoning_gym={task: chain_sum, size: 8, eval_size: 4"
    demo = "tasks.rewards.demo:successor_reward"
    import torch

    gpu = {} if torch.cuda.is_available() else {
        "cuda without a GPU": (["run", str(TINY), "-o", "train.device=cuda"], "train.device: cuda, but this machine")}
    return {**gpu,
        # config files and overrides
        "missing config file": (["run", str(tmp / "nope.yaml")], "config: file not found"),
        "config path a folder": (["run", str(tmp)], f"config: {tmp} is a folder; expected a YAML config file"),
        "not yaml": (["run", str(tmp / "badyaml.yaml")], "not valid YAML"),
        "not a mapping": (["run", str(tmp / "list.yaml")], "expected a mapping of sections"),
        "empty config": (["run", str(tmp / "blank.yaml")], "blank.yaml: holds no settings"),
        "unknown section": (["run", str(tmp / "unknown.yaml")], "unknown key 'bogus_section'"),
        "unknown key by override": (["run", str(TINY), "-o", "train.learning_rate=1"],
                                    "unknown key 'train.learning_rate'; did you mean 'train.lr'?"),
        "misspelt key in a list item": (["run", str(TINY), "-o", 'reward.functions=[{"fn": "m:f", "wieght": 2}]'],
                                        "unknown key 'reward.functions.0.wieght'; did you mean "
                                        "'reward.functions.0.weight'?"),
        "wrong type": (["run", str(TINY), "-o", "train.lr=fast"], "train.lr"),
        "out of bounds": (["run", str(TINY), "-o", "generate.num_generations=1"], "generate.num_generations"),
        "negative lora rank": (["run", str(TINY), "-o", "train.lora_r=-4"], "train.lora_r"),
        "bad loss type": (["run", str(TINY), "-o", "train.loss_type=ppo"], "train.learner.loss_type"),
        "bad dtype": (["run", str(TINY), "-o", "model.dtype=int8"], "model.dtype"),
        "bad launcher": (["run", str(TINY), "-o", "launcher.where=cloud"], "launcher.where"),
        "k above n": (["run", str(TINY), "-o", "eval.k=8", "-o", "eval.num_generations=4"], "k (8) must be <= num_generations (4)"),
        "run name escapes": (["run", str(TINY), "-o", "run.name=../escape"], "run.name: string should match pattern "
                             "'^[A-Za-z0-9][A-Za-z0-9._-]{0,99}$'"),
        "infinite number": (["run", str(TINY), "-o", "train.lr=inf"], "train.lr: input should be a finite number"),
        "duplicate yaml key": (["run", str(tmp / "dup.yaml")], "line 4: key 'name' appears twice in one mapping"),
        "config not utf-8": (["run", str(tmp / "latin1.yaml")], "latin1.yaml: not UTF-8 text"),
        "yaml alias bomb": (["run", str(tmp / "bomb.yaml")], f"config: {tmp}/bomb.yaml: holds more than 100000 values "
                            "once its YAML aliases are expanded"),
        "two yaml documents": (["run", str(tmp / "two_docs.yaml")], f"config: {tmp}/two_docs.yaml line 3: a second "
                               "YAML document starts here; expected one"),
        "yaml nested 1000 deep": (["run", str(tmp / "deep.yaml")], f"config: {tmp}/deep.yaml: nested deeper than 64 "
                                  "levels"),
        "malformed endpoint url": (["run", str(TINY), "-o", "store.endpoint_url=localhost:9000"],
                                   "store.endpoint_url: expected http(s)://HOST[:PORT]"),
        "unknown tracking scheme": (["run", str(TINY), "-o", "tracking.uri=ftp://host/x"],
                                    "tracking.uri: expected one of sqlite://"),
        "empty experiment name": (["run", str(TINY), "-o", 'tracking.experiment=""'], "tracking.experiment"),
        "store path is a file": (["run", str(TINY), "-o", f"store.uri={tmp}/a_file"], "is a file, not a folder"),
        "curriculum on a data folder": (["run", str(TINY), "-o", "data.curriculum.defer=2", "-o", f"data.path={tmp}"],
                                        f"data.path: {tmp}: expected a .json/.jsonl/.csv/.parquet file"),
        "store folder that cannot be made": (["run", str(TINY), "-o", "store.uri=file:///proc/rlflow-store"],
                                             "store.uri: cannot create /proc/rlflow-store ("),
        "tracking database under a file": (["run", str(TINY), "-o", f"tracking.uri=sqlite:///{tmp}/a_file/m.db"],
                                           f"tracking.uri: {tmp}/a_file is a file, not a folder"),
        # (2026-12-05, a sweep of store/tracking: each was a traceback, most after the store was written)
        "tracking in a folder": (["run", str(TINY), "-o", f"tracking.uri=file://{tmp}/mlruns"],
                                 "tracking.uri: MLflow's filesystem backend"),
        "sqlite URI with two slashes": (["run", str(TINY), "-o", "tracking.uri=sqlite://m.db"],
                                        "tracking.uri: expected sqlite:///PATH"),
        "empty tracking URI": (["run", str(TINY), "-o", 'tracking.uri=""'], "tracking.uri: expected an MLflow"),
        "tracking database without its driver": (["run", str(TINY), "-o",
                                                  "tracking.uri=postgresql://u:pw@127.0.0.1:9/db"],
                                                 "postgresql://u:***@127.0.0.1:9/db: its database driver is not "
                                                 "installed (psycopg2)"),
        "tracking database in /proc": (["run", str(TINY), "-o", "tracking.uri=sqlite:////proc/rlflow-m.db"],
                                       "tracking.uri: /proc is not writable"),
        # (257 to 500 characters passed MLflow's own check, and its database column on PostgreSQL or MySQL refused it)
        "experiment name past MLflow's column": (["run", str(TINY), "-o", f"tracking.experiment={'e' * 257}"],
                                                 "tracking.experiment: string should have at most 256 characters"),
        "experiment name with a newline": (["run", str(TINY), "-o", 'tracking.experiment="a\\nb"'],
                                           "tracking.experiment: expected a name without control characters"),
        "store scheme a slash short": (["run", str(TINY), "-o", "store.uri=s3:/bucket/x"],
                                       "store.uri: expected file://PATH, s3://BUCKET[/PREFIX] or a local path (a "
                                       "scheme with two slashes"),
        "store in the working directory": (["run", str(TINY), "-o", "store.uri=."],
                                           "store.uri: the working directory itself"),
        "store path past a name's limit": (["run", str(TINY), "-o", f"store.uri={'a' * 300}"],
                                           "File name too long"),
        "S3 region that is none": (["run", str(TINY), "-o", "store.uri=s3://bucket/x", "-o",
                                    "store.region=not a region!"],
                                   "store.uri: s3://bucket/x: the S3 client cannot be made (InvalidRegionError"),
        "model folder without a tokenizer": (["run", str(TINY), "-o", f"model.name_or_path={tmp}/no_tokenizer"],
                                             "model.name_or_path: cannot load tokenizer from"),
        "off-line rollouts as a URI": (["run", str(TINY), "-o", "train.algorithm=vtrace_awr", "-o",
                                        "train.learner.offline_rollouts=[s3://b/x/rewards]"],
                                       "train.learner.offline_rollouts: 's3://b/x/rewards': expected a key in this "
                                       "run's store"),
        "registered model name with a newline": (["run", str(TINY), "-o", "publish.register_model=true", "-o",
                                                  'publish.registered_model_name="a\\nb"'],
                                                 "publish.registered_model_name: 'a\\nb': expected at most 256 "
                                                 "characters (MLflow's database column) and no control characters"),
        "empty registered model name": (["run", str(TINY), "-o", 'publish.registered_model_name=""'],
                                        "publish.registered_model_name: string should have at least 1 character"),
        "float16 weights to train": (["run", str(TINY), "-o", "model.dtype=float16"],
                                     "model.dtype: float16 weights trained by AdamW"),
        "true as a price": (["run", str(TINY), "-o", "cost.hourly_usd={train: true}"],
                            "cost.hourly_usd: expected numbers, not true or false"),
        "launcher.mode and launcher.where both": (["run", str(TINY), "-o", "launcher.mode=local", "-o",
                                                   "launcher.where=inline"],
                                                  "launcher: mode is now where; give where alone (both were given)"),
        "S3 prefix with ..": (["run", str(TINY), "-o", "store.uri=s3://bucket/../x"],
                              "store.uri: s3://BUCKET/PREFIX: a prefix with an empty, '.' or '..' part"),
        "lora targets the model lacks": (["run", str(TINY), "-o", "train.lora_r=4", "-o",
                                          "train.lora_target_modules=[nope_proj]"],
                                         "train.lora_target_modules: ['nope_proj']: Target modules"),
        "override syntax": (["run", str(TINY), "-o", "train.lr"], "expected key=value"),
        "overrides json": (["run", str(TINY), "--overrides-json", "{not json"], "--overrides-json: expected a JSON list"),
        # reward functions
        "reward module missing": (["run", str(TINY), "-o", 'reward.functions=[{"fn": "nosuchmod:f"}]'],
                                  "reward.functions[0].fn: cannot import module 'nosuchmod'"),
        "reward module does not compile": (["run", str(TINY), "-o", 'reward.functions=[{"fn": "syntax_err:f"}]'],
                                           "reward.functions[0].fn: cannot import module 'syntax_err': SyntaxError"),
        "reward function missing": (["run", str(TINY), "-o", 'reward.functions=[{"fn": "tasks.rewards.demo:nope"}]'],
                                    "reward.functions[0].fn: 'tasks.rewards.demo' has no function 'nope'"),
        "reward needs a column the data lacks": (["run", str(TINY), "-o", 'reward.functions=[{"fn": "needs_col:f"}]'],
                                                 "reward.functions[0].fn: needs_col:f: needs argument 'solution', "
                                                 "which is neither a dataset column (the data has ['answer'])"),
        "reward module exits on import": (["run", str(TINY), "-o", 'reward.functions=[{"fn": "exits_on_import:f"}]'],
                                          "cannot import module 'exits_on_import': SystemExit"),
        "reward module calls os._exit(0) on import": (
            ["run", str(TINY), "-o", 'reward.functions=[{"fn": "os_exits_on_import:f"}]'],
            "cannot import module 'os_exits_on_import': ExitRefused: os._exit(0) refused"),
        "reward module crashes (SIGSEGV) on import": (
            ["run", str(TINY), "-o", 'reward.functions=[{"fn": "crashes_on_import:f"}]'],
            "reward.functions: the reward worker could not set up: it ended (killed by SIGSEGV) as it imported the "
            "functions (a module that exits or crashes when imported)"),
        "reward module dies in its worker": (["run", str(TINY), "-o", 'reward.functions=[{"fn": "dies_in_worker:f"}]'],
                                             "reward.functions: the reward worker could not set up: it ended "
                                             "(killed by SIGKILL) as it imported the functions"),
        "reward takes only *args": (["run", str(TINY), "-o", 'reward.functions=[{"fn": "varargs:f"}]'],
                                    "reward.functions[0].fn: varargs:f: takes no argument by name (only *args, or "
                                    "none); reward functions are called with every argument by keyword"),
        "reward a class": (["run", str(TINY), "-o", 'reward.functions=[{"fn": "not_a_function:C"}]'],
                           "reward.functions[0].fn: not_a_function:C is a class (calling it makes an instance); "
                           "expected a function that returns a list of scores"),
        # (said "'not_a_function' has no function 'THRESHOLD'": it has, a number)
        "reward a number": (["run", str(TINY), "-o", 'reward.functions=[{"fn": "not_a_function:THRESHOLD"}]'],
                            "reward.functions[0].fn: not_a_function:THRESHOLD is int 42, not a function"),
        "reward a generator": (["run", str(TINY), "-o", 'reward.functions=[{"fn": "not_a_function:g"}]'],
                               "reward.functions[0].fn: not_a_function:g is a generator function"),
        "reward path syntax": (["run", str(TINY), "-o", 'reward.functions=[{"fn": "no colon"}]'], "reward.functions.0.fn"),
        "reward weight": (["run", str(TINY), "-o", f'reward.functions=[{{"fn": "{demo}", "weight": "heavy"}}]'],
                          "reward.functions.0.weight"),
        "duplicate reward names": (["run", str(TINY), "-o", f'reward.functions=[{{"fn": "{demo}"}}, {{"fn": "{demo}"}}]'],
                                   "reward.functions: two functions share a name"),
        "no reward functions": (["run", str(TINY), "-o", "reward.functions=[]"], "config: reward.functions: at "
                                "least one reward function or reward.models entry is needed (or an env.factory"),
        "environment module missing": (["run", str(TINY), "-o", "env.factory=nosuchenv:Game"],
                                       "env.factory: cannot import module 'nosuchenv'"),
        "environment factory syntax": (["run", str(TINY), "-o", "env.factory=no colon"], "env.factory"),
        "local server-mode replicas": (["run", str(TINY), "-o", "generate.replicas=2", "-o", "generate.engine=vllm",
                                        "-o", "generate.mode=resident"], "replicas on this machine would share the run's one"),
        "replicas below zero": (["run", str(TINY), "-o", "generate.replicas=-1"], "generate.replicas"),
        "extra rounds' size with one round": (["run", str(TINY), "-o", "generate.dynamic_sampling={max_rounds: 1, "
                                               "prompts_per_round: 8}"], "generate.dynamic_sampling: prompts_per_round "
                                              "8 is never used with max_rounds 1"),
        "accelerator spelled wrong": (["run", str(TINY), "-o", "launcher.accelerators={train: 'A100 x8'}"],
                                      "launcher.accelerators.train"),
        "agent module missing": (["run", str(TINY), "-o", "env.agent=nosuchagent:run"],
                                 "env.agent: cannot import module 'nosuchagent'"),
        "agent that cannot be called so": (["run", str(TINY), "-o", "env.agent=tasks.envs.builtin.games:SayTheLetters"],
                                           "env.agent: tasks.envs.builtin.games:SayTheLetters cannot be called as run(row, "
                                           "base_url, api_key)"),
        "agent and factory": (["run", str(TINY), "-o", "env.agent=tasks.envs.builtin.games:letters_agent", "-o",
                               "env.factory=tasks.envs.builtin.games:SayTheLetters"], "set env.agent or env.factory, not both"),
        "agent on an environment server": (["run", str(TINY), "-o", "env.agent=tasks.envs.builtin.games:letters_agent", "-o",
                                            "env.where=local"], "env.agent: agents run beside the stage's endpoint"),
        "endpoint bounds reversed": (["run", str(TINY), "-o", "env.agent=tasks.envs.builtin.games:letters_agent", "-o",
                                      "env.endpoint.temperature=[1.0, 0.5]"], "env.endpoint.temperature"),
        "browser, not a chromium": (["run", str(TINY), "-o", "env.factory=tasks.envs.builtin.browser:Browser", "-o",
                                     'env.kwargs={"base_url": "http://127.0.0.1:9", "executable": "/nonexistent/chromium"}'],
                                    "env.kwargs.executable: '/nonexistent/chromium' is not an executable Chromium"),
        "off-line rollouts that are not there": (
            ["run", str(TINY), "-o", "train.algorithm=vtrace_awr", "-o",
             "train.learner.offline_rollouts=[elsewhere/iter-000001/rewards]"],
            "train.learner.offline_rollouts: elsewhere/iter-000001/rewards: no scored rollouts at "),
        "environment server, unreachable by the sky generate": (
            ["run", str(TINY), "-o", "env.factory=tasks.envs.builtin.games:SayTheLetters", "-o", "env.where=local", "-o",
             "launcher.stages={generate: sky}"], "env.where: local serves the environments on this machine"),
        "environment server url, nothing there": (
            ["run", str(TINY), "-o", "env.factory=tasks.envs.builtin.games:SayTheLetters", "-o",
             "env.where=http://127.0.0.1:9"], "env.where: no environment server answers at http://127.0.0.1:9"),
        "environment server url, not a url": (
            ["run", str(TINY), "-o", "env.factory=tasks.envs.builtin.games:SayTheLetters", "-o", "env.where=myhost:8330"],
            "env.where: expected stage, local, sky, or the http(s):// URL"),
        "browser, no site": (["run", str(TINY), "-o", "env.factory=tasks.envs.builtin.browser:Browser", "-o",
                              'env.kwargs={"base_url": "http://127.0.0.1:9"}'],
                             "env.kwargs.base_url: no site answers at http://127.0.0.1:9"),
        "browser, partial credit of a whole reward": (
            ["run", str(TINY), "-o", "env.factory=tasks.envs.builtin.browser:Browser", "-o",
             'env.kwargs={"base_url": "http://127.0.0.1:9", "partial_credit": 1.5}'],
            "env.kwargs.partial_credit: a share of the reward below a success's 1 (0 <= c < 1), not 1.5"),
        "browser, no base_url": (["run", str(TINY), "-o", "env.factory=tasks.envs.builtin.browser:Browser"],
                                 "env.kwargs.base_url: the browser environment needs the site's URL"),
        "openenv, not its python": (["run", str(TINY), "-o", "env.factory=tasks.envs.adapters.openenv_adapter:OpenEnv", "-o",
                                     f'env.kwargs={{"base_url": "http://127.0.0.1:9", "python": "{sys.executable}"}}'],
                                    f"env.kwargs.python: {sys.executable} has no openenv-core"),
        "openenv, python missing": (["run", str(TINY), "-o", "env.factory=tasks.envs.adapters.openenv_adapter:OpenEnv", "-o",
                                     'env.kwargs={"base_url": "http://127.0.0.1:9", "python": "/nonexistent/python"}'],
                                    "env.kwargs.python: '/nonexistent/python' is not an executable"),
        "bad reward timeout": (["run", str(TINY), "-o", "reward.timeout_seconds=0"], "reward.timeout_seconds"),
        # data
        # (the reward function was blamed: "needs argument 'answer', which is neither a dataset column")
        "the prompt column a reward needs by name": (["run", str(TINY), "-o", "data.prompt_column=answer"],
                                                     "data.prompt_column: 'answer' is read as the prompt"),
        "missing data file": (["run", str(TINY), "-o", f"data.path={tmp}/missing.jsonl"], "data.path"),
        # a value's control characters are written as escapes (an escape sequence reached the user's terminal raw)
        "control characters in a value": (["run", str(TINY), "-o", "generate.engine=vllm",
                                           "-o", f"generate.vllm_python={tmp}/a\x1b[31mb"],
                                          f"generate.vllm_python: {tmp}/a\\x1b[31mb does not exist"),
        # (the code sandbox's interpreter was first tried by the first code reward's call, after the store was written)
        "sandbox interpreter missing": (["run", str(TINY), "-o", f"reward.sandbox.python={tmp}/missing/python3"],
                                        f"reward.sandbox.python: {tmp}/missing/python3 cannot run sandboxed code"),
        "sandbox interpreter not python": (["run", str(TINY), "-o", f"reward.sandbox.python={tmp}/no_interpreter"],
                                           f"reward.sandbox.python: {tmp}/no_interpreter cannot run sandboxed code"),
        "unsupported data format": (["run", str(TINY), "-o", f"data.path={tmp}/prompts.txt"],
                                    "expected a .json/.jsonl/.csv/.parquet file"),
        "every reward weight 0": (["run", str(TINY), "-o", f'reward.functions=[{{fn: "{demo}", weight: 0}}]'],
                                  "reward: every weight is 0 (reward.functions, reward.models, env.reward_weight)"),
        "a tracking server that does not answer": (["run", str(TINY), "-o", "tracking.uri=http://127.0.0.1:9"],
                                                   "tracking.uri: http://127.0.0.1:9: no MLflow server answers there"),
        "a reward function's kwargs holding bytes": (["run", str(TINY), "-o", f'reward.functions=[{{fn: "{demo}", '
                                                     f'kwargs: {{when: !!binary aGk=}}}}]'],
                                                     "reward.functions.0.kwargs: when: b'hi' is a bytes"),
        "a reward function's kwargs holding NaN": (["run", str(TINY), "-o", f'reward.functions=[{{fn: "{demo}", '
                                                   f'kwargs: {{a: .nan}}}}]'],
                                                   "reward.functions.0.kwargs: a: nan is not a finite number"),
        "an override that begins as JSON and is not": (["run", str(TINY), "-o", f'reward.functions=[{{"fn": "{demo}"'],
                                                       "override reward.functions: its value is not valid YAML or JSON"),
        "the run's folder in the store a file": (["run", str(TINY), "-o", f"store.uri={tmp}/runfilestore"],
                                                 f"store.uri (tiny-demo in it): {tmp}/runfilestore/tiny-demo is a "
                                                 f"file, not a folder"),
        "a config key that is a list": (["run", str(tmp / "listkey.yaml")], "listkey.yaml line 1: not valid YAML: "
                                        "found unhashable key"),
        "a reasoning-gym prompt column it makes": (["run", str(ARITH), "-o", "data.prompt_column=answer"],
                                                   "data: prompt_column: 'answer' is a column data.reasoning_gym "
                                                   "makes"),
        "a tracking database that is another file": (["run", str(TINY), "-o", f"tracking.uri=sqlite:///{tmp}/not_a.db"],
                                                     f"tracking.uri: sqlite:///{tmp}/not_a.db: {tmp}/not_a.db is not a "
                                                     f"sqlite database"),
        "a tracking database cut short": (["run", str(TINY), "-o", f"tracking.uri=sqlite:///{tmp}/cut.db"],
                                          f"tracking.uri: sqlite:///{tmp}/cut.db: {tmp}/cut.db is cut short (50000 "
                                          f"bytes of the"),
        "a tracking database damaged inside": (["run", str(TINY), "-o", f"tracking.uri=sqlite:///{tmp}/damaged.db"],
                                               f"tracking.uri: sqlite:///{tmp}/damaged.db: {tmp}/damaged.db is "
                                               f"damaged (sqlite: On tree page 11 cell 7: Offset"),
        "a tracking database that is a folder": (["run", str(TINY), "-o", f"tracking.uri=sqlite:///{tmp}/a_folder.db"],
                                                 f"tracking.uri: sqlite:///{tmp}/a_folder.db: {tmp}/a_folder.db cannot "
                                                 f"be read as a database"),
        "a CSV header naming a column twice": (["run", str(TINY), "-o", f"data.path={tmp}/twice.csv"],
                                               f"data.path: {tmp}/twice.csv: line 1: column 'prompt' appears twice "
                                               f"in the header"),
        "a data path that is an S3 URI": (["run", str(TINY), "-o", "data.path=s3://bucket/rows.jsonl"],
                                          "data.path: expected a local file's path or a hub dataset id (org/name): "
                                          "s3:// URIs are not read here"),
        "record, out the prompts it records from": (["record", str(TINY.parent / "letters.yaml"), "--policy",
                                                     "tasks.envs.builtin.games:reference_action", "--rows", "0-1",
                                                     "-o", f"data.path={tmp}/own.jsonl", "--out", str(tmp / "own.jsonl")],
                                                    f"--out: {tmp / 'own.jsonl'} is the config's data.path (the "
                                                    f"prompts it records from), which it would replace"),
        "a JSON data file of no rows": (["run", str(TINY), "-o", f"data.path={tmp}/empty_array.json"],
                                        f"data.path: {tmp}/empty_array.json: no rows"),
        "record, a range without its end": (["record", str(TINY), "--policy", "tasks.envs.builtin.games:reference_action",
                                             "--rows", "3-", "--out", str(tmp / "rec.jsonl")],
                                            "--rows: expected indices like 0-9,12, got '3-'"),
        "record, rows with an underscore": (["record", str(TINY), "--policy", "tasks.envs.builtin.games:reference_action",
                                             "--rows", "0-1_0", "--out", str(tmp / "rec.jsonl")],
                                            "--rows: expected indices like 0-9,12, got '0-1_0'"),
        "record, rows in other digits": (["record", str(TINY), "--policy", "tasks.envs.builtin.games:reference_action",
                                          "--rows", "\u0663", "--out", str(tmp / "rec.jsonl")],
                                         "--rows: expected indices like 0-9,12"),
        "record, an empty range of rows": (["record", str(TINY), "--policy", "tasks.envs.builtin.games:reference_action",
                                            "--rows", "5-2", "--out", str(tmp / "rec.jsonl")],
                                           "--rows: 5-2: an empty range (its end before its start)"),
        "record, a range past a million rows": (["record", str(TINY), "--policy",
                                                 "tasks.envs.builtin.games:reference_action", "--rows", "0-10000000000",
                                                 "--out", str(tmp / "rec.jsonl")],
                                                "--rows: 0-10000000000: more than 1,000,000 rows"),
        "record, a file it would not write": (["record", str(TINY), "--policy",
                                               "tasks.envs.builtin.games:reference_action", "--out", str(tmp / "rec.csv")],
                                              f"--out: {tmp / 'rec.csv'}: rlflow record writes JSON Lines"),
        "record, episodes past a million": (["record", str(TINY.parent / "letters.yaml"), "--policy",
                                             "tasks.envs.builtin.games:reference_action", "--rows", "0-1", "--n",
                                             "1000000", "--out", str(tmp / "rec.jsonl")],
                                            "--n: 1000000 episodes per row x 2 rows: more than 1,000,000 episodes"),
        "record, out where nothing can be made": (["record", str(TINY), "--policy",
                                                   "tasks.envs.builtin.games:reference_action", "--out",
                                                   "/proc/rlflow-rec.jsonl"], "--out: cannot write /proc/rlflow-rec"),
        "record, an empty out": (["record", str(TINY), "--policy", "tasks.envs.builtin.games:reference_action",
                                  "--out", ""], "--out: empty; expected the path of a file"),
        "export, a version of digits that are not 0-9": (["export", str(TINY), "\u00b2", str(tmp / "out")],
                                                         "VERSION: expected a number, latest, best or models:/"),
        "export, a folder where nothing can be made": (["export", str(TINY), "1", "/proc/rlflow-out"],
                                                       "DEST: cannot write /proc/rlflow-out"),
        "export, a GGUF file where nothing can be made": (["export", str(TINY), "1", "/proc/rlflow-out.gguf"],
                                                          "DEST: cannot write /proc/rlflow-out.gguf"),
        "export, an empty dest": (["export", str(TINY), "1", ""], "DEST: empty; expected the path of a folder"),
        "export, an S3 client that cannot be made": (["export", str(TINY), "1", str(tmp / "out"), "-o",
                                                      "store.uri=s3://bucket/x", "-o", "store.region=not a region!"],
                                                     "store.uri: s3://bucket/x: the S3 client cannot be made "
                                                     "(InvalidRegionError"),
        "export of a registered version, no server": (
            ["export", str(TINY), "models:/tiny/3", str(tmp / "out"), "-o", "tracking.uri=http://127.0.0.1:9"],
            "VERSION: models:/tiny/3 (tracking.uri): http://127.0.0.1:9: no MLflow server answers there"),
        "plan, an empty config path": (["plan", ""], "config: empty; expected the path of a YAML config file"),
        "record, a return of nan": (["record", str(TINY), "--policy", "tasks.envs.builtin.games:reference_action",
                                     "--min-return", "nan", "--out", str(tmp / "rec.jsonl")],
                                    "--min-return: nan: expected a finite return"),
        "empty dataset": (["run", str(TINY), "-o", f"data.path={tmp}/empty.jsonl"],
                          f"data.path: {tmp}/empty.jsonl: no rows (the file is empty)"),
        "data not UTF-8 (a column the prompts do not read)": (
            ["run", str(TINY), "-o", f"data.path={tmp}/latin.jsonl"],
            f"data.path: {tmp}/latin.jsonl: line 2: not UTF-8 text (invalid start byte at byte 62)"),
        "chat message of a role templates do not have": (
            ["run", str(TINY), "-o", f"data.path={tmp}/bot.jsonl"],
            "row 1 column 'prompt' message 1: role 'bot', expected one of ('system', 'user', 'assistant', 'tool')"),
        "environment reads a column the data lacks": (
            ["run", str(TINY), "-o", "env.factory=tasks.envs.builtin.games:SayTheLetters"],
            "SayTheLetters.reset on the data's first row raised KeyError: 'letters'; expected the columns it reads "
            "(the data has ['answer'"),
        "missing prompt column": (["run", str(TINY), "-o", f"data.path={tmp}/nocol.jsonl"],
                                  "data.prompt_column: column 'prompt' not in"),
        "wrong prompt type": (["run", str(TINY), "-o", f"data.path={tmp}/badrow.jsonl"], "row 1 column 'prompt'"),
        "prompt list of strings": (["run", str(TINY), "-o", f"data.path={tmp}/badlist.jsonl"], "row 1 column 'prompt'"),
        "chat message without a role": (["run", str(TINY), "-o", f"data.path={tmp}/chat_no_role.jsonl"],
                                        "row 2 column 'prompt' message 0: role None, expected one of ('system', 'user', "
                                        "'assistant', 'tool')"),
        "empty prompt": (["run", str(TINY), "-o", f"data.path={tmp}/emptyprompt.jsonl"],
                         f"data.path: {tmp}/emptyprompt.jsonl row 2 column 'prompt': an empty prompt"),
        "csv of a header alone": (["run", str(TINY), "-o", f"data.path={tmp}/header.csv"],
                                  f"data.path: {tmp}/header.csv: no rows (only a header line)"),
        "prompt of 600,000 characters": (["run", str(TINY), "-o", f"data.path={tmp}/hugeprompt.jsonl"],
                                         f"data.path: {tmp}/hugeprompt.jsonl row 1 column 'prompt': 600,000 characters, "
                                         f"over 512,000"),
        "unparsable JSON line": (["run", str(TINY), "-o", f"data.path={tmp}/broken.jsonl"],
                                 f"data.path: {tmp}/broken.jsonl: line 3: not JSON"),
        "JSON line not an object": (["run", str(TINY), "-o", f"data.path={tmp}/not_object.jsonl"],
                                    "line 2: expected a JSON object (one row), got list"),
        "ragged CSV": (["run", str(TINY), "-o", f"data.path={tmp}/ragged.csv"],
                       "ragged.csv: line 3: 3 fields where the header has 2 (a field that holds a comma must be quoted)"),
        "every CSV row with extra fields": (["run", str(TINY), "-o", f"data.path={tmp}/shifted.csv"],
                                            "shifted.csv: line 2: 4 fields where the header has 2"),
        "a JSON array of strings": (["run", str(TINY), "-o", f"data.path={tmp}/strings.json"],
                                    "strings.json: row 1 of its array: expected a JSON object (one row), got str"),
        "a number past a float's range": (["run", str(TINY), "-o", f"data.path={tmp}/huge.jsonl"],
                                          "huge.jsonl: line 2: the number 1e999 is past a float's range"),
        # (a lone surrogate was pandas' "Trailing data at position 28"; a fault in a JSON array named no row)
        "a lone surrogate in a data row": (["run", str(TINY), "-o", f"data.path={tmp}/surrogate.jsonl"],
                                           "surrogate.jsonl: line 2: the value of 'prompt' holds a lone surrogate"),
        "a lone surrogate in a JSON array": (["run", str(TINY), "-o", f"data.path={tmp}/surrogate.json"],
                                             "surrogate.json: row 2 of its array: the value of 'answer' holds a lone"),
        "a number past a float's range in a JSON array": (["run", str(TINY), "-o", f"data.path={tmp}/huge.json"],
                                                          "huge.json: row 2 of its array: the number 1e999 is past"),
        "NaN in a data row": (["run", str(TINY), "-o", f"data.path={tmp}/nan.jsonl"],
                              "nan.jsonl: line 2: NaN is not JSON (a missing value is null"),
        "Infinity in a data array": (["run", str(TINY), "-o", f"eval.path={tmp}/infinity.json", "-o", "eval.every=1"],
                                     "infinity.json: row 2 of its array: -Infinity is not JSON"),
        "a seed past 2^32": (["run", str(TINY), "-o", "run.seed=99999999999999999999999"], "run.seed"),
        "a LoRA rank past any model's": (["run", str(TINY), "-o", "train.lora_r=99999999999999999999"],
                                         "train.lora_r: input should be less than or equal to 65536"),
        "AdamW betas past 1": (["run", str(TINY), "-o", "train.adam_betas=[1.5, 2.0]"],
                               "train.adam_betas: expected two numbers in [0, 1), got [1.5, 2.0]"),
        "a temperature that overflows": (["run", str(TINY), "-o", "generate.temperature=1e-300"],
                                         "generate.temperature"),
        "a lease of forever": (["run", str(TINY), "-o", "run.lease_seconds=1e300"], "run.lease_seconds"),
        "config not a regular file": (["run", "/dev/null"], "config: /dev/null is not a regular file"),
        "hub dataset, hub unreachable": (["run", str(TINY), "-o", "data.path=nosuch-org/nosuch-dataset"],
                                         "data.path: cannot load 'nosuch-org/nosuch-dataset'"),
        "missing eval file": (["run", str(TINY), "-o", "eval.every=5", "-o", f"eval.path={tmp}/held-out.jsonl"],
                              "eval.path: " + f"{tmp}/held-out.jsonl: no such file"),
        "held-out prompts all training ones": (["run", str(TINY), "-o", "eval.every=1", "-o", f"eval.path={tmp}/chat.jsonl"], f"eval.path: {tmp}/chat.jsonl: every held-out prompt (1) is also a training prompt"),
        "paid format reward, no pass_reward": (["run", str(TINY), "-o", "eval.every=1", "-o", 'reward.functions=[{fn: "tasks.rewards.demo:successor_reward"}, {fn: "tasks.rewards.demo:stops_reward", weight: 0.5}]', "-o", "eval.format_reward=stops_reward"], "eval.pass_reward: unset with eval.format_reward 'stops_reward' paid (weight 0.5)"),
        # model
        "model folder missing": (["run", str(TINY), "-o", f"model.name_or_path={tmp}/nomodel"], "model.name_or_path"),
        # (no Hub here, as for the hub dataset above: one line at once, not ~50 s of retries, a line each)
        "hub model, hub unreachable": (["run", str(TINY), "-o", "model.name_or_path=nobody/nothing"],
                                       "model.name_or_path: 'nobody/nothing' is not a local folder nor in the "
                                       "Hugging Face cache"),
        "chat prompts, no chat template": (["run", str(TINY), "-o", f"data.path={tmp}/chat.jsonl",
                                           "-o", f"model.name_or_path={no_chat}"],
                                          "model.name_or_path: " + str(no_chat) + ": its tokenizer has no chat template"),
        # (2026-12-05, a sweep of data/generate/reward/env: blank names blamed on data.path, a URL's newline a traceback)
        "a blank split": (["run", str(TINY), "-o", 'data.split=""'], "config: data.split: expected a split's name "
                          "(train, test[:100], ...): not blank"),              # (was blamed on data.path)
        "a blank held-out path": (["run", str(TINY), "-o", 'eval.path=" "'], "config: eval.path: expected a data file "
                                  "or a hub dataset id: not blank"),
        "environment server URL with a newline": (["run", str(TINY), "-o", 'env.where="http://a\\nb"'],
                                                  "config: env.where: a URL with a space or a control character; "
                                                  "expected http(s)://HOST[:PORT][/PATH]"),
        "agent temperatures past 100": (["run", str(TINY), "-o", "env.endpoint.temperature=[0, 1000]"],
                                        "config: env.endpoint.temperature: expected [low, high] with 0 <= low <= "
                                        "high <= 100"),
        # (the same sweep: only row 1 was looked at; the run's line came after the store was written, naming no row)
        "chat prompts in row 2, no chat template": (["run", str(TINY), "-o", f"data.path={tmp}/chat_second.jsonl",
                                                    "-o", f"model.name_or_path={no_chat}"],
                                                   f"its tokenizer has no chat template, but the prompts are chat "
                                                   f"messages (data.path: {tmp}/chat_second.jsonl row 2 column "
                                                   f"'prompt')"),
        "an image part in row 2, a text model": (["run", str(TINY), "-o", f"data.path={tmp}/image_second.jsonl"],
                                                 f"data.path: {tmp}/image_second.jsonl row 2 column 'prompt': message "
                                                 f"0: content parts of kinds ['image']; this model's chat template "
                                                 f"takes text only"),
        "chat prompts the template refuses": (["run", str(TINY), "-o", f"data.path={tmp}/two_users.jsonl",
                                               "-o", f"model.name_or_path={strict}"],
                                              f"data.path: {tmp}/two_users.jsonl row 4 column 'prompt': the model's "
                                              f"chat template refuses it (Conversation roles must alternate "
                                              f"user/assistant/user/assistant); roles ['user', 'user']"),
        "a system prompt the template refuses": (["run", str(TINY), "-o", f"data.path={tmp}/chat_second.jsonl",
                                                  "-o", "data.system_prompt=Answer.",
                                                  "-o", f"model.name_or_path={strict}"],
                                                 f"data.path: {tmp}/chat_second.jsonl row 1 column 'prompt': the "
                                                 f"model's chat template refuses it"),
        "a named pipe as the data": (["run", str(TINY), "-o", f"data.path={tmp}/pipe.jsonl"],
                                     f"data.path: {tmp}/pipe.jsonl: not a regular file (a named pipe, a device or a "
                                     f"socket)"),
        "a split's slice that is not one": (["run", str(TINY), "-o", f"data.path={tmp}/two_users.jsonl",
                                             "-o", "data.split=train[:abc]"],
                                            f"data.split: 'train[:abc]' of {tmp}/two_users.jsonl: Unrecognized "
                                            f"instruction format"),
        "a text part that is a number": (["run", str(TINY), "-o", f"data.path={tmp}/part_number.jsonl"],
                                         f"data.path: {tmp}/part_number.jsonl row 1 column 'prompt' message 0: "
                                         f"content part 0's text 5, expected a string"),
        "a prompt that is no tokens": (["run", str(TINY), "-o", f"data.path={tmp}/no_tokens.jsonl"],
                                       f"data.path: {tmp}/no_tokens.jsonl row 2 column 'prompt': '\u65e5\u672c' is no "
                                       f"tokens of this model's vocabulary"),
        "system prompt, no chat template": (["run", str(TINY), "-o", "data.system_prompt=Answer.",
                                            "-o", f"model.name_or_path={no_chat}"], "has no chat template"),
        "gguf, not a GGUF file": (["run", str(TINY), "-o", f"model.name_or_path={tmp}/not-a-model.gguf"],
                                  f"model.name_or_path: {tmp}/not-a-model.gguf: not a GGUF file (its first bytes "
                                  "are not 'GGUF')"),
        "gguf, an architecture transformers cannot build": (
            ["run", str(TINY), "-o", f"model.name_or_path={tmp}/bert.gguf"],
            f"model.name_or_path: {tmp}/bert.gguf: GGUF architecture 'bert' is not one transformers can load"),
        # reasoning-gym prompts
        "reasoning gym, unknown task": (["run", str(TINY), "-o", "data.path=null", "-o",
                                         "data.reasoning_gym={task: chain_sums}"],
                                        "data.reasoning_gym.task: unknown reasoning-gym task 'chain_sums'; did you "
                                        "mean 'chain_sum'? (similar: decimal_chain_sum)"),
        "reasoning gym, unknown config key": (["run", str(TINY), "-o", "data.path=null", "-o",
                                               rg + ", config: {max_termz: 3}}"],
                                              "data.reasoning_gym.config.max_termz: task 'chain_sum' has no such "
                                              "setting; did you mean 'max_terms'? (it has: allow_negation, max_digits"),
        # (a million held-out items took plan 4 minutes and 5 GB before a bound a run can afford)
        "reasoning gym, held-out split too large": (["run", str(TINY), "-o", "data.path=null", "-o",
                                                     "data.reasoning_gym={task: leg_counting, size: 10, "
                                                     "eval_size: 1000000}"],
                                                    "config: data.reasoning_gym.eval_size: input should be less than "
                                                    "or equal to 100000, got 1000000"),
        "reasoning gym, training split too large": (["run", str(TINY), "-o", "data.path=null", "-o",
                                                     "data.reasoning_gym={task: leg_counting, size: 1000000}"],
                                                    "config: data.reasoning_gym.size: input should be less than or "
                                                    "equal to 100000, got 1000000"),
        "reasoning gym and a data file": (["run", str(TINY), "-o", rg + "}"], "config: data: set exactly one of "
                                          "path (a data file or hub dataset) and reasoning_gym"),
        "pass_reward, not a reward function": (["run", str(TINY), "-o", "eval.pass_reward=answer_reward"],
                                               "eval.pass_reward: 'answer_reward' is not one of the reward functions "
                                               "or models (successor_reward)"),
        # reward models and judges (reward.models)
        **_reward_model_cases(),
        # engines
        "vllm engine, no vllm": (["run", str(TINY), "-o", "generate.engine=vllm", "-o",
                                  f"generate.vllm_python={sys.executable}"], f"generate.engine: vllm: {sys.executable} has no vllm"),
        "vllm python not a file": (["run", str(TINY), "-o", "generate.engine=vllm", "-o",
                                    f"generate.vllm_python={tmp}/"], "is not an executable file"),
        "vllm python missing": (["run", str(TINY), "-o", "generate.engine=vllm", "-o", f"generate.vllm_python={tmp}/py"],
                                f"generate.vllm_python: {tmp}/py does not exist"),
        # store and launchers
        "store scheme": (["run", str(TINY), "-o", "store.uri=gs://bucket"], "store.uri"),
        "s3 model outside the store": (["run", str(TINY), "-o", "model.name_or_path=s3://elsewhere/model"],
                                       "model.name_or_path: s3://elsewhere/model: an s3:// model must lie under"),
        # rlflow tune: the space is checked before any trial starts
        "tune, storage not a URL": (["tune", str(TINY), "--trials", "1", "--space", str(tmp / "space_ok.yaml"),
                                     "--storage", "notaurl"], "--storage: 'notaurl': expected a database URL"),
        "tune, negative seed": (["tune", str(TINY), "--trials", "1", "--space", str(tmp / "space_ok.yaml"),
                                 "--seed", "-3"], "--seed: expected a whole number from 0 to 2^32-1"),
        "tune, study outside its folder": (["tune", str(TINY), "--trials", "1", "--space", str(tmp / "space_ok.yaml"),
                                            "--study", "../evil"], "--study: '../evil': expected a name of letters"),
        "tune, unknown key": (["tune", str(TINY), "--trials", "2", "--space", str(tmp / "space_unknown_key.yaml")],
                              "--space: train.learning_rate: 1e-05: unknown key 'train.learning_rate'"),
        "tune, empty range": (["tune", str(TINY), "--trials", "2", "--space", str(tmp / "space_empty_range.yaml")],
                              "--space: train.lr: empty range (low 0.01 must be below high 0.01)"),
        "tune, wrong type": (["tune", str(TINY), "--trials", "2", "--space", str(tmp / "space_wrong_type.yaml")],
                             "--space: train.lr: 'fast': train.lr"),
        "tune, unknown distribution": (["tune", str(TINY), "--trials", "2", "--space",
                                        str(tmp / "space_unknown_dist.yaml")], "--space: train.lr: expected {type: one of"),
        "tune, space not a mapping": (["tune", str(TINY), "--trials", "2", "--space",
                                       str(tmp / "space_not_a_mapping.yaml")], "expected a mapping of config keys"),
        "tune, space missing": (["tune", str(TINY), "--trials", "2", "--space", str(tmp / "nope.yaml")],
                                "--space: " + str(tmp / "nope.yaml") + ": no such file"),
        "tune, a metric no manifest has": (["tune", str(TINY), "--trials", "1", "--space",
                                            str(tmp / "space_empty_range.yaml"), "--metric", "loss"],
                                           "--metric: 'loss': expected a metric of each iteration's reward, train or "
                                           "eval manifest"),
        "tune, an eval metric without evaluations": (["tune", str(TINY), "--trials", "1", "--space",
                                                      str(tmp / "space_empty_range.yaml"), "--metric",
                                                      "eval/greedy_pass_at_1", "-o", "eval.every=0"],
                                                     "--metric: eval/greedy_pass_at_1: the config evaluates nothing"),
        "tune, storage folder missing": (["tune", str(TINY), "--trials", "1", "--space", str(tmp / "space_ok.yaml"),
                                          "--storage", "sqlite:////nonexistent/dir/study.db"],
                                         "--storage: sqlite:////nonexistent/dir/study.db: the folder /nonexistent/dir does not exist"),
        "tune, storage without its driver": (["tune", str(TINY), "--trials", "1", "--space", str(tmp / "space_ok.yaml"),
                                              "--storage", "foo://bar"], "--storage: foo://bar: cannot open it"),
        "tune, storage that does not answer": (["tune", str(TINY), "--trials", "1", "--space", str(tmp / "space_ok.yaml"),
                                                "--storage", "sqlite:///" + str(tmp / "badrecipes")], "--storage: "),
        "tune, space not UTF-8": (["tune", str(TINY), "--trials", "1", "--space", str(tmp / "space_latin1.yaml")],
                                  "space_latin1.yaml: not UTF-8 text"),
        "tune, a key twice in the space": (["tune", str(TINY), "--trials", "1", "--space", str(tmp / "space_twice.yaml")],
                                           "space_twice.yaml line 2: key 'train.lr' appears twice"),
        "tune, log as text": (["tune", str(TINY), "--trials", "1", "--space", str(tmp / "space_log_text.yaml")],
                              "--space: train.lr: log: expected true or false, got 'false'"),
        "tune, a section as the key": (["tune", str(TINY), "--trials", "1", "--space", str(tmp / "space_section.yaml")],
                                       "--space: train: a section, not a key to tune"),
        "tune, a section's choices": (["tune", str(TINY), "--trials", "1", "--space", str(tmp / "space_dict_choice.yaml")],
                                      "--space: train.learner: a section, not a key to tune"),
        "tune, a fractional range on a whole-number field": (
            ["tune", str(TINY), "--trials", "1", "--space", str(tmp / "space_float_on_int.yaml")],
            "(a whole-number field: use type: int)"),
        "tune, a tuned key also overridden": (["tune", str(TINY), "--trials", "1", "--space", str(tmp / "space_ok.yaml"),
                                               "-o", "train.lr=0.5"], "--space: train.lr: also set by -o train.lr=0.5"),
        "tune, trials in other digits": (["tune", str(TINY), "--trials", "\u0663", "--space", str(tmp / "space_ok.yaml")],
                                         "argument --trials: expected a whole number in digits 0-9"),
        "tune, empty out": (["tune", str(TINY), "--trials", "1", "--space", str(tmp / "space_ok.yaml"), "--out", ""],
                            "--out: empty"),
        "tune, data the run refuses": (["tune", str(TINY), "--trials", "1", "--space", str(tmp / "space_ok.yaml"),
                                        "-o", f"data.path={tmp}/missing.jsonl"], "data.path: "),
        "tune, a study resumed with another space": (
            ["tune", str(TINY), "--trials", "2", "--space", str(tmp / "space_twice.yaml").replace("twice", "linear"),
             "--study", "old", "--out", str(tmp / "oldstudy")],
            "--space: train.lr: the study 'old' (sqlite:///"),
        "tune, a date as a choice": (["tune", str(TINY), "--trials", "1", "--space", str(tmp / "space_date_choice.yaml")],
                                     "--space: train.lr: '2024-01-01': train.lr: input should be a valid number"),
        "tune, storage a file that is no database": (
            ["tune", str(TINY), "--trials", "1", "--space", str(tmp / "space_ok.yaml"), "--storage",
             f"sqlite:///{tmp}/space_ok.yaml"], "--storage: sqlite:///"),
        "tune, a value the run's preflight refuses": (
            ["tune", str(TINY), "--trials", "1", "--space", str(tmp / "space_missing_data.yaml")],
            f"--space: data.path: '{tmp}/missing.jsonl': data.path: {tmp}/missing.jsonl: no such file"),
        "tune, a corner of the space the config refuses": (
            ["tune", str(TINY), "--trials", "1", "--space", str(tmp / "space_corner.yaml")],
            "--space: the corner data.curriculum.defer=1, run.max_staleness=3 is refused: data.curriculum.defer: 1 "
            "iteration is not longer than run.max_staleness (3)"),
        "tune, a key the config ignores": (
            ["tune", str(TINY), "--trials", "1", "--space", str(tmp / "space_ignored.yaml")],
            "--space: train.learner.gamma: the config ignores it (train.learner.gamma is a setting of ppo, vtrace_awr; "
            "train.algorithm is grpo: ignored): a dimension that changes nothing"),
        "tune, no trials": (["tune", str(TINY), "--trials", "0", "--space", str(tmp / "space_empty_range.yaml")],
                            "--trials: expected a whole number of at least 1, got 0"),
        "plan, bad launcher mode": (["plan", str(TINY), "-o", "launcher.where=cloud"], "launcher.where"),
        "plan, missing recipes": (["plan", str(TINY), "-o", "launcher.where=local", "-o", f"launcher.recipes={tmp}/none"],
                                  "launcher.recipes: no recipe"),
        "sky launcher, local store": (["run", str(TINY), "-o", "launcher.where=sky"],
                                      "store.uri: file://./rlflow-store: the sky launcher needs a store"),
        # launcher.sky_python that cannot run (was: PermissionError / FileNotFoundError tracebacks, exit 1)
        "sky_python a folder": (["run", str(TINY), "-o", "launcher.where=sky", "-o", f"launcher.sky_python={tmp}"],
                                f"launcher.sky_python: {tmp} is a folder; expected a Python executable"),
        "sky_python not executable": (["run", str(TINY), "-o", "launcher.where=sky", "-o",
                                       f"launcher.sky_python={tmp}/prompts.txt"],
                                      f"launcher.sky_python: {tmp}/prompts.txt is not executable; expected"),
        "sky_python not on PATH": (["plan", str(TINY), "-o", "launcher.where=sky", "-o",
                                    "launcher.sky_python=no-such-python-rlflow"],
                                   "launcher.sky_python: no-such-python-rlflow: no such command on PATH; expected"),
        "sky_python that cannot be run": (["run", str(TINY), "-o", "launcher.where=sky", "-o",
                                           f"launcher.sky_python={tmp}/no_interpreter"],
                                          f"launcher.sky_python: {tmp}/no_interpreter cannot be run (Exec format"),
        "sky_python empty": (["run", str(TINY), "-o", "launcher.where=sky", "-o", 'launcher.sky_python=""'],
                             "launcher.sky_python: empty; expected the path or command of a Python with SkyPilot"),
        # environments that cannot be built: refused before the run, not every episode failing
        "environment keyword the factory does not take": (
            ["run", str(TINY), "-o", "env.factory=tasks.envs.builtin.games:SayTheLetters", "-o", "env.kwargs={size: 3}"],
            "env.kwargs: tasks.envs.builtin.games:SayTheLetters cannot be called with env.kwargs ['size']: got an unexpected "
            "keyword argument 'size'"),
        "environment keyword the factory lacks": (
            ["run", str(TINY), "-o", "env.factory=badtools_env:NeedsSize"],
            "env.kwargs: badtools_env:NeedsSize cannot be called without env.kwargs: missing a required argument: "
            "'size'"),
        "environment module crashes (SIGSEGV) on import": (
            ["run", str(TINY), "-o", "env.factory=crashes_on_import:f"],
            "env.factory: crashes_on_import:f: the environment's code ended the process preflight checks it in "
            "(killed by SIGSEGV) as it imported module 'crashes_on_import'"),
        "environment crashes (SIGSEGV) as it is made": (
            ["run", str(TINY), "-o", "env.factory=badtools_env:CrashesWhenMade"],
            "env.factory: badtools_env:CrashesWhenMade: the environment's code ended the process preflight checks it "
            "in (killed by SIGSEGV) as it made one with env.kwargs, then reset and stepped it with the data's first "
            "row"),
        "environment factory that raises": (
            ["run", str(TINY), "-o", "env.factory=badtools_env:NeedsSize", "-o", "env.kwargs={size: -1}"],
            "env.factory: badtools_env:NeedsSize(**env.kwargs) raised ValueError: size must be positive"),
        "environment factory that returns None": (
            ["run", str(TINY), "-o", "env.factory=badtools_env:makes_none"],
            "env.factory: badtools_env:makes_none(**env.kwargs) returned None; expected the episode's environment"),
        "adapter forced onto a class that does not fit": (
            ["run", str(TINY), "-o", "env.factory=tasks.envs.builtin.games:SayTheLetters", "-o", "env.adapter=gymnasium"],
            "env.adapter: gymnasium: tasks.envs.builtin.games:SayTheLetters made a SayTheLetters, whose reset cannot be "
            "called as reset(seed=...)"),
        "verifiers adapter on a plain class": (
            ["run", str(TINY), "-o", "env.factory=tasks.envs.builtin.games:SayTheLetters", "-o", "env.adapter=verifiers"],
            "env.adapter: verifiers: tasks.envs.builtin.games:SayTheLetters made a SayTheLetters, which the verifiers "
            "adapter cannot drive"),
        "environment with reset(row) and no step": (
            ["run", str(TINY), "-o", "env.factory=badtools_env:NoStep"],
            "env.factory: badtools_env:NoStep made a NoStep, whose reset(row) is rlflow's protocol's but it has no "
            "step(message) method"),
        "environment tools that are not functions": (
            ["run", str(TINY), "-o", "env.factory=badtools_env:StringTools"],
            "env.factory: badtools_env:StringTools: StringTools.tools[0] is 'lookup', not a function"),
        "environment reset with a role no template renders": (
            ["run", str(TINY), "-o", "env.factory=badtools_env:Narrates"],
            "env.factory: badtools_env:Narrates: Narrates.reset's message 0: role 'narrator', expected one of "
            "('system', 'user', 'assistant', 'tool')"),
        "environment reset returning no messages": (
            ["run", str(TINY), "-o", "env.factory=badtools_env:ResetsToNumber"],
            "env.factory: badtools_env:ResetsToNumber: ResetsToNumber.reset's return is int, not chat messages"),
        # checks that accepted the wrong thing
        "environment server url, a server that is not one (404)": (
            ["run", str(TINY), "-o", "env.factory=tasks.envs.builtin.games:SayTheLetters", "-o",
             f"env.where={not_env_server}/missing"],
            f"env.where: {not_env_server}/missing is not an rlflow environment server (GET /health answered "
            "HTTP 404"),
        "environment server url, a server that is not one (200)": (
            ["run", str(TINY), "-o", "env.factory=tasks.envs.builtin.games:SayTheLetters", "-o",
             f"env.where={not_env_server}/ok"],
            f"env.where: {not_env_server}/ok is not an rlflow environment server (GET /health answered 'ok'"),
        "off-line rollouts, a generate output": (
            ["run", str(TINY), *ofl, f"train.learner.offline_rollouts=[{offline['rollouts']}]"],
            f"train.learner.offline_rollouts: {offline['rollouts']}: unscored rollouts (a generate output)"),
        "off-line rollouts, a row without a reward": (
            ["run", str(TINY), *ofl, f"train.learner.offline_rollouts=[{offline['null']}]"],
            f"train.learner.offline_rollouts: {offline['null']}: row 2 of 2 with reward null"),
        # names and files checked before any work
        "registered model name MLflow refuses": (["run", str(TINY), "-o", "publish.registered_model_name=team/model"],
                                                 "publish.registered_model_name: 'team/model': MLflow refuses it as a "
                                                 "registered model name"),
        "registered model name with a %": (["run", str(TINY), "-o", "publish.registered_model_name=a%b"],
                                           "publish.registered_model_name: 'a%b': MLflow refuses it"),
        "run, recipe that is not YAML": (["run", str(TINY), "-o", "launcher.where=local", "-o",
                                          f"launcher.recipes={tmp}/badrecipes"],
                                         f"launcher.recipes: {tmp}/badrecipes/generate.yaml: line 2: not valid YAML"),
        "plan, recipe that is not YAML": (["plan", str(TINY), "-o", "launcher.where=local", "-o",
                                           f"launcher.recipes={tmp}/badrecipes"],
                                          f"launcher.recipes: {tmp}/badrecipes/generate.yaml: line 2: not valid YAML"),
        "tune, space is a folder": (["tune", str(TINY), "--trials", "2", "--space", str(tmp / "badrecipes")],
                                    f"--space: {tmp}/badrecipes is a folder, not a file"),
        "tune, out is a file": (["tune", str(TINY), "--trials", "2", "--space", str(tmp / "space_empty_range.yaml"),
                                 "--out", str(tmp / "a_file")], f"--out: {tmp}/a_file is a file, not a folder"),
        "tune, out under a file": (["tune", str(TINY), "--trials", "2", "--space", str(tmp / "space_empty_range.yaml"),
                                    "--out", str(tmp / "a_file" / "study")],
                                   f"--out: {tmp}/a_file/study: {tmp}/a_file is a file, not a folder"),
        "export, dir is a file": (["export", str(TINY), "1", str(tmp / "a_file")],
                                  f"DEST: {tmp}/a_file is a file, not a folder"),
        "export, dir under a file": (["export", str(TINY), "1", str(tmp / "a_file" / "out")],
                                     f"DEST: {tmp}/a_file/out: {tmp}/a_file is a file, not a folder"),
        "export of a registered version, no database": (
            ["export", str(TINY), "models:/tiny/3", str(tmp / "out")],
            "VERSION: models:/tiny/3: no MLflow database at "),
        "summary json is a folder": (["run", str(TINY), "--summary-json", str(tmp / "badrecipes")],
                                     f"--summary-json: {tmp}/badrecipes is a folder, not a file"),
        # silent drops and misleading words
        "reward keyword the function cannot take": (
            ["run", str(TINY), "-o", 'reward.functions=[{"fn": "strict_sig:f", "kwargs": {"scale": 2}}]'],
            "reward.functions[0].kwargs.scale: strict_sig:f takes no argument 'scale' (it takes completions, answer, "
            "and no **kwargs)"),
        "reward keyword that replaces the completions": (
            ["run", str(TINY), "-o", f'reward.functions=[{{"fn": "{demo}", "kwargs": {{"completions": ["bbb"]}}}}]'],
            "reward.functions[0].kwargs.completions: 'completions' is a keyword TRL's convention passes, given to "
            "every call; a configured value would replace it for every completion"),
        "reward keyword that replaces a column": (
            ["run", str(TINY), "-o", f'reward.functions=[{{"fn": "{demo}", "kwargs": {{"answer": "x"}}}}]'],
            "reward.functions[0].kwargs.answer: 'answer' is a dataset column, given to every call"),
        "reward needs a column only the eval file lacks": (
            ["run", str(TINY), "-o", f"data.path={tmp}/withsol.jsonl", "-o", f"eval.path={tmp}/nosol.jsonl", "-o",
             'reward.functions=[{"fn": "needs_col:f"}]'],
            f"needs argument 'solution', which is neither a dataset column (the evaluation split (eval.path "
            f"{tmp}/nosol.jsonl, split 'test') has ['answer'])"),
        "eval file has a column named as a reward keyword": (
            ["run", str(TINY), "-o", f"eval.path={tmp}/evalclash.jsonl"],
            f"the evaluation split (eval.path {tmp}/evalclash.jsonl, split 'test'): column 'trainer_state' is named "
            f"as a keyword reward functions are called with"),
        # edge values
        "empty file store uri": (["run", str(TINY), "-o", "store.uri=file://"], "store.uri: expected a folder"),
        "empty store uri": (["run", str(TINY), "-o", 'store.uri=""'], "store.uri: expected a folder"),
        "missing flag": (["tune", str(TINY), "--space", str(tmp / "space_empty_range.yaml")],
                         "rlflow tune: the following arguments are required: --trials"),
        "malformed flag": (["tune", str(TINY), "--trials", "two", "--space", str(tmp / "space_empty_range.yaml")],
                           "rlflow tune: argument --trials: expected a whole number in digits 0-9, got 'two'"),
        "unknown command": (["train", str(TINY)], "rlflow: argument command: invalid choice: 'train'"),
        "no command": ([], "rlflow: the following arguments are required: command"),
    }


BADTOOLS_ENV = """
from tasks.core.contracts import Step


class CrashesWhenMade:                        # (a broken C extension: it took `rlflow run` with it, exit 139, no line)
    def __init__(self):
        import ctypes
        ctypes.string_at(0)


class NeedsSize:
    tools: list = []

    def __init__(self, size):
        if size < 1:
            raise ValueError("size must be positive")

    def reset(self, row):
        return [{"role": "user", "content": "a="}]

    def step(self, message):
        return Step([], 1.0, True)


class StringTools(NeedsSize):
    tools = ["lookup"]

    def __init__(self):
        pass


class AlwaysFails(NeedsSize):
    def __init__(self):
        pass

    def reset(self, row):
        raise RuntimeError("no board for this row")


class Narrates(AlwaysFails):
    def reset(self, row):
        return [{"role": "narrator", "content": "a="}]


class ResetsToNumber(AlwaysFails):
    def reset(self, row):
        return 7


class NoStep:
    def reset(self, row):
        return [{"role": "user", "content": "a="}]


def makes_none():
    return None
"""


def _http_server() -> str:
    """An HTTP server that is not an rlflow environment server: /ok/health answers 200 'ok', anything else 404."""
    import http.server
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            ok = self.path.startswith("/ok/")
            self.send_response(200 if ok else 404)
            self.end_headers()
            self.wfile.write(b"ok" if ok else b"not found")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}"


def _offline_store(root: Path) -> dict[str, str]:
    """A store with a generate output (unscored) and a rewards folder with a row whose reward is null."""
    import tempfile

    from tasks.core import rollout
    from tasks.core.contracts import Rollout
    from tasks.core.store import Store

    store = Store.open(str(root))

    def row(i: int, reward):
        return Rollout(group=0, row=i, prompt="a=", prompt_ids=[1], completion="bbb", completion_ids=[2, 2, 2],
                       logprobs=[0.0] * 3, truncated=False, reward=reward)

    keys = {"rollouts": "src/iter-000001/rollouts", "null": "src/iter-000001/rewards"}
    for what, key in keys.items():
        with tempfile.TemporaryDirectory() as tmp:
            rollout.write([row(0, None), row(1, None)] if what == "rollouts" else [row(0, 1.0), row(1, None)],
                          Path(tmp))
            store.put_folder(key, Path(tmp), meta={"fingerprint": "x", "policy": "base"} if what == "rollouts" else
                             {"fingerprint": "x", "metrics": {}, "samples": [], "errors": {}})
    return keys


def _study_of_another_space(folder: Path) -> None:
    """A tune's folder whose study (`old`) drew train.lr on a log scale in its one trial."""
    import optuna
    from optuna.distributions import FloatDistribution

    folder.mkdir()
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(study_name="old", storage=f"sqlite:///{folder / 'study.db'}")
    study.add_trial(optuna.trial.create_trial(params={"train.lr": 1e-3}, value=0.5,
                                              distributions={"train.lr": FloatDistribution(1e-5, 1e-2, log=True)}))


def _reward_model_cases() -> dict[str, tuple[list[str], str]]:
    from tasks.core.models import pin_of

    tiny = builtin_models.resolve("builtin:tiny-lm")
    pin = pin_of(tiny)
    judge = f"name: j, kind: judge, model: 'builtin:tiny-lm', sha256: {pin}"

    def run(entry: str) -> list[str]:
        return ["run", str(TINY), "-o", f"reward.models=[{{{entry}}}]"]

    return {
        "judge template without its completion": (run(judge + ", template: 'rate {prompt}'"),
                                                  "reward.models[0] (j).template: has no field {completion}"),
        "judge template, unknown field": (run(judge + ", template: '{prompt} {completion} {solution}'"),
                                          "reward.models[0] (j).template: field {solution} is neither a dataset "
                                          "column (the data has ['answer'])"),
        "judge template, not a format string": (run(judge + ", template: '{completion'"),
                                                "reward.models[0] (j).template: not a format string"),
        "judge template, a format spec on text": (run(judge + ", template: 'Q {prompt} A {completion:d}'"),
                                                  "reward.models.0.template: field {completion:d}: expected a plain "
                                                  "{completion} (filled with text: no attribute, index or format "
                                                  "spec)"),
        "judge template, an attribute": (run(judge + ", template: 'Q {prompt} A {completion.upper}'"),
                                         "reward.models.0.template: field {completion.upper}: expected a plain "
                                         "{completion}"),
        "pairwise template without completion_b": (run(judge + ", mode: pairwise, template: '{completion_a}'"),
                                                   "reward.models[0] (j).template: has no field {completion_b}"),
        # (vLLM's traceback as the judge server started, the store written)
        "vllm judge past the model's context": (run(judge + ", template: '{completion}', engine: vllm, where: local"),
                                                "reward.models[0] (j).max_length: 2048 + max_tokens 64 = 2112 tokens "
                                                "is above the model's context (256"),
        "classifier that is a causal LM": (run(f"name: j, kind: classifier, model: '{tiny}', sha256: {pin}"),
                                           "reward.models[0] (j).kind: " + tiny + " is not a sequence classifier"),
        "judge model pinned to other weights": (run(judge.replace(pin, f"'{'0' * 64}'") + ", template: '{completion}'"),
                                                f"reward.models[0] (j).sha256: builtin:tiny-lm has weights sha256 "
                                                f"{pin}, not the pinned"),
        # (said "must be pinned: run pin /nowhere/judge": a pin of a folder that is not there)
        "judge model folder missing": (run("name: j, kind: judge, model: /nowhere/judge, template: '{completion}'"),
                                       "reward.models.0: model: /nowhere/judge: no such file or folder"),
        "judge model not pinned": (run("name: j, kind: judge, model: 'builtin:tiny-lm', template: '{completion}'"),
                                   "sha256: builtin:tiny-lm must be pinned"),
        "judge from the registry, no database": (
            run("name: j, kind: judge, model: 'models:/judge/2', template: '{completion}'"),
            "reward.models[0] (j).model: models:/judge/2: no MLflow database at "),
        "judge from the registry, latest": (run("name: j, kind: judge, model: 'models:/judge/latest', "
                                                "template: '{completion}'"),
                                            "reward.models[0] (j).model: models:/judge/latest: expected "
                                            "models:/<name>/<version number>"),
        "judge named like a function": (run(judge.replace("name: j", "name: successor_reward") +
                                            ", template: '{completion}'"),
                                        "reward.models[0] (successor_reward).name: 'successor_reward' is taken"),
        "judge at an unreachable url": (run("name: j, kind: judge, model: m1, where: 'http://127.0.0.1:9', "
                                            "template: '{completion}'"),
                                        "reward.models[0] (j).where: http://127.0.0.1:9 does not answer"),
        "judge key variable not set": (run("name: j, kind: judge, model: m1, where: 'http://127.0.0.1:9', "
                                           "api_key_env: RLFLOW_TEST_NO_SUCH_KEY, template: '{completion}'"),
                                       "reward.models[0] (j).api_key_env: the variable RLFLOW_TEST_NO_SUCH_KEY is "
                                       "not set"),
        "judge max_length shorter than its template": (run(judge + ", template: 'Judge this answer with care and "
                                                           "say yes or no: {completion}', max_length: 16"),
                                                       "reward.models[0] (j).max_length: 16: the template's own text "
                                                       "is "),
        # (it named generate.engine, which was hf)
        "vllm judge, no vllm": (run(judge + ", template: '{completion}', engine: vllm, where: local, max_length: 128, "
                                            "max_tokens: 4") +
                                ["-o", f"generate.vllm_python={sys.executable}"],
                                f"reward.models[0] (j).engine: vllm: {sys.executable} has no vllm"),
        "two judges of one name": (["run", str(TINY), "-o", f"reward.models=[{{{judge}, template: '{{completion}}'}}, "
                                                         f"{{{judge}, template: '{{completion}}'}}]"],
                                   "reward.models[1] (j).name: 'j' is taken"),
        "verdict tokens of several tokens": (run(judge.replace("kind: judge", "kind: verdict") +
                                                 ", template: '{completion}', verdict_tokens: ['yes', 'no']"),
                                             "reward.models[0] (j).verdict_tokens: 'yes' is "),
    }


# The users' modules _cases writes, copied into each case's working directory (where user modules are found).
USER_MODULES = ("syntax_err.py", "needs_col.py", "exits_on_import.py", "strict_sig.py", "badtools_env.py",
                "varargs.py", "os_exits_on_import.py", "dies_in_worker.py", "not_a_function.py", "crashes_on_import.py")


def test_each_mistake_is_one_line_exit_2_and_nothing_written(prefect_api, tmp_path):
    cases = _cases(tmp_path)
    # Each case in its own working directory, so a store written by one case is seen as that case's failure;
    # each a fork of one process that imported the CLI (run_cli_many), two at a time.
    for name in cases:
        (tmp_path / "cwd" / name).mkdir(parents=True)
        for module in USER_MODULES:
            (tmp_path / "cwd" / name / module).write_text((tmp_path / module).read_text())
    outs = dict(zip(cases, run_cli_many([(args, tmp_path / "cwd" / name) for name, (args, _) in cases.items()],
                                        prefect_api)))
    failures = []
    for name, (_, expected) in cases.items():
        out = outs[name]
        lines = [line for line in out.stderr.splitlines() if line.strip()]
        ok = out.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0]
        if not ok:
            failures.append(f"{name}: rc={out.returncode} stderr={out.stderr[-600:]!r}")
        if (tmp_path / "cwd" / name / "rlflow-store").exists():
            failures.append(f"{name}: wrote to the store")
        if (tmp_path / "cwd" / name / "mlflow.db").exists():
            failures.append(f"{name}: made the tracking database")
    assert len(cases) >= 25 and not failures, "\n".join(failures)


# Cases whose line `rlflow plan` must print word for word as `rlflow run` does: both run (the others: plan only,
# against the case's expected text).
SAME_LINE = ("sky launcher, local store", "missing data file", "reward module missing",
             "environment factory that raises", "sky recipes not in the working directory")


def test_plan_refuses_what_run_refuses(prefect_api, tmp_path, s3_endpoint, bucket):
    """`rlflow plan` runs `rlflow run`'s preflight: every `rlflow run` case above (but --summary-json, a flag
    of run's alone) is refused by plan too, one line, exit 2, nothing written; for SAME_LINE, the same line.
    Each case's working directory is not the repository: plan finds the checkout's recipes from there (the
    local launcher), and plan and run refuse the sky launcher there (its recipes' `workdir: .`). make test takes
    every other case (plan's preflight is run's: each case is refused by run in the test above); make drills all."""
    from tests.conftest import ROOT

    s3 = ["-o", f"store.uri=s3://{bucket}/runs", "-o", f"store.endpoint_url={s3_endpoint}"]
    cases = {name: (["plan", *args[1:]], expected) for name, (args, expected) in _cases(tmp_path).items()
             if args[:1] == ["run"] and "--summary-json" not in args}
    if "RLFLOW_DRILL_TRIALS" not in os.environ:     # (make test: every other case and SAME_LINE's; the CI budget)
        cases = {name: case for i, (name, case) in enumerate(cases.items()) if i % 2 == 0 or name in SAME_LINE}
    cases["sky recipes not in the working directory"] = (["plan", str(TINY), *s3, "-o", "launcher.where=sky"],
                                                         "launcher.recipes: sky is not a folder of the working "
                                                         "directory (")
    calls = [(args, name) for name, (args, _) in cases.items()] + [(["run", *cases[name][0][1:]], f"run {name}")
                                                                  for name in SAME_LINE]
    calls.append((["plan", str(TINY), *s3, "-o", "launcher.where=local"], "local launcher"))
    for _, folder in calls:
        (tmp_path / "cwd" / folder).mkdir(parents=True)
        for module in USER_MODULES:
            (tmp_path / "cwd" / folder / module).write_text((tmp_path / module).read_text())
    outs = dict(zip([folder for _, folder in calls],
                    run_cli_many([(args, tmp_path / "cwd" / folder) for args, folder in calls], prefect_api)))
    failures = []
    for name, (_, expected) in cases.items():
        out = outs[name]
        lines = [line for line in out.stderr.splitlines() if line.strip()]
        if not (out.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0]):
            failures.append(f"{name}: rc={out.returncode} stderr={out.stderr[-600:]!r}")
        ran = outs[f"run {name}"].stderr.replace(f"cwd/run {name}", f"cwd/{name}") if name in SAME_LINE else None
        if ran is not None and out.stderr != ran:            # (each in a working directory of its own)
            failures.append(f"{name}: plan said {out.stderr!r}, run {ran!r}")
        if (tmp_path / "cwd" / name / "rlflow-store").exists():
            failures.append(f"{name}: wrote to the store")
    assert len(cases) >= (80 if "RLFLOW_DRILL_TRIALS" in os.environ else 40) and not failures, "\n".join(failures)
    local = outs["local launcher"]
    assert local.returncode == 0 and f"local subprocess ({ROOT / 'sky' / 'train.yaml'})" in local.stdout, local
    assert boto3.client("s3", endpoint_url=s3_endpoint).list_objects_v2(Bucket=bucket).get("KeyCount", 0) == 0


@pytest.fixture(scope="module")
def s3_with_auth(tmp_path_factory):
    """A second moto server that checks credentials (INITIAL_NO_AUTH_ACTION_COUNT=0): ours are unknown to it.
    Ready when its own API answers (which asks for none), as long as that takes: a loaded machine's imports."""
    import sys

    from tests.conftest import _serve, _stop, free_ports

    port = free_ports(1)
    proc = _serve([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                  {"INITIAL_NO_AUTH_ACTION_COUNT": "0"}, f"http://127.0.0.1:{port}/moto-api/data.json",
                  tmp_path_factory.mktemp("moto-auth") / "moto.log")
    yield f"http://127.0.0.1:{port}"
    _stop(proc)


def test_unauthorised_store(prefect_api, s3_with_auth, tmp_path):
    out = run_cli(["run", str(TINY), "-o", "store.uri=s3://private/x", "-o", f"store.endpoint_url={s3_with_auth}"],
                  tmp_path, prefect_api)
    assert out.returncode == 2
    assert out.stderr.strip() == f"error: store.uri: s3://private/x at {s3_with_auth}: access denied (check AWS credentials)"


def test_missing_bucket_and_unreachable_endpoint(prefect_api, s3_endpoint, tmp_path):
    out = run_cli(["run", str(TINY), "-o", "store.uri=s3://no-such-bucket/x", "-o", f"store.endpoint_url={s3_endpoint}"],
                  tmp_path, prefect_api)
    assert out.returncode == 2 and out.stderr.strip() == f"error: store.uri: s3://no-such-bucket/x at {s3_endpoint}: bucket does not exist"
    out = run_cli(["run", str(TINY), "-o", "store.uri=s3://b", "-o", "store.endpoint_url=http://127.0.0.1:9"], tmp_path, prefect_api)
    assert out.returncode == 2 and out.stderr.strip().startswith("error: store.uri: cannot reach s3://b")


def test_bad_reward_leaves_bucket_empty(prefect_api, s3_endpoint, bucket, tmp_path):
    out = run_cli(["run", str(TINY), *s3_overrides(s3_endpoint, bucket), "-o", 'reward.functions=[{"fn": "x.y:z"}]'],
                  tmp_path, prefect_api)
    assert out.returncode == 2, out.stderr
    assert boto3.client("s3", endpoint_url=s3_endpoint).list_objects_v2(Bucket=bucket).get("KeyCount", 0) == 0


def test_a_reward_function_that_raises_is_named_with_strict(prefect_api, tmp_path):
    (tmp_path / "broken.py").write_text("def boom(completions, **kw):\n    raise ValueError('bad answer format')\n")
    out = run_cli(["run", str(TINY), "-o", "run.iterations=1", "-o", 'reward.functions=[{"fn": "broken:boom"}]',
                   "-o", "reward.strict=true"], tmp_path, prefect_api)
    assert out.returncode == 2                  # the user's code: one line, never retried
    assert out.stderr.strip().splitlines()[-1] == "error: reward function 'boom' raised ValueError: bad answer format (broken.py:2)"


def test_overrides_parse_as_yaml_values():
    cfg = load_config(TINY, ["run.iterations=7", "train.adam_betas=[0.9, 0.95]", "store.uri=s3://b/p",
                             'reward.functions=[{"fn": "m:f", "weight": 2}]', "run.name=x-1"])
    assert cfg.run.iterations == 7 and cfg.train.adam_betas == (0.9, 0.95) and cfg.reward.functions[0].weight == 2.0
    assert Path(cfg.data.path).is_absolute()                 # relative to the config file
    with pytest.raises(UserError, match="run.name"):
        load_config(TINY, ["run.name=../escape"])
    for number in ("run.iterations", "train.lr", "run.seed", "generate.streaming.buffer"):    # true is not 1
        with pytest.raises(UserError, match=rf"^config: {number}: expected a number, not true or false, got true$"):
            load_config(TINY, [f"{number}=true", "run.max_staleness=1"])
    assert load_config(TINY, ["eval.greedy=true", "train.lr=1"]).train.lr == 1.0


def test_every_episode_failing_stops_the_run(prefect_api, tmp_path):
    """An environment whose every episode fails: one line saying so, exit 2, not an iteration trained on nothing."""
    (tmp_path / "badtools_env.py").write_text(BADTOOLS_ENV)
    out = run_cli(["run", str(TINY), "-o", "run.iterations=2", "-o", "env.factory=badtools_env:AlwaysFails"],
                  tmp_path, prefect_api)
    assert out.returncode == 2, out.stderr[-2000:]
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("error: env.factory: every episode of iteration 1 failed (128 of 128), nothing to train "
                           "on; the first: reset raised RuntimeError: no board for this row"), last


def test_every_reward_call_failing_stops_the_run(prefect_api, tmp_path):
    """Not strict, but no completion scored at all: one line, exit 2, rather than a run of reward 0.000."""
    (tmp_path / "broken.py").write_text("def boom(completions, **kw):\n    raise ValueError('bad answer format')\n")
    out = run_cli(["run", str(TINY), "-o", "run.iterations=2", "-o", 'reward.functions=[{"fn": "broken:boom"}]'],
                  tmp_path, prefect_api)
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines()[-1] == (
        "error: reward: every reward call of iteration 1 failed, no completion was scored (nothing to train on); "
        "the first: reward function 'boom' raised ValueError: bad answer format (broken.py:2)")


def test_a_thread_a_reward_module_starts_when_imported_does_not_hold_a_failed_run(prefect_api, tmp_path):
    """A module that starts a non-daemon thread when imported (preflight imports it in the flow's process): a run
    that failed said its line, then Python's exit waited for that thread for good."""
    (tmp_path / "threads.py").write_text("import threading, time\nthreading.Thread(target=time.sleep, args=(3600,), "
                                         "name='users').start()\ndef f(completions, **kw):\n    return []\n")
    out = run_cli(["run", str(TINY), "-o", "run.iterations=2", "-o", 'reward.functions=[{"fn": "threads:f"}]'],
                  tmp_path, prefect_api)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and lines[-2].startswith("error: reward: every reward call of iteration 1 failed")
    assert lines[-1].startswith("warning: users still running as the run ended: ended with it")


@pytest.mark.parametrize("body, line", [
    ("return [float('nan')] * len(completions)",
     "error: reward: no completion of iteration 1 was scored (nothing to train on): 'f' returned NaN, inf or beyond "
     "±3.4e+38 for 128; expected a finite score for some completion"),
    ("return 1.0",
     "error: reward: every reward call of iteration 1 failed, no completion was scored (nothing to train on); the "
     "first: reward function 'f' returned float, expected a list of 128 scores (one per completion)"),
], ids=["all NaN", "a scalar"])
def test_a_reward_that_scores_nothing_stops_the_run_saying_what_it_returned(prefect_api, tmp_path, body, line):
    """Not strict, yet nothing scored: NaN or inf for every completion (missing, as None is) stops the run as a
    raise does; a function that returns a number where a list is due is said to have returned it, not to have
    raised."""
    (tmp_path / "odd.py").write_text(f"def f(completions, **kw):\n    {body}\n")
    out = run_cli(["run", str(TINY), "-o", "run.iterations=1", "-o", 'reward.functions=[{"fn": "odd:f"}]'],
                  tmp_path, prefect_api)
    assert out.returncode == 2 and out.stderr.strip().splitlines()[-1] == line, out.stderr[-2000:]


def test_an_export_from_a_damaged_store_is_one_line_exit_1_and_nothing_written(prefect_api, tmp_path):
    """A store whose LATEST pointer was altered: no stage makes it again, so no retry, and no traceback either."""
    store = tmp_path / "store"
    (store / "tiny-demo" / "policy").mkdir(parents=True)
    (store / "tiny-demo" / "policy" / "LATEST").write_text("not a pointer")
    out = run_cli(["export", str(TINY), "latest", str(tmp_path / "out"), "-o", f"store.uri=file://{store}",
                   "-o", "run.name=tiny-demo"], tmp_path, prefect_api)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 1 and len(lines) == 1, out.stderr[-2000:]
    assert lines[0].startswith(f"error: file://{store}/tiny-demo/policy/LATEST: ") and "damaged" in lines[0]
    assert not (tmp_path / "out").exists()


def test_a_recording_policy_that_raises_or_exits_is_one_line(prefect_api, tmp_path):
    """A scripted policy that raises, exits, returns what is not text, is async, or never answers (a silent hang
    before: now env.timeout_seconds bounds each turn): one line naming it, exit 2, nothing written (not the folder
    --out was to be written in either, which the recording made)."""
    (tmp_path / "pol.py").write_text("import sys, time\ndef raises(ctx):\n    raise RuntimeError('boom')\n"
                                     "def exits(ctx):\n    sys.exit(0)\n"
                                     "def surrogate(ctx):\n    return 'ab\\udcff'\n"
                                     "def sleeps(ctx):\n    while True:\n        try:\n            time.sleep(1)\n"
                                     "        except Exception:\n            pass\n"
                                     "async def awaits(ctx):\n    return 'b'\n"
                                     "def none(ctx):\n    return None\n")
    letters = TINY.parent / "letters.yaml"
    cases = (("raises", "error: --policy: pol:raises(context) raised RuntimeError: boom"),
             ("surrogate", "error: --policy: pol:surrogate(context) returned text that is not Unicode "
                           "('\\udcff' at 2: a lone surrogate)"),
             ("exits", "error: --policy: pol:exits(context) called sys.exit(0); expected it to return the turn's text"),
             ("sleeps", "error: --policy: pol:sleeps(context) gave no answer in 2 s (env.timeout_seconds); expected "
                        "it to return the turn's text"),
             ("awaits", "error: --policy: pol:awaits is a coroutine function (async def); expected a plain function "
                        "returning the turn's text"),
             ("none", "error: --policy: pol:none(context) returned NoneType, expected the turn's text (str)"))
    for policy, _ in cases:
        (tmp_path / policy).mkdir()
        (tmp_path / policy / "pol.py").write_text((tmp_path / "pol.py").read_text())
    outs = run_cli_many([(["record", str(letters), "--policy", f"pol:{policy}", "--rows", "0-1", "--out",
                           str(tmp_path / policy / "made" / "here" / "o.jsonl"), "-o", "env.isolation=thread",
                           "-o", "env.timeout_seconds=2"], tmp_path / policy) for policy, _ in cases], prefect_api)
    for (policy, line), out in zip(cases, outs):
        assert out.returncode == 2 and out.stderr.strip().splitlines() == [line], (policy, out.stderr[-2000:])
        assert not (tmp_path / policy / "made").exists(), policy


@pytest.mark.parametrize("stage,args,expected", [
    ("generate", ["--iteration", "0"], "error: python -m tasks.generate: argument --iteration: iterations start at 1, "
                                       "got 0"),
    ("train", ["--iteration", "0"], "error: python -m tasks.train: argument --iteration: iterations start at 1, got 0"),
    ("reward", [], "error: python -m tasks.reward: the following arguments are required: --iteration"),
    # a traceback from boto3 before (only `run` and `plan` caught it, in preflight)
    ("publish", ["--iteration", "1", "-o", "store.uri=s3://bucket/x", "-o", "store.region=not a region!"],
     "error: store.uri: s3://bucket/x: the S3 client cannot be made (InvalidRegionError: Provided region_name 'not a "
     "region!' doesn't match a supported format.)"),
    ("generate", ["--iteration", "one"], "error: python -m tasks.generate: argument --iteration: invalid int value: "
                                         "'one'"),
    # out of order: the missing input, and the first command to run (IncompleteArtifact's traceback, before)
    ("generate", ["--iteration", "3"], f"error: generate of iteration 3: no complete published policy of iteration 2 "
                                       f"at {{store}}/tiny-demo/policy/v000002; run first: python -m tasks.generate "
                                       f"--config {TINY} --iteration 1, then each stage in order (generate, reward, "
                                       f"train, publish) through publish --iteration 2"),
    ("train", ["--iteration", "2", "-o", "run.max_staleness=1"],
     f"error: train of iteration 2: no complete scored rollouts of iteration 2 at {{store}}/tiny-demo/iter-000002/"
     f"rewards; run first: python -m tasks.generate --config {TINY} -o run.max_staleness=1 --iteration 1, then each "
     f"stage in order (generate, reward, train, publish) through reward --iteration 2"),
])
def test_stage_command_line_mistakes_are_one_line(tmp_path, stage, args, expected):
    import subprocess

    out = subprocess.run([sys.executable, "-m", f"tasks.{stage}", "--config", str(TINY), *args], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    assert out.returncode == 2 and out.stderr.strip() == expected.replace("{store}", f"file://{tmp_path}/rlflow-store"), \
        out.stderr[-2000:]
    assert not (tmp_path / "rlflow-store").exists()


def test_a_refused_resume_names_the_fields_that_changed(tmp_path):
    """An output made from another config: the changed fields with old -> new values (three, "and N more") and
    the overrides that resume; an output from before made_of was kept: the general line."""
    import tempfile

    from tasks.core.stage import fingerprint, reuse
    from tasks.core.store import Store

    store = Store.open(str(tmp_path))
    cfg = load_config(TINY)
    fp, made = fingerprint(cfg, ("model", "train"), iteration=1)
    for key, meta in (("new", {"fingerprint": fp, "made_of": made}), ("old", {"fingerprint": fp})):
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "x").write_text("x")
            store.put_folder(key, Path(tmp), meta=meta)
    assert reuse(store, "new", fp, made) is not None
    other = load_config(TINY, ["train.lr=0.5", "train.beta=0.1", "model.dtype=bfloat16", "run.seed=3"])
    fp2, made2 = fingerprint(other, ("model", "train"), iteration=1)
    with pytest.raises(UserError) as e:
        reuse(store, "new", fp2, made2)
    assert str(e.value) == (f"run: {store.uri('new')} was made from a different config or input: model.dtype float32 "
                            f"-> bfloat16, run.seed 0 -> 3, train.beta 0.0 -> 0.1 and 1 more; resume with the values "
                            f"it was made with (-o model.dtype=float32 -o run.seed=0 -o train.beta=0.0 and 1 more), "
                            f"or choose a new run.name")
    with pytest.raises(UserError, match="made from a different config or input; resume with the same config"):
        reuse(store, "old", fp2, made2)
    fp3, made3 = fingerprint(cfg, ("model", "train"), iteration=1, rewards="other")
    with pytest.raises(UserError, match="the same config, other inputs: an earlier output"):
        reuse(store, "new", fp3, made3)
    # A rollout sampled from another policy, the config the same: what a changed run.max_staleness does (it is not in
    # the generate stage's sections). Was: "other inputs (policy): an earlier output of this run was made again".
    from tasks.core.stage import changed

    assert changed({**made, "policy": "r/policy/v000001"}, {**made, "policy": "base"}) == (
        ": the same config, another policy sampled (r/policy/v000001 -> base), as a changed run.max_staleness makes "
        "it; resume with the run.max_staleness it was made with, or choose a new run.name")


def test_a_manifest_whose_fingerprint_is_not_that_of_its_made_of_is_corrupt(tmp_path):
    """A manifest edited so that its fingerprint is not the one its own made_of gives (only the manifest can be
    wrong: the config did not change) is a corrupt artifact, made again (flows/repair.py); it was refused,
    blaming the config ("the same config, other inputs"). A real change of the config is still refused."""
    import tempfile

    from tasks.core.artifacts import CorruptArtifact
    from tasks.core.stage import fingerprint, reuse
    from tasks.core.store import Store

    store = Store.open(str(tmp_path))
    cfg = load_config(TINY)
    fp, made = fingerprint(cfg, ("model", "train"), iteration=1, rewards="abc")
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "x").write_text("x")
        store.put_folder("edited", Path(tmp), meta={"fingerprint": "0123456789abcdef", "made_of": made})
    with pytest.raises(CorruptArtifact, match=r"edited: its manifest's fingerprint is not that of what it says it "
                                              r"was made of") as e:
        reuse(store, "edited", fp, made)
    assert e.value.key == "edited"
    other, made2 = fingerprint(load_config(TINY, ["train.lr=0.5"]), ("model", "train"), iteration=1, rewards="abc")
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "x").write_text("x")
        store.put_folder("changed", Path(tmp), meta={"fingerprint": fp, "made_of": made})
    with pytest.raises(UserError, match="train.lr"):
        reuse(store, "changed", other, made2)


HANGS = {"sleeps": "import time\nwhile True:\n    time.sleep(1)\n",
         "spins": "while True:\n    try:\n        pass\n    except Exception:\n        pass\n",
         "waits_on_stdin": "import sys\nsys.stdin.read()\n"}


@pytest.mark.parametrize("how", sorted(HANGS))
def test_a_user_module_that_hangs_when_imported_is_one_line(prefect_api, tmp_path, monkeypatch, how):
    """A reward module (or an environment factory's) that never finishes importing (a sleep, a busy loop that
    swallows exceptions, a read of stdin) fails preflight with one line naming the field, exit 2, nothing
    written: not a run that never starts. The deadline is RLFLOW_IMPORT_SECONDS (60 s by default; 2 here)."""
    (tmp_path / f"hang_{how}.py").write_text(HANGS[how] + "def f(completions, **kw):\n    return [0.0]\n")
    monkeypatch.setenv("RLFLOW_IMPORT_SECONDS", "2")
    field, override = (("reward.functions[0].fn", f'reward.functions=[{{"fn": "hang_{how}:f"}}]') if how != "spins"
                       else ("env.factory", f"env.factory=hang_{how}:f"))
    quiet, held = os.pipe()              # stdin that never ends: the write end stays open here
    try:
        out = run_cli(["run", str(TINY), "-o", override], tmp_path, prefect_api, timeout=120, stdin=quiet)
    finally:
        os.close(quiet), os.close(held)
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert out.returncode == 2 and lines == [f"error: {field}: module 'hang_{how}' did not finish importing in 2 s "
                                             f"(it waits or loops when imported: move that work into the "
                                             f"{'function' if how != 'spins' else 'callable'}; RLFLOW_IMPORT_SECONDS "
                                             f"allows more)"], out.stderr[-2000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"hang_{how}.py"]


def test_a_data_column_of_mixed_types_is_said_once_before_the_run(tmp_path, capsys):
    """A column whose rows hold an int here and a string there reaches reward functions as it is (as TRL passes
    it): one warning naming the file, the column and the first row of each type, not a failed iteration 1."""
    from tasks.core.data import load_prompts

    rows = [{"prompt": "a=", "answer": 5}, {"prompt": "b=", "answer": 6}, {"prompt": "c=", "answer": "bbb"},
            {"prompt": "d=", "answer": [1]}]
    (tmp_path / "mixed.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "plain.jsonl").write_text("".join(json.dumps({**r, "answer": str(r["answer"])}) + "\n" for r in rows))
    cfg = load_config(TINY, [f"data.path={tmp_path / 'mixed.jsonl'}"])
    assert load_prompts(cfg)["answer"] == [5, 6, "bbb", [1]]          # the values as they are, not coerced
    load_prompts(cfg, "eval")
    said = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert said == [f"warning: {tmp_path / 'mixed.jsonl'} column 'answer' mixes types (int in row 1, str in row 3, "
                    f"list in row 4): reward functions get each row's value as it is (convert it there, e.g. "
                    f"str(answer))"]
    load_prompts(load_config(TINY, [f"data.path={tmp_path / 'plain.jsonl'}"]))
    assert not capsys.readouterr().err.strip()


def test_a_prompt_cut_to_max_prompt_length_is_said_once(capsys, monkeypatch):
    """A prompt longer than generate.max_prompt_length keeps its last tokens, as TRL's do, and the console says
    so, once: a cut chat prompt loses its template's start (the recipe's 128 cut every letter_jumble prompt)."""
    from tasks.core import data
    from tasks.core.builtin_models import resolve
    from tasks.core.models import encode_prompt, load_tokenizer

    monkeypatch.setattr(data, "_CUT_SAID", [])
    tok = load_tokenizer(resolve("builtin:tiny-lm"))
    capsys.readouterr()                                  # (building the tiny model, the first time)
    whole = encode_prompt(tok, "abcdefgh", 100)
    assert encode_prompt(tok, "abcdefgh", 8) == whole and capsys.readouterr().err == ""
    assert encode_prompt(tok, "abcdefgh", 3) == whole[-3:]
    assert encode_prompt(tok, "abcdefghij", 3) == encode_prompt(tok, "abcdefghij", 100)[-3:]
    said = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert said == [f"warning: generate.max_prompt_length: a prompt of {len(whole)} tokens is cut to its last 3 (it "
                    f"loses its beginning: a chat prompt its template's start); raise generate.max_prompt_length "
                    f"where the model's context has room (it and max_completion_length together at most the "
                    f"context: `rlflow plan` says), else shorten the prompts (said once)"]


def test_files_and_messages_the_checks_must_leave_alone(tmp_path):
    """What datasets and chat templates read well is not refused by the row check or the message rule: a U+2028
    inside a JSON string (not a line break), a pretty-printed array or object, a CSV field past 128 KiB, a
    whitespace-only CSV line, a quoted multi-line CSV field, a BOM; a tool call given flat (Qwen's templates take
    it) or with no arguments."""
    from tasks.core.data import _row_fault, message_fault

    files = {"sep.jsonl": json.dumps({"prompt": "a\u2028b"}, ensure_ascii=False) + "\n",
             "pretty.json": '\n[\n  {"prompt": "a"},\n  {"prompt": "b"}\n]\n',
             "object.json": '{\n  "prompt": ["a", "b"]\n}\n',
             "wide.csv": "prompt,answer\n" + "x" * 200_000 + ",y\n",
             "blank.csv": "prompt,answer\na,x\n   \n",
             "multiline.csv": 'prompt,answer\n"a\nb, c",x\n',
             "bom.jsonl": '\ufeff{"prompt": "a"}\n'}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
        assert _row_fault(tmp_path / name) is None, name
    for call in ({"name": "search", "arguments": {"q": "tea"}},
                 {"type": "function", "function": {"name": "search", "arguments": None}},
                 {"id": "c1", "type": "function", "function": {"name": "search", "arguments": '{"q": "tea"}'}}):
        assert message_fault({"role": "assistant", "content": "", "tool_calls": [call]}) is None, call


def test_a_refused_data_file_leaves_nothing_in_datasets_cache(tmp_path, monkeypatch):
    """A local data file refused for what it holds (a column missing, a row that does not parse) leaves nothing
    in datasets' cache (was: its Arrow copy and lock files under ~/.cache/huggingface/datasets); a good one is
    read whole, in memory, and a .map() of it writes no cache file either."""
    import datasets

    from tasks.core.data import load_prompts

    cache = tmp_path / "hf-datasets"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(cache))
    (tmp_path / "no_prompt.jsonl").write_text('{"question": "1+1"}\n{"question": "2+2"}\n')
    (tmp_path / "broken.jsonl").write_text('{"prompt": "1+1"}\n{"prompt": \n')
    (tmp_path / "good.csv").write_text("prompt,answer\n1+1,2\n2+2,4\n")
    for name, said in (("no_prompt.jsonl", "data.prompt_column: column 'prompt' not in"),
                       ("broken.jsonl", "line 2")):
        cfg = load_config(TINY, [f"data.path={tmp_path / name}"])
        with pytest.raises(UserError, match=said):
            load_prompts(cfg)
    table = load_prompts(load_config(TINY, [f"data.path={tmp_path / 'good.csv'}"]))
    assert table["prompt"] == ["1+1", "2+2"] and table.map(lambda row: {"n": len(row["prompt"])})["n"] == [3, 3]
    assert not cache.exists() or not any(cache.rglob("*")), sorted(str(p) for p in cache.rglob("*"))


def test_rlflows_own_environment_variables_are_checked_before_anything(prefect_api, tmp_path, monkeypatch):
    """$RLFLOW_IMPORT_SECONDS of 'abc' was float()'s traceback (and -5 or nan a reward module 'that cannot be
    imported'), $RLFLOW_USER_OUTPUT_BYTES of 1e6 was taken silently as the default, an $RLFLOW_CACHE that cannot
    be made was mkdir's traceback: each is one line naming the variable, exit 2, nothing written; set and empty,
    each is unset (an empty $RLFLOW_CACHE was the working directory)."""
    from tasks.core.paths import cache_root, user_code_seconds

    for variable, value in (("RLFLOW_IMPORT_SECONDS", "abc"), ("RLFLOW_USER_OUTPUT_BYTES", "1e6"),
                            ("RLFLOW_CACHE", "/proc/rlflow-cache")):
        cwd = tmp_path / variable
        cwd.mkdir()
        out = subprocess.run([sys.executable, "-m", "flows.cli", "run", str(TINY)], cwd=cwd, capture_output=True,
                             text=True, timeout=300, env={**os.environ, "PREFECT_API_URL": prefect_api, variable: value})
        lines = [line for line in out.stderr.splitlines() if line.strip()]
        assert out.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"error: {variable}") and \
            ("expected" in lines[0] or "cannot create" in lines[0]), out.stderr[-2000:]
        assert not any(cwd.iterdir()), list(cwd.iterdir())
    for value in ("nan", "-5", "inf", "0"):
        monkeypatch.setenv("RLFLOW_IMPORT_SECONDS", value)
        with pytest.raises(UserError, match=r"^RLFLOW_IMPORT_SECONDS='.*' \(an environment variable\): expected a number from 0.01 to 604800, or unset for 60$"):
            user_code_seconds()
    monkeypatch.setenv("RLFLOW_IMPORT_SECONDS", " 2.5 ")
    assert user_code_seconds() == 2.5
    monkeypatch.setenv("RLFLOW_CACHE", "")
    assert cache_root() == Path.home() / ".cache" / "rlflow"


def test_a_tracking_server_or_database_that_cannot_take_the_run_is_one_line(prefect_api, tmp_path):
    """An http server that answers but is not MLflow (any reply passed: the run failed after writing the store),
    an experiment deleted in the run's sqlite database (MLflow's traceback, after the store was written), and a
    bad $MLFLOW_TRACKING_URI (tracking.uri's default was never checked): one line, exit 2, nothing written."""
    from mlflow.tracking import MlflowClient

    MlflowClient("sqlite:///" + str(tmp_path / "m.db")).delete_experiment(
        MlflowClient("sqlite:///" + str(tmp_path / "m.db")).create_experiment("gone"))
    cases = {"not MLflow": ({}, ["-o", f"tracking.uri={prefect_api.rsplit('/api', 1)[0]}"],
                            "but not as an MLflow tracking server"),
             "deleted": ({}, ["-o", f"tracking.uri=sqlite:///{tmp_path / 'm.db'}", "-o", "tracking.experiment=gone"],
                         "tracking.experiment: 'gone' was deleted in MLflow"),
             "environment": ({"MLFLOW_TRACKING_URI": "ftp://x/y"}, [], "tracking.uri: expected one of sqlite://")}
    for name, (env, args, expected) in cases.items():
        cwd = tmp_path / name
        cwd.mkdir()
        out = subprocess.run([sys.executable, "-m", "flows.cli", "run", str(TINY), *args], cwd=cwd, text=True,
                             capture_output=True, timeout=300,
                             env={**os.environ, "PREFECT_API_URL": prefect_api, **env})
        lines = [line for line in out.stderr.splitlines() if line.strip()]
        assert out.returncode == 2 and len(lines) == 1 and expected in lines[0], (name, out.stderr[-2000:])
        assert not any(cwd.iterdir()), (name, list(cwd.iterdir()))


def test_a_system_prompt_beside_rows_of_messages_is_said_once(tmp_path, capsys, monkeypatch):
    """data.system_prompt applies to plain-text prompts; rows that are chat messages keep their own, so it is
    a warning naming the first such row, once, before the run (it was ignored without a word)."""
    from flows.preflight import _check_chat_rows
    from tasks.core import config_base
    from tasks.core.config import load_config
    from tasks.core.data import load_prompts
    from tasks.core.models import base_path, load_tokenizer

    monkeypatch.setattr(config_base, "_SAID", set())
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"{c}="}], "answer": c * 2}) + "\n"
                            for c in "abc"))
    for system, said in ((None, False), ("Answer briefly.", True)):
        overrides = [f"data.path={data}", "eval.every=0"] + ([f"data.system_prompt={system}"] if system else [])
        cfg = load_config(TINY, overrides)
        _check_chat_rows(cfg, [load_prompts(cfg)], base_path(cfg), load_tokenizer(base_path(cfg)))
        err = capsys.readouterr().err
        assert err.count("warning: data.system_prompt applies to plain-text prompts only; data.path: "
                         f"{data} row 1 column 'prompt' is chat messages already") == said, err
        assert err.count("warning") == said


def test_a_needed_column_without_a_value_in_some_rows_is_a_warning_naming_the_first(tmp_path, capsys):
    """A row without the column a reward function needs (others have it), or every row: the function is called
    with None there, which failed its whole batch (an iteration without a training step) unsaid until then: a
    warning in preflight, naming the first such row and how many more (a function may take None: not refused)."""
    from flows.preflight import _check_needed_values
    from tasks.core.data import load_prompts

    data = tmp_path / "some.jsonl"
    rows = [{"prompt": "a=", "answer": "bbb"}, {"prompt": "b="}, {"prompt": "c=", "answer": "ddd"},
            {"prompt": "d=", "answer": None}]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(TINY, [f"data.path={data}"])
    _check_needed_values(cfg, [load_prompts(cfg)])
    assert capsys.readouterr().err.strip() == (
        f"warning: data.path: {data} row 2 and 1 more has no value in column 'answer', which reward.functions[0] "
        f"(tasks.rewards.demo:successor_reward) needs: it is called with None there")
    data = tmp_path / "none.jsonl"
    data.write_text("".join(json.dumps({"prompt": r["prompt"], "answer": None}) + "\n" for r in rows))
    cfg = load_config(TINY, [f"data.path={data}"])
    _check_needed_values(cfg, [load_prompts(cfg)])           # (TRL's multi-task functions take None: not refused)
    assert capsys.readouterr().err.strip() == (
        f"warning: data.path: {data} every row has no value in column 'answer', which reward.functions[0] "
        f"(tasks.rewards.demo:successor_reward) needs: it is called with None there")


def test_a_csv_cell_is_read_as_written(tmp_path):
    """A CSV cell whose number would be written otherwise is its text: `007` was 7.0 (its column read as floats),
    `NA`, `null`, `None` were missing, so a checker comparing answers as text saw 7.0 or None; a column of numbers
    written as numbers is still numbers (a gap leaves floats, as pandas did), true/false is a truth value."""
    from tasks.core.data import load_table

    (tmp_path / "cells.csv").write_text('prompt,answer,n,f,b,gap\n"x,y",007,1,0.5,true,3\n'
                                        "12,NA,2,1e3,False,\nhello,,3,-2,TRUE,4\nnull,None,4,0,false,5\n")
    table = load_table(str(tmp_path / "cells.csv"), None, "train")
    assert table["prompt"] == ["x,y", "12", "hello", "null"]
    assert table["answer"] == ["007", "NA", None, "None"]
    assert table["n"] == [1, 2, 3, 4] and table["f"] == [0.5, 1000.0, -2.0, 0.0]
    assert table["b"] == [True, False, True, False] and table["gap"] == [3.0, None, 4.0, 5.0]
    (tmp_path / "gaps.csv").write_text("prompt,n,big\na,1,1\n,,2\n   \nc,3," + "9" * 5000 + "\n")
    table = load_table(str(tmp_path / "gaps.csv"), None, "train")       # (a row of empty cells; past int64: text)
    assert table["n"] == [1.0, None, 3.0] and table["big"] == ["1", "2", "9" * 5000]
    (tmp_path / "numbers.csv").write_text("prompt,answer\n12,3\n13,4\n")      # (a prompt column of numbers: text)
    cfg = load_config(TINY, [f"data.path={tmp_path / 'numbers.csv'}"])
    from tasks.core.data import load_prompts

    assert load_prompts(cfg)["prompt"] == ["12", "13"] and load_prompts(cfg)["answer"] == [3, 4]


def test_a_csv_quote_never_closed_is_said_where_it_opens(tmp_path):
    """A CSV field whose quote is never closed runs to the end of the file: it was said at the file's last line
    ('line 4: 1 fields where the header has 2') or not at all, as pandas' 'EOF inside string'."""
    from tasks.core.data import _row_fault

    for text, line in (('prompt,answer\na,1\n"b,2\nc,3\n', 3), ('prompt,answer\n\n\na,"1\n', 4),
                       ('prompt,answer\r\na,1\r\n"b,2\r\nc,3\r\n', 3)):
        (tmp_path / "open.csv").write_bytes(text.encode())
        assert _row_fault(tmp_path / "open.csv") == f"line {line}: a quoted field begins here and its quote is never closed"
    for text in ('prompt,answer\na,"1\n2"\nb,3\n', 'prompt,answer\n"a""b",1\n'):
        (tmp_path / "closed.csv").write_bytes(text.encode())
        assert _row_fault(tmp_path / "closed.csv") is None


def test_held_out_rows_that_are_training_prompts_are_left_out_and_said_once(tmp_path, capsys):
    """An eval.path (or a hub split) that shares prompts with the training data was labelled held-out from its
    path alone and scored on them: the shared rows (the same text, case, spacing and chat form aside) are left out,
    said once; a file that is all training prompts is refused (one line)."""
    from tasks.core import data

    (tmp_path / "train.jsonl").write_text("".join(json.dumps({"prompt": p, "answer": "x"}) + "\n"
                                                  for p in ("What is 2+2?", "Name the capital of France.", "q1=")))
    held = ["what is 2+2?", " Name the capital of   France. ", "q10=", "Spell dog."]
    (tmp_path / "held.jsonl").write_text("".join(json.dumps({"prompt": p, "answer": "x"}) + "\n" for p in held)
                                         + json.dumps({"prompt": [{"role": "user", "content": "Q1="}],
                                                       "answer": "x"}) + "\n")
    cfg = load_config(TINY, [f"data.path={tmp_path}/train.jsonl", f"eval.path={tmp_path}/held.jsonl", "eval.every=1"])
    assert cfg.eval_is_held_out()
    capsys.readouterr()
    assert list(data.load_prompts(cfg, "eval")["prompt"]) == ["q10=", "Spell dog."]
    assert len(data.load_prompts(cfg, "eval")) == 2                         # (said once)
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("eval:")]
    assert said == [f"eval: 3 of 5 held-out prompts (eval.path {tmp_path}/held.jsonl) are also training prompts "
                    f"(same text): left out; scored on the other 2"]
    shutil.copy(tmp_path / "train.jsonl", tmp_path / "copy.jsonl")
    copy = load_config(TINY, [f"data.path={tmp_path}/train.jsonl", f"eval.path={tmp_path}/copy.jsonl", "eval.every=1"])
    with pytest.raises(UserError, match=r"^eval.path: .*copy.jsonl: every held-out prompt \(3\) is also a training "
                                        r"prompt \(data.path .*train.jsonl split 'train'; the same text"):
        data.load_prompts(copy, "eval")
    assert len(data.load_prompts(load_config(TINY, [f"data.path={tmp_path}/train.jsonl"]), "eval")) == 3   # (train)



def test_a_resume_after_a_data_file_was_rewritten_is_refused_naming_it(tmp_path):
    """The fingerprints held data.path's and eval.path's path strings only: an eval.path overwritten between two
    sessions resumed, its later policies scored on other prompts and compared with the earlier ones for BEST. Now
    each local data file's bytes are part of the stages' inputs, refused as a changed setting is; an output stored
    before they were is taken as it is."""
    import tempfile

    from tasks.core.stage import fingerprint, fingerprint_of, reuse
    from tasks.core.store import Store

    store = Store.open(str(tmp_path / "store"))
    (tmp_path / "train.jsonl").write_text((TINY.parent / "data" / "successor.jsonl").read_text())
    (tmp_path / "held.jsonl").write_text(json.dumps({"prompt": "y=", "answer": "zzz"}) + "\n")
    cfg = load_config(TINY, [f"data.path={tmp_path}/train.jsonl", f"eval.path={tmp_path}/held.jsonl", "eval.every=1"])
    sections = ("eval", "reward", "data")
    fp, made = fingerprint(cfg, sections, iteration=2)
    legacy = fingerprint(cfg, sections, iteration=2)[1]
    legacy.pop("files", None)
    for key, meta in (("eval", {"fingerprint": fp, "made_of": made}),
                      ("before", {"fingerprint": fingerprint_of(legacy), "made_of": legacy})):
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "x").write_text("x")
            store.put_folder(key, Path(tmp), meta=meta)
    assert reuse(store, "eval", fp, made) is not None
    (tmp_path / "held.jsonl").write_text(json.dumps({"prompt": "a=", "answer": "bbb"}) + "\n")     # rewritten
    fp2, made2 = fingerprint(cfg, sections, iteration=2)
    with pytest.raises(UserError) as e:
        reuse(store, "eval", fp2, made2)
    assert str(e.value) == (f"run: {store.uri('eval')} was made from a different config or input: eval.path "
                            f"{tmp_path}/held.jsonl changed since this run's outputs were made from it (its bytes "
                            f"differ); restore the file they were made from, or choose a new run.name")
    assert reuse(store, "before", fp2, made2) is not None
    (tmp_path / "train.jsonl").write_text((TINY.parent / "data" / "successor.jsonl").read_text() + "\n")
    with pytest.raises(UserError, match=r"data.path .*train.jsonl, eval.path .*held.jsonl changed since this run's "
                                        r"outputs were made from them \(their bytes differ\); restore the files"):
        reuse(store, "eval", *fingerprint(cfg, sections, iteration=2))


def test_an_environments_held_out_rows_are_told_apart_by_the_whole_row(tmp_path):
    """The letters game's rows share one prompt sentence and differ in `letters`: compared by the prompt alone,
    every held-out sequence was a training prompt and the run was refused (the warm start's check too). With an
    environment a row's task is the whole row: only a sequence trained on is left out."""
    from tasks.core import data
    from tasks.sft import _held_out_keys

    rows = lambda seqs: "".join(json.dumps({"prompt": "Say each letter I name.", "letters": s}) + "\n"  # noqa: E731
                                for s in seqs)
    (tmp_path / "train.jsonl").write_text(rows(["abc", "aaa", "cab"]))
    (tmp_path / "held.jsonl").write_text(rows(["abd", "aaa", "dcb"]))
    cfg = load_config(Path(__file__).resolve().parents[1] / "configs" / "letters.yaml", [f"data.path={tmp_path}/train.jsonl", "eval.every=1",
                                                          f"eval.path={tmp_path}/held.jsonl", "eval.split=train"])
    assert cfg.eval_is_held_out() and list(data.load_prompts(cfg, "eval")["letters"]) == ["abd", "dcb"]
    assert _held_out_keys(cfg) == frozenset()      # (the shared sentence names no held-out task)


def test_a_folder_datasets_save_to_disk_wrote_is_data(tmp_path):
    """`Dataset.save_to_disk` / `DatasetDict.save_to_disk` folders were refused ("expected a .json/.jsonl/.csv/
    .parquet file"): they load as datasets' load_from_disk reads them, a split and its slice as named."""
    import datasets

    from tasks.core import data

    rows = {"prompt": [f"q{i}=" for i in range(6)], "answer": [str(i) for i in range(6)]}
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(rows),
                          "test": datasets.Dataset.from_dict({"prompt": ["h="], "answer": ["h"]})}
                         ).save_to_disk(str(tmp_path / "dd"))
    datasets.Dataset.from_dict(rows).save_to_disk(str(tmp_path / "one"))
    cfg = load_config(TINY, [f"data.path={tmp_path}/dd", "data.split=train[2:5]", "eval.every=1",
                             f"eval.path={tmp_path}/dd", "eval.split=test"])
    assert list(data.load_prompts(cfg)["prompt"]) == ["q2=", "q3=", "q4="]
    assert list(data.load_prompts(cfg, "eval")["prompt"]) == ["h="]
    assert len(data.load_prompts(load_config(TINY, [f"data.path={tmp_path}/one"]))) == 6
    with pytest.raises(UserError, match=r"data.path: cannot load .*split 'dev'.*no split 'dev' \(it has train, test\)"):
        data.load_prompts(load_config(TINY, [f"data.path={tmp_path}/dd", "data.split=dev"]))


def test_an_empty_parquet_file_says_it_holds_no_rows(tmp_path):
    """A Parquet file with its columns and no row: Arrow's 'BatchSize must be greater than 0, got 0' was the line."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from tasks.core.data import load_table

    path = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"prompt": pa.array([], pa.string()), "answer": pa.array([], pa.string())}), path)
    with pytest.raises(UserError, match=rf"^data.path: {path}: no rows \(the Parquet file holds none\)$"):
        load_table(str(path), None, "train")


def test_more_local_replicas_than_the_machines_memory_holds_are_refused_before_the_run(tmp_path, monkeypatch):
    """generate.replicas: 256 (the field's bound) on a 2-core, 24 GiB machine was accepted: 256 processes each
    holding the model, swapped or killed one by one mid-run. Preflight weighs them against the machine's memory
    (here made 4 GiB, so the test holds on any machine): one line naming the field; what fits passes."""
    import os

    from flows.preflight import check_replicas_fit
    from tasks.core.config import load_config
    from tasks.core.models import base_path

    real = os.sysconf
    pages = (4 << 30) // real("SC_PAGE_SIZE")
    monkeypatch.setattr(os, "sysconf", lambda name: pages if name == "SC_PHYS_PAGES" else real(name))
    cfg = load_config(TINY, [f"store.uri={tmp_path}/store", "generate.replicas=16"])
    with pytest.raises(UserError, match=r"generate.replicas: 16 replicas on this machine, each a process holding the "
                                        r"model \(about 0.3 GiB: 0.00 GiB of weights and a Python with torch\), need "
                                        r"about 5 GiB; this machine has 4 GiB; expected at most 11 \(or launcher"):
        check_replicas_fit(cfg, base_path(cfg), 16)
    check_replicas_fit(cfg, base_path(cfg), 8)


def test_a_process_a_module_forks_as_it_is_imported_ends_with_the_run(prefect_api, tmp_path):
    """A reward module that forks a process as it is imported (a server, a helper; here a `sleep` in a session of
    its own): rlflow imports it in its own process too (preflight's checks), and that copy outlived the run
    (ppid 1, running for good). It ends when rlflow exits now; the worker's copy ended with the worker already."""
    (tmp_path / "forks_on_import.py").write_text(
        "import os\n"
        "child = os.fork()\n"
        "if child == 0:\n"
        "    os.setsid()\n"
        "    os.execvp('sleep', ['sleep', '3600'])\n"
        "with open('forked.pids', 'a') as f:\n"
        "    f.write(f'{child}\\n')\n"
        "def f(completions, answer, **kw):\n"
        "    return [0.0] * len(completions)\n")
    out = run_cli(["run", str(TINY), "-o", 'reward.functions=[{"fn": "forks_on_import:f"}]', "-o",
                   f"data.path={TINY.parent / 'data' / 'letters.jsonl'}"], tmp_path, prefect_api, timeout=300)
    assert out.returncode == 2 and "needs argument 'answer'" in out.stderr, out.stderr[-2000:]
    pids = [int(p) for p in (tmp_path / "forked.pids").read_text().split()]
    assert len(pids) >= 2                          # (this process's import and the worker's)

    def running(pid: int) -> bool:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return False
        return state != "Z"                         # (killed, not yet reaped by whoever adopted it)

    try:                                            # (killed as rlflow exited: gone once the kernel has run them)
        deadline = time.monotonic() + 120
        while [p for p in pids if running(p)] and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [p for p in pids if running(p)], "processes a module forked as it was imported outlived the run"
    finally:
        for pid in pids:
            with contextlib.suppress(OSError):
                os.killpg(pid, signal.SIGKILL)



def test_a_recording_whose_every_episode_failed_says_the_first_failure(prefect_api, tmp_path):
    """Every episode's environment crashed (a reset that segfaults, in its own process): the line blamed --policy
    alone ('none of its 2 episodes returned 1 or more without an error'), never the environment or the crash."""
    (tmp_path / "crashing_env.py").write_text(
        "from tasks.envs.builtin.games import SayTheLetters\n\n\n"
        "class Env(SayTheLetters):\n    def reset(self, row):\n        import ctypes\n        ctypes.string_at(0)\n")
    out = run_cli(["record", str(TINY.parent / "letters.yaml"), "--policy", "tasks.envs.builtin.games:reference_action",
                   "--rows", "0-1", "--out", str(tmp_path / "o.jsonl"), "-o", "env.factory=crashing_env:Env", "-o",
                   "env.isolation=process"], tmp_path, prefect_api)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2 and len(lines) == 1, out.stderr[-2000:]
    assert lines[0].startswith("error: --policy: none of its 2 episodes returned 1 or more without an error; nothing "
                               "to write (the first error: ") and "SIGSEGV" in lines[0], lines[0]
    assert not (tmp_path / "o.jsonl").exists()


def test_a_data_path_of_home_or_a_file_uri_is_the_local_file(tmp_path, monkeypatch):
    """`~` in a config file reaches no shell, and store.uri takes file://: data.path (eval.path, warmup.path) read
    both as the local file; `~/rows.jsonl` was "no such file" beside an existing one."""
    from tasks.core.config import load_config

    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = load_config(TINY, ["data.path=~/rows.jsonl", "eval.path=file://localhost/data/held%20out.jsonl",
                             "warmup.path=~/demos.jsonl"])
    assert (cfg.data.path, cfg.eval.path) == (f"{tmp_path}/rows.jsonl", "/data/held out.jsonl")
    assert cfg.warmup.path == f"{tmp_path}/demos.jsonl"
