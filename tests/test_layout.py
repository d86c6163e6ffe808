"""The package's folders name its architecture: each subpackage imports only what its docstring allows, no module
import cycle exists, and the public names stay where users import them from."""

import ast
from pathlib import Path

import lightning_ddp_plus

PACKAGE = Path(lightning_ddp_plus.__file__).parent

#: What each subpackage may import of this package (its docstring says the same); the top level may import all.
ALLOWED = {
    "config": set(),
    "demo": set(),
    "sync": {"config"},
    "sharding": {"config"},
    "memory": {"config", "sharding"},
    "conflicts": {"config"},
    "processes": {"config"},
    "persistence": {"config", "processes"},
    "diagnostics": {"config", "sync", "conflicts", "memory"},
    "engine": {"config", "sync", "sharding", "memory", "conflicts", "diagnostics", "processes", "persistence"},
    "frontends": {
        "config",
        "sync",
        "sharding",
        "conflicts",
        "diagnostics",
        "processes",
        "persistence",
        "engine",
        "demo",
    },
}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> set[str]:
    """Every module of this package that ``path`` imports, at the top or inside a function."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lightning_ddp_plus"):
            found.add(node.module)
            for alias in node.names:  # ``from lightning_ddp_plus.processes import reachability``
                candidate = f"{node.module}.{alias.name}"
                if (PACKAGE.parent / Path(*candidate.split("."))).with_suffix(".py").exists():
                    found.add(candidate)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("lightning_ddp_plus")}
    return found


MODULES = {module_name(path): imports_of(path) for path in PACKAGE.rglob("*.py")}


def subpackage(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in ALLOWED) else None


def test_every_module_lives_in_a_subpackage_with_a_docstring_that_says_what_it_may_import():
    loose = [m for m in MODULES if m.count(".") == 1 and m.split(".")[1] not in {*ALLOWED, "__main__"}]
    assert loose == [], f"modules outside the subpackages: {loose}"
    for name in ALLOWED:
        docstring = ast.get_docstring(ast.parse((PACKAGE / name / "__init__.py").read_text())) or ""
        assert "May import:" in docstring, name


def test_subpackages_import_only_what_they_may():
    wrong = []
    for module, imported in MODULES.items():
        own = subpackage(module)
        if own is None:
            continue
        for target in imported:
            other = subpackage(target)
            top_level = target == "lightning_ddp_plus" and own != "frontends"  # the CLI registers the strategy names
            if top_level or (other is not None and other != own and other not in ALLOWED[own]):
                wrong.append(f"{module} imports {target}")
    assert wrong == []


def test_no_module_import_cycle():
    graph = {m: {t for t in targets if t in MODULES and t != m} for m, targets in MODULES.items()}
    state: dict[str, int] = {}

    def visit(node: str, trail: list[str]) -> list[str] | None:
        state[node] = 1
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                return [*trail, node, target]
            if target not in state and (cycle := visit(target, [*trail, node])):
                return cycle
        state[node] = 2
        return None

    packages = {m for m in graph if m.endswith(tuple(ALLOWED)) or m == "lightning_ddp_plus"}
    for module in sorted(graph):
        if module not in state and module not in packages:
            assert visit(module, []) is None


def test_public_names_stay_at_the_top_level():
    assert {"DDPPlusStrategy", "DDPPlusFabricStrategy", "DDPConflictError", "DDPSettings", "UnevenInputsError"} <= set(
        lightning_ddp_plus.__all__
    )
    for name in lightning_ddp_plus.__all__:
        assert getattr(lightning_ddp_plus, name) is not None
