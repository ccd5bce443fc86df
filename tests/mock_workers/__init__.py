"""Mock LLM workers for gateway tests: real HTTP servers on loopback that enforce PD protocols.

Kinds (see each module): `MockWorker` (regular OpenAI/SGLang worker), `BootstrapPrefill` /
`BootstrapDecode` (SGLang rendezvous), `NixlPrefill` / `NixlDecode` (vLLM pull),
`MooncakePrefill` / `MooncakeDecode` (vLLM push). In-process: `MockHost().start(Kind(...))`;
as a process: `python -m tests.mock_workers KIND` (prints one JSON line with its URL).
"""

from .core import DEFAULT_KNOBS, MockWorker
from .host import MockHost
from .mooncake import MooncakeDecode, MooncakePrefill
from .nixl import NixlDecode, NixlPrefill
from .sglang import BootstrapDecode, BootstrapPrefill

KINDS = {
    "regular": MockWorker,
    "bootstrap-prefill": BootstrapPrefill,
    "bootstrap-decode": BootstrapDecode,
    "nixl-prefill": NixlPrefill,
    "nixl-decode": NixlDecode,
    "mooncake-prefill": MooncakePrefill,
    "mooncake-decode": MooncakeDecode,
}

__all__ = [
    "BootstrapDecode",
    "BootstrapPrefill",
    "DEFAULT_KNOBS",
    "KINDS",
    "MockHost",
    "MockWorker",
    "MooncakeDecode",
    "MooncakePrefill",
    "NixlDecode",
    "NixlPrefill",
]
