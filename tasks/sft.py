"""Stage 0 — warm start: supervised fine-tuning (SFT) on demonstrations, before RL's iteration 1 (`warmup:`).

    rlflow sft configs/letters.yaml -o warmup.path=demos.jsonl     # the warm start alone (`rlflow run`: first, once)
    python -m tasks.sft --config configs/letters.yaml -o warmup.path=demos.jsonl --iteration 0

Reads warmup.path in TRL's SFT formats, unchanged: `messages` (multi-turn episodes too, with a `tools` column
where they call tools: what `rlflow record` writes), `prompt`/`completion` (strings or message lists), `text`.
A conversation is tokenised as an episode of the same turns would be (tasks/envs/runtime/rendering.py:
Renderer.conversation), so its mask is RL's: the model's tokens 1, the prompt's and observations' 0. The loss is
TRL SFTTrainer's: cross-entropy summed over the step's masked tokens, over their count. Trains on train.engine
(torch; deepspeed as a torchrun group), LoRA with train.lora_r; <run>/sft/trainer/ckpt-S every
warmup.checkpoint_every steps (a killed warm start resumes from the newest, with the weights it would have had),
then publishes <run>/policy/v000000 (LoRA merged into the base): the policy every iteration starts from.
More: docs/internals.md (tasks/sft.py).
"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from tasks.core import data, layout
from tasks.core.artifacts import CorruptArtifact
from tasks.core.data import load_table, message_fault, message_text
from tasks.core.errors import UserError
from tasks.core.hashing import sha256_file
from tasks.core.models import ADAPTER_CONFIG, base_path, context_length, load_policy, load_tokenizer
from tasks.core.processes import stream
from tasks.core.stage import changed, fingerprint, raise_failure, result, reuse
from tasks.core.store import open_store
from tasks.engines.trainer import drill
from tasks.engines.training import training_engine
from tasks.envs.runtime.rendering import Renderer, turn_fault

if TYPE_CHECKING:
    from tasks.core.config import Config
    from tasks.core.store import Store

# The train section's fields the warm start uses (the rest are RL's: changing them later keeps v0).
TRAIN_FIELDS = ("engine", "weight_decay", "adam_betas", "max_grad_norm", "lora_r", "lora_alpha", "lora_dropout",
                "lora_target_modules", "device", "mixed_precision", "zero_stage", "offload_optimizer")


@dataclass
class Demo:
    ids: list[int]
    mask: list[int]          # 1: a token the loss is on (the model's), 0: the prompt's, an observation's


# ------------------------------------------------------------------------------------------ the demonstrations

def demonstrations(cfg: Config, tokenizer, context: int | None = None) -> list[Demo]:
    """Every row of warmup.path tokenised with its mask, checked: one UserError line naming the row otherwise."""
    w = cfg.warmup
    table = load_table(w.path, w.name, w.split, "warmup.path")
    cols = table.column_names
    fmt = w.format
    if fmt == "auto":
        fmt = ("messages" if "messages" in cols else "prompt_completion" if {"prompt", "completion"} <= set(cols)
               else "text" if "text" in cols else None)
    need = {"messages": ["messages"], "prompt_completion": ["prompt", "completion"], "text": ["text"]}.get(fmt)
    if need is None:
        raise UserError(f"warmup.path: {w.path}: expected a `messages` column, or `prompt` and `completion` (TRL's "
                        f"SFT formats; or `text`), got columns {cols}")
    if any(c not in cols for c in need):
        raise UserError(f"warmup.format: {fmt} reads the column{'s' if len(need) > 1 else ''} "
                        f"{' and '.join(f'`{c}`' for c in need)}, which {w.path} lacks (its columns: {cols}); "
                        f"expected a file of that format, or warmup.format auto")
    if len(table) == 0:
        raise UserError(f"warmup.path: {w.path} split {w.split!r} has no rows")
    if w.max_length is not None and context is not None and w.max_length > context:
        raise UserError(f"warmup.max_length: {w.max_length} tokens is above the model's context "
                        f"(max_position_embeddings) {context}; expected at most {context}")
    limit = w.max_length or context
    render = Renderer(tokenizer, 1 << 30)
    # a model turn of an episode is cut at generate.max_completion_length: a demonstration's turns as it cuts them
    turn_limit = cfg.generate.max_completion_length if cfg.env.episodic() else None
    out, specials = [], set(tokenizer.all_special_ids)
    for i, row in enumerate(table):
        where = f"warmup.path: {w.path} {data.row(i)}"
        try:
            ids, mask = _tokenise(fmt, row, tokenizer, render, w.assistant_only, turn_limit)
        except (TypeError, ValueError, KeyError) as e:
            raise UserError(f"{where}: {e}") from None
        except Exception as e:  # noqa: BLE001 - a chat template's own refusal (jinja's TemplateError)
            raise UserError(f"{where}: the chat template refused it: {str(e).splitlines()[0][:200]}") from None
        if limit is not None and len(ids) > limit:
            what = "warmup.max_length" if w.max_length else "the model's context (max_position_embeddings)"
            raise UserError(f"{where}: {len(ids)} tokens, above {what} {limit}; a demonstration is never cut "
                            f"(its end is what it teaches): shorten it"
                            + (" or raise warmup.max_length" if w.max_length and (context or 1 << 62) > limit
                               else ""))
        if not any(mask[1:]):
            raise UserError(f"{where}: no token to learn (its completion or assistant turns are empty)")
        if not any(m and t not in specials for t, m in zip(ids[1:], mask[1:])):
            raise UserError(f"{where}: no token to learn but the end of a turn: its completion or assistant turns "
                            f"are empty, or no tokens of this model's vocabulary (its tokenizer drops what it cannot "
                            f"read)")
        out.append(Demo(ids, mask))
    return out


def _a_tool_schema(t) -> bool:
    """An OpenAI tool schema as chat templates read it: {"type": "function", "function": {"name": ...}}, or the
    function's part alone ({"name": ...}, which transformers accepts too)."""
    if not isinstance(t, dict):
        return False
    fn = t.get("function", t) if t.get("type", "function") == "function" else None
    return isinstance(fn, dict) and isinstance(fn.get("name"), str) and bool(fn["name"].strip())


