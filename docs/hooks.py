"""mkdocs hook: the tables that must not drift from the code are generated from it when the site is built.

``<!-- generated: rules-table ... -->`` becomes the conflict rules (``lightning_ddp_plus.conflicts.rules.RULES``);
``<!-- generated: arguments-table ... -->`` becomes ``DDPPlusStrategy``'s arguments, from its signature (types,
defaults) and its docstring's ``Args:`` section (meanings). An argument without a docstring entry fails the build.
"""

from __future__ import annotations

import html
import inspect
import re
from typing import Any

MARKER = re.compile(r"<!-- generated: (?P<name>[a-z-]+)[^>]*-->")


def docstring_arguments(doc: str) -> dict[str, str]:
    """``name: text`` entries of a Google-style ``Args:`` section, continuation lines joined."""
    section = doc.split("Args:", 1)[1].split("\n\n", 1)[0]
    entries: dict[str, str] = {}
    name = None
    for line in section.split("\n"):
        match = re.match(r"^ {4}(\*{0,2}\w+): (.*)$", line)
        if match:
            name = match.group(1)
            entries[name] = match.group(2).strip()
        elif name and line.strip():
            entries[name] += " " + line.strip()
    return entries


def arguments_table() -> str:
    from lightning_ddp_plus import DDPPlusStrategy

    described = docstring_arguments(inspect.getdoc(DDPPlusStrategy) or "")
    described = {name.lstrip("*"): text for name, text in described.items()}
    rows = ["| argument | type | default | meaning |", "|---|---|---|---|"]
    for name, parameter in inspect.signature(DDPPlusStrategy.__init__).parameters.items():
        if name == "self":
            continue
        if name not in described:
            raise ValueError(f"DDPPlusStrategy's docstring does not describe `{name}`: add it to its Args section")
        annotation = "" if parameter.annotation is inspect.Parameter.empty else str(parameter.annotation)
        default = "" if parameter.default is inspect.Parameter.empty else f"`{parameter.default!r}`"
        shown = f"`**{name}`" if parameter.kind is inspect.Parameter.VAR_KEYWORD else f"`{name}`"
        rows.append(f"| {shown} | {cell(annotation, code=True)} | {default} | {cell(described[name])} |")
    return "\n".join(rows)


def cell(text: str, code: bool = False) -> str:
    """A table cell: RST double backticks as Markdown code; a pipe escaped (as an HTML entity inside code, where a
    backslash would show)."""
    if code:
        return f"<code>{html.escape(text).replace('|', '&#124;')}</code>" if text else ""
    return text.replace("``", "`").replace("|", "\\|")


def rules_table() -> str:
    from lightning_ddp_plus.conflicts.rules import rules_table as table

    return table()


GENERATORS = {"rules-table": rules_table, "arguments-table": arguments_table}


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    return MARKER.sub(lambda match: GENERATORS[match.group("name")](), markdown)
