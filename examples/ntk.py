"""The empirical NTK of a small CNN on scikit-learn's digits, at init and after training.

The empirical neural tangent kernel of a network ``f(θ, x) ∈ R^10`` is
``Θ(x, x')[k, k'] = <∂f_k(θ, x)/∂θ, ∂f_k'(θ, x')/∂θ>``: exactly the Gramian ``J Jᵀ`` of the
Jacobian of the outputs on a set of inputs, which ``tg.gramian(f, batch_dim=0)`` returns as a
``[N, 10, N, 10]`` tensor. Kernel regression with it, ``f̂(x*) = Θ(x*, X) (Θ(X, X) + λI)⁻¹ Y``,
is what gradient-descent training of the network *linearized* at ``θ`` (on the squared loss)
converges to. At initialization that is the "lazy" / NTK regime; after training the kernel
has moved and adapted to the data (the "after kernel", Long 2021; Fort et al. 2020).

This script trains a CNN on 250 digits, computes the NTK on 250 + 250 train and test images
at init and after training, and compares kernel regression with either kernel against the
network itself.

Run:  python examples/ntk.py
"""

import torch
from sklearn.datasets import load_digits
from torch import nn

import torchgram as tg

N_TRAIN, N_TEST = 250, 250
STEPS = 300
RIDGE = 1e-4  # λ relative to the mean diagonal of the kernel


def load_data() -> tuple[torch.Tensor, ...]:
    """Digits as [N, 1, 8, 8] images in [0, 1]: 250 to train on, 250 to test."""
    images, labels = load_digits(return_X_y=True)
    x = torch.tensor(images, dtype=torch.float32).reshape(-1, 1, 8, 8) / 16.0
    y = torch.tensor(labels)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    train, test = order[:N_TRAIN], order[N_TRAIN:N_TRAIN + N_TEST]
    return x[train], y[train], x[test], y[test]


def make_cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(),  # [8, 8, 8]
        nn.Conv2d(8, 8, 3, stride=2), nn.ReLU(),  # [8, 3, 3]
        nn.Flatten(), nn.Linear(72, 10),
    )


def ntk(fn, params, x: torch.Tensor) -> torch.Tensor:
    """The empirical NTK on the inputs x, as an [N * 10, N * 10] matrix (row = (sample, logit))."""
    kernel = tg.gramian(fn, batch_dim=0)(params, x)  # [N, 10, N, 10]
    n = x.shape[0]
    return kernel.reshape(n * 10, n * 10)


def check_against_jacrev(fn, params, x: torch.Tensor) -> float:
    """Max relative deviation of the NTK on a few inputs from J Jᵀ with J from torch.func.jacrev."""
    jac = torch.func.jacrev(fn)(params, x)  # per parameter: [n, 10, *shape]
    J = torch.cat([j.reshape(x.shape[0] * 10, -1) for j in jac.values()], dim=1)
    dense = J @ J.T
    return ((ntk(fn, params, x) - dense).abs().max() / dense.abs().max()).item()


def kernel_regression(K: torch.Tensor, y_train: torch.Tensor) -> torch.Tensor:
    """Predicted test logits [N_TEST, 10] from the full NTK over train then test inputs."""
    n = N_TRAIN * 10
    K = K.double()
    targets = nn.functional.one_hot(y_train, 10).double().reshape(-1) - 0.1  # centered one-hot
    ridge = RIDGE * K[:n, :n].diagonal().mean()
    # Cholesky succeeds only if K + λI is positive definite: a check that the NTK is PSD.
    factor, info = torch.linalg.cholesky_ex(K[:n, :n] + ridge * torch.eye(n, dtype=K.dtype))
    assert info == 0, "the NTK is not positive semi-definite"
    coef = torch.cholesky_solve(targets[:, None], factor)[:, 0]
    return (K[n:, :n] @ coef).reshape(N_TEST, 10)


def trace_kernel(K: torch.Tensor) -> torch.Tensor:
    """Σ_k Θ(x, x')[k, k]: the scalar kernel [N, N] summed over the outputs."""
    n = K.shape[0] // 10
    return K.reshape(n, 10, n, 10).diagonal(dim1=1, dim2=3).sum(-1)


