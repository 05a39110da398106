"""The gap against model size: standard and coupled at three sizes on the WikiText text, 500 iterations of 16 x 128
tokens (about one epoch). tiny (4 x 128) reuses results/paper_corpora.py's runs at train.py's rate, seeds 1-3. At the
middle size (4 x 256) and at small (6 x 384) each variant's learning rate is picked with seed 1 from a grid of factors
of two, widened at the end where the best sits until it sits inside (min_lr a tenth). Then seeds 1-3 (middle) or 1-5
(small) train each variant at its own rate, and both at standard's where the two differ. Then the tables and the
picture, results/.assets/sizes.png. Run from the repository root, with CORPORA_DIR as for results/paper_corpora.py:
    python results/sizes.py"""
import math
import os
from statistics import mean, stdev

import paper_corpora
import report
import runner
from laptop import P

SIZES = {'middle': '--n_layer=4 --n_head=4 --n_embd=256', 'small': '--preset=small'}
SEEDS = {'tiny': (1, 2, 3), 'middle': (1, 2, 3), 'small': (1, 2, 3, 4, 5)}
GRID = {'middle': ('1e-3', '2e-3', '4e-3'), 'small': ('5e-4', '1e-3', '2e-3')}  # the first grids, at seed 1
TINY_LR = '2e-3'  # train.py's default, at which results/laptop.py trains every variant
ATTN = ('standard', 'coupled')
PAPER = [(60e6, -6.6), (150e6, -6.7), (350e6, -1.0)]  # the abstract's change of perplexity, in % of standard's


def run(size, lr, attn, seed):  # (out_dir, flags)
    if size == 'tiny':
        return f"runs/laptop/wikitext/{attn}-s{seed}", f"--dataset=wikitext --seed={seed} --attn={attn} {P}"
    return (f"runs/sizes/{size}/lr-{lr}/{attn}-s{seed}", f"--dataset=wikitext {SIZES[size]} --seed={seed} "
            f"--attn={attn} {P} --learning_rate={lr} --min_lr={float(lr) / 10:g}")


def ppl(size, lr, attn, seed=1):  # a finished run's full-split val perplexity (a failed run: inf); None: not yet
    out = run(size, lr, attn, seed)[0]
    return report.load_runs([out])[0]['final']['val_ppl'] if runner.finished(out) else None


def grid(size, attn):  # the rates tried at seed 1: the first grid, widened by a factor of two where the best sits
    rates = list(GRID[size])
    while all(ppl(size, lr, attn) is not None for lr in rates):
        best = min(rates, key=lambda lr: ppl(size, lr, attn))
        if best not in (rates[0], rates[-1]):
            break
        wider = f"{float(best) * (0.5 if best == rates[0] else 2):.0e}".replace('e-0', 'e-')
        rates = [wider] + rates if best == rates[0] else rates + [wider]
    return rates


def picked(size, attn):  # the best rate, strictly inside its grid; None while the grid's runs are missing
    if size == 'tiny':
        return TINY_LR
    rates = grid(size, attn)
    if any(ppl(size, lr, attn) is None for lr in rates):
        return None
    return min(rates, key=lambda lr: ppl(size, lr, attn))


def pairs(size):  # {label: (standard's rate, coupled's rate)}: each at its own best, and both at standard's
    s, c = picked(size, 'standard'), picked(size, 'coupled')
    return {'own best': (s, c)} | ({"standard's": (s, s)} if c != s else {})


def jobs(size):  # every seed of each pair, once both rates are picked
    if not all(picked(size, a) for a in ATTN):
        return []
    return list(dict.fromkeys(run(size, lr, attn, seed) for rates in pairs(size).values()
                              for attn, lr in zip(ATTN, rates) for seed in SEEDS[size]))


def t_of(s, c):  # the difference of the means over its standard error (negative: coupled is better)
    return (mean(c) - mean(s)) / math.sqrt(stdev(s) ** 2 / len(s) + stdev(c) ** 2 / len(c))


def picks_table():
    print("| size | variant | seed 1's full-split perplexity at each learning rate | picked |\n|---|---|---|---|")
    for size in GRID:
        for attn in ATTN:
            cells = [f"{lr}: " + (f"{p:.3f}" if p is not None else 'not yet')
                     for lr, p in ((lr, ppl(size, lr, attn)) for lr in grid(size, attn))]
            print(f"| {size} | {attn} | {', '.join(cells)} | {picked(size, attn) or 'not yet'} |")


