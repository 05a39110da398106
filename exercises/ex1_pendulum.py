"""Exercise 1. A pendulum: the order of an integrator, and what it does over a long time (no training, seconds).
Run from the repository root: python exercises/ex1_pendulum.py [integrator ...] (default: leapfrog euler)."""
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # model.py, from any folder
if {'-h', '--help'} & set(sys.argv[1:]):
    sys.exit(print(__doc__))
from model import INTEGRATORS, Hamiltonian  # noqa: E402


class Pendulum(Hamiltonian):  # V(q) = -cos(q), so F(q) = -sin(q)
    def force(self, q, scale=1.0):
        return -scale * torch.sin(q)


def energy_errors(name, dt, steps):
    """|H - H0| after each of `steps` steps of dt, from rest at q = 1 radian; H = 1/2 k^2 - cos(q). Also the orbit."""
    h = Pendulum(1, 1, 1, 1, name, dt=dt).double()  # one head of one dimension; a call is one step of dt
    q, k = torch.ones(1, 1, 1, 1, dtype=torch.float64), torch.zeros(1, 1, 1, 1, dtype=torch.float64)
    energy = lambda q, k: 0.5 * k.item() ** 2 - math.cos(q.item())  # noqa: E731
    e0, errors, orbit = energy(q, k), [], []
    with torch.no_grad():
        for _ in range(steps):
            q, k = h(q, k)
            errors.append(abs(energy(q, k) - e0))
            orbit.append((q.item(), k.item()))
    return errors, orbit


names = sys.argv[1:] or ['leapfrog', 'euler']
for name in names:
    if name not in INTEGRATORS:  # a name model.py's table lacks: one line, not a traceback
        sys.exit(f"error: no integrator {name!r}; choose from {', '.join(INTEGRATORS)}, or add yours (exercise 6): "
                 "cat exercises/ex6_mine.py >> model.py")
dts = [0.1 / 2 ** i for i in range(6)]  # 0.1 down to 0.003125
worst, slopes = {}, {}
for name in names:
    worst[name] = [max(energy_errors(name, dt, round(20 / dt))[0]) for dt in dts]  # to time 20: three swings
    for dt, e in zip(dts[:2], worst[name]):
        print(f"{name:8s} dt={dt}: largest energy error {e:.1e}")
for name in names:  # the order p: error ~ dt^p, a straight line of slope p on log-log axes
    x, y = [math.log(dt) for dt in dts], [math.log(e) for e in worst[name]]
    slopes[name] = sum((a - sum(x) / len(x)) * (b - sum(y) / len(y)) for a, b in zip(x, y)) / sum(
        (a - sum(x) / len(x)) ** 2 for a in x)  # least-squares slope
    ratios = ' '.join(f"{a / b:.2f}x" for a, b in zip(worst[name], worst[name][1:]))
    print(f"{name:8s} each halving of dt from 0.1 divides the error by {ratios}; log-log slope {slopes[name]:.2f}")
# 10,000 steps: time 1000, about 149 swings (the period at 1 rad is 6.70)
long = {name: energy_errors(name, 0.1, 10_000) for name in names}
for name, (errors, _) in long.items():
    print(f"{name:8s} 10000 steps of dt=0.1: largest energy error {max(errors[:1000]):.1e} in the first 1000 steps, "
          f"{max(errors[-1000:]):.1e} in the last 1000")
# Euler's step (q, k) -> (q + dt k, k - dt sin q) has Jacobian [[1, dt], [-dt cos q, 1]]: det J = 1 + dt^2 cos q
if 'euler' in names:  # checked at the first 200 points of its orbit
    euler = Pendulum(1, 1, 1, 1, 'euler', dt=0.1).double()
    step = lambda x: torch.cat(euler(x[:1].view(1, 1, 1, 1), x[1:].view(1, 1, 1, 1)), -1).flatten()  # noqa: E731
    dt = euler.dt.item()
    gap = max(abs(torch.linalg.det(torch.autograd.functional.jacobian(step, x)).item() - (1 + dt ** 2 * math.cos(
        x[0]))) for x in torch.tensor(long['euler'][1][:200], dtype=torch.float64))
    print(f"euler    det J - (1 + dt^2 cos q) along the orbit: at most {gap:.0e}")
try:
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(1, 3, figsize=(13, 3.8))
    for name in names:
        ax[0].plot(*zip(*long[name][1][:200]), lw=0.8, label=name)
        ax[1].plot(range(1, 10_001), long[name][0], lw=0.8, label=name)
        ax[2].loglog(dts, worst[name], 'o-', label=f"{name}: slope {slopes[name]:.2f}")
    ax[0].set(title='orbits to time 20, dt = 0.1', xlabel='q', ylabel='k')
    ax[1].set(title='energy error, 10000 steps of dt = 0.1', xlabel='step', ylabel='|H - H0|', yscale='log')
    ax[2].set(title='largest energy error to time 20', xlabel='dt', ylabel='|H - H0|')
    for a in ax:
        a.legend()
    fig.tight_layout(), fig.savefig('ex1_pendulum.png', dpi=80)
    print("drew ex1_pendulum.png")
except ImportError:
    print("for the picture: pip install matplotlib")
