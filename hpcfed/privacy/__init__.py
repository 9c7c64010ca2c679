"""What the server never sees: differential privacy (`dp`, `accountant`) and secure aggregation.

This package is a library below the runtime: it imports numpy, cryptography and dp-accounting, and
nothing of hpcfed's server, client, strategies or tasks.
"""

import importlib.util
import sys
from types import ModuleType


def load_on_first_use(name: str) -> ModuleType:
    """Module `name`, run only when one of its attributes is first used (`importlib.util.LazyLoader`).
    dp-accounting imports scipy, over a second of CPU: every rank of every run imports this package,
    and only a run with DP asks the accountant anything."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.find_spec(name)
    if spec is None or spec.loader is None:
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)
    spec.loader = importlib.util.LazyLoader(spec.loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
