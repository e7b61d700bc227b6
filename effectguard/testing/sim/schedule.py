"""A schedule: everything one simulator run will do, generated from one seed.

:func:`generate` draws from ``random.Random(seed)`` only (and, for an option added
later, a generator seeded from the seed and the option's name; never the global
generator, never the clock), so the same seed and options always give the same
schedule, byte for byte in JSON. What the OS then makes of it (which request
wins a race, where a SIGKILL lands inside a request) is not part of the
schedule; see docs/simulator.md.
"""

from __future__ import annotations

import dataclasses
import json
import random
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from effectguard.testing.fakebehaviour import Behaviour
from effectguard.testing.sim import clocksteps

__all__ = [
    "BUDGETS",
    "CLOCK_ACTIONS",
    "CRASH_POINTS",
    "KEY_REFRESH_S",
    "KEY_ROOTS",
    "LEDGER_WIDE",
    "MAINTENANCE_ACTIONS",
    "OPERATOR_ACTIONS",
    "PG_STOP_MODES",
    "Call",
    "Fault",
    "Route",
    "Schedule",
    "generate",
    "key_root",
]

#: name -> (provider, path, model, streams possible)
ROUTES: Final = {
    "chat": ("openai", "/v1/chat/completions", "gpt-4o-mini", True),
    "messages": ("anthropic", "/v1/messages", "claude-haiku-4-5", True),
    "send": ("send_email", "/v1/send", None, False),
    "pay": ("payments", "/v1/send", None, False),
}
Route = Literal["chat", "messages", "send", "pay"]

#: The budget tree the clients spend from; limits are drawn per run (``None``: unlimited).
BUDGETS: Final = ("default", "team-a", "team-a/run-1", "team-a/run-2", "team-b")
CRASH_POINTS: Final = (
    "after:admit",
    "after:dispatch",
    "after:upstream-response",
    "after:observe",
    "mid-stream",
)
FaultKind = Literal[
    "kill",
    "crash_at",
    "stop",
    "restart",
    "disk_full",
    "read_only",
    "pg_outage",
    "budget_set",
    "reconcile_auto",
    "key_revoke",
    "key_new",
    "rate_set",
    "backup",
    "archive",
    "resend",
    "clock_step",
]
#: Faults of the ledger itself rather than of one replica: always scheduled on replica 0
#: (a read-only remount takes every replica's lock, in index order, from there).
LEDGER_WIDE: Final = frozenset({"read_only", "pg_outage"})
#: ``--operator``: what an operator does to the running system, through the CLI; applied
#: on their own (no replica's fault), whatever the replicas are going through.
OPERATOR_ACTIONS: Final = frozenset(
    {"budget_set", "reconcile_auto", "key_revoke", "key_new", "rate_set"}
)
#: ``--operator``: the budget roots whose clients use proxy keys (``ROOT.N``, N the key's
#: generation: ``ROOT.0`` is made before the replicas start, each rotation the next).
KEY_ROOTS: Final = ("default", "team-a", "team-b")
#: The run's ``[server] key_refresh_s``: how soon every replica honours a key made or
#: revoked (contract, ``key revoke``); short, so a short run sees revocations land.
KEY_REFRESH_S: Final = 1.0
#: ``--maintenance``: an operator's maintenance commands against the live ledger (a
#: backup, an archive, an authorized resend of an unknown call), applied on their own too.
MAINTENANCE_ACTIONS: Final = frozenset({"backup", "archive", "resend"})
#: ``--clock-steps``: wall-clock steps (:mod:`effectguard.testing.sim.clocksteps`), applied
#: on their own too.
CLOCK_ACTIONS: Final = frozenset({"clock_step"})
#: ``pg_ctlcluster stop`` modes: ``fast`` ends sessions cleanly, ``immediate`` like a crash.
PG_STOP_MODES: Final = ("fast", "immediate")
#: The run's ``[guard] max_answer_bytes``: small, so an endless answer is cut off soon.
MAX_ANSWER_BYTES: Final = 256 * 1024
#: ``--lookups``: how far the provider's search lags behind an effect, and the freshness
#: the ``payments`` declaration gives its lookup (well past the lag plus a request's
#: trip to the provider, so a "not found" that old is true).
SEARCH_LAG_S: Final = 0.5
FRESHNESS_S: Final = 2.0


