"""The tree verify mask in FlashInfer's custom-mask layout (kernels/_tree_mask.py): the host builder read
bit by bit the way FlashInfer's kernel reads it (variants.cuh: byte (j * kv + c) / 8 of the request's
segment, bit (j * kv + c) % 8) against each token's ancestor set (DraftTree.visible), a flipped
ancestor bit caught; the Triton kernel equal to the host builder under Triton's interpreter on the CPU,
and on the GPU."""


import numpy as np
import pytest
import torch

from mstar_attn import DraftTree
from mstar_attn.kernels import _tree_mask
from mstar_attn.metadata.tree import MAX_TREE_NODES
from tests.helpers import fresh_seed
from tests.support.interpreted import run_interpreted
from tests.support.trees import random_parents


def random_step(seed: int, requests: int = 6, max_prefix: int = 90) -> tuple[DraftTree, np.ndarray, np.ndarray]:
    """Random trees (chains, stars, random; a one-token tree and a 64-token one among them) and prefixes
    (0 included): the tree, q_lens [R], kv_lens [R]."""
    rng = np.random.default_rng(seed)
    sizes = [1, MAX_TREE_NODES] + [int(rng.integers(1, MAX_TREE_NODES + 1)) for _ in range(requests - 2)]
    shapes = rng.choice(["chain", "star", "random"], requests)
    tree = DraftTree.from_parents([random_parents(rng, n, str(s)) for n, s in zip(sizes, shapes)])
    prefix = rng.integers(0, max_prefix + 1, requests)
    prefix[0] = 0
    q = tree.sizes.astype(np.int32)
    return tree, q, (prefix + q).astype(np.int32)


