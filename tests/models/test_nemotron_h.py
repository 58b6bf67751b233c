"""Nemotron-H (Mamba-2 layers beside attention and MLP layers) end to end.

The oracle is transformers' own model in float64 (``patch_hf_float64``: its norms,
gated norm, decay, scans and logits, which it computes in float32 even in a float64
model, recompiled to float64); its cached ``generate`` equals its full-forward argmax
loop on these models. Our chunked scan is checked against the one-step recurrence
under random splits, the Engine against transformers with 16-token chunks at page
sizes 1 and 16, with shared prefixes hitting state snapshots, under KV pressure that
retracts requests, and bad checkpoints and configs are refused naming what is wrong.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from radixserve import Engine, SamplingParams
from radixserve.models import mamba2
from radixserve.models.causal_conv import causal_conv, conv_step
from radixserve.models.checkpoint import checkpoint_sources
from radixserve.models.config import ModelConfig
from radixserve.worker.build import build_runner
from radixserve.worker.config import WorkerConfig
from tests.helpers.tiny_models import load_hf_float64, make_tiny_model, tiny_config

GEN = 48


@pytest.fixture(scope="module")
def nemotron_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("tiny-nemotron_h"), "nemotron_h", seed=3)


@pytest.fixture(scope="module")
def hf_tokens(nemotron_dir):
    """Prompt -> transformers' 48 greedy tokens (``generate``, float64), memoised."""
    hf = load_hf_float64(nemotron_dir)
    hf.generation_config.eos_token_id = None  # as ignore_eos: EOS neither stops nor is masked
    memo: dict[tuple[int, ...], list[int]] = {}

    def get(prompt: list[int]) -> list[int]:
        key = tuple(prompt)
        if key not in memo:
            with torch.no_grad():
                out = hf.generate(torch.tensor([prompt]), max_new_tokens=GEN, do_sample=False)
            memo[key] = out[0, len(prompt) :].tolist()
        return memo[key]

    return get


def _prompts(seed: int, lengths: list[int]) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(4, 512, n).tolist() for n in lengths]


