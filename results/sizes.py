"""The gap against model size: standard and coupled at three sizes on the WikiText text, seeds 1-3, 500 iterations of
16 x 128 tokens (about one epoch). tiny (4 x 128) reuses results/paper_corpora.py's runs. At the middle size (4 x 256)
and at small (6 x 384), standard's learning rate is picked from 1e-3, 2e-3 and 4e-3 with seed 1 (min_lr a tenth),
and both variants train at it. Then the table and the picture (results/sizes.png).
Run from the repository root, after results/paper_corpora.py: python results/sizes.py"""
import functools
import math
from statistics import mean, stdev

import report
import runner
from laptop import P

SIZES = {'middle': '--n_layer=4 --n_head=4 --n_embd=256', 'small': '--preset=small'}
RATES = ('1e-3', '2e-3', '4e-3')
PAPER = [(60e6, -6.6), (150e6, -6.7), (350e6, -1.0)]  # the abstract's change of perplexity, in % of standard's


def run(size, lr, attn, seed):  # (out_dir, flags)
    return (f"runs/sizes/{size}/lr-{lr}/{attn}-s{seed}", f"--dataset=wikitext {SIZES[size]} --seed={seed} "
            f"--attn={attn} {P} --learning_rate={lr} --min_lr={float(lr) / 10:g}")


PICK = [run(size, lr, 'standard', 1) for size in ('small', 'middle') for lr in RATES]  # the slowest first


@functools.cache  # once its three runs have finished (runner.run(PICK) waits for them), the pick stays
def picked(size):  # the rate of standard's best seed-1 run at this size: its lowest full-split val perplexity
    ppl = {}
    for lr in RATES:
        final = report.load_runs([run(size, lr, 'standard', 1)[0]])  # a failed run: inf, never picked
        if final:
            ppl[lr] = final[0]['final']['val_ppl']
    return min(ppl, key=ppl.get) if len(ppl) == len(RATES) else None


def jobs():  # the runs at each size's picked rate (standard seed 1 is its pick's run)
    return [run(size, picked(size), attn, s) for size in SIZES for attn in ('standard', 'coupled') for s in (1, 2, 3)
            if picked(size) and (attn, s) != ('standard', 1)]


def folders(size):  # {attn: [run folders, seeds 1-3]}
    if size == 'tiny':
        return {a: [f"runs/laptop/wikitext/{a}-s{s}" for s in (1, 2, 3)] for a in ('standard', 'coupled')}
    return {a: [run(size, picked(size), a, s)[0] for s in (1, 2, 3)] for a in ('standard', 'coupled')}


def table():
    """Per size: parameters (all, the tied embedding once, as the paper counts), the learning rate, each variant's
    full-split val perplexity (mean +- std over seeds), coupled's change against standard and its t. Returns the
    rows for the picture."""
    print("| size | layers x width | parameters | learning rate | standard | coupled | change | t |\n"
          "|---|---|---|---|---|---|---|---|")
    rows = []
    for size in ('tiny', *SIZES):
        if size != 'tiny' and not picked(size):
            print(f"| {size} | standard's learning rate is not picked yet: its three runs have not all finished |")
            continue
        runs = {a: report.done(report.load_runs(f)) for a, f in folders(size).items()}
        if any(len(r) < 3 for r in runs.values()):
            print(f"| {size} | {len(runs['standard'])} + {len(runs['coupled'])} of 6 runs finished so far |")
            continue
        ppl = {a: [r['final']['val_ppl'] for r in sorted(rs, key=lambda r: r['config']['seed'])]
               for a, rs in runs.items()}
        (s, c), cfg = ppl.values(), runs['standard'][0]['config']
        params = params_of(runs['standard'][0])
        change, se = 100 * (mean(c) / mean(s) - 1), math.sqrt(stdev(s) ** 2 / 3 + stdev(c) ** 2 / 3)
        print(f"| {size} | {cfg['n_layer']} x {cfg['n_embd']} | {params / 1e6:.2f}M | {cfg['learning_rate']:g} | "
              f"{mean(s):.3f} +- {stdev(s):.3f} | {mean(c):.3f} +- {stdev(c):.3f} | {change:+.1f}% | "
              f"{(mean(c) - mean(s)) / se:.1f} |")
        rows.append(dict(params=params, change=change, se=100 * se / mean(s),
                         seeds=[100 * (b / a - 1) for a, b in zip(s, c)]))
    return rows


def params_of(r):  # a run's parameter count, from its log's first record
    return next(x for x in report.read_log(r['path']) if x['event'] == 'start')['params']


def plot(rows, path='results/sizes.png'):
    """coupled's change of perplexity against parameters (log axis): ours with +-1 standard error and each seed's
    pair, the paper's three points beside them."""
    _, plt = report.pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.8))
    ax.axhline(0, color='grey', lw=0.8)
    ax.errorbar([r['params'] for r in rows], [r['change'] for r in rows], [r['se'] for r in rows], fmt='o-',
                capsize=4, label='ours: WikiText-2 test text, bytes, 500 iterations (mean, +-1 s.e.)')
    for r in rows:
        ax.plot([r['params']] * len(r['seeds']), r['seeds'], '.', color='C0', alpha=0.4)
    ax.plot(*zip(*PAPER), 's--', color='C3', label='the paper: WikiText-103, GPT-2 tokens')
    ax.set(xscale='log', xlabel='parameters', ylabel='coupled vs standard, perplexity (%)',
           title='The gap against model size (dots: each seed\'s pair)')
    ax.grid(alpha=0.3, which='both')
    ax.legend(fontsize=7)
    report.save(fig, path)


if __name__ == '__main__':
    runner.run(PICK)
    runner.run(jobs())
    rows = table()
    if rows:
        plot(rows)