@dataclass(frozen=True, slots=True)
class Call:
    """One client's logical call: its first request and how the client retries it."""

    id: str
    at: float
    route: Route
    stream: bool
    key: str | None
    budget: str
    max_tokens: int
    prompt: str
    #: The fake provider's behaviour for every request of this call (``""``: plain).
    behaviour: str
    #: SDK-style retries on 5xx/429/connection errors (x-stainless-retry-count 1..N).
    sdk_retries: int
    #: The replica each request goes to: first request, then each retry in turn.
    replicas: tuple[int, ...]
    #: After its answer the client sends the same request again (a replay or a 409).
    repeat: bool
    #: ``pay`` calls (``--lookups``): short of a 200, the client sends this many keyed
    #: resends at once, a round after each lookup freshness, until one is answered 200.
    resends: int = 0
    #: The fake provider's behaviour for the resends (``""``: ``behaviour``, as every
    #: other request): a resend's attempt applied and its answer lost, after the first
    #: attempt was refused, is what the copies' lookups must not decide against.
    resend_behaviour: str = ""


@dataclass(frozen=True, slots=True)
class Fault:
    """A process or ledger fault at ``at`` seconds into the run."""

    at: float
    kind: FaultKind
    replica: int
    #: kill: downtime; stop: how long stopped; disk_full, read_only, pg_outage: how long
    #: the ledger stays full, read-only or down; crash_at: -.
    seconds: float = 0.0
    #: crash_at: the crash point; pg_outage: the ``pg_ctlcluster stop`` mode;
    #: budget_set: ``PATH=NANOS`` (or ``PATH=none``), the limit an operator sets;
    #: key_revoke, key_new: the key's name (``ROOT.N``); rate_set: ``PATH rpm=N tpm=N
    #: concurrency=N`` (``none`` removes one, ``-`` leaves it as it is);
    #: archive: ``--step-events``; resend: ``COPIES:PICK`` (how many copies of the resend
    #: go at once, and which of the unknown keyed calls listed then is chosen, modulo);
    #: clock_step: ``TARGET SPEC`` (:mod:`effectguard.testing.sim.clocksteps`).
    point: str | None = None


@dataclass(frozen=True, slots=True)
class Schedule:
    """A whole run: options, budget limits (nanos), calls and faults."""

    seed: int
    duration: float
    replicas: int
    ledger: str
    lease_s: float
    limits: dict[str, int | None] = field(default_factory=dict)
    calls: tuple[Call, ...] = ()
    faults: tuple[Fault, ...] = ()
    #: ``--lookups``: a ``payments`` tool whose lost calls a lookup decides.
    lookups: bool = False
    #: ``--keyless`` (with ``--lookups``): ``pay`` calls without a key too, whose copies
    #: are SDK retries matched by the request's hash.
    keyless: bool = False

    def to_json(self) -> str:
        """The schedule as stable, indented JSON."""
        return json.dumps(dataclasses.asdict(self), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Schedule:
        """Rebuild a schedule written by :meth:`to_json`."""
        raw: dict[str, Any] = json.loads(text)
        calls = tuple(Call(**(c | {"replicas": tuple(c["replicas"])})) for c in raw["calls"])
        faults = tuple(Fault(**f) for f in raw["faults"])
        return cls(**(raw | {"calls": calls, "faults": faults}))


_WORDS: Final = ("alpha", "beta", "gamma", "delta", "echo", "fox", "golf", "hotel", "ünï", "€")


def generate(
    seed: int,
    duration: float,
    *,
    replicas: int = 1,
    ledger: str = "sqlite",
    lease_s: float = 2.0,
    disk_faults: bool = False,
    ledger_faults: bool = False,
    answer_faults: bool = False,
    lookups: bool = False,
    keyless: bool = False,
    operator: bool = False,
    maintenance: bool = False,
    clock_steps: bool = False,
) -> Schedule:
    """The schedule for ``seed``: a deterministic function of its arguments."""
    rng = random.Random(seed)
    # A typical chat reservation is ~10-30 µUSD; limits of a few dozen of them
    # make some calls meet a 402 while others land.
    limits: dict[str, int | None] = {"default": None}
    for path in BUDGETS[1:]:
        limits[path] = rng.choice([None, rng.randrange(100_000, 1_000_000)])
    rate = rng.uniform(4.0, 12.0)  # calls per second
    calls: list[Call] = []
    at = 0.0
    while (at := at + rng.expovariate(rate)) < duration:
        calls.append(_call(rng, seed, len(calls), at, replicas))
    if answer_faults:  # drawn apart, so schedules without the option are unchanged
        calls = _oversized(random.Random(f"answers {seed}"), calls)
    if lookups:
        calls += _payments(random.Random(f"lookups {seed}"), seed, duration, replicas)
    if lookups and keyless:  # drawn apart too: the keyed calls stay as they were
        rng_keyless = random.Random(f"keyless {seed}")
        calls += _payments(rng_keyless, seed, duration, replicas, keyless=True)
    return Schedule(
        seed=seed,
        duration=duration,
        replicas=replicas,
        ledger=ledger,
        lease_s=lease_s,
        limits=limits,
        calls=tuple(calls),
        faults=tuple(_faults(rng, duration, replicas, lease_s, disk_faults, ledger_faults, ledger))
        + (_operator(seed, duration, lookups) if operator else ())
        + (_maintenance(seed, duration, ledger) if maintenance else ())
        + (_clock_steps(seed, duration, replicas, ledger) if clock_steps else ()),
        lookups=lookups,
        keyless=lookups and keyless,
    )


def _call(rng: random.Random, seed: int, n: int, at: float, replicas: int) -> Call:
    route: Route = rng.choice(["chat", "chat", "messages", "send"])
    streams = ROUTES[route][3]
    call_id = f"c{n:04d}"
    words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(1, 30)))
    retries = rng.choice([0, 0, 1, 2])
    return Call(
        id=call_id,
        at=round(at, 3),
        route=route,
        stream=streams and rng.random() < 0.4,
        key=f"k-{seed}-{call_id}" if rng.random() < 0.5 else None,
        budget=rng.choice(BUDGETS),
        max_tokens=rng.randint(1, 16),
        prompt=f"sim {seed} {call_id}: {words}",
        behaviour=_behaviour(rng, call_id, streams).render(),
        sdk_retries=retries,
        replicas=tuple(rng.randrange(replicas) for _ in range(retries + 2)),
        repeat=rng.random() < 0.15,
    )


