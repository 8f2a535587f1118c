"""Package names imported on first read (a module ``__getattr__``), so that importing a package costs nothing.

The packages whose light parts must import without torch (``hybrid``, ``hybrid.data``, ``hybrid.training`` and
``model_zoo``: configuration, data preprocessing, the model description) export their heavy names this way.
This module imports nothing of hybrid's, so any package may use it.
"""

import importlib
import sys
from typing import Callable, Dict, Iterable, List, Tuple


def lazy_exports(package: str, exports: Dict[str, str],
                 eager: Iterable[str] = ()) -> Tuple[Callable[[str], object], Callable[[], List[str]], List[str]]:
    """``(__getattr__, __dir__, __all__)`` for ``package``.

    ``exports`` maps each lazily exported name to the module that defines it (absolute, or relative to
    ``package`` when it starts with a dot); ``eager`` names the package defines itself. A name is imported on
    its first read and then kept in the package's namespace, so later reads are plain attribute reads.
    """
    names = sorted(set(exports) | set(eager))

    def __getattr__(name: str) -> object:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(exports[name], package), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> List[str]:
        return names

    return __getattr__, __dir__, names
