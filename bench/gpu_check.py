"""GPU check: the SmolLM2 arithmetic recipe's stages on one CUDA GPU, one row each, printed as one markdown table
ready to paste into docs/benchmarks.md (the GPU's name, the date, the torch / transformers / deepspeed versions).

    make gpu-check                      # = python bench/gpu_check.py: CUDA, rows 1-9 (meant for < 10 min on an H100)
    python bench/gpu_check.py --rows 1,3 --out /tmp/gpu-check.md
    python bench/gpu_check.py --device cpu --quick --model builtin:tiny-lm     # the plumbing, on a CPU (~1 min)

The recipe is configs/smollm2-arith.yaml; `--config` names another. What each row measures, through the stage functions
themselves (tasks/generate.py, reward.py, train.py, publish.py), on train.device = --device (generate samples
there too: tasks/core/models.py, device_for):
  1 generate, hf engine, model.dtype bfloat16: tokens/s of the recipe's batch, from the stage's own metric, on
    the second call (the first pays CUDA's start and the model load: reported beside it)
  2 train, torch engine, bfloat16, train.mode process: one train stage: completion tokens/s of its optimiser
    pass, and the peak GPU memory of the stage (torch.cuda.max_memory_allocated; the sampler's model released
    first, so the peak is the trainer's)
  3 train, deepspeed ZeRO-2, train.num_processes 1, mixed_precision bf16: one train stage (the stage starts
    torchrun itself, tasks/engines/deepspeed_engine.py: launch), and the process group's backend read from the
    worker's log: join_group asks for nccl on CUDA, and with NCCL_DEBUG=INFO / TORCH_CPP_LOG_LEVEL=INFO the
    worker's log names ProcessGroupNCCL and the NCCL version (needs CUDA: skipped on a CPU)
  4 train.mode resident, held by this process (train.host caller: what an inline `rlflow run` does): 3 iterations,
    seconds per iteration (all four stages) after the first, which starts the trainer
  5 publish.delta always, publish.dtype bfloat16, anchor_every 10^6: bytes of policy 2 (a delta against policy 1)
    against policy 1 (whole), and policy 2 rebuilt (tasks/core/policy.py: materialize) equal to its checkpoint's
  6 resume: a detached resident trainer (train.host detached, checkpoint_every 2) SIGKILLed after iteration 3;
    iteration 4's train stage starts a new trainer, which restores full-2 and replays 3 (the drill of
    tests/test_resident.py); the time to that first new step, and its weights against an uninterrupted
    process-mode run's (the tests' reference): bit-identical on a CPU; on a GPU, whose kernels are not
    bit-reproducible, closer than RESUME_TOLERANCE of the last update
  7 generate.streaming (issue 42), hf engine, bfloat16: two iterations' groups from the run's streaming
    sampler (continuous batching; S = 1, both from the base model): its tokens/s, every token tagged with its
    version, none discarded (row 9: the same on the vLLM engine, tasks/engines/vllm_stream.py; it needs a CUDA
    vllm in .venv-vllm or generate.vllm_python, and is skipped with that reason in its row when there is none)
  8 configs/browser.yaml's warm start (issue 43): the shop served on 127.0.0.1, the reference policy's episodes of
    16 training tasks recorded, SFT on them (bf16; v0 published), then one RL iteration of the model in headless
    Chromium from v0: the recipe's sizes with --model in place of its Qwen2.5-1.5B (no hub on the device)
Rows 5 and 6 replace the rewards with seeded random numbers after the reward stage (as bench/resident_vs_process.py
does): a group scored alike has zero advantages, and an update that moves no weight would make the delta and
the resume comparison say nothing. Rows 1-3 use model.dtype bfloat16, rows 4-6 the recipe's (float32 unless
it says otherwise: fp32 weights and bf16 policies, publish.dtype auto on a GPU); a GGUF model is converted once
per dtype before the rows (its time is in the header line).

Each row runs on a fresh file store in a temporary folder (tracking on sqlite there, no model registry); a
failure is recorded in its row (FAILED and one line) and the next row runs; the exit code is 1 if any row
FAILED, 2 when --device cuda finds no GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import importlib.metadata
import io
import json
import os
import platform
import re
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")     # (the reward worker is a process of its own)

import torch  # noqa: E402
import yaml  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from tasks.core import layout, rollout  # noqa: E402
from tasks.core.config import load_config  # noqa: E402
from tasks.core.errors import UserError  # noqa: E402
from tasks.core.hashing import sha256_file  # noqa: E402
from tasks.core.models import base_path, context_length  # noqa: E402
from tasks.core.policy import materialize  # noqa: E402
from tasks.core.processes import alive  # noqa: E402
from tasks.core.stage import quiet_progress_bars  # noqa: E402
from tasks.core.store import open_store  # noqa: E402
from tasks.engines import detached, hf  # noqa: E402
from tasks.engines import trainer as held_trainers  # noqa: E402
from tasks.engines.training import newest_full  # noqa: E402
from tasks.generate import generate  # noqa: E402
from tasks.publish import publish  # noqa: E402
from tasks.reward import reward  # noqa: E402
from tasks.train import finish_trainer, train  # noqa: E402

RECIPE = ROOT / "configs" / "smollm2-arith.yaml"
# --quick: the plumbing, not the numbers: 2 prompts x 2 completions x <= 8 tokens, and 64 training prompts made
# instead of 2000 (reasoning-gym makes up to 4x size items: the recipe's 2000 take ~4 s on 2 cores)
QUICK = ["generate.prompts_per_iteration=2", "generate.num_generations=2", "generate.max_completion_length=8",
         "train.micro_batch_size=4"]
QUICK_DATA = ["data.reasoning_gym.size=64", "data.reasoning_gym.eval_size=16"]
BF16 = ["model.dtype=bfloat16"]
ITERATIONS_RESIDENT = 3      # row 4: the first starts the trainer; the mean is over the other two
CHECKPOINT_EVERY = 2         # row 6: full-2 written in the background, lean 3, the trainer killed: iteration 4
KILL_AFTER = 3               # restores full-2 and replays 3, as train.checkpoint_every's default 10 mostly does
# Row 6 on a GPU: a trainer that resumed from the wrong state (an iteration lost or trained twice) ends about one
# whole update away from the uninterrupted run (|Δ| / |last update| ~ 1); kernels that are not bit-reproducible
# (atomics in backward passes) move it by a small fraction of one.
RESUME_TOLERANCE = 0.5


class Skipped(Exception):
    """A row that cannot run here; the message says why."""


# ------------------------------------------------------------------------------------------------ configs

def recipe(args) -> tuple[Path, bool]:
    """The recipe's file, and whether its prompts come from reasoning-gym."""
    try:
        tree = yaml.safe_load(Path(args.config).read_text()) or {}
    except (OSError, yaml.YAMLError):
        tree = {}                       # (load_config says what is wrong with it, in one line)
    data = tree.get("data") if isinstance(tree, dict) else None
    return Path(args.config), isinstance(data, dict) and "reasoning_gym" in data