def alignment(A: torch.Tensor, B: torch.Tensor) -> float:
    """Cosine between two matrices in the Frobenius inner product."""
    return (A * B).sum().item() / (A.norm() * B.norm()).item()


def centered_alignment(K: torch.Tensor, labels: torch.Tensor) -> float:
    """Centered kernel-target alignment (Cortes et al. 2012) of K [n, n] with one-hot labels."""
    K = K - K.mean(0, keepdim=True)
    K = K - K.mean(1, keepdim=True)  # H K H with H = I - 11ᵀ/n
    Y = labels - labels.mean(0)
    return alignment(K, Y @ Y.T)


def main() -> None:
    torch.set_num_threads(1)  # small matrices and a shared machine: one thread is fastest
    x_train, y_train, x_test, y_test = load_data()
    x_all = torch.cat([x_train, x_test])
    fn, params = tg.functionalize(make_cnn())
    print(f"CNN with {sum(p.numel() for p in params.values())} parameters; NTK over "
          f"{N_TRAIN} train + {N_TEST} test digits: a [{N_TRAIN + N_TEST}, 10, "
          f"{N_TRAIN + N_TEST}, 10] kernel")

    deviation = check_against_jacrev(fn, params, x_train[:4])
    print(f"NTK on 4 inputs vs dense jacrev J Jᵀ: max relative deviation {deviation:.1e}")
    assert deviation < 1e-4, "the NTK disagrees with the dense Jacobian"

    def accuracy(logits: torch.Tensor) -> float:
        return (logits.argmax(1) == y_test).float().mean().item()

    results, kernels = {}, {}
    for stage in ("init", "trained"):
        if stage == "trained":  # full-batch Adam on the cross-entropy of the train set
            params = {k: p.clone().requires_grad_() for k, p in params.items()}
            optimizer = torch.optim.Adam(params.values(), lr=1e-2)
            for _ in range(STEPS):
                optimizer.zero_grad()
                nn.functional.cross_entropy(fn(params, x_train), y_train).backward()
                optimizer.step()
            params = {k: p.detach() for k, p in params.items()}
        K = ntk(fn, params, x_all)
        kernels[stage] = K
        scalar = trace_kernel(K)[:N_TRAIN, :N_TRAIN].double()
        eigenvalues = torch.linalg.eigvalsh(scalar)
        with torch.no_grad():
            network = accuracy(fn(params, x_test))
        results[stage] = {
            "network test accuracy": network,
            "NTK regression test accuracy": accuracy(kernel_regression(K, y_train)),
            "kernel-label alignment": centered_alignment(
                scalar, nn.functional.one_hot(y_train, 10).double()),
            "top-10 eigenvalues / trace": (eigenvalues[-10:].sum() / eigenvalues.sum()).item(),
        }

    print(f"\n{'':32}{'at init':>10}{'trained':>10}")
    for key in results["init"]:
        print(f"{key:32}" + "".join(f"{results[s][key]:10.3f}" for s in ("init", "trained")))
    moved = 1 - alignment(kernels["init"], kernels["trained"])
    print(f"\nkernel distance 1 - cos(Θ_init, Θ_trained) = {moved:.3f}: the NTK moved in training.")
    print("Kernel-label alignment: centered cosine between the train block of the output-summed "
          "NTK\nand the label kernel Y Yᵀ: training moved the kernel towards the task. The NTK "
          "at init is\nalready a good kernel for regression although the network at init "
          "is at chance.")

    init, trained = results["init"], results["trained"]
    assert trained["network test accuracy"] > 0.8, "the network did not learn"
    assert trained["NTK regression test accuracy"] > 0.8, "the trained NTK does not fit"
    assert init["NTK regression test accuracy"] > 0.5, "the NTK at init does not fit"
    assert trained["kernel-label alignment"] > init["kernel-label alignment"]
    print("OK")


if __name__ == "__main__":
    main()
