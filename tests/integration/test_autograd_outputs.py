"""No ``torch.autograd.Function`` forward in the packages returns a tensor through a method that may return its own
input (``.to``, ``.float()``, ``.contiguous()``, ``.type_as``...): PyTorch 2.11's ``torch.compile`` gives such a
function's inputs a zero gradient (``mcore_parallel.autograd``, whose ``as_dtype`` is the safe spelling of a cast).
The check follows the returned names to their assignments, through views, and into the module's own functions the
forward returns the result of."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAYBE_SELF = {"to", "float", "double", "half", "bfloat16", "contiguous", "type_as", "type"}
VIEWS = {"view", "reshape", "view_as", "reshape_as", "squeeze", "unsqueeze", "flatten"}


def _assignments(fn: ast.FunctionDef) -> dict[str, list[ast.expr]]:
    out: dict[str, list[ast.expr]] = {}
    for node in ast.walk(fn):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                names = target.elts if isinstance(target, ast.Tuple) else [target]
                values = node.value.elts if isinstance(node.value, ast.Tuple) and len(node.value.elts) == len(names) \
                    else [node.value] * len(names)  # fmt: skip
                for name, value in zip(names, values, strict=True):
                    if isinstance(name, ast.Name):
                        out.setdefault(name.id, []).append(value)
    return out


def _returns(fn: ast.FunctionDef) -> list[ast.expr]:
    return [n.value for n in ast.walk(fn) if isinstance(n, ast.Return) and n.value is not None]


def _flagged(expr: ast.expr, fn: ast.FunctionDef, funcs: dict[str, ast.FunctionDef], depth: int,
             seen: set[tuple[int, str]]) -> list[str]:  # fmt: skip
    """The calls that ``expr`` (returned by ``fn``) may be the unchanged result of."""
    if isinstance(expr, ast.Tuple):
        return [f for e in expr.elts for f in _flagged(e, fn, funcs, depth, seen)]
    if isinstance(expr, ast.Name):
        if (id(fn), expr.id) in seen:
            return []
        seen.add((id(fn), expr.id))
        return [f for v in _assignments(fn).get(expr.id, []) for f in _flagged(v, fn, funcs, depth, seen)]
    if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute):
        if expr.func.attr in MAYBE_SELF:
            return [f"line {expr.lineno}: {ast.unparse(expr)}"]
        if expr.func.attr in VIEWS:
            return _flagged(expr.func.value, fn, funcs, depth, seen)
    if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Name) and expr.func.id in funcs and depth < 4:
        g = funcs[expr.func.id]
        return [f for r in _returns(g) for f in _flagged(r, g, funcs, depth + 1, seen)]
    return []


def autograd_forward_problems(source: str, name: str) -> list[str]:
    tree = ast.parse(source)
    funcs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    found = []
    for cls in [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]:
        if not any(ast.unparse(b).endswith("autograd.Function") for b in cls.bases):
            continue
        for fn in [n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "forward"]:
            for expr in _returns(fn):
                found += [f"{name} {cls.name}.forward returns {f}" for f in _flagged(expr, fn, funcs, 0, set())]
    return found


def test_no_autograd_forward_returns_a_maybe_self_result() -> None:
    files = sorted(ROOT.glob("packages/*/src/**/*.py"))
    forwards = sum(p.read_text().count("autograd.Function)") for p in files)
    assert forwards > 10, f"found only {forwards} autograd functions under {ROOT}"
    problems = [f for p in files for f in autograd_forward_problems(p.read_text(), str(p.relative_to(ROOT)))]
    assert not problems, (
        "call the method only where it changes the tensor (mcore_parallel.autograd.as_dtype):\n" + "\n".join(problems)
    )


def test_the_check_finds_each_spelling() -> None:
    bad = """
import torch
def helper(x):
    y = x * 2
    return y.to(x.dtype)
class A(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        out = x * 3
        out = out.float()
        return out.view(-1)
class B(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return helper(x), x.contiguous()
class C(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y, z = x * 2, x + 1
        return as_dtype(y, torch.float32), z.view(2, -1)
"""
    found = autograd_forward_problems(bad, "m.py")
    assert [f.split(" returns ")[0] for f in found] == ["m.py A.forward", "m.py B.forward", "m.py B.forward"], found
    assert "out.float()" in found[0] and "y.to(x.dtype)" in found[1] and "x.contiguous()" in found[2]
