"""Every GPU paged backend (FlashInfer, FlashAttention-4) through the same scenarios, eager and replayed,
against the reference per request: every mode over each backend's kernel combos, decode and verify
replays, a 200-step walk, no device sync on the step path, page-table steps, own page lists, draft
rounds and cross attention. The scenarios and each backend's combos: tests/support/paged_backends.py;
what only one backend has stays in its own file (test_flashinfer.py, test_flash_attn.py)."""

import pytest

from tests.helpers import fresh_seed
from tests.support.paged_scenarios import check_modes, check_replay, many_steps, no_sync_on_the_step_path, steady_steps, table_steps
from tests.support.paged_backends import BACKENDS, params

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name, combo, q_lens, kv_lens, mode", params("modes", lambda b: b.mode_cases))
def test_every_mode_matches_the_reference(name, combo, q_lens, kv_lens, mode):
    b = BACKENDS[name]
    check_modes(b.load(), b.gpu_step, b.combos[combo], q_lens, kv_lens, mode, fresh_seed())


@pytest.mark.parametrize("name, combo", params("replay", lambda b: list(b.combos)))
def test_decode_and_verify_replay_equal_eager(name, combo):
    b = BACKENDS[name]
    check_replay(b.load(), b.gpu_step, b.combos[combo], fresh_seed())


@pytest.mark.parametrize("name", list(BACKENDS))
def test_hundreds_of_steps_eager_and_replayed(name):
    """Changing batch sizes (across buckets and past the largest), lengths and pages, 200 steps:
    decode and verify (q_len 4, captured) replayed, other modes eager."""
    b = BACKENDS[name]
    many_steps(b.load().run, name, fresh_seed(), **b.walk)


@pytest.mark.parametrize("name", list(BACKENDS))
def test_no_device_sync_on_the_step_path(name):
    b = BACKENDS[name]
    no_sync_on_the_step_path(b.load(), b.gpu_step, fresh_seed())


@pytest.mark.parametrize("name", params("table", lambda b: [()]))
def test_page_table_steps_eager_and_replayed(name):
    """StepRows steps over the pool's page table (pages gathered on the device, one graph per bucket;
    FA4's page tables gathered from it, window groups shifted by their first page), arrivals, growth,
    departures and a shared prefix, against the reference per request. FlashInfer's bucket 128 x 8 KV
    heads is past its fixed-schedule threshold on an H100 (4 x 132 CTAs): planned once on scratch
    steps at capture, then replayed over thousands of tokens."""
    module, seed = BACKENDS[name].load(), fresh_seed()
    counts = table_steps(module.run, module.write_kv, name, seed)
    assert counts.get(128, 0) >= 3 and counts.get(None, 0) >= 2, (seed, counts)


@pytest.mark.parametrize("name", params("table", lambda b: [()]))
def test_steady_decode_steps_replayed(name):
    """Decode walks over fixed rows committed with defer=True (steady commits where the lengths stay in their
    slot's ranges: capture/steady.py), replayed, a full and a window group, per request against the reference;
    the 100-request walk appends a page whenever a request starts one, and its steps stay steady."""
    module, seed = BACKENDS[name].load(), fresh_seed()
    steady = steady_steps(module.run, module.write_kv, name, seed)
    assert sum(steady.values()) >= 20 and steady[100] >= 20, (seed, steady)


@pytest.mark.parametrize("name", params("table", lambda b: [()]))
def test_steady_listed_decode_steps_replayed(name):
    """The same walks given as StepBatch steps listing exactly their pages (derived on the device from the staged
    lists: capture/derive.py), per request against the reference; FlashInfer's are steady commits where the lengths
    stay in their slot's ranges (FA4's tables come from each step's lists: never steady)."""
    module, seed = BACKENDS[name].load(), fresh_seed()
    steady = steady_steps(module.run, module.write_kv, name, seed, lists=True)
    if name == "flashinfer":
        assert sum(steady.values()) >= 20 and steady[100] >= 20, (seed, steady)


@pytest.mark.parametrize("name", list(BACKENDS))
def test_own_page_lists_eager_and_replayed(name):
    """A hybrid model's window group on its own page list (passed pages given back and reused by
    later requests): prompts shorter than, equal to and far past the window, decode and verify
    replayed, prefill and mixed eager, both groups per request against the exact attention."""
    from tests.support.group_pages import gpu_hybrid

    gpu_hybrid(BACKENDS[name].load(), name, fresh_seed())


@pytest.mark.parametrize("name, page_size, sinks", params("rounds", lambda b: [(1, False), (16, False), (64, False), (16, True)]))
def test_draft_rounds_eager_and_replayed(name, page_size, sinks):
    """Speculative draft rounds of K = 1..8 steps (planned and committed once, captured as one graph
    per round), a full and a window group (with attention sinks in one case): every step of every
    request against the exact attention; rejected drafts' K/V (overwritten with large values) never read."""
    from tests.support.draft_rounds import gpu_rounds

    ran = gpu_rounds(BACKENDS[name].load(), name, fresh_seed(), page_size, sinks=sinks)
    assert any(replayed for _, replayed in ran) and any(not replayed for _, replayed in ran), ran


@pytest.mark.parametrize("name, page_size, rows", params("cross", lambda b: [(1, True), (16, False), (64, True)]))
def test_cross_attention_eager_and_replayed(name, page_size, rows):
    """Encoder-decoder cross attention: encoder K/V (1 to 3,000 tokens) stored once, read by every
    decoder step, decode replayed, every request of both groups against the exact attention."""
    from tests.support.cross_pages import gpu_cross

    gpu_cross(BACKENDS[name].load(), name, fresh_seed(), page_size, rows)
