"""Loading policies: a hub id, a local folder, a GGUF file, a builtin model, or a folder in the store (a published
policy, a checkpoint's model), as a full model or a LoRA adapter on the configured base; and their tokenizers.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tasks.core import builtin_models, gguf, layout
from tasks.core.data import cut_prompt
from tasks.core.errors import UserError
from tasks.core.hashing import known_sha256
from tasks.core.paths import file_uri_path
from tasks.core.policy import materialize
from tasks.core.process_wide import PROCESS_WIDE  # (why it exists: tasks/core/process_wide.py)
from tasks.core.store import open_store

if TYPE_CHECKING:
    from tasks.core.config import Config, TrainConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def device_for(cfg: Config) -> torch.device:
    want = cfg.train.device
    if want == "auto":
        want = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(want)


def policy_dtype(cfg: Config) -> str:
    """The dtype of published weights (publish.dtype; see its description for `auto`)."""
    if cfg.publish.dtype != "auto":
        return cfg.publish.dtype
    if cfg.train.engine == "deepspeed":
        return "bfloat16"
    full_fp32_on_gpu = cfg.model.dtype == "float32" and not cfg.train.lora_r and device_for(cfg).type == "cuda"
    return "bfloat16" if full_fp32_on_gpu else cfg.model.dtype


def policy_path(cfg: Config, policy: str) -> str:
    """`base` -> the configured starting model; otherwise a store key of a policy or checkpoint model (a delta
    policy is rebuilt whole: tasks/core/policy.py)."""
    if policy == layout.BASE:
        return base_path(cfg)
    return str(materialize(open_store(cfg), policy))


def base_path(cfg: Config) -> str:
    """The starting model (model.name_or_path) as a local folder or hub id: resolve()."""
    return resolve(cfg, cfg.model.name_or_path, "model.name_or_path", dtype=cfg.model.dtype)


def resolve(cfg: Config, name: str, field: str, pin: str | None = None, dtype: str = "float32") -> str:
    """A model a config names (the policy's base, a judge or a reward model) as what transformers loads, the one
    resolver of them all: a URI inside the store (a published policy, e.g. an earlier run's champion: fetched and
    verified into the local cache), models:/<name>/<version> (the registry's version, which names a policy in the
    store), a .gguf file (converted once per file and dtype: tasks/core/gguf.py), builtin:NAME, a saved model
    folder, or a hub id (a folder of the local cache where the Hub cannot be reached). `pin`: the sha256 the
    weights must have (pin_of; of the file itself for a GGUF), checked here; its mistakes name the field beside
    `field` (reward.models[1] (j).model -> reward.models[1] (j).sha256). Every mistake is one line naming `field`."""
    pin_field = f"{field.rpartition('.')[0]}.sha256"
    if name.startswith("models:/"):
        name = registered_uri(cfg, name, field)
    store = open_store(cfg)
    key = store_key(store, name, field)
    committed = key is not None and store.manifest(key) is not None
    # (a folder of the store's named by its path, not its URI, and that is no folder the store committed (a
    # checkpoint's model/, a model put there by hand): read as any saved model folder, as before)
    if committed or (key is not None and name.startswith(store.root.rstrip("/") + "/")):
        if not committed:
            raise UserError(f"{field}: {name}: no complete folder there")
        path = str(materialize(store, key))
    elif name.startswith("s3://"):
        raise UserError(f"{field}: {name}: an s3:// model must lie under store.uri ({store.root})")
    else:
        # (a file:// URI outside the store, such as another run's policy as rlflow prints it: that folder)
        path = builtin_models.resolve(_file_uri_path(name, field), field)
        if gguf.is_gguf(path):
            file = Path(path).expanduser()
            if (folder := gguf.converted(file, dtype)) is None:
                gguf.check(file, field)                   # (a missing or bad file: one line, not a hash)
            if pin is not None and (found := known_sha256(file)) != pin:
                raise UserError(f"{pin_field}: {name} has sha256 {found}, not the pinned {pin}")
            return folder or gguf.model_folder(path, dtype, field)
        looks_local = path.startswith(("/", "./", "../", "~")) or Path(path).expanduser().exists()
        if looks_local and not Path(path).expanduser().exists():
            raise UserError(f"{field}: {path}: no such file or folder")
        if looks_local and not (Path(path).expanduser() / "config.json").exists():
            raise UserError(f"{field}: {path}: no config.json (expected a saved model folder)")
        if looks_local and (Path(path).expanduser() / "delta.json").exists():     # (policy.DELTA_INDEX)
            raise UserError(f"{field}: {path}: a delta policy (its weights are a difference from another policy "
                            f"of its store): give its URI under store.uri, or a whole policy's folder")
        if not looks_local:
            path = hub_model(path, field, folder=pin is not None)
    if pin is not None and (found := pin_of(path)) != pin:
        raise UserError(f"{pin_field}: {name} has weights sha256 {found}, not the pinned {pin}")
    return path


def store_key(store, name: str, field: str) -> str | None:
    """The key in `store` a model name names, or None: its URI under store.uri, or (a local store) a path or
    file:// URI of a folder inside it however written (relative, through a link, with a trailing slash), so
    that such a folder is read as the store's folder (verified, a delta rebuilt), not as any folder."""
    root = store.root.rstrip("/")
    if name.startswith(root + "/"):
        return name[len(root) + 1:].rstrip("/") or None
    if not root.startswith("file://") or name.startswith(("s3://", "builtin:", "models:/")):
        return None
    path = Path(_file_uri_path(name, field)).expanduser()
    if not (path.is_absolute() or name.startswith((".", "file://")) or path.exists()):
        return None                                          # (a hub id)
    try:
        key = path.resolve().relative_to(Path(root[len("file://"):]).resolve()).as_posix()
    except ValueError:
        return None
    return None if key == "." else key


def _file_uri_path(name: str, field: str) -> str:
    """paths.file_uri_path, its refusal one line naming `field`."""
    try:
        return file_uri_path(name)
    except ValueError as e:
        raise UserError(f"{field}: {name}: {e}") from None


def pin_of(path: str) -> str:
    """A model's pin: the sha256 of its one weights file (or of a GGUF file itself), or of the sorted
    '<file> <sha256>' lines of several (shards)."""
    folder = Path(path)
    if folder.is_file():
        return known_sha256(folder)
    weights = sorted(p for p in folder.iterdir() if p.suffix in (".safetensors", ".bin", ".gguf", ".pt")
                     and not p.name.startswith(("training_args", "optimizer")))
    if not weights:
        raise UserError(f"reward.models: {path}: no weights file (*.safetensors, *.bin)")
    if len(weights) == 1:
        return known_sha256(weights[0])
    lines = "".join(f"{p.name} {known_sha256(p)}\n" for p in weights)
    return hashlib.sha256(lines.encode()).hexdigest()


def registered_uri(cfg: Config, uri: str, field: str) -> str:
    """The store URI of a registered model version (its rlflow.policy_uri tag, else its source)."""
    parts = uri[len("models:/"):].split("/")
    if len(parts) != 2 or not parts[1].isdigit():
        raise UserError(f"{field}: {uri}: expected models:/<name>/<version number> (a version pins the model; "
                        f"latest and aliases move)")
    from tasks.core.tracking import reading_client

    client = reading_client(cfg.tracking.uri, f"{field}: {uri}")
    try:
        version = client.get_model_version(parts[0], parts[1])
    except Exception as e:  # noqa: BLE001 - MLflow's own errors, one line
        raise UserError(f"{field}: {uri}: not in the model registry at {cfg.tracking.uri} "
                        f"({str(e).splitlines()[0][:160]})") from None
    source = (version.tags or {}).get("rlflow.policy_uri") or version.source
    if not source or source.startswith(("runs:/", "models:/")):
        raise UserError(f"{field}: {uri}: its source {source!r} is not a model folder rlflow can read")
    return source


def hub_model(name: str, field: str = "model.name_or_path", folder: bool = False) -> str:
    """A hub id as what transformers loads: the id itself when the Hub answers here (it downloads, or says at once
    that there is no such repository; `folder`: downloaded here and its folder, for a pin to be checked); without
    the Hub (no network, HF_HUB_OFFLINE=1) the local cache's snapshot folder, or one line saying it is not there:
    transformers would retry for ~50 s first, a line per retry."""
    from tasks.core.data import _hub_reachable

    reachable = _hub_reachable()
    if reachable and not folder:
        return name
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return snapshot_download(name, local_files_only=not reachable)
    except (LocalEntryNotFoundError, ValueError, OSError):
        raise UserError(f"{field}: {name!r} is not a local folder nor in the Hugging Face cache "
                        f"({constants.HF_HUB_CACHE}), and the Hub cannot be reached from here (no network, or "
                        f"HF_HUB_OFFLINE=1); give a model folder, or download it first where there is network "
                        f"(`hf download {name}`)") from None


def in_hub_cache(name: str) -> bool:
    """Whether this machine's Hugging Face cache holds the hub model `name` (no network asked)."""
    from huggingface_hub import snapshot_download

    try:
        snapshot_download(name, local_files_only=True)
    except Exception:  # noqa: BLE001 - not cached, or not a hub id
        return False
    return True


_tokenizers: dict[bytes, object] = {}     # by the bytes of a folder's tokenizer files (see load_tokenizer)
_TOKENIZER_FILES = ("tokenizer", "vocab", "merges", "special_tokens", "added_tokens", "chat_template", "spiece",
                    "generation_config")      # (its stop ids: stop_token_ids)


def load_tokenizer(path: str):
    """The tokenizer of a model folder or hub id. Every policy of a run has the same tokenizer files in a new
    folder: a tokenizer already loaded from the same bytes (config.json and every tokenizer* / vocab / merges /
    special-token / chat-template file) is shared instead of built again (~2 ms for the demo's, ~0.5 s for a
    real vocabulary; reading and hashing the files costs a tenth of that). Callers never modify it."""
    from transformers import AutoTokenizer

    folder, key = Path(path), None
    if folder.is_dir():
        h = hashlib.sha256()
        for f in sorted(folder.iterdir()):
            if f.is_file() and (f.name == "config.json" or f.name.startswith(_TOKENIZER_FILES)):
                h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
        key = h.digest()
        if key in _tokenizers:
            return _tokenizers[key]
    try:
        tok = AutoTokenizer.from_pretrained(path)
    except OSError as e:
        raise UserError(f"model.name_or_path: cannot load tokenizer from {path!r}: "
                        f"{str(e).splitlines()[0][:200]}") from None
    except (ValueError, ImportError, KeyError, TypeError) as e:    # (a folder without tokenizer files, or others')
        what = " (expected its tokenizer files: tokenizer.json or tokenizer.model, tokenizer_config.json)" \
            if folder.is_dir() else ""
        raise UserError(f"model.name_or_path: cannot load tokenizer from {path!r}{what}: {type(e).__name__}: "
                        f"{(str(e).splitlines() or [''])[0][:200]}") from None
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    stop_token_ids(tok, path, keep=True)   # (read now: a policy's folder may be gone by the time it samples)
    if key is not None:
        if len(_tokenizers) >= 4:
            _tokenizers.clear()
        _tokenizers[key] = tok
    return tok


def stop_token_ids(tokenizer, path: str | None = None, keep: bool = False) -> list[int]:
    """The ids that end a completion: the tokenizer's EOS, then each other eos_token_id of the model's
    generation config (an int or a list: Qwen2.5-Instruct's <|im_end|> and <|endoftext|>, Llama-3.1-Instruct's
    three), as transformers' generate under the model's own config and vLLM stop on each; the EOS alone where the
    model has none. `path`: the model folder or hub id (default: the one the tokenizer was loaded from; a LoRA
    adapter's folder reads its base model's). Kept on the tokenizer when read from its own folder, or with `keep`
    (load_tokenizer reads it as it loads: a policy's folder may be gone by the time it samples)."""
    if path is None and (known := getattr(tokenizer, "_rlflow_stop_ids", None)) is not None:
        return list(known)
    ids = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    more = _model_eos(path or tokenizer.name_or_path)
    for i in more if isinstance(more, list | tuple) else [more]:
        if i is not None and int(i) not in ids:
            ids.append(int(i))
    if keep or path is None:
        tokenizer._rlflow_stop_ids = tuple(ids)
    return ids


def _model_eos(path: str, adapter: bool = True):
    """eos_token_id of the model's generation_config.json, else of its config.json (from which transformers makes
    the generation config of a model without one); a LoRA adapter's folder (peft writes neither): its base
    model's, as adapter_config.json names it. None: no such file (a GGUF file's folder, a bare tokenizer)."""
    from transformers import AutoConfig, GenerationConfig

    for read in (GenerationConfig.from_pretrained, AutoConfig.from_pretrained):
        try:
            return read(path).eos_token_id
        except Exception:  # noqa: BLE001 - not there, or not readable: the next source
            pass
    try:
        base = json.loads((Path(path) / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")
    except (OSError, ValueError, AttributeError):
        return None
    return _model_eos(base, adapter=False) if adapter and isinstance(base, str) and base else None


def ended_at(toks: list[int], stops: list[int]) -> int | None:
    """The length of `toks` up to its first stop token, that token kept (None: none in it)."""
    return next((i + 1 for i, t in enumerate(toks) if t in stops), None)


def load_model(path: str, dtype: str = "float32", device: torch.device | str = "cpu"):
    from transformers import AutoModelForCausalLM

    try:
        with PROCESS_WIDE:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype])
    except OSError as e:
        raise UserError(f"model.name_or_path: cannot load model from {path!r}: "
                        f"{str(e).splitlines()[0][:200]}") from None
    return model.to(device)


ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"     # (peft's SAFETENSORS_WEIGHTS_NAME: what save_pretrained writes)


def load_policy(cfg: Config, path: str, device: torch.device | str, trainable: bool = False):
    """A full model folder, or a LoRA adapter folder (peft) applied to the configured base model."""
    if not (Path(path) / ADAPTER_CONFIG).exists():
        return load_model(path, cfg.model.dtype, device)
    from peft import PeftModel

    base = load_model(base_path(cfg), cfg.model.dtype, device)
    with PROCESS_WIDE:
        return PeftModel.from_pretrained(base, path, is_trainable=trainable)


def add_lora(model, tc: TrainConfig):
    """Wrap a base model with fresh LoRA adapters (B = 0: the wrapped model starts equal to the base)."""
    from peft import LoraConfig, get_peft_model

    with PROCESS_WIDE:
        return get_peft_model(model, LoraConfig(r=tc.lora_r, lora_alpha=tc.lora_alpha, lora_dropout=tc.lora_dropout,
                                                target_modules=tc.lora_target_modules, task_type="CAUSAL_LM"))


def checkpointing(model, tc: TrainConfig):
    """The model with train.gradient_checkpointing applied (non-reentrant: no input needs requires_grad, so LoRA
    and ZeRO-3's partitioned weights work unchanged). Only training-mode forwards recompute: evaluation is as
    before."""
    if tc.gradient_checkpointing:             # (transformers 5 renamed it; older ones have only the first name)
        enable = getattr(model, "activation_checkpointing_enable", None)
        if enable is not None:
            enable({"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def check_lora_targets(cfg: Config, path: str) -> None:
    """One UserError line if train.lora_target_modules names modules the model does not have: peft's own check,
    on a copy of the model without weights (meta device), before anything runs."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if not (Path(path) / "config.json").is_file():
        return
    try:
        with PROCESS_WIDE, torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
            add_lora(model, cfg.train)
    except ValueError as e:
        raise UserError(f"train.lora_target_modules: {cfg.train.lora_target_modules!r}: "
                        f"{str(e).strip().splitlines()[0][:200]}") from None


def encode_prompt(tokenizer, prompt, max_length: int) -> list[int]:
    """A string is tokenised as is; a list of chat messages goes through the tokenizer's chat template."""
    if isinstance(prompt, list):
        if not tokenizer.chat_template:
            raise UserError("data.prompt_column: chat-message prompts need a tokenizer with a chat template")
        try:
            prompt = parts_as_text(tokenizer, prompt)
        except ValueError as e:
            raise UserError(f"data.prompt_column: {e}") from None
        ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    else:
        ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    return cut_prompt(list(ids), max_length)


def parts_as_text(tokenizer, messages: list[dict]) -> list[dict]:
    """`messages` as the tokenizer's chat template can take them: where the template writes a content that is a
    list of parts out as Python text (a text model's: content is a string to it), each such list of text parts
    becomes the one string of their texts; a part that is not text there is refused (ValueError)."""
    if not any(isinstance(m.get("content"), list) for m in messages) or _takes_parts(tokenizer):
        return messages
    out = []
    for j, m in enumerate(messages):
        content = m.get("content")
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                kinds = sorted({str(p.get("type")) if isinstance(p, dict) else type(p).__name__ for p in content})
                raise ValueError(f"message {j}: content parts of kinds {kinds}; this model's chat template takes "
                                 f"text only (expected a string, or parts {{\"type\": \"text\", \"text\": ...}})")
            m = {**m, "content": "".join(p["text"] for p in content)}
        out.append(m)
    return out


_TAKES_PARTS: dict[str, bool] = {}      # by chat template


def _takes_parts(tokenizer) -> bool:
    """Whether the tokenizer's chat template renders a content given as a list of parts by their text (a
    multimodal model's does; a text model's writes the list out as it is). Asked once per template."""
    key = str(tokenizer.chat_template)
    if key not in _TAKES_PARTS:
        _TAKES_PARTS[key] = _renders_parts(tokenizer)
    return _TAKES_PARTS[key]


def _renders_parts(tokenizer) -> bool:
    probe = "\u2603parts-probe\u2603"
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": probe}]}],
                                             tokenize=False)
    except Exception:  # noqa: BLE001 - a template that refuses lists: joined texts are what it can take
        return False
    return probe in text and "'type'" not in text and '"type"' not in text


def context_length(path: str) -> int | None:
    """A model's context (its config's max_position_embeddings), or None when the config does not say."""
    from transformers import AutoConfig

    return getattr(AutoConfig.from_pretrained(path), "max_position_embeddings", None)


# The config keys vLLM reads a model's context from, the smallest found (vllm/transformers_utils/
# model_arch_config_convertor.py), and the RoPE scalings whose context is already the scaled one (vllm/config/model.py)
CONTEXT_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "model_max_length",
                "max_target_positions", "max_sequence_length", "max_seq_length", "seq_len")
_SCALED_ALREADY = ("su", "longrope", "llama3", "yarn", "deepseek_yarn", "deepseek_llama_scaling")


def engine_context(path: str) -> tuple[int, str, bool] | None:
    """The context vLLM derives for a model as the bound of its max_model_len (vllm/config/model.py:
    _get_and_verify_max_len): its config's smallest length key, within its tokenizer's model_max_length, times a
    RoPE scaling factor; with what says it, and whether the positions are rotary (past the context a RoPE model
    runs, degraded; one with learned positions fails). None when nothing says."""
    from transformers import AutoConfig
    from transformers.models.auto.tokenization_auto import get_tokenizer_config

    config = AutoConfig.from_pretrained(path)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    found = [(v, f"its config's {k}") for k in CONTEXT_KEYS
             if isinstance(v := getattr(config, k, None), int) and not isinstance(v, bool)]
    said = get_tokenizer_config(path).get("model_max_length")
    if found and isinstance(said, int) and not isinstance(said, bool):
        found.append((said, "its tokenizer's model_max_length"))
    if not found:
        return None
    length, key = min(found)
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope = [rope] if "rope_type" in rope or "type" in rope else [r for r in rope.values() if isinstance(r, dict)]
    factor = 1.0
    for r in rope:
        if r.get("rope_type", r.get("type")) not in _SCALED_ALREADY and r.get("factor"):
            factor = r["factor"]
    if "gemma3" not in getattr(config, "model_type", ""):
        length = int(length * factor)
    return length, key, bool(rope)


def policy_gguf(cfg: Config, store, key: str, dest: Path, quant: str) -> dict:
    """The policy at `key` as one GGUF file (tasks/core/gguf.py: write_gguf; `rlflow export --format gguf`); a LoRA
    adapter is merged into the configured base model first. The architecture is checked from config.json before
    any weight is read."""
    from transformers import AutoConfig

    from tasks.core.stage import quiet_progress_bars

    quiet_progress_bars()
    folder = materialize(store, key)
    lora = (folder / ADAPTER_CONFIG).exists()
    base = base_path(cfg) if lora else None              # (resolved once, for the check and the config)
    if lora and (trained := json.loads((folder / ADAPTER_CONFIG).read_text()).get("base_model_name_or_path")) \
            and Path(trained).exists() and Path(trained).resolve() != Path(base).resolve():
        raise UserError(f"model.name_or_path: the adapter {key} was trained on {trained}, not on the config's "
                        f"{cfg.model.name_or_path} ({base}): merged into it, it would be other weights")
    gguf.exportable(AutoConfig.from_pretrained(base if lora else folder))
    if lora:
        model = load_policy(cfg.model_copy(update={"model": cfg.model.model_copy(update={"dtype": "float32"})}),
                            str(folder), torch.device("cpu")).merge_and_unload()
    else:
        model = load_model(str(folder), "float32")
    tokenizer = load_tokenizer(str(folder) if (folder / "tokenizer_config.json").exists() else base_path(cfg))
    return gguf.write_gguf(model, tokenizer, dest, quant, pre=gguf.start_tokenizer_pre(cfg.model.name_or_path),
                           name=f"{cfg.run.name} {key.rstrip('/').rsplit('/', 1)[-1]}")
