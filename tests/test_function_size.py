"""No function in the forward pass (`ds4_mlx/models`) or the cache (`ds4_mlx/cache`) runs past 80 lines: a
longer one holds more than one idea, and is split at its seams."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "ds4_mlx"
CHECKED = ["models", "cache"]
MOST_LINES = 80


def long_functions(source: str, name: str) -> list:
    """'name:line function (n lines)' for each function of `source` longer than MOST_LINES, decorators aside."""
    return [f"{name}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MOST_LINES]


def test_no_function_runs_past_the_limit():
    files = [p for folder in CHECKED for p in sorted((PACKAGE / folder).rglob("*.py"))]
    assert files
    found = [f for p in files for f in long_functions(p.read_text(), str(p.relative_to(PACKAGE.parent)))]
    assert not found, "\n".join(found)


def test_the_check_sees_a_long_function():
    def method(lines):  # a method of `lines` lines, def line included
        return "class A:\n    def f(self):\n" + "".join(f"        x = {i}\n" for i in range(lines - 1))

    assert long_functions(method(MOST_LINES + 1), "a.py") and not long_functions(method(MOST_LINES), "a.py")
