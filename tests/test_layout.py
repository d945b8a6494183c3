"""The layout is the architecture: every module of ds4_mlx sits on one floor, and imports (at the top of a
module or inside a function alike) only go down or stay on their floor, without a cycle. The tools
(benchmarks, test support) sit above the library, so no library module imports them, nor a test-only
package."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "ds4_mlx"

# lowest first; a name is a module or a package with everything under it
FLOORS = [
    ["ds4_mlx.precision"],  # which modes are exact: float32 parameters, TF32 off
    ["ds4_mlx.cache"],  # per-layer state, saving sessions, the disk store
    # the forward pass, by idea: configuration, GGUF names and blocks, shared numerics
    ["ds4_mlx.models.args", "ds4_mlx.models.gguf_names", "ds4_mlx.models.gguf_blocks", "ds4_mlx.models.numerics",
     "ds4_mlx.models.variants"],
    ["ds4_mlx.models.kernels", "ds4_mlx.models.compiling", "ds4_mlx.models.linear"],  # kernels, compiling, linears
    ["ds4_mlx.models.hyper", "ds4_mlx.models.compressor", "ds4_mlx.models.attention", "ds4_mlx.models.moe"],  # blocks
    ["ds4_mlx.models.deepseek_v4"],  # the decoder layer and the model: ids, Slots and arrays to logits
    ["ds4_mlx.models"],  # the drafters
    ["ds4_mlx.session"],  # one conversation's tokens and caches: when to go back
    ["ds4_mlx.tokenizer", "ds4_mlx.chat"],  # text: tokens, rendering prompts, parsing answers
    ["ds4_mlx.generate", "ds4_mlx.constrain"],  # sampling, stop conditions, streaming on a session
    ["ds4_mlx.convert"],  # GGUF files: reading, converting to MLX folders
    ["ds4_mlx", "ds4_mlx.loader"],  # a model folder or GGUF file to (model, tokenizer)
    ["ds4_mlx.demo"],  # the built-in demo model
    ["ds4_mlx.distributed"],  # one model over several machines: a pipeline, sessions in lockstep
    ["ds4_mlx.server"],  # HTTP: APIs, slots, queueing
    ["ds4_mlx.generate_cli", "ds4_mlx.repl"],  # the library's own commands
    ["ds4_mlx.tools"],  # benchmarks and test support
    ["ds4_mlx.cli"],  # the one `ds4-mlx` command
]
TOOLS = FLOORS.index(["ds4_mlx.tools"])
TEST_ONLY = {"pytest", "hypothesis", "torch", "transformers", "openai", "anthropic", "pexpect", "requests",
             "schemathesis", "playwright", "tests", "conftest"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def floor_of(module: str) -> int:
    """The floor of the most specific name in FLOORS that holds `module`."""
    best = None
    for level, names in enumerate(FLOORS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and (best is None or len(name) > len(best[1])):
                best = (level, name)
    assert best is not None, f"{module} sits on no floor: add it to FLOORS"
    return best[0]


def imports(module: str) -> set:
    """(ds4_mlx modules, other top-level packages) that `module` imports anywhere in its file."""
    ours, others = set(), set()
    package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package upward
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            # `from pkg import name` imports the module pkg.name when there is one
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        for name in names:
            if name.split(".")[0] == "ds4_mlx":
                while name not in MODULES:  # an attribute of a module: the module
                    name = name.rpartition(".")[0]
                if name != module:
                    ours.add(name)
            else:
                others.add(name.split(".")[0])
    return ours, others


GRAPH = {m: imports(m)[0] for m in MODULES}


def test_every_module_is_on_a_floor():
    for module in MODULES:
        floor_of(module)


def test_no_import_points_up():
    upward = [f"{m} (floor {floor_of(m)}) imports {d} (floor {floor_of(d)})"
              for m, deps in GRAPH.items() for d in sorted(deps) if floor_of(d) > floor_of(m)]
    assert not upward, "\n".join(upward)


def test_no_import_cycle():
    done, path = set(), []

    def visit(m):
        if m in path:
            raise AssertionError("import cycle: " + " -> ".join(path[path.index(m):] + [m]))
        if m in done:
            return
        path.append(m)
        for d in sorted(GRAPH[m]):
            visit(d)
        path.pop()
        done.add(m)

    for m in MODULES:
        visit(m)


def test_the_library_imports_no_tool_and_no_test_package():
    library = [m for m in MODULES if floor_of(m) < TOOLS]
    for m in library:
        ours, others = imports(m)
        assert not {d for d in ours if floor_of(d) >= TOOLS}, m
        assert not others & TEST_ONLY, f"{m} imports {sorted(others & TEST_ONLY)}"


def test_the_checks_see_a_bad_import(monkeypatch):
    """The floors catch an arrow upward and a cycle (a check that cannot fail would prove nothing)."""
    bad = {m: set(d) for m, d in GRAPH.items()}
    bad["ds4_mlx.models.deepseek_v4"].add("ds4_mlx.tools.testing")
    bad["ds4_mlx.cache.layers"].add("ds4_mlx.models.deepseek_v4")
    bad["ds4_mlx.models.linear"].add("ds4_mlx.models.attention")
    monkeypatch.setitem(globals(), "GRAPH", bad)
    for check in (test_no_import_points_up, test_no_import_cycle):
        try:
            check()
        except AssertionError:
            continue
        raise AssertionError(f"{check.__name__} missed the bad import")
