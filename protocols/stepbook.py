"""A stage node's book of the microbatches routed through it: when it may step, and who may send what.

Sans-I/O, like `noloco.PairingRound`: the node reports events (a forward taken, a try to send it on, a
microbatch finished or aborted, the clock) and asks for decisions (refuse this forward? may this peer send
its gradient or abort? step now?). Time comes in as arguments; nothing here touches tensors or sockets.

Groups. A group is one data node's iteration, `(origin, iteration)`. Each forward says how many of the
group's microbatches the plan sends through this node (`expected`); the group is complete once that many (or
as many as actually arrived, if re-routing sent more or the data node moved on to a later iteration) have
finished their backward pass or were aborted. The node steps when nothing is held and the groups of the
oldest iterations it knows of are complete or expired, and a forward of a newer iteration waits for that
step. Each group with gradients is one update, with the learning rate of its iteration (the caller keeps
one gradient buffer per group), so the number of updates a node takes per tick of the swarm clock is the
number of data nodes that routed work through it, whatever the timing: two groups that happen to complete
together are never merged into one update. No global barrier is needed and no microbatch is applied twice.
An abort may arrive before any forward of its group (the microbatch died upstream, and this node is further
down its path): it is remembered for one expiry period, so that the group does not wait for the microbatch
that never will arrive.

Ticks in step. The first forward of tick t opens an awaited group for every other data node that will
send this node work in tick t, which holds the step of tick t until that data node's forwards of t arrive
and finish, it moves on to a later tick, or `await_s` passes (it died, or sends its work elsewhere now;
forwards that come later are taken, for a later step). So the forwards of every data node's tick t run on
the weights of tick t - 1 and the updates of tick t follow them, whichever data node is a little ahead:
without it the order of one node's step and another's forward was the timing's, and three runs of one seed
of a 2x1 swarm ended 5.18 to 5.46. Who will send: the forwards name them (`senders`: the data nodes whose
paths the plan sends through this node in tick t; the union of what the tick's forwards name, as data nodes
plan from views that may differ a little); if no forward of the tick names anyone (a forward re-routed
here, which the plan did not send), every data node seen at t - 1, and in a node's first tick
`first_tick_senders` data nodes (the run's `min_data_nodes`). Guessing from tick t - 1 cost a run that skips
stages `await_s` whenever a data node's path left this node out in the next tick: a step in four took 10 s
on the emulated WAN (`benchmarks/wan_swarm.py`). A data node awaited in vain is not awaited again in that
tick (`StepDecision.waited_out` says whom the step went without). A data node whose record shows it
finished a tick (`passed`) sends nothing more for it: so a plan that named it here wrongly (the data nodes'
views differ a little) costs the time its record takes to show that, about a second or two, not `await_s`.

Senders. A message's path is written by its sender, so it cannot say who may send a gradient back or abort.
For each microbatch it took, the book remembers the path up to this node as it arrived and every peer the
node tried to send the microbatch on to (re-routes included, recorded before each try). Only one of those
may send its gradient; aborts come from those, the upstream peers or the data node.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

MAX_EARLY_ABORTS = 4096  # aborts remembered for groups not seen yet (a bound against a flood of them)
FORGET_AFTER_EXPIRIES = 10  # closed groups are remembered (late messages refused) this many expiry periods
AWAIT_S = 10.0  # how long a tick's step waits at most for a data node expected to send work in it
# (at most a third of the expiry, the run's iteration timeout)
FORGET_ORIGIN_TICKS = 16  # a data node silent this many ticks is no longer remembered as a sender
MAX_PASSED = 1024  # data nodes whose finished ticks are remembered (`passed`)


class MicrobatchKey(NamedTuple):
    """One microbatch of the swarm: its data node, that node's iteration (the swarm clock), its index."""

    origin: str
    iteration: int
    microbatch: int

    @property
    def group(self) -> Group:
        return (self.origin, self.iteration)


Group = tuple[str, int]  # (origin data node, iteration)


