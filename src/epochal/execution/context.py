"""Thread-local context stacks: ``with obj:`` makes ``obj`` the current one of its class.

As in Caffe2's ``context.py``: ``Cls.current()`` returns the innermost active instance; a
*default-managed* class creates (and pushes) a default instance when none is active.
"""

from __future__ import annotations

import threading
from typing import Any, TypeVar

T = TypeVar("T", bound="Managed")


class Managed:
    """Base of context-managed classes (Job, TaskGroup, Task): one stack per class and thread."""

    _ctx_local: threading.local

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        if "_ctx_local" not in cls.__dict__ and not getattr(cls, "_ctx_shared", False):
            cls._ctx_local = threading.local()

    @classmethod
    def _stack(cls) -> list[Any]:
        local = cls._ctx_local
        if not hasattr(local, "stack"):
            local.stack = []
        return local.stack  # type: ignore[no-any-return]

    @classmethod
    def current(cls: type[T], value: T | None = None, required: bool = True) -> T:
        """``value`` if given (type-checked), else the innermost active instance.

        With none active: None when ``required`` is False, else an error naming the class.
        """
        if value is not None:
            if not isinstance(value, cls):
                raise TypeError(f"{value!r} is not a {cls.__name__}")
            return value
        stack = cls._stack()
        if stack:
            return stack[-1]  # type: ignore[no-any-return]
        return cls._no_current(required)  # type: ignore[return-value]

    @classmethod
    def _no_current(cls, required: bool) -> Any:
        if required:
            raise RuntimeError(f"Context {cls.__name__} is required but none is active.")
        return None

    def __enter__(self: T) -> T:
        type(self)._stack().append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        stack = type(self)._stack()
        if not stack or stack[-1] is not self:
            raise RuntimeError(f"{type(self).__name__} context exited out of order")
        stack.pop()

    def __call__(self, func: Any) -> Any:
        """Use as a decorator: run ``func`` inside ``with self``."""
        import functools

        @functools.wraps(func)
        def wrapper(*a: Any, **kw: Any) -> Any:
            with self:
                return func(*a, **kw)

        return wrapper


class DefaultManaged(Managed):
    """A Managed class whose ``current()`` creates and pushes a default instance if needed."""

    @classmethod
    def _no_current(cls, required: bool) -> Any:
        inst = cls()
        cls._stack().append(inst)
        return inst
