"""GGUF files (llama.cpp, Ollama) as starting policies: converted once into an ordinary model folder.

    folder = model_folder("/models/SmolLM2-135M-Instruct.Q4_1.gguf", "float32")   # a transformers folder

`model.name_or_path` may name a `.gguf` file (or `builtin:smollm2-135m`, tasks/core/builtin_models.py). It is
read by transformers' own GGUF loader (`from_pretrained(folder, gguf_file=...)`, which dequantizes every tensor),
and saved with `save_pretrained` in the dtype the run asks for, under the local cache keyed by the file's sha256
and that dtype. Everything downstream (hf and vLLM sampling, the torch and DeepSpeed trainers, LoRA, publish,
export, MLflow) then sees a plain model folder; nothing after this module knows the start was a GGUF.

Before anything is converted, the file's header is read (`check`): a file that is not GGUF, is truncated, or
holds an architecture transformers cannot dequantize into a causal LM is one UserError line naming the file.
More: docs/internals.md (tasks/core/gguf.py): why convert, and two processes converting at once.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import warnings
from pathlib import Path

from tasks.core.errors import UserError
from tasks.core.hashing import known_sha256, remembered_sha256
from tasks.core.paths import cache_root

SUFFIX = ".gguf"
FIELD = "model.name_or_path"
PROVENANCE = "rlflow_gguf.json"     # written into the folder: where its weights came from


def is_gguf(path: str) -> bool:
    return path.lower().endswith(SUFFIX)


def check(path: Path, field: str = FIELD) -> str:
    """Read the header (no tensors): the architecture when transformers can load it as a causal LM, else one
    UserError line."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if path.is_dir():
        raise UserError(f"{field}: {path}: a folder; expected a GGUF file")
    if not path.is_file():
        raise UserError(f"{field}: {path}: no such GGUF file")
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise UserError(f"{field}: {path}: not a GGUF file (its first bytes are not 'GGUF')")
    try:
        import gguf  # noqa: F401 - transformers' GGUF reader needs it
    except ImportError:
        raise UserError(f"{field}: {path}: reading GGUF files needs the gguf package (pip install gguf)") from None
    from transformers import AutoConfig

    try:           # the header only, through the loader from_pretrained uses (no tensors read)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    except Exception as e:  # noqa: BLE001 - gguf/transformers raise many types for a bad file: one line
        msg = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        unknown = re.search(r"architecture (\S+) is not supported", msg)
        if unknown:
            raise UserError(f"{field}: {path}: GGUF architecture {unknown.group(1)!r} is not one transformers can "
                            f"load from GGUF (e.g. llama, mistral, qwen2, qwen3, gemma3, phi3)") from None
        raise UserError(f"{field}: {path}: cannot read this GGUF file (damaged or cut short?): {msg}") from None
    model_type = getattr(config, "model_type", None)
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise UserError(f"{field}: {path}: architecture {model_type!r} is not a causal language model transformers "
                        f"can build from GGUF")
    return model_type


def converted(file: Path, dtype: str) -> str | None:
    """The folder converted before from this exact file in `dtype` (the file known by its identity: its hash is
    remembered, tasks/core/hashing.py), else None. Nothing is read: a converted file was checked when it was
    converted, and reading its header again costs ~3 s for SmolLM2's (its vocabulary), at every resolve."""
    digest = remembered_sha256(file) if file.is_file() else None
    target = _target(digest, dtype) if digest else None
    return str(target) if target is not None and (target / "config.json").is_file() else None


def _target(digest: str, dtype: str) -> Path:
    return cache_root() / "gguf" / f"{digest[:16]}-{dtype}"