@dataclass
class _GroupState:
    created: float
    expected: int = 0
    seen: set[int] = field(default_factory=set)
    finished: set[int] = field(default_factory=set)
    applied: int = 0  # microbatches whose gradient reached this node's parameters
    awaited: bool = False  # opened for a data node expected to send work in this tick; none of its yet
    ran_out: bool = False  # expired (an awaited one: `await_s` passed without its work)

    @property
    def complete(self) -> bool:
        """Every microbatch that arrived has finished, and as many as planned have finished or been aborted
        (aborts may name microbatches that never arrived: they count toward the plan, not for the held)."""
        return self.seen <= self.finished and len(self.finished) >= self.expected


@dataclass
class _Hops:
    upstream: tuple[str, ...]
    downstream: set[str] = field(default_factory=set)


@dataclass(frozen=True)
class StepDecision:
    """Step now: one update per group of `updates` (the closed groups whose gradients reached this node,
    oldest iteration first, each with the learning rate of its own iteration), `shares[i]` microbatches
    applied in `updates[i]`, `applied` in all. A decision with no update only closes groups whose
    microbatches were all aborted."""

    updates: tuple[Group, ...]
    applied: int
    shares: tuple[int, ...]
    waited_out: tuple[Group, ...] = ()  # awaited groups whose work never came (`await_s` ran out)

    @property
    def iteration(self) -> int | None:
        """The latest iteration the decision applies (None if it applies none)."""
        return self.updates[-1][1] if self.updates else None


