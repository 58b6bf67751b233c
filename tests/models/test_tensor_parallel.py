"""Tensor-parallel sharding (models/sharding.py, layers/parallel.py) against one rank and
against transformers, with ranks simulated by threads in this process
(tests/helpers/tp.py): every rank runs a real ``ModelRunner`` over its shard, its
own KV pool and page tables; only the collectives are simulated. The real
multi-process group (gloo) is tested in tests/worker/test_tp_group.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from radixserve.models.config import ModelConfig
from radixserve.models.sharding import Shard, check_tp, head_shard
from radixserve.protocol import Step, StepReq
from radixserve.sampling_params import SamplingParams
from radixserve.worker.build import build_runner
from radixserve.worker.config import WorkerConfig
from radixserve.worker.model_runner import ModelRunner
from tests.helpers.tiny_models import hf_greedy, make_tiny_model, patch_hf_float64, tiny_config
from tests.helpers.tp import run_ranks

GREEDY = SamplingParams(temperature=0.0)
PROMPT_LEN, GEN_LEN = 24, 12


def _runner(folder, page_size: int, tp: int = 1, comm=None) -> ModelRunner:
    config = WorkerConfig(
        model=str(folder), dtype="float64", page_size=page_size,
        num_pages=256 // page_size + 8, max_running_requests=4, warmup=False, tp=tp,
        sliding_pool_pages=0,  # steps built by hand: one pool, no window pages
    )  # fmt: skip
    return build_runner(config) if comm is None else build_runner(config, comm=comm)


def _greedy(runner: ModelRunner, prompt: np.ndarray, chunks: list[int], comm=None):
    """Prefill in ``chunks``, then decode greedily: (tokens, first-step logits). Page ids
    come in a fixed shuffled order, the same on every rank; each sampled token
    reaches the followers (the scheduler's part in a server) through ``comm``."""
    s = runner.page_size
    free = list(np.random.default_rng(0).permutation(runner.num_pages))
    held, pos, tokens, first_logits = 0, 0, [], None

    def grow(total: int) -> np.ndarray:
        nonlocal held
        need = -(-total // s) - held
        held += max(0, need)
        return np.array([free.pop() for _ in range(max(0, need))], dtype=np.int32)

    for i, size in enumerate(chunks):
        last = pos + size == len(prompt)
        req = StepReq(0, prompt[pos : pos + size], pos, grow(pos + size), last,
                      GREEDY if i == 0 else None)  # fmt: skip
        logits = runner.forward_logits(Step([req]))
        pos += size
        if last:
            first_logits = logits[0].clone() if len(logits) else None
            tokens.append(_share(int(logits[0].argmax()) if len(logits) else 0, comm))
    while len(tokens) < GEN_LEN:
        req = StepReq(0, np.array(tokens[-1:], np.int32), pos, grow(pos + 1), True)
        out = runner.step(Step([req]))
        tokens.append(_share(int(out.tokens[0]) if len(out.tokens) else 0, comm))
        pos += 1
    runner.step(Step([], release=[0]))
    return tokens, first_logits


def _share(token: int, comm) -> int:
    """Rank 0's token on every rank (the followers pass 0)."""
    if comm is None:
        return token
    return int(comm.all_reduce(torch.tensor([token]))[0])


def _tp_run(folder, tp: int, page_size: int, prompt, chunks):
    results = run_ranks(
        tp, lambda comm: _greedy(_runner(folder, page_size, tp, comm), prompt, chunks, comm)
    )
    for _, logits in results[1:]:  # followers get no logits
        assert logits is None
    return results[0]


@pytest.fixture(scope="module")
def llama_8_4(tmp_path_factory):
    """8 query / 4 KV heads: TP=2 splits KV heads, TP=4 splits them one per rank."""
    return make_tiny_model(tmp_path_factory.mktemp("tp-llama"), "llama", seed=5,
                           num_attention_heads=8, num_key_value_heads=4)  # fmt: skip


@pytest.fixture(scope="module")
def llama_8_2(tmp_path_factory):
    """8 query / 2 KV heads: at TP=4 each KV head is replicated on two ranks."""
    return make_tiny_model(tmp_path_factory.mktemp("tp-gqa"), "llama", seed=6,
                           num_attention_heads=8, num_key_value_heads=2)  # fmt: skip


def _hf(folder):
    from transformers import AutoModelForCausalLM

    return patch_hf_float64(
        AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()
    )


@pytest.mark.parametrize(
    "model,tp,page_size,chunks",
    [
        ("llama_8_4", 2, 1, [PROMPT_LEN]),
        ("llama_8_4", 2, 16, [5, 11, 8]),
        ("llama_8_4", 4, 16, [PROMPT_LEN]),
        ("llama_8_2", 4, 1, [9, 15]),
    ],
)
def test_tp_greedy_and_logits_equal_one_rank_and_hf(request, model, tp, page_size, chunks):
    folder = request.getfixturevalue(model)
    prompt = np.random.default_rng(7).integers(4, 512, PROMPT_LEN).astype(np.int32)
    one_tokens, one_logits = _greedy(_runner(folder, page_size), prompt, chunks)
    tp_tokens, tp_logits = _tp_run(folder, tp, page_size, prompt, chunks)
    assert tp_tokens == one_tokens
    assert torch.allclose(tp_logits, one_logits, atol=1e-9, rtol=0)
    hf_tokens, hf_logits = hf_greedy(_hf(folder), prompt, GEN_LEN)
    assert tp_tokens == hf_tokens
    assert torch.allclose(tp_logits, hf_logits, atol=1e-9, rtol=0)


@pytest.mark.parametrize("family", ["qwen2", "phi3", "qwen3_moe", "gemma2"])
def test_tp_families_match_one_rank(family, tiny_qwen2_dir, tiny_family_dir):
    """qkv biases (Qwen2), fused qkv/gate_up checkpoints (Phi-3), split experts
    (Qwen3-MoE), soft-caps and sandwich norms (Gemma 2) at TP=2."""
    folder = tiny_qwen2_dir if family == "qwen2" else tiny_family_dir(family)
    prompt = np.random.default_rng(8).integers(4, 512, PROMPT_LEN).astype(np.int32)
    one_tokens, one_logits = _greedy(_runner(folder, 16), prompt, [10, 14])
    tp_tokens, tp_logits = _tp_run(folder, 2, 16, prompt, [10, 14])
    assert tp_tokens == one_tokens
    assert torch.allclose(tp_logits, one_logits, atol=1e-9, rtol=0)


def test_tp3_pads_the_vocabulary_and_splits_9_3_heads(tmp_path):
    """SmolLM2's head layout (9 query / 3 KV heads) at TP=3; 512 tokens over 3 ranks
    leaves the last rank's vocabulary block padded."""
    folder = make_tiny_model(tmp_path, "llama", seed=9, hidden_size=144, num_attention_heads=9,
                             num_key_value_heads=3, intermediate_size=96)  # fmt: skip
    prompt = np.random.default_rng(9).integers(4, 512, PROMPT_LEN).astype(np.int32)
    one_tokens, one_logits = _greedy(_runner(folder, 1), prompt, [PROMPT_LEN])
    tp_tokens, tp_logits = _tp_run(folder, 3, 1, prompt, [PROMPT_LEN])
    assert tp_tokens == one_tokens
    assert tp_logits.shape == one_logits.shape == (512,)
    assert torch.allclose(tp_logits, one_logits, atol=1e-9, rtol=0)


def test_shards_hold_a_share_of_the_weights_and_kv(llama_8_4):
    ones = _runner(llama_8_4, 1)
    halves = run_ranks(2, lambda comm: _runner(llama_8_4, 1, 2, comm))
    for r in halves:
        assert r.pool.num_kv_heads == 2 and r.num_pages == ones.num_pages
        assert r.kv_bytes * 2 == ones.kv_bytes
        # Norms are replicated: a little more than half.
        assert 0.5 < r.weight_bytes / ones.weight_bytes < 0.52
    assert halves[0].info().tp == 2


def _cfg(heads: int, kv: int, inter: int = 128) -> ModelConfig:
    return ModelConfig.from_hf(
        tiny_config("llama", num_attention_heads=heads, num_key_value_heads=kv,
                    hidden_size=heads * 16, intermediate_size=inter)
    )  # fmt: skip


def test_unsplittable_models_are_refused_naming_the_numbers():
    with pytest.raises(ValueError, match="9 attention heads are not divisible by 2"):
        check_tp(_cfg(9, 3), 2)
    with pytest.raises(ValueError, match="6 KV heads are not divisible by 4"):
        check_tp(_cfg(12, 6), 4)
    with pytest.raises(ValueError, match="4 ranks are not a multiple of the 3 KV heads"):
        check_tp(_cfg(12, 3), 4)
    with pytest.raises(ValueError, match="intermediate size 100 is not divisible by 8"):
        check_tp(_cfg(8, 8, inter=100), 8)
    check_tp(_cfg(8, 2), 8)  # KV heads replicated 4 times


def test_replicated_kv_heads_follow_their_query_heads():
    cfg = _cfg(8, 2)
    layout = [head_shard(cfg, Shard(r, 4)) for r in range(4)]
    assert [(h.q_start, h.q_heads, h.kv_start, h.kv_heads) for h in layout] == [
        (0, 2, 0, 1), (2, 2, 0, 1), (4, 2, 1, 1), (6, 2, 1, 1),
    ]  # fmt: skip


def test_tp_host_tier_copies_each_ranks_heads(llama_8_4):
    """With tensor parallelism every rank keeps its own KV heads' host copies under
    the same slot ids: pages demoted, overwritten in the pool and promoted into other
    pages give the last prompt token bit-identical logits."""
    from radixserve.protocol import PageCopies

    prompt = np.random.default_rng(8).integers(4, 512, 17).astype(np.int32)
    i32 = lambda xs: np.asarray(xs, dtype=np.int32)  # noqa: E731

    def run(comm):
        config = WorkerConfig(
            model=str(llama_8_4), dtype="float64", page_size=4, num_pages=24,
            max_running_requests=4, warmup=False, tp=2, host_cache_gb=2**-15,
        )  # fmt: skip
        runner = build_runner(config, comm=comm)
        first, second = i32([3, 7, 1, 9]), i32([12, 20, 15, 4])
        # 16 tokens in whole pages, then the last one read through two page tables.
        runner.step(Step([StepReq(0, prompt[:16], 0, first, False, GREEDY)]))
        want = runner.forward_logits(
            Step([StepReq(1, prompt[16:], 16, i32([*first, 22]), True, GREEDY)])
        )
        runner.step(Step([], release=i32([0, 1])))
        runner.step(
            Step([], copies=[PageCopies(demote_pages=first, demote_slots=i32([5, 0, 2, 1]))])
        )
        for layer in runner.pool.layers:
            layer[first] = torch.randn_like(layer[first])
        runner.step(
            Step([], copies=[PageCopies(promote_slots=i32([5, 0, 2, 1]), promote_pages=second)])
        )
        got = runner.forward_logits(
            Step([StepReq(2, prompt[16:], 16, i32([*second, 23]), True, GREEDY)])
        )
        return runner.info().host_pages, want, got

    results = run_ranks(2, run)
    assert results[0][0] == results[1][0] > 4  # the same slot count on every rank
    _, want, got = results[0]
    assert torch.equal(want, got)
