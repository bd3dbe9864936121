"""Where each array of a committed step lives inside one pool slot's flat int32 buffer. Pure.

For a step of R request rows and N token rows (a bucketed step: R = bucket, N = R * q_len; any
other step: R = B, N = T) the arrays sit back to back from offset 0, so a commit copies one
contiguous range per layer group and nothing the step does not use:

    qo_indptr [R+1] | per group g: kv_indptr [R+1], last_page_len [R], kv_lens [R] | (pad to 8 bytes)
    slot_mapping int64 [N] | group 0 indices [P] | group 1 indices [P] | ...

Only the first n_g (+ padding) entries of group g's index region are used; P (index_capacity)
bounds the pages one group of one step may read, padding requests' scratch entries included.
Offsets depend on (R, N), so a graph captured for a bucket reads its own fixed addresses.
"""

from __future__ import annotations

import attrs


@attrs.frozen
class Offsets:
    """int32-element offsets for one (R, N). groups[g] = (kv_indptr, last_page_len, kv_lens, indices)."""

    rows: int
    num_rows: int
    slots: int  # start of slot_mapping (int64; an even int32 offset)
    groups: tuple[tuple[int, int, int, int], ...]
    head_end: int  # end of the slot_mapping region: group 0's indices start here


@attrs.frozen
class Layout:
    """max_rows: the most request rows (the pool's max batch); max_tokens: the most token rows;
    index_capacity: P, the most page entries one group of one step holds; num_groups: G."""

    max_rows: int
    max_tokens: int
    index_capacity: int
    num_groups: int

    def at(self, rows: int, num_rows: int) -> Offsets:
        groups, head = [], rows + 1
        for _ in range(self.num_groups):
            groups.append((head, head + rows + 1, head + 2 * rows + 1))
            head += 3 * rows + 1
        slots = head + (head & 1)
        end = slots + 2 * num_rows
        return Offsets(rows, num_rows, slots,
                       tuple((*g, end + i * self.index_capacity) for i, g in enumerate(groups)), end)

    @property
    def size(self) -> int:
        """int32 elements of one slot: the layout at the largest (R, N)."""
        return self.at(self.max_rows, self.max_tokens).head_end + self.num_groups * self.index_capacity
