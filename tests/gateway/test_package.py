"""The package imports without the compiled extension (the engine needs only Python), and says
how to build it when the gateway is used."""

from __future__ import annotations

import subprocess
import sys

BLOCK_CORE = "import sys; sys.modules['pdgate._core'] = None\n"  # makes `import pdgate._core` fail


def python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCK_CORE + code], capture_output=True, text=True, timeout=60)


def test_import_without_extension() -> None:
    out = python("import pdgate, pdgate.errors, pdgate.cli; print(sorted(pdgate.__all__) == pdgate.__all__)")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "True"


def test_gateway_without_extension_explains() -> None:
    out = python("import pdgate\ntry:\n    pdgate.Gateway()\nexcept ImportError as e:\n    print(e)")
    assert out.returncode == 0, out.stderr
    assert "pip install" in out.stdout and "maturin" in out.stdout
