"""The text that must not drift from the code, written into the repository from the code, and checked.

- ``docs/arguments.md``: the arguments table, from ``DDPPlusStrategy``'s signature and ``__init__`` docstring, which
  ``DDPPlusArguments`` (the one declaration) generates, with the arguments Fabric does not take and why;
- ``docs/guides/conflicts.md``: the conflict rules, from ``lightning_ddp_plus.conflicts.rules.RULES``;
- ``lightning_ddp_plus/demo/cpu.yaml`` (also ``configs/cpu.yaml``): every strategy argument written out, in declaration
  order; a value set in the file is kept, a missing argument gets its default;
- ``lightning_ddp_plus/engine/keywords.py``: the front ends' keyword arguments as ``TypedDict``s (what type checkers
  and IDEs read from ``**arguments: Unpack[...]``) and every argument's docstring (what ``help()`` and LightningCLI
  show at run time, where the source may not be installed).

``python docs/generated.py`` rewrites them; ``python docs/generated.py --check`` (and ``tests/test_generated.py``)
fails when one is stale. As the site's mkdocs hook it fails a build from stale files, so the site and the repository
show the same tables.
"""

from __future__ import annotations

import html
import inspect
import re
import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
START = "<!-- generated: {name} (docs/generated.py; do not edit by hand) -->"
END = "<!-- end generated: {name} -->"
CONFIG = ROOT / "lightning_ddp_plus" / "demo" / "cpu.yaml"
CONFIG_BLOCK = re.compile(
    r"(?m)^  strategy:\n    class_path: [^\n]*\n    init_args:[^\n]*\n(?P<body>(?:      [^\n]*\n)*)"
)
CONFIG_LINE = re.compile(r"^      (?P<name>\w+): (?P<value>.*?)(?:\s+# (?P<comment>.*))?$")


def docstring_arguments(doc: str) -> dict[str, str]:
    """``name: text`` entries of a Google-style ``Args:`` section, continuation lines joined."""
    section = doc.split("Args:", 1)[1]
    entries: dict[str, str] = {}
    name = None
    for line in section.split("\n"):
        match = re.match(r"^ {4}(\*{0,2}\w+): (.*)$", line)
        if match:
            name = match.group(1).lstrip("*")
            entries[name] = match.group(2).strip()
        elif name and line.startswith("     ") and line.strip():
            entries[name] += " " + line.strip()
    return entries


def cell(text: str, code: bool = False) -> str:
    """A table cell: RST double backticks as Markdown code; a pipe escaped (as an HTML entity inside code, where a
    backslash would show)."""
    if code:
        return f"<code>{html.escape(text).replace('|', '&#124;')}</code>" if text else ""
    return text.replace("``", "`").replace("|", "\\|")


def annotation_text(annotation: Any) -> str:
    if annotation is inspect.Parameter.empty:
        return ""
    text = annotation if isinstance(annotation, str) else inspect.formatannotation(annotation)
    return text.replace("typing.", "").replace("collections.abc.", "").replace("datetime.", "")


def arguments_table() -> str:
    from lightning_ddp_plus import DDPPlusStrategy
    from lightning_ddp_plus.engine.arguments import trainer_only_arguments

    described = docstring_arguments(inspect.getdoc(DDPPlusStrategy.__init__) or "")
    fabric_lacks = trainer_only_arguments()
    rows = ["| argument | type | default | Fabric | meaning |", "|---|---|---|---|---|"]
    for name, parameter in inspect.signature(DDPPlusStrategy).parameters.items():
        if name not in described:
            raise ValueError(f"DDPPlusStrategy.__init__'s docstring does not describe `{name}`")
        default = "" if parameter.default is inspect.Parameter.empty else f"`{parameter.default!r}`"
        shown = f"`**{name}`" if parameter.kind is inspect.Parameter.VAR_KEYWORD else f"`{name}`"
        fabric = "no: " + fabric_lacks[name].reason if name in fabric_lacks else "yes"
        if name == "precision_plugin":
            fabric = "as `precision`"
        annotation = cell(annotation_text(parameter.annotation), code=True)
        rows.append(f"| {shown} | {annotation} | {default} | {cell(fabric)} | {cell(described[name])} |")
    return "\n".join(rows)


def rules_table() -> str:
    from lightning_ddp_plus.conflicts.rules import rules_table as table

    return table()


MARKDOWN: dict[str, tuple[Path, Callable[[], str]]] = {
    "arguments-table": (ROOT / "docs" / "arguments.md", arguments_table),
    "rules-table": (ROOT / "docs" / "guides" / "conflicts.md", rules_table),
}


def with_block(text: str, name: str, content: str) -> str:
    """``text`` with the block between the markers of ``name`` replaced by ``content``."""
    start, end = START.format(name=name), END.format(name=name)
    before, found, rest = text.partition(start)
    if not found:
        raise ValueError(f"the marker {start!r} is missing")
    _, found, after = rest.partition(end)
    if not found:
        raise ValueError(f"the marker {end!r} is missing")
    return f"{before}{start}\n\n{content}\n\n{end}{after}"


