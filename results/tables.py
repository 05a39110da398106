"""
The results pages' tables: bench.py's report of train.py runs, and beside it the attention at the final eval, the
seed variances (each pair's ratio with its F interval and Levene's p) and, with --sweep, final perplexity against
a setting (with --plot, its picture; without --sweep, --plot draws the curves as bench.py does).

  python results/tables.py runs/claims/lr --sweep=learning_rate --plot=stability.png
  python results/tables.py runs/claims/seeds
"""
import argparse
import math
import os
import sys
from statistics import mean, stdev

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench.py, from any folder
import bench  # noqa: E402
from bench import ATTENTION, done, finished, spread_of  # noqa: E402
from model import GPTConfig  # noqa: E402


def attention_table(rows, order):
    """Each row's attention diagnostics at its final eval, per layer from first to last, mean over the seeds that
    finished. A seed without them (a log from before train.py wrote them) is left out; one that lacks a layer, or
    whose diagnostics are not finite, is left out with a note; no row: no table."""
    lines = []
    for key in order:
        seeds = [r for r in done(rows[key]['runs']) if r['evals'] and r['evals'][-1].get('attn')]
        layers = max((len(r['evals'][-1]['attn']) for r in seeds), default=0)
        att = []  # per seed, per layer, {entropy, sink, gap}; zip(*att): per layer, per seed
        for r in seeds:
            a, n = r['evals'][-1]['attn'], r['config'].get('n_layer', layers)
            if len(a) != n or not all(math.isfinite(s[k]) for s in a for k in ATTENTION):
                why = f"logged {len(a)} of {n} layers" if len(a) != n else "are not all finite"
                print(f"note: {r['path']}: its final attention diagnostics {why}; left out of the attention table",
                      file=sys.stderr)
            else:
                att.append(a)
        if att:
            cells = [' '.join(f"{mean(s[k] for s in layer):.3f}" for layer in zip(*att))
                     + f" ({spread_of([mean(s[k] for s in seed) for seed in att])})" for k in ATTENTION]
            lines.append(f"| {key[0]} | {key[1]} | {len(att)} | {' | '.join(cells)} |")
    if lines:
        print("\nAttention at the final eval, per layer from first to last, mean over seeds (in brackets: the mean "
              "over layers, mean +- std over seeds). entropy: a row's entropy over its maximum (1: uniform); sink: the "
              "mass on the window's first position; gap: sigma_2 / sigma_1 (0: rank one)\n"
              "| corpus | variant | seeds | entropy | sink | gap |\n|---|---|---|---|---|---|")
        print('\n'.join(lines))


def variance_table(ppl, order, least=5):
    """Seed variance of the rows with >= least seeds, and for each pair of them (same corpus) the ratio of their
    variances with its 95% interval from the F distribution and Levene's test (both need scipy; else ratio only)."""
    keys = [k for k in order if len(finished(ppl[k])) >= least]
    if not keys:
        return
    try:
        from scipy import stats
    except ImportError:
        stats = None
        print("note: the variance intervals and Levene's test need scipy (pip install scipy)", file=sys.stderr)
    print(f"\nSeed variance (rows with {least} or more seeds): the variance of the final perplexity, and each pair's "
          "ratio with its 95% interval (F distribution, normal seeds) and Levene's p (median-centered)\n"
          "| corpus | variant | seeds | std | variance | / variant | ratio | 95% interval | Levene p |\n"
          "|---|---|---|---|---|---|---|---|---|")
    var = lambda x: stdev(x) ** 2 if stdev(x) < 1e150 else math.inf  # noqa: E731  (a float's square overflows)
    for i, a in enumerate(keys):
        x = finished(ppl[a])
        std = f"{stdev(x):.3f}" if stdev(x) < 1e6 else f"{stdev(x):.3g}"
        print(f"| {a[0]} | {a[1]} | {len(x)} | {std} | {var(x):.4f} | | | | |")
        for b in (b for b in keys[i + 1:] if b[0] == a[0]):  # pairs within a corpus
            y = finished(ppl[b])
            if stdev(y) == 0:  # its seeds all ended alike: no ratio over it
                print(f"note: {b[0]}/{b[1]}: its seeds' perplexities are all equal (variance 0); no ratio over it",
                      file=sys.stderr)
                print(f"| {a[0]} | {a[1]} | | | | {b[1]} | - | - | - |")
                continue
            r, interval, lev = var(x) / var(y), '-', '-'
            # r / F(0.975) .. r / F(0.025), F with (len(x) - 1, len(y) - 1) degrees of freedom
            if stats and math.isfinite(var(x)) and math.isfinite(var(y)):
                f = lambda q: stats.f.ppf(q, len(x) - 1, len(y) - 1)
                interval, lev = f"{r / f(0.975):.2f} - {r / f(0.025):.2f}", f"{stats.levene(x, y).pvalue:.2f}"
            print(f"| {a[0]} | {a[1]} | | | | {b[1]} | {r:.2f} | {interval} | {lev} |")


