"""The Triton kernels of capture/derive.py (imported only where Triton is installed): `scatter` applies
the staged page-table updates, `derive` runs one program per request and layer group. See derive.py
for the arrays and tests/capture/test_derive.py for their check against the torch ops."""

import triton
import triton.language as tl


@triton.jit
def scatter(table, buf, at, U, BLOCK: tl.constexpr):
    u = tl.arange(0, BLOCK)
    m = u < U
    pos = tl.load(buf + at + u, mask=m, other=0)
    val = tl.load(buf + at + U + u, mask=m, other=0)
    tl.store(table + pos, val, mask=m)

@triton.jit
def derive(buf, slots, table, windows, meta, BLOCK_R: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_P: tl.constexpr):
    """Program (i, g): request i's entries of layer group g. meta (int32, derive.META): R, q_len, page
    size, table width, then the offsets in buf of the rows, kv_lens, qo_indptr, group 0's kv_indptr
    (its last_page_len and kv_lens follow), the stride between groups' kv_indptr, group 0's
    first_page (groups R apart), group 0's indices and the stride between groups' indices."""
    i, g = tl.program_id(0), tl.program_id(1)
    R, q_len, ps, width = tl.load(meta + 0), tl.load(meta + 1), tl.load(meta + 2), tl.load(meta + 3)
    rows_at, kv_at, qo_at = tl.load(meta + 4), tl.load(meta + 5), tl.load(meta + 6)
    ptr_at, ptr_stride, first_at = tl.load(meta + 7), tl.load(meta + 8), tl.load(meta + 9)
    idx_at, idx_stride = tl.load(meta + 10), tl.load(meta + 11)
    w = tl.load(windows + g)
    r = tl.arange(0, BLOCK_R)
    kv = tl.load(buf + kv_at + r, mask=r < R, other=0)
    need = (kv + ps - 1) // ps
    first = tl.where(w > 0, tl.maximum(kv - q_len - (w - 1), 0) // ps, 0)
    count = tl.where(r <= i, need - first, 0)  # requests 0..i: their pages end at this sum
    end = tl.sum(count, 0)
    kv_i = tl.load(buf + kv_at + i)
    need_i = (kv_i + ps - 1) // ps
    first_i = tl.where(w > 0, tl.maximum(kv_i - q_len - (w - 1), 0) // ps, 0)
    n = need_i - first_i
    ptr = buf + ptr_at + g * ptr_stride  # kv_indptr [R+1], last_page_len [R], kv_lens [R] follow each other
    tl.store(ptr + i + 1, end)
    tl.store(ptr + R + 1 + i, kv_i - (need_i - 1) * ps)
    tl.store(ptr + 2 * R + 1 + i, kv_i - first_i * ps)
    tl.store(buf + first_at + g * R + i, first_i)
    row = tl.load(buf + rows_at + i).to(tl.int64)
    if i == 0:
        tl.store(ptr, 0)
    if g == 0:
        tl.store(buf + qo_at + i + 1, (i + 1) * q_len)
        if i == 0:
            tl.store(buf + qo_at, 0)
        t = tl.arange(0, BLOCK_Q)
        mt = t < q_len
        p = kv_i - q_len + t
        page = tl.load(table + row * width + p // ps, mask=mt, other=0)
        tl.store(slots + i * q_len + t, page.to(tl.int64) * ps + p % ps, mask=mt)
    src = table + row * width + first_i
    dst = buf + idx_at + g * idx_stride + end - n
    for j0 in range(0, n, BLOCK_P):
        j = j0 + tl.arange(0, BLOCK_P)
        m = j < n
        tl.store(dst + j, tl.load(src + j, mask=m), mask=m)
