"""The Triton kernels of capture/derive.py (imported only where Triton is installed): `derive`, a bucketed
StepRows (or listed StepBatch) commit's whole device work in one launch, read straight from the slot's pinned
staging, and `copy_head`, which past derive.COPY_FIRST requests first copies that staging's head to the device for
it. See derive.py for the arrays and tests/capture/test_derive.py for their check against the torch ops."""

import triton
import triton.language as tl


BLOCK_P = tl.constexpr(128)  # page entries a program copies per iteration (a global a kernel reads must be a constexpr)
BLOCK_Q = tl.constexpr(64)  # a request's tokens a program maps to slots: the most a step has (metadata/tree.MAX_TREE_NODES)
BLOCK_HEAD = 1024  # int32 elements a program of copy_head moves


@triton.jit
def copy_head(dst, src, n, BLOCK: tl.constexpr):
    """dst[:n] = src[:n], int32: src the slot's pinned staging (read over the bus), dst its device buffer; grid
    (cdiv(n, BLOCK),). A kernel, not a copy node: the derive kernel after it starts without a switch from the
    copy engine (H100: a copy node left ~7-11 µs idle before the next kernel)."""
    j = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = j < n
    tl.store(dst + j, tl.load(src + j, mask=m), mask=m)


@triton.jit
def derive(buf, src, table, xtable, meta, counter, fence, BLOCK_R: tl.constexpr):
    """Grid (R + 1, G). Program (i, g), i < R: request i's entries of layer group g; program (R, 0): every
    staged table update. src: the slot's staging (pinned host memory, read over the bus; past
    derive.COPY_FIRST requests its device copy, buf itself); buf: the slot's device buffer; counter: one
    int32 device cell, 0 between launches; fence: one int32 cell (pinned) the last program to finish
    reading src writes the staged fence value to. BLOCK_R: a power of two >= R (and so 2 * BLOCK_R >= U);
    q_len <= BLOCK_Q. meta (int32 [20 + G],
    derive.Derivation.meta; entries 0, 4, 5, 12, 14 and 18 are not read, see below): R, q_len, page size, table
    width, the offsets of the rows, kv_lens,
    qo_indptr, group 0's kv_indptr (its last_page_len and kv_lens follow), the stride between groups'
    kv_indptr, group 0's first_page (groups R apart), group 0's indices, the stride between groups'
    indices, the table updates (positions [U], then values [U]), U, the fence cell, the slot_mapping
    (int64, at an even offset), whether the step is listed (below), a listed step's cross group (-1: none),
    the offset of its encoder lengths (cross_lens), the cross table's width, then each group's window (0: none).
    The kernels read the head's offsets (the rows, kv_lens, cross_lens, updates, U and fence) from no memory: they are
    layout.head_offsets(R, G) of the grid's R and G, so the reads of src wait for no read of meta.

    A request's program applies the updates that fall in its own table row before reading the row (a
    barrier between: every thread of the program sees them); program (R, 0) applies them all, so rows
    outside the step get theirs too (the same values twice: staged positions are distinct or carry the
    same latest value).

    A listed step is a StepBatch decode step (derive.listed_step; its meta's U is 0: no table updates): `table` is
    then the slot's pinned staging, where the host wrote each request's exact page list, request after request, at
    group 0's indices offset; request i's list starts at the sum of the page counts before it (no rows read). Its
    cross group xg (never group 0), if any, reads request i's pages from row rows[i] of `xtable` (the cross table,
    int32 [(rows + 1) * xwidth + 1] on the device) over its encoder length cross_lens[i], no window, no slots."""
    i, g = tl.program_id(0), tl.program_id(1)
    R, G = tl.num_programs(0) - 1, tl.num_programs(1)
    rows_at, kv_at, upd_at, U = 0, R * (1 + G), R * (3 + G), R // 2 + 16  # (layout.head_offsets)
    fence_at = upd_at + 2 * U
    q_len, ps, width = tl.load(meta + 1), tl.load(meta + 2), tl.load(meta + 3)
    qo_at, ptr_at, ptr_stride, first_at = tl.load(meta + 6), tl.load(meta + 7), tl.load(meta + 8), tl.load(meta + 9)
    idx_at, idx_stride = tl.load(meta + 10), tl.load(meta + 11)
    listed = tl.load(meta + 16) != 0
    is_x = g == tl.load(meta + 17)  # (a listed step's cross group)
    lens_at = tl.where(is_x, R * (2 + G), kv_at)  # (its encoder lengths, for every read of kv below)
    xwidth = tl.load(meta + 19)
    slots = (buf + tl.load(meta + 15)).to(tl.pointer_type(tl.int64))
    # every read of src first, independent of each other: one round trip
    u = tl.arange(0, 2 * BLOCK_R)
    pos = tl.load(src + upd_at + u, mask=u < U, other=0)
    val = tl.load(src + upd_at + U + u, mask=u < U, other=0)
    mu = u < tl.minimum(tl.load(meta + 13), U)  # (a listed step's meta: U 0, no updates)
    r = tl.arange(0, BLOCK_R)
    kv = tl.load(src + lens_at + r, mask=r < R, other=0)
    at = tl.minimum(i, R - 1)  # (program (R, 0) reads request R - 1's: unused)
    row = tl.load(src + rows_at + at)  # (a listed step's: its cross row, if any)
    kv_i = tl.load(src + lens_at + at)
    fence_value = tl.load(src + fence_at)
    if i == R:
        if g == 0:
            tl.store(table + pos, val, mask=mu)
    else:
        need = (kv + ps - 1) // ps
        pages = table
        if is_x:  # a listed step's cross group: row `row` of the cross table
            lo = row.to(tl.int64) * xwidth
            pages = xtable
        elif listed:  # request i's list: past every page listed before it
            lo = idx_at.to(tl.int64) + tl.sum(tl.where(r < i, need, 0), 0).to(tl.int64)
        else:
            lo = row.to(tl.int64) * width
            p64 = pos.to(tl.int64)
            tl.store(table + pos, val, mask=mu & (p64 >= lo) & (p64 < lo + width))
            tl.debug_barrier()
        w = tl.load(meta + 20 + g)
        first = tl.where(w > 0, tl.maximum(kv - q_len - (w - 1), 0) // ps, 0)
        count = tl.where(r <= i, need - first, 0)  # requests 0..i: their pages end at this sum
        end = tl.sum(count, 0)
        need_i = (kv_i + ps - 1) // ps
        first_i = tl.where(w > 0, tl.maximum(kv_i - q_len - (w - 1), 0) // ps, 0)
        n = need_i - first_i
        ptr = buf + ptr_at + g * ptr_stride  # kv_indptr [R+1], last_page_len [R], kv_lens [R] follow each other
        tl.store(ptr + i + 1, end)
        tl.store(ptr + R + 1 + i, kv_i - (need_i - 1) * ps)
        tl.store(ptr + 2 * R + 1 + i, kv_i - first_i * ps)
        tl.store(buf + first_at + g * R + i, first_i)
        if i == 0:
            tl.store(ptr, 0)
        # the first block of the pages this program copies, read beside the slot mapping's page: one wait, not two
        src_row = pages + lo + first_i
        dst = buf + idx_at + g * idx_stride + end - n
        j = tl.arange(0, BLOCK_P)
        first_block = tl.load(src_row + j, mask=j < n)
        if g == 0:
            tl.store(buf + rows_at + i, row)  # (the device's copy of the head: other readers' table_rows)
            tl.store(buf + kv_at + i, kv_i)
            tl.store(buf + qo_at + i + 1, (i + 1) * q_len)
            if i == 0:
                tl.store(buf + qo_at, 0)
            t = tl.arange(0, BLOCK_Q)
            mt = t < q_len
            p = kv_i - q_len + t
            page = tl.load(table + lo + p // ps, mask=mt, other=0)
            tl.store(slots + i * q_len + t, page.to(tl.int64) * ps + p % ps, mask=mt)
        tl.store(dst + j, first_block, mask=j < n)
        for j0 in range(BLOCK_P, n, BLOCK_P):  # (the blocks past the first)
            j = j0 + tl.arange(0, BLOCK_P)
            m = j < n
            tl.store(dst + j, tl.load(src_row + j, mask=m), mask=m)
    # this program has read all it reads of src: the last one to get here writes the fence (and resets the count).
    # Release: the program's reads of src are ordered before its count, so the fence (written once every program has
    # counted) never tells the host to rewrite the staging while a read of it is in flight.
    tl.debug_barrier()  # (every thread of the program past its reads before the count)
    done = tl.atomic_add(counter, 1, sem="release")
    if done == (R + 1) * G - 1:
        tl.store(counter, 0)
        tl.store(fence, fence_value)