def _tokenise(fmt: str, row: dict, tokenizer, render: Renderer, assistant_only: bool,
              turn_limit: int | None = None) -> tuple[list[int], list[int]]:
    """A row's ids and mask. Strings as TRL's SFTTrainer tokenises them (EOS added; the completion from where
    prompt and prompt + completion part); conversations as an episode of the same turns (Renderer.conversation),
    or with assistant_only false as TRL renders them whole (every token counted)."""
    eos = tokenizer.eos_token or ""
    _no_special_text(tokenizer, row)
    if fmt == "text":
        ids = tokenizer(_ended(_string(row, "text"), eos))["input_ids"]
        return ids, [1] * len(ids)
    if fmt == "prompt_completion" and isinstance(row["prompt"], str):
        if not _string(row, "completion").strip():
            raise ValueError("an empty completion (nothing to learn but the end of the text)")
        prompt = tokenizer(row["prompt"])["input_ids"]
        full = tokenizer(row["prompt"] + _ended(_string(row, "completion"), eos))["input_ids"]
        start = next((k for k, (a, b) in enumerate(zip(prompt, full)) if a != b), min(len(prompt), len(full)))
        return full, ([0] * start + [1] * (len(full) - start)) if assistant_only else [1] * len(full)
    if fmt == "prompt_completion":
        if not isinstance(row["prompt"], list):
            raise TypeError(f"column 'prompt': expected a string or a list of chat messages, got "
                            f"{type(row['prompt']).__name__}")
        prompt, rest = _messages(row, "prompt"), _messages(row, "completion")
    else:
        messages = _messages(row, "messages")
        first = next((k for k, m in enumerate(messages) if m["role"] == "assistant"), None)
        if first is None:
            raise ValueError("no assistant message (nothing to learn)")
        prompt, rest = messages[:first], messages[first:]
    if not prompt:
        raise ValueError("the conversation starts with an assistant message; the model needs a prompt first")
    if not any(m["role"] == "assistant" for m in rest):
        raise ValueError("the completion has no assistant message (nothing to learn)")
    if not any(message_text(m.get("content")).strip() or m.get("tool_calls") for m in rest if m["role"] == "assistant"):
        raise ValueError("every assistant message is empty or blank (nothing to learn but the end of a turn)")
    if any(m["role"] == "system" for m in prompt[1:] + rest):
        raise ValueError("a system message after the first message; the templates take one, first")
    if (fault := turn_fault(prompt + rest)) is not None:
        raise ValueError(fault)
    tools = row.get("tools") or None
    if isinstance(tools, str):      # (TRL's tool datasets keep the schemas as JSON text too)
        try:
            tools = json.loads(tools)
        except ValueError:
            tools = "not JSON"
    if tools is not None and not (isinstance(tools, list) and all(_a_tool_schema(t) for t in tools)):
        raise ValueError(f"column 'tools': expected a list of tool schemas (JSON objects naming a function: "
                         f"{{\"type\": \"function\", \"function\": {{\"name\": ...}}}} or {{\"name\": ...}}, or "
                         f"their JSON text), got {json.dumps(row.get('tools'), default=str)[:80]}")
    whole = render.template(prompt + rest, tools, False)       # (the template's checks; parts as their text)
    if any(m.get("tool_calls") for m in rest) and whole == render.template(
            prompt + [{k: v for k, v in m.items() if k != "tool_calls"} for m in rest], tools, False):
        raise ValueError("the model's chat template does not write tool_calls (a call would be learned as an empty "
                         "turn): write each call in the message's content, as this model writes calls")
    if not assistant_only:
        ids = render.tok(whole, add_special_tokens=False)["input_ids"]
        return ids, [1] * len(ids)
    return render.conversation(prompt, rest, tools, turn_limit)


