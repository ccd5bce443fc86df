"""Turning a sequence into response pieces: visible text, logprob lists, usage."""

from __future__ import annotations

from .sequence import Seq


# How many prompt tokens prime the detokenizer when the prompt ends inside a character.
PRIME_TOKENS = 64


def output_text(tok, seq: Seq) -> str:
    """The output decoded as vLLM's incremental detokenizer does: when the prompt ends inside a
    character (its tail decodes to a trailing U+FFFD), the output is decoded after that tail,
    so the character comes out whole. A continued answer (a gateway resuming after a dead
    decode sends prompt + generated ids) then yields exactly the text the client still lacks."""
    if not seq.output_ids:
        return ""
    tail = seq.tokens[max(0, seq.prompt_len - PRIME_TOKENS):seq.prompt_len]
    head = tok.decode(tail)
    if not head.endswith("\ufffd"):
        return tok.decode(seq.output_ids)
    base = head.rstrip("\ufffd")
    full = tok.decode(tail + seq.output_ids)
    return full[len(base):] if full.startswith(base) else tok.decode(seq.output_ids)


def visible_text(tok, seq: Seq, final: bool) -> str:
    """Output text with a matched stop string cut off; while streaming, text that could still
    become a stop string or an incomplete UTF-8 character is held back."""
    text = output_text(tok, seq)
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
