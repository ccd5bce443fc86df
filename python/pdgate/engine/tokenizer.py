"""Tokenizers: a byte-level one for the presets, `tokenizers` for Hugging Face checkpoints."""

from __future__ import annotations

import json
import os
from typing import Protocol


class Tokenizer(Protocol):
    bos_id: int | None
    eos_ids: tuple[int, ...]

    def encode(self, text: str, add_bos: bool = True) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...

    def token_text(self, token_id: int) -> str: ...


class ByteTokenizer:
    """Bytes 0..255 are tokens 0..255; 256 is BOS and 257 is EOS (never decoded to text)."""

    bos_id: int | None = 256
    eos_ids: tuple[int, ...] = (257,)

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.bos_id, *ids] if add_bos else ids

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def token_text(self, token_id: int) -> str:
        if token_id == self.bos_id:
            return "<s>"
        if token_id in self.eos_ids:
            return "</s>"
        return bytes([token_id]).decode("latin-1")


class HFTokenizer:
    """A `tokenizer.json` loaded with the `tokenizers` package (imported lazily)."""

    def __init__(self, path: str, bos_id: int | None, eos_ids: tuple[int, ...]):
        from tokenizers import Tokenizer as _Tok

        self._tok = _Tok.from_file(os.path.join(path, "tokenizer.json"))
        self.bos_id = bos_id
        self.eos_ids = eos_ids

    def encode(self, text: str, add_bos: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_bos and self.bos_id is not None:
            return [self.bos_id, *ids]
        return list(ids)

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def token_text(self, token_id: int) -> str:
        return self._tok.id_to_token(token_id) or ""


def chat_prompt(messages: list[dict]) -> str:
    """A simple, documented chat template: `<|role|>\\ncontent\\n` per turn, then the assistant tag."""
    parts = []
    for m in messages:
        content = m.get("content") or ""
        if isinstance(content, list):  # OpenAI content parts: keep the text ones
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        parts.append(f"<|{m.get('role', 'user')}|>\n{content}\n")
    parts.append("<|assistant|>\n")
    return "".join(parts)


def load_hf_ids(path: str) -> tuple[int | None, tuple[int, ...]]:
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    eos = cfg.get("eos_token_id", 2)
    eos_ids = tuple(eos) if isinstance(eos, list) else (eos,)
    return cfg.get("bos_token_id"), eos_ids