def _no_special_text(tokenizer, row: dict) -> None:
    """A chat message's text holds none of the model's special tokens as text ('</s>' in a turn is read as the
    token: an end learned in the middle of a turn, or a turn of its own made up; the template writes the markers
    itself): ValueError naming it. Strings (`text`, `prompt`, `completion`) are TRL's to hold them: pre-rendered
    or packed rows put them there on purpose."""
    specials = [t for t in tokenizer.all_special_tokens if t]
    if not specials:
        return
    found = re.compile("|".join(map(re.escape, sorted(specials, key=len, reverse=True))))
    for c in ("messages", "prompt", "completion"):
        for j, m in enumerate(row.get(c) if isinstance(row.get(c), list) else []):
            if isinstance(m, dict) and (hit := found.search(message_text(m.get("content")))) is not None:
                raise ValueError(f"column {c!r} message {j}: holds {hit.group()!r}, this model's special token, "
                                 f"which it would read as that token (an end or a turn in the middle of the turn); "
                                 f"expected text without it")


def _ended(text: str, eos: str) -> str:
    return text if not eos or text.endswith(eos) else text + eos


def _string(row: dict, column: str) -> str:
    if not isinstance(row[column], str):
        raise TypeError(f"column {column!r}: expected a string, got {type(row[column]).__name__}")
    return row[column]


def _messages(row: dict, column: str) -> list[dict]:
    value = row[column]
    if not (isinstance(value, list) and value):
        raise TypeError(f"column {column!r}: expected a list of chat messages, got "
                        f"{type(value).__name__}{' (empty)' if value == [] else ''}")
    if (odd := next((j for j, m in enumerate(value) if not isinstance(m, dict)), None)) is not None:
        raise TypeError(f"column {column!r} message {odd}: expected a chat message ({{role, content}}), got "
                        f"{type(value[odd]).__name__}")
    out = []
    for j, m in enumerate(value):
        m = {k: v for k, v in m.items() if v is not None}      # (datasets fills absent keys with None)
        if (fault := message_fault(m)) is not None:
            raise ValueError(f"column {column!r} message {j}: {fault}")
        out.append(m)
    return out


def check(cfg: Config) -> list[Demo]:
    """Everything the warm start refuses, before anything is written (the flow's preflight calls it too)."""
    path = base_path(cfg)
    if (Path(path) / ADAPTER_CONFIG).exists():
        raise UserError(f"model.name_or_path: {cfg.model.name_or_path} is a LoRA adapter, not a base model; the warm "
                        f"start trains the base (name the base model, and train.lora_r for an adapter)")
    no_held_out_prompts(cfg)
    demos = demonstrations(cfg, load_tokenizer(path), context_length(path))
    w = cfg.warmup
    if w.max_steps is None and w.lr_warmup_steps >= (total := steps_of(len(demos), cfg)):
        raise UserError(f"warmup.lr_warmup_steps: {w.lr_warmup_steps} is not below the warm start's {total} steps "
                        f"({len(demos)} demonstrations, batch_size {w.batch_size}, epochs {w.epochs}): the lr would "
                        f"never reach warmup.lr; expected fewer warm-up steps, or more epochs")
    return demos


