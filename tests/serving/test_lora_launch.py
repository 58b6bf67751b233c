"""LoRA adapters through a real server: ``--lora-modules`` at start, requests by the
client's ``lora=`` and by HTTP ``model``, ``/v1/models``, runtime load and unload
(admin-guarded, client calls and vLLM's HTTP bodies), bad adapters refused with the
server serving on, and an adapter unloaded while a request uses it.

The tokens are checked against the in-process Engine on the same weights, which
tests/worker/test_lora.py checks against transformers + PEFT.
"""

from __future__ import annotations

import threading

import httpx
import numpy as np
import pytest

from radixserve import Engine, SamplingParams
from radixserve.client import Client, ServerError
from tests.helpers.server import Server, wait_idle
from tests.serving.conftest import SERVER_ARGS, model_dir  # noqa: F401  (a shared fixture)
from tests.worker.test_lora import write_adapter

ADMIN = "lora-admin-key"
GEN = 12


@pytest.fixture(scope="module")
def adapters(model_dir, tmp_path_factory):  # noqa: F811
    root = tmp_path_factory.mktemp("lora-serve")
    return {
        "a": write_adapter(
            model_dir, root / "a", 1, 4, 8, False, ["q_proj", "v_proj", "down_proj"]
        ),
        "b": write_adapter(model_dir, root / "b", 2, 8, 8, True, ["k_proj", "o_proj", "up_proj"]),
    }


def test_adapters_served_loaded_and_unloaded(model_dir, adapters):  # noqa: F811
    prompt = np.random.default_rng(5).integers(4, 512, 21).tolist()
    sp = SamplingParams(max_tokens=GEN, temperature=0.0, ignore_eos=True)
    eng = Engine(str(model_dir), dtype="float64", num_pages=256, page_size=4,
                 lora={k: str(v) for k, v in adapters.items()})  # fmt: skip
    want = {n: eng.generate(prompt, sp, lora=n)[0].token_ids for n in (None, "a", "b")}
    eng.close()
    assert len({tuple(v) for v in want.values()}) == 3
    srv = Server(model_dir, *SERVER_ARGS, "--http-port", "0", "--served-model-name", "tiny",
                 "--lora-modules", f"a={adapters['a']}", "--max-loras", "2",
                 env={"RADIXSERVE_ADMIN_API_KEY": ADMIN})  # fmt: skip
    try:
        with (
            Client(srv.endpoint, timeout=120) as c,
            httpx.Client(base_url=srv.http_url, timeout=120) as h,
        ):
            greedy = {"max_tokens": GEN, "temperature": 0.0, "ignore_eos": True}
            assert c.generate(input_ids=prompt, lora="a", **greedy).token_ids == want["a"]
            assert c.generate(input_ids=prompt, **greedy).token_ids == want[None]
            with pytest.raises(ServerError, match="unknown LoRA adapter 'b'"):
                c.generate(input_ids=prompt, lora="b", **greedy)
            # HTTP: the adapter is a model; vLLM's load body, admin only.
            models = [m["id"] for m in h.get("/v1/models").json()["data"]]
            assert models == ["tiny", "a"]
            body = {"model": "a", "prompt": prompt, **greedy}
            r = h.post("/v1/completions", json=body)
            assert r.status_code == 200, r.text
            assert (
                r.json()["choices"][0]["text"]
                == c.generate(input_ids=prompt, lora="a", **greedy).text
            )
            assert h.post("/v1/completions", json=body | {"model": "b"}).status_code == 404
            load = {"lora_name": "b", "lora_path": str(adapters["b"])}
            assert h.post("/v1/load_lora_adapter", json=load).status_code == 401
            admin = {"Authorization": f"Bearer {ADMIN}"}
            r = h.post("/v1/load_lora_adapter", json=load, headers=admin)
            assert r.status_code == 200, r.text
            assert r.json()["rank"] == 8
            assert c.generate(input_ids=prompt, lora="b", **greedy).token_ids == want["b"]
            r = h.post("/v1/completions", json=body | {"model": "b"})
            assert (
                r.json()["choices"][0]["text"]
                == c.generate(input_ids=prompt, lora="b", **greedy).text
            )
            # Bad adapters: a clear error, and the server serves on.
            bad = {"lora_name": "c", "lora_path": str(model_dir / "nowhere")}
            r = h.post("/v1/load_lora_adapter", json=bad, headers=admin)
            assert r.status_code == 400 and "no such directory" in r.json()["error"]["message"]
            with pytest.raises(ServerError, match="admin API key"):
                c.load_lora_adapter("c", str(model_dir))
            with pytest.raises(ServerError, match="adapter_config.json is missing"):
                c.load_lora_adapter("c", str(model_dir), admin_key=ADMIN)  # a model, no adapter
            with pytest.raises(ServerError, match="already loaded"):
                c.load_lora_adapter("a", str(adapters["b"]), admin_key=ADMIN)
            assert [x["name"] for x in c.list_lora_adapters()] == ["a", "b"]
            # Unloaded while a request under it runs: that request finishes under it.
            c.flush_cache(admin_key=ADMIN)
            long = {**greedy, "max_tokens": 200}  # long enough to be running at the unload
            out: dict = {}
            chunks = []

            def run() -> None:
                with Client(srv.endpoint, timeout=120) as c2:
                    for ch in c2.generate_stream(input_ids=prompt, lora="a", **long):
                        chunks.append(ch)
                out["tokens"] = [t for ch in chunks for t in ch.token_ids]

            t = threading.Thread(target=run)
            t.start()
            while not chunks and t.is_alive():
                threading.Event().wait(0.01)
            reply = c.unload_lora_adapter("a", admin_key=ADMIN)
            assert reply["unloaded"] and reply["requests_finishing"] == 1
            with pytest.raises(ServerError, match="unknown LoRA adapter 'a'"):
                c.generate(input_ids=prompt, lora="a", **greedy)
            t.join(120)
            assert out["tokens"][:GEN] == want["a"] and len(out["tokens"]) == 200
            assert [x["name"] for x in c.list_lora_adapters()] == ["b"]
            r = h.post("/v1/unload_lora_adapter", json={"lora_name": "a"}, headers=admin)
            assert r.status_code == 404
            assert c.generate(input_ids=prompt, lora="b", **greedy).token_ids == want["b"]
            wait_idle(c)
            assert c.check(admin_key=ADMIN) == {"ok": True, "error": None}
    finally:
        assert srv.stop() == 0
