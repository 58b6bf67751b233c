import numpy as np
import pytest

from radixserve.scheduler.allocator import PageAllocator, PageAllocatorError


def test_alloc_all_or_nothing():
    a = PageAllocator(8, page_size=4)
    assert (a.num_pages, a.page_size, a.num_free) == (8, 4, 8)
    ids = a.alloc(5)
    assert ids.dtype == np.int32 and ids.tolist() == [0, 1, 2, 3, 4]
    assert a.alloc(4) is None  # only 3 left: nothing is taken
    assert a.num_free == 3
    assert a.alloc(3).tolist() == [5, 6, 7]
    assert a.alloc(1) is None
    assert a.alloc(0).size == 0


def test_free_and_reuse():
    a = PageAllocator(4)
    ids = a.alloc(4)
    a.free(ids[[1, 3]])
    assert a.num_free == 2
    again = a.alloc(2)
    assert sorted(again.tolist()) == [1, 3]
    a.free([])  # a no-op
    assert a.num_free == 0


@pytest.mark.parametrize(
    "bad, match",
    [([7], "out of range"), ([-1], "out of range"), ([2], "never-allocated"), ([0, 0], "twice")],
)
@pytest.mark.parametrize("as_int32", [False, True])  # int32 arrays take the native path
def test_bad_free_raises_and_changes_nothing(bad, match, as_int32):
    a = PageAllocator(4)
    a.alloc(2)  # pages 0, 1
    before = (a.num_free, a.is_allocated([0, 1, 2, 3]).tolist())
    with pytest.raises(PageAllocatorError, match=match):
        a.free(np.array(bad, dtype=np.int32) if as_int32 else bad)
    assert (a.num_free, a.is_allocated([0, 1, 2, 3]).tolist()) == before


def test_double_free_raises():
    a = PageAllocator(4)
    ids = a.alloc(2)
    a.free(ids)
    with pytest.raises(PageAllocatorError, match="double free"):
        a.free(ids[:1])
    assert a.num_free == 4


def test_random_alloc_free_conserves_pages():
    rng = np.random.default_rng(0)
    a = PageAllocator(64)
    held: list[np.ndarray] = []
    for _ in range(2000):
        if held and rng.random() < 0.5:
            a.free(held.pop(rng.integers(len(held))))
        else:
            ids = a.alloc(int(rng.integers(0, 9)))
            if ids is not None:
                held.append(ids)
        owned = np.concatenate(held) if held else np.zeros(0, np.int32)
        assert np.unique(owned).size == owned.size
        assert a.num_free + owned.size == 64


def test_invalid_construction():
    with pytest.raises(ValueError):
        PageAllocator(0)
    with pytest.raises(ValueError):
        PageAllocator(4, page_size=0)
    with pytest.raises(PageAllocatorError):
        PageAllocator(4).alloc(-1)


def test_int32_and_list_frees_leave_the_same_state():
    """The native free path (int32 arrays) and the numpy path are interchangeable."""
    a, b = PageAllocator(16), PageAllocator(16)
    for alloc in (a, b):
        alloc.alloc(10)
    for ids in ([3, 1, 7], [0, 9], [2, 4, 5, 6, 8]):
        a.free(np.array(ids, dtype=np.int32))
        b.free(ids)
        assert a.num_free == b.num_free
        assert a._stack[: a.num_free].tolist() == b._stack[: b.num_free].tolist()
        assert a.is_allocated(range(16)).tolist() == b.is_allocated(range(16)).tolist()
