"""The cost of one interruption on the hf engine (issue 42, item 5): a batch sampled uninterrupted vs the same
batch with a new policy arriving in the middle of its sequences (tasks/engines/hf.py: Interruption).

    python bench/interruption_cost.py [--config configs/smollm2-arith.yaml] [--prompts 16] [--tokens 64]
                                      [--at 1 16] [--repeats 3] [--device cuda] [--model PATH] [--dtype bfloat16]

The model is the recipe's (SmolLM2-135M-Instruct on CPU; --model, --dtype and --device change it: on a GPU the clock
is read after the device finished), its prompts the recipe's first ones, tokenised as the generate stage does. The
new policy is the same architecture with every weight moved (as an update does), saved as safetensors: `apply` reads
the file and copies it into the model in place, as the resident model's reload does. Interrupted after `--at` decode
steps, the unfinished sequences continue from their partial tokens with a fresh prefill under the new weights.
Printed per interruption point: seconds per batch for both sides (plain and interrupted alternate; median and best),
completion tokens and tokens/s (the new policy writes other lengths), and the weight load alone. After 1 step
nothing has finished: the difference is the interruption's own cost (the load, the refill of every sequence's
prompt, no longer shared by its group, and a second generate call). Later, the sequences that ended are left out of
the continued call, which transformers' one call keeps decoding padded to the end: that shortens the batch (a side
effect, not a cost). The interrupted side discards no token: it keeps every token drawn before the swap.
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402


class LoadFromFile:
    """An interruption pending after `at` decode steps: the new policy's safetensors file loaded in place."""

    def __init__(self, at: int, path: Path):
        self.left, self.path, self.load_seconds = at, path, 0.0

    def pending(self) -> bool:
        self.left -= 1
        return self.left == 0

    def apply(self, model):
        from safetensors.torch import load_file

        t0 = time.perf_counter()
        state = model.state_dict()
        with torch.no_grad():
            for name, tensor in load_file(self.path).items():
                state[name].copy_(tensor)
        synchronize()
        self.load_seconds = time.perf_counter() - t0
        return model, 1


def synchronize() -> None:
    """(On a GPU: the clock read after the device's work, not after its launch.)"""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "smollm2-arith.yaml"))
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--at", type=int, nargs="+", default=[1, 16], help="decode steps before the new policy "
                    "arrives (one measurement each)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu", help="where the model samples (cpu, cuda)")
    ap.add_argument("--model", default=None, help="model.name_or_path (default: the recipe's)")
    ap.add_argument("--dtype", default=None, help="model.dtype (default: the recipe's)")
    args = ap.parse_args()

    from tasks.core import data
    from tasks.core.config import load_config
    from tasks.core.contracts import SamplingParams
    from tasks.core.models import base_path, encode_prompt, load_model, load_tokenizer
    from tasks.engines.hf import hf_generate

    cfg = load_config(args.config, ["generate.num_generations=8",
                                     *([f"model.name_or_path={args.model}"] if args.model else []),
                                     *([f"model.dtype={args.dtype}"] if args.dtype else [])])
    path = base_path(cfg)
    tok = load_tokenizer(path)
    model = load_model(path, cfg.model.dtype, args.device).eval()
    ds = data.load_prompts(cfg)
    prompts = [encode_prompt(tok, data.prompt_of(cfg, ds[i]), cfg.generate.max_prompt_length)
               for i in range(args.prompts)]
    params = SamplingParams(n=cfg.generate.num_generations, max_new_tokens=args.tokens,
                            temperature=cfg.generate.temperature, top_p=1.0, seed=11)
    new = copy.deepcopy(model)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(0)
        for p in new.parameters():
            p.add_(torch.randn(p.shape, generator=gen).to(p) * 1e-3)
    where = torch.cuda.get_device_name(torch.device(args.device)) if args.device.startswith("cuda") else "CPU"
    print(f"{platform.node()}: {where}, {os.cpu_count()} CPUs, torch {torch.__version__} ({torch.get_num_threads()} "
          f"threads); {cfg.model.name_or_path} ({cfg.model.dtype}), {args.prompts} prompts x {params.n} samples, up "
          f"to {args.tokens} tokens, temperature {params.temperature}", flush=True)
    with tempfile.TemporaryDirectory(prefix="rlflow-interrupt-") as tmp:
        new.save_pretrained(tmp)                       # (tied embeddings: one tensor in the file, as published)
        weights = Path(tmp) / "model.safetensors"
        original = {k: v.clone() for k, v in model.state_dict().items()}
        hf_generate(model, tok, prompts[:2], params, cfg.generate.batch_size)          # warm

        def restore() -> None:
            with torch.no_grad():
                for k, v in model.state_dict().items():
                    v.copy_(original[k])

        for at in args.at:
            plain, interrupted, loads, tokens = [], [], [], {}
            for _ in range(args.repeats):
                restore()
                t0 = time.perf_counter()
                out = hf_generate(model, tok, prompts, params, len(prompts))
                synchronize()
                plain.append(time.perf_counter() - t0)
                tokens["plain"] = sum(len(s.completion_ids) for s in out)
                restore()
                interrupt = LoadFromFile(at, weights)
                t0 = time.perf_counter()
                out = hf_generate(model, tok, prompts, params, len(prompts), interrupt=interrupt)
                synchronize()
                interrupted.append(time.perf_counter() - t0)
                loads.append(interrupt.load_seconds)
                tokens["interrupted"] = sum(len(s.completion_ids) for s in out)
                tokens["after"] = sum(v == 1 for s in out for v in s.versions)
            p, i, load = statistics.median(plain), statistics.median(interrupted), statistics.median(loads)
            print(f"interrupted after {at} step(s):", flush=True)
            print(f"  plain:        {p:6.2f} s a batch (best {min(plain):.2f}), {tokens['plain']} tokens, "
                  f"{tokens['plain'] / p:.0f} tokens/s", flush=True)
            print(f"  interrupted:  {i:6.2f} s a batch (best {min(interrupted):.2f}), {tokens['interrupted']} tokens "
                  f"({tokens['after']} drawn by the new policy, 0 discarded), {tokens['interrupted'] / i:.0f} "
                  f"tokens/s", flush=True)
            print(f"  difference {i - p:+.2f} s ({(i - p) / p:+.0%}); the weight load {load:.2f} s of it", flush=True)


if __name__ == "__main__":
    main()
