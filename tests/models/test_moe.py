"""MoE routing and experts against transformers' own modules (Mixtral, Qwen3-MoE).

The router must choose the same experts with the same weights, bit for bit in
float32 (transformers' dtype), on random inputs and on ties: duplicated expert
rows (two experts with equal logits) and zero inputs (all experts tie).
"""

from __future__ import annotations

import pytest
import torch

from radixserve.models.config import ModelConfig
from radixserve.models.moe import Experts, Router
from tests.helpers.tiny_models import tiny_config

CASES = [("mixtral", {}), ("qwen3_moe", {"norm_topk_prob": False}),
         ("qwen3_moe", {"norm_topk_prob": True})]  # fmt: skip


def hf_block(family: str, hf_cfg):
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    hf_cfg._experts_implementation = "eager"
    cls = MixtralSparseMoeBlock if family == "mixtral" else Qwen3MoeSparseMoeBlock
    return cls(hf_cfg).eval()


def inputs(hidden: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(61, hidden, generator=g)
    x[5] = 0.0  # every expert's logit is 0: an all-way tie
    return x


@pytest.mark.parametrize(("family", "extra"), CASES)
def test_router_picks_what_transformers_picks(family, extra):
    hf_cfg = tiny_config(family, **extra)
    cfg = ModelConfig.from_hf(hf_cfg)
    assert cfg.moe is not None
    block = hf_block(family, hf_cfg)
    g = torch.Generator().manual_seed(1)
    w = torch.randn(cfg.moe.num_experts, cfg.hidden_size, generator=g)
    w[3] = w[1]  # experts 1 and 3 tie on every token
    block.gate.weight.data.copy_(w)
    ours = Router(cfg.moe, cfg.hidden_size)
    ours.weight.data.copy_(w)
    x = inputs(cfg.hidden_size)
    with torch.no_grad():
        _, hf_weights, hf_experts = block.gate(x)
        weights, experts = ours(x)
    assert torch.equal(experts, hf_experts)
    assert torch.equal(weights, hf_weights.to(weights.dtype))
    ties = (experts == 1).any(-1) & (experts == 3).any(-1)
    assert ties.any()  # the tie decided something
    assert torch.equal(experts[5], hf_experts[5])


@pytest.mark.parametrize(("family", "extra"), CASES[:2])
def test_grouped_experts_equal_transformers(family, extra):
    """Given the same routing, our per-expert grouped products equal transformers' experts
    (float64, to rounding), including an expert that gets no tokens."""
    hf_cfg = tiny_config(family, **extra)
    cfg = ModelConfig.from_hf(hf_cfg)
    assert cfg.moe is not None
    block = hf_block(family, hf_cfg).double()
    g = torch.Generator().manual_seed(2)
    for p in block.experts.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.2)
    ours = Experts(cfg.moe, cfg.hidden_size).double()
    ours.gate_up.data.copy_(block.experts.gate_up_proj.data)
    ours.down.data.copy_(block.experts.down_proj.data)
    x = inputs(cfg.hidden_size).double()
    k, n = cfg.moe.top_k, cfg.moe.num_experts
    experts = torch.stack([torch.randperm(n - 1, generator=g)[:k] for _ in range(len(x))])
    weights = torch.rand(len(x), k, generator=g, dtype=torch.float64)
    with torch.no_grad():
        want = block.experts(x, experts, weights)
        got = ours(x, weights, experts)  # expert n - 1 gets no tokens
    assert torch.max(torch.abs(got - want)).item() < 1e-12
