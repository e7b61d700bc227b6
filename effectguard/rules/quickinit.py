"""Faster construction of frozen, slotted dataclasses that are built on every request.

A frozen dataclass's ``__init__`` must go around its own ``__setattr__`` (which refuses
every write), so it sets each field with ``object.__setattr__(self, name, value)``: a
generic call per field. A request builds about 330 such fields (six ``WorkState``\\ s of
22 fields, six ``StoredEvent``\\ s, the events themselves, budget nodes), and those calls
were about a tenth of the instructions the guard spends on a request
(docs/performance.md, "Frozen values, built plainly").

:func:`quick_init` keeps the class exactly as it is for every reader (type, fields,
equality, hash, repr, signature, immutability after construction) and changes only how an
instance is built. The class's ``__new__`` becomes a generated function with the
dataclass's parameters (positional or keyword-only, defaults and default factories) that
makes an instance of a *builder*, a twin class with the same base and the same slots but
no frozen ``__setattr__``, assigns each field directly, and then sets the instance's class
to the frozen class. Python allows that assignment between classes whose layouts are the
same, which the twin's is by construction. Building a ``WorkState`` this way takes about a
fifth of the time the dataclass ``__init__`` takes.

tests/test_quickinit.py checks each class it is applied to against the dataclass's own
``__init__``.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

_NO_VALUE = object()  # a default that says "call this field's default factory"


def quick_init(cls: type[T]) -> type[T]:
    """Make ``cls(...)`` build through a plain twin class; ``cls`` is otherwise unchanged.

    ``cls`` must be a frozen dataclass with ``slots=True``, single inheritance, every
    field in ``__init__`` and no ``__post_init__``: the builder would otherwise have to
    copy the dataclass's own rules, and it refuses rather than guess. ``cls`` then takes no
    subclasses (its ``__new__`` builds ``cls`` only).
    """
    params = getattr(cls, "__dataclass_params__", None)
    if params is None or not params.frozen or "__slots__" not in cls.__dict__:
        raise TypeError(f"{cls.__name__}: quick_init needs a frozen dataclass with slots=True")
    if "__new__" in cls.__dict__:
        raise TypeError(f"{cls.__name__}: already built by quick_init, or has its own __new__")
    if hasattr(cls, "__post_init__") or len(cls.__bases__) != 1:
        raise TypeError(f"{cls.__name__}: quick_init does not copy __post_init__ or bases")
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    if any(not f.init for f in fields):
        raise TypeError(f"{cls.__name__}: quick_init needs every field in __init__")

    builder = type(
        f"_{cls.__name__}Builder",
        cls.__bases__,
        # The bases' frozen __setattr__ would refuse the builder's own writes.
        {"__slots__": cls.__dict__["__slots__"], "__setattr__": object.__setattr__},
    )

    def __reduce__(self: Any) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        # Pickling's default path calls __new__ without the fields.
        return _rebuild, (cls, {f.name: getattr(self, f.name) for f in fields})

    def __init_subclass__(subclass: type, /, **kwargs: Any) -> None:
        raise TypeError(f"{cls.__name__} is built by quick_init: it takes no subclasses")

    # What inspect (and so hypothesis and help()) reports: the dataclass's own parameters.
    declared = inspect.signature(cls.__init__)
    cls.__signature__ = declared.replace(  # type: ignore[attr-defined]
        parameters=list(declared.parameters.values())[1:]
    )
    cls.__new__ = _plain_new(cls, builder, fields)  # type: ignore[method-assign]
    # __new__ built the instance whole; object.__init__ accepts the arguments again
    # because __new__ is overridden.
    cls.__init__ = object.__init__  # type: ignore[method-assign]
    cls.__reduce__ = __reduce__  # type: ignore[method-assign]
    cls.__init_subclass__ = classmethod(__init_subclass__)  # type: ignore[assignment,method-assign]
    return cls


def _rebuild(cls: Callable[..., T], values: dict[str, Any]) -> T:
    return cls(**values)


def _plain_new(
    cls: type, builder: type, fields: tuple[dataclasses.Field[Any], ...]
) -> Callable[..., Any]:
    """A ``__new__`` with the dataclass's ``__init__`` signature: it makes a builder,
    assigns each field directly and gives the instance its frozen class."""
    env: dict[str, Any] = {
        "_NO_VALUE": _NO_VALUE,
        "_object_new": object.__new__,
        "_builder": builder,
        "_cls": cls,
    }
    positional: list[str] = []
    keyword: list[str] = []
    body = ["    __quick_self = _object_new(_builder)"]
    for f in fields:
        param = f.name
        if f.default is not dataclasses.MISSING:
            env[f"_default_{f.name}"] = f.default
            param += f"=_default_{f.name}"
            value = f.name
        elif f.default_factory is not dataclasses.MISSING:
            env[f"_factory_{f.name}"] = f.default_factory
            param += "=_NO_VALUE"
            value = f"_factory_{f.name}() if {f.name} is _NO_VALUE else {f.name}"
        else:
            value = f.name
        (keyword if f.kw_only else positional).append(param)
        body.append(f"    __quick_self.{f.name} = {value}")
    body += ["    __quick_self.__class__ = _cls", "    return __quick_self"]
    params = ["__quick_klass", *positional] + (["*", *keyword] if keyword else [])
    source = f"def __new__({', '.join(params)}):\n" + "\n".join(body)
    exec(compile(source, f"<quick_init {cls.__qualname__}>", "exec"), env)
    new: Callable[..., Any] = env["__new__"]
    new.__qualname__ = f"{cls.__qualname__}.__new__"
    return new
