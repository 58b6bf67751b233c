"""Cache tiers end to end through the in-process Engine on a tiny float64 model.

* Under KV pressure (a pool of about two requests), greedy outputs with a host
  tier equal those of a roomy pool without tiers, while the second round's prefixes
  come back from the host tier (demoted, then promoted: the KV must be exact).
* Restart: an Engine with a disk tier computes a long system prompt and closes; a
  new Engine on the same directory hits that prompt's page-aligned length from disk
  and answers exactly as a cold run; with one page file corrupted in between it
  counts one corrupt file (a miss), recomputes from there and is still exact.
* The worker's copies are bit-exact in bfloat16 too, and refusals are clear.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest
import torch

from radixserve import Engine, SamplingParams
from radixserve.cli import main
from radixserve.protocol import PageCopies
from radixserve.scheduler.request import ReqStatus
from radixserve.utils import kv_file
from radixserve.worker.host_cache import HostCache
from radixserve.worker.kv_pool import KVPool
from tests.helpers.tiny_models import make_tiny_model

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PAGE = 4
# The tiny model's page: 2 layers x K,V x 4 tokens x 2 KV heads x head_dim 16 x 8 bytes.
PAGE_BYTES = 2 * 2 * PAGE * 2 * 16 * 8


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model(
        tmp_path_factory.mktemp("tiny-tiers"), "llama", seed=11, max_position_embeddings=1024
    )


def engine(tiny_dir, **kw) -> Engine:
    kw.setdefault("dtype", "float64")
    kw.setdefault("page_size", PAGE)
    kw.setdefault("warmup", False)
    return Engine(str(tiny_dir), **kw)


def gib(pages: int) -> float:
    return pages * PAGE_BYTES / (1 << 30)


def test_host_tier_under_pressure_is_exact(tiny_dir):
    rng = np.random.default_rng(1)
    firsts = [rng.integers(4, 512, 60).tolist() for _ in range(4)]
    seconds = [p + rng.integers(4, 512, 7).tolist() for p in firsts]
    ref = engine(tiny_dir, num_pages=4096)
    expected = [r.token_ids for r in ref.generate(firsts + seconds, GREEDY)]

    # 48 pages: the four first-round prompts (16 pages each with output) cannot stay.
    eng = engine(tiny_dir, num_pages=48, host_cache_gb=gib(256), decode_reserve_ratio=0.0)
    got = [r.token_ids for r in eng.generate(firsts, GREEDY)]
    results = eng.generate(seconds, GREEDY)
    got += [r.token_ids for r in results]
    assert got == expected
    stats = eng.stats()
    assert stats["pages_demoted"] > 0 and stats["pages_promoted"] > 0
    assert stats["hit_tokens_l2"] > 0
    by_tier = [r.usage.cached_tokens_by_tier for r in results]
    assert sum(t[1] for t in by_tier) == stats["hit_tokens_l2"]
    assert all(sum(t) == r.usage.cached_tokens for t, r in zip(by_tier, results))
    eng.check_idle()
    assert eng.flush_cache() >= 0 and eng.stats()["host_pages_cached"] == 0
    eng.close()


def test_loading_requests_wait_while_others_run(tiny_dir):
    """Pages promoted from the host tier arrive while the step loop goes on: the
    copy thread is held (a hook) until an unrelated request has produced tokens;
    the request that promoted the prefix and another matching the pages in flight
    wait in LOADING meanwhile, then answer exactly as a roomy pool without tiers."""
    rng = np.random.default_rng(3)
    prefix = rng.integers(4, 512, 40).tolist()
    a, b = prefix + [7, 8, 9], prefix + [10, 11]
    c = rng.integers(4, 512, 9).tolist()
    ref = engine(tiny_dir, num_pages=4096)
    want = {rid: r.token_ids for rid, r in zip("abc", ref.generate([a, b, c], GREEDY))}

    eng = engine(tiny_dir, num_pages=64, host_cache_gb=gib(64))
    eng.generate([prefix + [5]], GREEDY)
    sched, runner = eng.scheduler, eng.runner
    assert sched.cache.evict(sched.cache.evictable_pages) > 0  # all of it to the host tier
    go = threading.Event()
    runner.host_cache.inline_pages = 0  # every ticket through the thread
    runner.host_cache.before_copies = lambda ticket: go.wait(60)
    for rid, prompt in zip("abc", (a, b, c)):
        sched.add_request(rid, prompt, GREEDY)
    got: dict[str, list[int]] = {"a": [], "b": [], "c": []}
    usage = {}

    def step() -> None:
        for out in sched.step(runner.step):
            got[out.rid] += list(out.token_ids)
            if out.finish_reason is not None:
                usage[out.rid] = out.cached_tokens_by_tier

    status = lambda rid: sched._requests[rid][0].status  # noqa: E731
    while len(got["c"]) < 6:  # c makes progress while a and b wait for their pages
        step()
        assert status("a") is ReqStatus.LOADING and status("b") is ReqStatus.LOADING
        assert not got["a"] and not got["b"]
    assert sched.stats()["loading"] == 2
    go.set()
    while sched.has_work():
        step()
    assert got == want
    hit = len(prefix) - len(prefix) % PAGE
    assert usage["a"] == [0, hit, 0, 0]  # it promoted them, and is credited for it
    assert usage["b"] == [hit, 0, 0, 0]  # it found them in the pool, on their way
    eng.check_idle()
    eng.close()


def test_disk_tier_survives_restart_and_corruption(tiny_dir, tmp_path):
    rng = np.random.default_rng(2)
    system = rng.integers(4, 512, 203).tolist()  # 50 whole pages and 3 tokens
    first = system + rng.integers(4, 512, 9).tolist()
    question = system + rng.integers(4, 512, 11).tolist()
    cold = engine(tiny_dir, num_pages=1024)
    [want] = cold.generate([question], GREEDY)
    disk = str(tmp_path / "kv")
    tiers = dict(num_pages=1024, host_cache_gb=gib(64), disk_cache_dir=disk)

    eng = engine(tiny_dir, **tiers)
    eng.generate([first], GREEDY)
    eng.close()
    files = sorted(os.listdir(disk))
    assert len(files) >= 50 and all(f.endswith(".kv") for f in files)

    again = engine(tiny_dir, **tiers)
    [r] = again.generate([question], GREEDY)
    assert r.token_ids == want.token_ids
    assert r.usage.cached_tokens >= 200
    assert r.usage.cached_tokens_by_tier == [0, 0, r.usage.cached_tokens, 0]
    assert again.stats()["disk_corrupt_files"] == 0
    again.check_idle()
    identity = again.runner.kv_identity
    again.close()

    # Damage the file of the 26th page of the system prompt: pages 0-24 still come
    # from disk, the rest is recomputed.
    from radixserve.scheduler.kv_events import page_keys

    root = kv_file.identity_digest(identity)
    key = page_keys(system[:200], PAGE, None, root)[25]
    path = os.path.join(disk, kv_file.file_name(key))
    with open(path, "r+b") as f:
        f.seek(kv_file.HEADER_BYTES + 100)
        f.write(b"\xff\xff\xff\xff")
    third = engine(tiny_dir, **tiers)
    [r] = third.generate([question], GREEDY)
    assert r.token_ids == want.token_ids
    assert r.usage.cached_tokens == 25 * PAGE
    assert third.stats()["disk_corrupt_files"] == 1
    assert not os.path.exists(path) or kv_file.check_page_file(path, key, root, PAGE_BYTES)
    third.check_idle()
    third.close()


def settle(host: HostCache, ticket: int) -> None:
    """Wait until ``ticket``'s copies are done."""
    done: list[int] = []
    while ticket not in done:
        host.wait(1.0)
        done += host.finished()


