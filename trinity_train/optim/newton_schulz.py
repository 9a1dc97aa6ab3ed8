"""Quintic Newton-Schulz orthogonalisation, batched over leading dimensions.

This is the iteration of `torch.optim.Muon` (same coefficients, same normalisation, same operation
order, so in bf16 it is bit-for-bit what torch computes for a 2-D matrix), extended in the two
ways distributed Muon needs and torch's 2-D-only, bf16-only version lacks: a batch of matrices
(every routed expert of a layer) goes through in one call, and the working precision is a
parameter, so exactness tests can run in fp32.
"""

from __future__ import annotations

import torch
from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, EPS

NS_COEFFICIENTS = (DEFAULT_A, DEFAULT_B, DEFAULT_C)


def newton_schulz(matrices: torch.Tensor, steps: int = 5, dtype: torch.dtype = torch.bfloat16,
                  coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
                  eps: float = EPS) -> torch.Tensor:
    """Approximately orthogonalise each trailing [rows, cols] matrix of `matrices`.

    The result has the shape of the input and `dtype`; its singular values lie roughly in
    [0.5, 1.5] (the quintic trades exact convergence for speed, see torch.optim.Muon).
    """
    if matrices.ndim < 2:
        raise ValueError(f"Newton-Schulz needs matrices, got a tensor of shape {tuple(matrices.shape)}")
    a, b, c = coefficients
    x = matrices.to(dtype)
    # Iterate on the wide orientation so the Gram matrix is the small one.
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    # Frobenius norm >= spectral norm, so this puts every singular value in [0, 1].
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
    batch_shape = x.shape[:-2]
    x = x.reshape(-1, *x.shape[-2:])
    for _ in range(steps):
        gram = torch.bmm(x, x.mT)
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.baddbmm(x, poly, x, beta=a)
    x = x.reshape(*batch_shape, *x.shape[-2:])
    return x.mT if tall else x

