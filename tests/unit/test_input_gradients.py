"""The mark of a call's backward (zero/input_gradients.py): it comes once every gradient of
the call's own parameters has come, whatever the arguments are -- the point every rank reaches
alike ([Note: a call's inputs mark its backward]). Seen here on one process, by the order of
the hooks; tests/distributed/test_moe_ranks.py trains the shapes at two ranks."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from infinity.zero.input_gradients import marked_inputs


class Mix(nn.Module):
    """A parameter-only op first (its gradient's node comes last among the call's), then the
    argument."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.log_gain = nn.Parameter(torch.zeros(4))

    def forward(self, adj: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        gain = self.log_gain.exp()
        return torch.sparse.mm(adj, self.lin(x)) * gain if adj.is_sparse \
            else adj @ self.lin(x) * gain


@pytest.mark.parametrize("layout", ["dense", "sparse"])
def test_the_mark_comes_after_every_gradient_of_the_call_for_a_leaf_argument(layout) -> None:
    """A leaf argument (a sparse adjacency that requires grad, inputs_embeds.requires_grad_())
    has its gradient accumulated ahead of the call's other nodes: a hook on it fired before
    log_gain's gradient (at two ranks: refused as a gradient after the mark). Each argument
    gets a node of its own -- a view, or for a sparse one an identity Function."""
    torch.manual_seed(0)
    module = Mix()
    dense = torch.rand(3, 3)
    adj = (dense.to_sparse() if layout == "sparse" else dense).requires_grad_()
    x = torch.randn(3, 4)
    events: list[str] = []
    for name, p in module.named_parameters():
        p.register_post_accumulate_grad_hook(lambda p, name=name: events.append(name))
    args, kwargs, call = marked_inputs((adj, x), {}, [], lambda call: events.append("mark"))
    assert call is not None and args[0] is not adj
    module(*args, **kwargs).sum().backward()
    assert events[-1] == "mark" and sorted(events[:-1]) == sorted(
        name for name, _ in module.named_parameters()), events
    expected = dense.detach().requires_grad_()
    (expected @ module.lin(x) * module.log_gain.exp()).sum().backward()
    got = adj.grad.to_dense() if layout == "sparse" else adj.grad
    torch.testing.assert_close(got, expected.grad * (dense != 0) if layout == "sparse"
                               else expected.grad)