def read_bit(packed: np.ndarray, starts: np.ndarray, r: int, j: int, c: int, kv: int) -> bool:
    """Bit (j, c) of request r as FlashInfer's kernel reads it."""
    off = j * kv + c
    return bool((int(packed[starts[r] + off // 8]) >> (off % 8)) & 1)


def test_the_host_mask_read_as_flashinfer_reads_it_is_each_tokens_prefix_and_ancestors():
    seed = fresh_seed()
    tree, q, kv = random_step(seed)
    packed = _tree_mask.host_mask(q, kv, tree.masks)
    starts = _tree_mask.byte_indptr(q, kv)
    assert packed.dtype == np.uint8 and packed.shape[0] == starts[-1], seed
    flat = _tree_mask.host_mask(q, kv, tree.masks, packed=False)
    assert flat.shape[0] == int((q.astype(np.int64) * kv).sum()), seed
    bit0 = 0
    for r in range(q.shape[0]):
        vis, prefix = tree.visible(r), kv[r] - q[r]
        want = np.concatenate([np.ones((q[r], prefix), bool), vis], axis=1)
        got = np.array([[read_bit(packed, starts, r, j, c, kv[r]) for c in range(kv[r])] for j in range(q[r])])
        assert np.array_equal(got, want), (seed, f"request {r}")
        assert np.array_equal(flat[bit0 : bit0 + q[r] * kv[r]].reshape(q[r], kv[r]), want), (seed, f"request {r}")
        assert starts[r + 1] - starts[r] == -(-int(q[r] * kv[r]) // 8), (seed, r)
        bit0 += int(q[r] * kv[r])


def test_one_flipped_ancestor_bit_changes_that_tokens_row_alone():
    """Negative control: token j of one request loses an ancestor; the mask differs at that one key."""
    seed = fresh_seed()
    tree, q, kv = random_step(seed)
    r = int(np.flatnonzero(q > 1)[0])
    t0 = int(q[:r].sum())
    bits = tree.masks.copy()
    j = int(q[r]) - 1
    i = int(np.flatnonzero(tree.visible(r)[j][:j])[0])  # (an ancestor of j other than itself: the root at least)
    bits[t0 + j] ^= np.uint64(1 << i)
    a = _tree_mask.host_mask(q, kv, tree.masks, packed=False)
    b = _tree_mask.host_mask(q, kv, bits, packed=False)
    at = int((q[:r].astype(np.int64) * kv[:r]).sum()) + j * int(kv[r]) + int(kv[r] - q[r]) + i
    assert np.flatnonzero(a != b).tolist() == [at], seed


_INTERPRETED = """
import sys, numpy as np, torch
sys.path.insert(0, {root!r})
from mstar_attn.kernels import _tree_mask
from tests.kernels.test_tree_mask import device_mask, random_step
for i in range(3):
    tree, q, kv = random_step({seed} + i, requests=4, max_prefix=40)
    for packed in (True, False):
        got = device_mask(tree, q, kv, "cpu", packed)
        want = _tree_mask.host_mask(q, kv, tree.masks, packed)
        assert np.array_equal(got, want), ({seed} + i, packed, np.flatnonzero(got != want)[:8])
    from mstar_attn.kernels._flashinfer_tree import mask_offsets  # (the tree part's: kv = q, sparse offsets)
    off = mask_offsets(q)
    got = device_mask(tree, q, q, "cpu", True, off)
    assert np.array_equal(got, _tree_mask.host_mask(q, q, tree.masks, offsets=off)), ({seed} + i, "tree part")
print("ok")
"""


def device_mask(tree: DraftTree, q: np.ndarray, kv: np.ndarray, device: str, packed: bool,
                offsets: np.ndarray | None = None) -> np.ndarray:
    """The Triton kernel's mask on `device` (the CPU: under the interpreter), as numpy, exactly segments[-1]
    long (the output buffer is longer and filled with a canary that must survive past the end); offsets:
    where each request's packed segment starts (default: byte_indptr)."""
    qo = np.concatenate([[0], np.cumsum(q)]).astype(np.int32)
    if offsets is not None:
        seg = offsets.astype(np.int32)
    elif packed:
        seg = _tree_mask.byte_indptr(q, kv)
    else:
        seg = np.concatenate([[0], np.cumsum(q.astype(np.int64) * kv)]).astype(np.int32)
    lens = np.diff(seg)
    n = int(seg[-1])
    out = torch.full((n + 64,), 0xA5 if packed else 1, dtype=torch.uint8 if packed else torch.bool, device=device)
    t = {name: torch.from_numpy(a).to(device) for name, a in (("qo", qo), ("kv", kv.astype(np.int32)), ("seg", seg))}
    bits = torch.from_numpy(tree.masks.view(np.int64).copy()).to(device)
    _tree_mask.pack(t["qo"], t["kv"], t["seg"], bits, out, int(lens.max()), packed)
    got = out.cpu().numpy()
    assert (got[n:] == (0xA5 if packed else 1)).all(), "the kernel wrote past the mask"
    return got[:n]


def test_the_triton_kernel_equals_the_host_mask_under_the_interpreter():
    pytest.importorskip("triton")
    run_interpreted(_INTERPRETED, fresh_seed())


@pytest.mark.gpu
def test_the_triton_kernel_equals_the_host_mask_on_the_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from mstar_attn.kernels._flashinfer_tree import mask_offsets

    seed = fresh_seed()
    for i in range(4):
        tree, q, kv = random_step(seed + i, requests=16, max_prefix=3000)
        for packed in (True, False):
            got = device_mask(tree, q, kv, "cuda", packed)
            assert np.array_equal(got, _tree_mask.host_mask(q, kv, tree.masks, packed)), (seed + i, packed)
        off = mask_offsets(q)
        got = device_mask(tree, q, q, "cuda", True, off)
        assert np.array_equal(got, _tree_mask.host_mask(q, q, tree.masks, offsets=off)), (seed + i, "tree part")


def test_the_tree_parts_mask_sits_where_flashinfer_reads_it():
    """The mask of a tree step's tree part (kernels/_flashinfer_tree.py: keys = the request's own new tokens, no
    prefix): request r's q x q ancestor matrix from byte mask_offsets(q)[r] = sum_{i<r} q_i^2, the bit count
    FlashInfer's planner computes as its mask offset (cumsum of q x kv, kv = q) and its kernel reads as a byte
    offset. Read that way, each token's row is its ancestor set, and the bytes up to the next request are zero;
    a flipped ancestor bit shows at its one bit."""
    from mstar_attn.kernels._flashinfer_tree import mask_offsets

    seed = fresh_seed()
    tree, q, _ = random_step(seed)
    offsets = mask_offsets(q)
    assert np.array_equal(offsets, np.concatenate([[0], np.cumsum(q.astype(np.int64) * q)])), seed  # (FlashInfer's formula)
    packed = _tree_mask.host_mask(q, q, tree.masks, offsets=offsets)
    assert packed.shape[0] == offsets[-1], seed
    for r in range(q.shape[0]):
        got = np.array([[read_bit(packed, offsets, r, j, c, q[r]) for c in range(q[r])] for j in range(q[r])])
        assert np.array_equal(got, tree.visible(r)), (seed, f"request {r}")
        used = -(-int(q[r]) ** 2 // 8)
        assert not packed[offsets[r] + used : offsets[r + 1]].any(), (seed, f"request {r}: bytes past its segment")
    bits = tree.masks.copy()
    r = int(np.flatnonzero(q > 1)[0])
    bits[int(q[:r].sum()) + 1] ^= np.uint64(1)  # (token 1 of request r loses the root)
    diff = np.flatnonzero(_tree_mask.host_mask(q, q, bits, offsets=offsets) != packed)
    assert diff.tolist() == [offsets[r] + int(q[r]) // 8], seed


def test_the_prefix_pass_reads_each_prefix_alone():
    """prefix_requests (kernels/_flashinfer_tree.py): a tree step's requests (random prefixes, 0 and page-aligned
    ones among them, trees of 1..64 tokens, page 16) as the prefix pass's: a CSR over the same page indices;
    request 2r reads r's first pages, exactly its prefix (FlashInfer's length: (pages - 1) x page_size + last,
    0 for no pages; the planned length the same), with r's queries; request 2r + 1 no queries, r's other pages.
    The data holds the case this layout exists for: lists with pages past the prefix (which FlashInfer's planner,
    given the step's own lists, would split into chunks past the prefix)."""
    from mstar_attn.kernels._flashinfer_tree import prefix_requests

    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    ps, R = 16, 12
    q = rng.integers(1, 65, R)
    p = rng.choice([0, 1, 16, 32, 100, 2047], R) + rng.integers(0, 2, R) * rng.integers(0, 3000, R)
    kv = p + q
    pages = -(-kv // ps) + rng.integers(0, 3, R)  # (lists may hold spare pages past kv_len)
    qo, ind = np.concatenate([[0], np.cumsum(q)]), np.concatenate([[0], np.cumsum(pages)])
    pr = prefix_requests(qo.astype(np.int32), ind.astype(np.int32), kv.astype(np.int32), ps)
    assert all(x.dtype == np.int32 for x in (pr.qo_indptr, pr.kv_indptr, pr.last_page_len, pr.kv_lens)), seed
    assert (np.diff(pr.kv_indptr) >= 0).all() and pr.kv_indptr[0] == 0 and pr.kv_indptr[-1] == ind[-1], seed
    assert np.array_equal(pr.qo_indptr[0::2], qo) and (np.diff(pr.qo_indptr)[1::2] == 0).all(), seed
    n = np.diff(pr.kv_indptr)
    length = np.where(n > 0, (n - 1) * ps + pr.last_page_len, 0)
    assert np.array_equal(length[0::2], p) and np.array_equal(pr.kv_lens[0::2], p), (seed, length[0::2], p)
    assert np.array_equal(pr.kv_indptr[0::2], ind), seed  # (each prefix starts at its request's first page)
    assert ((pr.last_page_len[0::2] >= 1) & (pr.last_page_len[0::2] <= ps) | (n[0::2] == 0)).all(), seed
    assert np.array_equal(pr.kv_lens[1::2], n[1::2] * ps) and (n[0::2] == -(-p // ps)).all(), seed
    own = np.diff(ind)
    assert (own > -(-p // ps)).any(), seed


def test_a_graph_prefix_splits_kv_only_where_its_partial_outputs_fit():
    """split_fits (kernels/_flashinfer_tree.py): FlashInfer's planner keeps partial outputs of num_qo_heads x
    padded CTAs x cta_tile_q / gqa rows; a Llama-like bucket of 8 x 16 tokens fits the pool's 128 MiB float
    workspace, the bound grows with the requests (2 per request in the prefix pass), and a wide-GQA bucket
    (64 query heads on 1 KV head, 250 requests of 16 tokens) does not fit: split-KV off."""
    from mstar_attn import AttentionSpec
    from mstar_attn.kernels._flashinfer_tree import split_fits

    ws = 128 << 20
    llama = AttentionSpec(32, 8, 128, 16, 1000)
    assert split_fits(llama, 8, 8 * 16, 132, ws)
    wide = AttentionSpec(64, 1, 128, 16, 1000)
    assert split_fits(wide, 8, 8 * 16, 132, ws) and not split_fits(wide, 250, 250 * 16, 132, ws)
    need = lambda R: next(b for b in range(1 << 20, 1 << 34, 1 << 20) if split_fits(llama, R, R * 16, 132, b))  # noqa: E731
    assert need(8) <= need(64) <= need(256), (need(8), need(64), need(256))