def config(args, work: Path, run: str, extra: list[str] = ()):
    """The recipe for one row: its own run name, a file store and sqlite tracking under `work`, --model,
    --device, --quick's sizes, then the row's overrides."""
    path, procedural = recipe(args)
    overrides = [f"run.name=gpu-check-{run}", f"store.uri=file://{work}/store",
                 f"tracking.uri=sqlite:///{work}/mlflow.db", "publish.register_model=false",
                 f"model.name_or_path={args.model}", f"train.device={args.device}"]
    if args.quick:
        overrides += QUICK + (QUICK_DATA if procedural else [])
    return load_config(path, [*overrides, *extra])


# ------------------------------------------------------------------------------------------------ helpers

def iteration(cfg, it: int, random_rewards: bool = False) -> dict[str, float]:
    """The four stages of iteration `it`; seconds of each."""
    seconds, t0 = {}, time.perf_counter()
    generate(cfg, it)
    seconds["generate"], t0 = time.perf_counter() - t0, time.perf_counter()
    reward(cfg, it)
    if random_rewards:
        randomise_rewards(cfg, it)
    seconds["reward"], t0 = time.perf_counter() - t0, time.perf_counter()
    train(cfg, it)
    seconds["train"], t0 = time.perf_counter() - t0, time.perf_counter()
    publish(cfg, it)
    seconds["publish"] = time.perf_counter() - t0
    return seconds


