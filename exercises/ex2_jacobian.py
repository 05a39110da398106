"""Exercise 2. Return with -dt, volume, symplecticity: each token's step forward, back with -dt, and its Jacobian J
(no training, seconds). Run from the repository root: python exercises/ex2_jacobian.py [integrator ...]"""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # model.py, from any folder
if {'-h', '--help'} & set(sys.argv[1:]):
    sys.exit(print(__doc__))
from model import INTEGRATORS, Hamiltonian  # noqa: E402

for name in sys.argv[1:]:
    if name not in INTEGRATORS:  # a name model.py's table lacks: one line, not a traceback
        sys.exit(f"error: no integrator {name!r}; choose from {', '.join(INTEGRATORS)}, or add yours (exercise 6): "
                 "cat exercises/ex6_mine.py >> model.py")

x = torch.randn(50, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(0))  # 50 tokens' (q, k), d = 8
Omega = torch.zeros(16, 16, dtype=torch.float64)
Omega[:8, 8:], Omega[8:, :8] = torch.eye(8), -torch.eye(8)
build = lambda name, force='potential': Hamiltonian(  # noqa: E731  12 wide, 3 steps: curved
    1, 8, 12, 3, name, dt=0.5, w_std=1.0, force=force)
rows = [('leapfrog', 'leapfrog', 'potential', torch.float32), ('leapfrog', 'leapfrog', 'potential', torch.float64),
        ('euler', 'euler', 'potential', torch.float64),
        ('free-force', 'leapfrog', 'mlp', torch.float64),  # the coupled-mlp entry's map: leapfrog, the free force
        *((name, name, 'potential', torch.float64) for name in sys.argv[1:])]  # yours: python ... ex2_jacobian.py mine
for label, name, force, dtype in rows:
    torch.manual_seed(1)
    h = build(name, force).to(dtype)
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
