"""One rank of test_moe_ranks.py: a mixture-of-experts model whose router sends each rank's
tokens to other experts (rank 0's to expert 0, rank 1's to expert 1), so an expert's
parameters get a gradient on one rank only, trained 3 steps beside torch's AdamW on one
un-offloaded copy fed both ranks' batches (the mean of their losses, as the ranks average
their gradients). argv: stage, tier (cpu|nvme), early_step (on|off), swap dir."""
from __future__ import annotations

import copy
import sys

import torch
from torch import nn

import infinity

WIDTH, EXPERTS = 16, 2


class MoEBlock(nn.Module):
    """A shared projection, then each token to the expert its first feature's sign picks (an
    expert no token picks is not run, as transformers' MoE layers skip it)."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(WIDTH, WIDTH)
        self.experts = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(EXPERTS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.shared(x))
        route = (x[..., 0] > 0).long()
        out = torch.zeros_like(h)
        for index, expert in enumerate(self.experts):
            hit = route == index
            if hit.any():
                out = out.index_put((hit,), expert(h[hit]))
        return x + out


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(MoEBlock() for _ in range(3))
        self.head = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x).pow(2).mean()


def batch(rank: int, step: int) -> torch.Tensor:
    """Rank 0's tokens all pick expert 0, rank 1's expert 1 (the first feature's sign)."""
    x = torch.randn(4, 3, WIDTH, generator=torch.Generator().manual_seed(100 * step + rank))
    x[..., 0] = x[..., 0].abs() * (1 if rank == 1 else -1)
    return x


def main() -> None:
    stage, tier, early, swap = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    info = infinity.init_distributed()
    torch.manual_seed(0)
    model = Net()
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
