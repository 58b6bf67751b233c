"""Choosing the radix tree: auto, native, python.

(CI's check that the native tree is built: tests/helpers/native.py, which
test_radix_native.py calls at import.)"""

import pytest

from radixserve.scheduler import radix_impl
from radixserve.scheduler.allocator import PageAllocator
from radixserve.scheduler.radix_cache import RadixCache
from radixserve.scheduler.radix_impl import available_impls, make_radix_cache


def test_python_and_auto():
    alloc = PageAllocator(8, 2)
    assert type(make_radix_cache(alloc, 2, impl="python")) is RadixCache
    auto = make_radix_cache(alloc, 2)
    assert available_impls()[-1] == "python"
    if radix_impl.NATIVE_AVAILABLE:
        assert available_impls() == ["native", "python"]
        assert type(auto) is radix_impl.NativeRadixCache
    else:
        assert type(auto) is RadixCache
    with pytest.raises(ValueError, match="page_size"):
        make_radix_cache(alloc, 1, impl="auto")


def test_unknown_impl():
    with pytest.raises(ValueError, match="unknown radix tree implementation"):
        make_radix_cache(PageAllocator(8), 1, impl="rust")


def test_native_missing_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(radix_impl, "NATIVE_AVAILABLE", False)
    monkeypatch.setattr(radix_impl, "NATIVE_UNAVAILABLE_REASON", "no module named _radix_native")
    assert available_impls() == ["python"]
    assert type(make_radix_cache(PageAllocator(8), 1)) is RadixCache
    with pytest.raises(RuntimeError, match="not built .*no module named.*pip install -e"):
        make_radix_cache(PageAllocator(8), 1, impl="native")