def yaml_value(value: Any) -> str:
    """A default as the config writes it.

    >>> yaml_value(None), yaml_value(True), yaml_value("mean"), yaml_value(timedelta(minutes=30)), yaml_value(("A",))
    ('null', 'true', 'mean', '30m', '[A]')
    """
    from lightning_ddp_plus.config.timeout import format_timeout

    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, timedelta):
        return format_timeout(value)
    if isinstance(value, (list, tuple)):
        return f"[{', '.join(yaml_value(item) for item in value)}]"
    return str(value)


def config_text(text: str) -> str:
    """The config with its strategy's ``init_args`` holding every argument of ``DDPPlusStrategy``, in declaration
    order: the values and comments the file has are kept, a missing argument gets its default."""
    from lightning_ddp_plus.engine.arguments import ARGUMENT_FIELDS, front_end_arguments

    match = CONFIG_BLOCK.search(text)
    if match is None:
        raise ValueError(f"{CONFIG} has no `strategy:` with `class_path:` and `init_args:` under `trainer:`")
    given = {}
    for line in match.group("body").splitlines():
        parsed = CONFIG_LINE.match(line)
        if parsed is None:
            raise ValueError(f"{CONFIG}: cannot read {line!r} (one `name: value  # comment` per line)")
        given[parsed.group("name")] = (parsed.group("value"), parsed.group("comment"))
    unknown = sorted(set(given) - set(ARGUMENT_FIELDS))
    if unknown:
        raise ValueError(f"{CONFIG} sets {unknown}, which DDPPlusStrategy does not declare")
    lines = []
    for name in front_end_arguments("DDPPlusStrategy"):
        value, comment = given.get(name, (yaml_value(ARGUMENT_FIELDS[name].default), None))
        entry = f"      {name}: {value}"
        lines.append(f"{entry:<40}# {comment}" if comment else entry)
    return text[: match.start("body")] + "\n".join(lines) + "\n" + text[match.end("body") :]


KEYWORDS = ROOT / "lightning_ddp_plus" / "engine" / "keywords.py"


def field_docs(source: str) -> dict[str, str]:
    """Each field of ``DDPPlusArguments`` in ``source`` and the docstring under it, whitespace folded."""
    import ast

    tree = ast.parse(source)
    [declaration] = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "DDPPlusArguments"]
    docs: dict[str, str] = {}
    for node, following in zip(declaration.body, declaration.body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
        ):
            docs[node.target.id] = " ".join(str(following.value.value).split())
    return docs


def imported_names(source: str) -> dict[str, str]:
    """Each name ``source`` imports with ``from x import name``, and its module."""
    import ast

    return {
        alias.asname or alias.name: node.module
        for node in ast.parse(source).body
        if isinstance(node, ast.ImportFrom) and node.module
        for alias in node.names
    }


