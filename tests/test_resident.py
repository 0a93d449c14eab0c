"""The resident trainer (train.mode: resident, tasks/engines/detached.py), for real: a detached trainer process
(train.host detached) or one held by the calling process (caller), on the tiny model, driven through the
stage functions as the flow drives them.

The reference is process mode on the same config (every iteration a full checkpoint, a fresh process): the
resident run must publish the same policies bit for bit, also when its trainer is SIGKILLed anywhere (before
a lean write, while a background full checkpoint is written, right after one is committed, after everything
was committed but before the stage heard back): the stage fails, the retry (Prefect's, here by hand) starts a
new trainer, which restores the newest full checkpoint and replays the stored iterations after it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from tasks.core import layout
from tasks.core.config import load_config
from tasks.core.errors import UserError
from tasks.core.processes import alive
from tasks.core.store import open_store
from tasks.engines.detached import DetachedTrainer, state_dir
from tasks.generate import generate
from tasks.publish import publish
from tasks.reward import reward
from tasks.train import finish_trainer, open_trainer, train
from tests.conftest import AT_LENGTH, ROOT, TINY

pytestmark = pytest.mark.slow
ITERATIONS = 6


def _cfg(tmp_path, name: str, mode: str = "resident", extra=(), host: str = "detached"):
    return load_config(TINY, [f"store.uri={tmp_path}/store", f"run.name={name}", f"train.mode={mode}",
                              f"train.host={host}", "train.checkpoint_every=2", "generate.prompts_per_iteration=4",
                              "generate.num_generations=4", "train.lr=1e-2", *extra])


def _iteration(cfg, it: int, retries: int = 0) -> None:
    generate(cfg, it, layout.BASE if it == 1 else layout.policy(cfg.run.name, it - 1))
    reward(cfg, it)
    for attempt in range(retries + 1):          # what the flow's retry of an infrastructure failure does
        try:
            train(cfg, it)
            break
        except RuntimeError:
            if attempt == retries:
                raise
    publish(cfg, it)


def _policies(cfg) -> list[str]:
    store = open_store(cfg)
    return [store.manifest(layout.policy(cfg.run.name, it))["files"]["model.safetensors"]["sha256"]
            for it in range(1, ITERATIONS + 1)]


def _finish(cfg) -> int | None:
    return finish_trainer(cfg)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Process mode, uninterrupted: the published policies every resident run must reproduce."""
    cfg = _cfg(tmp_path_factory.mktemp("process"), "ref", mode="process")
    for it in range(1, ITERATIONS + 1):
        _iteration(cfg, it)
    return _policies(cfg)


def test_resident_publishes_what_process_mode_publishes_and_writes_lean(reference, tmp_path):
    cfg = _cfg(tmp_path, "lean")
    for it in range(1, ITERATIONS + 1):
        _iteration(cfg, it)
    pid = json.loads((state_dir() / "lean.json").read_text())["pid"]
    assert _policies(cfg) == reference
    store = open_store(cfg)
    lean = store.manifest(layout.checkpoint("lean", 3))
    assert lean["meta"]["kind"] == "lean" and layout.CKPT_OPTIMIZER not in lean["files"]
    assert _finish(cfg) == 6 and not alive(pid) and not (state_dir() / "lean.json").exists()
    assert _finish(cfg) is None                                                # nothing left to stop
    assert store.manifest(layout.full_checkpoint("lean", 3)) is None          # checkpoint_every=2
    for it in (2, 4, 6):                                                       # 6: the background one, joined
        full = store.manifest(layout.full_checkpoint("lean", it))
        assert full["meta"]["kind"] == "full" and layout.CKPT_OPTIMIZER in full["files"]


@pytest.mark.drill
@pytest.mark.parametrize("drill", ["lean-write:3", pytest.param("full-upload:4", marks=AT_LENGTH),   # (drills: 4)
                                   pytest.param("full-done:4", marks=AT_LENGTH),
                                   pytest.param("answer:5", marks=AT_LENGTH)])
def test_a_trainer_killed_anywhere_resumes_bit_identically(reference, tmp_path, monkeypatch, drill):
    name = "kill-" + drill.replace(":", "-")
    monkeypatch.setenv("RLFLOW_DRILL", drill)
    monkeypatch.setenv("RLFLOW_DRILL_ONCE", str(tmp_path / "drilled"))
    cfg = _cfg(tmp_path, name)
    for it in range(1, ITERATIONS + 1):
        _iteration(cfg, it, retries=1)
    assert (tmp_path / "drilled").exists()                                     # the kill happened
    assert _policies(cfg) == reference
    assert _finish(cfg) == 6
    log = (state_dir() / f"{name}.log").read_text()
    assert "drill: killing the trainer" in log


