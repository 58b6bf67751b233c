"""Shifted keys of fp8 pools (``attention/key_shift.py``).

Taking one constant per (layer, kv head) off every key must leave attention unchanged
wherever values are exact (a float64 pool, every torch path and the native kernel);
the calibrated constant is the model's mean post-rotary key, the same on every build,
named in the pool's identity; and on a model whose keys carry an offset it brings an
fp8 pool's distributions closer to a float32 pool's.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixserve import Engine
from radixserve.worker.attention import KVPool, create_backend, key_shift
from radixserve.worker.attention.rotation import KeyRotation, hadamard
from radixserve.worker.attention.torch_backend import TorchAttention
from radixserve.worker.host_cache import kv_identity
from radixserve.worker.kv_transfer import transfer_identity
from tests.helpers.tiny_models import make_tiny_model
from tests.worker.test_kv_rotation import ragged_steps

CPU = torch.device("cpu")


@pytest.mark.parametrize("decode_kernel", ["torch", "native"])
def test_float64_attention_with_shifted_keys_equals_attention_without(decode_kernel):
    """The same steps on two float64 pools of rotated keys, one of them shifted by a
    large constant per kv head: equal outputs to float64's rounding, while the second
    pool's keys are the first's less the shift."""
    gen = torch.Generator().manual_seed(2)
    shift = 30 * torch.randn(1, 2, 64, generator=gen, dtype=torch.float64)
    outs, pools = [], []
    for m in (None, shift):
        pool = KVPool(1, 16, 16, 2, 64, torch.float64)
        backend = create_backend("torch", pool, 0.125, (-1,), 6, decode_kernel=decode_kernel)
        backend.rotation = KeyRotation(torch.float64, m)  # exact values: no rounding
        outs.append(ragged_steps(backend, pool, torch.Generator().manual_seed(5), 6))
        pools.append(pool)
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
    written = pools[0].layers[0][:, 0].abs().sum((-1, -2)) > 0  # the tokens the steps wrote
    keys = [p.layers[0][:, 0][written] for p in pools]  # [tokens, kv heads, head_dim]
    assert not torch.allclose(keys[0], keys[1])
    torch.testing.assert_close(keys[0] - keys[1], shift[0].expand_as(keys[0]), atol=1e-12, rtol=0)


def test_pools_that_take_a_shift():
    cfg = type("Cfg", (), {"attn_softcap": 0.0, "hybrid": False})()
    capped = type("Cfg", (), {"attn_softcap": 50.0, "hybrid": False})()
    for kv_dtype, layout, shifted in [("auto", "row", False), ("float32", "row", False),
                                      ("int8", "row", False), ("fp8_e4m3", "row", True),
                                      ("fp8_e4m3", "tensor", True),
                                      ("fp8_e5m2", "token_head", True)]:  # fmt: skip
        pool = KVPool(1, 2, 16, 1, 64, torch.bfloat16, kv_dtype=kv_dtype, kv_layout=layout)
        assert key_shift.applies(pool, cfg) == shifted
        assert not key_shift.applies(pool, capped)  # tanh of the scores: not invariant
    pool = KVPool(2, 2, 16, 2, 64, torch.bfloat16, kv_dtype="fp8_e4m3")
    with pytest.raises(ValueError, match="key shift must be"):
        pool.set_key_shift(torch.zeros(2, 2, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="rotated keys"):
        KVPool(2, 2, 16, 2, 64, torch.bfloat16).set_key_shift(torch.zeros(2, 2, 64))


def test_calibrated_shift_is_the_mean_key(tiny_llama_dir):
    """An fp8 Engine's shift is the mean post-rotary key of every layer and kv head over
    the calibration text (the keys the runner's own forward computes for it, float32
    pool, one prefill), rotated and rounded to bfloat16 values; the same on a second
    build; named in the pool's identity; none for int8."""
    from radixserve.benchmark.kv_quality import teacher_forced_logits

    eng = Engine(str(tiny_llama_dir), dtype="float32", num_pages=256, kv_cache_dtype="fp8_e4m3",
                 warmup=False)  # fmt: skip
    pool = eng.runner.pool
    shift = pool.key_shift
    assert shift is not None and shift.shape == (pool.num_layers, 2, 16)
    assert eng.runner.backend.rotation.shift is shift
    ids = key_shift.calibration_ids(eng.tokenizer, 1024)
    once = list(eng.tokenizer.encode(key_shift.CALIBRATION_TEXT))
    assert ids == (once * 2)[:1023]  # repeated, capped at the tiny model's context
    eng.close()

    keys: dict[int, list[torch.Tensor]] = {}
    queries: dict[int, list[torch.Tensor]] = {}
    forward = TorchAttention.forward

    def recorded(self, layer, q, k, v):
        keys.setdefault(layer, []).append(k.double())
        queries.setdefault(layer, []).append(q.double())
        return forward(self, layer, q, k, v)

    ref = Engine(str(tiny_llama_dir), dtype="float32", num_pages=1100, kv_cache_dtype="float32",
                 chunked_prefill_size=len(ids), warmup=False)  # fmt: skip
    assert ref.runner.pool.key_shift is None
    try:
        TorchAttention.forward = recorded
        teacher_forced_logits(ref, ids)
    finally:
        TorchAttention.forward = forward
    ref.close()
    r = hadamard(16, torch.float64, CPU)
    means = torch.stack([torch.cat(keys[i]).mean(0) for i in range(pool.num_layers)])
    # bfloat16 values of the rotated means (to a step of the rounding: the runner's
    # forward and the calibration's attention differ in float32's last bits)
    torch.testing.assert_close(shift.double(), means @ r, atol=1e-4, rtol=2**-7)
    assert not torch.equal(shift, torch.zeros_like(shift))
    # The GPTQ factors: per layer and kv head, the upper Cholesky factor of the inverse
    # of the rotated queries' damped second moment (over the kv head's query heads).
    factors = pool.key_gptq
    assert factors is not None and factors.shape == (pool.num_layers, 2, 16, 16)
    assert torch.equal(factors, factors.triu())
    moments = []
    for i in range(pool.num_layers):
        qr = torch.cat(queries[i]) @ r  # [tokens, heads, 16]
        qr = qr.view(qr.shape[0], 2, -1, 16).transpose(0, 1).reshape(2, -1, 16)
        moments.append(qr.transpose(1, 2) @ qr / qr.shape[1])
    want = key_shift.gptq_factors(moments).double()
    torch.testing.assert_close(factors.double(), want, atol=1e-3, rtol=2**-6)

    again = Engine(str(tiny_llama_dir), dtype="float32", num_pages=256,
                   kv_cache_dtype="fp8_e4m3", warmup=False)  # fmt: skip
    assert torch.equal(again.runner.pool.key_shift, shift)
    assert torch.equal(again.runner.pool.key_gptq, factors)
    ident = kv_identity("m", "w", "float32", again.runner.pool)
    assert f"key_shift={key_shift.digest(shift)};" in ident and "keys=hadamard;" in ident
    assert f"key_gptq={key_shift.digest(factors)};" in ident
    # a prefill/decode pair: the shift is part of what both sides must share
    info = again.runner.info()
    pd = transfer_identity(info, 2, 100, again.runner.pool.key_tag)
    assert key_shift.digest(shift) in pd and pd != transfer_identity(info, 2, 100)
    again.runner.pool.key_shift = shift + 1
    assert kv_identity("m", "w", "float32", again.runner.pool) != ident
    again.close()
    int8 = Engine(str(tiny_llama_dir), dtype="float32", num_pages=256, kv_cache_dtype="int8",
                  warmup=False)  # fmt: skip
    assert int8.runner.pool.key_shift is None and int8.runner.backend.rotation.shift is None
    assert int8.runner.pool.key_gptq is None
    assert "key_shift" not in kv_identity("m", "w", "float32", int8.runner.pool)
    int8.close()


