"""Exercise 3. What coupling does to the scores: leapfrog's first order, and Euler's difference from it (no training,
seconds). Run from the repository root: python exercises/ex3_scores.py"""
import math
import os
import sys

import torch

if sys.argv[1:]:  # it takes none: --help, or a one-line error
    print(__doc__) if sys.argv[1:] in (['-h'], ['--help']) else sys.exit(
        f"error: {os.path.basename(__file__)} takes no arguments (given: {' '.join(sys.argv[1:])})")
    sys.exit()
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # model.py, from any folder
from model import Hamiltonian  # noqa: E402

torch.manual_seed(0)
leap, euler = Hamiltonian(1, 16, 12, 1, 'leapfrog', w_std=0.5).double(), Hamiltonian(1, 16, 12, 1, 'euler').double()
euler.load_state_dict(leap.state_dict())  # the same potential V for both
q, k = torch.randn(2, 1, 1, 64, 16, dtype=torch.float64)  # 64 tokens of one head
scores = lambda q, k: q[0, 0] @ k[0, 0].T  # noqa: E731  q_i . k_j, (64, 64)
dts, rows = (0.1, 0.05, 0.025), []
with torch.no_grad():
    for dt in dts:
        dt_ = torch.tensor([dt], dtype=torch.float64)
        exact, by_euler = scores(*leap(q, k, dt=dt_)), scores(*euler(q, k, dt=dt_))
        first = scores(q, k) + dt * (scores(k, k) + scores(q, leap.force(q)))  # q_i.k_j + dt (k_i.k_j + q_i.F(q_j))
        rows.append(((exact - scores(q, k)).abs().mean().item(), (exact - first).abs().mean().item(),
                     (exact - by_euler).abs().mean().item()))
        print(f"dt={dt}: scores change by {rows[-1][0]:.4f}; off by {rows[-1][1]:.2e} (the formula), "
              f"{rows[-1][2]:.2e} (Euler)")
x = [math.log(dt) for dt in dts]
slope = lambda y: sum((a - sum(x) / 3) * (math.log(b) - sum(map(math.log, y)) / 3) for a, b in zip(x, y)) / sum(  # noqa
    (a - sum(x) / 3) ** 2 for a in x)  # least-squares slope of log y against log dt
names = ('the change', "the formula's error", "Euler's difference")
slopes = [slope([row[i] for row in rows]) for i in range(3)]
print('log-log slopes against dt: ' + ', '.join(f"{s:.2f} ({n})" for s, n in zip(slopes, names)))
try:
    import matplotlib.pyplot as plt
    for i, name in enumerate(names):
        plt.loglog(dts, [row[i] for row in rows], 'o-', label=f"{name}: slope {slopes[i]:.2f}")
    plt.xlabel('dt'), plt.ylabel('mean |difference| of the scores'), plt.legend()
    plt.savefig('ex3_scores.png', dpi=80)
    print("drew ex3_scores.png")
except ImportError:
    print("for the picture: pip install matplotlib")
