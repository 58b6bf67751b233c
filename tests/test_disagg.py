"""Prefill/decode disaggregation in one process: a prefill and a decode server's
schedulers and workers (a tiny model in float32, on short outputs: the pulled pages
were computed in other batches than one server's, and the greedy tokens still
agree), their pages written by Mooncake's transfer engine over TCP on loopback, their
control messages handed across by a pump that plays the two processes' loops. Greedy
tokens equal one ordinary server's; only the pages the decode side lacks are sent;
failures and aborts end cleanly and leave no page behind on either side."""

from __future__ import annotations

import time

import numpy as np
import pytest

pytest.importorskip("mooncake.engine")

from radixserve import Engine  # noqa: E402
from radixserve.protocol import KVCancel, KVPull, KVSend, decode  # noqa: E402
from radixserve.sampling_params import SamplingParams, StructuredOutput  # noqa: E402
from radixserve.worker.kv_transfer import KVTransferAgent, transfer_identity  # noqa: E402
from tests.helpers.tiny_models import make_tiny_model  # noqa: E402

PS = 4
MAX_NEW = 8
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-disagg"), "llama", seed=7)


class Side:
    """One server in process: an Engine's scheduler and runner, and a transfer agent
    on the runner's pool (what the worker process holds)."""

    def __init__(self, tiny_dir, num_pages: int = 96) -> None:
        self.engine = Engine(
            str(tiny_dir), dtype="float32", num_pages=num_pages, page_size=PS,
            chunked_prefill_size=64,
        )  # fmt: skip
        self.scheduler = self.engine.scheduler
        layers = self.engine.runner.pool.layers
        self.agent = KVTransferAgent(layers)
        info = self.engine.runner.info()
        self.descriptor = self.agent.descriptor(info)
        self.identity = transfer_identity(info, len(layers), self.agent.page_bytes)

    def run(self, step):
        return self.agent.step(self.engine.runner.step, step)

    def close(self) -> None:
        self.agent.close()
        self.engine.close()


class Pair:
    """A decode and a prefill side, and the pump between them: every message goes
    through its wire form, as between the processes."""

    def __init__(self, tiny_dir, timeout: float = 30.0, quarantine: float = 60.0) -> None:
        self.d, self.p = Side(tiny_dir), Side(tiny_dir)
        self.d.scheduler.serve_decode(self.d.descriptor, timeout, quarantine)
        self.p.scheduler.serve_prefill(self.p.identity)
        self.prefill_up = True  # False: the prefill server is gone (messages dropped)
        self.outputs: dict[tuple[str, int], list[int]] = {}  # by (rid, sample)
        self.finish: dict[tuple[str, int], str] = {}
        self.logprobs = 0

    def turn(self) -> None:
        d, p = self.d.scheduler, self.p.scheduler
        for out in d.step(self.d.run):
            self.outputs.setdefault((out.rid, out.index), []).extend(out.token_ids)
            self.logprobs += len(out.logprobs or [])
            if out.finish_reason is not None:
                self.finish[(out.rid, out.index)] = out.finish_reason
        for _, msg in d.disagg.take_outbox():
            if not self.prefill_up:
                continue
            msg = decode(msg.encode(), {KVPull.TYPE: KVPull, KVCancel.TYPE: KVCancel})
            if isinstance(msg, KVPull):
                p.disagg.pull(b"decode", msg)
            else:
                p.disagg.cancel(b"decode", msg.rid)
        if self.prefill_up:
            assert p.step(self.p.run) == []  # a pull's request answers nobody
            for _, msg in p.disagg.take_outbox():
                d.disagg.answered(decode(msg.encode()))

    def run(self, prompts, source: str | None = "prefill", params=GREEDY) -> list[list[int]]:
        rids = [f"r{len(self.finish) + i}" for i in range(len(prompts))]
        for rid, prompt in zip(rids, prompts):
            self.d.scheduler.add_request(rid, prompt, params, kv_source=source)
        n = params.n
        self.until(lambda: all((r, i) in self.finish for r in rids for i in range(n)))
        return [self.outputs[(r, 0)] for r in rids]

    def until(self, done) -> None:
        for _ in range(2000):
            if done():
                return
            self.turn()
        raise AssertionError("the requests did not finish")

    def settle(self) -> None:
        """Turn until neither side has anything left to do."""
        for _ in range(2000):
            if not (self.d.scheduler.has_work() or self.p.scheduler.has_work()):
                return
            self.turn()
        raise AssertionError("the pair did not settle")

    def check_idle(self) -> None:
        self.settle()
        self.d.scheduler.check_idle()
        self.p.scheduler.check_idle()

    def stats(self) -> tuple[dict, dict]:
        return self.d.scheduler.stats(), self.p.scheduler.stats()

    def close(self) -> None:
        self.d.close()
        self.p.close()


