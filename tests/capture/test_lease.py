"""capture/lease.py on the CPU: a fenced commit frees its slot once the fence holds its generation (no
event); a fence not reached yet is polled, then the commit's stream synchronized; a fence still wrong
after that is an error, not a silent reuse; an event is recorded late for a fenced step that is waited for."""

import pytest

from mstar_attn.capture import lease as lease_mod
from mstar_attn.capture.lease import FENCE_MASK, SlotLeases


class FakeStream:
    """Synchronizing writes `value` into the fence (what the GPU's graph would have done by then)."""

    def __init__(self, leases, s, value):
        self.leases, self.s, self.value, self.synced = leases, s, value, 0

    def synchronize(self):
        self.synced += 1
        if self.value is not None:
            self.leases.fence_np[self.s] = self.value


class FakeEvent:
    def __init__(self):
        self.recorded = []

    def record(self, stream=None):
        self.recorded.append(stream)

    def query(self):
        return True

    def synchronize(self):
        pass


def _commit(leases, s, stream):
    """What GraphBufferPool.commit does with a fenced slot: stage the next fence, count the commit, record."""
    value = leases.next_fence(s)
    leases.generations[s] += 1
    leases.record(s, stream, True)
    return value


def test_a_reached_fence_frees_the_slot_without_waiting():
    leases = SlotLeases(2, cuda=False)
    value = _commit(leases, 0, FakeStream(leases, 0, None))
    leases.fence_np[0] = value  # (the graph ran)
    leases.free(0)
    assert leases.stalls == 0 and value == 1


def test_a_fence_not_reached_is_polled_then_its_stream_synchronized(monkeypatch):
    monkeypatch.setattr(lease_mod, "SPIN_SECONDS", 0.001)
    leases = SlotLeases(2, cuda=False)
    stream = FakeStream(leases, 1, None)
    value = _commit(leases, 1, stream)
    stream.value = value
    leases.free(1)
    assert leases.stalls == 1 and stream.synced == 1 and leases.fence_np[1] == value


def test_a_fence_still_wrong_after_a_synchronize_raises(monkeypatch):
    monkeypatch.setattr(lease_mod, "SPIN_SECONDS", 0.001)
    leases = SlotLeases(2, cuda=False)
    stream = FakeStream(leases, 0, None)
    _commit(leases, 0, stream)
    stream.value = 7  # (another generation: never the commit's)
    with pytest.raises(RuntimeError, match="fence"):
        leases.free(0)


def test_the_fence_wraps_at_int32():
    leases = SlotLeases(1, cuda=False)
    leases.generations[0] = FENCE_MASK
    value = _commit(leases, 0, FakeStream(leases, 0, None))
    leases.fence_np[0] = value
    leases.free(0)
    assert value == 0 and leases.stalls == 0


def test_a_fenced_step_waited_for_gets_its_event_on_the_commits_stream():
    leases = SlotLeases(2, cuda=False)
    leases.ready = [FakeEvent(), FakeEvent()]
    stream = FakeStream(leases, 0, None)
    _commit(leases, 0, stream)
    assert leases.ready[0].recorded == []  # fenced: no event per commit
    ev = leases.event_of(0)
    assert ev is leases.ready[0] and ev.recorded == [stream] and not leases.fenced[0]
    leases.record(1, stream, False)  # an event-proven commit records at once
    assert leases.ready[1].recorded == [stream]


def test_take_claims_a_fenced_slot_as_free_and_record_would(monkeypatch):
    """A steady commit's lease (take) on a stream: a reached fence frees the slot at once, and the slot is claimed
    fenced on that stream (no event); a fence not reached yet is waited for (polled, then the stream synchronized);
    a CPU lease (no stream) records its event; a slot whose step runs on another stream is refused, nothing changed."""
    monkeypatch.setattr(lease_mod, "SPIN_SECONDS", 0.001)
    leases = SlotLeases(2, cuda=False)
    leases.ready = [FakeEvent(), FakeEvent()]
    stream = FakeStream(leases, 0, None)
    value = _commit(leases, 0, stream)
    leases.fence_np[0] = value  # (the graph ran)
    assert leases.take(0, stream)
    assert leases.stalls == 0 and leases.fenced[0] and leases.streams[0] is stream and leases.consumers[0] is stream
    assert leases.ready[0].recorded == []
    leases.generations[0] += 1  # (the steady commit's next generation, its fence not written back yet)
    stream.value = leases.generations[0] & FENCE_MASK
    assert leases.take(0, stream) and leases.stalls == 1 and stream.synced == 1  # waited for, as free does
    other = FakeStream(leases, 1, None)
    before = (list(leases.fenced), list(leases.streams), list(leases.consumers))
    assert not leases.take(1, other)  # (slot 0's step runs on `stream`)
    assert (list(leases.fenced), list(leases.streams), list(leases.consumers)) == before
    cpu = SlotLeases(1, cuda=False)
    cpu.ready = [FakeEvent()]
    assert cpu.take(0, None) and cpu.ready[0].recorded == [None] and not cpu.fenced[0]


def test_take_waits_for_an_event_proven_slot_then_claims_it_fenced():
    """A slot whose last commit was proven by an event (the general path) is waited for through that event before
    a steady commit on a stream takes it (the event's synchronize when its query says not done), and is then
    claimed fenced on that stream."""
    class Pending(FakeEvent):
        def __init__(self):
            super().__init__()
            self.synced = 0

        def query(self):
            return self.synced > 0

        def synchronize(self):
            self.synced += 1

    leases = SlotLeases(2, cuda=False)
    leases.ready = [Pending(), Pending()]
    stream = FakeStream(leases, 1, None)
    leases.generations[1] += 1
    leases.record(1, stream, False)  # (a general commit: its event recorded, not fenced)
    leases.fenced[1], leases.streams[1] = False, None
    leases.fence_np[1] = leases.generations[1] & FENCE_MASK  # (its cell proves nothing: the slot is not fenced)
    assert leases.take(1, stream)
    assert leases.ready[1].synced == 1 and leases.stalls == 1
    assert leases.fenced[1] and leases.streams[1] is stream and leases.consumers[1] is stream
