"""LoRA adapters against PEFT: a tiny float64 Llama and three random adapters that
``peft`` itself writes (B nonzero), each adapter's greedy tokens equal to
transformers + PEFT's; a mixed batch (three adapters and the base model, radix
cache, page 16, chunked prefill) equal to each request alone; the cache namespace
by adapter content; bad adapters refused with the engine serving on; tensor
parallelism's shards of an adapter equal to one rank.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from radixserve import Engine, SamplingParams
from radixserve.models.lora import LoraError
from radixserve.protocol import Step, StepReq
from radixserve.worker.build import build_runner
from radixserve.worker.config import WorkerConfig
from tests.helpers.tiny_models import hf_cached_greedy, make_tiny_model, patch_hf_float64
from tests.helpers.tp import run_ranks

GEN = 16
#: name -> (rank, alpha, rsLoRA, targets): every projection, fused forms split.
ADAPTERS = {
    "attn": (4, 8, False, ["q_proj", "k_proj", "v_proj", "o_proj"]),
    "mlp": (8, 16, True, ["gate_proj", "up_proj", "down_proj"]),
    "mixed": (2, 3, False, ["q_proj", "v_proj", "up_proj", "down_proj"]),
}


def _hf(folder):
    from transformers import AutoModelForCausalLM

    return patch_hf_float64(
        AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()
    )


def write_adapter(base, out, seed: int, r: int, alpha: float, rslora: bool, targets, scale=0.2):
    """A PEFT LoRA adapter of ``base`` saved by ``peft`` (random A and B)."""
    import peft

    torch.manual_seed(seed)
    model = _hf(base)
    cfg = peft.LoraConfig(r=r, lora_alpha=alpha, use_rslora=rslora, target_modules=targets,
                          init_lora_weights=False)  # fmt: skip
    pm = peft.get_peft_model(model, cfg)
    with torch.no_grad():  # nonzero B everywhere, of a size that moves the argmax
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, scale)
    pm.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base = make_tiny_model(root / "base", "llama", seed=21)
    paths = {
        name: write_adapter(base, root / name, 30 + i, *spec)
        for i, (name, spec) in enumerate(ADAPTERS.items())
    }
    return base, paths


def _peft_greedy(base, adapter, prompt):
    import peft

    pm = peft.PeftModel.from_pretrained(_hf(base), str(adapter)).eval()
    return hf_cached_greedy(pm.get_base_model(), prompt, GEN)


def _prompts(n: int, shared: int = 40, seed: int = 3):
    rng = np.random.default_rng(seed)
    head = rng.integers(4, 512, shared).tolist()
    return [head + rng.integers(4, 512, 5 + 7 * i).tolist() for i in range(n)]


GREEDY = SamplingParams(max_tokens=GEN, temperature=0.0, ignore_eos=True)


def test_each_adapter_equals_peft_and_a_mixed_batch_equals_each_alone(lora_setup):
    base, paths = lora_setup
    prompts = _prompts(3)
    want = {name: [_peft_greedy(base, p, prompts[0])] for name, p in paths.items()}
    want[None] = [hf_cached_greedy(_hf(base), prompts[0], GEN)]
    # Every adapter changes the tokens (so none is silently ignored).
    assert len({tuple(v[0]) for v in want.values()}) == 4
    eng = Engine(str(base), dtype="float64", page_size=16, num_pages=256,
                 chunked_prefill_size=16, lora={k: str(v) for k, v in paths.items()})  # fmt: skip
    for name in want:
        got = [r.token_ids for r in eng.generate(prompts[:1], GREEDY, lora=name)]
        assert got == want[name], name
    eng.check_idle()
    alone = {}
    for name in want:
        eng.flush_cache()
        alone[name] = [r.token_ids for r in eng.generate(prompts, GREEDY, lora=name)]
    # One batch: every prompt under every adapter and the base model, interleaved.
    names = list(want)
    jobs = [(q, name) for q in range(len(prompts)) for name in names]
    for _ in range(2):  # cold, then warm (each namespace hit in the radix tree)
        out = eng.generate([prompts[q] for q, _ in jobs], GREEDY, lora=[n for _, n in jobs])
        for (q, name), r in zip(jobs, out):
            assert r.token_ids == alone[name][q], (q, name)
        eng.check_idle()


def test_cache_namespace_is_the_adapter_content(lora_setup, tmp_path):
    base, paths = lora_setup
    copy = shutil.copytree(paths["attn"], tmp_path / "attn-copy")
    eng = Engine(str(base), dtype="float64", page_size=16, num_pages=256,
                 lora={"a": str(paths["attn"]), "b": str(paths["mlp"]), "a2": str(copy)})  # fmt: skip
    [prompt] = _prompts(1, shared=60)
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)

    hit = (len(prompt) - 1) // 16 * 16  # whole pages, all but the last token

    def cached(lora, salt=None):
        return eng.generate(prompt, sp, lora=lora, cache_salt=salt)[0].usage.cached_tokens

    assert cached("a") == 0
    assert cached("a") == hit  # hits its own namespace
    assert cached("b") == 0  # another adapter: never the other's KV
    assert cached(None) == 0  # nor the base model's
    assert cached("a2") == hit  # the same weights under another name: the same KV
    assert cached("a", salt="t") == 0  # cache_salt still splits within an adapter
    assert cached("a", salt="t") == hit
    with pytest.raises(ValueError, match="NUL"):
        eng.generate(prompt, sp, cache_salt="\0lora:" + "0" * 64)
    # A name reloaded with other weights: a new namespace.
    eng.unload_lora("a")
    with pytest.raises(ValueError, match="unknown LoRA adapter 'a'"):
        eng.generate(prompt, sp, lora="a")
    eng.load_lora("a", str(paths["mixed"]))
    assert cached("a") == 0
    assert cached("a") == hit
    digests = {d["name"]: d["digest"] for d in eng.list_loras()}
    assert digests["a2"] != digests["a"] and len(set(digests.values())) == 3
    eng.check_idle()


def _broken(src, dst, edit):
    shutil.copytree(src, dst)
    edit(dst)
    return str(dst)


def test_bad_adapters_are_refused_and_the_engine_serves_on(lora_setup, tmp_path):
    base, paths = lora_setup
    other = make_tiny_model(tmp_path / "other", "llama", seed=2, hidden_size=32, tokenizer=False)
    wrong_base = write_adapter(other, tmp_path / "wrong-base", 1, 4, 8, False, ["q_proj"])
    big = write_adapter(base, tmp_path / "big", 2, 32, 32, False, ["q_proj"])
    dora_cfg = json.loads((paths["attn"] / "adapter_config.json").read_text()) | {"use_dora": True}
    eng = Engine(str(base), dtype="float64", page_size=16, num_pages=256, max_lora_rank=16,
                 lora={"attn": str(paths["attn"])})  # fmt: skip
    cases = [
        (str(tmp_path / "nowhere"), "no such directory"),
        (_broken(paths["attn"], tmp_path / "nocfg", lambda d: (d / "adapter_config.json").unlink()),
         "adapter_config.json is missing"),
        (_broken(paths["attn"], tmp_path / "nowts",
                 lambda d: (d / "adapter_model.safetensors").unlink()),
         "adapter_model.safetensors is missing"),
        (_broken(paths["attn"], tmp_path / "trunc",
                 lambda d: (d / "adapter_model.safetensors").write_bytes(b"\x08\0\0\0")),
         "cannot read"),
        (_broken(paths["attn"], tmp_path / "dora",
                 lambda d: (d / "adapter_config.json").write_text(json.dumps(dora_cfg))),
         "use_dora"),
        (str(wrong_base), r"another base model"),
        (str(big), "rank 32 is above --max-lora-rank 16"),
    ]  # fmt: skip
    [prompt] = _prompts(1)
    before = eng.generate(prompt, GREEDY, lora="attn")[0].token_ids
    for path, message in cases:
        with pytest.raises(ValueError, match=message):
            eng.load_lora("x", path)
        assert [d["name"] for d in eng.list_loras()] == ["attn"]
        assert eng.generate(prompt, GREEDY, lora="attn")[0].token_ids == before
    with pytest.raises(ValueError, match="already loaded"):
        eng.load_lora("attn", str(paths["mlp"]))
    with pytest.raises(ValueError, match="unknown LoRA adapter 'nope'"):
        eng.generate(prompt, GREEDY, lora="nope")
    eng.check_idle()
    with pytest.raises(LoraError, match="above --max-lora-rank"):
        Engine(str(base), dtype="float64", num_pages=64, max_lora_rank=16, lora={"big": str(big)})


def test_max_loras_bounds_the_adapters_of_a_batch(lora_setup):
    base, paths = lora_setup
    eng = Engine(str(base), dtype="float64", page_size=16, num_pages=256, max_loras=2,
                 lora={k: str(v) for k, v in paths.items()})  # fmt: skip
    prompts = _prompts(1)
    names = [None, *paths]
    alone = {n: [r.token_ids for r in eng.generate(prompts, GREEDY, lora=n)] for n in names}
    eng.flush_cache()
    slot_lora: dict[int, int] = {}
    most = 0
    step = eng.runner.step

    def watch(batch: Step):
        nonlocal most
        for s in batch.release:
            slot_lora.pop(int(s), None)
        for r in batch.reqs:
            if r.sampling is not None:
                slot_lora[r.slot] = r.lora
        most = max(most, len({slot_lora[r.slot] for r in batch.reqs} - {0}))
        return step(batch)

    eng.runner.step = watch
    jobs = [(0, n) for n in names]
    out = eng.generate([prompts[q] for q, _ in jobs], GREEDY, lora=[n for _, n in jobs])
    assert [r.token_ids for r in out] == [alone[n][q] for q, n in jobs]
    assert most == 2  # never more than max_loras adapters, and it did batch two
    eng.check_idle()


def _lora_greedy(folder, adapter, prompt, tp=1, comm=None):
    config = WorkerConfig(model=str(folder), dtype="float64", page_size=4, num_pages=64,
                          max_running_requests=2, warmup=False, tp=tp,
                          lora_modules=(f"x={adapter}",))  # fmt: skip
    runner = build_runner(config) if comm is None else build_runner(config, comm=comm)
    pages = np.arange(-(-(len(prompt) + 1) // 4), dtype=np.int32)
    req = StepReq(0, np.asarray(prompt, np.int32), 0, pages, True,
                  SamplingParams(temperature=0.0), lora=1)  # fmt: skip
    logits = runner.forward_logits(Step([req]))
    return logits[0].clone() if len(logits) else None


def test_tensor_parallel_shards_equal_one_rank(tmp_path):
    """qkv/gate_up (column-parallel: B sharded) and o/down (row-parallel: A sharded)
    on 2 ranks give one rank's logits; 8 query / 4 KV heads, every projection adapted."""
    base = make_tiny_model(tmp_path / "b", "llama", seed=7, num_attention_heads=8,
                           num_key_value_heads=4)  # fmt: skip
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    adapter = write_adapter(base, tmp_path / "a", 3, 4, 8, False, targets)
    prompt = _prompts(1)[0]
    one = _lora_greedy(base, adapter, prompt)
    two = run_ranks(2, lambda comm: _lora_greedy(base, adapter, prompt, 2, comm))
    assert two[1] is None
    assert torch.allclose(two[0], one, rtol=0, atol=1e-12)
    plain = build_runner(WorkerConfig(model=str(base), dtype="float64", page_size=4, num_pages=64,
                                     max_running_requests=2, warmup=False))  # fmt: skip
    pages = np.arange(-(-(len(prompt) + 1) // 4), dtype=np.int32)
    req = StepReq(0, np.asarray(prompt, np.int32), 0, pages, True, SamplingParams(temperature=0.0))
    assert (plain.forward_logits(Step([req]))[0] - one).abs().max() > 1e-3  # the adapter acts


def test_kv_events_and_the_router_key_by_the_adapter(lora_setup):
    """Stored events name the adapter (our format: ``lora``, ``lora_path`` and the
    namespace salt; vLLM's: ``lora_name`` and the ``("lora", name, path)`` extra key on
    every block); a mirror fed the events keys a request under the adapter so that it
    matches that adapter's pages only, and a vLLM follower does the same."""
    import msgpack

    from radixserve import protocol as P
    from radixserve.router.events_vllm import VllmEventFollower
    from radixserve.router.mirror import KVMirror
    from radixserve.scheduler.kv_events import page_keys
    from radixserve.scheduler.kv_events_vllm import VllmEncoder, sha256_pickle
    from radixserve.scheduler.lora import split_namespace

    base, paths = lora_setup
    eng = Engine(str(base), dtype="float64", page_size=16, num_pages=256,
                 lora={"a": str(paths["attn"]), "b": str(paths["mlp"])})  # fmt: skip
    recorder = eng.scheduler.record_kv_events()
    [prompt] = _prompts(1, shared=60)
    sp = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    for lora, salt in (("a", None), (None, None), ("a", "t")):
        eng.generate(prompt, sp, lora=lora, cache_salt=salt)
    events = [e for e in recorder.take() if e.kind == "stored"]
    digest = {d["name"]: d["digest"] for d in eng.list_loras()}["a"]
    assert [(e.lora, split_namespace(e.salt)) for e in events] == [
        ("a", (digest, None)), (None, (None, None)), ("a", (digest, "t")),
    ]  # fmt: skip
    assert events[0].lora_path == str(paths["attn"])
    batch = P.KVEventBatch("r", 7, 1, 0.0, 16, events)
    # vLLM's format: the adapter on every block, in the hash and in extra_keys.
    _, vllm_events, _ = msgpack.unpackb(VllmEncoder(b"s" * 32).encode(batch), raw=False)
    first, plain = vllm_events[0], vllm_events[1]
    assert (first["lora_name"], plain["lora_name"], first["lora_id"]) == ("a", None, None)
    assert first["extra_keys"] == [["a"]] * 4 and plain.get("extra_keys") is None
    lora_key = ("lora", "a", str(paths["attn"]))
    h0 = sha256_pickle((b"s" * 32, tuple(prompt[:16]), (lora_key,)))
    assert first["block_hashes"][0] == h0
    assert sha256_pickle((h0, tuple(prompt[16:32]), (lora_key,))) == first["block_hashes"][1]
    salted = vllm_events[2]
    assert salted["extra_keys"][:2] == [["a", "t"], ["a"]]
    # The router's mirror: the adapter's keys hit its own pages only.
    ids = prompt[: len(prompt) - 1]
    for mirror in (KVMirror(), None):
        if mirror is None:  # rebuilt from vLLM's events by the router's follower
            follower = VllmEventFollower.__new__(VllmEventFollower)
            follower.blocks = {}
            mirror = KVMirror()
            translated = [t for ev in vllm_events for t in follower._translate(ev)]
            mirror.apply(P.KVEventBatch("r", 7, 1, 0.0, 16, translated))
        else:
            mirror.apply(batch)
        want = (len(prompt) - 1) // 16
        for lora, salt, hit in (("a", None, want), (None, None, want), ("b", None, 0),
                                ("a", "t", want), ("a", "u", 0)):  # fmt: skip
            keys = page_keys(ids, 16, mirror.salt_for(lora, salt))
            assert mirror.match(keys) == hit, (lora, salt)
    eng.close()


def test_float32_kernels_with_adapter_rows_match_float64(lora_setup):
    """float32 takes the CPU kernels (the skinny product, rotary from the q/k/v product,
    the residual add + norm) whose outputs the adapters add into in place: a mixed
    prefill and a mixed decode step (base and two adapters) give float64's logits to
    float32 rounding, and a base-only decode step still takes the one-call layers."""
    from radixserve.models import decode_step

    base, paths = lora_setup
    prompt = np.asarray(_prompts(1)[0], np.int32)
    n = len(prompt)

    def run(dtype):
        config = WorkerConfig(model=str(base), dtype=dtype, page_size=16, num_pages=64,
                              max_running_requests=4, warmup=False,
                              lora_modules=(f"a={paths['attn']}", f"b={paths['mlp']}"))  # fmt: skip
        runner = build_runner(config)
        pages = [np.arange(4 * i, 4 * i + 4, dtype=np.int32) for i in range(3)]
        sp = SamplingParams(temperature=0.0)
        pre = runner.forward_logits(
            Step([StepReq(i, prompt, 0, pages[i], True, sp, lora=i) for i in range(3)])
        )
        nxt = np.asarray([7], np.int32)
        calls = []
        native = decode_step.run
        decode_step.run = lambda *a: calls.append(1) or native(*a)
        try:
            dec = runner.forward_logits(
                Step([StepReq(i, nxt, n, pages[i][:0], True) for i in range(3)])
            )
            runner.forward_logits(Step([StepReq(3, nxt, 0, np.asarray([12], np.int32), True, sp)]))
        finally:
            decode_step.run = native
        return pre.double(), dec.double(), calls

    pre32, dec32, calls = run("float32")
    pre64, dec64, _ = run("float64")
    assert (pre64[0] - pre64[1]).abs().max() > 1e-2  # the adapters act
    assert torch.allclose(pre32, pre64, atol=2e-4, rtol=0)
    assert torch.allclose(dec32, dec64, atol=2e-4, rtol=0)
    assert calls == [1]  # only the base-only step went to the one-call layers


@pytest.mark.parametrize("transposed", [False, True])
def test_grouped_products_equal_a_dense_reference(transposed):
    """``LoraLayer.add`` on both layouts of ``y`` (rows, or the skinny form's transposed
    view), for the whole batch under one adapter, small groups and large groups (the
    column scatter): each row gets exactly its adapter's term, base rows none."""
    from radixserve.layers.lora import SCATTER_COLUMNS, LoraBatch

    g = torch.Generator().manual_seed(0)
    t, din, dout = 3 * SCATTER_COLUMNS, 24, 40
    ads = {k: [{"qkv": (torch.randn(din, r, generator=g, dtype=torch.float64),
                        torch.randn(r, dout, generator=g, dtype=torch.float64))}]
           for k, r in ((1, 4), (2, 8), (3, 2))}  # fmt: skip
    x = torch.randn(t, din, generator=g, dtype=torch.float64)
    y0 = torch.randn(t, dout, generator=g, dtype=torch.float64)
    owner = torch.zeros(t, dtype=torch.long)
    owner[: SCATTER_COLUMNS + 5] = 1  # a large group
    owner[SCATTER_COLUMNS + 5 : SCATTER_COLUMNS + 9] = 2  # a small one
    owner[-SCATTER_COLUMNS:] = 3  # large; the rest is the base model's
    owner = owner[torch.randperm(t, generator=g)]
    cases = [
        [(None, ads[1])],  # every row under one adapter
        [(torch.nonzero(owner == k).flatten(), ads[k]) for k in (1, 2, 3)],
    ]
    for groups in cases:
        y = y0.t().contiguous().t() if transposed else y0.clone()
        LoraBatch(groups).at(0).add(y, x, "qkv")
        want = y0.clone()
        for rows, w in groups:
            rows = torch.arange(t) if rows is None else rows
            a, b = w[0]["qkv"]
            want[rows] += x[rows] @ a @ b
        assert torch.allclose(y, want, rtol=0, atol=1e-12)
        if len(groups) > 1:
            assert torch.equal(y[owner == 0], y0[owner == 0])  # base rows: the same bits


def test_router_answers_lora_calls_for_all_replicas():
    """Behind a router (``launch --dp``) a listing names the adapters every replica
    serves (a request may go to any); a load or unload answers once all did it."""
    from radixserve import protocol as P
    from radixserve.router.server import Router

    router = Router.__new__(Router)
    a = {"name": "a", "id": 1, "path": "/a", "digest": "d1", "rank": 4}
    b = {"name": "b", "id": 2, "path": "/b", "digest": "d2", "rank": 8}
    listed = router._aggregate(P.ListLoraAdapters, {0: {"loras": [b, a]}, 1: {"loras": [a]}})
    assert listed == {"loras": [a]}
    loaded = router._aggregate(P.LoadLoraAdapter, {1: {"name": "b", "rank": 8}, 0: {"name": "b"}})
    assert loaded == {"name": "b", "replicas": 2}
