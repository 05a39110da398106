"""Closer to convergence: standard and coupled for 5,000 iterations and standard for 12,000 (2.4x the tokens), seeds
1-3, then their table and curves (results/long.png), and the tokens standard needs to match coupled, seed by seed.
Run from the repository root: python results/long.py"""
from statistics import mean, stdev

import report
import runner
from seeds import P


JOBS = [(f"runs/claims/long/{a}-s{s}", f"{P} --seed={s} --attn={a} --max_iters=5000")
        for s in (1, 2, 3) for a in ('standard', 'coupled')]
JOBS += [(f"runs/claims/long/standard-2.4x-s{s}", f"{P} --seed={s} --attn=standard --max_iters=12000")
         for s in (1, 2, 3)]


def tokens_to_match(folder='runs/claims/long'):  # seed s: where standard-2.4x-s's curve reaches coupled-s's final
    ratios, bounds = [], []
    for s in (1, 2, 3):
        pair = [report.done(report.load_runs([f"{folder}/{name}-s{s}"])) for name in ('standard-2.4x', 'coupled')]
        if not all(pair):  # a run missing, stopped or diverged: no reading for this seed
            print(f"seed {s}: - (standard-2.4x-s{s} and coupled-s{s} have not both finished)")
            continue
        (ref,), (run,) = pair
        needed = report.tokens_to_reach([(e['tokens'], e['val_loss']) for e in ref['evals']],
                                       run['evals'][-1]['val_loss'])
        if needed is None:  # the curve ends above coupled's final estimate: a lower bound
            bounds.append(ref['final']['tokens'] / run['final']['tokens'])
            print(f"seed {s}: > {bounds[-1]:.2f}x")
        else:
            ratios.append(needed / run['final']['tokens'])
            print(f"seed {s}: {ratios[-1]:.2f}x")
    print("standard tokens to match coupled: " + (
        f"> {min(bounds):.2f}x (a seed's curve never reaches coupled's final estimate)" if bounds else
        f"{mean(ratios):.2f}x +- {stdev(ratios):.2f} over {len(ratios)} seeds" if len(ratios) > 1 else
        f"{ratios[0]:.2f}x from 1 seed" if ratios else "- (no seed has both runs finished)"))


if __name__ == '__main__':
    runner.run(JOBS)
    report.report(['runs/claims/long'], plot='results/long.png')
    tokens_to_match()
