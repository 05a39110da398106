"""Closer to convergence: standard and coupled for 5,000 iterations and standard for 12,000 (2.4x the tokens), seeds
1-3, then their table and curves (results/long.png), and the tokens standard needs to match coupled, seed by seed.
Run from the repository root: python results/long.py"""
import math
from statistics import mean, stdev

import bench
import runner
import tables
from seeds import P

JOBS = [(f"runs/claims/long/{a}-s{s}", f"{P} --seed={s} --attn={a} --max_iters=5000")
        for s in (1, 2, 3) for a in ('standard', 'coupled')]
JOBS += [(f"runs/claims/long/standard-2.4x-s{s}", f"{P} --seed={s} --attn=standard --max_iters=12000")
         for s in (1, 2, 3)]


def tokens_to_match():  # seed s: where standard-2.4x-s's curve first reaches coupled-s's final estimate
    ratios = []
    for s in (1, 2, 3):
        (ref,), (run,) = bench.load_runs([f"runs/claims/long/standard-2.4x-s{s}"]), bench.load_runs(
            [f"runs/claims/long/coupled-s{s}"])
        needed = bench.tokens_to_reach([(e['tokens'], e['val_loss']) for e in ref['evals']],
                                       run['evals'][-1]['val_loss'])
        ratios.append(math.inf if needed is None else needed / run['final']['tokens'])
        print(f"seed {s}: " + (f"{ratios[-1]:.2f}x" if needed else f"> {ref['final']['tokens'] / run['final']['tokens']:.2f}x"))
    ok = [r for r in ratios if r < math.inf]
    print("standard tokens to match coupled, over seeds 1-3: " + (
        f"{mean(ok):.2f}x +- {stdev(ok):.2f}" if len(ok) == 3 else "> 2.4x (a seed's curve never reaches coupled's "
        "final estimate)"))


if __name__ == '__main__':
    runner.run(JOBS)
    tables.report(['runs/claims/long'], plot='results/long.png')
    tokens_to_match()
