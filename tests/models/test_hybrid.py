"""Hybrid models (Qwen3.5: gated delta-net layers beside gated attention; Qwen3-Next and
Qwen3.5-MoE: the same with MoE MLPs) end to end.

The oracle is transformers' own ``generate`` in float64 (``patch_hf_float64``: its
norms, rotary, decay and delta rule in float64, the rule by its token-by-token
definition). Our chunked delta rule is checked against the recurrent one under
random splits, the Engine against transformers with 16-token chunks at page sizes
1 and 16, under KV pressure that retracts requests, and bad checkpoints are refused
naming what is wrong.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from radixserve import Engine, SamplingParams
from radixserve.models import gated_delta
from radixserve.models.causal_conv import causal_conv, conv_step
from radixserve.models.config import ModelConfig
from radixserve.worker.build import build_runner
from radixserve.worker.config import WorkerConfig
from tests.helpers.tiny_models import load_hf_float64, make_tiny_model, tiny_config

GEN = 48


@pytest.fixture(scope="module")
def qwen3_5_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen3_5"), "qwen3_5", seed=5)


@pytest.fixture(scope="module")
def qwen3_next_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen3_next"), "qwen3_next", seed=5)


#: The families built from hybrid.py's layers; tests taking ``family_dir`` run for each.
FAMILIES = ("qwen3_5", "qwen3_next", "qwen3_5_moe")


@pytest.fixture(scope="module")
def qwen3_5_moe_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-qwen3_5_moe"), "qwen3_5_moe", seed=5)


@pytest.fixture(params=FAMILIES)
def family_dir(request):
    return request.getfixturevalue(f"{request.param}_dir")


@pytest.fixture(scope="module")
def hf_greedy_tokens():
    """(model folder, prompt) -> transformers' 48 greedy tokens (``generate``, float64),
    memoised."""
    models: dict = {}
    memo: dict[tuple, list[int]] = {}

    def get(folder, prompt: list[int]) -> list[int]:
        key = (str(folder), tuple(prompt))
        if key not in memo:
            if str(folder) not in models:
                hf = load_hf_float64(folder)
                hf.generation_config.eos_token_id = (
                    None  # as ignore_eos: EOS neither stops nor is masked
                )
                models[str(folder)] = hf
            with torch.no_grad():
                out = models[str(folder)].generate(
                    torch.tensor([prompt]), max_new_tokens=GEN, do_sample=False
                )
            memo[key] = out[0, len(prompt) :].tolist()
        return memo[key]

    return get


@pytest.fixture(scope="module")
def hf_tokens(qwen3_5_dir, hf_greedy_tokens):
    """Prompt -> transformers' 48 greedy tokens for the Qwen3.5 model."""
    return lambda prompt: hf_greedy_tokens(qwen3_5_dir, prompt)


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(4, 512, n).tolist() for n in lengths]


def test_chunked_delta_rule_equals_the_recurrence():
    """Any split of a sequence into chunked pieces (state carried between them) gives the
    outputs and final state of the token-by-token recurrence, to float64 rounding."""
    rng = torch.Generator().manual_seed(0)
    n, h, dk, dv = 70, 3, 8, 5
    q = gated_delta.l2_normalize(torch.randn(n, h, dk, generator=rng, dtype=torch.float64))
    k = gated_delta.l2_normalize(torch.randn(n, h, dk, generator=rng, dtype=torch.float64))
    v = torch.randn(n, h, dv, generator=rng, dtype=torch.float64)
    g = -torch.rand(n, h, generator=rng, dtype=torch.float64) * 2
    beta = torch.rand(n, h, generator=rng, dtype=torch.float64)
    s0 = torch.randn(h, dk, dv, generator=rng, dtype=torch.float64)
    want, s = [], s0[None]
    for t in range(n):
        o, s = gated_delta.recurrent_step(q[t : t + 1], k[t : t + 1], v[t : t + 1],
                                          g[t : t + 1], beta[t : t + 1], s)  # fmt: skip
        want.append(o[0])
    want = torch.stack(want)
    for cuts in ([], [1], [20, 32, 33], [16, 48], [69]):
        outs, state = [], s0
        for lo, hi in zip([0, *cuts], [*cuts, n], strict=True):
            o, state = gated_delta.chunked(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi],
                                           beta[lo:hi], state, chunk=16)  # fmt: skip
            outs.append(o)
        torch.testing.assert_close(torch.cat(outs), want, rtol=0, atol=1e-12)
        torch.testing.assert_close(state, s[0], rtol=0, atol=1e-12)