def test_a_trainer_held_by_the_caller_publishes_the_same_and_starts_no_process(reference, tmp_path):
    """train.host caller (auto's choice where the stage is a function call, as in the flow's own process)."""
    cfg = _cfg(tmp_path, "held", host="caller")
    assert type(open_trainer(cfg)).__name__ == "InProcessTrainer"
    for it in range(1, ITERATIONS + 1):
        _iteration(cfg, it)
    assert not (state_dir() / "held.json").exists()                          # no trainer process
    assert _policies(cfg) == reference
    assert _finish(cfg) == 6 and _finish(cfg) is None
    store = open_store(cfg)
    assert [it for it in range(1, 7) if store.manifest(layout.full_checkpoint("held", it))] == [2, 4, 6]
    auto = _cfg(tmp_path, "held", host="auto")
    assert type(open_trainer(auto)).__name__ == "InProcessTrainer"
    with pytest.raises(UserError, match="host: caller holds the trainer in the calling process"):
        _cfg(tmp_path, "held", extra=["train.engine=deepspeed"], host="caller")


@AT_LENGTH
@pytest.mark.drill
def test_a_caller_killed_inside_a_background_checkpoint_resumes_bit_identically(reference, tmp_path):
    """The caller holding the trainer is the process that dies (SIGKILL while its thread writes full-4, ckpt-4
    committed): a new process, as a flow's rerun, reuses iteration 4, restores full-2 for iteration 5,
    replays 3 and 4 and goes on."""
    script = (f"import sys; from pathlib import Path; sys.path.insert(0, {str(ROOT)!r})\n"
              "from tests.test_resident import _cfg, _iteration, ITERATIONS\n"
              f"cfg = _cfg(Path({str(tmp_path)!r}), 'held-kill', host='auto')\n"
              "for it in range(1, ITERATIONS + 1):\n    _iteration(cfg, it)\n")
    env = {**os.environ, "RLFLOW_DRILL": "full-upload:4", "RLFLOW_DRILL_ONCE": str(tmp_path / "drilled")}
    first = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=300)
    assert first.returncode == -9 and (tmp_path / "drilled").exists(), first.stderr[-2000:]
    second = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                            timeout=300)
    assert second.returncode == 0, second.stderr[-2000:]
    cfg = _cfg(tmp_path, "held-kill")
    assert _policies(cfg) == reference
    store = open_store(cfg)
    assert store.manifest(layout.full_checkpoint("held-kill", 4)) is None      # the killed write left nothing
    assert store.manifest(layout.full_checkpoint("held-kill", 6)) is not None  # (5 replayed 3 and 4 from full-2)


def test_a_replay_that_reproduces_other_weights_is_refused_on_a_cpu(tmp_path):
    """The stored rewards of a replayed iteration no longer give the policy it published (altered behind the
    manifest's back, here rewritten whole): the restore fails loudly instead of training on from other weights."""
    from tasks.core import rollout
    from tasks.engines import trainer

    cfg = _cfg(tmp_path, "tamper", host="caller")
    for it in (1, 2, 3):
        _iteration(cfg, it)
    store, key = open_store(cfg), layout.rewards("tamper", 3)
    manifest, records = store.manifest(key), rollout.load(store, key)
    for i, r in enumerate(records):
        r.reward = float(i % 2)
    (tmp_path / "altered").mkdir()
    rollout.write(records, tmp_path / "altered")
    store.delete_folder(key)
    store.put_folder(key, tmp_path / "altered", meta=manifest["meta"])
    trainer._HELD.pop("tamper")[1].close()                  # as if the process holding it had died
    generate(cfg, 4, layout.policy("tamper", 3))
    reward(cfg, 4)
    with pytest.raises(RuntimeError, match="replay: iteration 3 reproduced other weights.*this is a bug"):
        train(cfg, 4)