def test_chunked_scan_equals_the_recurrence():
    """The one-step form and any split of a sequence into chunked pieces (state carried
    between them) give the outputs and final state of the recurrence written head by
    head (heads sharing their group's B and C), to float64 rounding."""
    rng = torch.Generator().manual_seed(0)
    n, h, g, p, s = 70, 6, 2, 4, 5
    x = torch.randn(n, h, p, generator=rng, dtype=torch.float64)
    dt = torch.rand(n, h, generator=rng, dtype=torch.float64) * 0.5
    A = -torch.rand(h, generator=rng, dtype=torch.float64) * 3
    B = torch.randn(n, g, s, generator=rng, dtype=torch.float64)
    C = torch.randn(n, g, s, generator=rng, dtype=torch.float64)
    s0 = torch.randn(h, p, s, generator=rng, dtype=torch.float64)
    # The recurrence by its definition, head by head (head i reads group i // 3's B, C).
    st, want = s0.clone(), torch.empty(n, h, p, dtype=torch.float64)
    for t in range(n):
        for i in range(h):
            a = (dt[t, i] * A[i]).exp()
            st[i] = a * st[i] + dt[t, i] * x[t, i, :, None] * B[t, i // 3][None, :]
            want[t, i] = st[i] @ C[t, i // 3]
    steps, state = [], s0[None]
    for t in range(n):
        o, state = mamba2.recurrent_step(x[t : t + 1], dt[t : t + 1], A, B[t : t + 1],
                                         C[t : t + 1], state)  # fmt: skip
        steps.append(o[0])
    torch.testing.assert_close(torch.stack(steps), want, rtol=0, atol=1e-12)
    torch.testing.assert_close(state[0], st, rtol=0, atol=1e-12)
    for cuts in ([], [1], [20, 32, 33], [16, 48], [69]):
        outs, state = [], s0
        for lo, hi in zip([0, *cuts], [*cuts, n], strict=True):
            o, state = mamba2.chunked(x[lo:hi], dt[lo:hi], A, B[lo:hi], C[lo:hi], state, chunk=16)
            outs.append(o)
        torch.testing.assert_close(torch.cat(outs), want, rtol=0, atol=1e-12)
        torch.testing.assert_close(state, st, rtol=0, atol=1e-12)


def test_conv_with_bias_carries_its_state():
    """The biased causal convolution over pieces, its state carried, equals it over the
    whole."""
    rng = torch.Generator().manual_seed(1)
    x = torch.randn(30, 6, generator=rng, dtype=torch.float64)
    w = torch.randn(6, 4, generator=rng, dtype=torch.float64)
    b = torch.randn(6, generator=rng, dtype=torch.float64)
    whole, _ = causal_conv(x, torch.zeros(6, 3, dtype=torch.float64), w, b)
    state, parts = torch.zeros(6, 3, dtype=torch.float64), []
    for lo, hi in ((0, 2), (2, 3), (3, 17), (17, 30)):
        if hi - lo == 1:
            out, st = conv_step(x[lo:hi], state[None], w, b)
            state = st[0]
        else:
            out, state = causal_conv(x[lo:hi], state, w, b)
        parts.append(out)
    torch.testing.assert_close(torch.cat(parts), whole, rtol=0, atol=1e-14)


def test_config_fields():
    cfg = ModelConfig.from_hf(tiny_config("nemotron_h"))
    assert cfg.family == "nemotron_h" and cfg.hybrid and cfg.activation == "relu2"
    assert cfg.layer_types == ("mamba", "mlp", "mamba", "full_attention", "moe", "mamba")
    assert cfg.recurrent_layers == (0, 2, 5) and cfg.kv_layers == (3,)
    assert cfg.kv_layer(3) == 0 and cfg.recurrent_index(5) == 2
    assert cfg.mamba is not None and cfg.mamba.conv_dim == 8 * 8 + 2 * 2 * 16
    assert cfg.state_shapes == ((128, 3), (8, 8, 16))
    assert not cfg.qkv_bias and not cfg.qk_norm and cfg.rms_norm_eps == 1e-5
    moe = cfg.moe
    assert moe is not None and moe.sparse_layers == (False,) * 4 + (True, False)
    assert (moe.num_experts, moe.top_k, moe.n_group, moe.topk_group) == (8, 2, 2, 1)
    assert moe.scaling == 2.5 and moe.shared_intermediate_size == 48 and moe.renormalize


def test_router_picks_what_transformers_picks():
    """Nemotron-H's grouped sigmoid router (float32 weights, as transformers keeps them)
    on bfloat16 and float32 inputs: the same experts with the same weights, bit for bit."""
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHTopkRouter

    from radixserve.models.moe import GroupedSigmoidRouter

    hf_cfg = tiny_config("nemotron_h")
    cfg = ModelConfig.from_hf(hf_cfg)
    assert cfg.moe is not None
    hf = NemotronHTopkRouter(hf_cfg)
    ours = GroupedSigmoidRouter(cfg.moe, cfg.hidden_size)
    g = torch.Generator().manual_seed(2)
    for p in (hf.weight, hf.e_score_correction_bias):
        p.data.copy_(torch.randn(p.shape, generator=g) * 0.3)
    ours.weight.data.copy_(hf.weight)
    ours.bias.data.copy_(hf.e_score_correction_bias)
    for dtype in (torch.bfloat16, torch.float32):
        x = torch.randn(61, cfg.hidden_size, generator=g).to(dtype)
        with torch.no_grad():
            _, hf_weights, hf_experts = hf(x)
            weights, experts = ours(x)
        assert torch.equal(experts, hf_experts) and torch.equal(weights, hf_weights)


def test_logits_match_transformers(nemotron_dir):
    """A prompt in three chunks (the states carried by the worker's state pool), then
    decode steps: logits within 1e-9 of transformers' float64 forward over the whole
    sequence; every parameter comes from the checkpoint."""
    from radixserve.protocol import Step, StepReq

    runner = build_runner(
        WorkerConfig(
            model=str(nemotron_dir), dtype="float64", page_size=4, num_pages=64, warmup=False
        )  # fmt: skip
    )
    assert set(dict(runner.model.named_parameters())) <= set(
        checkpoint_sources(runner.model_config)
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
    hf = load_hf_float64(nemotron_dir)
    with torch.no_grad():
        want = hf(input_ids=torch.tensor([ids[:pos]])).logits[0]
    assert want.dtype == torch.float64
    for row, logits in got.items():
        assert (logits - want[row]).abs().max().item() < 1e-9


@pytest.mark.parametrize("page_size", [1, 16])
def test_engine_greedy_and_shared_prefix(nemotron_dir, hf_tokens, page_size):
    """Three prompts sharing a 48-token prefix arrive together (prefill in 16-token
    chunks): the prefix is computed once; a second round of new questions on it hits at
    least 90% of it. Every output equals transformers' 48 greedy tokens."""
    rng = np.random.default_rng(4)
    shared = rng.integers(4, 512, 48).tolist()
    first = [shared + rng.integers(4, 512, n).tolist() for n in (7, 19, 3)]
    second = [shared + rng.integers(4, 512, n).tolist() for n in (11, 2)]
    eng = Engine(str(nemotron_dir), dtype="float64", page_size=page_size,
                 num_pages=2048 // page_size, chunked_prefill_size=16)  # fmt: skip
    sp = SamplingParams(max_tokens=GEN, temperature=0.0, ignore_eos=True)
    r1 = eng.generate(first, sp)
    assert [r.token_ids for r in r1] == [hf_tokens(p) for p in first]
    assert [r.usage.cached_tokens for r in r1] == [0, 48, 48]
    r2 = eng.generate(second, sp)
    assert [r.token_ids for r in r2] == [hf_tokens(p) for p in second]
    assert all(r.usage.cached_tokens >= 0.9 * len(shared) for r in r2)
    eng.check_idle()


def test_snapshot_in_the_middle_of_a_chunk(nemotron_dir):
    """Page size 1, 16-token chunks: the first prompt takes the whole budget and saves
    its state where the other two part from it, 40 tokens in (inside its third chunk,
    so the scan runs in two pieces around the save); both hit all 40. Tokens equal the
    cache-off engine's."""
    rng = np.random.default_rng(8)
    shared = rng.integers(4, 512, 40).tolist()
    prompts = [shared + rng.integers(4, 512, n).tolist() for n in (9, 4, 13)]
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    eng = Engine(str(nemotron_dir), dtype="float64", num_pages=512, chunked_prefill_size=16)
    cold = Engine(str(nemotron_dir), dtype="float64", num_pages=512, cache="none")
    got = eng.generate(prompts, sp)
    assert [r.token_ids for r in got] == [r.token_ids for r in cold.generate(prompts, sp)]
    assert [r.usage.cached_tokens for r in got] == [0, 40, 40]
    eng.check_idle()


def test_multi_turn_resumes_from_the_last_turn(nemotron_dir):
    """Each turn sends the whole conversation so far: it hits everything the last turn
    computed in whole pages (the snapshot its release saved), and its tokens equal the
    cache-off engine's."""
    rng = np.random.default_rng(6)
    convs = [rng.integers(4, 512, n).tolist() for n in (21, 30)]
    sp = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    eng = Engine(str(nemotron_dir), dtype="float64", page_size=4, num_pages=512,
                 chunked_prefill_size=16)  # fmt: skip
    cold = Engine(str(nemotron_dir), dtype="float64", page_size=4, num_pages=512, cache="none")
    computed = [0, 0]
    for _ in range(3):
        got = eng.generate(convs, sp)
        assert [r.token_ids for r in got] == [r.token_ids for r in cold.generate(convs, sp)]
        assert [r.usage.cached_tokens for r in got] == [c - c % 4 for c in computed]
        computed = [len(c) + len(r.token_ids) - 1 for c, r in zip(convs, got, strict=True)]
        convs = [c + r.token_ids + rng.integers(4, 512, 5).tolist() for c, r in zip(convs, got)]
    eng.check_idle()


def test_retraction_under_kv_pressure(nemotron_dir, hf_tokens):
    """A pool too small for six requests' decodes: some are retracted and readmitted
    (restoring the snapshots their release left), and every output still equals
    transformers'."""
    rng = np.random.default_rng(4)
    shared = rng.integers(4, 512, 48).tolist()
    prompts = [shared + rng.integers(4, 512, n).tolist() for n in (7, 19, 3)] * 2
    eng = Engine(str(nemotron_dir), dtype="float64", page_size=4, num_pages=48,
                 chunked_prefill_size=16, decode_reserve_ratio=0.0)  # fmt: skip
    sp = SamplingParams(max_tokens=GEN, temperature=0.0, ignore_eos=True)
    assert [r.token_ids for r in eng.generate(prompts, sp)] == [hf_tokens(p) for p in prompts]
    stats = eng.stats()
    assert stats["preemptions"] > 0 and stats["hit_tokens"] > 0
    eng.check_idle()


def test_model_layout_is_read_as_backbone(tmp_path, nemotron_dir):
    """A checkpoint under ``model.`` (not the Hub's ``backbone.``) loads the same weights."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "renamed"
    folder.mkdir()
    (folder / "config.json").write_text((nemotron_dir / "config.json").read_text())
    weights = load_file(str(nemotron_dir / "model.safetensors"))
    save_file({k.replace("backbone.", "model.", 1): v for k, v in weights.items()},
              str(folder / "model.safetensors"))  # fmt: skip
    runners = [build_runner(WorkerConfig(model=str(f), dtype="float64", num_pages=16,
                                        warmup=False)) for f in (nemotron_dir, folder)]  # fmt: skip
    a, b = (dict(r.model.named_parameters()) for r in runners)
    assert all(torch.equal(a[n], b[n]) for n in a)


def test_bad_checkpoints_are_refused(tmp_path):
    folder = make_tiny_model(tmp_path / "m", "nemotron_h", tokenizer=False)
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig

    weights = load_file(str(folder / "model.safetensors"))
    good = dict(weights)
    del weights["backbone.layers.2.mixer.dt_bias"]
    save_file(weights, str(folder / "model.safetensors"))
    with pytest.raises(KeyError, match=r"backbone\.layers\.2\.mixer\.dt_bias"):
        build_runner(WorkerConfig(model=str(folder), dtype="float64", num_pages=16, warmup=False))
    good["backbone.layers.0.mixer.D"] = torch.zeros(7, dtype=torch.float64)
    save_file(good, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=r"shape mismatch for .*layers\.0\.mixer\.D"):
        build_runner(WorkerConfig(model=str(folder), dtype="float64", num_pages=16, warmup=False))
    config = json.loads((folder / "config.json").read_text())
    for key, value, message in (
        ("moe_latent_size", 16, "moe_latent_size"),
        ("n_group", 3, "must be n_group 3 groups"),
        ("layers_block_type", ["linear_attention", "mlp"], "without an attention layer"),
        ("n_groups", 3, "not a multiple of n_groups"),
        ("mlp_hidden_act", "silu", "mlp_hidden_act"),
        ("sliding_window", 16, "sliding_window"),
    ):  # fmt: skip
        bad = tmp_path / f"bad-{key}-{message[:8].replace(' ', '_')}"
        bad.mkdir()
        (bad / "config.json").write_text(json.dumps({**config, key: value}))
        with pytest.raises(ValueError, match=message):
            ModelConfig.from_hf(AutoConfig.from_pretrained(str(bad)))
