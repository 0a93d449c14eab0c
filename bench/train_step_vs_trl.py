"""Train-step throughput: our GRPO update (tasks.algorithms.update.optimise, the code the train stage runs)
against TRL's GRPOTrainer step (compute_loss -> accelerator.backward -> clip -> AdamW step) on the same model, the same
scored completions and the same settings, both on this machine in one process, interleaved.

    python bench/train_step_vs_trl.py [--model tiny-lm|small-lm] [--prompts 16] [--generations 8]
                                      [--length 32] [--steps 10] [--loss-type dapo]
    python bench/train_step_vs_trl.py --recipe configs/smollm2-arith.yaml --prompts 8 --length 16 --steps 3

--recipe: the recipe's model (SmolLM2-135M-Instruct from its GGUF) and its training prompts through the chat
template (~60 tokens each) instead of a random builtin model and 3-token prompts, and the recipe's micro-batch
size on our side (TRL runs the batch in one forward, its default): what a real iteration's update costs.

Prints completion tokens/s for each side and the ratio ours/TRL (goal >= 1.0). "ours+IS" is our default
configuration, which also weights the loss by the truncated-IS ratio against the generator's logprobs (TRL
does that only with vLLM); the like-for-like line turns it off. Our side includes padding the rollouts into
micro-batches (prepare_batches) in every step; TRL's padded inputs are built once. With beta > 0 both sides
count the reference model's forward in the step.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.work import keep_option, work_folder  # noqa: E402
from tasks.algorithms.advantage import group_advantages  # noqa: E402
from tasks.algorithms.batching import prepare_batches  # noqa: E402
from tasks.algorithms.update import optimise  # noqa: E402
from tasks.core.builtin_models import build  # noqa: E402
from tasks.core.config import load_config  # noqa: E402
from tasks.core.contracts import Rollout  # noqa: E402
from tasks.core.models import load_model, load_tokenizer  # noqa: E402
from tasks.engines.torch_engine import TorchEngine  # noqa: E402


def scored_completions(tokenizer, n_prompts: int, group: int, length: int, seed: int = 0,
                       prompt_ids: list[list[int]] | None = None) -> list[Rollout]:
    """Ragged random completions (a quarter stop early on EOS), random 0/1 rewards; the prompts are `prompt_ids`
    when given, else 3-character ones."""
    g = torch.Generator().manual_seed(seed)
    chars = "abcdefgh"
    vocab = len(tokenizer)
    out = []
    for p in range(n_prompts):
        prompt = f"{chars[p % 8]}{chars[(p // 8) % 8]}="
        pids = prompt_ids[p] if prompt_ids else tokenizer(prompt, add_special_tokens=False)["input_ids"]
        for _ in range(group):
            n = length if torch.rand(1, generator=g) < 0.75 else int(torch.randint(1, length, (1,), generator=g))
            cids = torch.randint(5, vocab, (n,), generator=g).tolist()
            truncated = n == length
            if not truncated:
                cids[-1] = tokenizer.eos_token_id
            out.append(Rollout(group=p, row=p, prompt=prompt, prompt_ids=pids, completion="", completion_ids=cids,
                               logprobs=[-3.0] * n, truncated=truncated,
                               reward=float(torch.randint(0, 2, (1,), generator=g))))
    return out


def trl_inputs(records, advantages, pad_id: int) -> dict:
    from trl.trainer.utils import pad

    prompt_ids = pad([torch.tensor(r.prompt_ids) for r in records], padding_value=pad_id, padding_side="left")
    prompt_mask = pad([torch.ones(len(r.prompt_ids), dtype=torch.long) for r in records], padding_value=0,
                      padding_side="left")
    completion_ids = pad([torch.tensor(r.completion_ids) for r in records], padding_value=pad_id,
                         padding_side="right")
    completion_mask = pad([torch.ones(len(r.completion_ids), dtype=torch.long) for r in records], padding_value=0,
                          padding_side="right")
    return dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
                completion_mask=completion_mask, advantages=advantages, num_items_in_batch=completion_mask.sum())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny-lm", help="builtin model: tiny-lm (0.1M) or small-lm (3M)")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--length", type=int, default=32, help="max completion length (tokens)")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per side (after 2 warm-up steps)")
    ap.add_argument("--loss-type", default="dapo")
    ap.add_argument("--beta", type=float, default=0.0)
    ap.add_argument("--recipe", default=None, help="a recipe whose model and training prompts to use, e.g. "
                    "configs/smollm2-arith.yaml")
    keep_option(ap)
    args = ap.parse_args()

    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    work = work_folder("rlflow-bench-trl-", args.keep)
    n = args.prompts * args.generations
    lr = 1e-5
    prompt_ids = None
    if args.recipe:
        from tasks.core import data
        from tasks.core.models import base_path, encode_prompt

        recipe = load_config(args.recipe, [])
        path = Path(base_path(recipe))
        micro = recipe.train.micro_batch_size
        args.model = recipe.model.name_or_path
    else:
        path, micro = build(work / "model", name=args.model), n
    tokenizer = load_tokenizer(str(path))
    if args.recipe:
        rows = data.load_prompts(recipe)
        prompt_ids = [encode_prompt(tokenizer, rows[i][recipe.data.prompt_column], recipe.generate.max_prompt_length)
                      for i in range(args.prompts)]
    common = [f"model.name_or_path={path}", f"generate.prompts_per_iteration={args.prompts}",
              f"generate.num_generations={args.generations}", f"generate.max_completion_length={args.length}",
              f"train.learner.loss_type={args.loss_type}", f"train.beta={args.beta}", f"train.lr={lr}",
              f"train.micro_batch_size={micro}", "train.device=cpu"]
    cfg_plain = load_config(ROOT / "configs" / "tiny.yaml", [*common, "train.importance_sampling_correction=false"])
    cfg_is = load_config(ROOT / "configs" / "tiny.yaml", common)

    records = scored_completions(tokenizer, args.prompts, args.generations, args.length, prompt_ids=prompt_ids)
    rewards = torch.tensor([r.reward for r in records])
    advantages = group_advantages(rewards, args.generations, "group")
    tokens = sum(len(r.completion_ids) for r in records)

    # ours: the train stage's model, optimizer and update
    variants = [("ours", cfg_plain), ("ours+IS", cfg_is)]
    if args.recipe:     # the prompt shared by a group's rows run once (train.share_prompts, on in both above) or not
        variants.append(("ours+IS, prompt per row", load_config(ROOT / "configs" / "tiny.yaml",
                                                                [*common, "train.share_prompts=false"])))
    ours = {}
    for name, cfg in variants:
        model = load_model(str(path), "float32", torch.device("cpu")).train()
        opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.999), weight_decay=0.0)
        ref = load_model(str(path), "float32", torch.device("cpu")).eval().requires_grad_(False) if args.beta else None
        ours[name] = (model, opt, cfg, ref)

    def our_step(name):
        model, opt, cfg, ref = ours[name]
        batches = prepare_batches(records, advantages, tokenizer.pad_token_id, cfg.train, torch.device("cpu"))
        optimise(TorchEngine(model, opt, cfg, ref_model=ref), batches, cfg)

    # TRL: GRPOTrainer's own model, optimizer, loss and backward, on the same completions
    targs = GRPOConfig(output_dir=str(work / "trl"), use_cpu=True, bf16=False, per_device_train_batch_size=n,
                       num_generations=args.generations, max_completion_length=args.length, beta=args.beta,
                       loss_type=args.loss_type, learning_rate=lr, lr_scheduler_type="constant",
                       weight_decay=0.0, max_grad_norm=1.0, report_to=[], logging_strategy="no")
    trainer = GRPOTrainer(model=str(path), args=targs,
                          reward_funcs=[lambda completions, **kw: [0.0] * len(completions)],
                          train_dataset=Dataset.from_dict({"prompt": ["a="] * args.prompts}))
    trainer.create_optimizer()
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    inputs = trl_inputs(records, advantages, tokenizer.pad_token_id)
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1)
    attn = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], 1)

    def trl_step(_name):
        model = trainer.model
        if args.beta:   # TRL does this forward in _generate_and_score_completions; we count it in its step
            with torch.no_grad():
                inputs["ref_per_token_logps"] = trainer._get_per_token_logps_and_entropies(
                    trainer.ref_model, ids, attn, inputs["completion_ids"].size(1))[0]
        loss = trainer.compute_loss(model, inputs)
        trainer.accelerator.backward(loss)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        trainer.optimizer.step()
        trainer.optimizer.zero_grad(set_to_none=True)

    sides = {"TRL": trl_step, **{name: our_step for name in ours}}
    times: dict[str, list[float]] = {k: [] for k in sides}
    for i in range(args.steps + 2):
        for name, step in sides.items():          # interleaved: drift hits every side alike
            t0 = time.perf_counter()
            step(name)
            if i >= 2:
                times[name].append(time.perf_counter() - t0)

    params = sum(p.numel() for p in trainer.model.parameters())
    print(f"# train step, {platform.node()} ({platform.machine()}, {torch.get_num_threads()} threads), "
          f"torch {torch.__version__}, model {args.model} ({params / 1e6:.2f}M params), "
          f"batch {args.prompts}x{args.generations}, prompts ~{len(records[0].prompt_ids)} tokens, "
          f"completions <= {args.length} tokens ({tokens} tokens), micro-batch {micro}, "
          f"loss {args.loss_type}, beta {args.beta}, median of {args.steps} steps")
    trl_tps = tokens / statistics.median(times["TRL"])
    for name in sides:
        med = statistics.median(times[name])
        print(f"{name:24s} {med * 1e3:8.1f} ms/step {tokens / med:10.0f} tokens/s   ratio vs TRL "
              f"{tokens / med / trl_tps:5.2f}x")


if __name__ == "__main__":
    main()
