"""The deepspeed engine, for real on CPU (DeepSpeed's CPU accelerator, gloo): ZeRO 1, 2 and 3 with one process
(run here, as a torchrun worker runs it: RANK/WORLD_SIZE set) and with two processes (the stage starts
torchrun itself), each against the torch engine on the same rollouts.

Every setting trains iterations 1 and 2 with two optimiser passes per iteration (train.num_iterations=2), so:
  - iteration 1 is a training iteration from the base model;
  - iteration 2 is a resume (a fresh engine, load_checkpoint with optimizer states), and its logged loss is
    the loss after the first resumed step, which depends on the restored Adam moments; it must equal the
    loss of an uninterrupted run: the torch engine's, and with one process a DeepSpeed engine that trains
    both iterations without checkpointing in between (exactly);
  - the published policy v2 holds the trainer's weights in bf16, loads through from_pretrained and gives the
    trainer's logprobs up to bf16 rounding;
  - iteration 3 (iteration 2's data again) resumes on another number of processes than wrote ckpt-2: 2 -> 1 at
    ZeRO 1 and 3, 1 -> 2 at ZeRO 2, through DeepSpeed's universal checkpoint; it must equal the torch engine's
    uninterrupted iteration 3.
These run in train.mode process (one torchrun per stage); the resident group (train.mode resident: one torchrun
across iterations, on one machine and across two "nodes") is tested on the same data against the same torch run,
through a kill.
The three ZeRO stages use three loss types (dapo, grpo, dr_grpo), whose normalisers are the whole batch's
token count, sequence count and sequence count x length: on two processes they must be all-reduced.
9 completions, micro-batch 2: one process runs 5 micro-batches; with two, process 0 takes 5 completions
(3 micro-batches) and process 1 four (2, padded with a weightless one).

The rewards are seeded random numbers (see `rollouts`), so every update is driven by a real signal.
Tolerances (fp32 on CPU; measured in brackets): losses, gradient norms and the other metrics 1e-5 relative
(< 1e-6); weights 1e-5 absolute after 4 AdamW steps of lr 1e-3 (< 1e-6): summation order differs between one
and two processes and between ZeRO stages, while a lost optimizer state would move weights by ~lr; published
logprobs 0.01 absolute (1.6e-3): bf16 keeps 8 bits of mantissa, each weight moves by up to 2^-9 relative.
The offload test builds DeepSpeedCPUAdam on a fresh machine (~1-3 min, cached in ~/.cache/torch_extensions).
DeepSpeed's shared-memory comm op, which only its inference uses, is never built (join_group).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tasks.algorithms.advantage import group_advantages
from tasks.algorithms.batching import pad_batch, shard_batches
from tasks.algorithms.logprobs import completion_logprobs
from tasks.algorithms.update import optimise
from tasks.core import layout, rollout
from tasks.core.config import load_config
from tasks.core.errors import UserError
from tasks.core.models import base_path, load_model
from tasks.core.store import Store
from tasks.generate import generate
from tasks.publish import publish
from tasks.reward import reward
from tasks.train import finish_trainer, train
from tests.conftest import AT_LENGTH, ROOT, TINY

pytestmark = [pytest.mark.deepspeed, pytest.mark.slow]

RUN = "ds"
COMMON = [f"run.name={RUN}", "train.mode=process", "generate.prompts_per_iteration=3", "generate.num_generations=3",
          "generate.max_completion_length=4", "train.micro_batch_size=2", "train.num_iterations=2",
          "train.beta=0.05", "train.lr=1e-3", "train.device=cpu",
          'reward.functions=[{"fn": "tasks.rewards.demo:stops_reward"}]']
LOSS_OF_STAGE = {1: "dapo", 2: "grpo", 3: "dr_grpo"}
METRIC_TOL = dict(rel=1e-5, abs=1e-7)
METRIC_KEYS = ("train/loss", "train/grad_norm", "train/kl_ref", "train/entropy", "train/ratio_mean",
               "train/mismatch_kl", "train/clip_region")
WEIGHT_ATOL = 1e-5
LOGPROB_ATOL = 0.01


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def rollouts(tmp_path_factory) -> dict[int, Path]:
    """Iterations 1 and 2's scored rollouts (local folders), both sampled from the base policy, so that every
    setting trains on the same data. The tiny random model rarely earns a reward in 4 tokens, so the rewards
    are replaced by seeded random numbers: every group has a learning signal, and the updates compared below
    are driven by it rather than by rounding noise (which Adam would turn into steps of size ~lr)."""
    tmp = tmp_path_factory.mktemp("rollouts")
    # (run.max_staleness 1: the schedule has iteration 2 sample from the base policy too)
    cfg = load_config(TINY, [*COMMON, f"store.uri={tmp}/store", "run.max_staleness=1"])
    store, g, folders = Store.open(cfg.store), torch.Generator().manual_seed(0), {}
    for it in (1, 2):
        generate(cfg, it, layout.BASE)
        reward(cfg, it)
        store.get_folder(layout.rewards(RUN, it), tmp / "scored")
        records = rollout.read(tmp / "scored")
        for r in records:
            r.reward = float(torch.rand((), generator=g))
        folders[it] = tmp / f"iter-{it}"
        folders[it].mkdir()
        rollout.write(records, folders[it])
    return folders


def _config(tmp_path: Path, rollouts: dict[int, Path], extra=(), iterations=(1, 2)):
    """A fresh store holding the shared rewards folders (iteration 3, when asked for, repeats iteration 2's)."""
    cfg = load_config(TINY, [*COMMON, f"store.uri={tmp_path}/store", *extra])
    store = Store.open(cfg.store)
    for it in iterations:
        store.put_folder(layout.rewards(RUN, it), rollouts[min(it, 2)], meta={"iteration": it})
    return cfg


@pytest.fixture(scope="module")
def process_group():
    """Environment of a one-process torchrun worker; the gloo process group it creates lives for the module."""
    env = dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(_free_port()))
    yield env
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


