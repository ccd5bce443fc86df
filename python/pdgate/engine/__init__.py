"""The pdgate reference engine: a small Llama-architecture model on numpy with a paged KV
cache, serving the SGLang and vLLM worker HTTP surfaces and their PD protocols, moving real KV
pages between processes. See docs/engine.md.

Run one with `python -m pdgate.engine --model tiny --port 30000 --disaggregation-mode prefill`.
"""
