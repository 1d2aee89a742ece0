"""The device-memory cache's two variants -- real memory (the engine's, on CPU storages) and
none (the dry run's, on meta storages) -- fed the same attach / detach / fits sequence of
several sizes under a small budget, agree after every step: what fits, the budget held, the
bytes cached, which blocks are kept (the eviction choices), hits, misses and the peak in use.

Why: the dry run's device peaks must equal the engine's (DESIGN.md "One plan, one assembly").
The policy is one class (storage/device_cache.py ``DeviceMemoryCache``); what differs is the
memory strategy, so this guards the strategies: one that mis-sizes a storage, keeps a block the
other drops, or takes memory back incompletely shows here as a diverging step."""
from __future__ import annotations

import random

import torch

from infinity.base.budget import MemoryBudget
from infinity.storage.device_cache import DeviceMemoryCache, NoMemory

PAGE = 4096
SIZES = (PAGE, 2 * PAGE, 3 * PAGE, 5 * PAGE)
LIMIT = 12 * PAGE


def real_cache() -> tuple[DeviceMemoryCache, torch.device]:
    cpu = torch.device("cpu")
    cache = DeviceMemoryCache(MemoryBudget("device", LIMIT), cpu)
    assert cache.enabled
    return cache, cpu


def byte_free_cache() -> tuple[DeviceMemoryCache, torch.device]:
    meta = torch.device("meta")
    cache = DeviceMemoryCache(MemoryBudget("device", LIMIT), meta, memory=NoMemory(keeps=True))
    assert cache.enabled
    return cache, meta


def kept(cache: DeviceMemoryCache) -> dict[int, int]:
    """Blocks kept, by size (which ones eviction left)."""
    return {size: len(blocks) for size, blocks in sorted(cache._free.items()) if blocks}


def run(make, steps: int, seed: int) -> list[tuple]:
    """The same seeded sequence on one variant; a row of observations per step."""
    cache, device = make()
    rng = random.Random(seed)
    held: list[tuple[torch.UntypedStorage, int]] = []
    rows = []
    for step in range(steps):
        if held and (rng.random() < 0.45 or len(held) >= 4):
            storage, nbytes = held.pop(rng.randrange(len(held)))
            cache.detach(storage)
            op = ("detach", nbytes, storage.nbytes())
        else:
            nbytes = rng.choice(SIZES)
            storage = torch.empty(0, dtype=torch.uint8, device=device).untyped_storage()
            fits = cache.fits(nbytes)
            attached = cache.try_attach(storage, nbytes, f"step {step}")
            if attached:
                held.append((storage, nbytes))
            op = ("attach", nbytes, fits, attached, storage.nbytes())
        rows.append((op, cache.budget.held, cache.cached_bytes, cache.in_use_bytes(),
                     kept(cache), cache.hits, cache.misses, cache.peak_in_use))
    for storage, _ in held:
        cache.detach(storage)
    rows.append(("end", cache.budget.held, cache.cached_bytes, kept(cache)))
    cache.clear()
    rows.append(("clear", cache.budget.held, cache.cached_bytes, kept(cache)))
    return rows


def test_both_variants_make_the_same_choices_step_by_step() -> None:
    for seed in range(4):
        real, free = run(real_cache, 120, seed), run(byte_free_cache, 120, seed)
        for i, (a, b) in enumerate(zip(real, free)):
            assert a == b, f"seed {seed}, step {i}: real {a} != byte-free {b}"
        assert len(real) == len(free)
        # the sequence did exercise the policy: hits, misses, evictions, refusals
        rows = [r for r in real if r[0][0] == "attach"]
        assert any(not r[0][3] for r in rows), "no attach was refused"
        assert rows[-1][5] and rows[-1][6], "no hit or no miss"
    assert real[-1][1:] == (0, 0, {})


def test_disabled_variants_reserve_and_release_alike() -> None:
    """Off (a GPU's device: the caching allocator keeps memory outside the budget), both
    resize the storage and count only fetched bytes; nothing is cached."""
    for cache, device in (
            (DeviceMemoryCache(MemoryBudget("device", LIMIT), torch.device("meta")),
             torch.device("meta")),
            (DeviceMemoryCache(MemoryBudget("device", LIMIT), torch.device("meta"),
                               memory=NoMemory(keeps=False)), torch.device("meta"))):
        assert not cache.enabled and not cache.warm(PAGE, "next")
        storage = torch.empty(0, dtype=torch.uint8, device=device).untyped_storage()
        cache.attach(storage, 2 * PAGE, "unit")
        assert storage.nbytes() == 2 * PAGE and cache.budget.held == 2 * PAGE
        assert cache.peak_in_use == 2 * PAGE
        cache.detach(storage)
        assert storage.nbytes() == 0 and cache.budget.held == 0 and cache.cached_bytes == 0


def test_the_byte_free_variant_never_warms() -> None:
    """No memory to populate ahead: ``warm`` is False and changes nothing (the dry run's
    attach then takes the miss path, as the engine's does when a warm did not happen)."""
    cache, _ = byte_free_cache()
    assert cache.warm(PAGE, "next") is False
    assert cache.budget.held == 0 and cache.cached_bytes == 0 and kept(cache) == {}
