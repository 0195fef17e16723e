"""Pieces shared by the Gluon kernels' barrier-protocol simulations (tests/test_gluon_attention.py,
tests/test_gluon_attention_bwd.py): an mbarrier, a ring of TMA slots that checks nobody overwrites a tile
still (or not yet) read, and a scheduler that runs the partitions (generators yielding (barrier, parity)
waits) and the TMA completions in a random order until all finished, failing on a deadlock."""
from __future__ import annotations


class Bar:
    """An mbarrier (or, with count = number of warpgroups, a thread barrier): `count` arrives complete a
    phase; wait(parity) passes once the phase of that parity has completed (a fresh barrier passes
    parity 1 at once)."""

    def __init__(self, count):
        self.count, self.pending, self.phases = count, count, 0

    def arrive(self):
        self.pending -= 1
        assert self.pending >= 0
        if self.pending == 0:
            self.phases, self.pending = self.phases + 1, self.count

    def done(self, parity):
        return (self.phases & 1) != parity


class Ring:
    """TMA slots per kind (e.g. "k", "v"), `stages` deep, read by `n_readers` warpgroups.  load() starts a
    copy (queued in `in_flight` until land()), start_read/end_read bracket a warpgroup's use of a tile."""

    def __init__(self, kinds, stages: int, n_readers: int):
        self.stages, self.n_readers = stages, n_readers
        self.slot = {k: [None] * stages for k in kinds}            # tile held (landed or in flight)
        self.landed = {k: [False] * stages for k in kinds}
        self.readers = {k: [set() for _ in range(stages)] for k in kinds}
        self.read_by: dict = {k: {} for k in kinds}                 # tile -> warpgroups that finished it
        self.in_flight: list = []                                   # (kind, stage) copies not landed yet

    def load(self, kind, t):
        st = t % self.stages
        old = self.slot[kind][st]
        assert not self.readers[kind][st], f"{kind} slot {st} overwritten by tile {t} while read"
        assert old is None or self.read_by[kind].get(old, set()) == set(range(self.n_readers)), \
            f"{kind} tile {old} in slot {st} overwritten by tile {t} before every warpgroup read it"
        self.slot[kind][st], self.landed[kind][st] = t, False
        self.in_flight.append((kind, st))

    def land(self, kind, st):
        self.landed[kind][st] = True

    def start_read(self, kind, t, wg):
        st = t % self.stages
        assert self.slot[kind][st] == t and self.landed[kind][st], \
            f"wg{wg} reads {kind} tile {t}: slot has {self.slot[kind][st]}"
        self.readers[kind][st].add(wg)

    def end_read(self, kind, t, wg):
        self.readers[kind][t % self.stages].discard(wg)
        self.read_by[kind].setdefault(t, set()).add(wg)

    def all_read(self, kind, n_tiles) -> bool:
        return all(self.read_by[kind].get(t) == set(range(self.n_readers)) for t in range(n_tiles))


def run(agents: dict, in_flight: list, on_land, rnd) -> None:
    """Step the agents (generators yielding (barrier, parity) to wait on, or (None, None) to let others
    run) and land the in-flight copies (on_land(item)) in a random order until everything finished."""
    blocked = {name: (None, None) for name in agents}
    while agents or in_flight:
        runnable = [n for n in agents if blocked[n][0] is None or blocked[n][0].done(blocked[n][1])]
        choices = runnable + (["tma"] if in_flight else [])
        assert choices, f"deadlock: {blocked}"
        who = rnd.choice(choices)
        if who == "tma":
            on_land(in_flight.pop(rnd.randrange(len(in_flight))))
            continue
        try:
            blocked[who] = next(agents[who])
        except StopIteration:
            del agents[who]
