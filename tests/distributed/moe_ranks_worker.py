"""One rank of test_moe_ranks.py: mixture-of-experts models whose router sends each rank's
tokens to other experts, so an expert's parameters get a gradient on one rank only (rank 0's
tokens all pick expert 0, rank 1's both experts), trained 3 steps beside torch's AdamW on one
un-offloaded copy fed both ranks' batches (the mean of their losses, as the ranks average their
gradients). argv: model, stage, tier (cpu|nvme), early_step (on|off), swap dir.

The models (``MODELS``), each a place where the point a unit's backward ends was read wrongly:
- "routed": the blocks in a chain;
- "shared": every block also reads one context tensor, whose gradient exists only after the
  last block's backward (an encoder-decoder's encoder_hidden_states, T5's position bias);
- "leaf": the input is a leaf that requires grad (inputs_embeds.requires_grad_(),
  enable_input_require_grads) and each block first computes from a parameter alone (a
  weight-norm parametrization), so the leaf's hook came before that parameter's gradient;
- "towers": two towers read the raw batch (no gradient on their inputs);
- "latents": a learned parameter of the root handed to every block as its context (Perceiver's
  latents, a Q-Former's queries): a leaf input too;
- "skipped": a leaf input and the latents, read by a block only where the rank's tokens pick
  expert 1 (none of rank 0's do): an argument one rank's call leaves unused, whose gradient
  never comes there;
- "reentrant": the chain under reentrant activation checkpointing, whose first forward runs
  without grad (its calls unwatched) and whose recomputation's graph is the one the backward
  runs."""
from __future__ import annotations

import copy
import sys

import torch
import torch.utils.checkpoint
from torch import nn

import infinity

WIDTH, EXPERTS = 16, 2


class MoEBlock(nn.Module):
    """A shared projection, then each token to the expert its first feature's sign picks (an
    expert no token picks is not run, as transformers' MoE layers skip it)."""

    def __init__(self, scaled: bool = False, conditional: bool = False) -> None:
        super().__init__()
        self.conditional = conditional
        self.shared = nn.Linear(WIDTH, WIDTH)
        self.experts = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(EXPERTS))
        self.log_gain = nn.Parameter(torch.zeros(WIDTH)) if scaled else None

    def forward(self, x: torch.Tensor, route: torch.Tensor,
                context: torch.Tensor | None = None) -> torch.Tensor:
        gain = self.log_gain.exp() if self.log_gain is not None else 1.0   # from a parameter alone
        if self.conditional and not bool(route.any()):   # the data skips the context here
            context = None
        h = torch.tanh(self.shared(x if context is None else x + context)) * gain
        out = torch.zeros_like(h)
        for index, expert in enumerate(self.experts):
            hit = route == index
            if hit.any():
                out = out.index_put((hit,), expert(h[hit]))
        return x + out


class Net(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.context = nn.Linear(WIDTH, WIDTH)
        self.blocks = nn.ModuleList(MoEBlock(scaled=kind == "leaf", conditional=kind == "skipped")
                                    for _ in range(3))
        self.other = nn.ModuleList(MoEBlock() for _ in range(2)) if kind == "towers" else None
        self.head = nn.Linear(WIDTH, 1)
        self.latents = nn.Parameter(torch.randn(3, WIDTH) * 0.1) \
            if kind in ("latents", "skipped") else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        route = (x[..., 0] > 0).long()
        context = self.context(x) if self.kind == "shared" else self.latents
        # reentrant checkpointing gives no gradient to a call whose inputs have none
        h = x.detach().requires_grad_() if self.kind in ("leaf", "reentrant", "skipped") else x
        for block in self.blocks:
            if self.kind == "reentrant":
                h = torch.utils.checkpoint.checkpoint(block, h, route, context,
                                                      use_reentrant=True)
            else:
                h = block(h, route, context)
        if self.other is not None:
            g = x.flip(-1)
            for block in self.other:
                g = block(g, route)
            h = h * g
        return self.head(h).pow(2).mean()


def batch(rank: int, step: int) -> torch.Tensor:
    """Rank 0's tokens all pick expert 0; rank 1's both (the first feature's sign)."""
    x = torch.randn(4, 3, WIDTH, generator=torch.Generator().manual_seed(100 * step + rank))
    if rank == 0:
        x[..., 0] = -x[..., 0].abs()
    return x


def main() -> None:
    kind, stage, tier, early, swap = sys.argv[1], int(sys.argv[2]), *sys.argv[3:6]
    info = infinity.init_distributed()
    torch.manual_seed(0)
    model = Net(kind)
    reference = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01, foreach=False)
    offload = {"device": tier, **({"nvme_path": swap} if tier == "nvme" else {})}
    zero = {"stage": stage, "offload_optimizer": offload}
    if stage == 3:
        zero["offload_param"] = offload
    ds = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": zero,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
          "infinity": {"compute_dtype": "fp32", "early_step": early, "collective_timeout": 60}}
    engine, *_ = infinity.initialize(model=model, config=ds)
    for step in range(3):
        loss = engine(batch(info.rank, step))
        engine.backward(loss)
        engine.step()
        ref_loss = sum(reference(batch(rank, step)) for rank in range(2)) / 2
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
    state = engine.module_state_dict()
    worst = max(((state[name] - p.detach()).abs().max() / p.detach().abs().max()).item()
                for name, p in reference.named_parameters())
    engine.close()
    print(f"trained, worst relative difference {worst:.3g}")
    if worst > 1e-5:
        raise SystemExit(f"rank {info.rank}: weights {worst:.3g} off torch")


if __name__ == "__main__":
    main()
