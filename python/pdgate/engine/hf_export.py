"""A Hugging Face model directory for a model: what a gateway's `--model-path` loader reads.

gRPC workers take token ids, so the gateway in front of them tokenizes and applies the chat
template itself; it loads `tokenizer.json` and `tokenizer_config.json` (plus `config.json` and
`generation_config.json` for the eos/bos ids and the context length) from a local directory.
`pdgate engine --model M --export-tokenizer DIR` writes that directory and `GetTokenizer` serves it.

The byte-level presets get an equivalent HF tokenizer: a BPE with no merges over the 256
byte-level symbols (ByteLevel pre-tokenizer and decoder, ids 0..255 = bytes), `<s>` = 256 and
`</s>` = 257 as special added tokens, and a post-processor that puts `<s>` first, so
`encode(text, add_special_tokens=True)` equals the engine's `encode(text)`. One difference no
tokenizer.json can remove: HF matches the literal strings `<s>` / `</s>` in input text as the
special tokens, the engine's byte tokenizer encodes them as bytes.
"""

from __future__ import annotations

import json
import os
import shutil

from .config import PRESETS, ModelConfig
from .errors import EngineConfigError

# The engine's HTTP chat path (tokenizer.chat_prompt), as a Jinja template: `<|role|>\ncontent\n`
# per turn, then the assistant tag; content parts keep their text; BOS first as the engine's
# encode adds it (a gateway encodes a rendered chat prompt without special tokens, as HF does).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% set content = message['content'] if message['content'] is defined else none %}"
    "{{ '<|' + (message['role'] if message['role'] is defined else 'user') + '|>\n' }}"
    "{% if content is string %}{{ content }}"
    "{% elif content is iterable and content is not mapping and content is not none %}"
    "{% for part in content %}{% if part is mapping and part['text'] is defined %}{{ part['text'] }}{% endif %}{% endfor %}"
    "{% endif %}"
    "{{ '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt is not defined or add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)

BOS_TOKEN, EOS_TOKEN = "<s>", "</s>"
FILES = ("tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json")


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte maps to one printable character."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def byte_tokenizer_json(bos_id: int, eos_id: int) -> dict:
    """tokenizer.json of the engine's byte tokenizer (ids 0..255 = bytes, then BOS, EOS)."""
    alphabet = bytes_to_unicode()
    special = [{"id": i, "content": c, "single_word": False, "lstrip": False, "rstrip": False,
                "normalized": False, "special": True} for i, c in ((bos_id, BOS_TOKEN), (eos_id, EOS_TOKEN))]
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": special,
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": BOS_TOKEN, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": BOS_TOKEN, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {BOS_TOKEN: {"id": BOS_TOKEN, "ids": [bos_id], "tokens": [BOS_TOKEN]}},
        },
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": {alphabet[b]: b for b in range(256)}, "merges": []},
    }


def tokenizer_config(bos: str | None, eos: str, max_len: int) -> dict:
    return {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": eos,
            "pad_token": None, "add_bos_token": bos is not None, "add_eos_token": False,
            "clean_up_tokenization_spaces": False, "model_max_length": max_len,
            "chat_template": CHAT_TEMPLATE}


def model_config(cfg: ModelConfig) -> dict:
    """config.json in Llama's layout (what loaders read: architecture, vocab, eos, context)."""
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": cfg.vocab_size,
            "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
            "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
            "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
            "max_position_embeddings": cfg.max_position, "rope_theta": cfg.rope_theta,
            "rms_norm_eps": cfg.rms_eps, "tie_word_embeddings": cfg.tie_embeddings,
            "bos_token_id": cfg.bos_id, "eos_token_id": list(cfg.eos_ids) if len(cfg.eos_ids) > 1 else cfg.eos_ids[0],
            "torch_dtype": "float32"}


def _write(path: str, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, ensure_ascii=False)


def export(model: str, out_dir: str) -> list[str]:
    """Write the model directory for `model` (a preset or an HF checkpoint dir) into `out_dir`."""
    os.makedirs(out_dir, exist_ok=True)
    if model in PRESETS:
        cfg = PRESETS[model]
        _write(os.path.join(out_dir, "tokenizer.json"), byte_tokenizer_json(cfg.bos_id, cfg.eos_ids[0]))
        _write(os.path.join(out_dir, "tokenizer_config.json"), tokenizer_config(BOS_TOKEN, EOS_TOKEN, cfg.max_position))
        _write(os.path.join(out_dir, "config.json"), model_config(cfg))
        _write(os.path.join(out_dir, "generation_config.json"),
               {"bos_token_id": cfg.bos_id, "eos_token_id": cfg.eos_ids[0]})
        return [os.path.join(out_dir, f) for f in FILES]
    if os.path.isdir(model):
        return _export_checkpoint(model, out_dir)
    raise EngineConfigError(f"--model {model!r}: not a preset ({', '.join(PRESETS)}) nor a directory")


