"""What the server never sees: differential privacy (`dp`, `accountant`) and secure aggregation.

This package is a library below the runtime: it imports numpy, cryptography and dp-accounting, and
nothing of hpcfed's server, client, strategies or tasks.
"""

import importlib
import importlib.util
from typing import Any


def load_on_first_use(name: str) -> Any:
    """Module `name`, imported only when one of its attributes is first used. dp-accounting imports
    scipy, over a second of CPU: every rank of every run imports this package, and only a run with DP
    asks the accountant anything. Not `importlib.util.LazyLoader`: that puts the module in
    `sys.modules`, where `inspect.getmodule` (which torch calls while it registers its own operators)
    touches every module's `__file__`, and so loaded scipy on every rank after all."""
    if importlib.util.find_spec(name) is None:
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)
    return _OnFirstUse(name)


class _OnFirstUse:
    """Stands for a module that is imported on the first attribute asked of it."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        return getattr(importlib.import_module(self._name), attr)