def keywords_text() -> str:
    """``engine/keywords.py``: the ``TypedDict`` of each front end's keywords, and the argument docstrings."""
    from lightning_ddp_plus.config.training_arguments import PORTED_ARGUMENTS
    from lightning_ddp_plus.engine.arguments import (
        ARGUMENT_FIELDS,
        DDP_FURTHER_ARGUMENTS,
        RENAMED_ARGUMENTS,
        DDPPlusArguments,
        front_end_arguments,
    )

    source = (ROOT / "lightning_ddp_plus" / "engine" / "arguments.py").read_text()
    docs, origins = field_docs(source), imported_names(source)
    annotations = {name: DDPPlusArguments.__annotations__[name] for name in ARGUMENT_FIELDS}
    annotations |= {r.former: annotations[r.name] for r in RENAMED_ARGUMENTS}
    docs |= {r.former: r.doc for r in RENAMED_ARGUMENTS}
    used = sorted({word for text in annotations.values() for word in re.findall(r"[A-Za-z_]\w*", text)})
    imports: dict[str, list[str]] = {"typing": ["Any", "TypedDict"]}
    for word in used:
        if word in origins:
            imports.setdefault(origins[word], []).append(word)
    lines = [
        '"""The keyword arguments of the front ends, generated from ``DDPPlusArguments`` (``engine/arguments.py``) by',
        "``python docs/generated.py``: do not edit by hand (``tests/test_generated.py`` fails when it is stale).",
        "",
        "Type checkers and IDEs read each front end's arguments from these ``TypedDict``s (``**arguments:",
        "Unpack[DDPPlusStrategyKeywords]``), so a misspelt or mistyped argument is flagged in the user's editor;",
        "``ARGUMENT_DOCS`` gives ``help()`` and LightningCLI each argument's docstring without reading the source.",
        '"""',
        "",
        "from __future__ import annotations",
        "",
    ]
    standard = [m for m in sorted(imports) if not m.startswith("lightning_ddp_plus")]
    own = [m for m in sorted(imports) if m.startswith("lightning_ddp_plus")]
    for group in (standard, own):
        lines += [f"from {module} import {', '.join(sorted(set(imports[module])))}" for module in group]
        lines.append("")

    def typed_dict(name: str, bases: list[str], doc: str, arguments: list[str]) -> list[str]:
        body = [f"class {name}({', '.join(bases)}, total=False):", f'    """{doc}"""', ""]
        former = [r.former for r in RENAMED_ARGUMENTS if r.name in arguments]  # still typed, deprecated
        for argument in [*arguments, *former]:
            body += [
                f"    {argument}: {double_quoted_literals(annotations[argument])}",
                f'    """{docs[argument]}"""',
                "",
            ]
        return ["", *body, ""]

    # each argument is declared once, in the part of the front ends that takes it
    every = front_end_arguments("DDPPlusStrategy")
    fabric = set(front_end_arguments("DDPPlusFabricStrategy"))
    shared = [name for name in every if name in fabric and name not in PORTED_ARGUMENTS]
    lines += typed_dict("_Shared", ["TypedDict"], "The arguments every front end takes.", shared)
    lines += typed_dict(
        "_Ported",
        ["TypedDict"],
        "The arguments ``HFStyleDDPPlusStrategy`` takes by their Hugging Face names.",
        [name for name in every if name in PORTED_ARGUMENTS],
    )
    lines += typed_dict(
        "_TrainerOnly",
        ["TypedDict"],
        "The arguments of the Trainer strategy only.",
        [n for n in every if n not in fabric],
    )
    further = ["", "class _FurtherDDPArguments(TypedDict, total=False):"]
    further.append(
        '    """Further arguments of torch\'s ``DistributedDataParallel``, checked against its signature."""'
    )
    further += ["", *(f"    {argument}: Any" for argument in DDP_FURTHER_ARGUMENTS), ""]
    lines += further
    lines += typed_dict(
        "DDPPlusFabricStrategyKeywords",
        ["_Shared", "_Ported", "_FurtherDDPArguments"],
        "``DDPPlusFabricStrategy(...)``'s arguments beyond Fabric's plumbing.",
        [],
    )
    lines += typed_dict(
        "DDPPlusStrategyKeywords",
        ["DDPPlusFabricStrategyKeywords", "_TrainerOnly"],
        "``DDPPlusStrategy(...)``'s arguments beyond Lightning's plumbing.",
        [],
    )
    lines += typed_dict(
        "HFStyleKeywords",
        ["_Shared", "_TrainerOnly"],
        "``HFStyleDDPPlusStrategy(...)``'s arguments beyond the Hugging Face names it ports.",
        [],
    )
    lines += ["", "#: Each argument's docstring, whitespace folded.", "ARGUMENT_DOCS: dict[str, str] = {"]
    lines += [f"    {quoted(name)}: {quoted(docs[name])}," for name in ARGUMENT_FIELDS]
    lines.append("}")
    return "\n".join(lines).replace("\n\n\n\n", "\n\n\n") + "\n"


def quoted(text: str) -> str:
    """``text`` as a Python string literal in the package's style, as ``ruff format`` writes it: double quotes,
    unless the text holds more double quotes than single ones (fewer escapes). Written here, so that the generated
    text does not depend on which formatter is installed (``tests/test_generated.py`` checks it with ruff).

    >>> print(quoted('a "b"'), quoted("it's"), quoted('"it\\'s" "x"'))
    'a "b"' "it's" '"it\\'s" "x"'
    """
    body = text.replace("\\", "\\\\").replace("\n", "\\n")
    if text.count('"') > text.count("'"):
        return "'" + body.replace("'", "\\'") + "'"
    return '"' + body.replace('"', '\\"') + '"'


def double_quoted_literals(annotation: str) -> str:
    """An annotation's string literals (``Literal['auto']``) in double quotes, as the package writes them."""
    return re.sub(r"'([^'\"\\]*)'", r'"\1"', annotation)


def generated_files() -> dict[Path, str]:
    """Every generated file's path and the text it must have."""
    files: dict[Path, str] = {}
    for name, (path, make) in MARKDOWN.items():
        files[path] = with_block(files.get(path, path.read_text()), name, make())
    files[CONFIG] = config_text(CONFIG.read_text())
    files[KEYWORDS] = keywords_text()
    return files


def stale_files() -> list[Path]:
    return [path for path, text in generated_files().items() if not path.exists() or path.read_text() != text]


def on_config(config: Any) -> Any:
    """mkdocs hook: a site is never built from stale files."""
    stale = stale_files()
    if stale:
        names = ", ".join(str(path.relative_to(ROOT)) for path in stale)
        raise SystemExit(f"generated text is stale in {names}: run `python docs/generated.py`")
    return config


def main(argv: list[str]) -> int:
    if argv[1:] == ["--check"]:
        stale = stale_files()
        for path in stale:
            print(f"stale: {path.relative_to(ROOT)} (run `python docs/generated.py`)")
        return 1 if stale else 0
    for path, text in generated_files().items():
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
            print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main(sys.argv))
