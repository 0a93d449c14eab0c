"""Inputs, fourth round (issue 44, items 4-11): what new audits got through, by class. Each refusal is one line
naming the field, before anything is written; none echoes a value that looks like a credential."""

from __future__ import annotations

import json

import pytest

from tasks.core.config import load_config
from tasks.core.errors import UserError, redact
from tests.conftest import TINY


@pytest.mark.parametrize("secret", ["sk-proj-AbCdEf1234567890abcdefGH", "hf_abcdefghijklmnopqrstuvwxyz0123",
                                    "AKIAIOSFODNN7EXAMPLE", "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY",
                                    "xoxb-1234567890-abcdefghij", "Zq8LmP2vX9kR4tY7wB3nC6dF1gH5jK0s"])
def test_a_key_pasted_where_its_variables_name_belongs_is_never_quoted(secret):
    model = {"name": "j", "kind": "judge", "model": "m", "url": "http://127.0.0.1:9", "template": "{completion}",
             "api_key_env": secret}
    with pytest.raises(UserError) as e:
        load_config(TINY, [f"reward.models={json.dumps([model])}"])
    assert secret not in str(e.value) and "reward.models.0.api_key_env" in str(e.value), str(e.value)
    with pytest.raises(UserError) as e:                                  # anywhere a message would quote it
        load_config(TINY, [f"run.name={secret}!"])
    assert secret not in str(e.value)


def test_a_url_keeps_its_user_not_its_password_and_ordinary_values_are_kept():
    assert redact("url: https://me:hunter2@judge.example/v1 does not answer") == \
        "url: https://me:***@judge.example/v1 does not answer"
    kept = ("sha256 0f3a9c8e1b2d4f6a8c0e1f2a3b4c5d6e7f8091a2b3c4d5e6f708192a3b4c5d6e7, "
            "run 7cd7d85c9af04119bf7176d9fcc2c3aa, file://./rlflow-store/tiny-demo/policy/v000060, "
            "/tmp/AbCdEf123456789012345678/x, train.lr 1e-5, RLFLOW_USER_OUTPUT_BYTES='1e6' (a long name in "
            "capitals beside a value with digits and a small letter: the secret's shape was looked for past the name)")
    assert redact(kept) == kept


def test_a_refused_config_says_its_refusal_only(capsys):
    """A deprecation warning about a key it read is said once the config is accepted, never before its refusal."""
    with pytest.raises(UserError, match="^config: train.lr: input should be greater than 0"):
        load_config(TINY, ["train.algorithm=ppo", "train.lam=0.9", "train.lr=-1"])
    assert capsys.readouterr().err == ""
    load_config(TINY, ["train.algorithm=ppo", "train.lam=0.9"])
    load_config(TINY, ["train.algorithm=ppo", "train.lam=0.9"])
    assert capsys.readouterr().err.splitlines() == [
        "warning: config: train.lam is now train.learner.lam (read as that; write the new key)"]


@pytest.mark.parametrize("model, line", [
    ("/nonexistent/judge.gguf", "reward.models[1] (j).model: /nonexistent/judge.gguf: no such GGUF file"),
    ("builtin:nosuch", "reward.models[1] (j).model: unknown builtin model 'nosuch'; expected one of"),
    ("/nonexistent/folder", "reward.models[1] (j).model: /nonexistent/folder: no such file or folder"),
])
def test_a_judges_missing_model_is_one_line_naming_its_entry(model, line):
    """Every path of every entry checked before the lease (a pinned GGUF that is not there: a traceback before),
    and blamed on that entry, never on the policy's model.name_or_path, though the same resolvers check both."""
    from flows.preflight import preflight
    from tasks.core import builtin_models
    from tasks.core.models import pin_of

    ok = {"name": "k", "kind": "judge", "model": "builtin:tiny-lm", "template": "{completion}",
          "sha256": pin_of(builtin_models.resolve("builtin:tiny-lm"))}
    bad = {"name": "j", "kind": "judge", "model": model, "sha256": "0" * 64, "template": "{completion}"}
    with pytest.raises(UserError) as e:
        preflight(load_config(TINY, [f"reward.models={json.dumps([ok, bad])}"]))
    assert str(e.value).startswith(line), str(e.value)


def test_a_file_uri_model_is_that_folder(tmp_path):
    """model.name_or_path=file:///... (a policy folder as rlflow prints a local store's URIs) outside the store is
    that folder; one not there says so (it was read as a hub id: "hf download file:///...")."""
    from tasks.core import builtin_models
    from tasks.core.models import resolve

    cfg = load_config(TINY)
    folder = builtin_models.resolve("builtin:tiny-lm")
    assert resolve(cfg, f"file://{folder}", "model.name_or_path") == folder
    with pytest.raises(UserError, match="^model.name_or_path: /nonexistent/x: no such file or folder$"):
        resolve(cfg, "file:///nonexistent/x", "model.name_or_path")
    with pytest.raises(UserError, match="^model.name_or_path: file://elsewhere/x: a file:// URI of another host"):
        resolve(cfg, "file://elsewhere/x", "model.name_or_path")
    delta = tmp_path / "v000002"                   # (a delta policy's folder: its weights a difference)
    delta.mkdir()
    (delta / "config.json").write_text("{}")
    (delta / "delta.json").write_text("{}")
    with pytest.raises(UserError, match=f"^model.name_or_path: {delta}: a delta policy"):
        resolve(cfg, f"file://{delta}", "model.name_or_path")


