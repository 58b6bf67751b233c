"""The sparse mixture-of-experts MLP (Mixtral, Qwen3-MoE, Qwen3-Next, Nemotron-H): a router picks
``top_k`` experts per token, each a SwiGLU MLP (Nemotron-H: squared-ReLU, no gate), and
the token's output is their weighted sum.

Routing follows transformers exactly, so the same experts win, ties included:
softmax over all experts' logits (float32 for half types, else the model dtype),
``torch.topk`` over those probabilities, then, where the family asks for it
(``MoEConfig.renormalize``), division by the chosen probabilities' sum (for
Mixtral that is the softmax over the top-k logits).

Nemotron-H routes otherwise (``GroupedSigmoidRouter``, as transformers): sigmoid
scores; each of ``n_group`` groups is worth the sum of its two best scores plus
correction biases; the best ``top_k`` (score + bias) within the ``topk_group`` best
groups are chosen (``torch.topk``), weighted by their scores (renormalised when asked,
the sum plus 1e-20), times ``scaling``.

Experts are computed grouped by expert: the (token, expert) pairs are sorted by
expert, and each expert that got tokens runs one gate/up and one down product
over all of its tokens; the weighted results are added back per token in expert
order. The group sizes are read on the host (one sync per MoE layer).

Qwen3-Next adds a shared expert (``SharedExpert``): a SwiGLU MLP of every token,
scaled by ``sigmoid(shared_expert_gate(x))``, added to the routed experts' sum.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from radixserve.layers import invariant
from radixserve.layers.linear import linear
from radixserve.layers.parallel import SINGLE, Comm
from radixserve.models.blocks import compute_dtype
from radixserve.models.config import ModelConfig, MoEConfig


class Router(nn.Module):
    """Top-k expert choice: ``weight`` [num_experts, hidden]."""

    def __init__(self, moe: MoEConfig, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden_size))
        self.top_k, self.renormalize = moe.top_k, moe.renormalize

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, top_k] in the routing dtype, expert ids [T, top_k])."""
        # F.linear, as transformers: a tie between logits must stay a tie bit for bit
        # (batch-invariant mode: the same, on fixed blocks of rows).
        if invariant.enabled() and x.shape[0] > 0:
            logits = invariant.blocked(x, self.weight, None, F.linear)
        else:
            logits = F.linear(x, self.weight)
        probs = torch.softmax(logits.to(compute_dtype(x.dtype)), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, experts


class GroupedSigmoidRouter(nn.Module):
    """Nemotron-H's expert choice (module docstring): ``weight`` [num_experts, hidden],
    ``bias`` [num_experts] (the checkpoint's ``e_score_correction_bias``), held in
    float32 in a half model (``KEEP_WIDE``), as transformers holds them."""

    KEEP_WIDE = True  # CausalLM keeps this module's parameters in compute_dtype

    def __init__(self, moe: MoEConfig, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(moe.num_experts, hidden_size))
        self.bias = nn.Parameter(torch.empty(moe.num_experts))
        self.moe = moe

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, top_k] in the routing dtype, expert ids [T, top_k])."""
        m, wide = self.moe, compute_dtype(x.dtype)
        scores = torch.sigmoid(F.linear(x.to(wide), self.weight.to(wide)))
        choice = scores + self.bias.to(wide)
        groups = choice.view(-1, m.n_group, m.num_experts // m.n_group)
        group_scores = groups.topk(2, dim=-1)[0].sum(dim=-1)
        best = torch.topk(group_scores, k=m.topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        choice = groups.masked_fill(~keep[..., None], float("-inf")).view_as(choice)
        experts = torch.topk(choice, k=m.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, experts)
        if m.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * m.scaling, experts


class Experts(nn.Module):
    """``num_experts`` SwiGLU MLPs stacked: ``gate_up`` [E, 2I, hidden], ``down`` [E, hidden, I].
    Over ``size`` ranks each holds ``I / size`` of every expert's features (the
    caller sums the ranks' outputs). Not ``gated`` (Nemotron-H): ``gate_up`` holds the
    up projections only [E, I, hidden], and the activation is ``relu(x) ** 2``."""

    def __init__(self, moe: MoEConfig, hidden_size: int, size: int = 1, gated: bool = True) -> None:
        super().__init__()
        e, i = moe.num_experts, moe.intermediate_size // size
        self.intermediate, self.gated = i, gated
        self.gate_up = nn.Parameter(torch.empty(e, 2 * i if gated else i, hidden_size))
        self.down = nn.Parameter(torch.empty(e, hidden_size, i))

    def forward(
        self, x: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
    ) -> torch.Tensor:
        top_k = experts.shape[1]
        flat = experts.flatten()
        order = torch.argsort(flat, stable=True)  # pairs grouped by expert, tokens ascending
        counts = torch.bincount(flat, minlength=self.gate_up.shape[0]).tolist()
        tokens = order // top_k
        pair_weights = weights.flatten()[order]
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            rows = tokens[start : start + n]
            h = linear(x[rows], self.gate_up[e])
            if self.gated:
                gate, up = h.split(self.intermediate, dim=-1)
                h = F.silu(gate) * up
            else:
                h = F.relu(h).square()
            y = linear(h, self.down[e])
            w = pair_weights[start : start + n, None]
            out.index_add_(0, rows, (y.to(w.dtype) * w).to(x.dtype))
            start += n
        return out


class SharedExpert(nn.Module):
    """Qwen3-Next's and Qwen3.5-MoE's shared expert: a SwiGLU MLP every token goes through, its output
    scaled by ``sigmoid(gate(x))`` (``gate`` [1, hidden]); one rank only."""

    def __init__(self, moe: MoEConfig, hidden_size: int) -> None:
        super().__init__()
        self.intermediate = moe.shared_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(2 * self.intermediate, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(hidden_size, self.intermediate))
        self.gate = nn.Parameter(torch.empty(1, hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = linear(x, self.gate_up_proj).split(self.intermediate, dim=-1)
        y = linear(F.silu(gate) * up, self.down_proj)
        return torch.sigmoid(F.linear(x, self.gate)) * y


class SparseMoeBlock(nn.Module):
    """Router (replicated) and experts (each split over the ranks: one all-reduce),
    plus the gated shared expert where the family has one (Qwen3-Next)."""

    def __init__(self, cfg: ModelConfig, comm: Comm = SINGLE) -> None:
        super().__init__()
        assert cfg.moe is not None
        self.router = Router(cfg.moe, cfg.hidden_size)
        self.experts = Experts(cfg.moe, cfg.hidden_size, comm.size)
        self.shared = SharedExpert(cfg.moe, cfg.hidden_size) if cfg.moe.shared_gate else None
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.comm.all_reduce(self.experts(x, *self.router(x)))
        return out if self.shared is None else out + self.shared(x)