def test_a_held_trainer_keeps_its_own_random_streams_beside_generate(tmp_path):
    """A model with dropout draws from the global torch RNG while it trains; generate, in the same process when
    the caller holds the trainer, seeds that RNG per request. The held trainer keeps its own streams (as a
    process of its own does, and as process mode restores them), so the three give the same weights."""
    import shutil

    from tasks.core.builtin_models import resolve

    model = tmp_path / "dropout-lm"
    shutil.copytree(resolve("builtin:tiny-lm"), model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "attention_dropout": 0.3}))
    runs = {name: _cfg(tmp_path, name, mode=mode, host=host, extra=[f"model.name_or_path={model}"])
            for name, mode, host in (("drop-process", "process", "auto"), ("drop-held", "resident", "caller"))}
    for it in (1, 2, 3):
        for cfg in runs.values():
            _iteration(cfg, it)
    store = open_store(runs["drop-held"])
    shas = {name: [store.manifest(layout.policy(name, it))["files"]["model.safetensors"]["sha256"]
                   for it in (1, 2, 3)] for name in runs}
    assert shas["drop-process"] == shas["drop-held"]
    _finish(runs["drop-held"])


def test_process_mode_resumes_from_a_resident_runs_lean_checkpoints(reference, tmp_path):
    """Switching mode between flow runs: process mode restores the newest full checkpoint and replays."""
    cfg = _cfg(tmp_path, "switch")
    for it in range(1, 4):
        _iteration(cfg, it)
    assert _finish(cfg) == 3
    os.remove(open_store(cfg).root[len("file://"):] + "/switch/trainer/full-000003/MANIFEST.json")   # replay 3
    process = _cfg(tmp_path, "switch", mode="process")
    for it in range(4, ITERATIONS + 1):
        _iteration(process, it)
    assert _policies(process) == reference


@AT_LENGTH
def test_the_trainer_is_found_again_after_its_caller_died_and_an_idle_one_stops(reference, tmp_path):
    # idle_timeout: long enough for a stage process to import torch and ask on a loaded 2-core machine (~4 s
    # quiet, 37 s measured under load), short enough to watch the idle stop
    cfg = _cfg(tmp_path, "again", extra=["train.idle_timeout=120"])
    _iteration(cfg, 1)
    first = json.loads((state_dir() / "again.json").read_text())["pid"]
    generate(cfg, 2, layout.policy("again", 1))
    reward(cfg, 2)
    overrides = [f"store.uri={tmp_path}/store", "run.name=again", "train.mode=resident", "train.checkpoint_every=2",
                 "generate.prompts_per_iteration=4", "generate.num_generations=4", "train.lr=1e-2",
                 "train.idle_timeout=120"]
    out = subprocess.run([sys.executable, "-m", "tasks.train", "--config", str(TINY), "--iteration", "2",
                          "--overrides-json", json.dumps(overrides)], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]                            # a stage process, now gone
    assert json.loads((state_dir() / "again.json").read_text())["pid"] == first      # the same trainer
    publish(cfg, 2)
    deadline = time.monotonic() + 300
    while alive(first) and time.monotonic() < deadline:                      # unused for 120 s: it stops
        time.sleep(0.2)
    assert not alive(first) and not (state_dir() / "again.json").exists()
    assert open_store(cfg).manifest(layout.full_checkpoint("again", 2)) is not None   # after a full checkpoint
    for it in range(3, ITERATIONS + 1):                                        # a new trainer, no replay needed
        _iteration(cfg, it)
    assert _policies(cfg) == reference
    _finish(cfg)


@AT_LENGTH
def test_a_lost_trainer_is_restored_by_preload_before_the_train_request_comes(reference, tmp_path):
    """What the flow does while generate runs (flows/training.py: _warm_trainer): a new trainer restores then,
    and the train request finds it ready; a late preload never moves a trainer back."""
    import signal

    cfg = _cfg(tmp_path, "warm")
    for it in (1, 2, 3):
        _iteration(cfg, it)
    os.kill(json.loads((state_dir() / "warm.json").read_text())["pid"], signal.SIGKILL)
    handle = DetachedTrainer(cfg)
    assert handle.preload(3) == 3                              # a new trainer: full-2, then 3 replayed
    generate(cfg, 4, layout.policy("warm", 3))
    reward(cfg, 4)
    assert "train/restore_seconds" in train(cfg, 4)["metrics"]   # (spent in preload, reported here)
    publish(cfg, 4)
    assert handle.preload(2) == 4
    log = (state_dir() / "warm.log").read_text().split("pid ")[-1]   # the new trainer's lines
    assert log.count("restored the state after") == 1 and "restored the state after iteration 3" in log
    assert log.index("preload 3: ok") < log.index("train 4: ok") and "preload 2: ok" in log
    for it in (5, 6):
        _iteration(cfg, it)
    assert _policies(cfg) == reference
    _finish(cfg)


