"""quick_init: the classes built on every request build exactly as their dataclasses do."""

from __future__ import annotations

import dataclasses
import inspect
import pickle
from dataclasses import dataclass, field
from typing import Any

import pytest

from effectguard.callpath.prepare import Prepared
from effectguard.ledger.operations import Admitted
from effectguard.rules.admission import AdmitRequest, Decision
from effectguard.rules.budget import BudgetNode, Delta
from effectguard.rules.events import _KINDS, CallCompleted, StoredEvent
from effectguard.rules.quickinit import quick_init
from effectguard.rules.settlement import Answer, Settlement
from effectguard.rules.usage import Usage, UsageResult
from effectguard.rules.workstate import WorkState, replace

QUICK = [
    WorkState,
    StoredEvent,
    BudgetNode,
    Delta,
    AdmitRequest,
    Decision,
    Prepared,
    Admitted,
    Usage,
    UsageResult,
    Answer,
    Settlement,
    *_KINDS.values(),
]


def _sample(f: dataclasses.Field[Any], i: int) -> Any:
    return f"v{i}-{f.name}"  # distinct per field: a field set from another would show


def _reference(cls: type, kwargs: dict[str, Any]) -> Any:
    """What the dataclass's own generated __init__ builds (the class keeps it as
    ``__init__`` of a plain twin made by dataclasses itself)."""
    twin = dataclasses.make_dataclass(
        cls.__name__,
        [(f.name, Any, _copy_field(f)) for f in dataclasses.fields(cls)],
        eq=False,
    )
    built = twin(**kwargs)
    return {f.name: getattr(built, f.name) for f in dataclasses.fields(cls)}


def _copy_field(f: dataclasses.Field[Any]) -> Any:
    if f.default is not dataclasses.MISSING:
        return field(default=f.default, kw_only=f.kw_only)
    if f.default_factory is not dataclasses.MISSING:
        return field(default_factory=f.default_factory, kw_only=f.kw_only)
    return field(kw_only=f.kw_only)


def _values(obj: Any) -> dict[str, Any]:
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


@pytest.mark.parametrize("cls", QUICK, ids=lambda c: c.__name__)
def test_every_field_set_as_given_and_defaults_as_declared(cls: type) -> None:
    fields = dataclasses.fields(cls)
    given = {f.name: _sample(f, i) for i, f in enumerate(fields)}
    built = cls(**given)
    assert type(built) is cls
    assert _values(built) == given
    required = {
        f.name: given[f.name]
        for f in fields
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    }
    assert _values(cls(**required)) == _reference(cls, required)


@pytest.mark.parametrize("cls", QUICK, ids=lambda c: c.__name__)
def test_still_frozen_equal_and_picklable(cls: type) -> None:
    fields = dataclasses.fields(cls)
    given = {f.name: _sample(f, i) for i, f in enumerate(fields)}
    built = cls(**given)
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(built, fields[0].name, "changed")
    assert built == cls(**given)
    assert pickle.loads(pickle.dumps(built)) == built
    changed = dataclasses.replace(built, **{fields[0].name: "changed"})
    assert type(changed) is cls and getattr(changed, fields[0].name) == "changed"


def test_wrong_arguments_fail_as_the_dataclass_would() -> None:
    with pytest.raises(TypeError):
        CallCompleted(call="c")  # type: ignore[call-arg]  # outcome missing
    with pytest.raises(TypeError):
        CallCompleted("c", "completed")  # type: ignore[call-arg]  # keyword-only
    with pytest.raises(TypeError):
        CallCompleted(call="c", outcome="completed", surprise=1)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        WorkState("c", "new", 0, extra=1)  # type: ignore[call-arg]


def test_default_factories_give_each_instance_its_own_value() -> None:
    @quick_init
    @dataclass(frozen=True, slots=True)
    class Holder:
        name: str
        items: list[int] = field(default_factory=list)

    a, b = Holder("a"), Holder("b")
    a.items.append(1)
    assert b.items == [] and Holder("c", [2]).items == [2]


def test_refuses_classes_it_cannot_copy_faithfully() -> None:
    @dataclass(slots=True)
    class Mutable:
        x: int

    @dataclass(frozen=True, slots=True)
    class Checked:
        x: int

        def __post_init__(self) -> None:
            pass

    @dataclass(frozen=True)
    class NoSlots:
        x: int

    for cls in (Mutable, Checked, NoSlots, WorkState):  # WorkState: once is enough
        with pytest.raises(TypeError):
            quick_init(cls)


def test_a_quick_class_takes_no_subclass() -> None:
    with pytest.raises(TypeError, match="no subclasses"):

        class Special(WorkState):
            pass


def test_workstate_replace_changes_only_what_it_is_given() -> None:
    state = WorkState(call_id="c", stage="in_flight", provider="openai", attempts=1)
    after = replace(state, stage="completed", cost=5)
    assert after == dataclasses.replace(state, stage="completed", cost=5)
    assert state.stage == "in_flight"


@pytest.mark.parametrize("cls", QUICK, ids=lambda c: c.__name__)
def test_signature_is_the_dataclasses_own(cls: type) -> None:
    reference = dataclasses.make_dataclass(
        cls.__name__, [(f.name, f.type, _copy_field(f)) for f in dataclasses.fields(cls)]
    )
    assert inspect.signature(cls) == inspect.signature(reference)
