"""deploy/Dockerfile, offline: a pinned Rust toolchain and locked crates, the wheel installed with
the complete runtime dependencies (the reference-engine pods import them at start), and a
.dockerignore that keeps the sources in the build context."""

from __future__ import annotations

import ast
import fnmatch
import pathlib
import re
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"


def dockerfile_stages() -> list[str]:
    text = (DEPLOY / "Dockerfile").read_text().replace("\\\n", " ")
    return re.split(r"^FROM ", text, flags=re.M)[1:]


def test_dockerfile_pins_the_rust_toolchain() -> None:
    build = dockerfile_stages()[0]
    (pinned,) = re.findall(r"^ARG RUST_TOOLCHAIN=(\d+\.\d+\.\d+)$", build, re.M)
    assert '--default-toolchain "$RUST_TOOLCHAIN"' in build, "rustup installs the pinned toolchain"
    (minimum,) = re.findall(r'^rust-version = "([\d.]+)"', (REPO / "Cargo.toml").read_text(), re.M)
    version = lambda v: tuple(int(x) for x in v.split("."))  # noqa: E731
    assert version(pinned) >= version(minimum), f"toolchain {pinned} is older than the workspace's rust-version {minimum}"
    assert re.search(r"maturin build .*--locked", build), "the image builds the dependencies in Cargo.lock"


def pyproject_dependencies() -> set[str]:
    text = (REPO / "pyproject.toml").read_text()
    block = re.search(r"^dependencies = \[(.*?)^\]", text, re.M | re.S)
    assert block, "pyproject.toml: [project] dependencies"
    return {re.split(r"[<>=!~;\[ ]", d, maxsplit=1)[0].lower().replace("_", "-") for d in re.findall(r'"([^"]+)"', block.group(1))}


def module_level_imports() -> dict[str, str]:
    """Third-party modules python/pdgate imports at module level (not in a function, try or
    TYPE_CHECKING block): what `pdgate launch` and `pdgate engine` need to start."""
    if not hasattr(sys, "stdlib_module_names"):
        pytest.skip("needs Python 3.10+ (sys.stdlib_module_names)")
    found: dict[str, str] = {}
    for path in sorted((REPO / "python" / "pdgate").rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else []
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top not in ("pdgate", "__future__"):
                    found.setdefault(top, str(path.relative_to(REPO)))
    return found


def test_the_image_installs_the_complete_runtime_dependencies() -> None:
    runtime = dockerfile_stages()[-1]
    (install,) = re.findall(r"^RUN pip install (.*)$", runtime, re.M)
    assert "/wheels/*.whl" in install and "--no-deps" not in install, "the wheel with its dependencies"
    assert re.search(r'python -c "import pdgate\._core, .*pdgate\.engine\.server', install), "a missing module fails the build"
    # The distribution names of modules the package imports at start, as far as they differ.
    distribution = {"prometheus_client": "prometheus-client", "yaml": "pyyaml", "grpc": "grpcio", "google": "protobuf",
                    "zmq": "pyzmq"}
    needed = {distribution.get(m, m).lower().replace("_", "-"): where for m, where in module_level_imports().items()}
    missing = set(needed) - pyproject_dependencies()
    assert not missing, f"imported at start but not in pyproject.toml's dependencies: {({m: needed[m] for m in missing})}"


def test_dockerignore_keeps_what_the_build_needs() -> None:
    patterns = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines() if line.strip() and not line.startswith("#")]
    needed = ["Cargo.toml", "Cargo.lock", "pyproject.toml", "README.md", "crates", "bindings", "python"]
    for path in needed:
        assert (REPO / path).exists(), path
        assert not any(fnmatch.fnmatch(path, p.lstrip("/").rstrip("/")) for p in patterns), f".dockerignore drops {path}"
    assert {".git", "target"} <= set(patterns), "the context leaves out history and build outputs"
