"""A real model side by side with TRL: SmolLM2-135M-Instruct learning configs/smollm2-arith.yaml's task through rlflow
(the flow, as a user runs it) and through TRL's GRPOTrainer, with the same model file, data, rewards,
hyper-parameters and seeds, on this machine.

    python bench/real_model_vs_trl.py                         # 3 seeds each side, then the table
    python bench/real_model_vs_trl.py --seeds 0 --sides rlflow --iterations 8
    python bench/real_model_vs_trl.py --levers                # seconds per iteration, each lever of rlflow's on/off

Equal on both sides: the model folder (builtin:smollm2-135m's GGUF, converted once by tasks/core/gguf.py), the
training prompts (the recipe's reasoning-gym train split, chat messages) and their order's seed, the rewards
(the recipe's reward.functions and weights: today answer_reward 1.0, format_reward 0.0, logged only; the
2026-11-26 table in docs/benchmarks.md was measured when format_reward weighed 0.2; called by TRL with its own
calling convention), prompts x completions per step, max completion tokens, temperature, AdamW lr / betas / no weight
decay / clip 1.0, constant schedule, loss dapo, beta 0, scale_rewards group, one optimiser step per batch.
- rlflow: `rlflow run configs/smollm2-arith.yaml -o run.seed=S` in a subprocess (store, MLflow and a Prefect API of
  its own, in a temporary folder); its per-iteration `iteration/seconds` minus `time/evaluate_seconds` (MLflow).
- TRL: `GRPOTrainer(...).train()` in this process; the clock starts before the trainer is built (it loads the
  model there, as rlflow's first iteration does) and stops while held-out accuracy is measured.
Held-out accuracy is measured the same way on both sides, at the recipe's eval.every and on the base model: greedy
completions of the recipe's held-out prompts by rlflow's hf sampler (tasks/engines/hf.py: hf_generate, temperature
0), a pass when answer_reward is 1.0. rlflow's come from its own evaluate stage (eval/greedy_pass_at_1); TRL's
model is evaluated in a callback, off the clock.

Printed: wall seconds per iteration (mean over iterations 2..N and seeds), held-out accuracy at each evaluation
with the training clock at that point (mean over seeds), and the time to a stated held-out accuracy
(--threshold: the first evaluation at or above it). Writes <out>/real_model_vs_trl.csv and .png. `--levers`
instead runs a few iterations of rlflow with each of its speed levers turned off in turn (and TRL), evaluation
off, and prints seconds per iteration: what each lever contributes.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.work import keep_option, work_folder  # noqa: E402

CONFIG = ROOT / "configs" / "smollm2-arith.yaml"
ACCURACY = "eval/greedy_pass_at_1"


def rlflow_run(config: Path, seed: int, iterations: int, work: Path, overrides: list[str],
               name: str) -> dict:
    """One `rlflow run` in a subprocess; its per-iteration seconds (evaluation excluded) and held-out accuracy."""
    from mlflow.tracking import MlflowClient

    folder = work / name
    folder.mkdir(parents=True, exist_ok=True)
    db = f"sqlite:///{folder}/mlflow.db"
    rlflow = ROOT / ".venv" / "bin" / "rlflow"
    sets = [f"run.name={name}", f"run.seed={seed}", f"run.iterations={iterations}", f"store.uri={folder}/store",
            f"tracking.uri={db}", *overrides]
    argv = [str(rlflow) if rlflow.exists() else "rlflow", "run", str(config), *sum((["-o", o] for o in sets), []),
            "--summary-json", str(folder / "summary.json")]
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}     # (a temporary API of its own)
    t0 = time.perf_counter()
    done = subprocess.run(argv, cwd=folder, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"rlflow run failed ({done.returncode}):\n{done.stderr[-3000:]}")
    client = MlflowClient(tracking_uri=db)
    run_id = json.loads((folder / "summary.json").read_text())["mlflow_run_id"]

    def history(key: str) -> dict[int, float]:
        return {m.step: m.value for m in client.get_metric_history(run_id, key)}

    total, evals = history("iteration/seconds"), history("time/evaluate_seconds")
    seconds = [total[it] - evals.get(it, 0.0) for it in range(1, iterations + 1)]
    return {"seconds": seconds, "accuracy": history(ACCURACY), "process_seconds": time.perf_counter() - t0,
            "stage_seconds": {k: [history(f"time/{k}_seconds").get(it, 0.0) for it in range(1, iterations + 1)]
                              for k in ("generate", "reward", "train", "publish")}}


def trl_run(config: Path, seed: int, iterations: int, work: Path, evaluate: bool = True) -> dict:
    """GRPOTrainer on the recipe's data and rewards; per-step seconds (evaluation off the clock) and held-out
    accuracy at the recipe's eval.every (and of the base model)."""
    from transformers.trainer_callback import PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from tasks.core import data
    from tasks.core.config import load_config
    from tasks.core.models import base_path
    from tasks.rewards.reasoning_gym import answer_reward, format_reward

    cfg = load_config(config, [f"run.seed={seed}"])
    g, t = cfg.generate, cfg.train
    by_name = {"answer_reward": answer_reward, "format_reward": format_reward}
    funcs = [by_name[f.fn.split(":")[1]] for f in cfg.reward.functions]
    held_out = data.load_prompts(cfg, split="eval")
    train_rows = data.load_prompts(cfg)
    args = GRPOConfig(output_dir=str(work / f"trl-{seed}"), use_cpu=True, bf16=False, seed=seed, data_seed=seed,
                      per_device_train_batch_size=g.prompts_per_iteration * g.num_generations,
                      num_generations=g.num_generations, max_completion_length=g.max_completion_length,
                      temperature=g.temperature, top_p=g.top_p, learning_rate=t.lr, lr_scheduler_type="constant",
                      warmup_steps=0, weight_decay=t.weight_decay, adam_beta1=t.adam_betas[0],
                      adam_beta2=t.adam_betas[1], max_grad_norm=t.max_grad_norm, beta=t.beta,
                      loss_type=t.learner.loss_type, scale_rewards=t.learner.scale_rewards,
                      epsilon=t.learner.epsilon, num_iterations=t.num_iterations,
                      mask_truncated_completions=t.mask_truncated_completions,
                      reward_weights=[f.weight for f in cfg.reward.functions], max_steps=iterations, logging_steps=1,
                      report_to=[], save_strategy="no", disable_tqdm=True)
    clock = {"start": time.perf_counter(), "paused": 0.0, "marks": []}
    accuracy: dict[int, float] = {}

    def measure(model, tokenizer, step: int) -> None:
        t0 = time.perf_counter()
        accuracy[step] = held_out_accuracy(cfg, model, tokenizer, held_out)
        clock["paused"] += time.perf_counter() - t0

    trainer = GRPOTrainer(model=base_path(cfg), args=args, reward_funcs=funcs, train_dataset=train_rows)

    class Clock(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            if evaluate:
                measure(trainer.model, trainer.processing_class, 0)

        def on_step_end(self, args, state, control, **kwargs):
            clock["marks"].append(time.perf_counter() - clock["start"] - clock["paused"])
            if evaluate and cfg.eval.every and (state.global_step % cfg.eval.every == 0
                                                or state.global_step == iterations):
                measure(trainer.model, trainer.processing_class, state.global_step)

    trainer.remove_callback(PrinterCallback)
    trainer.add_callback(Clock())
    trainer.train()
    marks = clock["marks"]
    return {"seconds": [b - a for a, b in zip([0.0, *marks[:-1]], marks)], "accuracy": accuracy}


def held_out_accuracy(cfg, model, tokenizer, held_out) -> float:
    """What rlflow's evaluate stage measures (eval/greedy_pass_at_1), for a model in memory: greedy completions of
    the first eval.max_prompts held-out prompts by rlflow's hf sampler, passed when answer_reward is 1.0."""
    import torch

    from tasks.core.contracts import SamplingParams
    from tasks.core.models import encode_prompt
    from tasks.engines.hf import hf_generate
    from tasks.rewards.reasoning_gym import answer_reward

    rows = [held_out[i] for i in range(min(cfg.eval.max_prompts, len(held_out)))]
    prompts = [encode_prompt(tokenizer, r[cfg.data.prompt_column], cfg.generate.max_prompt_length) for r in rows]
    was_training = model.training
    model.eval()
    with torch.no_grad():
        samples = hf_generate(model, tokenizer, prompts, SamplingParams(
            n=1, max_new_tokens=cfg.generate.max_completion_length, temperature=0.0, top_p=1.0, seed=0),
            cfg.generate.batch_size)
    model.train(was_training)
    texts = [tokenizer.decode(s.completion_ids, skip_special_tokens=True) for s in samples]
    columns = {k: [r[k] for r in rows] for k in ("answer", "question", "metadata", "reasoning_gym", "answer_format")}
    return sum(s >= cfg.eval.pass_threshold for s in answer_reward(texts, **columns)) / len(rows)


def _steady(seconds: list[float]) -> float:
    return statistics.fmean(seconds[1:] if len(seconds) > 1 else seconds)


def levers(config: Path, iterations: int, work: Path, only: list[str] | None = None) -> None:
    """Seconds per iteration of rlflow with each speed lever off in turn, and of TRL: evaluation off, seed 0."""
    off = ["eval.every=0", "publish.register_model=false"]
    variants = {
        "rlflow (the recipe)": [],
        "each prompt run per completion when sampling (generate.share_prompts=false)":
            ["generate.share_prompts=false"],
        "... and when training (train.share_prompts=false)": ["generate.share_prompts=false",
                                                              "train.share_prompts=false"],
        "a trainer process per iteration (train.mode=process)": ["generate.share_prompts=false",
                                                                 "train.share_prompts=false", "train.mode=process"],
        "vLLM-CPU server for sampling (generate.engine=vllm)": ["generate.engine=vllm", "generate.mode=resident",
                                                               "generate.gpu_memory_utilization=0.3"],
        "generation beside training (run.max_staleness=1)": ["run.max_staleness=1"],
        "LoRA r=16 (train.lora_r=16, lr 1e-4)": ["train.lora_r=16", "train.lora_alpha=32", "train.lr=1e-4"],
        "dynamic sampling (generate.dynamic_sampling, up to 4 rounds)": ["generate.dynamic_sampling={max_rounds: 4}"],
        "the curriculum (data.curriculum)": ["data.curriculum={defer: 4}"],
        "overlong shaping (reward.overlong, buffer 8)": ["reward.overlong={buffer: 8}"],
        "nucleus sampling, renormalized on both sides (generate.top_p=0.8)": ["generate.top_p=0.8"],
    }
    if only:
        variants = {k: v for k, v in variants.items() if any(o in k for o in only)}
    rows = []
    for name, extra in variants.items():
        got = rlflow_run(config, 0, iterations, work, [*off, *extra], name=f"lever-{len(rows)}")
        shutil.rmtree(work / f"lever-{len(rows)}", ignore_errors=True)    # (its checkpoints: ~3.6 GB a variant)
        rows.append((name, _steady(got["seconds"]), {k: _steady(v) for k, v in got["stage_seconds"].items()}))
        print(f"{name}: {rows[-1][1]:.1f} s/iteration ({', '.join(f'{k} {v:.1f}' for k, v in rows[-1][2].items())})",
              flush=True)
    trl = _steady(trl_run(config, 0, iterations, work, evaluate=False)["seconds"])
    print(f"\n# seconds per iteration, {platform.node()} ({platform.machine()}, {os.cpu_count()} cores), "
          f"{iterations} iterations each (mean of 2..{iterations}), evaluation off")
    print("| variant | s/iteration | generate | train | vs TRL |")
    print("|---|---:|---:|---:|---:|")
    for name, s, stages in rows:
        print(f"| {name} | {s:.1f} | {stages['generate']:.1f} | {stages['train']:.1f} | **{s / trl:.2f}x** |")
    print(f"| TRL GRPOTrainer | {trl:.1f} | | | 1.00x |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=str(CONFIG))
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--iterations", type=int, default=None, help="default: the config's run.iterations")
    ap.add_argument("--sides", default="rlflow,trl")
    ap.add_argument("--threshold", type=float, default=0.3, help="held-out accuracy for the time-to line")
    ap.add_argument("--out", default=str(ROOT / "docs" / "benchmarks"))
    ap.add_argument("--levers", action="store_true", help="seconds per iteration, each rlflow lever off in turn")
    ap.add_argument("--lever-iterations", type=int, default=4)
    ap.add_argument("--only", nargs="+", default=None, help="with --levers: the variants whose name holds one of these")
    keep_option(ap)
    args = ap.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    config = Path(args.config).resolve()
    work = work_folder("rlflow-real-vs-trl-", args.keep)
    if args.levers:
        levers(config, args.lever_iterations, work, args.only)
        return
    from tasks.core.config import load_config

    cfg = load_config(config, [])
    iterations = args.iterations or cfg.run.iterations
    sides = args.sides.split(",")
    runs: dict[str, dict[int, dict]] = {s: {} for s in sides}
    for seed in args.seeds:
        for side in sides:
            got = (rlflow_run(config, seed, iterations, work, [], name=f"rlflow-{seed}") if side == "rlflow"
                   else trl_run(config, seed, iterations, work))
            runs[side][seed] = got
            print(f"{side} seed {seed}: {_steady(got['seconds']):.1f} s/iteration, held-out "
                  + ", ".join(f"{k}: {v:.2f}" for k, v in sorted(got["accuracy"].items())), flush=True)

    steps = sorted(set.intersection(*(set(r["accuracy"]) for s in sides for r in runs[s].values())))

    def clock(side: str, seed: int, step: int) -> float:
        return sum(runs[side][seed]["seconds"][:step])

    def mean_acc(side: str, step: int) -> float:
        return statistics.fmean(runs[side][s]["accuracy"][step] for s in args.seeds)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "real_model_vs_trl.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["side", "seed", "iteration", "train_clock_seconds", "held_out_greedy_pass_at_1"])
        for side in sides:
            for seed in args.seeds:
                for step in steps:
                    w.writerow([side, seed, step, f"{clock(side, seed, step):.1f}",
                                f"{runs[side][seed]['accuracy'][step]:.4f}"])

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for side, color in zip(sides, ["tab:blue", "tab:orange"]):
        for seed in args.seeds:
            ax.plot([clock(side, seed, s) / 60 for s in steps], [runs[side][seed]["accuracy"][s] for s in steps],
                    color=color, alpha=0.3, linewidth=0.8, marker=".")
        ax.plot([statistics.fmean(clock(side, s, st) for s in args.seeds) / 60 for st in steps],
                [mean_acc(side, st) for st in steps], color=color, linewidth=2, marker="o",
                label=f"{side} (mean of {len(args.seeds)} seeds)")
    ax.axhline(args.threshold, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("training wall clock (minutes; evaluation excluded)")
    ax.set_ylabel("held-out greedy accuracy")
    ax.set_title("SmolLM2-135M-Instruct on reasoning-gym sums, 2-core CPU: rlflow vs TRL")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "real_model_vs_trl.png", dpi=110)

    def to_threshold(side: str) -> str:
        hits = [next((clock(side, s, st) for st in steps if runs[side][s]["accuracy"][st] >= args.threshold), None)
                for s in args.seeds]
        reached = [h for h in hits if h is not None]
        return f"{statistics.fmean(reached):.0f} s ({len(reached)}/{len(hits)} seeds)" if reached else "never"

    print(f"\n# {platform.node()} ({platform.machine()}, {os.cpu_count()} cores), seeds {args.seeds}, "
          f"{iterations} iterations, {time.strftime('%Y-%m-%d')}")
    print("| side | s/iteration (2..N) | " + " | ".join(f"held-out @{s}" for s in steps)
          + f" | time to held-out ≥ {args.threshold} |")
    print("|---|---:|" + "---:|" * len(steps) + "---:|")
    for side in sides:
        per_it = statistics.fmean(_steady(runs[side][s]["seconds"]) for s in args.seeds)
        cells = [f"{mean_acc(side, st):.3f} ({statistics.fmean(clock(side, s, st) for s in args.seeds):.0f} s)"
                 for st in steps]
        print(f"| {side} | {per_it:.1f} | " + " | ".join(cells) + f" | {to_threshold(side)} |")
    if len(sides) == 2:
        a, b = (statistics.fmean(_steady(runs[s][x]["seconds"]) for x in args.seeds) for s in sides)
        print(f"\nwall time per iteration, {sides[0]} / {sides[1]}: {a / b:.2f}x")


if __name__ == "__main__":
    main()