def no_held_out_prompts(cfg: Config) -> None:
    """Demonstrations of the held-out evaluation's prompts (`rlflow record --split eval`, a file that shares them)
    are refused: the warm start would train on what the held-out score measures, which becomes a training score.
    A demonstration's prompt is its `prompt`, or its messages before the first assistant turn, compared as the
    held-out split's rows are with the training prompts (data.prompt_key); with an environment, a recorded
    episode's first user turn holding a held-out prompt (the task it was given) counts too."""
    keys = _held_out_keys(cfg)
    if not keys:
        return
    w = cfg.warmup
    table = load_table(w.path, w.name, w.split, "warmup.path")
    by_word: dict[str, list[list[str]]] = {}        # (a key's words, under its first: found word by word)
    for key in keys if cfg.env.episodic() else ():
        by_word.setdefault(key.split(" ", 1)[0], []).append(key.split(" "))
    hits = [i for i, row in enumerate(table)
            if (found := _demonstration_keys(row))[0] & keys or (by_word and _holds(found[1].split(" "), by_word))]
    if hits:
        where = f"eval.path {cfg.eval.path}" if cfg.eval.path else f"eval.split {cfg.eval.split!r}"
        raise UserError(f"warmup.path: {w.path} {data.row(hits[0])}: a demonstration of a held-out eval prompt "
                        f"({where}), as {len(hits)} of its {len(table)} are; the warm start would train on what "
                        f"the held-out score measures: expected demonstrations of training prompts (rlflow record "
                        f"--split train), or those rows left out")


def _holds(words: list[str], by_word: dict[str, list[list[str]]]) -> bool:
    """Whether a text's words (a first user turn's, prompt_key'd) hold one of the keys as whole words."""
    return any(words[i:i + len(key)] == key for i, w in enumerate(words) for key in by_word.get(w, ()))


def _held_out_keys(cfg: Config) -> frozenset[str]:
    """The prompt_keys of the prompts a held-out evaluation scores (data.load_prompts(cfg, "eval"), training prompts
    left out; a chat prompt's user turns' text too, so a demonstration with another system turn is found); empty
    when the run has no held-out evaluation (eval.every 0, or the training set's)."""
    if not cfg.eval.every or not cfg.eval_is_held_out():
        return frozenset()
    ds, col = data.load_prompts(cfg, "eval"), cfg.data.prompt_column
    if col not in ds.column_names:
        return frozenset()
    keys = set()
    for value in ds[col]:
        keys.add(data.prompt_key(value))
        if isinstance(value, list):
            keys.add(data.prompt_key([m for m in value if isinstance(m, dict) and m.get("role") == "user"]))
    return frozenset(keys - {""} - data.training_prompt_keys(cfg))     # (a text every row shares names no task)


def _demonstration_keys(row: dict) -> tuple[set[str], str]:
    """A demonstration's prompt as _held_out_keys compares it: the keys of its prompt (the `prompt` column, or the
    messages before the first assistant turn: all of them, their user turns', the first user turn's), and the
    first user turn's key alone (a recorded episode's: an environment writes the task's prompt into it)."""
    prompt = row.get("prompt")
    if prompt is None and isinstance(row.get("messages"), list):
        messages = [m for m in row["messages"] if isinstance(m, dict)]
        first = next((k for k, m in enumerate(messages) if m.get("role") == "assistant"), len(messages))
        prompt = messages[:first]
    if isinstance(prompt, str):
        return {data.prompt_key(prompt)}, data.prompt_key(prompt)
    if not isinstance(prompt, list):
        return set(), ""
    users = [m for m in prompt if isinstance(m, dict) and m.get("role") == "user"]
    first_user = data.prompt_key(users[:1])
    return {data.prompt_key(prompt), data.prompt_key(users), first_user} - {""}, first_user


# ------------------------------------------------------------------------------------------ the schedule and loss

