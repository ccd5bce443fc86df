"""Loading a local Hugging Face Llama checkpoint (config.json, safetensors, tokenizer.json).

The checkpoint is written here from the `tiny` preset's weights in Hugging Face layout
([out, in] matrices, HF tensor names), so loading it must reproduce the preset's logits."""

from __future__ import annotations

import json

import httpx
import numpy as np
import pytest
from safetensors.numpy import save_file
from tokenizers import Tokenizer, models, pre_tokenizers

from pdgate.engine.config import PRESETS
from pdgate.engine.engine import load_model
from pdgate.engine.kv import KVPool
from pdgate.engine.model import Model, Segment
from pdgate.engine.weights import random_weights
from pdgate.workers import ReferenceWorker

pytestmark = pytest.mark.timeout(60)
CFG = PRESETS["tiny"]
HF = {"wq": "self_attn.q_proj", "wk": "self_attn.k_proj", "wv": "self_attn.v_proj",
      "wo": "self_attn.o_proj", "w_gate": "mlp.gate_proj", "w_up": "mlp.up_proj",
      "w_down": "mlp.down_proj"}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama")
    w = random_weights(CFG, 0)
    t = {"model.embed_tokens.weight": w["embed"], "model.norm.weight": w["final_norm"],
         "lm_head.weight": np.ascontiguousarray(w["lm_head"].T)}
    for i in range(CFG.num_layers):
        p = f"layers.{i}."
        for short, name in HF.items():
            t[f"model.layers.{i}.{name}.weight"] = np.ascontiguousarray(w[p + short].T)
        t[f"model.layers.{i}.input_layernorm.weight"] = w[p + "attn_norm"]
        t[f"model.layers.{i}.post_attention_layernorm.weight"] = w[p + "mlp_norm"]
    save_file(t, str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "vocab_size": CFG.vocab_size,
        "hidden_size": CFG.hidden_size, "num_hidden_layers": CFG.num_layers,
        "num_attention_heads": CFG.num_heads, "num_key_value_heads": CFG.num_kv_heads,
        "intermediate_size": CFG.intermediate_size, "max_position_embeddings": CFG.max_position,
        "rms_norm_eps": CFG.rms_eps, "rope_theta": CFG.rope_theta, "tie_word_embeddings": False,
        "bos_token_id": 1, "eos_token_id": 2}))
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, CFG.vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(d / "tokenizer.json"))
    return d


def test_checkpoint_reproduces_preset_logits(checkpoint):
    cfg, w, tok, _ = load_model(str(checkpoint), 0)
    assert tok.encode("w5 w7") == [1, 5, 7] and cfg.eos_ids == (2,)
    ids = [1, 5, 7, 9, 200, 31]
    out = []
    for c, weights in ((cfg, w), (CFG, random_weights(CFG, 0))):
        pool = KVPool(4, 16, c.num_layers, c.num_kv_heads, c.head_dim)
        out.append(Model(c, weights).forward(pool, [Segment(pool.reserve(1), 0, ids, all_logits=True)])[0])
    np.testing.assert_allclose(out[0], out[1], atol=1e-5)


def test_worker_serves_a_checkpoint(checkpoint):
    with ReferenceWorker(mode="null", model=str(checkpoint)) as w:
        r = httpx.post(w.url + "/generate", json={"text": "w5 w7 w9", "sampling_params": {
            "max_new_tokens": 4, "temperature": 0, "ignore_eos": True}}, timeout=30)
        assert r.status_code == 200 and len(r.json()["output_ids"]) == 4
        assert r.json()["meta_info"]["prompt_tokens"] == 4


@pytest.mark.parametrize("preset", ["tiny", "tiny64"])
def test_export_model_writes_a_checkpoint_that_reproduces_the_preset(tmp_path, preset):
    """`pdgate engine --model P --export-model DIR`: the preset as an HF checkpoint (what real
    vLLM loads in tests/real_vllm); loaded back it gives the preset's logits and tokens."""
    import subprocess
    import sys

    from safetensors.numpy import load_file

    out = subprocess.run([sys.executable, "-m", "pdgate.engine", "--model", preset, "--seed", "3",
                          "--export-model", str(tmp_path)], capture_output=True, text=True, timeout=60, check=True)
    assert str(tmp_path / "model.safetensors") in out.stdout
    tensors = load_file(str(tmp_path / "model.safetensors"))
    base = PRESETS[preset]
    assert tensors["model.embed_tokens.weight"].shape == (base.vocab_size, base.hidden_size)
    assert tensors["model.layers.0.self_attn.q_proj.weight"].shape == (base.num_heads * base.head_dim, base.hidden_size)
    assert json.loads((tmp_path / "config.json").read_text())["head_dim"] == base.head_dim
    cfg, w, tok, _ = load_model(str(tmp_path), 0)
    assert tok.encode("hi") == [256, 104, 105] and cfg.eos_ids == base.eos_ids
    ids = [256, 72, 101, 108, 108, 111]
    out = []
    for c, weights in ((cfg, w), (base, random_weights(base, 3))):
        pool = KVPool(4, 16, c.num_layers, c.num_kv_heads, c.head_dim)
        out.append(Model(c, weights).forward(pool, [Segment(pool.reserve(1), 0, ids, all_logits=True)])[0])
    np.testing.assert_allclose(out[0], out[1], atol=1e-5)


def test_export_model_refuses_a_directory(tmp_path, checkpoint):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "pdgate.engine", "--model", str(checkpoint), "--export-model", str(tmp_path)],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "writes a preset" in r.stderr