def model_folder(path: str, dtype: str, field: str = FIELD) -> str:
    """The converted folder of GGUF file `path` in `dtype` (made on first use; UserError for a bad file)."""
    file = Path(path).expanduser()
    if file.is_dir():
        raise UserError(f"{field}: {file}: a folder; expected a GGUF file")
    if not file.is_file():
        raise UserError(f"{field}: {file}: no such GGUF file")
    digest = known_sha256(file)
    target = _target(digest, dtype)
    if (target / "config.json").is_file():
        return str(target)
    check(file, field)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    tmp.chmod(0o755)          # (mkdtemp's is 0700: the folder is read like any model folder)
    try:
        _convert(file, dtype, tmp, field)
        (tmp / PROVENANCE).write_text(json.dumps({"gguf_file": str(file.resolve()), "sha256": digest,
                                                  "dtype": dtype}, indent=1))
        try:
            os.rename(tmp, target)          # atomic; a concurrent converter may have won: then keep theirs
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(target)


def _convert(file: Path, dtype: str, out: Path, field: str = FIELD) -> None:
    """transformers' GGUF loader (dequantizes), then save_pretrained as a plain model in `dtype`."""
    import torch
    import transformers.modeling_gguf_pytorch_utils as gguf_utils
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
    from transformers.utils import logging as hf_logging

    from tasks.core.process_wide import PROCESS_WIDE

    verbosity, bars, per_tensor_bar = (hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled(),
                                       gguf_utils.tqdm)
    hf_logging.set_verbosity_error()            # progress bars and notes on stderr: not on a user's console
    hf_logging.disable_progress_bar()
    gguf_utils.tqdm = lambda items, **_: items
    try:
        with PROCESS_WIDE, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                tokenizer = AutoTokenizer.from_pretrained(file.parent, gguf_file=file.name)
                # dequantize: always dense weights (with the `kernels` package some architectures would otherwise
                # keep their blocks packed, and save_pretrained would write the packed bytes)
                model = AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name,
                                                             dtype=getattr(torch, dtype),  # float32 | bfloat16 | …
                                                             quantization_config=GgufConfig(dequantize=True))
            except (ValueError, KeyError, NotImplementedError, RuntimeError, TypeError) as e:
                msg = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
                raise UserError(f"{field}: {file}: transformers cannot convert this GGUF file: {msg}") from None
            # A model loaded from GGUF carries a quantizer marker that save_pretrained refuses; its weights are
            # already dequantized, so the folder is a plain model once the marker goes.
            model.hf_quantizer = None
            if hasattr(model.config, "quantization_config"):
                del model.config.quantization_config
            if tokenizer.pad_token_id is None:
                tokenizer.pad_token = tokenizer.eos_token
            pre = _stated_pre(file)
            if pre is not None:         # (llama.cpp's pre-tokenizer name: what an export back to GGUF states)
                tokenizer.init_kwargs[TOKENIZER_PRE] = pre
            model.save_pretrained(out)
            tokenizer.save_pretrained(out)
    finally:
        hf_logging.set_verbosity(verbosity)
        gguf_utils.tqdm = per_tensor_bar
        if bars:
            hf_logging.enable_progress_bar()


# ---------------------------------------------------------------------------------------------------------------
# Out: a policy as a GGUF file (`rlflow export CONFIG VERSION FILE.gguf --format gguf --quant q8_0`)
#
# Written with the gguf package's own GGUFWriter and tensor-name map, the way llama.cpp's convert_hf_to_gguf.py
# writes these architectures: q/k projections of llama permuted into llama.cpp's rotary layout, 1-D tensors
# (norms, biases) in F32 whatever the quantization, an output matrix tied to the embedding left out. The
# tokenizer travels as llama.cpp reads it: the vocabulary in byte-level spelling, merges, token types (control
# for special tokens, user-defined for added ones), bos/eos/unk/pad ids, whether BOS is added, the pre-tokenizer
# name, and the chat template. What cannot be carried faithfully (an architecture the map lacks, a rope scaling
# transformers' GGUF loader ignores, a tokenizer that is neither byte-level BPE nor sentencepiece BPE) is one
# UserError line before anything is written.

QUANTS = ("f32", "f16", "q8_0")
# transformers model_type -> (GGUF architecture, q/k permuted into llama.cpp's rotary layout)
EXPORT_ARCHS: dict[str, tuple[str, bool]] = {"llama": ("llama", True), "qwen2": ("qwen2", False),
                                             "qwen3": ("qwen3", False)}
