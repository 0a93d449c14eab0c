"""A model of another's architecture and tokenizer with seeded random weights, for a machine that cannot hold the
weights (a GPU machine with no hub and a small transfer limit: the GPU check of 2026-12-04, docs/benchmarks.md).
Speed, memory and plumbing depend on the shape, not the values; learning does not, and sampling runs every
completion to its limit (no end of sequence is learnt).

    python bench/shape_model.py SRC DST [--seed 0]     # SRC: a model folder (its weights are not read), or one
                                                        # holding only config.json and the tokenizer's files
Here, SRC is what `builtin:smollm2-135m` converts to (tasks/core/models.py: base_path); DST is written fp32.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

KEPT = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
        "generation_config.json", "vocab.json", "merges.txt", "tokenizer.model")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src")
    ap.add_argument("dst")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.manual_seed(args.seed)
    config = AutoConfig.from_pretrained(args.src)
    config.dtype = "float32"
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(args.dst)
    for name in KEPT:
        if (Path(args.src) / name).is_file():
            shutil.copy(Path(args.src) / name, Path(args.dst) / name)
    print(f"{args.dst}: {sum(p.numel() for p in model.parameters()):,} parameters, seed {args.seed}")


if __name__ == "__main__":
    main()
