"""A class that tests load by module path as a task and that is not one."""
from __future__ import annotations


class NotATask:
    options: dict = {}
