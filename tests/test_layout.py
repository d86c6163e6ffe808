"""The package's folders name its architecture: each subpackage imports only what its docstring allows, no module
import cycle exists, the public names stay where users import them from, DDP's internals are called from one module,
and the front ends stay thin (sizes below)."""

import ast
from pathlib import Path

import lightning_ddp_plus

PACKAGE = Path(lightning_ddp_plus.__file__).parent

#: What each subpackage may import of this package (its docstring says the same); the top level may import all.
ALLOWED = {
    "private_apis": set(),
    "pipeline": set(),
    "crash": set(),
    "config": {"pipeline", "private_apis"},
    "demo": set(),
    "sync": {"config", "pipeline", "private_apis"},
    "sharding": {"config", "pipeline", "private_apis"},
    "memory": {"config", "sharding", "private_apis"},
    "conflicts": {"config", "pipeline", "private_apis"},
    "processes": {"config", "private_apis"},
    "persistence": {"config", "processes", "private_apis"},
    "preemption": {"config", "sync", "pipeline", "private_apis"},
    "diagnostics": {"config", "sync", "conflicts", "memory", "processes", "pipeline", "private_apis"},
    "engine": {
        "pipeline",
        "config",
        "sync",
        "sharding",
        "memory",
        "conflicts",
        "diagnostics",
        "processes",
        "persistence",
        "preemption",
        "private_apis",
    },
    "frontends": {
        "config",
        "crash",
        "sync",
        "sharding",
        "conflicts",
        "diagnostics",
        "processes",
        "persistence",
        "engine",
        "preemption",
        "demo",
        "private_apis",
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


#: The libraries whose private names live in ``private_apis`` only.
FOREIGN = ("torch", "lightning", "lightning_fabric", "pytorch_lightning")


def is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def own_private_names() -> set[str]:
    """The underscored names this package defines: functions, classes, module names, and attributes it sets on
    ``self``/``cls`` (what a class of its own keeps)."""
    own = set()
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                    own.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                own.add(node.target.id)
    return {name for name in own if is_private(name)}


def lightning_strategy_members() -> set[str]:
    """The protected members of Lightning's strategies, which a strategy subclass overrides and reads (Lightning's
    extension API for strategies): allowed on ``self`` in the front ends."""
    from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy
    from lightning.pytorch.strategies import DDPStrategy

    members = set()
    for strategy in (DDPStrategy(), FabricDDPStrategy()):
        members |= {name for name in dir(strategy) if is_private(name)}
    return members


def foreign_private_names(path: Path, own: set[str], strategy_members: set[str]) -> list[str]:
    """Every private name of torch or Lightning that ``path`` uses: an import of an underscored module or name, or an
    underscored attribute that this package does not define (read on any object but ``sys`` and ``os``)."""
    found = []
    front_end = path.parent.name == "frontends"
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in FOREIGN:
            names = [*node.module.split("."), *(alias.name for alias in node.names)]
            found += [f"{path.name}:{node.lineno} {node.module}: {n}" for n in names if is_private(n)]
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] in FOREIGN and any(is_private(part) for part in parts):
                    found.append(f"{path.name}:{node.lineno} import {alias.name}")
        elif isinstance(node, ast.Attribute) and is_private(node.attr):
            holder = node.value
            on_self = isinstance(holder, ast.Name) and holder.id in ("self", "cls")
            if isinstance(holder, ast.Name) and holder.id in ("sys", "os"):
                continue
            if front_end and on_self and node.attr in strategy_members:
                continue
            if node.attr not in own:
                found.append(f"{path.name}:{node.lineno} .{node.attr} on {ast.unparse(holder)}")
    return found


def test_private_torch_and_lightning_names_are_used_in_private_apis_only():
    own = own_private_names()
    members = lightning_strategy_members()
    room = PACKAGE / "private_apis"
    outside = [
        found
        for path in PACKAGE.rglob("*.py")
        if room not in path.parents
        for found in foreign_private_names(path, own, members)
    ]
    assert outside == []
    inside = [found for path in room.glob("*.py") for found in foreign_private_names(path, own, members)]
    assert len(inside) > 20  # the rule finds what the room holds: it can fail


def test_the_private_api_room_says_what_each_name_is_for():
    for path in (PACKAGE / "private_apis").glob("*.py"):
        if path.name == "__init__.py":
            continue
        docstring = ast.get_docstring(ast.parse(path.read_text())) or ""
        assert "| what |" in docstring and "probe" in docstring, path.name


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


#: Design rules, not measurements: a feature that does not fit goes to the room its name says (docs/development.md).
LINE_LIMITS = {
    "frontends/strategy.py": 400,
    "frontends/fabric.py": 280,
    "frontends/common.py": 300,
    "engine/engine.py": 250,
}


def test_the_front_ends_and_the_engine_stay_thin():
    too_long = {
        name: lines
        for name, limit in LINE_LIMITS.items()
        if (lines := len((PACKAGE / name).read_text().splitlines())) > limit
    }
    assert too_long == {}
    classes = {
        f"{path.name}:{node.name}": code_lines_without_docstrings(node)
        for path in (PACKAGE / "frontends").glob("*.py")
        for node in ast.parse(path.read_text()).body
        if isinstance(node, ast.ClassDef)
    }
    assert classes["strategy.py:DDPPlusStrategy"] > 100  # the rule reads the classes
    assert {name: lines for name, lines in classes.items() if lines > 350} == {}


def test_the_engine_imports_what_it_composes_and_no_front_end():
    imported = MODULES["lightning_ddp_plus.engine.engine"]
    assert not [name for name in imported if name.startswith("lightning_ddp_plus.frontends")]
    assert len([name for name in imported if name.startswith("lightning_ddp_plus.")]) < 30


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


def test_the_shared_front_end_part_overrides_nothing_of_lightning_and_calls_no_super():
    """Composition, not cooperative mixins: ``DDPPlusFrontEnd`` only adds (views, helpers); each front end overrides
    Lightning's hooks itself."""
    from lightning.fabric.strategies import DDPStrategy as FabricDDPStrategy
    from lightning.pytorch.strategies import DDPStrategy

    from lightning_ddp_plus.frontends.common import DDPPlusFrontEnd

    own = {name for name in vars(DDPPlusFrontEnd) if not name.startswith("__")}
    assert "engine" in DDPPlusFrontEnd.__annotations__ and "findings" in own
    assert own & (set(dir(DDPStrategy)) | set(dir(FabricDDPStrategy))) == set()
    calls = [
        node
        for node in ast.walk(ast.parse((PACKAGE / "frontends" / "common.py").read_text()))
        if isinstance(node, ast.Call)
    ]
    assert calls and not [call for call in calls if isinstance(call.func, ast.Name) and call.func.id == "super"]
    for front_end in (lightning_ddp_plus.DDPPlusStrategy, lightning_ddp_plus.DDPPlusFabricStrategy):
        assert front_end.__bases__[0] is DDPPlusFrontEnd and len(front_end.__bases__) == 2


def test_every_type_ignore_says_why_and_they_are_few():
    ignores = [
        f"{path.relative_to(PACKAGE)}:{number}"
        for path in PACKAGE.rglob("*.py")
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if "# type: ignore" in line
    ]
    without_reason = [
        f"{path.relative_to(PACKAGE)}:{number}"
        for path in PACKAGE.rglob("*.py")
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if "# type: ignore" in line and "  # " not in line.split("# type: ignore", 1)[1]
    ]
    assert without_reason == []
    assert 0 < len(ignores) <= 15, ignores


def engine_chains(source: str) -> set[str]:
    """``engine.<component>.<member>`` in ``path`` (``self.engine.window.steps``, ``engine.uneven.mode``): a front end
    reaching through the engine into one of its components. ``engine.arguments.<name>`` is the validated
    configuration, a value, and is not counted."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute):
            component, base = node.value, node.value.value
            on_engine = (isinstance(base, ast.Name) and base.id == "engine") or (
                isinstance(base, ast.Attribute) and base.attr == "engine"
            )
            if on_engine and component.attr != "arguments":
                found.add(f"engine.{component.attr}.{node.attr}")
    return found


def test_the_front_ends_call_engine_actions_and_reach_no_component():
    """The front ends call the engine's actions and read its properties (``docs/development.md``); a component's
    member reached through the engine would tie a front end to how the engine is built."""
    chains = {
        f"{path.name}: {chain}"
        for path in (PACKAGE / "frontends").glob("*.py")
        for chain in engine_chains(path.read_text())
    }
    assert chains == set()
    probe = "self.engine.window.steps\nengine.uneven.padding = False\nengine.arguments.backend\nself.engine.step_done()"
    assert engine_chains(probe) == {"engine.window.steps", "engine.uneven.padding"}  # the rule sees them


def test_no_method_is_written_twice_in_the_two_front_ends():
    """What reads the same in both front ends is written once (``framework_io.py``, ``registry.py``)."""
    from benchmarks.step_path import methods_written_alike

    assert methods_written_alike() == []


def test_importing_the_package_leaves_torchs_sharded_optimizer_unloaded():
    """``torch.distributed.optim`` costs every rank about 0.2 s to import (half of the package's import): only a
    sharded optimizer needs it (``sharding/zero_redundancy.py``)."""
    import subprocess
    import sys

    probe = "import sys, lightning_ddp_plus; print('torch.distributed.optim' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip() == "False"