@pytest.fixture(scope="module")
def offset_keys_dir(tmp_path_factory):
    """A tiny Llama whose keys carry an offset, as real models' do: a key bias of 8 on
    each head's slowest rotary pair (channels 7 and 15, which a rope base of 1e6 turns by
    under a hundredth of a radian over the calibration text), the other channels about
    1."""
    from safetensors.torch import load_file, save_file

    folder = make_tiny_model(tmp_path_factory.mktemp("tiny-offset"), "llama", seed=3,
                             attention_bias=True, rope_theta=1e6)  # fmt: skip
    path = folder / "model.safetensors"
    weights = load_file(path)
    for name, w in weights.items():
        if name.endswith("k_proj.bias"):
            b = w.view(-1, 16)  # [kv heads, head_dim]
            b[:, 7] += 8.0
            b[:, 15] += 8.0
    save_file(weights, path, metadata={"format": "pt"})
    return folder


def test_shift_brings_fp8_logits_closer(offset_keys_dir, monkeypatch):
    """bench/kv_quality.py's measure on the tiny model with offset keys: the fp8_e4m3
    pool with shifted keys moves the distributions less from the float32 pool's than
    the same pool without the shift."""
    from radixserve.benchmark.kv_quality import compare, teacher_forced_logits

    text = np.random.default_rng(5).integers(4, 512, 160).tolist()

    def logits(kv, shifted):
        eng = Engine(str(offset_keys_dir), dtype="float32", page_size=16, num_pages=64,
                     kv_cache_dtype=kv, chunked_prefill_size=16, warmup=False)  # fmt: skip
        assert (eng.runner.pool.key_shift is not None) == shifted
        out = teacher_forced_logits(eng, text)
        eng.close()
        return out

    ref = logits("float32", False)
    shifted = compare(ref, logits("fp8_e4m3", True))[0]
    monkeypatch.setattr(key_shift, "applies", lambda pool, cfg: False)
    plain = compare(ref, logits("fp8_e4m3", False))[0]
    assert shifted < 0.6 * plain, (shifted, plain)