def randomise_rewards(cfg, it: int) -> None:
    """Seeded random rewards in place of the reward stage's (the same in every run: seeded by the iteration), the
    rewards folder rewritten with its manifest's meta, as tests/test_resident.py rewrites one."""
    store, key = open_store(cfg), layout.rewards(cfg.run.name, it)
    manifest, records = store.manifest(key), rollout.load(store, key)
    g = torch.Generator().manual_seed(it)
    for r in records:
        r.reward = float(torch.rand((), generator=g))
    with tempfile.TemporaryDirectory(prefix="rlflow-gpu-check-") as tmp:
        rollout.write(records, Path(tmp))
        store.delete_folder(key)
        store.put_folder(key, Path(tmp), meta=manifest["meta"])


def train_tokens(metrics: dict, cfg) -> int:
    """Completion tokens of the update (the loss's tokens): train/tokens_per_s times train/seconds, per pass."""
    return round(metrics["train/tokens_per_s"] * metrics["train/seconds"] / cfg.train.num_iterations)


def release() -> None:
    """The sampler's resident model (tasks/engines/hf.py keeps the last one per process) and the CUDA cache: each
    row starts with nothing of an earlier one on the GPU."""
    hf.RESIDENT.release()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def stop_trainers(cfg) -> None:
    """What a failed row may leave: a trainer held here (train.host caller) or a detached one of its run."""
    with contextlib.suppress(Exception):
        held = held_trainers._HELD.pop(cfg.run.name, None)
        if held is not None:
            held[1].close()
    path = detached.state_dir() / f"{cfg.run.name}.json"
    with contextlib.suppress(OSError, ValueError):
        detached._stop(path, json.loads(path.read_text()))


@contextlib.contextmanager
def environ(**values: str):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class _Tee(io.TextIOBase):
    """stderr as it was, and a copy kept (the deepspeed stage prints its workers' lines there)."""

    def __init__(self, out):
        self.out, self.kept = out, io.StringIO()

    def write(self, s: str) -> int:
        self.kept.write(s)
        return self.out.write(s)

    def flush(self) -> None:
        self.out.flush()


def exact_weights(store, key: str) -> dict[str, torch.Tensor]:
    """A full checkpoint's trainer weights: weights.safetensors where the policy is in another dtype, else the
    model folder's (tasks/engines/torch_engine.py: _write_full)."""
    folder = store.local(key)
    files = ([folder / layout.CKPT_WEIGHTS] if (folder / layout.CKPT_WEIGHTS).exists()
             else sorted((folder / layout.CKPT_MODEL).glob("*.safetensors")))
    weights = {}
    for f in files:
        weights.update(load_file(f))
    return weights


def distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """The L2 norm of a - b over every tensor both hold, in float64."""
    return sum(float((a[k].double() - b[k].double()).square().sum()) for k in a.keys() & b.keys()) ** 0.5


def folder_bytes(manifest: dict) -> int:
    return sum(f["size"] for f in manifest["files"].values())


def rate(x: float) -> str:
    """Thousands separated; a CPU's few tokens/s with 3 significant digits."""
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def mb(n: float) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


# ------------------------------------------------------------------------------------------------ the rows

def row_generate(args, work: Path) -> str:
    cold = config(args, work, "generate-cold", [*BF16, "generate.engine=hf"])
    cfg = config(args, work, "generate", [*BF16, "generate.engine=hf"])
    t0 = time.perf_counter()
    first = generate(cold, 1)["metrics"]
    first_s = time.perf_counter() - t0
    m = generate(cfg, 1)["metrics"]          # the same prompts and seed, the model kept: sampling alone
    g = cfg.generate
    n = g.prompts_per_iteration * g.num_generations
    return (f"**{rate(m['generate/tokens_per_s'])} tokens/s** ({g.prompts_per_iteration} prompts x "
            f"{g.num_generations} x ≤{g.max_completion_length} tokens: {m['generate/completion_length'] * n:.0f} "
            f"sampled in {m['generate/sampling_seconds']:.2f} s); first call {first_s:.1f} s (model load "
            f"{first['generate/load_seconds']:.1f} s)")


