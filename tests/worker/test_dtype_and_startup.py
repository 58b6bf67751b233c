"""Start-up choices of the worker: ``--dtype auto``, the malloc policy, oneDNN's cache
bound, the warm-up."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from radixserve.protocol import Step, StepReq
from radixserve.sampling_params import SamplingParams
from radixserve.worker import dtype as dtype_mod
from radixserve.worker.build import build_runner
from radixserve.worker.config import WorkerConfig
from radixserve.worker.malloc import tune_malloc
from radixserve.worker.model_runner import ModelRunner
from radixserve.worker.primitive_cache import ENV_VARS, bound_primitive_caches

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def test_a_named_dtype_is_kept():
    for name in ("float32", "bfloat16", "float64"):
        assert dtype_mod.choose_dtype(name, CPU) == (name, "as asked")


@pytest.mark.parametrize(
    ("fast", "expected"),
    [
        ((True, "AVX512_BF16"), "bfloat16"),
        ((True, "AMX"), "bfloat16"),
        ((False, "AVX2"), "float32"),
    ],
)
def test_auto_on_cpu_follows_the_bf16_instructions(monkeypatch, fast, expected):
    monkeypatch.setattr(dtype_mod, "cpu_has_fast_bf16", lambda: fast)
    name, why = dtype_mod.choose_dtype("auto", CPU)
    assert name == expected and fast[1] in why


def test_this_cpus_features_are_read():
    fast, feature = dtype_mod.cpu_has_fast_bf16()
    cpuinfo = Path("/proc/cpuinfo")
    flags = cpuinfo.read_text().split() if cpuinfo.exists() else []
    if "avx512_bf16" in flags or "amx_bf16" in flags:
        assert fast and feature in ("AVX512_BF16", "AMX")
    elif flags:
        assert not fast


def test_auto_on_cuda_follows_the_checkpoint(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: True)
    for given, expected in (("float16", "float16"), (torch.bfloat16, "bfloat16")):
        cfg = SimpleNamespace(dtype=given)
        assert dtype_mod.choose_dtype("auto", CUDA, cfg)[0] == expected
    assert dtype_mod.choose_dtype("auto", CUDA, SimpleNamespace(dtype="float32"))[0] == "bfloat16"
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: False)
    assert dtype_mod.choose_dtype("auto", CUDA, SimpleNamespace())[0] == "float16"


def test_unknown_dtype_is_refused():
    with pytest.raises(ValueError, match="unsupported dtype 'int8'"):
        WorkerConfig(dtype="int8")


def test_glibc_accepts_the_malloc_policy():
    import platform

    applied = tune_malloc()
    if platform.libc_ver()[0] != "glibc":
        pytest.skip("not glibc")
    assert applied == {"mmap_threshold": True, "trim_threshold": True, "top_pad": True}


def test_primitive_cache_bound_keeps_a_set_value(monkeypatch):
    monkeypatch.setenv(ENV_VARS[0], "7")
    monkeypatch.delenv(ENV_VARS[1], raising=False)
    assert bound_primitive_caches(64) == {ENV_VARS[0]: "7", ENV_VARS[1]: "64"}
    with pytest.raises(ValueError, match="at least 0"):
        bound_primitive_caches(-1)


# In a fresh process (oneDNN reads its cache capacities once, at its first product): a
# bfloat16 runner prefills prompts of many lengths, each a product shape of its own; the
# heap in use must stop growing once the bounded caches are full.
_PREFILLS = """
import ctypes, sys
import numpy as np
from radixserve.protocol import Step, StepReq
from radixserve.sampling_params import SamplingParams
from radixserve.worker.build import build_runner
from radixserve.worker.config import WorkerConfig

class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost".split()]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
def in_use():
    m = libc.mallinfo2()
    return m.uordblks + m.hblkhd

runner = build_runner(WorkerConfig(model=sys.argv[1], dtype="bfloat16", page_size=4,
                                  num_pages=200, max_running_requests=2, warmup=False))
greedy = SamplingParams(temperature=0, max_tokens=1)
pages = np.arange(200, dtype=np.int32)
def prefill(n):
    ids = np.arange(4, 4 + n, dtype=np.int32) % 500
    runner.step(Step([StepReq(0, ids, 0, pages[: -(-n // 4)], True, greedy)]))
    runner.step(Step([], release=np.asarray([0], dtype=np.int32)))
for n in range(40, 110):
    prefill(n)
full = in_use()
for n in range(110, 190, 2):
    prefill(n)
print((in_use() - full) >> 20)
"""


def test_varied_prefills_stop_growing_the_heap(tiny_llama_dir):
    if not (torch.backends.mkldnn.is_available() and hasattr(_libc(), "mallinfo2")):
        pytest.skip("needs oneDNN and glibc's mallinfo2")
    env = {k: v for k, v in os.environ.items() if k not in ENV_VARS}
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    out = subprocess.run(
        [sys.executable, "-c", _PREFILLS, str(tiny_llama_dir)],
        env=env, cwd=root, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    # Unbounded (1024 entries each) the 40 new lengths' products cost ~270 KiB per shape
    # in each cache: ~85 MiB (the tiny model has four weight shapes); bounded, none.
    assert int(out.stdout.split()[-1]) < 16


def _libc():
    import ctypes

    try:
        return ctypes.CDLL("libc.so.6")
    except OSError:
        return None


def _generate(runner, prompt, n):
    pages = np.arange(64, dtype=np.int32)
    held, pos, ids, out = 0, 0, prompt, []
    for i in range(n):
        need = -(-(pos + len(ids)) // 4)
        greedy = SamplingParams(temperature=0) if i == 0 else None
        tok = runner.step(Step([StepReq(3, ids, pos, pages[held:need], True, greedy)])).tokens
        held, pos, ids = need, pos + len(ids), tok
        out.append(int(tok[0]))
    runner.step(Step([], release=[3]))
    return out


def test_warmup_leaves_no_state_and_changes_no_token(tiny_llama_dir, monkeypatch):
    kw = dict(model=str(tiny_llama_dir), dtype="float64", page_size=4, num_pages=96,
              max_running_requests=6, chunked_prefill_size=300)  # fmt: skip
    cold = build_runner(WorkerConfig(**kw, warmup=False))
    calls = []
    real_step = ModelRunner.step
    monkeypatch.setattr(ModelRunner, "step", lambda r, b: calls.append(b) or real_step(r, b))
    warm = build_runner(WorkerConfig(**kw, warmup=True))
    monkeypatch.undo()
    # The largest prefill (capped by the pool: 95 pages of 4 tokens) and a full decode batch ran.
    assert [len(r.input_ids) for r in calls[0].reqs] == [300]
    assert sorted(r.slot for r in calls[1].reqs) == list(range(6))
    assert warm.page_table.lengths.sum() == 0 and not any(warm.sampler.has(s) for s in range(6))
    prompt = np.random.default_rng(1).integers(4, 512, 23).astype(np.int32)
    assert _generate(warm, prompt, 10) == _generate(cold, prompt, 10)


def test_warmup_fits_a_small_pool(tiny_llama_dir):
    r = build_runner(WorkerConfig(model=str(tiny_llama_dir), dtype="float64", page_size=4,
                                 num_pages=3, max_running_requests=4))  # fmt: skip
    assert r.page_table.lengths.sum() == 0