def schedule(n: int, cfg: Config) -> list[list[int]]:
    """The demonstrations of every optimizer step: each epoch a seeded permutation (run.seed, epoch) cut into
    warmup.batch_size (the last step of an epoch may be smaller); warmup.max_steps cuts or extends it."""
    w = cfg.warmup
    per_epoch, total = math.ceil(n / w.batch_size), steps_of(n, cfg)
    steps = []
    for epoch in range(math.ceil(total / per_epoch)):
        order = np.random.default_rng([cfg.run.seed, epoch]).permutation(n).tolist()
        steps += [order[i:i + w.batch_size] for i in range(0, n, w.batch_size)]
    return steps[:total]


def steps_of(n: int, cfg: Config) -> int:
    """The warm start's optimizer steps on `n` demonstrations: warmup.max_steps, else the epochs' (each
    ceil(n / warmup.batch_size))."""
    w = cfg.warmup
    return w.max_steps or math.ceil(n / w.batch_size) * w.epochs


def lr_at(cfg: Config, step: int, total: int) -> float:
    """warmup.lr at optimizer step `step` (0-based): linear warm-up, then constant or linear decay to 0."""
    w = cfg.warmup
    if step < w.lr_warmup_steps:
        return w.lr * (step + 1) / w.lr_warmup_steps
    if w.lr_schedule == "constant":
        return w.lr
    return w.lr * max(0.0, (total - step) / max(1, total - w.lr_warmup_steps))


def token_loss(model, ids: torch.Tensor, mask: torch.Tensor, attention: torch.Tensor,
               tokens: int) -> tuple[torch.Tensor, int]:
    """Cross-entropy summed over the masked next-token predictions of a micro-batch, over `tokens` (the whole
    step's count, so micro-batches add up to the step's mean: TRL's num_items_in_batch); and how many of them
    the model already predicted (argmax). The vocabulary's logits are computed only at the positions that
    predict a masked token in some row (logits_to_keep): a long page observed for a short action costs its
    forward pass, not a vocabulary-wide projection of every token."""
    at = mask[:, 1:].any(0).nonzero().squeeze(1)          # positions whose next token is learned in some row
    logits = model(input_ids=ids, attention_mask=attention, logits_to_keep=at).logits.float()
    target, keep = ids[:, at + 1], mask[:, at + 1].bool()
    ce = torch.nn.functional.cross_entropy(logits[keep], target[keep], reduction="sum")
    correct = int((logits[keep].argmax(-1) == target[keep]).sum())
    return ce / tokens, correct


def batch(demos: list[Demo], pad: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ids, masks and attention masks of some demonstrations."""
    width = max(len(d.ids) for d in demos)
    ids = torch.full((len(demos), width), pad, dtype=torch.long)
    mask = torch.zeros((len(demos), width), dtype=torch.long)
    attention = torch.zeros((len(demos), width), dtype=torch.long)
    for i, d in enumerate(demos):
        ids[i, :len(d.ids)] = torch.tensor(d.ids)
        mask[i, :len(d.ids)] = torch.tensor(d.mask)
        attention[i, :len(d.ids)] = 1
    return ids.to(device), mask.to(device), attention.to(device)


# ------------------------------------------------------------------------------------------ the stage

def v0_fingerprint(cfg: Config, store: Store | None = None, legacy: bool = False) -> tuple[str, dict]:
    """What v0 is made of: the base model, the warmup section, the train fields it uses, the data's bytes (a local
    file gone since v0 was made from it: the bytes v0's manifest names, `store` given; RL needs it no more), and
    with an environment the turn limit that cuts the demonstrations' model turns (`legacy`: without it, as v0s
    and checkpoints made before 2026-12-04 were fingerprinted: still taken)."""
    w, content = cfg.warmup, {}
    if Path(w.path).is_file():
        content = {"data_sha256": sha256_file(Path(w.path))}
    elif store is not None and data.looks_local(w.path) and \
            (v0 := store.manifest(layout.policy(cfg.run.name, 0))) is not None and \
            "data_sha256" in (made := v0.get("meta", {}).get("made_of", {})):
        content = {"data_sha256": made["data_sha256"]}
    used = {k: v for k, v in cfg.train.model_dump(mode="json").items() if k in TRAIN_FIELDS}
    if cfg.env.episodic() and not legacy:        # (demonstrations(): a model turn is cut where an episode's is)
        content["turn_limit"] = cfg.generate.max_completion_length
    return fingerprint(cfg, ("model", "warmup"), warmup_train=used, **content)


def _legacy(cfg: Config, store: Store | None, made: dict, was: dict | None, found: str | None) -> bool:
    """Whether an output fingerprinted before the turn limit was (`was`: its made_of, `found`: its fingerprint)
    is this config's all the same."""
    return "turn_limit" in made and "turn_limit" not in (was or {}) and \
        found == v0_fingerprint(cfg, store, legacy=True)[0]


