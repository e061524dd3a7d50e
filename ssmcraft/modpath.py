"""Objects named by a module path in a spec: ``package.module:name``.

The module is imported with ``importlib.import_module`` and the attribute read from it; no text
from the spec is evaluated. Importing a module runs its code, so a spec alone may not name one:
the person running the command allows the top-level packages they trust in the environment,
``SSMCRAFT_TRUST_MODULES=examples,mypkg`` (comma-separated), and a module path into any other
package is refused before anything is imported. Only this form is accepted: dotted identifiers,
a colon, an identifier.
"""
from __future__ import annotations

import importlib
import os
import re

from ssmcraft.errors import SpecError

MODULE_PATH = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")


def is_module_path(text) -> bool:
    return isinstance(text, str) and MODULE_PATH.fullmatch(text) is not None


def trusted_packages() -> set[str]:
    """The top-level packages whose modules a spec may name (``SSMCRAFT_TRUST_MODULES``)."""
    return {p.strip() for p in os.environ.get("SSMCRAFT_TRUST_MODULES", "").split(",") if p.strip()}


def load_object(path: str, source: str, key: str):
    """The object ``package.module:name`` names; a ``SpecError`` naming ``source`` and ``key``
    when the path is malformed, the module cannot be imported or lacks the name."""
    if not is_module_path(path):
        raise SpecError(source, key, f"{path!r} is not a module path of the form package.module:name")
    module_name, _, attr = path.partition(":")
    top = module_name.split(".")[0]
    if top not in trusted_packages():
        raise SpecError(source, key, f"{path!r} names code to import, which a spec alone may not run: allow its "
                        f"package with SSMCRAFT_TRUST_MODULES={top} (top-level packages, comma-separated)")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise SpecError(source, key, f"cannot import module {module_name!r} ({e}); is it on PYTHONPATH?") from None
    except Exception as e:  # noqa: BLE001 - the user's module failed while importing: say so in one line
        raise SpecError(source, key, f"importing {module_name!r} failed: {type(e).__name__}: {e}") from None
    if not hasattr(module, attr):
        raise SpecError(source, key, f"module {module_name!r} has no {attr!r}")
    return getattr(module, attr)