def row_torch(args, work: Path) -> str:
    cfg = config(args, work, "torch", [*BF16, "train.engine=torch", "train.mode=process"])
    generate(cfg, 1)
    reward(cfg, 1)
    release()
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    m = train(cfg, 1)["metrics"]
    stage = time.perf_counter() - t0
    tokens = train_tokens(m, cfg)
    memory = (f"; peak GPU memory **{torch.cuda.max_memory_allocated() / 2**30:.2f} GiB**" if cuda
              else "; no GPU memory (CPU)")
    return (f"**{rate(tokens / m['train/update_seconds'])} train tokens/s** ({tokens} completion tokens, one pass "
            f"in {m['train/update_seconds']:.2f} s; the stage {stage:.1f} s with model load and full "
            f"checkpoint){memory}")


def row_deepspeed(args, work: Path) -> str:
    if args.device != "cuda":
        raise Skipped("no CUDA: NCCL needs a GPU" if not torch.cuda.is_available() else "--device cpu")
    cfg = config(args, work, "deepspeed", [*BF16, "train.engine=deepspeed", "train.zero_stage=2",
                                           "train.num_processes=1", "train.mixed_precision=bf16",
                                           "train.mode=process"])
    generate(cfg, 1)
    reward(cfg, 1)
    release()
    # The stage passes its environment to torchrun (DeepSpeedEngine.torchrun) and prints the workers' lines on
    # stderr. TORCH_CPP_LOG_LEVEL=INFO: c10d logs "ProcessGroupNCCL initialization options" when the group is
    # made; NCCL_DEBUG=INFO (INIT only: ~20 lines): NCCL prints its version when its first collective runs.
    tee = _Tee(sys.stderr)
    t0 = time.perf_counter()
    with environ(NCCL_DEBUG="INFO", NCCL_DEBUG_SUBSYS="INIT", TORCH_CPP_LOG_LEVEL="INFO"), \
            contextlib.redirect_stderr(tee):
        m = train(cfg, 1)["metrics"]
    stage = time.perf_counter() - t0
    log = tee.kept.getvalue()
    version = re.search(r"NCCL version ([\w.+-]+)", log)
    evidence = [what for what, found in (("ProcessGroupNCCL", "ProcessGroupNCCL" in log),
                                         (f"NCCL {version.group(1)}" if version else "", version is not None),
                                         ("NCCL INFO lines", version is None and " NCCL INFO " in log))
                if found]
    if not evidence:
        gloo = "ProcessGroupGloo" in log or "gloo" in log.lower()
        raise RuntimeError("the worker's log names no NCCL process group" + (" (it names gloo)" if gloo else "")
                           + "; expected nccl on CUDA (tasks/engines/deepspeed_engine.py: join_group)")
    tokens = train_tokens(m, cfg)
    return (f"**{rate(tokens / m['train/update_seconds'])} train tokens/s** ({tokens} completion tokens, one pass "
            f"in {m['train/update_seconds']:.2f} s; the stage {stage:.1f} s with torchrun, model load and "
            f"checkpoint); backend **nccl** (worker log: {', '.join(evidence)})")


def row_resident(args, work: Path) -> str:
    cfg = config(args, work, "resident", ["train.mode=resident", "train.host=caller"])
    try:
        seconds = [iteration(cfg, it) for it in range(1, ITERATIONS_RESIDENT + 1)]
        finish_trainer(cfg)                                        # as the flow does when it ends
    finally:
        stop_trainers(cfg)
    later = seconds[1:]
    per_iteration = sum(sum(s.values()) for s in later) / len(later)
    training = sum(s["train"] for s in later) / len(later)
    return (f"**{per_iteration:.2f} s/iteration** after the first (train stage {training:.2f} s of it; "
            f"the first {sum(seconds[0].values()):.1f} s, trainer start and model load included)")


