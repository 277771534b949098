import random

import pytest

from freetoken_jax.memory.kv_pages import OutOfPages, PageAllocator


def test_allocator_against_a_set_model():
    rng = random.Random(0)
    alloc = PageAllocator(num_pages=40, page_size=4)
    held: list[list[int]] = []
    free = set(range(1, 40))
    for _ in range(500):
        if held and rng.random() < 0.5:
            pages = held.pop(rng.randrange(len(held)))
            alloc.release(pages)
            free |= set(pages)
        else:
            tokens = rng.randint(1, 30)
            need = -(-tokens // 4)
            if need > len(free):
                with pytest.raises(OutOfPages):
                    alloc.allocate(tokens)
                continue
            pages = alloc.allocate(tokens)
            assert len(pages) == need and set(pages) <= free and 0 not in pages
            free -= set(pages)
            held.append(pages)
        assert alloc.free_pages == len(free)


def test_release_of_foreign_pages_is_refused():
    alloc = PageAllocator(8, 4)
    with pytest.raises(ValueError):
        alloc.release([0])
    with pytest.raises(ValueError):
        alloc.release([8])