def made_v0(cfg: Config, store: Store) -> dict | None:
    """v0 when it was made from these inputs, None when it is not made yet; one line otherwise (what changed)."""
    fp, made = v0_fingerprint(cfg, store)
    try:
        return reuse(store, layout.policy(cfg.run.name, 0), fp, made)
    except CorruptArtifact as e:      # (found by preflight, out of the flow's repair: the warm start makes it again)
        raise UserError(f"{e}; delete {store.uri(layout.policy(cfg.run.name, 0))} and the warm start makes it again"
                        ) from None
    except UserError:
        manifest = store.manifest(layout.policy(cfg.run.name, 0))
        was = manifest["meta"].get("made_of", {})
        if _legacy(cfg, store, made, was, manifest["meta"].get("fingerprint")):
            return result(store, layout.policy(cfg.run.name, 0), manifest)
        if was.get("data_sha256") not in (None, made.get("data_sha256")) and \
                {k: v for k, v in was.items() if k != "data_sha256"} == \
                {k: v for k, v in json.loads(json.dumps(made)).items() if k != "data_sha256"}:
            raise UserError(f"warmup.path: {cfg.warmup.path} changed since the run's v0 was made from it (its bytes "
                            f"differ); restore the file v0 was made from, or choose a new run.name") from None
        raise


def check_first(cfg: Config, store: Store) -> None:
    """v0 not made yet: the warm start comes first, so a run that has iterations already (trained from the base,
    the config then without warmup:) cannot have one now (its iterations' outputs would all be refused)."""
    run = cfg.run.name
    if store.list_folders(f"{run}/policy") or store.manifest(layout.rollouts(run, 1)) is not None:
        raise UserError(f"warmup: run {run} has iterations already, trained from {cfg.model.name_or_path} without a "
                        f"warm start, and v0 comes before them; remove warmup: to go on with that run, or choose a "
                        f"new run.name")


def resumable(cfg: Config, store: Store) -> str | None:
    """The warm start's newest checkpoint, when one was written by a warm start of these inputs (None: none); one
    line naming what changed otherwise (before anything is written: the flow's preflight asks it too)."""
    latest = store.get_pointer(layout.latest(sft_run(cfg), "trainer"))
    if latest is None or store.manifest(latest) is None:
        return None
    state = store.get_json(latest, layout.CKPT_STATE)
    fp, made = v0_fingerprint(cfg)
    if state.get("fingerprint") != fp and not _legacy(cfg, None, made, state.get("made_of"), state.get("fingerprint")):
        was = state.get("made_of")
        raise UserError(f"warmup: {store.uri(latest)} (a checkpoint of this run's warm start) was made from other "
                        f"demonstrations or settings" + (changed(was, made) if was is not None else
                                                         "; resume with the same config or choose a new run.name"))
    return latest


def sft_run(cfg: Config) -> str:
    """Where the warm start's trainer keeps its checkpoints: the run's `sft/` folder, laid out as a run's."""
    return f"{cfg.run.name}/sft"


def engine_config(cfg: Config) -> Config:
    """The config the engine opens with: the train section's optimizer and LoRA at warmup.lr, no KL reference,
    no value model, the checkpoints under sft_run(), and the policy written in model.dtype (v0 is the base RL
    trains from, not a sampler's copy: publish.dtype's bf16 would round it)."""
    from tasks.core.config import GrpoConfig

    train = cfg.train.model_copy(update={"lr": cfg.warmup.lr, "beta": 0.0, "algorithm": "grpo",
                                         "learner": GrpoConfig(), "micro_batch_size": cfg.warmup.micro_batch_size})
    run = cfg.run.model_copy(update={"name": sft_run(cfg)})
    publish = cfg.publish.model_copy(update={"dtype": cfg.model.dtype})
    return cfg.model_copy(update={"train": train, "run": run, "publish": publish})