@pytest.fixture
def as_worker(process_group, monkeypatch):
    for k, v in process_group.items():
        monkeypatch.setenv(k, v)


_torch_runs: dict[str, dict] = {}


def _torch_reference(loss_type: str, rollouts: dict, tmp_path_factory) -> dict:
    """The torch engine on the same rollouts, uninterrupted: metrics of iterations 1-3 (3 repeats 2's data),
    the weights after iterations 2 and 3."""
    if loss_type not in _torch_runs:
        tmp = tmp_path_factory.mktemp(f"torch-{loss_type}")
        cfg = _config(tmp, rollouts, [f"train.learner.loss_type={loss_type}"], iterations=(1, 2, 3))
        metrics = [train(cfg, it)["metrics"] for it in (1, 2, 3)]
        publish(cfg, 2)
        store = Store.open(cfg.store)
        store.get_folder(layout.checkpoint(RUN, 2), tmp / "ckpt")
        store.get_folder(layout.policy(RUN, 2), tmp / "published")
        with safe_open(tmp / "published" / "model.safetensors", "pt") as f:
            published_keys = set(f.keys())
        weights = load_model(str(tmp / "ckpt" / "model")).state_dict()
        store.get_folder(layout.checkpoint(RUN, 3), tmp / "ckpt3")
        weights3 = load_model(str(tmp / "ckpt3" / "model")).state_dict()
        _torch_runs[loss_type] = dict(metrics=metrics, weights=weights, weights3=weights3,
                                      published_keys=published_keys)
    return _torch_runs[loss_type]