def table():
    """Per size and pair of rates: parameters (all, the tied embedding once, as the paper counts), the rates, each
    variant's full-split val perplexity (mean +- std over seeds), coupled's change against standard, t over every
    seed and, at small, over seeds 2-5 (seed 1 picked the rates). Returns the own-best rows, for the picture."""
    print("\n| size | parameters | rates (standard, coupled) | seeds | standard | coupled | change | t "
          "| t, seeds 2-5 |\n|---|---|---|---|---|---|---|---|---|")
    rows = []
    for size in ('tiny', *SIZES):
        if not all(picked(size, a) for a in ATTN):
            print(f"| {size} | the learning rates are not picked yet: their seed-1 runs have not all finished |")
            continue
        for label, rates in pairs(size).items():
            seeds = SEEDS[size]
            p = {a: [ppl(size, lr, a, s) for s in seeds] for a, lr in zip(ATTN, rates)}
            done = sum(x is not None for v in p.values() for x in v)
            if done < 2 * len(seeds):
                print(f"| {size} | {label}: {done} of {2 * len(seeds)} runs finished so far |")
                continue
            s, c = p['standard'], p['coupled']
            later = f"{t_of(s[1:], c[1:]):.1f}" if size == 'small' else ''
            params = next(x for x in report.read_log(os.path.join(run(size, rates[0], 'standard', 1)[0],
                                                                  'metrics.jsonl')) if x['event'] == 'start')['params']
            change, se = 100 * (mean(c) / mean(s) - 1), math.sqrt(stdev(s) ** 2 / len(s) + stdev(c) ** 2 / len(c))
            print(f"| {size} | {params / 1e6:.2f}M | {rates[0]}, {rates[1]} | 1-{seeds[-1]} | {mean(s):.3f} +- "
                  f"{stdev(s):.3f} | {mean(c):.3f} +- {stdev(c):.3f} | {change:+.1f}% | {t_of(s, c):.1f} | {later} |")
            if label == 'own best':
                rows.append(dict(size=size, params=params, change=change, se=100 * se / mean(s),
                                 seeds=[100 * (b / a - 1) for a, b in zip(s, c)]))
    return rows


def wall_time():  # the summed wall times of the finished runs the tables cite, as their logs' final records say
    outs = [run(size, lr, a, 1)[0] for size in GRID for a in ATTN for lr in grid(size, a)]
    done = [o for o in dict.fromkeys(outs + [o for size in SEEDS for o, _ in jobs(size)]) if runner.finished(o)]
    hours = sum(report.load_runs([o])[0]['final']['time'] for o in done) / 3600
    print(f"\n{len(done)} runs have finished; their wall times, one core each, sum to {hours:.1f} hours")


# what a seed fixes: one command (standard, small, seed 1, 200 iterations of the 500-iteration schedule, every loss
# logged) with one thing changed against runs/sizes/seeds/here-<rate> (one thread, this code, the best CPU kernel)
STUDY = {'b7058e8-2e-3': "the first protocol's code (b7058e8)", 'threads2-2e-3': 'two threads',
         'default-kernel-2e-3': 'ATEN_CPU_CAPABILITY=default', 'default-kernel-1e-3': 'ATEN_CPU_CAPABILITY=default'}


def seeds_table():
    """Per change: the first iteration whose training loss differs, the largest difference in each 50 iterations and
    the full-split perplexity at 200 of both runs."""
    print("\n| rate | changed | first iteration whose loss differs | largest difference in iterations 1-50, 51-100, "
          "101-150, 151-200 | full-split perplexity at 200, unchanged and changed |\n|---|---|---|---|---|")
    for name, changed in STUDY.items():
        logs = [report.read_log(f"runs/sizes/seeds/{n}/metrics.jsonl") for n in (f"here-{name[-4:]}", name)]
        (a, b), (pa, pb) = ([{r['iter']: r['loss'] for r in log if r['event'] == 'train'} for log in logs],
                            [log[-1]['val_ppl'] for log in logs])
        first = next((i for i in sorted(a) if a[i] != b[i]), 'none')
        most = [max(abs(a[i] - b[i]) for i in range(lo, lo + 50)) for lo in (1, 51, 101, 151)]
        print(f"| {name[-4:]} | {changed} | {first} | {', '.join(f'{d:.1e}' for d in most)} | {pa:.3f}, {pb:.3f} |")


def plot(rows, path='results/.assets/sizes.png'):
    """coupled's change of perplexity against parameters (log axis), each variant at its own best rate: ours with +-1
    standard error and each seed's pair, the paper's three points beside them."""
    _, plt = report.pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.axhline(0, color='grey', lw=0.8)
    ax.errorbar([r['params'] for r in rows], [r['change'] for r in rows], [r['se'] for r in rows], fmt='o-',
                capsize=4, label='ours: WikiText-2 test text, bytes, 500 iterations (mean, +-1 s.e.)')
    for r in rows:  # each seed's pair a little to the right of its size, so the mean hides none
        ax.plot([r['params'] * 1.25] * len(r['seeds']), r['seeds'], 'o', mfc='none', color='C0', ms=4)
        ax.annotate(r['size'], (r['params'], r['change']), (-8, 0), textcoords='offset points', ha='right')
    ax.plot(*zip(*PAPER), 's--', color='C3', label='the paper: WikiText-103, GPT-2 tokens, full training')
    ax.set(xscale='log', xlabel='parameters', ylabel='coupled vs standard, perplexity (%)\nbelow 0: coupled is better',
           title='The gap against model size (circles: each seed\'s pair)')
    ax.grid(alpha=0.3, which='both')
    ax.legend(fontsize=8, loc='upper right')
    report.save(fig, path)


if __name__ == '__main__':
    runner.start()
    for size in ('small', 'middle', 'tiny'):  # the slowest first: a size's picks, widened until bracketed, its seeds
        picks = []
        while size != 'tiny' and picks != [run(size, lr, a, 1) for a in ATTN for lr in grid(size, a)]:
            picks = [run(size, lr, a, 1) for a in ATTN for lr in grid(size, a)]
            runner.run(picks, paper_corpora.prepare)  # the WikiText text, if a run is missing
        runner.run(jobs(size), paper_corpora.prepare)
    picks_table()
    rows = table()
    wall_time()
    seeds_table()
    if len(rows) == 1 + len(SIZES):
        plot(rows)
