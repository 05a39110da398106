"""Exercise 2. Reversibility, volume, symplecticity: each token's step forward, back with -dt, and its Jacobian J
(no training, seconds). Run from the repository root: python exercises/ex2_jacobian.py [integrator ...]"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # model.py, from any folder
from model import Hamiltonian, HeadMLP  # noqa: E402


def free_force_leapfrog():
    """STAND-IN for model.py's free-force entry (issue #33): leapfrog with the force f(q) = A silu(W q + b), a
    two-layer SiLU net per head that is not the gradient of any potential. At the merge, this function returns the
    table's entry instead (the same shapes: 1 head of 8, 12 hidden units, 3 steps, dt = 0.5, weights of std 1)."""
    class FreeForce(Hamiltonian):
        def __init__(self, *args, **kw):
            super().__init__(*args, **kw)
            self.f = HeadMLP(1, 8, 12, 8, w_std=1.0)  # W (1, 12, 8), b (1, 1, 12), A (1, 8, 12)

        def force(self, q, scale=1.0):
            return self.f(q, scale)  # scale * A silu(W q + b): a force, but not -grad V
    return FreeForce(1, 8, 12, 3, 'leapfrog', dt=0.5, w_std=1.0)


x = torch.randn(50, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(0))  # 50 tokens' (q, k), d = 8
Omega = torch.zeros(16, 16, dtype=torch.float64)
Omega[:8, 8:], Omega[8:, :8] = torch.eye(8), -torch.eye(8)
potential = lambda name: Hamiltonian(1, 8, 12, 3, name, dt=0.5, w_std=1.0)  # noqa: E731  V 12 wide, 3 steps: curved
rows = [('leapfrog', potential, 'leapfrog', torch.float32), ('leapfrog', potential, 'leapfrog', torch.float64),
        ('euler', potential, 'euler', torch.float64),
        ('free-force', lambda _: free_force_leapfrog(), '', torch.float64),  # the fourth row
        *((name, potential, name, torch.float64) for name in sys.argv[1:])]  # yours: python ... ex2_jacobian.py mine
for label, build, name, dtype in rows:
    torch.manual_seed(1)
    h = build(name).to(dtype)
    step = lambda x, dt=None: torch.cat(  # noqa: E731  (50, 16) -> (50, 16): a step of every token
        h(x[..., :8].view(1, 1, -1, 8), x[..., 8:].view(1, 1, -1, 8), dt), -1)[0, 0]
    with torch.no_grad():
        x1 = step(x.to(dtype))
        x0 = step(x1, -h.dt)  # back: the same map with -dt
    J = torch.func.vmap(torch.func.jacrev(step))(x.to(dtype)[:, None]).squeeze().double()  # (50, 16, 16) per token
    det, s = torch.linalg.det(J), torch.linalg.svdvals(J)
    print(f"{label} {str(dtype)[6:]}: moved {(x1 - x.to(dtype)).abs().max():.1f}, back to "
          f"{(x0 - x.to(dtype)).abs().max():.1e}; det J {det.min():.3f} to {det.max():.3f}; singular values "
          f"{s.min():.3f} to {s.max():.2f}; |J^T Omega J - Omega| {(J.mT @ Omega @ J - Omega).abs().max():.0e}")
