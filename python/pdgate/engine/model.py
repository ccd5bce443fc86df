"""A Llama-architecture decoder in numpy: RMSNorm, RoPE, grouped-query attention over a page
table, SwiGLU.

`forward` takes a batch of segments. A segment is a run of consecutive tokens of one sequence
(a prefill chunk, or the single newest token of a decode). Projections and MLPs run on all
segments' tokens at once (the batching); attention runs per segment, reading K/V through that
sequence's page table. New K/V are written into the pool before attention reads them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .config import ModelConfig
from .kv import KVPool

_Q_BLOCK = 256  # query rows per attention block: bounds the score matrix on long prompts


@dataclass
class Segment:
    pages: list[int]       # the sequence's page table
    start: int             # position of tokens[0]
    tokens: list[int]
    all_logits: bool = False  # logits for every row (input logprobs), else only the last
    embeds: tuple | None = None  # (offsets into tokens, rows): image embeddings replacing those tokens'


class Model:
    def __init__(self, cfg: ModelConfig, weights: dict[str, np.ndarray]):
        self.cfg = cfg
        self.w = weights
        hd = cfg.head_dim
        inv = 1.0 / (cfg.rope_theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
        ang = np.outer(np.arange(cfg.max_position, dtype=np.float64), inv)
        self.cos = np.cos(ang).astype(np.float32)
        self.sin = np.sin(ang).astype(np.float32)

    def forward(self, pool: KVPool, segs: list[Segment]) -> list[np.ndarray]:
        """Run the segments; returns per segment the logits ([rows, vocab])."""
        cfg, w = self.cfg, self.w
        toks = np.concatenate([np.asarray(s.tokens, dtype=np.int64) for s in segs])
        pos = np.concatenate([np.arange(s.start, s.start + len(s.tokens)) for s in segs])
        page_idx, slot = self._slots(pool, segs, pos)
        x = w["embed"][toks]  # a copy: image rows may overwrite placeholder rows
        off = 0
        for s in segs:
            if s.embeds is not None:
                rel, rows = s.embeds
                x[off + rel] = rows
            off += len(s.tokens)
        for layer in range(cfg.num_layers):
            x = x + self._attention(pool, layer, segs, x, pos, page_idx, slot)
            x = x + self._mlp(layer, x)
        x = _rms(x, w["final_norm"], cfg.rms_eps)
        out, off = [], 0
        for s in segs:
            n = len(s.tokens)
            rows = x[off:off + n] if s.all_logits else x[off + n - 1:off + n]
            logits = rows @ w["lm_head"]
            if cfg.image_token_id is not None:  # a placeholder is never sampled
                logits[:, cfg.image_token_id] = np.float32(-1e9)
            out.append(logits)
            off += n
        return out

    def _slots(self, pool: KVPool, segs: list[Segment], pos: np.ndarray):
        ps = pool.page_size
        pages = np.concatenate([
            np.asarray(s.pages, dtype=np.int64)[np.arange(s.start, s.start + len(s.tokens)) // ps]
            for s in segs])
        return pages, pos % ps

    def _attention(self, pool, layer, segs, x, pos, page_idx, slot) -> np.ndarray:
        cfg, w, p = self.cfg, self.w, f"layers.{layer}."
        nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        h = _rms(x, w[p + "attn_norm"], cfg.rms_eps)
        q = self._rope((h @ w[p + "wq"]).reshape(-1, nh, hd), pos)
        k = self._rope((h @ w[p + "wk"]).reshape(-1, nkv, hd), pos)
        v = (h @ w[p + "wv"]).reshape(-1, nkv, hd)
        pool.k[layer, page_idx, slot] = k
        pool.v[layer, page_idx, slot] = v
        out = np.empty((len(pos), nh * hd), dtype=np.float32)
        offs = np.cumsum([0] + [len(s.tokens) for s in segs])
        single = [i for i, s in enumerate(segs) if len(s.tokens) == 1]
        if len(single) > 1:  # decode tokens: one padded, batched attention
            rows = offs[single]
            out[rows] = self._attend_decode(pool, layer, [segs[i] for i in single], q[rows])
        for i, s in enumerate(segs):
            if len(single) <= 1 or len(s.tokens) > 1:
                out[offs[i]:offs[i + 1]] = self._attend_segment(pool, layer, s, q[offs[i]:offs[i + 1]])
        return out @ w[p + "wo"]

    def _attend_decode(self, pool: KVPool, layer: int, segs: list[Segment], q: np.ndarray) -> np.ndarray:
        """Attention of B newest tokens over their own pages, padded to the longest context."""
        cfg = self.cfg
        nkv, hd, g = cfg.num_kv_heads, cfg.head_dim, cfg.num_heads // cfg.num_kv_heads
        lens = np.array([s.start + 1 for s in segs])
        npg = pool.pages_for(int(lens.max()))
        idx = np.array([(s.pages[:npg] + [s.pages[0]] * npg)[:npg] for s in segs], dtype=np.int64)
        b, t = len(segs), npg * pool.page_size
        kk = pool.k[layer, idx].reshape(b, t, nkv, hd).transpose(0, 2, 3, 1)  # [B, nkv, hd, T]
        vv = pool.v[layer, idx].reshape(b, t, nkv, hd).transpose(0, 2, 1, 3)  # [B, nkv, T, hd]
        sc = (q.reshape(b, nkv, g, hd) @ kk) * np.float32(1.0 / np.sqrt(hd))  # [B, nkv, g, T]
        visible = (np.arange(t)[None, :] < lens[:, None])[:, None, None, :]
        sc = np.where(visible, sc, np.float32(-np.inf))
        sc = np.exp(sc - sc.max(axis=-1, keepdims=True))
        sc /= sc.sum(axis=-1, keepdims=True)
        return (sc @ vv).reshape(b, -1)

    def _attend_segment(self, pool: KVPool, layer: int, s: Segment, q: np.ndarray) -> np.ndarray:
        """Causal GQA attention of one segment's queries over its pages.

        The g query heads that share a KV head are folded into the rows, so each block is one
        contiguous batched matmul per KV head; a block only reads keys up to its last position.
        """
        cfg = self.cfg
        nkv, hd, g = cfg.num_kv_heads, cfg.head_dim, cfg.num_heads // cfg.num_kv_heads
        n, total = len(s.tokens), s.start + len(s.tokens)
        idx = np.asarray(s.pages[:pool.pages_for(total)], dtype=np.int64)
        kk = np.ascontiguousarray(pool.k[layer, idx].reshape(-1, nkv, hd)[:total].transpose(1, 2, 0))
        vv = np.ascontiguousarray(pool.v[layer, idx].reshape(-1, nkv, hd)[:total].transpose(1, 0, 2))
        qq = q.reshape(n, nkv, g, hd).transpose(1, 0, 2, 3)  # [nkv, n, g, hd]
        res = np.empty((nkv, n, g, hd), dtype=np.float32)
        scale = np.float32(1.0 / np.sqrt(hd))
        for b in range(0, n, _Q_BLOCK):
            e = min(n, b + _Q_BLOCK)
            kmax = s.start + e
            qb = np.ascontiguousarray(qq[:, b:e]).reshape(nkv, (e - b) * g, hd)
            sc = (qb @ kk[:, :, :kmax]) * scale  # [nkv, rows*g, kmax]
            if e - b > 1:  # causal mask, only on the diagonal square; a single newest token sees every key
                sc[:, :, s.start + b:kmax] += _causal_bias(e - b, g)
            sc = np.exp(sc - sc.max(axis=-1, keepdims=True))
            sc /= sc.sum(axis=-1, keepdims=True)
            res[:, b:e] = (sc @ vv[:, :kmax]).reshape(nkv, e - b, g, hd)
        return res.transpose(1, 0, 2, 3).reshape(n, -1)

    def _mlp(self, layer: int, x: np.ndarray) -> np.ndarray:
        w, p = self.w, f"layers.{layer}."
        h = _rms(x, w[p + "mlp_norm"], self.cfg.rms_eps)
        gate = h @ w[p + "w_gate"]
        act = gate / (1.0 + np.exp(-gate)) * (h @ w[p + "w_up"])
        return act @ w[p + "w_down"]

    def _rope(self, t: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """Rotate-half RoPE (the Hugging Face Llama convention)."""
        half = t.shape[-1] // 2
        cos, sin = self.cos[pos][:, None, :], self.sin[pos][:, None, :]
        t1, t2 = t[..., :half], t[..., half:]
        return np.concatenate([t1 * cos - t2 * sin, t2 * cos + t1 * sin], axis=-1)


def _causal_bias(rows: int, g: int) -> np.ndarray:
    """[rows*g, rows]: 0 where query row r//g may see key k (k <= r//g), -inf elsewhere."""
    r = np.repeat(np.arange(rows), g)
    return np.where(np.arange(rows)[None, :] <= r[:, None], np.float32(0), np.float32(-np.inf))


def _rms(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps) * weight
