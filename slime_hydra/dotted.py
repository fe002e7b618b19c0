"""Config values that name a user's function by dotted path (``reward.target``, ``rollout.generate``,
``algo.dynamic_filter``): one importer, one error shape."""

import importlib
import traceback
from typing import Callable


def import_callable(path: str, key: str, expects: str) -> Callable:
    """The callable at ``path`` (``package.module.attr``, or ``package.module:attr``); a ValueError that names the
    config ``key``, the cause and ``expects`` (what the callable must be) otherwise."""
    module_name, _, attr = path.rpartition(":") if ":" in path else path.rpartition(".")
    if not module_name or not attr:
        raise ValueError(f"{key}={path!r} is not a dotted path; give module.function ({expects})")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (Exception, SystemExit) as error:  # a module's top level may raise anything, or call sys.exit
        raise ValueError(f"{key}={path!r} cannot be imported ({type(error).__name__}: {error}{_where(error)}); give "
                         f"a dotted path module.function importable where the run executes ({expects})") from error
    if not callable(fn):
        raise ValueError(f"{key}={path!r} is a {type(fn).__name__}, not a callable {expects}")
    return fn


def _where(error: BaseException) -> str:
    """``, at file:line`` of the innermost frame that raised ``error`` outside the import machinery, or ''."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if "importlib" not in f.filename]
    return f", at {frames[-1].filename}:{frames[-1].lineno}" if frames[1:] else ""
