"""GGUF files (llama.cpp, Ollama) as starting policies: converted once into an ordinary model folder.

    folder = model_folder("/models/SmolLM2-135M-Instruct.Q4_1.gguf", "float32")   # a transformers folder

`model.name_or_path` may name a `.gguf` file (or `builtin:smollm2-135m`, tasks/core/builtin_models.py). It is
read by transformers' own GGUF loader (`from_pretrained(folder, gguf_file=...)`, which dequantizes every tensor),
and saved with `save_pretrained` in the dtype the run asks for, under the local cache keyed by the file's sha256
and that dtype. Everything downstream (hf and vLLM sampling, the torch and DeepSpeed trainers, LoRA, publish,
export, MLflow) then sees a plain model folder; nothing after this module knows the start was a GGUF.

Why convert instead of loading the GGUF each time: a load dequantizes every tensor (~20 s for 135M parameters on
2 cores, minutes for 7B) and vLLM's own GGUF path is a separate, partial implementation; one folder, made once per
machine, is what every engine already reads. The folder appears whole or not at all (written under a temporary
name, then renamed), so two processes converting at once both end with the same folder.

Before anything is converted, the file's header is read (`check`): a file that is not GGUF, is truncated, or
holds an architecture transformers cannot dequantize into a causal LM is one UserError line naming the file.
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
from tasks.core.hashing import known_sha256
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


def model_folder(path: str, dtype: str, field: str = FIELD) -> str:
    """The converted folder of GGUF file `path` in `dtype` (made on first use; UserError for a bad file)."""
    file = Path(path).expanduser()
    if file.is_dir():
        raise UserError(f"{field}: {file}: a folder; expected a GGUF file")
    if not file.is_file():
        raise UserError(f"{field}: {file}: no such GGUF file")
    digest = known_sha256(file)
    target = cache_root() / "gguf" / f"{digest[:16]}-{dtype}"
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
            model.save_pretrained(out)
            tokenizer.save_pretrained(out)
    finally:
        hf_logging.set_verbosity(verbosity)
        gguf_utils.tqdm = per_tensor_bar
        if bars:
            hf_logging.enable_progress_bar()
