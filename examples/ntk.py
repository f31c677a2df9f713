"""The empirical NTK of a small CNN on scikit-learn's digits, at init and after training.

The empirical neural tangent kernel of a network ``f(θ, x) ∈ R^10`` is
``Θ(x, x')[k, k'] = <∂f_k(θ, x)/∂θ, ∂f_k'(θ, x')/∂θ>``. ``tg.ntk.empirical_ntk_fn(fn,
trace_axes=())`` computes it between two input sets with neural-tangents' semantics: a
``[N1, N2, 10, 10]`` kernel, the training set against itself and the test set against the
training set, without concatenating them. Kernel regression with it,
``f̂(x*) = Θ(x*, X) (Θ(X, X) + λI)⁻¹ Y``, is what gradient-descent training of the network
*linearized* at ``θ`` (on the squared loss) converges to: ``tg.ntk.gradient_descent_mse``
gives it at infinite time (and at any finite time). At initialization that is the "lazy" /
NTK regime; after training the kernel has moved and adapted to the data (the "after
kernel", Long 2021; Fort et al. 2020).

This script trains a CNN on 250 digits, computes the NTK at init and after training, and
compares kernel regression with either kernel against the network itself.

Run:  python examples/ntk.py
"""

import torch
from sklearn.datasets import load_digits
from torch import nn

import torchgram as tg

N_TRAIN, N_TEST = 250, 250
STEPS = 300
RIDGE = 1e-4  # diag_reg, relative to the mean diagonal of the kernel (neural-tangents' default)


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


def check_against_jacrev(ntk_fn, fn, params, x1: torch.Tensor, x2: torch.Tensor) -> float:
    """Max relative deviation of the kernel on a few inputs from J(x1) J(x2)ᵀ (torch.func)."""
    def jacobian(x):
        jac = torch.func.jacrev(fn)(params, x)  # per parameter: [n, 10, *shape]
        return torch.cat([j.reshape(x.shape[0] * 10, -1) for j in jac.values()], dim=1)

    dense = (jacobian(x1) @ jacobian(x2).T).reshape(len(x1), 10, len(x2), 10).permute(0, 2, 1, 3)
    return ((ntk_fn(x1, x2, params) - dense).abs().max() / dense.abs().max()).item()


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
    fn, params = tg.functionalize(make_cnn())
    ntk_fn = tg.ntk.empirical_ntk_fn(fn, trace_axes=())  # the full kernel [N1, N2, 10, 10]
    print(f"CNN with {sum(p.numel() for p in params.values())} parameters; NTK of "
          f"{N_TRAIN} train digits with themselves and of {N_TEST} test digits with them")

    deviation = check_against_jacrev(ntk_fn, fn, params, x_test[:3], x_train[:4])
    print(f"NTK between 3 and 4 inputs vs dense jacrev J1 J2ᵀ: max relative deviation "
          f"{deviation:.1e}")
    assert deviation < 1e-4, "the NTK disagrees with the dense Jacobian"

    targets = nn.functional.one_hot(y_train, 10).double() - 0.1  # centered one-hot

    def accuracy(logits: torch.Tensor) -> float:
        return (logits.argmax(-1) == y_test).float().mean().item()

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
        k_train = ntk_fn(x_train, None, params).double()  # [250, 250, 10, 10]
        k_test = ntk_fn(x_test, x_train, params).double()  # [250, 250, 10, 10]
        kernels[stage] = k_train
        # infinite-time gradient descent on the squared loss from zero outputs: kernel
        # regression with diag_reg relative to the kernel's mean diagonal
        predict_fn = tg.ntk.gradient_descent_mse(k_train, targets, diag_reg=RIDGE, trace_axes=())
        regression = predict_fn(t=None, fx_train_0=None,
                                fx_test_0=torch.zeros(N_TEST, 10, dtype=torch.float64),
                                k_test_train=k_test)
        scalar = k_train.diagonal(dim1=2, dim2=3).mean(-1)  # the logit-traced kernel [N, N]
        eigenvalues = torch.linalg.eigvalsh(scalar)
        assert eigenvalues[0] > -1e-6 * eigenvalues[-1], "the NTK is not positive semi-definite"
        with torch.no_grad():
            network = accuracy(fn(params, x_test))
        results[stage] = {
            "network test accuracy": network,
            "NTK regression test accuracy": accuracy(regression),
            "kernel-label alignment": centered_alignment(
                scalar, nn.functional.one_hot(y_train, 10).double()),
            "top-10 eigenvalues / trace": (eigenvalues[-10:].sum() / eigenvalues.sum()).item(),
        }

    print(f"\n{'':32}{'at init':>10}{'trained':>10}")
    for key in results["init"]:
        print(f"{key:32}" + "".join(f"{results[s][key]:10.3f}" for s in ("init", "trained")))
    moved = 1 - alignment(kernels["init"], kernels["trained"])
    print(f"\nkernel distance 1 - cos(Θ_init, Θ_trained) = {moved:.3f}: the NTK moved in training.")
    print("Kernel-label alignment: centered cosine between the train block of the logit-traced "
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
