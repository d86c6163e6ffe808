"""The strategy arguments a ``ddp-plus`` command line gives, read back from its configs and flags, so that a bad one
is explained by the strategy's own check (the argument, the value, what is allowed, the fix) rather than by
jsonargparse's type error inside a union of the ``Trainer``'s strategy types.

Only consulted after LightningCLI refused the command line (or a strategy argument failed its check while the
classes were built): the reading follows jsonargparse's rules closely enough to rebuild the strategy, and where it
cannot, jsonargparse's own message is shown as before.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from lightning_ddp_plus.config.messages import BAD_VALUE_MESSAGE, ArgumentTypeError, ArgumentValueError

#: What a ``strategy:`` string names (the registered names): the class that ``Trainer(strategy=...)`` builds.
_PREFIX = "--trainer.strategy"


@dataclass
class StrategyRequest:
    """The strategy a command line asks for: its class path (``None``: not one of ours) and its arguments."""

    class_path: str | None = None
    init_args: dict[str, Any] = field(default_factory=dict)


def _config_files(argv: list[str]) -> Iterator[str]:
    for index, token in enumerate(argv):
        if token in ("--config", "-c") and index + 1 < len(argv):
            yield argv[index + 1]
        elif token.startswith("--config="):
            yield token.split("=", 1)[1]


def _flags(argv: list[str]) -> Iterator[tuple[str, str]]:
    """``(key, value)`` of every ``--trainer.strategy...`` flag, as ``--key=value`` or ``--key value``."""
    for index, token in enumerate(argv):
        if not token.startswith(_PREFIX):
            continue
        if "=" in token:
            key, value = token.split("=", 1)
        elif index + 1 < len(argv):
            key, value = token, argv[index + 1]
        else:
            continue
        yield key[len(_PREFIX) :].lstrip("."), value


def _apply(request: StrategyRequest, strategy: Any) -> None:
    """A config's ``trainer.strategy``: a name, or ``class_path`` with ``init_args``."""
    if isinstance(strategy, str):
        request.class_path, request.init_args = strategy, {}
    elif isinstance(strategy, dict):
        if "class_path" in strategy:
            request.class_path, request.init_args = strategy["class_path"], {}
        request.init_args.update(strategy.get("init_args") or {})


def requested_strategy(argv: list[str]) -> StrategyRequest:
    """The strategy and its arguments from the configs, then the flags, in the order jsonargparse applies them."""
    request = StrategyRequest()
    for path in _config_files(argv):
        try:
            config = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError):
            continue
        _apply(request, (config.get("trainer") or {}).get("strategy") if isinstance(config, dict) else None)
    for key, text in _flags(argv):
        value = yaml.safe_load(text) if text else None
        if key in ("", "class_path"):
            _apply(request, value if key == "" else {"class_path": value})
        else:
            request.init_args[key.removeprefix("init_args.")] = value
    return request


def _strategy_class(class_path: str | None) -> type | None:
    from lightning_ddp_plus.frontends.registry import REGISTERED_NAMES

    if class_path is None:
        return None
    if class_path in {name for name, _ in REGISTERED_NAMES}:
        class_path = "lightning_ddp_plus.frontends.strategy.DDPPlusStrategy"
    if "." not in class_path:
        class_path = f"lightning_ddp_plus.{class_path}"
    module_name, _, name = class_path.rpartition(".")
    try:
        found = getattr(importlib.import_module(module_name), name, None)
    except ImportError:
        return None
    return found if isinstance(found, type) and found.__module__.startswith("lightning_ddp_plus.") else None


def explain(argv: list[str], error_text: str = "") -> str | None:
    """The strategy's own message for the command line's bad argument, or ``None`` when it has none to give: the
    strategy named is not one of ours, or it accepts the arguments as given. A message of ours already inside
    ``error_text`` (a check that failed while jsonargparse built the classes) is taken as it is."""
    request = requested_strategy(argv)
    strategy_class = _strategy_class(request.class_path)
    if strategy_class is not None:
        try:
            strategy_class(**request.init_args)
        except (ArgumentValueError, ArgumentTypeError) as error:
            return str(error)
    found = BAD_VALUE_MESSAGE.search(error_text)
    return found.group(0) if found else None


def error_text(message: str, strategy_class_path: str = "lightning_ddp_plus.DDPPlusStrategy") -> str:
    """What ``ddp-plus`` prints for a refused argument: the message, then where every argument is described."""
    return (
        f"ddp-plus: error: {message}\n"
        "Nothing was started. Every strategy argument, with its type, default and meaning: docs/arguments.md, or "
        f"`ddp-plus fit --trainer.strategy.help {strategy_class_path}`."
    )