# kept in tokenizer_config.json of a folder converted from GGUF: llama.cpp's name of its pre-tokenizer
TOKENIZER_PRE = "gguf_tokenizer_pre"
_Q8_BLOCK = 32
READER_QWEN3_HEAD_DIM = 128


def exportable(config, field: str = "VERSION") -> tuple[str, bool]:
    """(GGUF architecture, permute q/k) for a model config, or one UserError line saying what stops it."""
    mt = getattr(config, "model_type", None)
    if mt not in EXPORT_ARCHS:
        raise UserError(f"{field}: architecture {mt!r} cannot be written as GGUF by rlflow (it writes "
                        f"{', '.join(sorted(EXPORT_ARCHS))}); export it as a folder (--format folder) and convert "
                        f"it with llama.cpp's convert_hf_to_gguf.py")
    rope = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
        raise UserError(f"{field}: rope scaling {rope.get('rope_type', rope.get('type'))!r} is not carried by "
                        f"transformers' GGUF reader: a GGUF written here would not compute what the policy does")
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    # The file states key_length (llama.cpp reads it), but transformers' GGUF reader does not: it builds Llama and
    # Qwen2 with hidden_size / heads, and Qwen3 with Qwen3Config's default 128 (every released Qwen3's).
    if mt == "qwen3" and head_dim != READER_QWEN3_HEAD_DIM:
        raise UserError(f"{field}: qwen3 with head_dim {head_dim}: transformers' GGUF reader builds Qwen3 with "
                        f"head_dim {READER_QWEN3_HEAD_DIM}, so the file would not read back as this model")
    if mt != "qwen3" and head_dim * heads != config.hidden_size:
        raise UserError(f"{field}: {mt} with head_dim {head_dim} != hidden_size / num_attention_heads "
                        f"({config.hidden_size} / {heads}): transformers' GGUF reader assumes they are equal")
    return EXPORT_ARCHS[mt]


def _permute(w, n_head: int):
    """llama.cpp's rotary layout of a q or k projection (convert_hf_to_gguf.py's LlamaModel.permute)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape))


def _tokenizer_fields(tokenizer, n_rows: int, pre: str | None) -> dict:
    """What llama.cpp (and transformers' GGUF reader) need of a tokenizer, or one UserError line."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        raise UserError(f"VERSION: a {model.get('type')} tokenizer cannot be written as GGUF by rlflow (BPE only: "
                        f"byte-level as GPT-2/Llama 3/Qwen/SmolLM, or sentencepiece BPE as Llama 2/Mistral)")

    def has(node, kind: str) -> bool:
        if isinstance(node, dict):
            return node.get("type") == kind or any(has(v, kind) for v in node.values())
        return isinstance(node, list) and any(has(v, kind) for v in node)

    sentencepiece = bool(model.get("byte_fallback")) or has(spec.get("pre_tokenizer"), "Metaspace") \
        or has(spec.get("decoder"), "Metaspace")
    added = {t["id"]: t for t in spec.get("added_tokens") or []}
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    types = []
    for i, token in enumerate(tokens):
        if i in added:
            types.append(3 if added[i].get("special") else 4)        # CONTROL | USER_DEFINED
        elif sentencepiece and re.fullmatch(r"<0x[0-9A-Fa-f]{2}>", token or ""):
            types.append(6)                                          # BYTE
        else:
            types.append(1)                                          # NORMAL
            if not sentencepiece and not set(token) <= alphabet:     # a plain vocabulary: its byte-level spelling
                tokens[i] = "".join(spelling[b] for b in token.encode("utf-8"))
    if tokenizer.unk_token_id is not None and types[tokenizer.unk_token_id] == 1:
        types[tokenizer.unk_token_id] = 2                            # UNKNOWN
    if len(tokens) > n_rows:
        raise UserError(f"VERSION: the tokenizer has {len(tokens)} tokens, the embedding {n_rows} rows")
    for i in range(len(tokens), n_rows):                  # rows past the vocabulary (padded embeddings): unused
        tokens.append(f"[PAD{i}]")
        types.append(5)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    if pre is None:
        pre = _pre_name(spec) if not sentencepiece else "default"
    probe = tokenizer("a", add_special_tokens=True)["input_ids"]
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    fields = {"model": "llama" if sentencepiece else "gpt2", "pre": pre, "tokens": tokens, "types": types,
              "merges": merges, "add_bos": bool(probe[:1] != plain[:1] and probe[0] == tokenizer.bos_token_id),
              "add_eos": bool(probe[-1:] != plain[-1:] and probe[-1] == tokenizer.eos_token_id),
              "chat_template": tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else None}
    if sentencepiece or not merges:   # llama.cpp's sentencepiece merges by score: a merge's rank, best first
        rank = {m.replace(" ", ""): r for r, m in enumerate(merges)}   # (no merges: what a reader derives them from)
        fields["scores"] = [-float(rank.get(t, 0)) for t in tokens]
    for name in ("bos", "eos", "unk", "pad"):
        fields[name] = getattr(tokenizer, f"{name}_token_id", None)
    return fields


