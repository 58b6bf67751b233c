"""Replay a shared-prefix request trace against the radix tree and time its calls.

    python bench/radix_ops.py                      # default trace, 5 runs, median
    python bench/radix_ops.py --impl native        # the C++ tree (csrc/)
    python bench/radix_ops.py --save-trace t.json  # write the trace (docs/trace-format.md)
    python bench/radix_ops.py --trace t.json       # replay a saved trace

Per request, as the scheduler does it: match the prompt minus its last token,
lock the match, allocate pages for the rest of the sequence (evicting when
short). At retirement (oldest first once ``max_in_flight`` are running): insert
the whole sequence, free the pages that duplicate the tree's, unlock. The
table reports the time spent inside tree calls only (tokens are int32 arrays
before timing starts), per-call latencies, the token hit rate, and checks that
no page leaked.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import deque
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from radixserve.scheduler.allocator import PageAllocator  # noqa: E402
from radixserve.scheduler.radix_impl import make_radix_cache  # noqa: E402

TRACE_FORMAT = "radixserve-trace/1"


def make_trace(
    num_requests: int = 2000,
    num_system_prompts: int = 50,
    system_len: int = 1000,
    zipf_s: float = 0.8,
    user_len: tuple[int, int] = (50, 200),
    output_len: tuple[int, int] = (20, 150),
    continue_prob: float = 0.35,
    recent: int = 64,
    vocab: int = 32000,
    seed: int = 0,
) -> list[dict]:
    """The default shared-prefix trace (see docs/trace-format.md)."""
    rng = np.random.default_rng(seed)
    systems = [rng.integers(0, vocab, system_len).tolist() for _ in range(num_system_prompts)]
    weights = 1.0 / np.arange(1, num_system_prompts + 1) ** zipf_s
    weights /= weights.sum()
    requests: list[dict] = []
    for rid in range(num_requests):
        user = rng.integers(0, vocab, int(rng.integers(user_len[0], user_len[1] + 1))).tolist()
        if requests and rng.random() < continue_prob:
            prev = requests[int(rng.integers(max(0, len(requests) - recent), len(requests)))]
            prompt = prev["prompt"] + prev["output"] + user
        else:
            prompt = systems[int(rng.choice(num_system_prompts, p=weights))] + user
        output = rng.integers(0, vocab, int(rng.integers(output_len[0], output_len[1] + 1)))
        requests.append({"id": rid, "prompt": prompt, "output": output.tolist()})
    return requests


def replay(
    requests: list[dict], make_tree, capacity: int, page_size: int, max_in_flight: int
) -> dict:
    alloc = PageAllocator(capacity, page_size)
    tree = make_tree(alloc, page_size)
    prompts = [np.asarray(r["prompt"], dtype=np.int32) for r in requests]
    seqs = [np.asarray(r["prompt"] + r["output"], dtype=np.int32) for r in requests]
    clock = time.perf_counter
    t = dict.fromkeys(("match", "lock", "evict", "insert", "unlock"), 0.0)
    n = dict.fromkeys(t, 0)
    hit_tokens = query_tokens = 0
    running: deque = deque()

    def retire() -> None:
        seq, node, hit_len, table = running.popleft()
        whole = len(seq) // page_size
        t0 = clock()
        cached_len, _ = tree.insert(seq[: whole * page_size], table[:whole])
        t1 = clock()
        tree.unlock(node)
        t2 = clock()
        t["insert"] += t1 - t0
        t["unlock"] += t2 - t1
        n["insert"] += 1
        n["unlock"] += 1
        # Duplicates of what another request cached meanwhile, and the partial tail page.
        alloc.free(table[hit_len // page_size : cached_len // page_size])
        alloc.free(table[whole:])

    start = clock()
    for prompt, seq in zip(prompts, seqs):
        if len(running) >= max_in_flight:
            retire()
        t0 = clock()
        m = tree.match_prefix(prompt[:-1])
        t1 = clock()
        tree.lock(m.last_node)
        t2 = clock()
        t["match"] += t1 - t0
        t["lock"] += t2 - t1
        n["match"] += 1
        n["lock"] += 1
        hit_tokens += m.hit_len
        query_tokens += len(prompt)
        need = -(-len(seq) // page_size) - len(m.pages)
        own = alloc.alloc(need)
        while own is None:
            t0 = clock()
            freed = tree.evict(need - alloc.num_free)
            t["evict"] += clock() - t0
            n["evict"] += 1
            if not freed:
                running_pages = sum(len(r[3]) for r in running)
                raise SystemExit(f"capacity too small: {running_pages} pages held by requests")
            own = alloc.alloc(need)
        running.append((seq, m.last_node, m.hit_len, np.concatenate([m.pages, own])))
    while running:
        retire()
    total = clock() - start
    tree.check()
    leaked = capacity - alloc.num_free - tree.cached_pages
    if leaked or tree.protected_pages:
        raise SystemExit(f"page leak: {leaked} pages, {tree.protected_pages} still locked")
    return {
        "total_s": total,
        "tree_s": sum(t.values()),
        "times": t,
        "calls": n,
        "hit_rate": hit_tokens / query_tokens,
        "requests": len(requests),
    }


# Every implementation goes through make_radix_cache, as the scheduler does;
# "native" fails there with a clear message when the extension is not built.
IMPLS = {
    "python": lambda alloc, ps: make_radix_cache(alloc, ps, impl="python"),
    "native": lambda alloc, ps: make_radix_cache(alloc, ps, impl="native"),
}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--impl", default="python", help=f"tree implementation: {', '.join(IMPLS)}")
    p.add_argument("--trace", help="replay this trace file instead of generating one")
    p.add_argument("--save-trace", help="write the generated trace here and continue")
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--capacity", type=int, default=200_000, help="pool size in pages")
    p.add_argument("--page-size", type=int, default=1)
    p.add_argument("--max-in-flight", type=int, default=16)
    p.add_argument("--runs", type=int, default=5, help="report the median run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)
    if args.impl not in IMPLS:
        p.error(f"unknown --impl {args.impl!r}; available: {', '.join(IMPLS)}")

    if args.trace:
        doc = json.loads(Path(args.trace).read_text())
        if doc.get("format") != TRACE_FORMAT:
            p.error(f"{args.trace}: not a {TRACE_FORMAT} file")
        requests = doc["requests"]
        capacity = doc.get("capacity_pages", args.capacity)
        max_in_flight = doc.get("max_in_flight", args.max_in_flight)
    else:
        requests = make_trace(num_requests=args.requests, seed=args.seed)
        capacity, max_in_flight = args.capacity, args.max_in_flight
    if args.save_trace:
        doc = {
            "format": TRACE_FORMAT,
            "capacity_pages": capacity,
            "page_size": 1,
            "max_in_flight": max_in_flight,
            "requests": requests,
        }
        Path(args.save_trace).write_text(json.dumps(doc))

    runs = [
        replay(requests, IMPLS[args.impl], capacity, args.page_size, max_in_flight)
        for _ in range(args.runs)
    ]
    runs.sort(key=lambda r: r["tree_s"])
    med = runs[len(runs) // 2]
    calls = sum(med["calls"].values())
    prompt_tokens = sum(len(r["prompt"]) for r in requests)
    print(
        f"radix_ops: impl={args.impl} requests={len(requests)} prompt_tokens={prompt_tokens} "
        f"capacity={capacity} page_size={args.page_size} in_flight={max_in_flight} "
        f"runs={args.runs} (median by tree time)"
    )
    rows = [
        ("tree-call time (s)", f"{med['tree_s']:.4f}"),
        ("replay wall time (s)", f"{med['total_s']:.4f}"),
        ("requests/s (tree time)", f"{len(requests) / med['tree_s']:,.0f}"),
        ("tree calls", f"{calls}"),
        ("tree ops/s", f"{calls / med['tree_s']:,.0f}"),
    ]
    for op in ("match", "insert", "evict", "lock", "unlock"):
        c = med["calls"][op]
        us = 1e6 * med["times"][op] / c if c else 0.0
        rows.append((f"us per {op} ({c} calls)", f"{us:.2f}"))
    rows.append(("token hit rate", f"{med['hit_rate']:.4f}"))
    rows.append(
        ("tree-call time spread (s)", f"{runs[0]['tree_s']:.4f} .. {runs[-1]['tree_s']:.4f}")
    )
    rows.append(("page leak check", "ok"))
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"  {k:<{width}}  {v:>18}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "median": med}, indent=1))


if __name__ == "__main__":
    main()
