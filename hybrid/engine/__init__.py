"""The few-lines training API: ``engine = hybrid.initialize(model, config)``.

See :mod:`hybrid.engine.engine` and docs/engine.md.
"""

from hybrid.engine.engine import Engine, initialize

__all__ = ["Engine", "initialize"]