def _pre_name(spec: dict) -> str:
    """llama.cpp's name of the pre-tokenizer a byte-level tokenizer.json uses (its Split regex), else gpt-2's."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS

    def patterns(node):
        if isinstance(node, dict):
            if node.get("type") == "Split":
                yield (node.get("pattern") or {}).get("Regex")
            for v in node.values():
                yield from patterns(v)
        elif isinstance(node, list):
            for v in node:
                yield from patterns(v)

    names = {regex: name for name, regex in reversed(list(GGUF_PRE_TOKENIZER_SPLITS.items()))}
    names.update({GGUF_PRE_TOKENIZER_SPLITS["llama3"]: "llama-bpe", GGUF_PRE_TOKENIZER_SPLITS["qwen2"]: "qwen2"})
    for regex in patterns(spec.get("pre_tokenizer")):
        if regex in names:
            return names[regex]
    return "gpt-2"


def start_tokenizer_pre(name_or_path: str) -> str | None:
    """The pre-tokenizer name a starting GGUF file states (None when the start is not a GGUF file)."""
    from tasks.core.builtin_models import resolve

    path = resolve(name_or_path) if name_or_path.startswith("builtin:") else name_or_path
    if not is_gguf(path) or not Path(path).is_file():
        return None
    return _stated_pre(Path(path))


def _stated_pre(file: Path) -> str | None:
    """The pre-tokenizer name (tokenizer.ggml.pre) a GGUF file states, if it states one."""
    import gguf as gguf_pkg

    field = gguf_pkg.GGUFReader(str(file)).fields.get("tokenizer.ggml.pre")
    return field.contents() if field is not None else None


def write_gguf(model, tokenizer, dest: Path, quant: str = "f16", pre: str | None = None,
               name: str | None = None) -> dict:
    """Write `model` (a transformers causal LM, LoRA already merged) and `tokenizer` as one GGUF file at `dest`
    (written under a temporary name, then renamed). Returns what was written: tensors per type, bytes."""
    import gguf as gguf_pkg
    import numpy as np
    import torch
    from gguf import GGMLQuantizationType as Q

    if quant not in QUANTS:
        raise UserError(f"--quant: expected one of {', '.join(QUANTS)}, got {quant!r}")
    config = model.config
    arch, permute = exportable(config)
    n_blocks = config.num_hidden_layers
    heads, kv_heads = config.num_attention_heads, getattr(config, "num_key_value_heads", None) or \
        config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    state = {k: v.detach().to(torch.float32).cpu().numpy() for k, v in model.state_dict().items()}
    tied = bool(getattr(config, "tie_word_embeddings", False))
    if tied:
        state.pop("lm_head.weight", None)
    n_rows = state["model.embed_tokens.weight"].shape[0]
    tok = _tokenizer_fields(tokenizer, n_rows, pre or tokenizer.init_kwargs.get(TOKENIZER_PRE))

    names = gguf_pkg.get_tensor_name_map(next(a for a, n in gguf_pkg.MODEL_ARCH_NAMES.items() if n == arch),
                                         n_blocks)
    tensors = []
    for key, w in state.items():
        if key.endswith("rotary_emb.inv_freq"):
            continue
        gname = names.get_name(key, try_suffixes=(".weight", ".bias"))
        if gname is None:
            raise UserError(f"VERSION: tensor {key!r} has no GGUF name for architecture {arch!r} (the gguf "
                            f"package's map); this model cannot be written as GGUF by rlflow")
        if permute and key.endswith("self_attn.q_proj.weight"):
            w = _permute(w, heads)
        elif permute and key.endswith("self_attn.k_proj.weight"):
            w = _permute(w, kv_heads)
        tensors.append((gname, w))

    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.partial-{os.getpid()}")
    file_type = {"f32": gguf_pkg.LlamaFileType.ALL_F32, "f16": gguf_pkg.LlamaFileType.MOSTLY_F16,
                 "q8_0": gguf_pkg.LlamaFileType.MOSTLY_Q8_0}[quant]
    counts: dict[str, int] = {}
    writer = gguf_pkg.GGUFWriter(str(tmp), arch)
    try:
        writer.add_type(gguf_pkg.GGUFType.MODEL)
        if name:
            writer.add_name(name)
        writer.add_block_count(n_blocks)
        writer.add_context_length(config.max_position_embeddings)
        writer.add_embedding_length(config.hidden_size)
        writer.add_feed_forward_length(config.intermediate_size)
        writer.add_head_count(heads)
        writer.add_head_count_kv(kv_heads)
        rope = dict(getattr(config, "rope_parameters", None) or {})
        writer.add_rope_freq_base(float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))))
        writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
        writer.add_rope_dimension_count(head_dim)
        if arch == "qwen3":
            writer.add_key_length(head_dim)
            writer.add_value_length(head_dim)
        writer.add_vocab_size(n_rows)
        writer.add_file_type(file_type)
        writer.add_quantization_version(gguf_pkg.GGML_QUANT_VERSION)
        writer.add_tokenizer_model(tok["model"])
        writer.add_tokenizer_pre(tok["pre"])
        writer.add_token_list(tok["tokens"])
        writer.add_token_types(tok["types"])
        if "scores" in tok:
            writer.add_token_scores(tok["scores"])
        writer.add_token_merges(tok["merges"])      # (llama.cpp requires the key for BPE, even empty)
        for key, add in (("bos", writer.add_bos_token_id), ("eos", writer.add_eos_token_id),
                         ("unk", writer.add_unk_token_id), ("pad", writer.add_pad_token_id)):
            if tok[key] is not None:
                add(tok[key])
        writer.add_add_bos_token(tok["add_bos"])
        writer.add_add_eos_token(tok["add_eos"])
        if tok["chat_template"]:
            writer.add_chat_template(tok["chat_template"])
        for gname, w in tensors:
            if w.ndim < 2 or quant == "f32":
                data, qtype = w.astype(np.float32), Q.F32
            elif quant == "q8_0" and w.shape[-1] % _Q8_BLOCK == 0:
                data, qtype = gguf_pkg.quants.quantize(w, Q.Q8_0), Q.Q8_0
            else:                         # f16, and q8_0's rows that are not whole blocks (llama.cpp does the same)
                data, qtype = w.astype(np.float16), Q.F16
            writer.add_tensor(gname, data, raw_dtype=qtype if qtype == Q.Q8_0 else None)
            counts[qtype.name] = counts.get(qtype.name, 0) + 1
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.rename(tmp, dest)
    finally:
        writer.close()
        if tmp.exists():
            tmp.unlink()
    return {"file": str(dest), "architecture": arch, "quant": quant, "tensors": counts,
            "bytes": dest.stat().st_size, "tokenizer": tok["model"], "pre": tok["pre"]}