@pytest.mark.parametrize("override, line", [
    ('reward.models=[{name: j, kind: judge, model: builtin:tiny-lm, sha256: "' + "0" * 64 + '", '
     'template: "{completion}", scale: [10, 1]}]',
     "config: reward.models.0.scale: expected [low, high] with low below high (scores map to [0, 1] over it), "
     "got [10, 1]"),
    ('reward.models=[{name: j, kind: verdict, model: builtin:tiny-lm, sha256: "' + "0" * 64 + '", '
     'template: "{completion}", verdict_tokens: ["Yes", "Yes"]}]',
     "config: reward.models.0.verdict_tokens: the good and the bad verdict are the same token ('Yes', spaces "
     "aside): expected two, got [\"Yes\", \"Yes\"]"),
    ("launcher.accelerators={train: 'A100:0'}",
     "config: launcher.accelerators: train: 'A100:0' asks for 0 of them; expected a count of 1 or more (or the "
     "type alone, one)"),
    ("cost.hourly_usd={train: -1}", "config: cost.hourly_usd.train: input should be greater than or equal to 0, "
                                    "got -1"),
    ("generate.max_model_len=16", "config: generate: max_model_len (16) leaves no room for a prompt of "
                                  "max_prompt_length (512) beside max_completion_length (16) tokens; expected at "
                                  "least 528, or a shorter max_prompt_length"),
    ("generate.max_model_len=500", "config: generate: max_model_len (500) leaves no room for a prompt of "
                                   "max_prompt_length (512) beside max_completion_length (16) tokens; expected at "
                                   "least 528, or a shorter max_prompt_length"),
    ("env.endpoint={min_top_p: 0.9}", "config: env.endpoint.min_top_p: 0.9 is above generate.top_p (0.8): a request "
                                      "may only narrow top_p, from generate.top_p down to min_top_p; expected "
                                      "min_top_p <= top_p"),
    ("data.curriculum={defer: 8, max_defer: 2}", "config: data.curriculum: max_defer (2) is below defer (8): the "
                                                 "deferral could never be as long as defer says"),
])
def test_settings_that_contradict_each_other_are_refused(override, line):
    """Item 6: a floor above its ceiling, a scale whose min is above its max, a count of 0, a range that is empty:
    a setting that could never take effect is one line."""
    with pytest.raises(UserError) as e:
        load_config(TINY, ["generate.max_completion_length=16", "generate.top_p=0.8", override])
    assert str(e.value) == line


@pytest.mark.parametrize("kwargs, line", [
    ("{env: {taskset: {id: x}}, client: training}", "env.kwargs.client: 'training'; expected eval or train"),
    ("{env: {taskset: {id: x}}, client: train}", "env.kwargs.tokenizer: client train renders prompts with the "
                                                 "policy's tokenizer"),
    ("{env: {taskset: {id: x}}, path: [/nonexistent/envs]}", "env.kwargs.path: /nonexistent/envs: no such folder"),
    ("{env: {taskset: {id: x}}, timeout: -1}", "env.kwargs.timeout: seconds, above 0; got -1"),
    ("{env: {taskset: {id: x}}, sampling: 7}", "env.kwargs.sampling: verifiers' SamplingConfig as a mapping"),
])
def test_an_integrations_arguments_are_checked_before_the_run(kwargs, line, tmp_path):
    """Item 7: verifiers 0.4's agent refused its own arguments per episode, after the MLflow run and the lease
    existed; preflight now asks the integration (an agent's `check`) first, and nothing is written."""
    from flows.preflight import preflight

    cfg = load_config(TINY.parent / "agent.yaml", ["env.agent=tasks.envs.adapters.verifiers_v04:run",
                                                   f"env.kwargs={kwargs}", f"store.uri={tmp_path}/store"])
    with pytest.raises(UserError) as e:
        preflight(cfg)
    assert str(e.value).startswith(line), str(e.value)
    assert not (tmp_path / "store").exists()


def test_a_modules_import_leaves_rlflows_signal_handlers_and_warning_filters_as_they_were(tmp_path, monkeypatch):
    """A module that ignored SIGINT and SIGTERM when imported made Ctrl-C do nothing to the run (preflight imports
    it in the flow's own process); one that set `warnings.simplefilter('error')` turned MLflow's warnings into
    errors (no trace recorded, nothing said)."""
    import signal
    import warnings

    from tasks.core.paths import import_user

    (tmp_path / "rude.py").write_text("import signal, warnings\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\n"
                                      "signal.signal(signal.SIGTERM, signal.SIG_IGN)\nwarnings.simplefilter('error')\n"
                                      "def f(completions, **kw):\n    return [0.0] * len(completions)\n")
    monkeypatch.chdir(tmp_path)
    handlers = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    filters = list(warnings.filters)
    assert callable(import_user("rude:f", "reward.functions[0].fn"))
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == handlers
    assert warnings.filters == filters


def test_what_a_finished_run_waits_for_at_its_exit_is_bounded(tmp_path):
    """A thread a user's module started when imported, or an exit handler it registered, that never ends kept a
    finished `rlflow run` from exiting (it printed `done:` and hung)."""
    import subprocess
    import sys

    from tests.conftest import ROOT

    script = ("import atexit, os, sys, threading, time\n"
              "from tasks.core import process_wide\nprocess_wide.EXIT_HANDLER_SECONDS = 1.0\n"
              "with process_wide.user_import():     # (what a user's module registers as it is imported)\n"
              "    atexit.register(time.sleep, 600)\n    atexit.register(time.sleep, 600)\n"
              "threading.Thread(target=time.sleep, args=(600,), name='users').start()\n"
              "atexit.register(print, 'own handler ran')\n"
              "print(process_wide.wind_down(2.0), flush=True)\nos._exit(0)\n")
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.splitlines() == [
        "own handler ran", "['users', 'exit handler sleep', 'exit handler sleep']"], out
