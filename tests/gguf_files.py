"""GGUF files for the tests, written the way llama.cpp's convert_hf_to_gguf.py writes a Llama checkpoint (with the
gguf package's own GGUFWriter), from a transformers folder such as the builtin tiny model:

- tensors renamed to llama.cpp's names (token_embd, blk.N.attn_q, ..., output_norm; no output.weight when the
  embeddings are tied), stored in torch's (rows, columns) order, which GGUFWriter records reversed as ggml does;
- attn_q / attn_k rows permuted as llama.cpp's `LlamaModel.permute` does (its rotary layout), which transformers'
  GGUF loader reverses (modeling_gguf_pytorch_utils.LlamaTensorProcessor);
- the `<arch>.*` hyper-parameters transformers maps back into a LlamaConfig (integrations/ggml.py);
- the tokenizer as `tokenizer.ggml.*` with model "gpt2" (a byte-level BPE): tokens spelled as the tokenizer's
  vocabulary spells them (llama.cpp copies them as they are), token types (CONTROL for the special tokens), scores,
  no merges (the tiny vocabulary is one token per character; an empty array is not written), the special token ids,
  add_bos_token, and the chat template (`tokenizer.chat_template`).

    write_gguf(builtin_models.resolve("builtin:tiny-lm"), tmp / "tiny.gguf")              # F32
    write_gguf(folder, tmp / "tiny.Q8_0.gguf", quant=gguf.GGMLQuantizationType.Q8_0)       # 2-D weights in Q8_0
    write_gguf(folder, tmp / "bert.gguf", arch="bert")                                      # an architecture label
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

# transformers' Llama parameter (in a layer) -> llama.cpp's tensor name (gguf's MODEL_TENSOR names for LLAMA)
LAYER_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
TOP_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}


def permute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf.py LlamaModel.permute (what transformers' loader undoes)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2).reshape(weights.shape))


def gguf_name(hf_name: str) -> str:
    if hf_name in TOP_NAMES:
        return TOP_NAMES[hf_name]
    _, _, layer, *rest = hf_name.split(".")          # model.layers.N.<module path>.weight
    return f"blk.{layer}.{LAYER_NAMES['.'.join(rest[:-1])]}.{rest[-1]}"


def write_gguf(folder: str | Path, out: str | Path, quant=None, arch: str = "llama", name: str = "tiny-lm") -> Path:
    """Write the Llama model in `folder` (config.json, model.safetensors, tokenizer.json) as a GGUF file `out`:
    F32 tensors, or with `quant` (a gguf.GGMLQuantizationType) every 2-D weight quantized, the norms F32 (as
    llama.cpp keeps them). `arch` is only the label (general.architecture and the key prefix)."""
    import gguf
    from safetensors.numpy import load_file

    folder, out = Path(folder), Path(out)
    cfg = json.loads((folder / "config.json").read_text())
    tok = json.loads((folder / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {a["content"] for a in tok["added_tokens"] if a.get("special")}
    template = folder / "chat_template.jinja"
    chat_template = (template.read_text() if template.is_file()
                     else json.loads((folder / "tokenizer_config.json").read_text())["chat_template"])

    w = gguf.GGUFWriter(str(out), arch)
    w.add_name(name)
    w.add_file_type(gguf.LlamaFileType.ALL_F32 if quant is None else gguf.LlamaFileType.MOSTLY_Q8_0)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_rope_dimension_count(cfg["hidden_size"] // cfg["num_attention_heads"])
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens])
    w.add_token_scores([0.0] * len(tokens))
    w.add_bos_token_id(cfg["bos_token_id"])
    w.add_eos_token_id(cfg["eos_token_id"])
    w.add_pad_token_id(cfg["pad_token_id"])
    w.add_add_bos_token(False)
    w.add_chat_template(chat_template)

    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    for hf_name, t in load_file(folder / "model.safetensors").items():
        name_ = gguf_name(hf_name)
        t = t.astype(np.float32)
        if ".attn_q." in name_:
            t = permute(t, n_head, n_head)
        elif ".attn_k." in name_:
            t = permute(t, n_head, n_kv)
        t = np.ascontiguousarray(t)
        if quant is not None and t.ndim == 2:
            w.add_tensor(name_, gguf.quants.quantize(t, quant), raw_dtype=quant)
        else:
            w.add_tensor(name_, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