def sft(cfg: Config, iteration: int = 0) -> dict:
    """The warm start: v0 from the demonstrations ({key, uri, metrics}); the one already published when it was made
    from the same inputs. `iteration` is unused (the stage command line's)."""
    if cfg.warmup is None:
        raise UserError("warmup: the config has no warmup section (SFT's demonstrations: warmup.path)")
    store, run = open_store(cfg), cfg.run.name
    key = layout.policy(run, 0)
    if (done := made_v0(cfg, store)) is not None:
        if store.list_folders(f"{sft_run(cfg)}/trainer"):
            _delete_checkpoints(store, sft_run(cfg))    # (left by a kill between v0's commit and their deletion)
        return done
    check_first(cfg, store)
    demos = check(cfg)
    previous = resumable(cfg, store)             # (here too: the deepspeed group would say it once per process)
    fp, made = v0_fingerprint(cfg, store)
    if cfg.train.engine == "deepspeed" and "RANK" not in os.environ:
        _torchrun(cfg)                           # the group trains and publishes; its result is read back
        if (done := reuse(store, key, fp, made)) is None:
            raise RuntimeError(f"warm start: the deepspeed group ended without publishing {store.uri(key)}")
        return done
    return _train(cfg, store, demos, key, fp, made, previous)


def _train(cfg: Config, store: Store, demos: list[Demo], key: str, fp: str, made: dict,
           previous: str | None) -> dict:
    """`previous`: the warm start's checkpoint to resume from (resumable), None: from the base."""
    w, ecfg = cfg.warmup, engine_config(cfg)
    plan = schedule(len(demos), cfg)
    history = list(store.get_json(previous, layout.CKPT_STATE)["history"]) if previous is not None else []
    engine = training_engine(ecfg).open(ecfg, store, previous)
    pad = engine.tokenizer.pad_token_id if engine.tokenizer.pad_token_id is not None else 0
    params = (engine.model.optimizer if cfg.train.engine == "deepspeed" else engine.optimizer).param_groups
    try:
        engine.model.train()
        for step in range(engine.global_step, len(plan)):
            lr = lr_at(cfg, step, len(plan))
            for group in params:
                group["lr"] = lr
            mine = plan[step][engine.rank::engine.world_size]
            weight = 1.0 if mine else 0.0    # (a process with none of a short step's: one weightless pass, so
            mine = mine or plan[step][:1]    # that every process's backward joins the step's reduction)
            tokens = sum(sum(demos[i].mask[1:]) for i in plan[step])
            engine.zero_grad()
            loss_sum = correct = 0.0
            for at in range(0, len(mine), w.micro_batch_size):
                ids, mask, attention = batch([demos[i] for i in mine[at:at + w.micro_batch_size]], pad,
                                             engine.device)
                loss, right = token_loss(engine.model, ids, mask, attention, tokens)
                engine.backward(loss * weight)
                loss_sum, correct = loss_sum + weight * float(loss.detach()), correct + weight * right
            loss_sum, correct = engine.sum([loss_sum, correct])
            grad_norm = engine.step()
            engine.global_step = step + 1
            history.append({"step": step + 1, "loss": loss_sum, "token_accuracy": correct / tokens,
                            "grad_norm": grad_norm, "lr": lr, "tokens": tokens})
            if engine.rank == 0 and ((step + 1) % 10 == 0 or step + 1 == len(plan)):
                print(f"sft step {step + 1:>5}/{len(plan)}  loss {loss_sum:.4f}  token accuracy "
                      f"{correct / tokens:.3f}", file=sys.stderr, flush=True)
            drill("sft-step", step + 1)
            if (step + 1) % w.checkpoint_every == 0 and step + 1 < len(plan):
                _checkpoint(ecfg, store, engine, step + 1, fp, made, history)
        done = _publish(cfg, store, engine, key, fp, made, history)
        if engine.rank == 0:         # v0 is committed: the warm start's checkpoints are never read again
            _delete_checkpoints(store, ecfg.run.name)
        return done
    finally:
        engine.close()