class StepBook:
    """Per-group accounting of planned, taken and finished microbatches on one stage node, and their hops."""

    def __init__(self, expiry_s: float, await_s: float = AWAIT_S, first_tick_senders: int = 1) -> None:
        """`first_tick_senders`: how many data nodes this node's first tick waits for (at most `await_s`):
        the run's `min_data_nodes` in a fresh swarm whose forwards name no senders."""
        self.expiry_s = expiry_s
        self.await_s = min(await_s, expiry_s / 3)  # so a data node's iteration outlasts a wait for another
        self.first_tick_senders = first_tick_senders
        self._first_taken_at: float | None = None  # None until the first forward, then until the first step
        self._groups: dict[Group, _GroupState] = {}
        self._last_tick: dict[str, int] = {}  # each data node's latest tick seen here
        self._closed: dict[Group, float] = {}  # stepped groups, remembered to refuse late messages
        self._early: dict[Group, tuple[float, set[int]]] = {}  # aborts of groups not seen yet
        self._named: dict[int, set[str]] = {}  # per tick, the senders its forwards named
        self._passed: dict[str, int] = {}  # each data node's latest tick finished, as its record shows
        self._waited_out: dict[Group, float] = {}  # awaits that ran out: not awaited again
        self._taken: dict[MicrobatchKey, _Hops] = {}  # taken and not finished: queued, held or downstream

    # ---- events ---------------------------------------------------------------------------------------

    def take(
        self,
        key: MicrobatchKey,
        upstream: tuple[str, ...],
        expected: int,
        now: float,
        senders: frozenset[str] | None = None,
    ) -> bool:
        """A forward arrived along `upstream`, its group planning `expected` microbatches through this node
        and naming the data nodes whose work the plan sends through it in this tick (`senders`; None: not
        known). False (refuse it) if it is a duplicate, was aborted, or belongs to a group already stepped
        past."""
        key = MicrobatchKey(*key)
        if key.group in self._closed:
            return False
        for (origin, iteration), older in self._groups.items():
            if origin == key.origin and iteration < key.iteration:
                older.expected = 0  # its data node moved on: what did not arrive here went elsewhere or died
        if senders is not None:
            named = self._named.setdefault(key.iteration, set())
            named |= senders
            for group in [g for g, state in self._groups.items() if state.awaited and g[1] == key.iteration]:
                if group[0] not in named:  # a guess from the tick before that the plan contradicts
                    del self._groups[group]
            self._await(key, named, now)
            if self._first_taken_at is None:
                self._first_taken_at = math.inf  # the plan says who sends in the first tick too
        elif key.iteration not in self._named:
            self._await_senders_of_the_tick_before(key, now)
        state = self._groups.get(key.group)
        if state is None or state.awaited:
            state = self._groups[key.group] = _GroupState(created=now if state is None else state.created)
            state.finished |= self._early.pop(key.group, (now, set()))[1]
        state.expected = max(state.expected, expected)
        if key.microbatch in state.seen or key.microbatch in state.finished:
            return False
        state.seen.add(key.microbatch)
        self._taken[key] = _Hops(upstream)
        if self._first_taken_at is None and not self._closed:
            self._first_taken_at = now
        self._last_tick[key.origin] = max(self._last_tick.get(key.origin, key.iteration), key.iteration)
        latest = max(self._last_tick.values())
        for origin in [o for o, tick in self._last_tick.items() if tick < latest - FORGET_ORIGIN_TICKS]:
            del self._last_tick[origin]
        for tick in [tick for tick in self._named if tick < latest - FORGET_ORIGIN_TICKS]:
            del self._named[tick]
        return True

    def _await_senders_of_the_tick_before(self, key: MicrobatchKey, now: float) -> None:
        self._await(key, (o for o, tick in self._last_tick.items() if tick == key.iteration - 1), now)

    def _await(self, key: MicrobatchKey, origins: Iterable[str], now: float) -> None:
        """Hold the step of `key`'s tick for the other `origins`' groups of that tick (not moved on yet)."""
        for origin in origins:
            group = (origin, key.iteration)
            gone_past = (
                self._last_tick.get(origin, key.iteration) > key.iteration
                or self._passed.get(origin, -1) >= key.iteration
            )
            known = group in self._groups or group in self._closed or group in self._waited_out
            if origin == key.origin or gone_past or known:
                continue
            self._groups[group] = _GroupState(created=now, expected=1, awaited=True)

    def passed(self, origin: str, tick: int) -> None:
        """`origin` finished its ticks up to `tick` (its record's step says so): whatever of them did not
        reach this node went elsewhere or died, so its groups of those ticks wait for nothing more and it
        is awaited in none of them."""
        if tick <= self._passed.get(origin, -1):
            return
        self._passed[origin] = tick
        for (sender, iteration), state in self._groups.items():
            if sender == origin and iteration <= tick:
                state.expected = 0
        if len(self._passed) > MAX_PASSED:
            del self._passed[min(self._passed, key=self._passed.__getitem__)]

    def tries(self, key: MicrobatchKey) -> set[str] | None:
        """The set the router records its tries to send `key` on in (before each try), or None once `key`
        is finished or aborted (then send nothing)."""
        hops = self._taken.get(MicrobatchKey(*key))
        return None if hops is None else hops.downstream

    def finish(self, key: MicrobatchKey, applied: bool, now: float) -> None:
        """A microbatch finished here: its backward pass ran (`applied`) or it was aborted. An abort for a
        group this node has not seen yet is remembered for one expiry period."""
        key = MicrobatchKey(*key)
        self._taken.pop(key, None)
        state = self._groups.get(key.group)
        if state is None or state.awaited:
            if not applied and key.group not in self._closed:
                self._remember_early(key.group, key.microbatch, now)
            return
        if key.microbatch in state.finished:
            return
        state.finished.add(key.microbatch)
        state.applied += int(applied)

    def expire(self, now: float) -> frozenset[MicrobatchKey]:
        """Give up on groups older than the expiry (they count as complete) and forget the hops of every
        microbatch whose group is no longer open. Returns the microbatches still taken: the caller drops
        whatever else it holds."""
        for state in self._groups.values():
            limit = self.await_s if state.awaited else self.expiry_s
            if not state.complete and now - state.created > limit:
                state.expected = 0
                state.finished |= state.seen
                state.ran_out = True
        open_groups = self.open_groups
        for key in [key for key in self._taken if key.group not in open_groups]:
            del self._taken[key]
        return frozenset(self._taken)

    def ready(self, held: int, now: float) -> StepDecision | None:
        """A step decision if this node should step now, else None: nothing is held, and the complete groups
        of iterations older than every open group are stepped (the forwards of a newer iteration wait for
        that step: `waits`). A decision closes its groups: their late messages are refused from then on."""
        oldest_open = min((iteration for (_, iteration) in self.open_groups), default=None)
        due = [
            group
            for group, state in self._groups.items()
            if state.complete and (oldest_open is None or group[1] < oldest_open)
        ]
        if held or not due or self._first_tick_waits(now):
            return None
        self._first_taken_at = math.inf  # the first tick is over: the ticks before say who sends
        updates = sorted((group for group in due if self._groups[group].applied), key=lambda g: (g[1], g[0]))
        waited_out = tuple(sorted(g for g in due if self._groups[g].awaited and self._groups[g].ran_out))
        decision = StepDecision(
            tuple(updates),
            sum(self._groups[group].applied for group in due),
            tuple(self._groups[group].applied for group in updates),
            waited_out,
        )
        for group in due:
            if not self._groups[group].awaited:  # an awaited group closes nothing (below)
                self._closed[group] = now
            del self._groups[group]
        for group in waited_out:  # an await that ran out closes nothing: its forwards, if they come late,
            self._waited_out[group] = now  # open the group afresh for a later step; it is not awaited again
        horizon = now - FORGET_AFTER_EXPIRIES * self.expiry_s
        for book in (self._closed, self._waited_out):
            for group in [g for g, at in book.items() if at < horizon]:
                del book[group]
        return decision

    def _first_tick_waits(self, now: float) -> bool:
        """Whether the first tick still waits for senders: fewer than `first_tick_senders` data nodes sent
        work in it, for less than `await_s` since the first forward."""
        if self._first_taken_at is None or self._first_taken_at == math.inf:
            return False
        first = min(iteration for _, iteration in self._groups)
        senders = {origin for origin, iteration in self._groups if iteration == first}
        return len(senders) < self.first_tick_senders and now - self._first_taken_at < self.await_s

    # ---- questions ------------------------------------------------------------------------------------

    def __len__(self) -> int:
        """Microbatches taken and not finished (the backlog a node bounds)."""
        return len(self._taken)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, tuple) and len(key) == 3 and MicrobatchKey(*key) in self._taken

    def waits(self, iteration: int) -> bool:
        """Whether a forward of `iteration` must wait before it runs: a group of an older iteration is still
        open or not stepped yet. So a node takes one step per iteration (the swarm clock's tick) rather than
        one for several, whatever the timing: a data node starts its next iteration as soon as its gradients
        are back, often before the nodes downstream have stepped."""
        return any(older < iteration for (_, older) in self._groups)

    @property
    def groups(self) -> set[Group]:
        """Groups not stepped yet: open, or complete and waiting for an older one."""
        return set(self._groups)

    @property
    def open_groups(self) -> set[Group]:
        """Groups still waiting for microbatches (an expired group is no longer open)."""
        return {group for group, state in self._groups.items() if not state.complete}

    def may_send_gradient(self, key: MicrobatchKey, peer: str) -> bool:
        """Only a peer this node sent the microbatch to may send its gradient back."""
        hops = self._taken.get(MicrobatchKey(*key))
        return hops is not None and peer in hops.downstream

    def may_abort(self, key: MicrobatchKey, peer: str) -> bool:
        """An abort from the data node or a peer on the path as this node knows it; for a microbatch this
        node has not taken, anyone's (the book remembers it for one expiry period at most)."""
        key = MicrobatchKey(*key)
        hops = self._taken.get(key)
        return hops is None or peer == key.origin or peer in hops.upstream or peer in hops.downstream

    def _remember_early(self, group: Group, microbatch: int, now: float) -> None:
        for old in [g for g, (seen_at, _) in self._early.items() if now - seen_at > self.expiry_s]:
            del self._early[old]
        if sum(len(keys) for _, keys in self._early.values()) >= MAX_EARLY_ABORTS:
            return
        self._early.setdefault(group, (now, set()))[1].add(microbatch)
