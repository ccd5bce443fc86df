"""Weights: drawn from a seed for the presets, or read from a Hugging Face Llama checkpoint.

Matrices are stored as [in, out] so the forward pass is `x @ W`.
"""

from __future__ import annotations

import glob
import json
import os

import numpy as np

from .config import ModelConfig

LOGIT_GAIN = 3.0  # spreads random-weight logits so greedy choices are far from ties


def random_weights(cfg: ModelConfig, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)

    def mat(n_in: int, n_out: int, gain: float = 1.0) -> np.ndarray:
        return (rng.standard_normal((n_in, n_out)) * (gain / np.sqrt(n_in))).astype(np.float32)

    h, hd = cfg.hidden_size, cfg.head_dim
    w: dict[str, np.ndarray] = {
        "embed": rng.standard_normal((cfg.vocab_size, h)).astype(np.float32),
        "final_norm": np.ones(h, dtype=np.float32),
    }
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        w[p + "attn_norm"] = np.ones(h, dtype=np.float32)
        w[p + "mlp_norm"] = np.ones(h, dtype=np.float32)
        w[p + "wq"] = mat(h, cfg.num_heads * hd)
        w[p + "wk"] = mat(h, cfg.num_kv_heads * hd)
        w[p + "wv"] = mat(h, cfg.num_kv_heads * hd)
        w[p + "wo"] = mat(cfg.num_heads * hd, h, 0.5)
        w[p + "w_gate"] = mat(h, cfg.intermediate_size)
        w[p + "w_up"] = mat(h, cfg.intermediate_size)
        w[p + "w_down"] = mat(cfg.intermediate_size, h, 0.5)
    w["lm_head"] = w["embed"].T.copy() if cfg.tie_embeddings else mat(h, cfg.vocab_size, LOGIT_GAIN)
    return w


_HF_NAMES = {
    "self_attn.q_proj.weight": "wq", "self_attn.k_proj.weight": "wk",
    "self_attn.v_proj.weight": "wv", "self_attn.o_proj.weight": "wo",
    "mlp.gate_proj.weight": "w_gate", "mlp.up_proj.weight": "w_up",
    "mlp.down_proj.weight": "w_down", "input_layernorm.weight": "attn_norm",
    "post_attention_layernorm.weight": "mlp_norm",
}


def hf_config(path: str) -> ModelConfig:
    with open(os.path.join(path, "config.json")) as f:
        c = json.load(f)
    heads = c["num_attention_heads"]
    eos = c.get("eos_token_id", 2)
    return ModelConfig(
        name=os.path.basename(os.path.normpath(path)), vocab_size=c["vocab_size"],
        hidden_size=c["hidden_size"], num_layers=c["num_hidden_layers"], num_heads=heads,
        num_kv_heads=c.get("num_key_value_heads", heads),
        head_dim=c.get("head_dim") or c["hidden_size"] // heads,
        intermediate_size=c["intermediate_size"],
        max_position=c.get("max_position_embeddings", 4096),
        rope_theta=float(c.get("rope_theta", 10000.0)), rms_eps=float(c.get("rms_norm_eps", 1e-5)),
        tie_embeddings=bool(c.get("tie_word_embeddings", False)),
        bos_id=c.get("bos_token_id", 1), eos_ids=tuple(eos) if isinstance(eos, list) else (eos,),
    )


def hf_weights(path: str, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Read `*.safetensors` (numpy backend; bf16 is widened to float32 by hand)."""
    from safetensors import safe_open

    raw: dict[str, np.ndarray] = {}
    for fn in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        with safe_open(fn, framework="numpy") as f:
            for name in f.keys():
                raw[name] = f.get_tensor(name)
    w = {"embed": _f32(raw["model.embed_tokens.weight"]), "final_norm": _f32(raw["model.norm.weight"])}
    for name, t in raw.items():
        parts = name.split(".")
        if parts[:2] == ["model", "layers"]:
            short = _HF_NAMES.get(".".join(parts[3:]))
            if short is not None:
                t = _f32(t)
                w[f"layers.{parts[2]}.{short}"] = t if t.ndim == 1 else np.ascontiguousarray(t.T)
    head = raw.get("lm_head.weight")
    w["lm_head"] = np.ascontiguousarray((_f32(head) if head is not None else w["embed"]).T)
    return w


def _f32(t: np.ndarray) -> np.ndarray:
    if t.dtype == np.uint16:  # bfloat16 read as raw bits
        return (t.astype(np.uint32) << 16).view(np.float32)
    return t.astype(np.float32)