def test_conv_carries_its_state():
    """The causal convolution over pieces, its state carried, equals it over the whole."""
    rng = torch.Generator().manual_seed(1)
    x = torch.randn(30, 6, generator=rng, dtype=torch.float64)
    w = torch.randn(6, 4, generator=rng, dtype=torch.float64)
    whole, _ = causal_conv(x, torch.zeros(6, 3, dtype=torch.float64), w)
    state, parts = torch.zeros(6, 3, dtype=torch.float64), []
    for lo, hi in ((0, 2), (2, 3), (3, 17), (17, 30)):
        if hi - lo == 1:
            out, st = conv_step(x[lo:hi], state[None], w)
            state = st[0]
        else:
            out, state = causal_conv(x[lo:hi], state, w)
        parts.append(out)
    torch.testing.assert_close(torch.cat(parts), whole, rtol=0, atol=1e-14)


def test_config_fields():
    cfg = ModelConfig.from_hf(tiny_config("qwen3_5"))
    assert cfg.family == "qwen3_5" and cfg.hybrid and cfg.attn_output_gate
    assert cfg.recurrent_layers == (0, 1, 2) and cfg.kv_layers == (3,)
    assert cfg.kv_layer(3) == 0 and cfg.recurrent_index(2) == 2
    assert cfg.rotary_dim == 4 and cfg.norm_unit_offset and cfg.qk_norm
    assert cfg.linear is not None and cfg.linear.conv_dim == 2 * 2 * 16 + 4 * 8


