"""GGUF out and back: SmolLM2-135M-Instruct (`builtin:smollm2-135m`, converted from its GGUF) written by
tasks/core/gguf.py: write_gguf in f32, f16 and q8_0, each file read back through transformers' GGUF reader
(tasks/core/gguf.py: model_folder), and the model that comes back compared with the one that went out:

- size of the file, seconds to write it and to read it back;
- max |logit difference| over the prompts' positions;
- greedy completions (24 tokens) of N held-out arithmetic prompts of the smollm2-arith recipe (reasoning-gym
  basic_arithmetic, chat template): how many are token for token the same, and how many give the same final
  answer (the recipe's own checker).

    python bench/gguf_roundtrip.py [--prompts 20] [--quants f32 f16 q8_0] [--out docs/benchmarks]
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from tasks.core import builtin_models, gguf  # noqa: E402
from tasks.core.config import load_config  # noqa: E402
from tasks.core.models import load_model, load_tokenizer  # noqa: E402
from tasks.core.stage import quiet_progress_bars  # noqa: E402


def prompts(n: int) -> list[tuple[list[dict], str, str]]:
    """The recipe's held-out prompts: (chat messages, the answer, its answer format)."""
    from tasks.core.data import load_prompts, prompt_of

    cfg = load_config(ROOT / "configs" / "smollm2-arith.yaml")
    rows = load_prompts(cfg, split="eval")
    return [(prompt_of(cfg, rows[i]), str(rows[i]["answer"]), rows[i].get("answer_format", "final"))
            for i in range(min(n, len(rows)))]


def greedy(model, tok, rows, max_new: int = 24) -> list[list[int]]:
    out = []
    with torch.no_grad():
        for messages, *_ in rows:
            enc = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                          return_dict=True)
            ids = model.generate(**enc, max_new_tokens=max_new, do_sample=False, pad_token_id=tok.pad_token_id)
            out.append(ids[0, enc["input_ids"].shape[1]:].tolist())
    return out


def logits(model, tok, rows) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model(**tok.apply_chat_template(m, add_generation_prompt=True, return_tensors="pt",
                                                return_dict=True)).logits[0] for m, *_ in rows]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=20)
    ap.add_argument("--quants", nargs="+", default=list(gguf.QUANTS), choices=gguf.QUANTS)
    ap.add_argument("--out", help="folder for gguf_roundtrip.md (default: print only)")
    args = ap.parse_args()
    quiet_progress_bars()
    torch.manual_seed(0)
    start = builtin_models.resolve("builtin:smollm2-135m")
    folder = gguf.model_folder(start, "float32")
    model, tok = load_model(folder, "float32").eval(), load_tokenizer(folder)
    rows = prompts(args.prompts)
    from tasks.rewards.reasoning_gym import readings

    def answers(completions):
        return [(readings(tok.decode(c, skip_special_tokens=True), r[2]) or [None])[-1]
                for c, r in zip(completions, rows)]

    ref_logits, ref_greedy = logits(model, tok, rows), greedy(model, tok, rows)
    ref_answers = answers(ref_greedy)
    right = sum(a == r[1] for a, r in zip(ref_answers, rows))
    table = ["| quant | file MB | write s | read back s | max abs logit diff | greedy same tokens | same answer |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    with tempfile.TemporaryDirectory(prefix="rlflow-gguf-bench-") as tmp:
        os.environ["RLFLOW_CACHE"] = str(Path(tmp) / "cache")        # read back fresh, not from the run cache
        for quant in args.quants:
            t0 = time.perf_counter()
            done = gguf.write_gguf(model, tok, Path(tmp) / f"smollm2.{quant}.gguf", quant,
                                   pre=gguf.start_tokenizer_pre(start))
            write_s, t0 = time.perf_counter() - t0, time.perf_counter()
            back = gguf.model_folder(done["file"], "float32")
            again = load_model(back, "float32").eval()
            read_s = time.perf_counter() - t0
            diff = max(float((a - b).abs().max()) for a, b in zip(ref_logits, logits(again, tok, rows)))
            got = greedy(again, load_tokenizer(back), rows)
            same = sum(a == b for a, b in zip(ref_greedy, got))
            same_answer = sum(a == b for a, b in zip(ref_answers, answers(got)))
            table.append(f"| {quant} | {done['bytes'] / 1e6:.0f} | {write_s:.1f} | {read_s:.1f} | {diff:.3g} | "
                         f"{same}/{len(rows)} | {same_answer}/{len(rows)} |")
            print(table[-1], flush=True)
            del again
    head = (f"GGUF round trip of SmolLM2-135M-Instruct, {len(rows)} held-out prompts of configs/smollm2-arith.yaml "
            f"(the original model answers {right}/{len(rows)} right greedily); {datetime.date.today()}, "
            f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}.")
    text = head + "\n\n" + "\n".join(table) + "\n"
    print("\n" + text)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "gguf_roundtrip.md").write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