@pytest.mark.parametrize("host", ["caller", pytest.param("detached", marks=AT_LENGTH)])
def test_a_flow_ends_with_a_full_checkpoint_even_when_its_trainer_died(tmp_path, host):
    """The trainer that committed the newest iteration is gone (a killed flow process holding it, a killed
    detached one) and the flow run that ends reused that iteration: finish still leaves its full checkpoint,
    made by replay (what retention and the next resume rely on)."""
    import signal

    from tasks.engines import trainer

    cfg = _cfg(tmp_path, f"gone-{host}", host=host)
    for it in (1, 2, 3):
        _iteration(cfg, it)
    if host == "caller":
        trainer._HELD.pop(cfg.run.name)[1].close()
    else:
        pid = json.loads((state_dir() / f"{cfg.run.name}.json").read_text())["pid"]
        os.kill(pid, signal.SIGKILL)
        while alive(pid):
            time.sleep(0.05)
    store = open_store(cfg)
    assert store.manifest(layout.full_checkpoint(cfg.run.name, 3)) is None
    assert _finish(cfg) == 3
    assert store.manifest(layout.full_checkpoint(cfg.run.name, 3))["meta"]["kind"] == "full"
    assert not (state_dir() / f"{cfg.run.name}.json").exists() and _finish(cfg) is None


