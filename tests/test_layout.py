"""The package layout holds: imports run one way (no file cycle, no edge outside the package
graph below), and every module of grctl imports on a CPU-only machine.

The graph is docs/architecture.md's; a new import that reaches up (the engine importing the
weights, the client importing the server) fails here, naming the file and the import.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "grctl"

# component -> the components it may import. A module's component is its top-level name under
# grctl (grctl.engine.scheduler -> engine), except the subpackages named here on their own.
ALLOWED: dict[str, set[str]] = {
    "errors": set(),
    "threads": set(),
    "heap": set(),
    "confined": {"errors"},
    "knobs": {"errors"},
    "model": {"errors"},
    "catalog": {"confined", "heap", "errors"},
    "protocol": {"errors"},
    "engine.search": {"model", "catalog", "errors"},
    "engine": {"engine.search", "model", "catalog", "confined", "heap", "knobs", "errors"},
    "weights.wire": {"model", "errors"},
    "weights": {"weights.wire", "engine", "model", "confined", "knobs", "errors"},
    "testing": {"engine", "weights", "weights.wire", "model", "errors"},
    "config": {"engine", "knobs", "errors"},
    "server": {
        "config",
        "engine",
        "engine.search",
        "weights",
        "weights.wire",
        "catalog",
        "confined",
        "protocol",
        "model",
        "knobs",
        "errors",
        "testing",
        "threads",
    },
    "client": {"protocol", "weights", "weights.wire", "model", "errors"},
    # the trainer's side, imported beside its own model: never the server or engine internals
    "rl": {"client", "catalog", "protocol", "weights.wire", "model", "errors"},
    # a trainer's own rollout code driving grctl servers (grctl/integrations/): HTTP only
    "integrations": {"client", "protocol", "errors"},
    "cli": {
        "rl",
        "server",
        "client",
        "config",
        "engine",
        "engine.search",
        "weights",
        "weights.wire",
        "catalog",
        "protocol",
        "model",
        "knobs",
        "errors",
        "threads",
    },
    "": set(),  # grctl/__init__.py: the version only
    "__main__": {"cli"},
}
SUBPACKAGES = ("engine.search", "weights.wire")


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports_of(path: Path, name: str, modules: dict[str, Path]) -> list[tuple[int, str]]:
    """(line, grctl module) for every import in the file, function-local and TYPE_CHECKING ones
    included: a cycle through either is still a cycle in the design."""
    is_pkg = path.name == "__init__.py"
    base = name if is_pkg else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            mod = node.module or ""
            if node.level:
                anchor = base.split(".")[: len(base.split(".")) - node.level + 1]
                mod = ".".join([*anchor, mod] if mod else anchor)
            # `from grctl.weights import apply` imports the submodule grctl.weights.apply
            targets = [
                f"{mod}.{a.name}" if f"{mod}.{a.name}" in modules else mod for a in node.names
            ]
        else:
            continue
        for t in targets:
            while t and t not in modules:  # `import grctl.engine.engine` -> that module
                t = t.rpartition(".")[0]
            if t.startswith("grctl") and t != name:
                out.append((node.lineno, t))
    return out


def component(module: str) -> str:
    rest = module.removeprefix("grctl").removeprefix(".")
    for sub in SUBPACKAGES:
        if rest == sub or rest.startswith(sub + "."):
            return sub
    return rest.split(".")[0]


def graph() -> dict[str, list[tuple[int, str]]]:
    modules = all_modules()
    return {name: imports_of(path, name, modules) for name, path in modules.items()}


def test_every_component_is_in_the_table():
    unknown = {component(m) for m in all_modules()} - set(ALLOWED)
    assert not unknown, f"new top-level modules or packages; add them to ALLOWED: {unknown}"


def test_imports_follow_the_package_graph():
    bad: list[str] = []
    for name, edges in graph().items():
        src = component(name)
        for line, target in edges:
            dst = component(target)
            if dst != src and dst not in ALLOWED[src] and target != "grctl":
                bad.append(f"{name}:{line} imports {target} ({src} -> {dst})")
    bad = list(dict.fromkeys(bad))  # one line per import, however many names it takes
    assert not bad, "imports against the package graph:\n" + "\n".join(bad)


def test_no_import_cycle_between_files():
    g = {name: sorted({t for _, t in edges if t != "grctl"}) for name, edges in graph().items()}
    # a package's __init__ importing its own submodules is how a package re-exports: not a cycle
    for name in g:
        g[name] = [t for t in g[name] if not t.startswith(name + ".")]
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            scc = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                scc.append(w)
                if w == v:
                    break
            if len(scc) > 1:
                cycles.append(sorted(scc))

    sys.setrecursionlimit(10_000)
    for v in g:
        if v not in index:
            visit(v)
    assert not cycles, "import cycles between files:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_every_module_imports_on_a_cpu_only_machine():
    """Each module in a fresh interpreter with CUDA hidden, the CUDA-only ones included."""
    names = [m for m in all_modules() if m != "grctl.__main__"]
    script = (
        "import importlib, sys\n"
        "failed = []\n"
        "for name in sys.argv[1:]:\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except Exception as exc:\n"
        "        failed.append(f'{name}: {type(exc).__name__}: {exc}')\n"
        "print('\\n'.join(failed))\n"
        "sys.exit(1 if failed else 0)\n"
    )
    env = {"CUDA_VISIBLE_DEVICES": "", "PATH": "/usr/bin:/bin"}
    out = subprocess.run(
        [sys.executable, "-c", script, *names],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stdout + out.stderr