# The engine's weight names and their Hugging Face Llama names (HF stores matrices [out, in]).
_HF_LAYER_NAMES = {
    "wq": "self_attn.q_proj.weight", "wk": "self_attn.k_proj.weight", "wv": "self_attn.v_proj.weight",
    "wo": "self_attn.o_proj.weight", "w_gate": "mlp.gate_proj.weight", "w_up": "mlp.up_proj.weight",
    "w_down": "mlp.down_proj.weight", "attn_norm": "input_layernorm.weight",
    "mlp_norm": "post_attention_layernorm.weight",
}


def hf_tensors(cfg: ModelConfig, weights: dict) -> dict:
    """The engine's weights under Hugging Face Llama tensor names, in HF's [out, in] layout."""
    import numpy as np

    def hf(t):
        return np.ascontiguousarray(t.T if t.ndim == 2 else t, dtype=np.float32)

    # The embedding is [vocab, hidden] in both layouts: a table, not an [in, out] matrix.
    out = {"model.embed_tokens.weight": np.ascontiguousarray(weights["embed"], dtype=np.float32),
           "model.norm.weight": hf(weights["final_norm"])}
    for i in range(cfg.num_layers):
        for short, name in _HF_LAYER_NAMES.items():
            out[f"model.layers.{i}.{name}"] = hf(weights[f"layers.{i}.{short}"])
    if not cfg.tie_embeddings:
        out["lm_head.weight"] = hf(weights["lm_head"])
    return out


def export_model(model: str, out_dir: str, seed: int = 0) -> list[str]:
    """A whole Hugging Face Llama checkpoint of a preset: the tokenizer files of `export` plus
    `model.safetensors` with the preset's weights from `seed`, float32. Real vLLM loads it
    (`--model DIR --dtype float32`), and so does this engine (`--model DIR`), so both serve the
    same model."""
    if model not in PRESETS:
        raise ValueError(f"--export-model writes a preset ({', '.join(PRESETS)}), not {model!r}")
    from .weights import random_weights

    cfg = PRESETS[model]
    written = export(model, out_dir)
    path = os.path.join(out_dir, "model.safetensors")
    write_safetensors(path, hf_tensors(cfg, random_weights(cfg, seed)))
    return [*written, path]


def write_safetensors(path: str, tensors: dict) -> None:
    """float32 tensors in the safetensors format (`safetensors_file`), written here so that
    exporting needs no package beyond numpy; `safetensors` and torch read it back."""
    from .safetensors_file import header_bytes

    with open(path, "wb") as f:
        f.write(header_bytes(tensors, {"format": "pt"}))
        for t in tensors.values():  # one at a time: a checkpoint need not fit in memory twice
            f.write(t.astype("<f4", copy=False).tobytes())


def _export_checkpoint(src: str, out_dir: str) -> list[str]:
    """An HF checkpoint's own tokenizer files, copied; tokenizer_config.json gets the engine's chat
    template (the engine's chat path does not run the checkpoint's own template, and a gateway
    must render exactly what the engine would)."""
    written = []
    for name in (*FILES, "special_tokens_map.json"):
        if os.path.isfile(os.path.join(src, name)) and os.path.abspath(src) != os.path.abspath(out_dir):
            shutil.copyfile(os.path.join(src, name), os.path.join(out_dir, name))
            written.append(os.path.join(out_dir, name))
    if not os.path.isfile(os.path.join(src, "tokenizer.json")):
        raise EngineConfigError(f"{src}: no tokenizer.json to export")
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    tc_path = os.path.join(out_dir, "tokenizer_config.json")
    tc = {}
    if os.path.isfile(tc_path):
        with open(tc_path) as f:
            tc = json.load(f)
    bos_id = cfg.get("bos_token_id")
    tok = json.load(open(os.path.join(src, "tokenizer.json")))
    vocab = tok.get("model", {}).get("vocab")
    names = {i: t for t, i in vocab.items()} if isinstance(vocab, dict) else {}
    names.update({t["id"]: t["content"] for t in tok.get("added_tokens", [])})
    eos = cfg.get("eos_token_id", 2)
    eos_id = eos[0] if isinstance(eos, list) else eos
    tc.setdefault("bos_token", names.get(bos_id) if bos_id is not None else None)
    tc.setdefault("eos_token", names.get(eos_id, ""))
    tc["chat_template"] = CHAT_TEMPLATE if bos_id is not None else CHAT_TEMPLATE.replace("{{ bos_token }}", "", 1)
    _write(tc_path, tc)
    if tc_path not in written:
        written.append(tc_path)
    if not os.path.isfile(os.path.join(out_dir, "generation_config.json")):
        _write(os.path.join(out_dir, "generation_config.json"), {"bos_token_id": bos_id, "eos_token_id": eos})
        written.append(os.path.join(out_dir, "generation_config.json"))
    return written