def numeric(v):
    return type(v) in (int, float)  # not a bool


def sweep_cells(rows, order, key):
    """The rows split by each run's setting `key`: [(row key, value, runs)] by corpus, variant, then value (numbers
    first, then the rest by name). A row holds one value of a compared setting, and a value each of seed or dtype."""
    cells = []
    for k in order:
        values = {}
        for r in rows[k]['runs']:
            if reads(r, key):
                v = r['config'][key]
                values.setdefault(v if isinstance(v, (int, float, str, type(None))) else str(v), []).append(r)
        cells += [(k, v, rs) for v, rs in values.items()]
    at = lambda v: (0, v, '') if numeric(v) else (1, 0, str(v))
    return sorted(cells, key=lambda c: (c[0][0], series(rows, c[0], key), at(c[1])))


def series(rows, k, key):
    """Row k's line in a sweep of `key`: its variant, and the settings that tell apart two of the variant's rows at
    one value of `key` (standard [bias=True]), so that no line averages runs that differ in more than `key`."""
    attn, corpus = rows[k]['kind'].get('attn'), k[0]
    kinds = [r['kind'] for j, r in rows.items() if j[0] == corpus and r['kind'].get('attn') == attn]
    differ = sorted({d for a in kinds for b in kinds if a.get(key) == b.get(key)
                     for d in set(a) & set(b) if d not in (key, 'tokens') and a[d] != b[d]})  # (a key one log lacks: alike)
    return f"{attn}" + (' [' + ', '.join(f"{d}={rows[k]['kind'].get(d)}" for d in differ) + ']' if differ else '')


def reads(run, key):  # whether the run logged the setting and its variant reads it (standard and diff: no qk_*)
    if key not in run['config']:
        return False
    try:
        return not key.startswith('qk_') or bool(GPTConfig(attn=run['config'].get('attn', 'standard')).qk_name)
    except (ValueError, TypeError):  # a variant this model.py does not know
        return True


def counted(paths):  # "1 run", "4 runs"
    return f"{len(paths)} run{'s' * (len(paths) != 1)}"


def check_sweep(rows, key):  # a one-line error for a key no run logged or no run varies; a note for older logs
    runs = [r for row in rows.values() for r in row['runs']]
    unread = [r['path'] for r in runs if key in r['config'] and not reads(r, key)]
    if unread:
        print(f"note: {counted(unread)} without a q/k map (which {key} sets) left out of the sweep: "
              f"{', '.join(unread)}", file=sys.stderr)
    runs = [r for r in runs if r['path'] not in unread]
    values = {str(r['config'][key]) for r in runs if key in r['config']}
    if not values:
        sys.exit(f"error: --sweep={key}: no run logged that setting; name a train.py flag, e.g. learning_rate")
    if len(values) == 1:
        sys.exit(f"error: --sweep={key}: every run has {key}={values.pop()}; name a setting the runs vary, "
                 f"e.g. learning_rate")
    lack = [r['path'] for r in runs if key not in r['config']]
    if lack:
        print(f"note: {counted(lack)} did not log {key} (older logs), left out of the sweep: {', '.join(lack)}",
              file=sys.stderr)


def sweep_table(rows, order, key):
    """The rows as variant x the setting `key`: final perplexity, diverged runs, loss spikes after warmup."""
    print(f"\nSweep of {key}: full-split val perplexity over the seeds that finished; diverged: stopped at a "
          f"non-finite loss; spikes: train-loss log points after warmup more than 10% above the lowest before them\n"
          f"| corpus | variant | {key} | seeds | val ppl | diverged | spikes (runs with any) |\n"
          "|---|---|---|---|---|---|---|")
    for k, v, runs in sweep_cells(rows, order, key):
        p = [mean(x) for x in bench.by_seed(runs).values()]
        ok, sp = finished(p), [r['spikes'] for r in runs]
        print(f"| {k[0]} | {series(rows, k, key)} | {v} | {len(p)} | {spread_of(ok) if ok else '-'} | "
              f"{len(p) - len(ok)} | {sum(sp)} ({sum(map(bool, sp))}) |")