def _fp32_weights(store: Store, iteration: int, dest: Path, key: str | None = None) -> dict:
    """The trainer's fp32 weights, rebuilt from the node folders by DeepSpeed's own zero_to_fp32."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    state = store.get_json(key or layout.checkpoint(RUN, iteration), layout.CKPT_STATE)
    for part in state["engine_state"]:
        store.get_folder(part, dest)
    return get_fp32_state_dict_from_zero_checkpoint(str(dest), tag=state["tag"])


def _logprobs(model, records) -> torch.Tensor:
    ids, attn, pos, mask = pad_batch([r.prompt_ids for r in records], [r.completion_ids for r in records], 0)
    with torch.no_grad():
        logp, _ = completion_logprobs(model, ids, attn, pos, mask.shape[1], 1.0)
    return logp * mask


def _check_against_torch(cfg, metrics: list[dict], ref: dict, rollouts, tmp_path: Path, processes: int) -> dict:
    """Metrics, updated weights, checkpoint layout and the published 16-bit policy; returns the fp32 weights."""
    store = Store.open(cfg.store)
    for got, want in zip(metrics, ref["metrics"]):
        assert set(got) == set(want)                                   # the same train/* metrics
        for k in METRIC_KEYS:
            assert got[k] == pytest.approx(want[k], **METRIC_TOL), k
    assert metrics[1]["train/kl_ref"] > 0 and metrics[1]["train/grad_norm"] > 0.05   # not a vacuous comparison

    state = store.get_json(layout.checkpoint(RUN, 2), layout.CKPT_STATE)
    assert (state["step"], state["world_size"], state["zero_stage"]) == (4, processes, cfg.train.zero_stage)
    assert state["data_cursor"] == 6 and all(store.manifest(p) for p in state["engine_state"])
    fp32 = _fp32_weights(store, 2, tmp_path / "fp32")
    for name, want in ref["weights"].items():
        assert (fp32[name] - want).abs().max() <= WEIGHT_ATOL, name

    # Publish ships the checkpoint's bf16 model folder: exactly the fp32 weights rounded to bf16.
    published = tmp_path / "published"
    store.get_folder(publish(cfg, 2)["key"], published)
    with safe_open(published / "model.safetensors", "pt") as f:
        assert set(f.keys()) == ref["published_keys"]                  # what save_pretrained writes (tied once)
        for name in f.keys():
            t = f.get_tensor(name)
            assert t.dtype == torch.bfloat16 and torch.equal(t, fp32[name].to(torch.bfloat16)), name
    assert json.loads((published / "config.json").read_text())["dtype"] == "bfloat16"
    policy = load_model(str(published), "float32").eval()            # from_pretrained, as generate loads it
    trainer = load_model(str(published), "float32").eval()
    trainer.load_state_dict(fp32, strict=True)
    records = rollout.read(rollouts[2])
    diff = (_logprobs(policy, records) - _logprobs(trainer, records)).abs().max()
    assert 0 < diff <= LOGPROB_ATOL
    return fp32


def _check_resumed_on(tmp_path: Path, extra: list[str], processes: int, ref: dict) -> None:
    """Iteration 3 on `processes` processes from iteration 2's checkpoint, written by another number of processes
    (a spot replacement with another GPU count): DeepSpeed's universal checkpoint re-cuts the ZeRO shards,
    optimizer states included, so the update equals the uninterrupted torch run's. Lost Adam moments or step
    counts would move the weights by ~lr = 1e-3, far above WEIGHT_ATOL."""
    cfg = load_config(TINY, [*COMMON, f"store.uri={tmp_path}/store", *extra, f"train.num_processes={processes}"])
    metrics = train(cfg, 3)["metrics"]
    for k in METRIC_KEYS:
        assert metrics[k] == pytest.approx(ref["metrics"][2][k], **METRIC_TOL), k
    store = Store.open(cfg.store)
    state = store.get_json(layout.checkpoint(RUN, 3), layout.CKPT_STATE)
    assert (state["step"], state["world_size"]) == (6, processes)
    fp32 = _fp32_weights(store, 3, tmp_path / "fp32-3")
    for name, want in ref["weights3"].items():
        assert (fp32[name] - want).abs().max() <= WEIGHT_ATOL, name


@pytest.mark.parametrize("stage", [pytest.param(1, marks=AT_LENGTH), 2, 3])     # (ZeRO-1: make drills; the CI budget)
def test_one_process_matches_torch_resumes_exactly_and_publishes_16bit(stage, rollouts, tmp_path, tmp_path_factory,
                                                                       as_worker, monkeypatch):
    loss_type = LOSS_OF_STAGE[stage]
    ref = _torch_reference(loss_type, rollouts, tmp_path_factory)
    extra = ["train.engine=deepspeed", f"train.zero_stage={stage}", f"train.learner.loss_type={loss_type}"]
    cfg = _config(tmp_path, rollouts, extra, iterations=(1, 2, 3))
    metrics = [train(cfg, it)["metrics"] for it in (1, 2)]
    fp32 = _check_against_torch(cfg, metrics, ref, rollouts, tmp_path, processes=1)

    # Uninterrupted: one engine trains both iterations, no checkpoint in between. The resumed run equals it.
    import deepspeed

    from tasks.engines.deepspeed_engine import DeepSpeedEngine

    engine = DeepSpeedEngine.open(cfg, Store.open(cfg.store), None)
    try:
        for it in (1, 2):
            records = rollout.read(rollouts[it])
            rewards = torch.tensor([r.reward for r in records], dtype=torch.float64)   # (as the trainer: float64,
            adv = group_advantages(rewards, cfg.generate.num_generations,             # then float32)
                                   cfg.train.learner.scale_rewards).float()
            stats = optimise(engine, shard_batches(records, adv, engine.tokenizer.pad_token_id, cfg.train,
                                                   engine.device, 0, 1), cfg)
        assert (stats.loss, stats.grad_norm) == (metrics[1]["train/loss"], metrics[1]["train/grad_norm"])
        params = dict(engine.model.module.named_parameters())
        with deepspeed.zero.GatheredParameters(list(params.values())):
            for name, p in params.items():
                assert torch.equal(p.detach(), fp32[name]), name
    finally:
        engine.close()

    if stage == 2:      # one process's shards resume on two (the stage starts torchrun: not a worker any more)
        for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            monkeypatch.delenv(var)
        _check_resumed_on(tmp_path, extra, 2, ref)


def test_gradient_checkpointing_under_zero_3_trains_as_the_torch_engine(rollouts, tmp_path, tmp_path_factory,
                                                                         as_worker, monkeypatch):
    """train.gradient_checkpointing on the DeepSpeed engine (the shop's recipe needs it for its ~4000-token
    episodes): each layer recomputed in the backward from ZeRO-3's partitioned weights gives the torch engine's
    update without it, metrics and weights, through a resume."""
    from tasks.engines import deepspeed_engine

    on = []
    real = deepspeed_engine.checkpointing
    monkeypatch.setattr(deepspeed_engine, "checkpointing",
                        lambda model, tc: on.append(real(model, tc).is_gradient_checkpointing) or model)
    ref = _torch_reference(LOSS_OF_STAGE[3], rollouts, tmp_path_factory)
    cfg = _config(tmp_path, rollouts, ["train.engine=deepspeed", "train.zero_stage=3", "train.gradient_checkpointing"
                                       "=true", f"train.learner.loss_type={LOSS_OF_STAGE[3]}"])
    metrics = [train(cfg, it)["metrics"] for it in (1, 2)]
    assert on == [True, True]                                          # (each iteration a fresh engine: a resume)
    for got, want in zip(metrics, ref["metrics"]):
        for k in METRIC_KEYS:
            assert got[k] == pytest.approx(want[k], **METRIC_TOL), k
    fp32 = _fp32_weights(Store.open(cfg.store), 2, tmp_path / "fp32")
    for name, want in ref["weights"].items():
        assert (fp32[name] - want).abs().max() <= WEIGHT_ATOL, name


@AT_LENGTH
@pytest.mark.parametrize("stage", [1])
def test_two_processes_match_one_and_the_torch_engine(stage, rollouts, tmp_path, tmp_path_factory):
    """The stage starts `torchrun --nproc_per_node=2` itself; ZeRO shards over both processes. (ZeRO 2 on two
    processes is compared with the torch engine by the one-process test, which resumes its stage-2 shards on
    two, and by the resident group's test, which trains three iterations at ZeRO 2 on two; ZeRO 3 on two by
    test_two_nodes. Their cases here went for the CI budget.)"""
    loss_type = LOSS_OF_STAGE[stage]
    ref = _torch_reference(loss_type, rollouts, tmp_path_factory)
    extra = ["train.engine=deepspeed", f"train.zero_stage={stage}", f"train.learner.loss_type={loss_type}",
             "train.num_processes=2"]
    cfg = _config(tmp_path, rollouts, extra, iterations=(1, 2, 3))
    assert "RANK" not in os.environ
    metrics = [train(cfg, it)["metrics"] for it in (1, 2)]
    _check_against_torch(cfg, metrics, ref, rollouts, tmp_path, processes=2)
    store = Store.open(cfg.store)
    shards = store.manifest(store.get_json(layout.checkpoint(RUN, 2), layout.CKPT_STATE)["engine_state"][0])
    assert {"rng/rank-00000.pt", "rng/rank-00001.pt"} <= set(shards["files"])
    assert sum("optim_states" in f for f in shards["files"]) == 2         # one ZeRO shard per process
    if stage == 1:   # a worker's user error stays a user error: a checkpoint of ZeRO stage 1 resumed at stage 2
        other = load_config(TINY, [*COMMON, f"store.uri={tmp_path}/store", *extra, "train.zero_stage=2"])
        with pytest.raises(UserError, match="train.zero_stage: .* ZeRO stage 1"):
            train(other, 3)
        assert store.manifest(layout.checkpoint(RUN, 3)) is None
    _check_resumed_on(tmp_path, extra[:-1], 1, ref)          # two processes' shards resume on one


def test_two_nodes(rollouts, tmp_path, tmp_path_factory):
    """Two nodes of one process each, on this machine: each node runs what sky/train.yaml runs on it
    (`python -m tasks.train` with NNODES/NODE_RANK/MASTER_ADDR/MASTER_PORT); each node saves its shards to
    its own disk and uploads them; the resume downloads both. Same update as the torch engine."""
    cfg = _config(tmp_path, rollouts, ["train.engine=deepspeed", "train.zero_stage=3",
                                       "train.learner.loss_type=dr_grpo"])
    config = tmp_path / "config.yaml"
    config.write_text(json.dumps(cfg.model_dump(mode="json")))
    port = str(_free_port())
    for it in (1, 2):
        nodes = [subprocess.Popen([sys.executable, "-m", "tasks.train", "--config", str(config), "--iteration",
                                   str(it)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  env={**os.environ, "NNODES": "2", "NODE_RANK": str(node), "MASTER_ADDR": "127.0.0.1",
                                       "MASTER_PORT": port})
                 for node in (0, 1)]
        outs = [p.communicate(timeout=600)[0] for p in nodes]
        assert [p.returncode for p in nodes] == [0, 0], "\n".join(o[-3000:] for o in outs)
    store = Store.open(cfg.store)
    state = store.get_json(layout.checkpoint(RUN, 2), layout.CKPT_STATE)
    assert (state["nodes"], state["world_size"]) == (2, 2) and len(state["engine_state"]) == 2
    node1 = store.manifest(state["engine_state"][1])["files"]
    assert any("zero_pp_rank_1" in f for f in node1) and not any("zero_pp_rank_0" in f for f in node1)
    fp32 = _fp32_weights(store, 2, tmp_path / "fp32")
    ref = _torch_reference("dr_grpo", rollouts, tmp_path_factory)
    assert all((fp32[k] - w).abs().max() <= WEIGHT_ATOL for k, w in ref["weights"].items())


@AT_LENGTH
@pytest.mark.drill
def test_a_resident_group_across_two_nodes_trains_as_the_torch_engine_and_resumes_after_losing_a_node(
        rollouts, tmp_path, tmp_path_factory):
    """train.mode resident on two nodes of one process each, on this machine: each node runs what sky/train.yaml
    runs on it (`python -m tasks.train` with NNODES/NODE_RANK/MASTER_ADDR/MASTER_PORT), which finds or starts its
    node's part of one torchrun group (ZeRO 3) across both; node 0's stage sends the train request, node 1's waits
    for ckpt-N. The group is kept between iterations 1 and 2 (lean ckpt-N, no full checkpoint before 10). Then
    node 1's processes are SIGKILLed (a lost node): node 0's part ends by itself, and iteration 3's stage on both
    nodes starts a new group, which restores the base model and replays 1-2 (the replay must reproduce the lean
    ckpt-2 bit for bit on a CPU, or the restore fails). The flow's end (`python -m tasks.train finish` on both
    nodes) writes full-3. Every iteration's metrics and full-3's weights equal the uninterrupted torch engine's."""
    import signal
    import time

    from tasks.core.daemon import read_state
    from tasks.core.processes import alive, descendants
    from tasks.engines.detached import _stop, state_dir

    ref = _torch_reference("dr_grpo", rollouts, tmp_path_factory)
    cfg = _config(tmp_path, rollouts, ["train.engine=deepspeed", "train.zero_stage=3",
                                       "train.learner.loss_type=dr_grpo", "train.mode=resident"], iterations=(1, 2, 3))
    config = tmp_path / "config.yaml"
    config.write_text(json.dumps(cfg.model_dump(mode="json")))
    port, paths = str(_free_port()), [state_dir() / f"{RUN}.json", state_dir() / f"{RUN}.node1.json"]

    def on_both(*argv: str) -> list[dict]:
        nodes = [subprocess.Popen([sys.executable, "-m", "tasks.train", *argv, "--config", str(config)], cwd=ROOT,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  env={**os.environ, "NNODES": "2", "NODE_RANK": str(node),
                                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port})
                 for node in (0, 1)]
        outs = [p.communicate(timeout=300) for p in nodes]
        assert [p.returncode for p in nodes] == [0, 0], "\n".join(err[-3000:] for _, err in outs)
        return [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]

    store, metrics = Store.open(cfg.store), []
    try:
        for it in (1, 2):
            got = on_both("--iteration", str(it))
            assert got[0] == got[1]                          # both stages report the committed ckpt-N
            metrics.append(got[0]["metrics"])
            states = [read_state(p) for p in paths]
            assert [(s["node"], s["nodes"], s["processes"]) for s in states] == [(0, 2, 2), (1, 2, 2)]
            if it == 1:
                first = states
        assert [s["pid"] for s in states] == [s["pid"] for s in first]          # one group, kept
        assert store.manifest(layout.full_checkpoint(RUN, 2)) is None

        for pid in [states[1]["pid"], *descendants(states[1]["pid"])]:          # node 1 is lost: torchrun and
            os.kill(pid, signal.SIGKILL)                                         # its worker
        deadline = time.monotonic() + 60
        while alive(states[0]["pid"]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(states[0]["pid"]), "node 0's part outlived the loss of node 1"
        log = paths[0].with_suffix(".log")
        seen = log.stat().st_size
        got = on_both("--iteration", "3")                                        # a new group, by replay
        assert got[0] == got[1]
        metrics.append(got[0]["metrics"])
        assert all(read_state(p)["pid"] not in {s["pid"] for s in states} for p in paths)
        assert "restored the state after iteration 2" in log.read_text()[seen:]
        assert on_both("finish", "--iteration", "0") == [{"finished": 3}, {"finished": 3}]
        assert not any(p.exists() for p in paths)
    finally:
        for p in paths:
            if (state := read_state(p)) is not None:
                _stop(p, state)
    for got, want in zip(metrics, ref["metrics"]):
        for k in METRIC_KEYS:
            assert got[k] == pytest.approx(want[k], **METRIC_TOL), k
    assert [store.manifest(layout.checkpoint(RUN, it))["meta"]["kind"] for it in (1, 2, 3)] == ["lean"] * 3
    state = store.get_json(layout.full_checkpoint(RUN, 3), layout.CKPT_STATE)
    assert (state["nodes"], state["world_size"], state["step"]) == (2, 2, 6)
    fp32 = _fp32_weights(store, 3, tmp_path / "fp32", key=layout.full_checkpoint(RUN, 3))
    for name, want in ref["weights3"].items():
        assert (fp32[name] - want).abs().max() <= WEIGHT_ATOL, name


@pytest.mark.drill
def test_a_resident_group_trains_as_the_torch_engine_and_resumes_after_a_kill(rollouts, tmp_path, tmp_path_factory,
                                                                             monkeypatch):
    """train.mode resident: one torchrun group of two processes (ZeRO 2) trains iterations 1-3 (3 repeats 2's
    data), holding its shards between them: lean ckpt-N (the bf16 policy), a full checkpoint at 2 whose shards
    upload in the background. Its process 0 is SIGKILLed in iteration 3 (trained, nothing written): torchrun
    stops the other, the stage fails; the retry starts a new group, which restores full-2 (or, if its upload
    had not finished, the base model) and replays. Every iteration's update equals the torch engine's; finish
    writes full-3 and the group exits. A user error in the group reaches the stage as one."""
    from tasks.engines.detached import DetachedTrainer

    ref = _torch_reference("dapo", rollouts, tmp_path_factory)
    monkeypatch.setenv("RLFLOW_DRILL", "lean-write:3")
    monkeypatch.setenv("RLFLOW_DRILL_ONCE", str(tmp_path / "drilled"))
    extra = ["train.engine=deepspeed", "train.zero_stage=2", "train.num_processes=2", "train.mode=resident",
             "train.checkpoint_every=2"]
    cfg = _config(tmp_path, rollouts, extra, iterations=(1, 2, 3, 4))
    trainer, store = DetachedTrainer(cfg), Store.open(cfg.store)
    try:
        metrics = [train(cfg, it)["metrics"] for it in (1, 2)]
        first = json.loads(trainer.path.read_text())
        assert first["processes"] == 2
        with pytest.raises(RuntimeError, match="died or went away"):
            train(cfg, 3)
        assert (tmp_path / "drilled").exists() and store.manifest(layout.checkpoint(RUN, 3)) is None
        metrics.append(train(cfg, 3)["metrics"])                     # the retry: a new group, by replay
        assert json.loads(trainer.path.read_text())["pid"] != first["pid"]
        for got, want in zip(metrics, ref["metrics"]):
            for k in METRIC_KEYS:
                assert got[k] == pytest.approx(want[k], **METRIC_TOL), k
        assert store.manifest(layout.checkpoint(RUN, 2))["meta"]["kind"] == "lean"
        assert store.manifest(layout.full_checkpoint(RUN, 2))["meta"]["kind"] == "full"
        assert _finish_trainer(cfg) == 3
    finally:
        DetachedTrainer(cfg).finish()
    assert not trainer.path.exists()
    # A user error inside the group (every process finds full-3 written at another ZeRO stage) reaches the
    # stage as one line, not as a lost trainer.
    other = load_config(TINY, [*COMMON, f"store.uri={tmp_path}/store", *extra, "train.zero_stage=1"])
    try:
        with pytest.raises(UserError, match="train.zero_stage: .* ZeRO stage 2"):
            train(other, 4)
    finally:
        DetachedTrainer(other).finish()
    assert store.manifest(layout.checkpoint(RUN, 4)) is None
    fp32 = _fp32_weights(store, 3, tmp_path / "fp32", key=layout.full_checkpoint(RUN, 3))
    for name, want in ref["weights3"].items():
        assert (fp32[name] - want).abs().max() <= WEIGHT_ATOL, name
    store.get_folder(layout.checkpoint(RUN, 3), tmp_path / "lean")         # the lean policy: those weights, bf16
    with safe_open(tmp_path / "lean" / "model" / "model.safetensors", "pt") as f:
        assert all(torch.equal(f.get_tensor(n), fp32[n].to(torch.bfloat16)) for n in f.keys())


def _finish_trainer(cfg) -> int | None:
    return finish_trainer(cfg)


@AT_LENGTH
def test_bf16_and_optimizer_offload(rollouts, tmp_path, tmp_path_factory, as_worker):
    """What a GPU run uses, here on CPU: bf16 compute with fp32 masters, optimizer states offloaded and
    stepped by DeepSpeedCPUAdam. Close to the fp32 torch engine, not equal (bf16 logits)."""
    ref = _torch_reference("grpo", rollouts, tmp_path_factory)
    cfg = _config(tmp_path, rollouts, ["train.engine=deepspeed", "train.zero_stage=2", "train.learner.loss_type=grpo",
                                       "train.mixed_precision=bf16", "train.offload_optimizer=true"])
    metrics = [train(cfg, it)["metrics"] for it in (1, 2)]
    for got, want in zip(metrics, ref["metrics"]):
        assert got["train/grad_norm"] == pytest.approx(want["train/grad_norm"], rel=0.05)
        assert got["train/entropy"] == pytest.approx(want["train/entropy"], rel=0.01)
    fp32 = _fp32_weights(Store.open(cfg.store), 2, tmp_path / "fp32")
    assert all(t.dtype == torch.float32 for t in fp32.values())               # the masters stay fp32
    base = load_model(base_path(cfg)).state_dict()
    moved = torch.cat([(ref["weights"][k] - base[k]).flatten() for k in base])          # the torch update
    error = torch.cat([(fp32[k] - ref["weights"][k]).flatten() for k in base])
    assert error.norm() < 0.15 * moved.norm()


_value_runs: dict[str, tuple] = {}


def _torch_value_reference(algorithm: str, rollouts: dict, tmp_path_factory) -> tuple[list[dict], dict, dict]:
    """The torch engine with a value head, uninterrupted: metrics of iterations 1-3, the policy's and the
    critic's weights after 3."""
    from safetensors.torch import load_file

    if algorithm not in _value_runs:
        tmp = tmp_path_factory.mktemp(f"torch-{algorithm}")
        cfg = _config(tmp, rollouts, [f"train.algorithm={algorithm}", "train.max_grad_norm=1000"],
                      iterations=(1, 2, 3))
        metrics = [train(cfg, it)["metrics"] for it in (1, 2, 3)]
        Store.open(cfg.store).get_folder(layout.checkpoint(RUN, 3), tmp / "ckpt3")
        _value_runs[algorithm] = (metrics, load_model(str(tmp / "ckpt3" / "model")).state_dict(),
                                  load_file(tmp / "ckpt3" / layout.CKPT_CRITIC))
    return _value_runs[algorithm]


@pytest.mark.drill
@AT_LENGTH                      # (make test keeps the resident group's kill drill without a value head)
def test_a_resident_group_with_a_value_head_resumes_after_a_kill_as_the_torch_engine(rollouts, tmp_path,
                                                                                    tmp_path_factory, monkeypatch):
    """ppo on a resident torchrun group of two (ZeRO 2): killed in iteration 3, the retry's new group restores
    full-2 (shards, the head and its optimizer) and replays; every iteration's metrics and the critic of full-3
    equal the torch engine's."""
    from safetensors.torch import load_file

    from tasks.engines.detached import DetachedTrainer

    want, _, want_critic = _torch_value_reference("ppo", rollouts, tmp_path_factory)
    monkeypatch.setenv("RLFLOW_DRILL", "lean-write:3")
    monkeypatch.setenv("RLFLOW_DRILL_ONCE", str(tmp_path / "drilled"))
    extra = ["train.algorithm=ppo", "train.max_grad_norm=1000", "train.engine=deepspeed", "train.zero_stage=2",
             "train.num_processes=2", "train.mode=resident", "train.checkpoint_every=2"]
    cfg = _config(tmp_path, rollouts, extra, iterations=(1, 2, 3))
    store = Store.open(cfg.store)
    try:
        metrics = [train(cfg, it)["metrics"] for it in (1, 2)]
        with pytest.raises(RuntimeError, match="died or went away"):
            train(cfg, 3)
        metrics.append(train(cfg, 3)["metrics"])
        assert _finish_trainer(cfg) == 3
    finally:
        DetachedTrainer(cfg).finish()
    for got, w in zip(metrics, want):
        for k in [k for k in METRIC_KEYS if k != "train/grad_norm"] + ["train/value_loss", "train/value_mean"]:
            assert got[k] == pytest.approx(w[k], **METRIC_TOL), k
    store.get_folder(layout.full_checkpoint(RUN, 3), tmp_path / "full3")
    critic = load_file(tmp_path / "full3" / layout.CKPT_CRITIC)
    assert all((critic[n] - w).abs().max() <= WEIGHT_ATOL for n, w in want_critic.items())
    assert (tmp_path / "full3" / layout.CKPT_CRITIC_OPTIMIZER).exists()


@AT_LENGTH
@pytest.mark.parametrize("algorithm", ["ppo", "vtrace_awr"])   # (the same head)
def test_a_value_head_on_two_processes_trains_as_the_torch_engine_and_resumes_on_one(
        algorithm, rollouts, tmp_path, tmp_path_factory):
    """train.algorithm ppo / vtrace_awr with the value head outside ZeRO: two processes (ZeRO 2) train
    iterations 1-2 as the torch engine does (policy, critic, their metrics), and iteration 3, resumed on one
    process from their checkpoint (shards re-cut, the head and its optimizer from critic*.{safetensors,pt}),
    equals the torch engine's too. (max_grad_norm out of reach: the torch engine clips policy and critic
    together, DeepSpeed each on its own.)"""
    from safetensors.torch import load_file

    common = [f"train.algorithm={algorithm}", "train.max_grad_norm=1000"]
    want, want_weights, want_critic = _torch_value_reference(algorithm, rollouts, tmp_path_factory)
    extra = [*common, "train.engine=deepspeed", "train.zero_stage=2"]
    cfg = _config(tmp_path, rollouts, [*extra, "train.num_processes=2"], iterations=(1, 2, 3))
    got = [train(cfg, it)["metrics"] for it in (1, 2)]
    resumed = load_config(TINY, [*COMMON, f"store.uri={tmp_path}/store", *extra, "train.num_processes=1"])
    got.append(train(resumed, 3)["metrics"])
    keys = [k for k in METRIC_KEYS if k != "train/grad_norm"] + ["train/value_loss", "train/value_mean"]
    for it, (g, w) in enumerate(zip(got, want), start=1):
        assert set(g) == set(w)
        for k in keys:
            assert g[k] == pytest.approx(w[k], **METRIC_TOL), (it, k)
    store = Store.open(cfg.store)
    fp32 = _fp32_weights(store, 3, tmp_path / "fp32-3")
    # AWR's exp-weights and Adam's normalisation carry the last bits of summation order a little further
    # (measured 1.4e-5 at worst); a lost moment or step count would still be ~lr = 1e-3 away.
    atol = WEIGHT_ATOL * (5 if algorithm == "vtrace_awr" else 1)
    for name, w in want_weights.items():
        assert (fp32[name] - w).abs().max() <= atol, name
    store.get_folder(layout.checkpoint(RUN, 3), tmp_path / "ckpt3")
    critic = load_file(tmp_path / "ckpt3" / layout.CKPT_CRITIC)
    assert set(critic) == set(want_critic)
    for name, w in want_critic.items():
        assert (critic[name] - w).abs().max() <= atol, name
    assert got[1]["train/value_loss"] > 0


@pytest.mark.parametrize("stage", [2, pytest.param(3, marks=AT_LENGTH)])     # (ZeRO-3: make drills; the CI budget)
def test_a_separate_critic_trains_as_the_torch_engine_and_resumes(stage, rollouts, tmp_path, as_worker, monkeypatch):
    """ppo with train.learner.critic separate on the deepspeed engine (refused before issue 41): a trunk of its
    own and a head, the same weights on every process, its AdamW's states sharded over the processes
    (ZeroRedundancyOptimizer). Iterations 1 and 2 (a resume from ckpt-1: critic weights and optimizer state)
    give the torch engine's metrics and critic; at ZeRO 2 iteration 3 resumes on two processes (the optimizer
    state, saved whole, re-cut) and still equals the torch engine's."""
    from safetensors.torch import load_file

    common = ["train.algorithm=ppo", "train.learner.critic=separate", "train.max_grad_norm=1000"]
    ref = _config(tmp_path / "torch", rollouts, common, iterations=(1, 2, 3))
    want = [train(ref, it)["metrics"] for it in (1, 2, 3)]
    Store.open(ref.store).get_folder(layout.checkpoint(RUN, 3), tmp_path / "want3")
    ds = [*common, "train.engine=deepspeed", f"train.zero_stage={stage}"]
    cfg = _config(tmp_path / "ds", rollouts, ds, iterations=(1, 2, 3))
    got = [train(cfg, it)["metrics"] for it in (1, 2)]
    if stage == 2:
        for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            monkeypatch.delenv(var)
        cfg = load_config(TINY, [*COMMON, f"store.uri={tmp_path}/ds/store", *ds, "train.num_processes=2"])
    got.append(train(cfg, 3)["metrics"])
    keys = [k for k in METRIC_KEYS if k != "train/grad_norm"] + ["train/value_loss", "train/value_mean"]
    for it, (g, w) in enumerate(zip(got, want), start=1):
        for k in keys:
            assert g[k] == pytest.approx(w[k], **METRIC_TOL), (it, k)
    assert got[1]["train/value_loss"] > 0
    Store.open(cfg.store).get_folder(layout.checkpoint(RUN, 3), tmp_path / "got3")
    critic, want_critic = (load_file(tmp_path / f / layout.CKPT_CRITIC) for f in ("got3", "want3"))
    assert set(critic) == set(want_critic) and any(k.startswith("trunk.") for k in critic)
    for name, w in want_critic.items():
        assert (critic[name] - w).abs().max() <= WEIGHT_ATOL, name
    base = load_model(base_path(cfg)).state_dict()                     # the trunk learned: it left the base
    assert max(float((critic[k] - base[k.removeprefix("trunk.")]).abs().max()) for k in critic
               if k.startswith("trunk.")) > 1e-4


@pytest.mark.parametrize("stage", [2, pytest.param(3, marks=AT_LENGTH)])     # (ZeRO-3: make drills; the CI budget)
def test_lora_trains_as_the_torch_engine_resumes_and_publishes_the_adapter(stage, rollouts, tmp_path, as_worker,
                                                                           monkeypatch):
    """train.lora_r with the deepspeed engine (refused before issue 41): the base frozen, the adapter trained
    under ZeRO (its fp32 master weights and Adam moments sharded), the KL reference the model with its adapter
    disabled; iteration 2 resumes from ckpt-1's shards, which hold the adapter's state alone. Checkpoints and
    policies are adapter folders, as the torch engine's: the same metrics and the same adapter weights as the
    torch engine's on the same rollouts."""
    from tasks.core.models import load_policy

    lora = ["train.lora_r=4", "train.lora_alpha=8", "publish.dtype=float32"]      # (fp32: compared to 1e-5)
    ref_cfg = _config(tmp_path / "torch", rollouts, lora, iterations=(1, 2, 3))
    want = [train(ref_cfg, it)["metrics"] for it in (1, 2, 3)]
    cfg = _config(tmp_path / "ds", rollouts, [*lora, "train.engine=deepspeed", f"train.zero_stage={stage}"],
                  iterations=(1, 2, 3))
    got = [train(cfg, it)["metrics"] for it in (1, 2)]
    for g, w in zip(got, want):
        for k in METRIC_KEYS:
            assert g[k] == pytest.approx(w[k], **METRIC_TOL), k
    assert got[1]["train/kl_ref"] > 0 and got[1]["train/grad_norm"] > 0.05

    adapters = []
    for c, side in ((ref_cfg, "torch"), (cfg, "ds")):
        store = Store.open(c.store)
        assert {"adapter_config.json", "adapter_model.safetensors"} <= {
            f.rsplit("/", 1)[-1] for f in store.manifest(layout.checkpoint(RUN, 2))["files"]}
        folder = tmp_path / f"published-{side}"
        store.get_folder(publish(c, 2)["key"], folder)
        assert not (folder / "model.safetensors").exists()             # the adapter alone
        with safe_open(folder / "adapter_model.safetensors", "pt") as f:
            adapters.append({k: f.get_tensor(k) for k in f.keys()})
    assert adapters[0].keys() == adapters[1].keys() and any("lora_B" in k for k in adapters[0])
    for name, w in adapters[0].items():
        assert (adapters[1][name] - w).abs().max() <= WEIGHT_ATOL, name
    assert max(float(w.abs().max()) for k, w in adapters[1].items() if "lora_B" in k) > 1e-4     # B moved from 0
    policy = load_policy(cfg, str(tmp_path / "published-ds"), "cpu")                        # as generate loads it
    assert getattr(policy, "peft_config", None)
    # the engine's shards hold the adapter's state (fp32 masters, Adam moments), not the frozen base
    store = Store.open(cfg.store)
    for part in store.get_json(layout.checkpoint(RUN, 2), layout.CKPT_STATE)["engine_state"]:
        store.get_folder(part, tmp_path / "shards")
    states = list((tmp_path / "shards").rglob("*model_states.pt"))
    module = torch.load(states[0], map_location="cpu", weights_only=False)["module"] or {}
    others = [k for k in module if "lora_" not in k]      # (the tiny model's tied lm_head: DeepSpeed keeps shared
    assert states and others in ([], ["base_model.model.lm_head.weight"]), others[:3]      # parameters)

    if stage == 2:      # the adapter's shards of one process resume on two (universal checkpoint conversion)
        for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            monkeypatch.delenv(var)
        two = load_config(TINY, [*COMMON, f"store.uri={tmp_path}/ds/store", *lora, "train.engine=deepspeed",
                                 "train.zero_stage=2", "train.num_processes=2"])
        metrics = train(two, 3)["metrics"]
        for k in METRIC_KEYS:
            assert metrics[k] == pytest.approx(want[2][k], **METRIC_TOL), k