def row_delta(args, work: Path) -> str:
    cfg = config(args, work, "delta", ["train.mode=process", "publish.delta=always", "publish.dtype=bfloat16",
                                       "publish.anchor_every=1000000"])
    iteration(cfg, 1, random_rewards=True)
    seconds = iteration(cfg, 2, random_rewards=True)["publish"]
    store, run = open_store(cfg), cfg.run.name
    whole = folder_bytes(store.manifest(layout.policy(run, 1)))
    second = store.manifest(layout.policy(run, 2))
    rebuilt = materialize(store, layout.policy(run, 2))       # rebuilt whole, every tensor's checksum checked
    ckpt = store.manifest(layout.checkpoint(run, 2))["files"]
    for rel in sorted(p.name for p in rebuilt.glob("*.safetensors")):
        if sha256_file(rebuilt / rel) != ckpt[f"{layout.CKPT_MODEL}/{rel}"]["sha256"]:
            raise RuntimeError(f"policy 2 rebuilt from its delta differs from its checkpoint's {rel}")
    if "anchor" not in second["meta"]:
        return (f"policy 2 published whole ({mb(folder_bytes(second))}): a delta would not have been smaller "
                f"than policy 1's {mb(whole)}")
    delta = folder_bytes(second)
    return (f"delta **{mb(delta)}** vs whole **{mb(whole)}** (**{delta / whole:.1%}**; publish "
            f"{seconds:.2f} s); rebuilt = the checkpoint's weights")


def row_resume(args, work: Path) -> str:
    ref = config(args, work, "resume-reference", ["train.mode=process"])
    cfg = config(args, work, "resume", ["train.mode=resident", "train.host=detached",
                                        f"train.checkpoint_every={CHECKPOINT_EVERY}"])
    run, after, full_at = cfg.run.name, KILL_AFTER + 1, KILL_AFTER - KILL_AFTER % CHECKPOINT_EVERY
    try:
        for it in range(1, after + 1):                            # uninterrupted: a full checkpoint every time
            iteration(ref, it, random_rewards=True)
        for it in range(1, KILL_AFTER + 1):
            iteration(cfg, it, random_rewards=True)
        store = open_store(cfg)
        deadline = time.monotonic() + 300
        while store.manifest(layout.full_checkpoint(run, full_at)) is None:     # written in the background
            if time.monotonic() > deadline:
                raise RuntimeError(f"the resident trainer's full checkpoint of iteration {full_at} never appeared")
            time.sleep(0.2)
        pid = json.loads((detached.state_dir() / f"{run}.json").read_text())["pid"]
        log = detached.state_dir() / f"{run}.log"
        seen = log.stat().st_size if log.exists() else 0       # (a cache kept across runs keeps its log)
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while alive(pid):
            if time.monotonic() > deadline:
                raise RuntimeError(f"the resident trainer (pid {pid}) outlived SIGKILL for 30 s")
            time.sleep(0.05)
        generate(cfg, after)
        reward(cfg, after)
        randomise_rewards(cfg, after)
        restored_from = newest_full(store, run, KILL_AFTER)[1]
        t0 = time.perf_counter()
        m = train(cfg, after)["metrics"]
        first_step = time.perf_counter() - t0
        publish(cfg, after)
        finish_trainer(cfg)                                        # full-4: the resumed trainer's exact weights
    finally:
        stop_trainers(cfg)
    replay_exact = b"reproduced other weights" not in (log.read_bytes()[seen:] if log.exists() else b"")
    mine = exact_weights(store, layout.full_checkpoint(run, after))
    theirs = exact_weights(store, layout.checkpoint(ref.run.name, after))
    before = exact_weights(store, layout.checkpoint(ref.run.name, KILL_AFTER))
    if mine.keys() != theirs.keys():
        raise RuntimeError(f"the resumed trainer's checkpoint holds other tensors: "
                           f"{sorted(mine.keys() ^ theirs.keys())[:3]}")
    timing = (f"first new step **{first_step:.1f} s** (a new trainer: full-{restored_from} restored, "
              f"{KILL_AFTER - restored_from} iteration(s) replayed, {m.get('train/restore_seconds', 0.0):.1f} s)")
    if all(torch.equal(mine[k], theirs[k]) for k in mine):
        return f"{timing}; weights after {after} **bit-identical** to the uninterrupted run's"
    update = distance(theirs, before)
    if update == 0:
        raise RuntimeError(f"iteration {after} moved no weight, so the comparison says nothing")
    ratio = distance(mine, theirs) / update
    sampled = [store.manifest(layout.rollouts(c.run.name, after))["files"][rollout.FILE]["sha256"] for c in (cfg, ref)]
    said = (f"weights after {after} differ from the uninterrupted run's by {ratio:.2g} of its last update"
            f"{'' if replay_exact else f'; the replay of {KILL_AFTER} was not bit-exact either'}"
            f"{'' if sampled[0] == sampled[1] else f'; iteration {after} sampled other completions'}")
    if args.device == "cpu":
        raise RuntimeError(said + ": on a CPU a resume is bit-identical")
    if ratio >= RESUME_TOLERANCE:
        raise RuntimeError(said + f" (>= {RESUME_TOLERANCE}: an iteration lost or repeated?)")
    return f"{timing}; {said} (< {RESUME_TOLERANCE})"


