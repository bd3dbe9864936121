/* The compiled step builder: per-step checks of the planner and the pool in one C call each, the twins of Python
 * functions that stay (native.py builds and loads this file; plain C, no Python headers, called through ctypes).
 * Each is tested equal to its Python twin in tests/metadata/test_native.py.
 *
 * mstar_exact_lists (twin: metadata/listed.py's twin_exact_lists): the checks of a StepBatch decode step that lists
 * exactly its pages, in one pass per array.
 *   array      a C-contiguous numpy int32 [3B + 1 + n]: q_lens [B], kv_lens [B], page_indptr [B + 1], page_indices [n],
 *              back to back (a from_csr batch's one read-only array: StepBatch.packed)
 *   ps         tokens per page (>= 1); num_pages: page ids allowed are 0 .. num_pages - 1 (>= 1)
 *   ownership  nonzero: also every written page (each request's last listed page) distinct and listed once in all
 * Returns the longest kv_len (>= 1) when every check passes: each q_len 1, each kv_len >= 1, the longest at most
 * INT32_MAX - ps and B * (longest / ps + 1) within int32 (every page count sum fits), page_indptr[0] == 0 and
 * page_indptr[i + 1] - page_indptr[i] == ceil(kv_lens[i] / ps), page_indptr[B] <= n, every listed page id in
 * range, and ownership if asked. 0 when a check fails (the Python planner then names it). -1 when it cannot tell
 * (its bit table past MAX_TABLE_BYTES, out of memory, arguments outside what the planner sends): the Python twin
 * decides. */

#include <stdint.h>
#include <stdlib.h>

/* The planner passes each array as its numpy object (ctypes.py_object: no address to compute in Python, which costs
 * more than the call): its data pointer is the first field after the object header (numpy's PyArray_DATA, a
 * PyArrayObject's `data`). native.py checks this against numpy's own address for several arrays at load and uses
 * none of these functions where it does not hold. */
#define DATA_OF(array) (*(const int32_t *const *)((const char *)(array) + 2 * sizeof(void *)))

const void *mstar_data_of(const void *array) { return DATA_OF(array); }

#define INT32_MAX_ 2147483647LL
#define MAX_TABLE_BYTES (1 << 20) /* a bit per page id: pools of up to 8M pages */

static const uint8_t BIT[8] = {1, 2, 4, 8, 16, 32, 64, 128};

int64_t mstar_exact_lists(const void *array, int64_t B, int64_t n, int64_t ps, int64_t num_pages, int32_t ownership) {
    const int32_t *packed = DATA_OF(array), *q = packed, *kv = packed + B, *indptr = packed + 2 * B;
    const int32_t *idx = packed + 3 * B + 1;
    int64_t hi = 0, end = 0, hits = 0, b, j;
    if (B < 1 || ps < 1 || num_pages < 1 || num_pages > INT32_MAX_)
        return -1; /* (not a step the planner sends here) */
    for (b = 0; b < B; b++) {
        int64_t k = kv[b];
        if (q[b] != 1 || k < 1)
            return 0;
        hi = k > hi ? k : hi;
    }
    if (hi > INT32_MAX_ - ps || B * (hi / ps + 1) > INT32_MAX_ || indptr[0] != 0)
        return 0;
    for (b = 0; b < B; b++) {
        end += (kv[b] + ps - 1) / ps;
        if (indptr[b + 1] != end)
            return 0;
    }
    if (end > n)
        return 0;
    uint32_t limit = (uint32_t)num_pages, outside = 0; /* (a negative id is a large uint32: outside too) */
    for (j = 0; j < end; j++)
        outside |= (uint32_t)idx[j] >= limit;
    if (outside)
        return 0;
    if (!ownership)
        return hi;
    size_t bytes = ((size_t)num_pages + 7) / 8;
    if (bytes > MAX_TABLE_BYTES)
        return -1;
    uint8_t *written = calloc(bytes, 1);
    if (!written)
        return -1;
    int64_t result = hi;
    for (b = 0; b < B; b++) { /* each request's last page: the page its new token goes to */
        uint32_t p = (uint32_t)idx[indptr[b + 1] - 1];
        if (written[p >> 3] & BIT[p & 7])
            result = 0; /* two requests write one page */
        written[p >> 3] |= BIT[p & 7];
    }
    for (j = 0; j < end; j++) {
        uint32_t p = (uint32_t)idx[j];
        hits += (written[p >> 3] & BIT[p & 7]) != 0;
    }
    free(written);
    return hits == B ? result : 0; /* (more: another request lists a written page, or its writer twice) */
}

/* mstar_rows_decode (twin: metadata/plan.py's _plan_rows_decode checks): a StepRows decode step's lengths and rows.
 *   array   a C-contiguous numpy int32 [2B]: rows [B], kv_lens [B], back to back (StepRows.packed of a
 *           StepRows.decode step)
 * Returns the longest kv_len when every kv_len >= 1, every row >= 0, the longest at most INT32_MAX - ps and
 * B * (longest / ps + 1) within int32; else 0 (the Python planner names what is wrong). */
int64_t mstar_rows_decode(const void *array, int64_t B, int64_t ps) {
    const int32_t *rows = DATA_OF(array), *kv = rows + B;
    int64_t hi = 0, b;
    int32_t lo = 1, row = 0;
    if (B < 1 || ps < 1)
        return 0;
    for (b = 0; b < B; b++) {
        lo = kv[b] < lo ? kv[b] : lo;
        row = rows[b] < row ? rows[b] : row;
        hi = kv[b] > hi ? kv[b] : hi;
    }
    if (lo < 1 || row < 0 || hi > INT32_MAX_ - ps || B * (hi / ps + 1) > INT32_MAX_)
        return 0;
    return hi;
}

/* mstar_within (twin: metadata/_arrays.py's within, for Ranges.holds): whether low[i] <= values[i] < low[i] + span[i]
 * for every i < B, as one wrapping int32 subtraction and one unsigned comparison each. values, low: C-contiguous numpy
 * int32 [B]; span: C-contiguous numpy uint32 [B]. */
int32_t mstar_within(const void *values, const void *low, const void *span, int64_t B) {
    const uint32_t *v = (const uint32_t *)DATA_OF(values), *lo = (const uint32_t *)DATA_OF(low);
    const uint32_t *n = (const uint32_t *)DATA_OF(span);
    uint32_t out = 0;
    for (int64_t b = 0; b < B; b++)
        out |= (v[b] - lo[b]) >= n[b];
    return !out;
}
