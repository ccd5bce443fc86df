"""The Python API is typed: `mypy --strict` accepts a usage example and rejects a wrong one.

`typing_examples/good.py` uses the API as documented and must check clean;
`typing_examples/bad.py` makes one mistake per line marked with an error comment (a misspelled option, a
wrong type, a wrong choice, an unawaited async call...) and mypy must report exactly those lines.
The option types come from `pdgate._options`, generated from the Rust schema.
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parent / "typing_examples"
PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "python" / "pdgate"
# The modules of the public API (the engine and the CLI are not held to --strict yet).
API_MODULES = ["__init__", "_async_gateway", "_config", "_native", "_options", "_workers_api", "errors", "gateway"]
ERROR_LINE = re.compile(r"^(?P<file>[^:\n]+\.py):(?P<line>\d+): error: (?P<message>.*)$", re.M)

pytest.importorskip("mypy", reason="mypy is in the test extra: pip install .[test]")


def marked_lines(path: pathlib.Path) -> set[int]:
    lines = path.read_text().splitlines()
    return {n for n, text in enumerate(lines, start=1) if "# error:" in text}


def mypy_strict(tmp_path_factory: pytest.TempPathFactory, files: list[pathlib.Path]) -> subprocess.CompletedProcess[str]:
    cache = tmp_path_factory.mktemp("mypy-cache")
    out = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--no-color-output", "--no-error-summary",
         "--show-absolute-path", "--cache-dir", str(cache), *map(str, files)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path_factory.getbasetemp(),
    )
    assert out.returncode in (0, 1), f"mypy crashed:\n{out.stdout}\n{out.stderr}"
    return out


@pytest.fixture(scope="module")
def mypy_errors(tmp_path_factory: pytest.TempPathFactory) -> dict[str, set[int]]:
    """One `mypy --strict` run over both examples: {file name: lines with an error}."""
    out = mypy_strict(tmp_path_factory, [EXAMPLES / "good.py", EXAMPLES / "bad.py"])
    errors: dict[str, set[int]] = {"good.py": set(), "bad.py": set()}
    for match in ERROR_LINE.finditer(out.stdout):
        name = pathlib.Path(match["file"]).name
        assert name in errors, f"mypy reports an error outside the examples (in pdgate?):\n{out.stdout}"
        errors[name].add(int(match["line"]))
    print(out.stdout)
    return errors


def test_the_usage_example_checks_clean(mypy_errors: dict[str, set[int]]) -> None:
    assert mypy_errors["good.py"] == set()


def test_every_mistake_is_rejected_and_nothing_else(mypy_errors: dict[str, set[int]]) -> None:
    expected = marked_lines(EXAMPLES / "bad.py")
    assert len(expected) >= 9
    assert mypy_errors["bad.py"] == expected


def test_the_api_modules_check_clean(tmp_path_factory: pytest.TempPathFactory) -> None:
    out = mypy_strict(tmp_path_factory, [PACKAGE / f"{name}.py" for name in API_MODULES])
    assert out.returncode == 0, out.stdout
