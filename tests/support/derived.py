"""The derivation of a committed slot made again, outside the pool (capture/derive.py): a slot's buffer with every
derived array overwritten and derived anew by the Triton kernel or the torch ops (`derive_again`), held to the
committed slot (`check_again`); the reads the kernel takes (`copy_reads`) and the interpreter's kernel module on the
CPU (`interpreted_kernel`). Shared by tests/capture/test_derive*.py."""

import os

import attrs
import pytest
import torch

from mstar_attn.capture import derive
from mstar_attn.capture.layout import slot_views


def copy_reads(monkeypatch, copy_first: bool) -> None:
    """Derivations made from now on read the head's device copy at every size (copy_first; the copy kernel in blocks of
    16 elements, so over several programs) or the pinned staging at every size."""
    monkeypatch.setattr(derive, "COPY_FIRST", 0 if copy_first else 1 << 30)
    if copy_first and derive.triton_kernel() is not None:
        from mstar_attn.capture import _derive_triton

        monkeypatch.setattr(_derive_triton, "BLOCK_HEAD", 16)


def derive_again(pool, step, kernel, device: str):
    """The committed (CPU) step's slot buffer copied to `device` with every derived array overwritten
    (-7), then derived again by `kernel` (Triton's, from the slot's staging, its head's rows and kv_lens
    overwritten too; or None: the torch ops); returns (buffer, offsets)."""
    R, N = step.padded_batch_size, step.padded_num_tokens
    offsets = slot_views(pool.layout, pool.dev[step.slot], pool.host[step.slot], R, N).offsets
    buf = pool.dev[step.slot].clone().to(device)
    for o in offsets.groups:
        for a, n in ((o.kv_indptr, R + 1), (o.last_page_len, R), (o.kv_lens, R), (o.first_page, R),
                     (o.indices, pool.layout.index_capacity)):
            buf[a : a + n] = -7
    buf[offsets.qo : offsets.qo + R + 1] = -7
    buf[offsets.slots : offsets.slots + 2 * N] = -7
    d, listed = pool.derivation, step.plan.rows is None  # (listed: a StepBatch decode step, from its staged lists)
    cross = None if d.cross is None else attrs.evolve(d.cross, table=d.cross.table.to(device))
    again = derive.Derivation(d.table.to(device), d.width, pool.spec.groups, pool.spec.page_size, d.capacity, kernel,
                              cross=cross)
    if kernel is None and listed:  # (the torch ops read the lists the work copied into group 0's index region)
        i0 = offsets.groups[0].indices
        buf[i0 : i0 + d.capacity] = pool.host[step.slot][i0 : i0 + d.capacity].to(device)
        derive.derive_listed(buf, offsets, step.q_len, again)
    elif kernel is None:
        derive.derive_rows(buf, offsets, step.q_len, again)
    else:
        buf[offsets.table_rows : offsets.table_rows + R] = -7
        buf[offsets.kv_lens : offsets.kv_lens + R] = -7
        derive.derive_staged(buf, staging_on(pool.host[step.slot], device), offsets, step.q_len, again, None, step.slot,
                             listed)
    return buf, offsets


def check_again(pool, step, buf: torch.Tensor, offsets, seed: int) -> None:
    """derive_again's buffer (on any device) against the committed step's slot (the torch ops, CPU): the head from
    the first pages on (a StepRows step: from its rows), every derived array and each group's used indices."""
    s, R, buf = step.slot, step.padded_batch_size, buf.cpu()
    start = 0 if step.plan.rows is not None else R  # (a listed step has no rows: the kernel leaves them)
    assert torch.equal(buf[start : offsets.updates], pool.dev[s][start : offsets.updates]), f"seed {seed}"
    assert torch.equal(buf[offsets.qo : offsets.head_end], pool.dev[s][offsets.qo : offsets.head_end]), f"seed {seed}"
    for dg, o in zip(step.groups, offsets.groups):
        n = int(dg.kv_indptr[-1])
        assert torch.equal(buf[o.indices : o.indices + n], dg.kv_indices[:n]), f"seed {seed}"


def staging_on(host: torch.Tensor, device: str) -> torch.Tensor:
    """A copy of a CPU pool slot's staging where `device`'s kernel reads it: pinned for CUDA."""
    return host.clone().pin_memory() if device == "cuda" else host.clone()


def interpreted_kernel(monkeypatch, copy_first: bool):
    """capture/_derive_triton.py under Triton's interpreter (tests/conftest.py chose it before Triton was imported;
    the test skips without Triton), its derivations reading as copy_reads says."""
    pytest.importorskip("triton")
    copy_reads(monkeypatch, copy_first)
    assert os.environ.get("TRITON_INTERPRET") == "1", "tests/conftest.py picks the interpreter before Triton is imported"
    from mstar_attn.capture import _derive_triton

    return _derive_triton