@pytest.fixture(scope="module")
def pair(tiny_dir):
    pair = Pair(tiny_dir)
    yield pair
    pair.close()


@pytest.fixture(scope="module")
def reference(tiny_dir):
    """One ordinary server's greedy tokens."""
    engine = Engine(str(tiny_dir), dtype="float32", num_pages=256, page_size=PS)

    def generate(prompts, params=GREEDY):
        return [r.token_ids for r in engine.generate(prompts, params)]

    yield generate
    engine.close()


def prompts(seed: int, n: int, length: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(4, 512, length).tolist() for _ in range(n)]


def test_fresh_prompts_equal_one_server_and_send_every_page(pair, reference):
    batch = prompts(1, 3, 37)
    before, _ = pair.stats()
    assert pair.run(batch) == reference(batch)
    after, p = pair.stats()
    # 36 of 37 tokens pulled (all but the last, in whole pages): 9 pages each.
    assert after["kv_transfer_pages_sent"] - before["kv_transfer_pages_sent"] == 3 * 9
    assert after["kv_transfer_pages_skipped"] == before["kv_transfer_pages_skipped"]
    assert after["kv_transfer_fallbacks"] == 0
    assert 0 < after["kv_transfer_latency_p50"] <= after["kv_transfer_latency_p99"]
    assert p["kv_transfer_pages_sent"] >= 27
    pair.check_idle()


def test_decode_side_prefix_is_not_sent(pair, reference):
    (history,) = prompts(2, 1, 40)
    pair.run([history], source=None)  # the decode side computes and caches it
    turn = history + prompts(3, 1, 13)[0]
    before, _ = pair.stats()
    assert pair.run([turn]) == reference([turn])
    after, _ = pair.stats()
    # 52 tokens matchable, 40 held by the decode side: 10 pages skipped, 3 sent.
    assert after["kv_transfer_pages_skipped"] - before["kv_transfer_pages_skipped"] == 10
    assert after["kv_transfer_pages_sent"] - before["kv_transfer_pages_sent"] == 3
    page = pair.d.agent.page_bytes * len(pair.d.engine.runner.pool.layers)
    assert after["kv_transfer_bytes_sent"] - before["kv_transfer_bytes_sent"] == 3 * page
    assert after["kv_transfer_bytes_skipped"] - before["kv_transfer_bytes_skipped"] == 10 * page
    pair.check_idle()


def test_prefill_side_prefix_is_its_own_hit(pair, reference):
    (history,) = prompts(4, 1, 48)
    pair.p.engine.generate(
        [history], SamplingParams(max_tokens=1)
    )  # only the prefill side holds it
    _, before = pair.stats()
    turn = history + prompts(5, 1, 9)[0]
    assert pair.run([turn]) == reference([turn])
    _, after = pair.stats()
    assert after["hit_tokens"] - before["hit_tokens"] >= 44  # its tree served the history
    pair.check_idle()


def test_streams_n_and_logprobs_come_from_the_decode_side(pair, reference):
    (prompt,) = prompts(6, 1, 30)
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, n=2, logprobs=2)
    before = pair.logprobs
    rid = f"many{len(pair.finish)}"
    pair.d.scheduler.add_request(rid, prompt, params, kv_source="prefill")
    pair.until(lambda: (rid, 0) in pair.finish and (rid, 1) in pair.finish)
    (want,) = reference([prompt])
    assert pair.outputs[(rid, 0)] == pair.outputs[(rid, 1)] == want
    assert pair.logprobs - before == 2 * MAX_NEW
    pair.check_idle()


def test_unreachable_peer_falls_back_to_a_local_prefill(pair, reference):
    side = pair.d.scheduler.disagg
    d0, p0 = pair.stats()
    side.descriptor = {**pair.d.descriptor, "session": "127.0.0.1:1"}  # nobody listens
    try:
        batch = prompts(8, 2, 21)
        assert pair.run(batch) == reference(batch)
    finally:
        side.descriptor = pair.d.descriptor
    d, p = pair.stats()
    assert d["kv_transfer_fallbacks"] - d0["kv_transfer_fallbacks"] == 2
    assert d["kv_transfer_pages_sent"] == d0["kv_transfer_pages_sent"]
    assert p["kv_transfer_failures"] - p0["kv_transfer_failures"] == 2
    pair.check_idle()