def row_streaming(args, work: Path, engine: str = "hf") -> str:
    """generate.streaming on the device: two iterations' groups (S = 1: both from the base model) from the run's
    streaming sampler (`engine`'s decoder), its tokens/s since it started, each token tagged with its version,
    none discarded."""
    from tasks.engines.streaming import Stream

    cfg = config(args, work, f"streaming-{engine}", [*BF16, f"generate.engine={engine}", "run.max_staleness=1",
                                                     "run.iterations=2", "generate.streaming.on_update=interrupt"])
    if engine == "vllm":
        from tasks.engines.vllm_offline import NoVllm, installed_python

        try:
            installed_python(cfg)
        except NoVllm as e:                 # (a machine without vLLM: no measurement, not a failure of the check)
            raise Skipped(str(e)) from None
    try:
        metrics = [generate(cfg, it)["metrics"] for it in (1, 2)]
    finally:
        dropped = Stream.stop_run(cfg.run.name)
    store = open_store(cfg)
    records = [r for it in (1, 2) for r in rollout.load(store, layout.rollouts(cfg.run.name, it))]
    if any(r.versions is None or len(r.versions) != len(r.completion_ids) or set(r.versions) != {0}
           for r in records):
        raise RuntimeError("a streamed completion's tokens are not each tagged with version 0 (the base model)")
    m = metrics[-1]
    return (f"**{rate(m['generate/tokens_per_s'])} tokens/s** streamed ({len(records)} completions of 2 iterations, "
            f"{sum(len(r.completion_ids) for r in records)} tokens, {sum(x['generate/refills'] for x in metrics):.0f} "
            f"refills); every token tagged with its version; discarded {m['generate/discarded_tokens'] + dropped:.0f}")


def row_browser(args, work: Path) -> str:
    """configs/browser.yaml's warm start on the device (issue 43): the shop served here, the reference policy's
    episodes of the first training tasks recorded, SFT on them (bf16, v0 published), then one RL iteration of the
    model in Chromium from v0. --model replaces the recipe's Qwen2.5-1.5B (the hub, where reachable)."""
    from flows.warmup import overrides_after
    from tasks.envs.builtin.webshop import serve
    from tasks.envs.runtime.demonstrations import record, write
    from tasks.sft import sft

    sizes = (["env.kwargs.max_chars=900", "env.max_turns=3", "env.max_tokens=4000", "generate.max_prompt_length=2000",
              "generate.max_completion_length=40", "warmup.batch_size=2", "warmup.epochs=1"] if args.quick else
             ["env.max_tokens=6000"])             # (SmolLM2's context is 8192; Qwen's would take the recipe's)
    with serve() as url:
        path = ROOT / "configs" / "browser.yaml"
        common = [f"store.uri=file://{work}/store", f"tracking.uri=sqlite:///{work}/mlflow.db",
                  "publish.register_model=false", f"model.name_or_path={args.model}", f"train.device={args.device}",
                  f"env.kwargs.base_url={url}", f"warmup.path={work / 'demos.jsonl'}", "run.name=gpu-check-browser",
                  *BF16, *(QUICK if args.quick else []), *sizes]
        cfg = load_config(path, common)
        if (n := context_length(base_path(cfg))) is not None and n < 2048:
            raise Skipped(f"{args.model}'s context ({n} tokens) holds no shop demonstration")
        t0 = time.perf_counter()
        kept, episodes, _ = record(cfg, "tasks.envs.builtin.webshop:reference_action",
                                   rows=list(range(2 if args.quick else 16)))
        if not kept:
            raise RuntimeError(f"no demonstration recorded ({len(episodes)} episodes)")
        write(kept, work / "demos.jsonl")
        recorded, t0 = time.perf_counter() - t0, time.perf_counter()
        v0 = sft(cfg)
        m, sft_s = v0["metrics"], time.perf_counter() - t0
        rl = load_config(path, [*common, *overrides_after(v0)])
        seconds = iteration(rl, 1)
    g = open_store(rl).manifest(layout.rollouts(rl.run.name, 1))["meta"]["metrics"]
    if g["env/errors"]:
        raise RuntimeError(f"{g['env/errors']:.0f} of {g['env/episodes']:.0f} episodes failed in the environment")
    return (f"{len(kept)} demonstrations recorded in {recorded:.1f} s; **SFT {m['sft/steps']:.0f} steps in "
            f"{sft_s:.1f} s** (loss {m['sft/loss']:.3f}); RL iteration 1 from v0: {g['env/episodes']:.0f} episodes "
            f"in Chromium, {g['env/turns_mean']:.1f} turns each, generate {seconds['generate']:.1f} s, train "
            f"{seconds['train']:.1f} s")