def plot_sweep(rows, path, key):
    """Final perplexity against the setting `key`, a line per variant (mean over the seeds that finished, band: min
    to max), diverged runs as crosses along the top, a panel per corpus. A numeric key: a log axis, or a linear one
    where a value is 0 or below (said on the axis); any other (attn, bias, dtype): a position per value."""
    matplotlib, plt = bench.pyplot()
    cells = sweep_cells(rows, sorted(rows), key)
    values = sorted({v for _, v, _ in cells}, key=lambda v: (0, v, '') if numeric(v) else (1, 0, str(v)))
    by_number = all(map(numeric, values))
    log = by_number and min(values) > 0
    x_of = (lambda v: v) if by_number else values.index
    span = (max(values) - min(values) if by_number else len(values)) or 1
    nudge = (lambda x, i: x * 1.04 ** i) if log else (lambda x, i: x + 0.015 * span * i)  # a variant's crosses apart
    corpora = sorted({c for c, _ in rows})
    fig, axes = plt.subplots(1, len(corpora), figsize=(5 * len(corpora), 3.8), squeeze=False)
    for ax, corpus in zip(axes[0], corpora):
        variants = sorted({series(rows, k, key) for k, _, _ in cells if k[0] == corpus})
        diverged = {}
        for i, v in enumerate(variants):
            at = {}  # x: the final perplexities of the variant's seeds there, over its rows
            for k, x, rs in cells:
                if k[0] == corpus and series(rows, k, key) == v:
                    at.setdefault(x_of(x), []).extend(mean(p) for p in bench.by_seed(rs).values())
            mine = sorted(at.items())
            ok = [(x, finished(p)) for x, p in mine if finished(p)]
            color = f"C{i % 10}"
            if ok:
                ax.plot([x for x, _ in ok], [mean(p) for _, p in ok], 'o-', label=v, color=color, lw=1.3, ms=3)
                ax.fill_between([x for x, _ in ok], [min(p) for _, p in ok], [max(p) for _, p in ok], alpha=0.15,
                                color=color)
            diverged[v] = [x for x, p in mine for q in p if not math.isfinite(q)]
        low, high = ax.get_ylim()
        ax.set_ylim(low, high + 0.15 * (high - low))  # a strip along the top, above every line, for the crosses
        for i, v in enumerate(variants):  # a cross per diverged run, nudged right per variant
            xs = diverged.get(v, [])
            ax.plot([nudge(x, i) for x in xs], [0.95] * len(xs), 'x', color=f"C{i % 10}", ms=7,
                    transform=ax.get_xaxis_transform())
        axis = '' if log or not by_number else ' (linear axis: a value is 0 or below)'
        crosses = ": x along the top, a diverged run" if any(diverged.values()) else ''
        ax.set(xlabel=key + axis, ylabel='val perplexity (full split)', title=corpus + crosses,
               xscale='log' if log else 'linear')
        if not by_number:
            ax.set_xticks(range(len(values)), [str(v) for v in values])
        ax.grid(alpha=0.3, which='both')
        ax.legend(fontsize=7)
    bench.save(fig, path)


def report(folders, plot=None, sweep=None):
    """bench.py's report of the runs under folders, with the attention, variance and (with sweep) sweep tables."""
    rows, ppl, notes = bench.rows_of(folders)
    if sweep:
        check_sweep(rows, sweep)
    if plot:  # first: a path it cannot write to stops it before any output
        plot_sweep(rows, plot, sweep) if sweep else bench.plot_curves(rows, plot)
    order, used = bench.results_table(rows, ppl)
    attention_table(rows, order)
    variance_table(ppl, order)
    if sweep:
        sweep_table(rows, order, sweep)
    bench.footnote(rows, ppl, used)
    for note in notes:
        print(note, file=sys.stderr)


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not a usage dump
        sys.exit(f"error: {message}; see python results/tables.py --help")


def main(argv=None):
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('folders', nargs='+', help='run folders (--out_dir of train.py), or folders above them')
    p.add_argument('--sweep', help='a table (and with --plot, a picture) of final perplexity, diverged runs and loss '
                   'spikes against this train.py setting, e.g. learning_rate')
    p.add_argument('--plot', help="the sweep's picture, or else each row's learning curve, into this file")
    args = p.parse_intermixed_args(argv)
    if args.sweep is not None and not args.sweep.strip():
        p.error("--sweep= names no setting; name a train.py flag, e.g. --sweep=learning_rate")
    if args.plot is not None and not os.path.splitext(args.plot)[1]:
        p.error("--plot names a file by its format, e.g. --plot=curves.png")
    report(args.folders, args.plot, args.sweep)


if __name__ == '__main__':
    main()
