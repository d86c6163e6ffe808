"""The package's folders name its architecture: each subpackage imports only what its docstring allows, no module
import cycle exists, the public names stay where users import them from, DDP's internals are called from one module,
and the front ends stay thin (sizes below)."""

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
    "diagnostics": {"config", "sync", "conflicts", "memory", "processes"},
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


#: torch's private names for DDP and its reducer that the package calls: only ``sync/ddp_internals.py`` may.
DDP_INTERNALS = {
    "_build_params_for_reducer",
    "_build_debug_param_to_name_mapping",
    "_ddp_init_helper",
    "_set_static_graph",
    "_has_rebuilt_buckets",
    "_comm_hooks",
    "_remove_autograd_hooks",
    "_bucket_config",
    "_BucketCapacityConfig",
    "_use_python_reducer",
    "_DDPSink",
    "_find_tensors",
    "_check_reducer_finalized",
    "_get_zeros_like_grad_buckets",
    "_run_comm_hook",
    "_delay_all_reduce",
    "_get_ddp_logging_data",
    "_execution_engine",
    "_set_pg_timeout",
    "_set_ddp_runtime_logging_sample_rate",
    "set_runtime_stats_and_log",
    "prepare_for_forward",
    "prepare_for_backward",
}


def test_ddp_internals_are_called_from_one_module():
    touching = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            name = node.attr if isinstance(node, ast.Attribute) else getattr(node, "name", None)
            if isinstance(node, ast.alias):
                name = node.name
            if name in DDP_INTERNALS:
                touching.add(module_name(path))
    assert touching == {"lightning_ddp_plus.sync.ddp_internals"}


def function_lengths() -> dict[str, int]:
    """Every function of the package and its length in lines (decorators excluded, docstring included)."""
    lengths = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lengths[f"{module_name(path)}:{node.lineno} {node.name}"] = node.end_lineno - node.lineno + 1
    return lengths


def code_lines_without_docstrings(node: ast.AST) -> int:
    """Lines of ``node`` but those of its docstrings (and of the docstrings of what it holds)."""
    lines = set(range(node.lineno, node.end_lineno + 1))
    for inner in ast.walk(node):
        body = getattr(inner, "body", None)
        if isinstance(inner, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and body:
            first = body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                lines -= set(range(first.lineno, first.end_lineno + 1))
    return len(lines)


def test_no_function_is_longer_than_60_lines():
    assert {name: n for name, n in function_lengths().items() if n > 60} == {}


def test_the_front_ends_stay_thin():
    strategy_file = PACKAGE / "frontends" / "strategy.py"
    fabric_file = PACKAGE / "frontends" / "fabric.py"
    assert len(strategy_file.read_text().splitlines()) <= 430  # what a feature needs of Lightning lives beside it
    assert len(fabric_file.read_text().splitlines()) <= 305
    [strategy] = [
        node
        for node in ast.parse(strategy_file.read_text()).body
        if isinstance(node, ast.ClassDef) and node.name == "DDPPlusStrategy"
    ]
    assert code_lines_without_docstrings(strategy) <= 350
    methods = [node for node in strategy.body if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))]
    assert {m.name: m.end_lineno - m.lineno + 1 for m in methods if m.end_lineno - m.lineno + 1 > 50} == {}


def test_no_front_end_touches_a_private_attribute_of_the_engine():
    touched = []
    for path in (PACKAGE / "frontends").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
                inner = node.value
                while isinstance(inner, ast.Attribute):  # self.engine.window._x, engine._x
                    if inner.attr == "engine":
                        touched.append(f"{path.name}:{node.lineno} {node.attr}")
                    inner = inner.value
                if isinstance(inner, ast.Name) and inner.id == "engine":
                    touched.append(f"{path.name}:{node.lineno} {node.attr}")
    assert touched == []