def _checkpoint(ecfg: Config, store: Store, engine, step: int, fp: str, made: dict, history: list[dict]) -> None:
    run = ecfg.run.name
    ckpt = layout.checkpoint(run, step)
    with tempfile.TemporaryDirectory(prefix="rlflow-sft-") as tmp:
        extra = engine.save(Path(tmp), step)
        if engine.rank != 0:
            return
        state = {"iteration": step, "step": step, "fingerprint": fp, "made_of": made, "history": history, **extra}
        (Path(tmp) / layout.CKPT_STATE).write_text(json.dumps(state))
        store.put_folder(ckpt, Path(tmp), meta={"fingerprint": fp, "kind": "full", "iteration": step},
                         give_up=True)
    store.advance_pointer(layout.latest(run, "trainer"), ckpt)
    _delete_checkpoints(store, run, keep=ckpt)


def _delete_checkpoints(store: Store, run: str, keep: str | None = None) -> None:
    """The warm start's checkpoints but `keep` (the newest, which trainer/LATEST names: a kill between the two
    leaves one more, removed next time), with the deepspeed shards (trainer-state/) that `keep` does not name."""
    named = set()
    if keep is not None:
        named = {p.rsplit("/", 1)[0] for p in store.get_json(keep, layout.CKPT_STATE).get("engine_state", [])}
    for name in store.list_folders(f"{run}/trainer"):
        if f"{run}/trainer/{name}" != keep:
            store.delete_folder(f"{run}/trainer/{name}")
    for name in store.list_folders(f"{run}/trainer-state"):
        if (folder := f"{run}/trainer-state/{name}") not in named:
            for node in store.list_folders(folder):
                store.delete_folder(f"{folder}/{node}")


def _publish(cfg: Config, store: Store, engine, key: str, fp: str, made: dict, history: list[dict]) -> dict:
    """v0: the trained policy as the engine writes it (publish.dtype; collective on deepspeed), a LoRA adapter
    merged into its base (RL then trains an adapter of its own on v0), then its manifest."""
    last = history[-1] if history else {}
    metrics = {"sft/steps": float(len(history)), "sft/loss": last.get("loss", 0.0),
               "sft/token_accuracy": last.get("token_accuracy", 0.0)}
    with tempfile.TemporaryDirectory(prefix="rlflow-v0-") as tmp:
        out = Path(tmp) / "policy"
        engine.save_policy(out)
        if engine.rank != 0:
            return {"key": key, "uri": store.uri(key), "metrics": metrics}
        if engine.lora:
            merged = Path(tmp) / "merged"
            with engine.loading_whole():
                load_policy(cfg, str(out), "cpu").merge_and_unload().save_pretrained(merged)
            engine.tokenizer.save_pretrained(merged)
            out = merged
        manifest = store.put_folder(key, out, meta={"fingerprint": fp, "made_of": made, "metrics": metrics,
                                                     "history": history, "iteration": 0}, give_up=True)
    return {"key": key, "uri": store.uri(key), "metrics": manifest["meta"]["metrics"]}


def _torchrun(cfg: Config) -> None:
    """The deepspeed group: this stage in train.num_processes processes (DeepSpeedEngine.torchrun), given the
    config as this process resolved it."""
    from tasks.engines.deepspeed_engine import DeepSpeedEngine

    argv, env = DeepSpeedEngine.torchrun(cfg)
    # (a folder of its own: load_config reads a relative path as relative to the config's folder first, so
    # `-o warmup.path=demos.jsonl` would find a demos.jsonl that happened to lie beside it, in $TMPDIR)
    with tempfile.TemporaryDirectory(prefix="rlflow-sft-") as tmp:
        config = Path(tmp) / "rlflow-resolved-config.json"
        config.write_text(json.dumps(cfg.model_dump(mode="json")))
        # (each process's result, the JSON stage_cli prints, is left out: the command says v0 in its own words)
        ran = stream([*argv, "-m", "tasks.sft", "--config", str(config), "--iteration", "0"], env,
                     sink=lambda line: line.startswith('{"key": ') or print(line, file=sys.stderr, flush=True))
    if ran.code != 0:
        raise_failure(ran, "warm start: the deepspeed group (torchrun)")


if __name__ == "__main__":
    from tasks.core.stage import stage_cli

    stage_cli(sft, "sft")