def test_logits_match_transformers(family_dir):
    """A prompt in three chunks (the states carried by the worker's state pool), then
    decode steps: logits within 1e-9 of transformers' float64 forward over the whole
    sequence (causal: its row p is the logits after p + 1 tokens)."""
    from radixserve.protocol import Step, StepReq

    runner = build_runner(
        WorkerConfig(
            model=str(family_dir), dtype="float64", page_size=4, num_pages=64, warmup=False
        )  # fmt: skip
    )
    assert runner.pool.num_layers == 1 and runner.info().state_bytes > 0
    ids = _prompts(7, [90])[0]
    greedy = SamplingParams(temperature=0.0)
    pos, got = 0, {}
    for n in (37, 40, 13, 1, 1, 1):
        pages = np.arange(-(-pos // 4), -(-(pos + n) // 4), dtype=np.int32)
        step = StepReq(0, np.asarray(ids[pos : pos + n], np.int32), pos, pages, True,
                       greedy if pos == 0 else None)  # fmt: skip
        got[pos + n - 1] = logits = runner.forward_logits(Step([step]))[0]
        pos += n
        if pos == len(ids):
            ids.append(int(logits.argmax()))
    hf = load_hf_float64(family_dir)
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([ids[:pos]])).logits[0]
    for row, logits in got.items():
        assert (logits - want[row]).abs().max().item() < 1e-9


@pytest.mark.parametrize("page_size", [1, 16])
def test_engine_greedy_equals_transformers(family_dir, hf_greedy_tokens, page_size):
    """Three prompts together, prefill in 16-token chunks: 48 greedy tokens each equal
    transformers' ``generate``."""
    prompts = _prompts(11, [40, 57, 9])
    eng = Engine(str(family_dir), dtype="float64", page_size=page_size,
                 num_pages=2048 // page_size, chunked_prefill_size=16)  # fmt: skip
    sp = SamplingParams(max_tokens=GEN, temperature=0.0, ignore_eos=True)
    want = [hf_greedy_tokens(family_dir, p) for p in prompts]
    assert [r.token_ids for r in eng.generate(prompts, sp)] == want
    eng.check_idle()


def test_retraction_under_kv_pressure(qwen3_5_dir, hf_tokens):
    """A pool too small for six requests' decodes: some are retracted and readmitted
    (their states recomputed from the start), and every output still equals
    transformers'."""
    prompts = _prompts(11, [40, 57, 9]) * 2
    eng = Engine(str(qwen3_5_dir), dtype="float64", page_size=4, num_pages=40,
                 chunked_prefill_size=16, decode_reserve_ratio=0.0)  # fmt: skip
    sp = SamplingParams(max_tokens=GEN, temperature=0.0, ignore_eos=True)
    assert [r.token_ids for r in eng.generate(prompts, sp)] == [hf_tokens(p) for p in prompts]
    stats = eng.stats()
    assert stats["preemptions"] > 0
    # Readmitted requests restore the snapshot their release left and resume there.
    assert stats["hit_tokens"] > 0
    eng.check_idle()


@pytest.mark.parametrize("page_size", [1, 16])
def test_shared_prefix_hits_its_snapshots(family_dir, hf_greedy_tokens, page_size):
    """Three prompts sharing a 48-token prefix arrive together: the prefix is computed
    once (the others wait, and the first saves its state where they diverge); a second
    round of new questions on it hits at least 90% of it. Every output equals
    transformers'."""
    rng = np.random.default_rng(4)
    shared = rng.integers(4, 512, 48).tolist()
    first = [shared + rng.integers(4, 512, n).tolist() for n in (7, 19, 3)]
    second = [shared + rng.integers(4, 512, n).tolist() for n in (11, 2)]
    eng = Engine(str(family_dir), dtype="float64", page_size=page_size,
                 num_pages=2048 // page_size, chunked_prefill_size=16)  # fmt: skip
    sp = SamplingParams(max_tokens=GEN, temperature=0.0, ignore_eos=True)
    r1 = eng.generate(first, sp)
    assert [r.token_ids for r in r1] == [hf_greedy_tokens(family_dir, p) for p in first]
    assert [r.usage.cached_tokens for r in r1] == [0, 48, 48]
    r2 = eng.generate(second, sp)
    assert [r.token_ids for r in r2] == [hf_greedy_tokens(family_dir, p) for p in second]
    assert all(r.usage.cached_tokens >= 0.9 * len(shared) for r in r2)
    eng.check_idle()


def test_requests_left_waiting_mark_where_they_diverge(qwen3_5_dir):
    """Page size 1, 16-token chunks: the first prompt takes the whole budget, so the
    other two wait without being looked at by admission; still its prefill saves its
    state where they part from it (40 tokens, between two chunk ends), and both hit
    all 40. Tokens equal the cache-off engine's."""
    rng = np.random.default_rng(8)
    shared = rng.integers(4, 512, 40).tolist()
    prompts = [shared + rng.integers(4, 512, n).tolist() for n in (9, 4, 13)]
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    eng = Engine(str(qwen3_5_dir), dtype="float64", num_pages=512, chunked_prefill_size=16)
    cold = Engine(str(qwen3_5_dir), dtype="float64", num_pages=512, cache="none")
    got = eng.generate(prompts, sp)
    assert [r.token_ids for r in got] == [r.token_ids for r in cold.generate(prompts, sp)]
    assert [r.usage.cached_tokens for r in got] == [0, 40, 40]
    eng.check_idle()


def test_last_chunk_saves_the_divergence_and_the_prompt_end(qwen3_5_dir):
    """The first prompt's last chunk, [32, 49), holds both where the others part from it
    (40) and its own last boundary before its last token (48): it saves both, so the
    others hit 40 and the same prompt sent again hits 48 (one save a step: only 40)."""
    rng = np.random.default_rng(8)
    shared = rng.integers(4, 512, 40).tolist()
    prompts = [shared + rng.integers(4, 512, n).tolist() for n in (9, 4, 13)]
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    eng = Engine(str(qwen3_5_dir), dtype="float64", num_pages=512, chunked_prefill_size=16)
    first = eng.generate(prompts, sp)
    assert [r.usage.cached_tokens for r in first] == [0, 40, 40]
    again = eng.generate([prompts[0]], sp)[0]
    assert again.usage.cached_tokens == 48 and again.token_ids == first[0].token_ids
    eng.check_idle()


def test_multi_turn_resumes_from_the_last_turn(qwen3_5_dir):
    """Each turn sends the whole conversation so far: it hits everything the last
    turn computed, in whole pages (its snapshot saved at release), and its tokens
    equal those of the cache-off engine (itself checked against transformers above)."""
    rng = np.random.default_rng(6)
    convs = [rng.integers(4, 512, n).tolist() for n in (21, 30)]
    sp = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    eng = Engine(str(qwen3_5_dir), dtype="float64", page_size=4, num_pages=512,
                 chunked_prefill_size=16)  # fmt: skip
    cold = Engine(str(qwen3_5_dir), dtype="float64", page_size=4, num_pages=512, cache="none")
    computed = [0, 0]
    for _ in range(3):
        got = eng.generate(convs, sp)
        assert [r.token_ids for r in got] == [r.token_ids for r in cold.generate(convs, sp)]
        assert [r.usage.cached_tokens for r in got] == [c - c % 4 for c in computed]
        # The last sampled token has no KV yet: what a turn computed ends before it.
        computed = [len(c) + len(r.token_ids) - 1 for c, r in zip(convs, got, strict=True)]
        convs = [c + r.token_ids + rng.integers(4, 512, 5).tolist() for c, r in zip(convs, got)]
    eng.check_idle()


def test_worker_refuses_a_mid_sequence_start_without_a_snapshot(qwen3_5_dir):
    from radixserve.protocol import Step, StepReq

    runner = build_runner(
        WorkerConfig(
            model=str(qwen3_5_dir), dtype="float64", num_pages=64, warmup=False, state_snapshots=2
        )  # fmt: skip
    )
    greedy = SamplingParams(temperature=0.0)
    ids = np.arange(4, 12, dtype=np.int32)
    with pytest.raises(ValueError, match="without a state snapshot"):
        runner.step(Step([StepReq(0, ids, 8, np.arange(16, dtype=np.int32), True, greedy)]))
    with pytest.raises(ValueError, match="state snapshot 2 out of range"):
        runner.step(Step([StepReq(1, ids, 0, np.arange(8, dtype=np.int32), True, greedy,
                                  state_save_at=8, state_save=2)]))  # fmt: skip
    with pytest.raises(ValueError, match="state_save_at 9"):
        runner.step(Step([StepReq(2, ids, 0, np.arange(8, dtype=np.int32), True, greedy,
                                  state_save_at=9, state_save=1)]))  # fmt: skip
    with pytest.raises(ValueError, match=r"state_save2_at 4 not in \(4, 8\]"):
        runner.step(Step([StepReq(3, ids, 0, np.arange(8, dtype=np.int32), True, greedy,
                                  state_save_at=4, state_save=0, state_save2_at=4,
                                  state_save2=1)]))  # fmt: skip


def test_bad_checkpoints_are_refused(tmp_path):
    folder = make_tiny_model(tmp_path / "m", "qwen3_5", tokenizer=False)
    from safetensors.torch import load_file, save_file

    weights = load_file(str(folder / "model.safetensors"))
    del weights["model.layers.1.linear_attn.A_log"]
    save_file(weights, str(folder / "model.safetensors"))
    with pytest.raises(KeyError, match=r"model\.layers\.1\.linear_attn\.A_log"):
        build_runner(WorkerConfig(model=str(folder), dtype="float64", num_pages=16, warmup=False))
    config = json.loads((folder / "config.json").read_text())
    for key, value, message in (
        ("linear_num_value_heads", 3, "not a multiple of linear_num_key_heads"),
        ("layer_types", ["linear_attention"] * 4, "without a full-attention layer"),
    ):  # fmt: skip
        bad = tmp_path / f"bad-{key}-{len(str(value))}"
        bad.mkdir()
        (bad / "config.json").write_text(json.dumps({**config, key: value}))
        from transformers import AutoConfig

        with pytest.raises(ValueError, match=message):
            ModelConfig.from_hf(AutoConfig.from_pretrained(str(bad)))


def test_qwen3_next_and_qwen3_5_moe_config_and_layout():
    """Qwen3-Next: Qwen3.5's layers, MoE on every layer but ``mlp_only_layers`` with a
    gated shared expert; the delta-net projection rows interleaved per key head are
    put into Qwen3.5's order (q, k, v, z, b, a)."""
    from radixserve.models.hybrid import grouped_rows

    cfg = ModelConfig.from_hf(tiny_config("qwen3_next"))
    assert cfg.family == "qwen3_next" and cfg.hybrid and cfg.attn_output_gate
    assert cfg.recurrent_layers == (0, 1, 2) and cfg.kv_layers == (3,)
    assert cfg.rotary_dim == 4 and cfg.norm_unit_offset and cfg.qk_norm
    assert cfg.moe is not None and cfg.moe.sparse_layers == (True, True, False, True)
    assert cfg.moe.shared_gate and cfg.moe.shared_intermediate_size == 48
    assert cfg.moe.renormalize and (cfg.moe.num_experts, cfg.moe.top_k) == (8, 2)
    # Qwen3.5-MoE: the same MoE on every layer, always renormalised, Qwen3.5's projections.
    moe = ModelConfig.from_hf(tiny_config("qwen3_5_moe")).moe
    assert moe is not None and moe.sparse_layers == (True,) * 4 and moe.renormalize
    assert moe.shared_gate and moe.shared_intermediate_size == 48
    # 2 key heads of 3, 4 value heads of 2 (2 per key head): label each checkpoint row.
    rows = []
    for h in range(2):
        rows += [f"q{h}"] * 3 + [f"k{h}"] * 3
        rows += [f"v{2 * h + j}" for j in range(2) for _ in range(2)]
        rows += [f"z{2 * h + j}" for j in range(2) for _ in range(2)]
    for h in range(2):
        rows += [f"b{2 * h}", f"b{2 * h + 1}", f"a{2 * h}", f"a{2 * h + 1}"]
    got = [rows[i] for i in grouped_rows(2, 4, 3, 2).tolist()]
    want = [f"{x}{h}" for x, n, d in (("q", 2, 3), ("k", 2, 3), ("v", 4, 2), ("z", 4, 2),
                                      ("b", 4, 1), ("a", 4, 1)) for h in range(n) for _ in range(d)]  # fmt: skip
    assert got == want


def test_bad_qwen3_next_checkpoints_are_refused(tmp_path):
    folder = make_tiny_model(tmp_path / "m", "qwen3_next", tokenizer=False)
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    weights = load_file(str(folder / "model.safetensors"))
    for name in ("model.layers.1.linear_attn.in_proj_ba.weight",
                 "model.layers.3.mlp.shared_expert_gate.weight"):  # fmt: skip
        broken = dict(weights)
        del broken[name]
        save_file(broken, str(folder / "model.safetensors"))
        with pytest.raises(KeyError, match=name.replace(".", r"\.")):
            build_runner(
                WorkerConfig(model=str(folder), dtype="float64", num_pages=16, warmup=False)
            )
    config = json.loads((folder / "config.json").read_text())
    for key, value, message in (
        ("shared_expert_intermediate_size", 0, "shared_expert_intermediate_size must be > 0"),
        ("layer_types", ["linear_attention"] * 3 + ["sliding_attention"], "unsupported layer types"),
    ):  # fmt: skip
        bad = tmp_path / f"bad-{key}"
        bad.mkdir()
        (bad / "config.json").write_text(json.dumps({**config, key: value}))
        with pytest.raises(ValueError, match=message):
            ModelConfig.from_hf(AutoConfig.from_pretrained(str(bad)))