def _behaviour(rng: random.Random, call_id: str, streams: bool) -> Behaviour:
    """What the fake provider does with this call's requests (most answer plainly)."""
    delay = rng.choice([None, None, 0.05, 0.2, 0.6])
    roll = rng.random()
    times = rng.choice([1, 1, 2, 9])
    if roll < 0.55:
        return Behaviour(delay=delay)
    if roll < 0.65:
        return Behaviour(delay=delay, status=429, id=call_id, times=times)
    if roll < 0.72:
        return Behaviour(delay=delay, status=rng.choice([500, 503, 529]), id=call_id, times=times)
    if roll < 0.82:
        return Behaviour(delay=delay, ending="drop", id=call_id, times=times)
    if roll < 0.91 and streams:
        return Behaviour(
            delay=delay, ending="cut", after=rng.randint(0, 4), id=call_id, times=times
        )
    return Behaviour(delay=delay, ending="reset", after=rng.randint(0, 4), id=call_id, times=times)


def _payments(
    rng: random.Random, seed: int, duration: float, replicas: int, *, keyless: bool = False
) -> list[Call]:
    """``pay`` calls: keyed, at most once, often lost after the provider applied them (or
    refused before it did), then resent by several copies at once, through any replica.

    ``keyless``: ``q`` calls without a key, whose copies are SDK retries of the same
    request (matched by its hash); none repeats after its 200, which would be new work."""
    calls: list[Call] = []
    at = 0.0
    while (at := at + rng.expovariate(rng.uniform(1.0, 3.0))) < duration:
        call_id = f"{'q' if keyless else 'p'}{len(calls):04d}"
        retries = rng.choice([0, 1, 2])
        calls.append(
            Call(
                id=call_id,
                at=round(at, 3),
                route="pay",
                stream=False,
                key=None if keyless else f"k-{seed}-{call_id}",
                budget=rng.choice(BUDGETS),
                max_tokens=0,
                prompt=f"sim {seed} {call_id}",
                behaviour=_pay_behaviour(rng, call_id).render(),
                sdk_retries=retries,
                replicas=tuple(rng.randrange(replicas) for _ in range(retries + 2)),
                repeat=rng.random() < 0.15 and not keyless,
                resends=rng.choice([1, 2, 3, 4]),
                resend_behaviour=rng.choice(["", f"drop;id={call_id}-r;times=1"]),
            )
        )
    return calls