ROWS = {
    1: ("generate: hf engine, bf16", row_generate),
    2: ("train: torch engine, bf16, process mode", row_torch),
    3: ("train: DeepSpeed ZeRO-2, 1 process, bf16, NCCL", row_deepspeed),
    4: (f"train: resident trainer, {ITERATIONS_RESIDENT} iterations", row_resident),
    5: ("publish: bf16 delta vs whole", row_delta),
    6: (f"resume: resident trainer SIGKILLed after iteration {KILL_AFTER}", row_resume),
    7: ("generate.streaming: hf engine, bf16, continuous batching", row_streaming),
    8: ("browser.yaml: warm start (SFT) then RL in Chromium, bf16", row_browser),
    9: ("generate.streaming: vLLM engine, bf16, the batch's rows as running requests",
        lambda args, work: row_streaming(args, work, "vllm")),
}


# ------------------------------------------------------------------------------------------------ the table

def one_line(e: BaseException) -> str:
    """The first line of an error (a UserError's is its whole message, naming the field), for a table cell."""
    text = (str(e).strip().splitlines() or [""])[0]
    if not isinstance(e, UserError):
        text = f"{type(e).__name__}: {text}" if text else type(e).__name__
    return (text[:240] + "…" if len(text) > 240 else text).replace("|", "\\|")


def run_row(number: int, args, top: Path) -> dict:
    name, fn = ROWS[number]
    print(f"gpu_check: row {number}: {name} ...", file=sys.stderr, flush=True)
    work = Path(tempfile.mkdtemp(prefix=f"row{number}-", dir=top))
    release()
    t0 = time.perf_counter()
    try:
        status, result = "ok", fn(args, work)
    except Skipped as e:
        status, result = f"skipped ({e})", ""
    except Exception as e:  # noqa: BLE001 - recorded in its row; the next row runs
        import traceback

        traceback.print_exc()
        status, result = f"**FAILED**: {one_line(e)}", ""
    seconds = time.perf_counter() - t0
    row = {"number": number, "name": name, "status": status, "seconds": seconds, "result": result}
    # The row's table line as soon as it is known: a run stopped before the table (a timeout) keeps its rows
    print(f"gpu_check: row {number}: {status} in {seconds:.1f} s\n{table_line(row)}", file=sys.stderr, flush=True)
    shutil.rmtree(work, ignore_errors=True)
    return row


