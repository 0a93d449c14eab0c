"""Loading policies (hub id, local folder, builtin, or a store folder) and computing token logprobs.

The one function both sides of RL must agree on lives here: `completion_logprobs` computes what the
trainer thinks the policy's logprob of each sampled token is, with the same temperature the generator used.
"""

from __future__ import annotations

import functools
import hashlib
import os
import random
from pathlib import Path

import torch

from tasks import layout, tiny_model
from tasks.errors import UserError
from tasks.store import Store

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@functools.lru_cache(maxsize=8)
def _open_store(store_cfg_json: str, cwd: str) -> Store:
    from tasks.config import StoreConfig

    return Store.open(StoreConfig.model_validate_json(store_cfg_json))


def open_store(cfg) -> Store:
    """One Store per store config (and working directory: a relative file store resolves against it) in this
    process (a boto3 client is not free to build)."""
    return _open_store(cfg.store.model_dump_json(), os.getcwd())


def device_for(cfg) -> torch.device:
    want = cfg.train.device
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(want)


def local_folder(store: Store, key: str) -> Path:
    """Download (or reuse) a complete store folder into the local cache, verified."""
    digest = hashlib.sha256(store.uri(key).encode()).hexdigest()[:16]
    dest = tiny_model.cache_root() / "store" / digest
    store.get_folder(key, dest)
    return dest


def policy_path(cfg, policy: str) -> str:
    """`base` -> the configured starting model; otherwise a store key of a policy or checkpoint model."""
    if policy == layout.BASE:
        return base_path(cfg)
    return str(local_folder(open_store(cfg), policy))


def base_path(cfg) -> str:
    """The starting model as a local folder or hub id. A URI inside the store (a published policy, e.g.
    the champion of an earlier run) is fetched, verified, into the local cache."""
    store = open_store(cfg)
    if cfg.model.name_or_path.startswith(store.root.rstrip("/") + "/"):
        key = cfg.model.name_or_path[len(store.root.rstrip("/")) + 1:]
        if store.manifest(key) is None:
            raise UserError(f"model.name_or_path: {cfg.model.name_or_path}: no complete folder there")
        return str(local_folder(store, key))
    if cfg.model.name_or_path.startswith("s3://"):
        raise UserError(f"model.name_or_path: {cfg.model.name_or_path}: an s3:// model must lie under store.uri "
                        f"({store.root})")
    path = tiny_model.resolve(cfg.model.name_or_path)
    looks_local = path.startswith(("/", "./", "../", "~")) or Path(path).exists()
    if looks_local and not (Path(path).expanduser() / "config.json").exists():
        raise UserError(f"model.name_or_path: {path}: no config.json (expected a saved model folder)")
    return path


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(path)
    except OSError as e:
        raise UserError(f"model.name_or_path: cannot load tokenizer from {path!r}: {str(e).splitlines()[0][:200]}") from None
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_model(path: str, dtype: str = "float32", device: torch.device | str = "cpu"):
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=_DTYPES[dtype])
    except OSError as e:
        raise UserError(f"model.name_or_path: cannot load model from {path!r}: {str(e).splitlines()[0][:200]}") from None
    return model.to(device)


ADAPTER_CONFIG = "adapter_config.json"


def load_policy(cfg, path: str, device, trainable: bool = False):
    """A full model folder, or a LoRA adapter folder (peft) applied to the configured base model."""
    if not (Path(path) / ADAPTER_CONFIG).exists():
        return load_model(path, cfg.model.dtype, device)
    from peft import PeftModel

    base = load_model(base_path(cfg), cfg.model.dtype, device)
    return PeftModel.from_pretrained(base, path, is_trainable=trainable)


def add_lora(model, tc):
    """Wrap a base model with fresh LoRA adapters (B = 0: the wrapped model starts equal to the base)."""
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=tc.lora_r, lora_alpha=tc.lora_alpha, lora_dropout=tc.lora_dropout,
                                            target_modules=tc.lora_target_modules, task_type="CAUSAL_LM"))


def encode_prompt(tokenizer, prompt, max_length: int) -> list[int]:
    """A string is tokenised as is; a list of chat messages goes through the tokenizer's chat template."""
    if isinstance(prompt, list):
        if not tokenizer.chat_template:
            raise UserError("data.prompt_column: chat-message prompts need a tokenizer with a chat template")
        ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    else:
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    return list(ids)[-max_length:]


def pad_batch(prompts: list[list[int]], completions: list[list[int]], pad_id: int):
    """[left-padded prompt | right-padded completion] with attention mask, position ids and completion mask.

    Shapes: ids, attention (B, Lp+Lc); completion_mask (B, Lc). Position ids count real tokens only, so a
    left-padded row sees the same positions as it did unpadded in the generator.
    """
    Lp = max(len(p) for p in prompts)
    Lc = max(max(len(c) for c in completions), 1)
    # Rows are built as Python lists and converted once: per-row tensor writes cost more than the step itself
    # at small sizes.
    rows, attn_rows, cmask_rows = [], [], []
    for p, c in zip(prompts, completions):
        lp, lc = Lp - len(p), Lc - len(c)
        rows.append([pad_id] * lp + list(p) + list(c) + [pad_id] * lc)
        attn_rows.append([0] * lp + [1] * (len(p) + len(c)) + [0] * lc)
        cmask_rows.append([1.0] * len(c) + [0.0] * lc)
    ids = torch.tensor(rows, dtype=torch.long)
    attn = torch.tensor(attn_rows, dtype=torch.long)
    cmask = torch.tensor(cmask_rows, dtype=torch.float32)
    positions = (attn.cumsum(-1) - 1).clamp(min=0)
    return ids, attn, positions, cmask


def completion_logprobs(model, ids, attn, positions, n_completion: int, temperature: float,
                        with_entropy: bool = False):
    """Logprob of each completion token under `model`: (B, Lc) float32, and optionally entropy (B, Lc)."""
    device = next(model.parameters()).device
    out = model(input_ids=ids.to(device), attention_mask=attn.to(device), position_ids=positions.to(device),
                logits_to_keep=n_completion + 1)
    logits = out.logits[:, :-1].float() / temperature            # (B, Lc, V): logits at t predict token t+1
    targets = ids[:, -n_completion:].to(device)                   # (B, Lc)
    logp = torch.log_softmax(logits, dim=-1)
    token_logp = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    if not with_entropy:
        return token_logp, None
    entropy = -(logp.exp() * logp).sum(-1)
    return token_logp, entropy


def rng_state() -> dict:
    """Every random stream training draws from (saved with a checkpoint, so a resume continues them)."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
