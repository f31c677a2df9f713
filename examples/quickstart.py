"""Quickstart: the per-sample Gramian of a small classifier, checked against a dense oracle.

Run:  python examples/quickstart.py
"""

import torch
from torch import nn

import torchgram as tg


def main() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 3)).double()
    fn, params = tg.functionalize(model)
    x, y = torch.randn(8, 5, dtype=torch.float64), torch.randint(0, 3, (8,))

    def losses(p, x, y):
        return nn.functional.cross_entropy(fn(p, x), y, reduction="none")  # shape [8]

    # G[i, j] = <grad loss_i, grad loss_j>, shape [8, 8]
    G = tg.gramian(losses, batch_dim=0)(params, x, y)
    norms = tg.gramian(losses, diagonal=True, batch_dim=0)(params, x, y)  # [8]
    ntk = tg.gramian(lambda p, x: fn(p, x), batch_dim=0)(params, x)  # empirical NTK [8, 3, 8, 3]

    # The dense oracle: the full Jacobian [8, P] from torch.func.jacrev, then J @ J.T.
    jac = torch.func.jacrev(losses)(params, x, y)
    J = torch.cat([j.reshape(8, -1) for j in jac.values()], dim=1)
    dense = J @ J.T

    torch.set_printoptions(precision=4, sci_mode=False)
    print(f"per-sample Gramian G = J Jᵀ, shape {tuple(G.shape)} (P = {J.shape[1]} parameters):")
    print(G)
    print(f"squared per-sample gradient norms: {norms}")
    print(f"empirical NTK shape: {tuple(ntk.shape)}")
    error = ((G - dense).abs().max() / dense.abs().max()).item()
    print(f"max relative deviation from the dense jacrev oracle: {error:.2e}")
    assert error < 1e-10, "torchgram disagrees with the dense oracle"
    print("OK: matches the dense oracle")


if __name__ == "__main__":
    main()
