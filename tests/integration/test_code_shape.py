"""The code stays readable in one sitting: no library or benchmark module over 500 lines, no function over 80 lines
(Triton kernels aside: a function decorated with ``triton.jit``, or the factory that defines such kernels)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 80


def _sources() -> list[Path]:
    files = sorted(ROOT.glob("packages/*/src/**/*.py")) + sorted(ROOT.glob("bench/**/*.py"))
    assert len(files) > 50, f"found only {len(files)} source files under {ROOT}"
    return files


def _is_triton_jit(node: ast.AST) -> bool:
    if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        return False
    return any("triton.jit" in ast.unparse(d) or ast.unparse(d) == "jit" for d in node.decorator_list)


def _is_kernel(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    return _is_triton_jit(fn) or any(_is_triton_jit(n) for n in ast.walk(fn) if n is not fn)


def _long_functions(path: Path, root: Path = ROOT) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and not _is_kernel(node):
            n = (node.end_lineno or node.lineno) - node.lineno + 1
            if n > MAX_FUNCTION_LINES:
                found.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({n} lines)")
    return found


def test_no_module_is_over_500_lines() -> None:
    long = [f"{p.relative_to(ROOT)} ({n} lines)" for p in _sources() if (n := len(p.read_text().splitlines())) >
            MAX_FILE_LINES]  # fmt: skip
    assert not long, f"split these modules (at most {MAX_FILE_LINES} lines each): {long}"


def test_no_function_is_over_80_lines() -> None:
    long = [entry for p in _sources() for entry in _long_functions(p)]
    assert not long, f"split these functions (at most {MAX_FUNCTION_LINES} lines each): {long}"


def test_the_checks_see_a_long_function_and_exempt_a_kernel(tmp_path: Path) -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    src = tmp_path / "m.py"
    src.write_text(
        f"def long():\n{body}\n\n\ndef factory():\n    @triton.jit\n    def k():\n{body.replace('    ', '        ')}\n"
    )
    found = _long_functions(src, tmp_path)
    assert [f.split()[1] for f in found] == ["long"], found