def test_a_train_stage_typed_by_hand_says_what_it_left_and_the_finish_command_stops_it(tmp_path):
    """`python -m tasks.train` typed by hand (no launcher, no flow to finish its trainer): one line names the
    detached trainer it started (pid), when it leaves by itself (tasks/train.py: HAND_RUN_IDLE, not the two hours
    train.idle_timeout gives a flow's) and the command that stops it now: `python -m tasks.train finish` (what
    sky/train.yaml runs with FINISH set, the flow's end when the train stage runs on a cluster), which finishes
    it after a full checkpoint."""
    import shlex

    import yaml

    from tasks.train import HAND_RUN_IDLE

    cfg = _cfg(tmp_path, "cli-finish")
    generate(cfg, 1, layout.BASE)
    reward(cfg, 1)
    overrides = [f"store.uri={tmp_path}/store", "run.name=cli-finish", "train.mode=resident",
                 "train.checkpoint_every=2", "generate.prompts_per_iteration=4", "generate.num_generations=4",
                 "train.lr=1e-2"]
    env = {k: v for k, v in os.environ.items() if k not in ("SKYPILOT_NODE_RANK", "RANK")}    # by hand
    out = subprocess.run([sys.executable, "-m", "tasks.train", "--config", str(TINY), "--iteration", "1",
                          "--overrides-json", json.dumps(overrides)], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    pid = json.loads((state_dir() / "cli-finish.json").read_text())["pid"]
    said = [line for line in out.stderr.splitlines() if line.startswith("train: started the resident trainer")]
    assert len(said) == 1 and f"run cli-finish (pid {pid}, log " in said[0], out.stderr[-2000:]
    assert f"stops by itself after {HAND_RUN_IDLE:.0f} s unused (train.idle_timeout)" in said[0]
    started = yaml.safe_load((state_dir() / "cli-finish.config.yaml").read_text())
    assert started["train"]["idle_timeout"] == HAND_RUN_IDLE
    finish = shlex.split(said[0].split("; to stop it now, after a full checkpoint: ")[1])
    assert finish[:4] == ["python", "-m", "tasks.train", "finish"] and finish[-2:] == ["--iteration", "0"]
    out = subprocess.run([sys.executable, *finish[1:]], cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"finished": 1}
    assert not alive(pid) and not (state_dir() / "cli-finish.json").exists()
    assert open_store(cfg).manifest(layout.full_checkpoint("cli-finish", 1))["meta"]["kind"] == "full"


@AT_LENGTH
def test_a_trainer_for_another_config_is_replaced(tmp_path):
    cfg = _cfg(tmp_path, "other")
    _iteration(cfg, 1)
    first = json.loads((state_dir() / "other.json").read_text())["pid"]
    changed = _cfg(tmp_path, "other2", extra=["train.lr=5e-3"])            # another run: its own trainer
    _iteration(changed, 1)
    assert alive(first)
    DetachedTrainer(changed)._ensure()
    bumped = _cfg(tmp_path, "other", extra=["train.max_grad_norm=0.5"])    # same run, another trainer config
    address = DetachedTrainer(bumped)._ensure()
    assert not alive(first) and json.loads((state_dir() / "other.json").read_text())["socket"] == address[0]
    for c in (bumped, changed):
        _finish(c)


def test_the_flow_trains_resident_through_the_local_launcher_and_stops_the_trainer(reference, prefect_api, tmp_path,
                                                                                   monkeypatch):
    """The train stage as its recipe's subprocess (`python -m tasks.train`), the trainer outliving each one;
    the flow's end asks it for a full checkpoint of the last iteration and stops it."""
    from flows.training import train_flow

    monkeypatch.chdir(tmp_path)
    overrides = [f"store.uri={tmp_path}/store", "run.name=flow", "run.iterations=3", "train.mode=resident",
                 "train.checkpoint_every=2", "generate.prompts_per_iteration=4", "generate.num_generations=4",
                 "train.lr=1e-2", "launcher.stages={train: local}", f"launcher.recipes={ROOT / 'sky'}",
                 f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", "tracking.sample_completions=0"]
    summary = train_flow(str(TINY), overrides)
    assert summary["iterations_completed"] == 3
    store = open_store(load_config(TINY, overrides))
    shas = [store.manifest(layout.policy("flow", it))["files"]["model.safetensors"]["sha256"] for it in (1, 2, 3)]
    assert shas == reference[:3]
    log = (state_dir() / "flow.log").read_text()
    # warmed up while generating, once, never restarted (a new trainer would restore a later iteration, and say so)
    assert log.count("preload 0: ok") == 1 and "restored the state after" not in log
    assert not (state_dir() / "flow.json").exists()                          # stopped at the flow's end ...
    assert store.manifest(layout.full_checkpoint("flow", 3)) is not None     # ... after a full checkpoint


@AT_LENGTH
def test_a_bf16_policy_keeps_the_trainers_fp32_weights_exact(tmp_path, monkeypatch):
    """publish.dtype: bfloat16 (the default on a GPU for an fp32 model): the policies are bf16, the trainer
    resumes from its exact fp32 weights (weights.safetensors in a full checkpoint), in both modes alike."""
    import torch
    from safetensors import safe_open

    bf16 = ["publish.dtype=bfloat16"]
    process = _cfg(tmp_path, "bf16-process", mode="process", extra=bf16)
    monkeypatch.setenv("RLFLOW_DRILL", "lean-write:3")
    monkeypatch.setenv("RLFLOW_DRILL_ONCE", str(tmp_path / "drilled"))
    resident = _cfg(tmp_path, "bf16-resident", extra=bf16)
    for it in range(1, 5):
        _iteration(process, it)
        _iteration(resident, it, retries=1)
    assert (tmp_path / "drilled").exists()
    store = open_store(process)
    shas = {c.run.name: [store.manifest(layout.policy(c.run.name, it))["files"]["model.safetensors"]["sha256"]
                         for it in range(1, 5)] for c in (process, resident)}
    assert shas["bf16-process"] == shas["bf16-resident"]
    assert layout.CKPT_WEIGHTS in store.manifest(layout.checkpoint("bf16-process", 4))["files"]
    folder = tmp_path / "store" / "bf16-process" / "policy" / "v000004"
    with safe_open(folder / "model.safetensors", "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"
    _finish(resident)


def test_auto_is_resident_on_one_machine_and_on_several_nodes_and_process_inside_a_torchrun_by_hand(tmp_path,
                                                                                                     monkeypatch):
    """auto: resident with either engine on one machine (DeepSpeed: one torchrun group) and on several nodes
    (NNODES, as sky/train.yaml sets it: one DeepSpeed group across them; the torch engine is refused there);
    process inside a torchrun started by hand, where train.mode resident is refused before anything is read
    or written."""
    for engine in ("torch", "deepspeed"):
        assert load_config(TINY, [f"train.engine={engine}"]).resident_trainer
    auto, explicit = load_config(TINY, ["train.engine=deepspeed"]), _cfg(tmp_path, "nodes")
    with monkeypatch.context() as m:
        m.setenv("NNODES", "2")
        assert auto.resident_trainer and explicit.resident_trainer
        with pytest.raises(UserError, match="resident keeps one trainer of one process with train.engine torch"):
            train(explicit, 1)
    with monkeypatch.context() as m:
        m.setenv("RANK", "0")
        assert not auto.resident_trainer and explicit.resident_trainer
        with pytest.raises(UserError, match="train.mode: resident keeps one trainer"):
            train(explicit, 1)
    assert not (tmp_path / "store").exists()


def test_the_trainer_handle_is_chosen_from_the_config_alone(tmp_path, monkeypatch):
    """Which handle a train stage gets is the config's answer (issue 41), not the process's provenance: host auto
    is caller for the torch engine and detached for deepspeed in any process; a stage process (`python -m
    tasks.train`) writes host detached into its config at its boundary (stage_process), and typed by hand the
    idle timeout of the trainer it starts, unless set."""
    from tasks.core import stage
    from tasks.engines.detached import DetachedTrainer
    from tasks.engines.trainer import InProcessTrainer
    from tasks.train import HAND_RUN_IDLE, open_trainer, stage_process

    cfg = _cfg(tmp_path, "handles", host="auto")
    for own_process in (False, True):                  # provenance no longer matters to open_trainer
        monkeypatch.setattr(stage, "_OWN_PROCESS", own_process)
        assert type(open_trainer(cfg)) is InProcessTrainer
        assert type(open_trainer(_cfg(tmp_path, "handles", extra=["train.engine=deepspeed"], host="auto"))) \
            is DetachedTrainer
        assert type(open_trainer(_cfg(tmp_path, "handles", mode="process", host="auto"))) is InProcessTrainer
    monkeypatch.setenv("SKYPILOT_NODE_RANK", "0")      # a launcher's stage process
    launched = stage_process(cfg)
    assert (launched.train.host, launched.train.idle_timeout) == ("detached", cfg.train.idle_timeout)
    assert type(open_trainer(launched)) is DetachedTrainer
    monkeypatch.delenv("SKYPILOT_NODE_RANK")
    monkeypatch.delenv("RANK", raising=False)           # typed by hand
    by_hand = stage_process(cfg)
    assert (by_hand.train.host, by_hand.train.idle_timeout) == ("detached", HAND_RUN_IDLE)
    kept = stage_process(_cfg(tmp_path, "handles", extra=["train.idle_timeout=30"], host="caller"))
    assert (kept.train.host, kept.train.idle_timeout) == ("caller", 30)


def test_process_mode_with_deepspeed_is_a_group_of_one_iteration(tmp_path, monkeypatch):
    """train.mode process with deepspeed: the handle is a GroupTrainer, which starts the trainer's own processes
    (`-m tasks.engines.trainer_server once`, as a resident group runs `serve`): no engine starts a stage. A
    process's user error and corrupt-artifact lines come back as the stage's own errors; inside a torchrun
    started by hand the stage trains in each process. (The groups themselves train in tests/test_deepspeed.py.)"""
    from tasks.core.errors import corrupt_in, corrupt_line, user_error_in, user_error_line
    from tasks.core.processes import Streamed
    from tasks.core.store import CorruptArtifact
    from tasks.engines import detached
    from tasks.engines.trainer import InProcessTrainer
    from tasks.train import open_trainer

    cfg = _cfg(tmp_path, "group", extra=["train.engine=deepspeed"], mode="process")
    handle = open_trainer(cfg)
    assert type(handle) is detached.GroupTrainer
    started = []

    def exits(code: int, lines: list[str]):
        def stream(argv, env, sink):
            started.append(argv)
            return Streamed(code, next(filter(None, map(user_error_in, lines)), None), lines,
                            next(filter(None, map(corrupt_in, lines)), None))
        return stream

    monkeypatch.setattr(detached, "stream", exits(0, []))
    assert handle.train(3, "fp") == {"key": layout.checkpoint("group", 3)}
    argv = started[0]
    assert argv[1:3] == ["-m", "torch.distributed.run"] and argv[-6:-3] == ["-m", detached.MARKER, "once"]
    assert argv[-2:] == ["3", "fp"] and "tasks.train" not in argv
    assert handle.preload(2) == 2 and handle.finish() is None and not (tmp_path / "store").exists()
    for line, error in ((user_error_line(UserError("train.zero_stage: no")), UserError),
                        (corrupt_line("group/iter-000003/rewards", "altered"), CorruptArtifact)):
        monkeypatch.setattr(detached, "stream", exits(2 if error is UserError else 3, line.splitlines()))
        with pytest.raises(error):
            handle.train(3, "fp")
    monkeypatch.setattr(detached, "stream", exits(1, ["boom"]))
    with pytest.raises(RuntimeError, match="deepspeed group .*exited with 1: boom"):
        handle.train(3, "fp")
    monkeypatch.setenv("RANK", "0")                       # a torchrun started by hand runs the stage in each process
    assert type(open_trainer(cfg)) is InProcessTrainer


def test_a_flow_ends_with_a_full_checkpoint_when_its_trainer_holds_an_older_iteration(tmp_path):
    """A resume whose trainer restored an iteration before the newest committed one (its preload, the iterations
    after it reused from the store): finish restored nothing and wrote no full checkpoint of the newest (the run
    ended on lean checkpoints, a later resume replaying from further back). Now the newest, by replay."""
    from tasks.engines import trainer

    cfg = _cfg(tmp_path, "behind", host="caller")
    for it in (1, 2, 3):
        _iteration(cfg, it)
    trainer._HELD.pop(cfg.run.name)[1].close()
    store = open_store(cfg)
    assert store.manifest(layout.full_checkpoint("behind", 2)) is not None      # (train.checkpoint_every 2)
    assert open_trainer(cfg).preload(2) == 2
    assert _finish(cfg) == 3
    assert store.manifest(layout.full_checkpoint("behind", 3))["meta"]["kind"] == "full"


@pytest.mark.drill
def test_a_trainer_that_stops_answering_is_stopped_and_the_retry_resumes_bit_identically(reference, tmp_path,
                                                                                          monkeypatch):
    """A hung trainer (SIGSTOP: a process that neither answers nor dies) mid-request, or between requests: the
    request's watch stops it once it misses its pings, the retry starts a new one that replays; the next stage
    to find a stopped one replaces it. The old handle waited for an answer forever."""
    import signal

    from tasks.engines import detached

    timing = {name: getattr(detached, name) for name in ("WATCH_SECONDS", "PING_TIMEOUT", "HUNG_AFTER")}
    monkeypatch.setattr(detached, "WATCH_SECONDS", 0.5)
    monkeypatch.setattr(detached, "PING_TIMEOUT", 3.0)
    monkeypatch.setattr(detached, "HUNG_AFTER", 2)
    monkeypatch.setenv("RLFLOW_DRILL", "lean-write:3")
    monkeypatch.setenv("RLFLOW_DRILL_SIGNAL", "STOP")
    monkeypatch.setenv("RLFLOW_DRILL_ONCE", str(tmp_path / "drilled"))
    cfg = _cfg(tmp_path, "hung")
    for it in (1, 2):               # (retried: a busy update that missed its short pings restarts, replayed)
        _iteration(cfg, it, retries=1)
    generate(cfg, 3, layout.policy("hung", 2))
    reward(cfg, 3)
    for _ in range(3):              # (a busy trainer that missed its short pings is stopped too: then again)
        DetachedTrainer(cfg).preload(2)                         # (one runs: a new one if that happened)
        stopped = json.loads((state_dir() / "hung.json").read_text())["pid"]
        with pytest.raises(RuntimeError, match="answered none of 2 pings during train"):
            train(cfg, 3)
        if (tmp_path / "drilled").exists():
            break
    assert (tmp_path / "drilled").exists() and not alive(stopped)
    train(cfg, 3)                                   # the retry: a new trainer, restored by replay
    publish(cfg, 3)
    DetachedTrainer(cfg).preload(3)     # (one runs between requests: a new one where a loaded machine's stall made
    between = json.loads((state_dir() / "hung.json").read_text())["pid"]     # the last miss its short pings)
    assert between != stopped
    for name, value in timing.items():   # (the watch's own timing from here: a busy trainer missed 3 s pings)
        monkeypatch.setattr(detached, name, value)
    os.kill(between, signal.SIGSTOP)                # hung between requests: the next stage replaces it
    for it in range(4, ITERATIONS + 1):
        _iteration(cfg, it, retries=1)
    assert not alive(between)
    assert _policies(cfg) == reference
    assert _finish(cfg) == 6