def prepare_model(args, top: Path) -> str:
    """Convert (GGUF) or build the model once per dtype the rows use, timed: the rows then find it in the cache."""
    dtypes = []
    if {1, 2, 3, 7, 8} & set(args.rows):
        dtypes.append("bfloat16")
    if {4, 5, 6} & set(args.rows):
        dtypes.append(config(args, top / "prepare", "prepare").model.dtype)
    said = []
    for dtype in dict.fromkeys(dtypes):
        t0 = time.perf_counter()
        try:
            base_path(config(args, top / "prepare", "prepare", [f"model.dtype={dtype}"]))
            said.append(f"{dtype} {time.perf_counter() - t0:.1f} s")
        except Exception as e:  # noqa: BLE001 - every row then fails on its own, with its reason
            said.append(f"{dtype} FAILED: {one_line(e)}")
    return ", ".join(said)


def machine(args) -> str:
    def version(package: str) -> str:
        try:
            return importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    if args.device == "cuda":
        where = f"{torch.cuda.get_device_name(0)} ({torch.cuda.device_count()} visible), CUDA {torch.version.cuda}"
    else:
        where = f"CPU only (--device cpu), {platform.machine()}"
    return (f"{where}, {os.cpu_count()} cores; Python {platform.python_version()}, torch {torch.__version__}, "
            f"transformers {version('transformers')}, deepspeed {version('deepspeed')}")


def table(args, cfg, rows: list[dict], model_line: str, command: str) -> str:
    g = cfg.generate
    source = os.path.relpath(args.config, ROOT)
    lines = [
        "## GPU check — `bench/gpu_check.py`", "",
        f"Machine: {machine(args)}. Date: {datetime.date.today().isoformat()}.",
        f"Recipe: {source}: {g.prompts_per_iteration} prompts x {g.num_generations} completions x "
        f"≤{g.max_completion_length} tokens, lr {cfg.train.lr:g}; model {args.model}, made ready (converted or "
        f"built) in: {model_line}. Command: `{command}`.", "",
        "| # | check | status | seconds | result |",
        "|---|---|---|---:|---|",
    ]
    lines.extend(table_line(r) for r in rows)
    return "\n".join(lines) + "\n"


def table_line(r: dict) -> str:
    return f"| {r['number']} | {r['name']} | {r['status']} | {r['seconds']:.1f} | {r['result']} |"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,3,4,5,6,7,8,9", help="which rows, e.g. 1,3 (default: all nine)")
    ap.add_argument("--model", default="builtin:smollm2-135m", help="model.name_or_path for every row")
    ap.add_argument("--config", default=str(RECIPE), help="the recipe (default: configs/smollm2-arith.yaml)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--quick", action="store_true", help="tiny batches: the plumbing, not the numbers")
    ap.add_argument("--out", default=None, help="also write the table to this file")
    args = ap.parse_args(argv)
    try:
        args.rows = sorted({int(n) for n in args.rows.split(",") if n.strip()})
    except ValueError:
        ap.error(f"--rows: expected numbers such as 1,3, got {args.rows!r}")
    if not args.rows or not set(args.rows) <= ROWS.keys():
        ap.error(f"--rows: expected numbers from 1 to {len(ROWS)}, got {args.rows}")
    if args.device == "cuda" and not torch.cuda.is_available():
        print(f"gpu_check: no CUDA device here (torch {torch.__version__}, built for CUDA {torch.version.cuda}); "
              f"run it on a GPU machine, or with --device cpu --quick to check the plumbing", file=sys.stderr)
        return 2
    command = " ".join(["python bench/gpu_check.py", *(argv if argv is not None else sys.argv[1:])])
    try:
        config(args, Path(tempfile.gettempdir()), "check")       # validated only: nothing is written
    except UserError as e:
        print(f"gpu_check: {e}", file=sys.stderr)
        return 2
    quiet_progress_bars()                   # (transformers' loading / writing bars: a screen of them per row)
    top = Path(tempfile.mkdtemp(prefix="rlflow-gpu-check-"))
    # The local cache (converted models, resident trainers' state files): the caller's when set (the tests'),
    # else a fresh one, so the conversion is timed as a new GPU machine pays it.
    os.environ.setdefault("RLFLOW_CACHE", str(top / "cache"))
    try:
        model_line = prepare_model(args, top)
        rows = [run_row(n, args, top) for n in args.rows]
        text = table(args, config(args, top, "table"), rows, model_line, command)
    finally:
        shutil.rmtree(top, ignore_errors=True)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 1 if any(r["status"].startswith("**FAILED**") for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