@pytest.mark.parametrize("asynchronous", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_copies_are_bit_exact(tmp_path, dtype, asynchronous):
    pool = KVPool(3, 6, 4, 2, 8, dtype)
    for layer in pool.layers:
        layer.normal_()
    before = [layer.clone() for layer in pool.layers]
    host = HostCache(pool, 3, str(tmp_path), "test", asynchronous)
    host.inline_pages = 0
    go = threading.Event()  # ticket 2's background part waits for it
    host.before_copies = lambda ticket: go.wait(10) if ticket == 2 else None
    i32 = lambda xs: np.asarray(xs, dtype=np.int32)  # noqa: E731
    keys = bytes(range(32)) + bytes(range(1, 33))
    host.apply(PageCopies(demote_pages=i32([1, 4]), demote_slots=i32([2, 0]), ticket=1))
    settle(host, 1)
    # The page and the slot written to disk are read in step: overwriting them right
    # after (a demotion into the slot in the same step, a prefill into the page)
    # must not change the files.
    host.apply(
        PageCopies(
            save_pages=i32([3]),
            save_keys=keys[:32],
            to_disk_slots=i32([0]),
            to_disk_keys=keys[32:],
            demote_pages=i32([5]),
            demote_slots=i32([0]),
            ticket=2,
        )
    )
    for layer in pool.layers:
        layer[3].zero_()
    go.set()
    settle(host, 2)
    for layer in pool.layers:
        layer.zero_()
    host.apply(
        PageCopies(
            promote_slots=i32([2, 0]),
            promote_pages=i32([5, 1]),
            load_keys=keys,
            load_pages=i32([0, 2]),
            ticket=3,
        )
    )
    settle(host, 3)
    host.close()
    for b, layer in zip(before, pool.layers):
        assert torch.equal(layer[5], b[1])  # via the host tier
        assert torch.equal(layer[1], b[5])  # demoted into a slot written to disk in step
        assert torch.equal(layer[0], b[3])  # written through to disk, loaded
        assert torch.equal(layer[2], b[4])  # host tier, then disk, then loaded


def test_close_finishes_the_writes_queued(tmp_path):
    """A clean stop loses no write-through file: ``close`` joins the copy thread
    after the copies queued (held back here a little by the hook)."""
    pool = KVPool(2, 4, 4, 2, 8, torch.float32)
    pool.layers[0].normal_()
    host = HostCache(pool, 2, str(tmp_path), "test")
    host.inline_pages = 0
    host.before_copies = lambda ticket: time.sleep(0.05)
    keys = bytes(range(32)) + bytes(range(1, 33))
    pages = np.asarray([1, 2], dtype=np.int32)
    host.apply(PageCopies(save_pages=pages, save_keys=keys, ticket=1))
    host.close()
    assert sorted(os.listdir(tmp_path)) == sorted(
        kv_file.file_name(keys[i : i + 32]) for i in (0, 32)
    )
    assert host.finished() == [1]


def test_small_tickets_are_done_in_step_while_the_thread_is_idle(tmp_path):
    """On the CPU a ticket under ``inline_pages`` is done in ``apply`` when nothing
    is queued (finished at once, hook never called); a bigger one, or any ticket
    behind a queued one, goes to the thread in order."""
    pool = KVPool(2, 40, 4, 2, 8, torch.float32)
    pool.layers[0].normal_()
    host = HostCache(pool, 4, str(tmp_path), "test")
    assert host.inline_pages == 16
    threaded: list[int] = []
    go = threading.Event()
    host.before_copies = lambda ticket: (threaded.append(ticket), go.wait(10))
    keys = b"".join(bytes([i]) * 32 for i in range(1, 21))
    pages = lambda n: np.arange(1, n + 1, dtype=np.int32)  # noqa: E731
    host.apply(PageCopies(save_pages=pages(2), save_keys=keys[:64], ticket=1))
    assert host.finished() == [1] and not host.busy
    host.apply(PageCopies(save_pages=pages(20), save_keys=keys, ticket=2))
    assert host.busy
    host.apply(PageCopies(save_pages=pages(1), save_keys=keys[:32], ticket=3))  # behind 2
    assert host.finished() == []
    go.set()
    settle(host, 3)
    host.close()
    assert threaded == [2, 3]
    assert len(os.listdir(tmp_path)) == 20


def test_refusals(tiny_dir, tmp_path, capsys):
    with pytest.raises(ValueError, match="--cache radix"):
        engine(tiny_dir, num_pages=64, cache="none", host_cache_gb=gib(8))
    with pytest.raises(ValueError, match="needs a host tier"):
        engine(tiny_dir, num_pages=64, disk_cache_dir=str(tmp_path))
    with pytest.raises(ValueError, match="tensor parallelism"):
        engine(tiny_dir, num_pages=64, host_cache_gb=gib(8), disk_cache_dir="d", tp=2)
    # radixserve launch says so and exits 1 before starting anything.
    assert main(["launch", "--cache", "none", "--host-cache-gb", "1"]) == 1
    assert "need --cache radix" in capsys.readouterr().err
