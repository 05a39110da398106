"""Stability: standard, coupled, euler-mlp and uncoupled at learning rates 2e-3 to 2.56e-1 (--min_lr a tenth of each),
then final perplexity, diverged runs and loss spikes against the rate (results/stability.png). At 2e-3 three
variants reuse the seed-variance runs (copied). Run from the repository root: python results/stability.py"""
import report
import runner
from seeds import JOBS as SEEDS, P

RATES = [("2e-3", "2e-4", (1, 2, 3)), ("4e-3", "4e-4", (1, 2, 3)), ("8e-3", "8e-4", (1, 2, 3)),
         ("1.6e-2", "1.6e-3", (1, 2, 3)), ("3.2e-2", "3.2e-3", (1, 2, 3)),
         ("6.4e-2", "6.4e-3", (1, 2)), ("1.28e-1", "1.28e-2", (1, 2)), ("2.56e-1", "2.56e-2", (1, 2))]
COPIED = {f"runs/claims/lr/{a}-2e-3-s{s}": f"runs/claims/seeds/{a}-s{s}"
          for a in ('standard', 'coupled', 'uncoupled') for s in (1, 2, 3)}
JOBS = [(f"runs/claims/lr/{a}-{lr}-s{s}", f"{P} --seed={s} --attn={a} --learning_rate={lr} --min_lr={low}")
        for lr, low, seeds in RATES for a in ('standard', 'coupled', 'euler-mlp', 'uncoupled') for s in seeds]
JOBS = [j for j in JOBS if j[0] not in COPIED]

if __name__ == '__main__':
    runner.run([j for j in SEEDS if j[0] in COPIED.values()] + JOBS)
    for dst, src in COPIED.items():
        runner.copy(src, dst)
    report.report(['runs/claims/lr'], plot='results/stability.png', sweep='learning_rate')
