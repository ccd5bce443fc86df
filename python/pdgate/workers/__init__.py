"""Launch and stop inference workers: pdgate reference engines as subprocesses, and the command
lines of real SGLang and vLLM workers (built here, run elsewhere).

    from pdgate.workers import ReferenceWorker
    with ReferenceWorker(mode="prefill") as p, ReferenceWorker(mode="decode") as d:
        ...  # p.url, p.bootstrap_port, d.url
"""

from ._commands import sglang_command, vllm_command
from pdgate.errors import WorkerStartError

from ._reference import ReferenceWorker, free_port

__all__ = sorted(["ReferenceWorker", "WorkerStartError", "free_port", "sglang_command", "vllm_command"])