def test_prefill_server_gone_times_out_then_frees_the_quarantine(pair, reference):
    d = pair.d.scheduler
    side = d.disagg
    now = [0.0]
    d.clock, side.timeout, side.quarantine = (lambda: now[0]), 5.0, 5.0
    pair.prefill_up = False
    try:
        batch = prompts(9, 2, 25)
        for i, prompt in enumerate(batch):
            d.add_request(f"gone{i}", prompt, GREEDY, kv_source="prefill")
        pair.turn()
        assert d.stats()["kv_transfer_quarantined_pages"] == 0
        assert all(r.remote is not None for r in d.running)  # LOADING, pulling
        before = d.stats()["kv_transfer_timeouts"]
        now[0] = 6.0  # past the deadline: prefilled on the decode side, pages quarantined
        pair.until(lambda: all((f"gone{i}", 0) in pair.finish for i in range(2)))
        assert [pair.outputs[(f"gone{i}", 0)] for i in range(2)] == reference(batch)
        assert d.stats()["kv_transfer_timeouts"] - before == 2
        assert d.stats()["kv_transfer_quarantined_pages"] == 2 * 6
        now[0] = 12.0  # the quarantine ends: the pages are free again
        pair.turn()
        d.check_idle()
    finally:
        pair.prefill_up = True
        d.clock, side.timeout, side.quarantine = time.monotonic, 30.0, 60.0


def test_abort_during_the_transfer_frees_both_sides(pair):
    d, p = pair.d.scheduler, pair.p.scheduler
    for i, prompt in enumerate(prompts(10, 3, 33)):
        d.add_request(f"a{i}", prompt, GREEDY, kv_source="prefill")
    d.step(pair.d.run)  # admitted and pulling
    for _, msg in d.disagg.take_outbox():
        p.disagg.pull(b"decode", msg)
    p.step(pair.p.run)  # a0 and a1 computed on the prefill side, their sends queued
    d.abort_request("a0")  # before anything arrived: its late pages go to the quarantine
    d.abort_request("a2")  # still computing on the prefill side: aborted there too
    pair.turn()
    assert pair.finish[("a0", 0)] == pair.finish[("a2", 0)] == "abort"
    pair.until(lambda: ("a1", 0) in pair.finish)
    assert pair.finish[("a1", 0)] == "length"
    pair.check_idle()
    assert d.stats()["kv_transfer_quarantined_pages"] == 0


def test_a_pull_computed_past_its_expiry_writes_nothing(pair, reference):
    d, p = pair.d.scheduler, pair.p.scheduler
    now = [0.0]
    p.disagg.clock = lambda: now[0]
    try:
        (prompt,) = prompts(11, 1, 29)
        d.add_request("late", prompt, GREEDY, kv_source="prefill")
        d.step(pair.d.run)
        for _, msg in d.disagg.take_outbox():
            p.disagg.pull(b"decode", msg)  # arrives at 0: no write may start after 30
        now[0] = 31.0
        _, before = pair.stats()
        pair.until(lambda: ("late", 0) in pair.finish)  # prefilled on the decode side
        assert pair.outputs[("late", 0)] == reference([prompt])[0]
        _, after = pair.stats()
        assert after["kv_transfer_pages_sent"] == before["kv_transfer_pages_sent"]
        assert after["kv_transfer_failures"] - before["kv_transfer_failures"] == 1
        pair.check_idle()
    finally:
        p.disagg.clock = time.monotonic


def test_the_worker_starts_no_write_past_its_deadline(pair):
    pages = np.arange(2, dtype=np.int32)
    d = pair.d.descriptor
    send = KVSend(1, d["session"], pages, pages, d["layers"], d["page_bytes"], deadline=0.0)
    with pytest.raises(RuntimeError, match="expired"):
        pair.p.agent.write(send)


def test_a_prompt_sharing_a_pulled_prefix_waits_and_pulls_only_the_rest(pair, reference):
    (system,) = prompts(12, 1, 40)
    batch = [system + tail for tail in prompts(13, 2, 9)]
    before, _ = pair.stats()
    assert pair.run(batch) == reference(batch)  # arrive together
    after, _ = pair.stats()
    # The second waited for the first's 12 pages (48 tokens matchable), then pulled 2.
    assert after["kv_transfer_pages_sent"] - before["kv_transfer_pages_sent"] == 12 + 2
    assert after["kv_transfer_pages_skipped"] - before["kv_transfer_pages_skipped"] == 10
    pair.check_idle()


def test_structured_output_and_priorities_run_on_the_decode_side(pair, reference):
    regex = StructuredOutput.regex("(ab|cd|e )+")
    params = SamplingParams(max_tokens=10, temperature=0.0, structured=regex, priority=3)
    batch = prompts(14, 2, 26)
    assert pair.run(batch, params=params) == reference(batch, params)
    pair.check_idle()


def test_only_a_decode_server_takes_a_kv_source(pair):
    with pytest.raises(ValueError, match="decode server"):
        pair.p.scheduler.add_request("x", [5, 6, 7], GREEDY, kv_source="tcp://127.0.0.1:1")
    assert not pair.p.scheduler.has_work()
