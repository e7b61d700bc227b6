"""Faster construction of frozen, slotted dataclasses that are built on every request.

A frozen dataclass's ``__init__`` must go around its own ``__setattr__`` (which refuses
every write), so it sets each field with ``object.__setattr__(self, name, value)``: a
generic call per field. A request builds about 330 such fields (six ``WorkState``\\ s of
22 fields, six ``StoredEvent``\\ s, the events themselves, budget nodes), and those calls
were about a tenth of the instructions the guard spends on a request
(docs/performance.md, "Frozen values, built plainly").

:func:`quick_init` keeps the class exactly as it is for every reader (type, fields,
equality, hash, repr, immutability after construction) and changes only how an instance
is built: a *builder*, a twin class with the same slots and the same base whose
``__init__`` assigns its fields directly, builds the instance, and the instance's class is
then set to the frozen class. Python allows that assignment between classes whose
layouts are the same, which the twin's is by construction. Building a ``WorkState`` this
way takes about a ninth of the time the dataclass ``__init__`` takes.

The builder's ``__init__`` takes the same arguments as the dataclass's (positional or
keyword-only, defaults and default factories); tests/test_quickinit.py checks each class
it is applied to against the dataclass's own ``__init__``.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

_NO_VALUE = object()  # a default that says "call this field's default factory"


def quick_init(cls: type[T]) -> type[T]:
    """Make ``cls(...)`` build through a plain twin class; ``cls`` itself is unchanged.

    ``cls`` must be a frozen dataclass with ``slots=True``, single inheritance, every
    field in ``__init__`` and no ``__post_init__``: the builder would otherwise have to
    copy the dataclass's own rules, and it refuses rather than guess.
    """
    params = getattr(cls, "__dataclass_params__", None)
    if params is None or not params.frozen or "__slots__" not in cls.__dict__:
        raise TypeError(f"{cls.__name__}: quick_init needs a frozen dataclass with slots=True")
    if hasattr(cls, "__post_init__") or len(cls.__bases__) != 1:
        raise TypeError(f"{cls.__name__}: quick_init does not copy __post_init__ or bases")
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    if any(not f.init for f in fields):
        raise TypeError(f"{cls.__name__}: quick_init needs every field in __init__")

    builder = type(
        f"_{cls.__name__}Builder",
        cls.__bases__,
        {
            "__slots__": cls.__dict__["__slots__"],
            # The bases' frozen __setattr__ would refuse the builder's own writes.
            "__setattr__": object.__setattr__,
            "__init__": _plain_init(cls, fields),
        },
    )

    def __new__(klass: type[T], *args: Any, **kwargs: Any) -> T:
        if klass is not cls:  # a subclass builds the ordinary way
            return object.__new__(klass)
        instance = builder(*args, **kwargs)
        instance.__class__ = cls
        return instance  # type: ignore[no-any-return]

    def __reduce__(self: Any) -> tuple[Callable[..., Any], tuple[Any, ...]]:
        # Pickling's default path calls __new__ without the fields.
        return _rebuild, (cls, {f.name: getattr(self, f.name) for f in fields})

    # What inspect (and so hypothesis and help()) reports: the dataclass's own parameters.
    declared = inspect.signature(cls.__init__)
    cls.__signature__ = declared.replace(  # type: ignore[attr-defined]
        parameters=list(declared.parameters.values())[1:]
    )
    cls.__new__ = __new__  # type: ignore[method-assign,assignment]
    # The builder already ran the __init__; object.__init__ accepts the arguments again
    # because __new__ is overridden.
    cls.__init__ = object.__init__  # type: ignore[method-assign]
    cls.__reduce__ = __reduce__  # type: ignore[method-assign]
    return cls


def _rebuild(cls: Callable[..., T], values: dict[str, Any]) -> T:
    return cls(**values)


def _plain_init(cls: type, fields: tuple[dataclasses.Field[Any], ...]) -> Callable[..., None]:
    """An ``__init__`` with the dataclass's signature that assigns each field directly."""
    env: dict[str, Any] = {"_NO_VALUE": _NO_VALUE}
    positional: list[str] = []
    keyword: list[str] = []
    body: list[str] = []
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
        body.append(f"    self.{f.name} = {value}")
    params = ["self", *positional] + (["*", *keyword] if keyword else [])
    source = f"def __init__({', '.join(params)}):\n" + ("\n".join(body) or "    pass")
    exec(compile(source, f"<quick_init {cls.__qualname__}>", "exec"), env)
    init: Callable[..., None] = env["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    return init
