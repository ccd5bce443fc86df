"""`pdgate engine --export-tokenizer DIR`: a Hugging Face directory equivalent to the engine's
tokenizer and chat path, checked with the `tokenizers` package and a Jinja render as HF does it."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import jinja2
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from pdgate.engine.hf_export import export
from pdgate.engine.tokenizer import ByteTokenizer, chat_prompt

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-tok")
    out = subprocess.run([sys.executable, "-m", "pdgate.engine", "--model", "tiny", "--export-tokenizer", str(d)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return d


def _random_text(rng: random.Random) -> str:
    ranges = [(32, 127), (0, 32), (0x80, 0x800), (0x800, 0xD800), (0xE000, 0xFFFF), (0x10000, 0x10FFFF)]
    chars = []
    for _ in range(rng.randrange(0, 50)):
        lo, hi = rng.choice(ranges)
        chars.append(chr(rng.randrange(lo, hi)))
    return "".join(chars)


def test_files_and_ids(exported):
    cfg = json.loads((exported / "config.json").read_text())
    gen = json.loads((exported / "generation_config.json").read_text())
    tc = json.loads((exported / "tokenizer_config.json").read_text())
    assert cfg["vocab_size"] == 258 and cfg["bos_token_id"] == 256 and cfg["eos_token_id"] == 257
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["max_position_embeddings"] == 4096
    assert gen == {"bos_token_id": 256, "eos_token_id": 257}
    assert tc["bos_token"] == "<s>" and tc["eos_token"] == "</s>" and tc["chat_template"]
    tok = Tokenizer.from_file(str(exported / "tokenizer.json"))
    assert tok.get_vocab_size() == 258 and tok.token_to_id("<s>") == 256 and tok.token_to_id("</s>") == 257


def test_encode_decode_equal_engine_on_random_text_and_ids(exported):
    tok, ref, rng = Tokenizer.from_file(str(exported / "tokenizer.json")), ByteTokenizer(), random.Random(1234)
    for _ in range(500):
        text = _random_text(rng)
        assert tok.encode(text).ids == ref.encode(text), text
        assert tok.encode(text, add_special_tokens=False).ids == ref.encode(text, add_bos=False), text
        ids = [rng.randrange(0, 258) for _ in range(rng.randrange(0, 40))]  # any bytes, invalid UTF-8 too
        assert tok.decode(ids, skip_special_tokens=True) == ref.decode(ids), ids
    # every single byte id round-trips
    assert all(tok.decode([b]) == ref.decode([b]) for b in range(256))


CHATS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo wörld ✓ 🙂"},
     {"role": "assistant", "content": "ok"}, {"role": "user", "content": "again\nwith lines"}],
    [{"role": "user", "content": [{"type": "text", "text": "part one, "}, {"type": "image_url", "image_url": {}},
                                  {"type": "text", "text": "part two"}]}],
    [{"role": "tool", "content": None}, {"role": "user", "content": ""}],
]


@pytest.mark.parametrize("messages", CHATS)
def test_chat_template_gives_the_engine_chat_ids(exported, messages):
    tc = json.loads((exported / "tokenizer_config.json").read_text())
    # rendered the way transformers' apply_chat_template does it
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, undefined=jinja2.StrictUndefined)
    text = env.from_string(tc["chat_template"]).render(messages=messages, add_generation_prompt=True,
                                                      bos_token=tc["bos_token"], eos_token=tc["eos_token"])
    tok = Tokenizer.from_file(str(exported / "tokenizer.json"))
    assert tok.encode(text, add_special_tokens=False).ids == ByteTokenizer().encode(chat_prompt(messages))


def test_checkpoint_exports_its_own_tokenizer(tmp_path):
    src = tmp_path / "ckpt"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    (src / "tokenizer.json").write_text(Tokenizer.from_file(
        str(_tiny_dir(tmp_path) / "tokenizer.json")).to_str())
    out = tmp_path / "out"
    export(str(src), str(out))
    assert (out / "tokenizer.json").read_text() == (src / "tokenizer.json").read_text()
    tc = json.loads((out / "tokenizer_config.json").read_text())
    assert tc["chat_template"] and json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2


def test_unknown_model_is_refused(tmp_path):
    from pdgate.engine import EngineConfigError

    with pytest.raises(EngineConfigError, match="not a preset"):
        export("no-such-model", str(tmp_path / "x"))


def _tiny_dir(tmp_path):
    d = tmp_path / "tiny"
    export("tiny", str(d))
    return d
