"""A pool's slots as leases: each slot's commit count, when its staging may be written again, and the
stream its step runs on. Host bookkeeping only; the pool (pool.py) is its one owner.

A commit writes slot s's pinned staging, and copies out of it run later on the GPU. Before the
next commit into s rewrites the staging, those copies must have run: the commit records either an
event after them, or (a derived StepRows commit, whose reads of the staging all sit in one captured
graph: see GraphBufferPool.commit) a fence: the commit's generation, staged with the step, written back
into `fence` (pinned) once the graph has read the staging (on CUDA with Triton, by the derive kernel's
last program: capture/derive.py; else by the graph's last node, a copy), so the host reads one int
instead of paying an event record per step. `free(s)` waits for whichever the last commit left.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from mstar_attn.metadata.errors import PlanError

FENCE_MASK = 0x7FFFFFFF  # a generation as the int32 fence cell holds it
SPIN_SECONDS = 1.0  # how long free() polls a fence before it synchronizes the commit's stream
BUSY_SECONDS = 50e-6  # polled without sleeping this long; then sleeping (the GIL released), backing off to 1 ms


class HostEvent:
    """The event of a CPU pool: CPU copies are synchronous, so every commit is done at once."""

    def record(self, stream=None) -> None: ...
    def synchronize(self) -> None: ...

    def query(self) -> bool:
        return True


class CurrentStream:
    """torch.cuda.current_stream(index) of one device, as the same Stream object while the current stream
    does not change: making a torch Stream object costs a few µs per call, reading the current one's id
    less than one (through torch's own binding; without it, a Stream each call)."""

    def __init__(self, index: int):
        self.index = index
        self.ident = getattr(torch._C, "_cuda_getCurrentStream", None)  # (stream id, device index, device type)
        self.kept: tuple = (None, None)  # (the id, its Stream), one tuple: never a stream beside another's id

    def __call__(self) -> torch.cuda.Stream:
        if self.ident is None:
            return torch.cuda.current_stream(self.index)
        key = self.ident(self.index)
        kept = self.kept
        if key != kept[0]:
            kept = self.kept = (key, torch.cuda.current_stream(self.index))
        return kept[1]


class SlotLeases:
    """num_slots slots of a pool on `device` (cuda: events and a pinned fence array; else host events).

    generations[s]: commits into slot s so far (a DeviceStep is live while its count is current).
    ready[s]: the event after slot s's last event-proven commit; fence [4 * num_slots] int32 pinned: the
    generation (& FENCE_MASK) each slot's last fenced commit graph wrote back (slot s's: fence_cell(s)). consumers[s]: the
    stream slot s's step runs on, if it was committed on or waited for on a side stream."""

    def __init__(self, num_slots: int, cuda: bool):
        self.cuda = cuda
        self.generations = [0] * num_slots
        self.ready = [torch.cuda.Event() if cuda else HostEvent() for _ in range(num_slots)]
        # one cell per 16 bytes (a kernel writing slot s's cell compiles once for every slot: Triton specializes
        # its pointer arguments on 16-byte alignment); fence_ints[4 * s] reads slot s's as a Python int
        self.fence = torch.zeros(num_slots * 4, dtype=torch.int32, pin_memory=cuda)
        self.fence_ints = memoryview(self.fence.numpy())
        self.fenced = [False] * num_slots  # the slot's last commit is proven by its fence (else by ready[s])
        self.streams: list = [None] * num_slots  # the stream a fenced commit ran on (event_of records there)
        self.consumers: list = [None] * num_slots
        self._reuse = [torch.cuda.Event() if cuda else HostEvent() for _ in range(num_slots)]
        self.stalls = 0  # commits that had to wait for the GPU before reusing a slot

    @property
    def fence_np(self) -> np.ndarray:
        """The slots' fence cells as an int32 numpy view [num_slots] (slot s's: [s]), for diagnostics and tests."""
        return self.fence.numpy()[::4]

    def fence_cell(self, s: int) -> torch.Tensor:
        """Slot s's fence cell: int32 [1], pinned on CUDA, 16-byte aligned."""
        return self.fence[4 * s : 4 * s + 1]

    def next_fence(self, s: int) -> int:
        """The value slot s's next commit stages into its fence cell (its generation after the commit)."""
        return (self.generations[s] + 1) & FENCE_MASK

    def free(self, s: int) -> None:
        """Return once the copies out of slot s's staging that its last commit queued have run."""
        if self.fenced[s]:
            want = self.generations[s] & FENCE_MASK
            if self.fence_ints[4 * s] == want:
                return
            self.stalls += 1
            start, nap = time.perf_counter(), 10e-6
            while self.fence_ints[4 * s] != want:
                waited = time.perf_counter() - start
                if waited > SPIN_SECONDS:
                    self.streams[s].synchronize()
                    if self.fence_ints[4 * s] != want:
                        raise RuntimeError(f"slot {s}: its commit graph ran but did not write fence {want} "
                                           f"(reads {self.fence_ints[4 * s]})")
                elif waited > BUSY_SECONDS:
                    time.sleep(nap)
                    nap = min(2 * nap, 1e-3)
        elif not self.ready[s].query():
            self.stalls += 1
            self.ready[s].synchronize()

    def record(self, s: int, on, fenced: bool) -> None:
        """Slot s's commit has queued its last copy on stream `on`: proven by its fence, or by an event now."""
        self.fenced[s], self.streams[s] = fenced, on
        if not fenced:
            self.ready[s].record(on)

    def take(self, s: int, on) -> bool:
        """A steady commit's lease (capture/steady.py), on stream `on` (None: a CPU pool), proven by its fence
        on CUDA: when no slot's step runs on another stream (after_consumer and claim_consumer would do nothing,
        or raise), wait until slot s is free (free), claim it as record does and return True; else False,
        nothing changed (the general commit takes it)."""
        for c in self.consumers:
            if c is not None and c is not on and c != on:
                return False
        if not (self.fenced[s] and self.fence_ints[4 * s] == self.generations[s] & FENCE_MASK):
            self.free(s)  # (else free would return at once: the fence proves the last commit's copies ran)
        self.consumers[s] = self.streams[s] = on
        if on is None:  # (a CPU pool: record's event; on CUDA the commit's fence proves it)
            self.record(s, on, False)
        else:
            self.fenced[s] = True
        return True

    def event_of(self, s: int):
        """An event after slot s's last commit (recorded now on that commit's stream if its fence proves it)."""
        if self.fenced[s]:
            self.ready[s].record(self.streams[s])
            self.fenced[s] = False
        return self.ready[s]

    def after_consumer(self, s: int, on) -> None:
        """If slot s's last step runs on another stream than this commit's `on` (it was committed
        there, or waited for there), make `on` wait (on the GPU) for what that stream has queued so
        far: kernels that may still read the slot."""
        consumer, self.consumers[s] = self.consumers[s], None
        if consumer is not None and on is not None and consumer is not on and consumer != on:
            self._reuse[s].record(consumer)
            on.wait_event(self._reuse[s])

    def claim_consumer(self, s: int, stream, where: str) -> None:
        """Record `stream` as where slot s's step runs. A pool's steps run on one compute stream:
        FlashInfer's float workspace is shared by the slots, so two live steps running on two
        streams at once would race in it (overlap batches with one pool per stream)."""
        for other, c in enumerate(self.consumers):
            if c is not None and c is not stream and other != s and c != stream:
                raise PlanError(f"{where}: slot {other}'s step runs on another stream ({c}); a pool's steps run on "
                                "one compute stream (use one pool per stream to overlap batches)")
        self.consumers[s] = stream

    def memory(self) -> dict[str, tuple[int, int]]:
        return {"slot fences (pinned)": (0, self.fence.numel() * 4 if self.cuda else 0)}


def check_stream(device: torch.device, stream, where: str):
    """`stream` if it is None (the current one) or a torch.cuda.Stream on the pool's `device`, else PlanError."""
    if stream is None:
        return None
    if device.type != "cuda":
        raise PlanError(f"{where}: stream= needs a CUDA pool (this one is on {device})")
    if not isinstance(stream, torch.cuda.Stream) or stream.device != device:
        raise PlanError(f"{where}: stream must be a torch.cuda.Stream on {device}, got {stream!r}")
    return stream


def check_slot(num_slots: int, slot, where: str) -> None:
    """PlanError unless `slot` is None (the next slot) or one of a pool's num_slots slots."""
    if slot is not None and (isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < num_slots):
        raise PlanError(f"{where}: slot {slot!r} is not one of the pool's {num_slots} slots")
