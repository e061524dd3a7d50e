"""Objects named by a module path in a spec: ``package.module:name``.

The module is imported with ``importlib.import_module`` and the attribute read from it; no text
from the spec is evaluated. Importing a module runs its code, so a module path in a spec is code
the spec's author chose to run. Only this form is accepted: dotted identifiers, a colon, an
identifier.
"""
from __future__ import annotations

import importlib
import re

from ssmcraft.errors import SpecError

MODULE_PATH = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")


def is_module_path(text) -> bool:
    return isinstance(text, str) and MODULE_PATH.fullmatch(text) is not None


def load_object(path: str, source: str, key: str):
    """The object ``package.module:name`` names; a ``SpecError`` naming ``source`` and ``key``
    when the path is malformed, the module cannot be imported or lacks the name."""
    if not is_module_path(path):
        raise SpecError(source, key, f"{path!r} is not a module path of the form package.module:name")
    module_name, _, attr = path.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise SpecError(source, key, f"cannot import module {module_name!r} ({e}); is it on PYTHONPATH?") from None
    except Exception as e:  # noqa: BLE001 - the user's module failed while importing: say so in one line
        raise SpecError(source, key, f"importing {module_name!r} failed: {type(e).__name__}: {e}") from None
    if not hasattr(module, attr):
        raise SpecError(source, key, f"module {module_name!r} has no {attr!r}")
    return getattr(module, attr)