def _pay_behaviour(rng: random.Random, call_id: str) -> Behaviour:
    """Applied and answered; applied and the answer lost (``drop``, ``reset``); refused
    before it was applied (a 500, which the search never finds)."""
    delay = rng.choice([None, None, 0.05, 0.3])
    roll = rng.random()
    times = rng.choice([1, 1, 2])
    if roll < 0.25:
        return Behaviour(delay=delay)
    if roll < 0.5:
        return Behaviour(delay=delay, ending="drop", id=call_id, times=times)
    if roll < 0.6:
        return Behaviour(delay=delay, ending="reset", after=0, id=call_id, times=times)
    return Behaviour(delay=delay, status=500, id=call_id, times=times)


def _oversized(rng: random.Random, calls: list[Call]) -> list[Call]:
    """Some calls answered without end, past the run's ``max_answer_bytes`` (one in
    twelve), and some padded to half of it (one in twenty), which must still complete."""
    out: list[Call] = []
    for call in calls:
        roll = rng.random()
        if roll < 1 / 12:
            call = dataclasses.replace(call, behaviour=Behaviour(ending="endless").render())
        elif roll < 1 / 12 + 1 / 20:
            pad = Behaviour(pad=MAX_ANSWER_BYTES // 2).render()
            call = dataclasses.replace(call, behaviour=pad)
        out.append(call)
    return out


def _faults(
    rng: random.Random,
    duration: float,
    replicas: int,
    lease_s: float,
    disk: bool,
    ledger_faults: bool = False,
    ledger: str = "sqlite",
) -> list[Fault]:
    kinds: list[FaultKind] = ["kill", "kill", "crash_at", "crash_at", "stop", "restart"]
    if disk:
        kinds.append("disk_full")
    if ledger_faults:  # appended last, so schedules without the option are unchanged
        kinds.append("read_only" if ledger == "sqlite" else "pg_outage")
    faults: list[Fault] = []
    at = rng.uniform(0.5, 2.0)
    while at < duration * 0.85:
        kind = rng.choice(kinds)
        replica = rng.randrange(replicas)
        if kind == "kill":
            faults.append(Fault(at, kind, replica, seconds=round(rng.uniform(0.0, 1.0), 3)))
        elif kind == "crash_at":
            faults.append(Fault(at, kind, replica, point=rng.choice(CRASH_POINTS)))
        elif kind == "stop":
            faults.append(Fault(at, kind, replica, seconds=round(lease_s + rng.uniform(1, 2), 3)))
        elif kind == "disk_full":
            faults.append(Fault(at, kind, replica, seconds=round(rng.uniform(0.5, 2.0), 3)))
        elif kind == "read_only":
            faults.append(Fault(at, kind, 0, seconds=round(rng.uniform(0.5, 3.0), 3)))
        elif kind == "pg_outage":
            seconds = round(rng.uniform(1.0, 5.0), 3)
            faults.append(Fault(at, kind, 0, seconds=seconds, point=rng.choice(PG_STOP_MODES)))
        else:
            faults.append(Fault(at, kind, replica))
        at = round(at + rng.uniform(2.5, 7.0), 3)
    return faults


def _operator(seed: int, duration: float, lookups: bool) -> tuple[Fault, ...]:
    """``--operator``: limits and reconciles (as drawn before keys and rates were added),
    then key rotations and rate limits from a generator of their own, in time order."""
    limits = _operator_actions(random.Random(f"operator {seed}"), duration, lookups)
    # tpm from a generator of its own: the rest of a schedule is drawn as before it came.
    keys = _key_and_rate_actions(
        random.Random(f"keys {seed}"), random.Random(f"tpm {seed}"), duration
    )
    return tuple(sorted(limits + keys, key=lambda f: f.at))


def key_root(name: str) -> str:
    """The budget root of the simulator's key ``ROOT.N``."""
    return name.rpartition(".")[0]


def _key_and_rate_actions(
    rng: random.Random, tpms: random.Random, duration: float
) -> tuple[Fault, ...]:
    """Every 1.5-5 s: a key rotation (the key a root's clients use is revoked, and a new
    one made, up to 1.5 s before or 4 s after: clients meet 401s meanwhile, and go on
    with the new key once made) or ``budget set PATH --rpm --tpm --concurrency`` (raised,
    lowered, to 0, removed; ``tpm`` drawn from ``tpms``). A root is rotated again only
    once its last new key exists."""
    faults: list[Fault] = []
    generation = dict.fromkeys(KEY_ROOTS, 0)
    busy_until = dict.fromkeys(KEY_ROOTS, 0.0)
    at = round(rng.uniform(1.0, 3.0), 3)
    while at < duration * 0.85:
        free = [r for r in KEY_ROOTS if busy_until[r] < at]
        if free and rng.random() < 0.5:
            root = rng.choice(free)
            # The new key first (a rotation), soon after, or long after: only then do
            # requests with the revoked key outlast the bound the contract gives even a
            # replica that cannot read the keys.
            gap = rng.choice([rng.uniform(-1.5, 0.0), rng.uniform(1.0, 4.0), rng.uniform(7, 10)])
            made = round(max(0.2, busy_until[root] + 0.1, at + gap), 3)
            faults.append(Fault(at, "key_revoke", 0, point=f"{root}.{generation[root]}"))
            generation[root] += 1
            faults.append(Fault(made, "key_new", 0, point=f"{root}.{generation[root]}"))
            busy_until[root] = max(at, made)
        else:
            rpm = rng.choice(["-", "none", "0", *map(str, range(2, 40, 3))])
            concurrency = rng.choice(["-", "-", "none", "1", "2", "3"])
            # A call's estimate (prompt bytes and max_tokens) is 20-200 tokens here.
            tpm = tpms.choice(["-", "-", "none", "0", "150", "400", "1000", "2500", "6000"])
            point = f"{rng.choice(BUDGETS)} rpm={rpm} tpm={tpm} concurrency={concurrency}"
            faults.append(Fault(at, "rate_set", 0, point=point))
        at = round(at + rng.uniform(1.5, 5.0), 3)
    return tuple(faults)


def _operator_actions(rng: random.Random, duration: float, lookups: bool) -> tuple[Fault, ...]:
    """``--operator``: every 1-4 s of the load, ``budget set`` on any budget (a limit
    raised, lowered, often below what the node already holds, or removed) or, with
    ``--lookups``, ``reconcile --auto`` racing the sweepers' lookups and the copies'
    resends. Not a replica's fault (``replica`` is 0 by convention): the runner applies
    them on their own."""
    faults = []
    at = rng.uniform(0.5, 2.0)
    while at < duration * 0.9:
        if lookups and rng.random() < 0.4:
            faults.append(Fault(at, "reconcile_auto", 0))
        else:
            limit = rng.choice([None, rng.randrange(20_000, 1_000_000)])
            point = f"{rng.choice(BUDGETS)}={limit or 'none'}"
            faults.append(Fault(at, "budget_set", 0, point=point))
        at = round(at + rng.uniform(1.0, 4.0), 3)
    return tuple(faults)


def _maintenance(seed: int, duration: float, ledger: str) -> tuple[Fault, ...]:
    """``--maintenance``: every 1-3 s of the load, ``backup`` (SQLite only: PostgreSQL is
    backed up with its own tools), ``archive`` (in steps of a few hundred events or the
    default) or an authorized ``reconcile --resend`` of an unknown keyed call, then 1-3
    copies of its resend at once. Not a replica's fault (``replica`` is 0): the runner
    applies them on their own, whatever the replicas do."""
    rng = random.Random(f"maintenance {seed}")
    kinds: list[FaultKind] = ["backup", "archive", "resend"]
    if ledger != "sqlite":
        kinds.remove("backup")
    faults = []
    at = rng.uniform(1.0, 2.5)
    while at < duration * 0.9:
        kind: FaultKind = rng.choice(kinds)
        if kind == "archive":
            faults.append(Fault(at, kind, 0, point=str(rng.choice([100, 500, 50_000]))))
        elif kind == "resend":
            point = f"{rng.randint(1, 3)}:{rng.randrange(1000)}"
            faults.append(Fault(at, kind, 0, point=point))
        else:
            faults.append(Fault(at, kind, 0))
        at = round(at + rng.uniform(1.0, 3.0), 3)
    return tuple(faults)


def _clock_steps(seed: int, duration: float, replicas: int, ledger: str) -> tuple[Fault, ...]:
    """``--clock-steps``: wall-clock steps from a generator of their own (not a replica's
    fault but for a PostgreSQL replica's own host clock: applied on their own)."""
    draws = clocksteps.draw(seed, duration, replicas, ledger)
    return tuple(Fault(at, "clock_step", replica, point=point) for at, replica, point in draws)
