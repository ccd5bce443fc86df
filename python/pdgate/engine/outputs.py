"""Turning a sequence into response pieces: visible text, logprob lists, usage."""

from __future__ import annotations

from .sequence import Seq


# How many prompt tokens prime the detokenizer when the prompt ends inside a character.
PRIME_TOKENS = 64


def output_text(tok, seq: Seq, upto: int | None = None) -> str:
    """The output (its first `upto` ids, or all) decoded as vLLM's incremental detokenizer
    does: when the prompt ends inside a character (its tail decodes to a trailing U+FFFD), the
    output is decoded after that tail, so the character comes out whole. A continued answer (a
    gateway resuming after a dead decode sends prompt + generated ids) then yields exactly the
    text the client still lacks."""
    ids = seq.output_ids if upto is None else seq.output_ids[:upto]
    if not ids:
        return ""
    tail = seq.tokens[max(0, seq.prompt_len - PRIME_TOKENS):seq.prompt_len]
    head = tok.decode(tail)
    if not head.endswith("\ufffd"):
        return tok.decode(ids)
    base = head.rstrip("\ufffd")
    full = tok.decode(tail + ids)
    return full[len(base):] if full.startswith(base) else tok.decode(ids)


def released_text(tok, seq: Seq) -> str:
    """The text vLLM's detokenizer has sent: it feeds tokenizers' `DecodeStream`
    (vllm/v1/engine/detokenizer.py), which holds every token's text while the text decoded so
    far ends in U+FFFD (an unfinished UTF-8 character) and never sends what it still holds when
    the answer ends. So the sent text is the decode of the longest prefix of the output whose
    text does not end in U+FFFD. Scanned from the end: a held run is a few tokens.

    vLLM 0.32 primes that stream with the whole prompt (`DecodeStream(ids=prompt)`), and when
    the prompt's text itself ends in U+FFFD nothing of it counts as sent: the first text it
    releases is the whole prompt's followed by the output's (measured with tokenizers 0.23.3).
    A gateway that continues an answer from ids ending inside a character meets exactly this."""
    n = len(seq.output_ids)
    echo = _primed_prompt_is_held(tok, seq)
    text = _vllm_text(tok, seq, n, echo)
    while n and text.endswith("\ufffd"):
        n -= 1
        text = _vllm_text(tok, seq, n, echo)
    return text


def _primed_prompt_is_held(tok, seq: Seq) -> bool:
    # A trailing U+FFFD comes from the last few bytes: a short tail of the prompt tells.
    return tok.decode(seq.tokens[max(0, seq.prompt_len - 8):seq.prompt_len]).endswith("\ufffd")


def _vllm_text(tok, seq: Seq, n: int, echo: bool) -> str:
    if not echo:
        return output_text(tok, seq, n)
    return tok.decode(seq.tokens[:seq.prompt_len] + seq.output_ids[:n]) if n else ""


def visible_text(tok, seq: Seq, final: bool, vllm_tail: bool = False) -> str:
    """Output text with a matched stop string cut off; while streaming, text that could still
    become a stop string or an incomplete UTF-8 character is held back. With `vllm_tail` (the
    vLLM flavour's OpenAI routes) the text is what vLLM's detokenizer sends (`released_text`):
    an answer that ends inside a character ends without that tail, where SGLang writes U+FFFD."""
    text = released_text(tok, seq) if vllm_tail else output_text(tok, seq)
    reason = seq.finish_reason or {}
    if reason.get("type") == "stop" and isinstance(reason.get("matched"), str):
        cut = text.find(reason["matched"])
        return text[:cut] if cut >= 0 else text
    if final or seq.finished:
        return text
    hold = max((len(s) - 1 for s in seq.params.stop), default=0)
    if hold:
        text = text[:max(0, len(text) - hold)]
    return text.rstrip("\ufffd")


def finish_reason_openai(seq: Seq) -> str | None:
    if seq.error is not None:
        return "abort"
    r = seq.finish_reason
    if r is None:
        return None
    return "stop" if r.get("type") == "stop" else "length"


def native_logprobs(tok, seq: Seq, with_text: bool) -> dict:
    def entry(lp, tid):
        return [lp, tid, tok.token_text(tid) if with_text else None]

    prompt = seq.tokens[:seq.prompt_len]
    out: dict = {
        "input_token_logprobs": [entry(lp, t) for lp, t in zip(seq.input_logprobs, prompt)],
        "output_token_logprobs": [entry(lp, t) for lp, t in zip(seq.output_logprobs, seq.output_ids)],
    }
    if seq.top_logprobs_num > 0:
        out["input_top_logprobs"] = [[entry(lp, t) for lp, t in top] or None for top in seq.input_top]
        out["output_top_logprobs"] = [[entry(lp, t) for lp, t in top] for top in seq.output_top]
    return out


def usage(seqs: list[Seq], n: int) -> dict:
    """OpenAI usage; with n choices per prompt the prompt counts once."""
    firsts = seqs[::n] if n > 1 else seqs
    prompt = sum(s.prompt_len for s in firsts)
    completion = sum(len(s.output_ids) for s in seqs)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(s.cached_tokens for s in firsts)}}
