"""
Tables of finished train.py runs. A row is a variant on a corpus: its seeds' full-split validation perplexity (mean
+- std), the change against standard, and the tokens standard needs to match it. Then the attention at the final
evaluation, the seed variances, and with --sweep the final perplexity against a setting. --plot draws the curves (or
the sweep).

  python results/report.py out-standard out-coupled        # two runs side by side
  python results/report.py runs/laptop --plot=curves.png   # every run under a folder, and their curves
  python results/report.py runs/claims/lr --sweep=learning_rate --plot=stability.png

A run is a folder with a metrics.jsonl, labelled by its name less '-s<seed>' (coupled-s2: coupled). It counts once,
copies of it too, under the name of the folder it trained in (its --out_dir), else the shortest. A run that failed (a
loss that is not finite, or not below ln(vocabulary size), a uniform guess) is counted in its row and never averaged.
Runs that differ in model, training or corpus are never one row.
"""
import argparse
import hashlib
import json
import math
import os
import sys
from itertools import groupby
from statistics import mean, median, stdev

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # model.py, from any folder
from model import attn_names, median_layer  # noqa: E402

# settings that change neither model nor training: runs that differ only in these share a row
NOT_COMPARED = {'seed', 'out_dir', 'data_dir', 'init_from', 'eval_only', 'device', 'compile', 'preset',
                'log_interval', 'eval_interval', 'eval_iters', 'always_save_checkpoint', 'time_budget', 'sample',
                'sample_tokens', 'diag_interval'}
SHAPE = ('n_layer', 'n_head', 'n_embd', 'block_size', 'bias', 'pos', 'vocab_size')
BASE = SHAPE + ('fingerprint',)  # a row's baseline: standard of the same shape, on the same text
BATCHES = ('eval_iters', 'batch_size', 'block_size', 'dataset')  # equal: the estimates score the same batches
ATTENTION = ('entropy', 'sink', 'gap')  # model.attention_diagnostics, per layer


# -----------------------------------------------------------------------------
# the runs

def read_log(path):
    """The records of a metrics.jsonl; a line cut short (a run killed as it wrote) is skipped with a warning."""
    records = []
    for i, line in enumerate(open(path, encoding='utf-8', errors='replace'), 1):
        try:
            records.append(json.loads(line))
        except ValueError:
            print(f"warning: {path}:{i} is not a log record (cut short?); skipped", file=sys.stderr)
    return records


def standing(log):
    """The records up to the last final. A start at iteration N (a resume) voids the records past N (work lost to
    a stop), but not a final that scored a model of iteration N or before (a best-only checkpoint, which the resume
    continues). A run that stopped at a non-finite loss, with no final, ends at its 'diverged' record."""
    kept = []
    for r in log:
        if r['event'] == 'start':
            kept = [k for k in kept if k.get('iter', 0) <= r['iter']
                    or k['event'] == 'final' and k.get('model_iter', r['iter'] + 1) <= r['iter']]
        kept.append(r)
    ends = [i for i, r in enumerate(kept) if r['event'] == 'final'] or [
        i for i, r in enumerate(kept) if r['event'] == 'diverged']
    return kept[:max(ends) + 1] if ends else []


def folder_label(path):  # a run folder's name less '-s<seed>' and 'out-': out-coupled-s2: coupled
    name = os.path.basename(os.path.dirname(path))
    label, _, seed = name.rpartition('-s')
    return (label if label and seed.isdigit() else name).removeprefix('out-').removeprefix('out_')


def trained_in(path):  # its folder is one its log says the run trained in (a start's --out_dir), by name
    folder = os.path.basename(os.path.dirname(os.path.abspath(path)))  # (abspath: the folder '.' has a name)
    return folder in {os.path.basename(os.path.normpath(str(r['config'].get('out_dir'))))  # (normpath: out-coupled/)
                      for r in read_log(path) if r['event'] == 'start'}


def find_logs(folders):
    """Every metrics.jsonl under folders, each run once: copies of one log (cp -a, a link) count as one run, under
    the name of the folder the run trained in (the out_dir its log records), else the shortest path. A copy's age
    says nothing: cp -a and rsync -a keep it."""
    logs = {}
    for top in folders:
        for d, _, files in os.walk(top, followlinks=True):
            if 'metrics.jsonl' in files:
                path = os.path.join(d, 'metrics.jsonl')
                digest = hashlib.sha256(open(path, 'rb').read()).hexdigest()
                logs.setdefault(digest, {}).setdefault(os.path.realpath(path), path)  # a folder reached twice: once
    kept = []
    for paths in logs.values():
        original, *copies = sorted(paths.values(), key=lambda p: (len(paths) > 1 and not trained_in(p),
                                                                  len(p), p))  # (a copy's log read only then)
        if copies:
            print(f"note: {', '.join(copies)} {'is a copy' if len(copies) == 1 else 'are copies'} of {original}; "
                  "counted once, as it", file=sys.stderr)
        kept.append(original)
    return sorted(kept)


def load_runs(folders):
    """Every finished train.py run in or under the folders, labelled by its folder's name less '-s<seed>' and
    'out-' (out-coupled-s2: coupled; 'out': its attn) and by what a resume changed: coupled [resumed: max_iters
    500->1000]."""
    runs = []
    for path in find_logs(folders):
        log = standing(read_log(path))
        start = [r for r in log if r['event'] == 'start']
        final = log[-1] if start else {}
        cfg, world = start[-1]['config'] if start else {}, start[-1].get('world_size', 1) if start else 1
        if final.get('event') == 'diverged':  # stopped at a non-finite loss: inf, at the tokens it set out to train
            final = dict(final, val_loss=math.inf, tokens=cfg['max_iters'] * cfg['batch_size'] * cfg['block_size']
                         * cfg['gradient_accumulation_steps'] * world)
        if 'val_loss' not in final or not final['tokens']:
            print(f"note: {path} is not a finished run (no final evaluation after training); left out",
                  file=sys.stderr)
            continue
        vocab = start[-1].get('vocab_size')  # (older logs: none, and only a non-finite loss fails)
        if not final['val_loss'] < (math.log(vocab) if vocab else 700):  # no better than a uniform guess
            final = dict(final, val_ppl=math.inf)
        label = folder_label(path)
        label = str(cfg.get('attn', '?')) if label in ('out', '') else label
        # what each start trained with: a setting changed at a resume makes no straight run
        sets = [{k: v for k, v in s['config'].items() if k not in NOT_COMPARED} | {'world_size': s.get('world_size')}
                for s in start]
        changed = ', '.join(f"{k} " + '->'.join(v for v, _ in groupby(str(s.get(k)) for s in sets))
                            for k in sorted(set().union(*sets)) if any(s.get(k) != sets[0].get(k) for s in sets))
        if changed:
            label += f" [resumed: {changed}]"
            print(f"note: {path}: resumed with other settings; a row of its own", file=sys.stderr)
        if final.get('model_iter', final['iter']) != final['iter']:
            print(f"note: {path}: its result is its best-only checkpoint's model, iteration {final['model_iter']} of "
                  f"{final['iter']}", file=sys.stderr)
        evals = [r for r in log if r['event'] == 'eval' and r['iter'] <= final.get('model_iter', math.inf)]
        losses = [r['loss'] for r in log if r['event'] == 'train' and r['iter'] > cfg.get('warmup_iters', 0)]
        runs.append(dict(path=path, label=label, corpus=str(cfg.get('dataset', '?')), final=final, evals=evals,
                         ms=[r['ms'] for r in log if r['event'] == 'train'], spikes=spikes(losses),
                         config=cfg | {'seed': start[0]['config'].get('seed')},  # a resume continues the run's RNG
                         kind=sets[-1] | {'tokens': final.get('model_tokens', final['tokens'])}
                         | ({'fingerprint': start[-1]['fingerprint'][:12]} if 'fingerprint' in start[-1] else {})))
    return runs


def spikes(losses):
    """Loss spikes: train-loss log points more than 10% above the lowest before them."""
    low, n = math.inf, 0
    for x in losses:
        n += x > 1.1 * low
        low = min(low, x)
    return n


def group_runs(runs):
    """Rows: runs of one corpus and label that agree in all that makes them comparable (model, training, tokens);
    a label whose runs differ: a row per kind, named by what differs, and a note."""
    rows, notes, by_label = {}, [], {}
    for r in runs:
        by_label.setdefault((r['corpus'], r['label']), []).append(r)
    for (corpus, label), rs in by_label.items():
        kinds = []
        for r in rs:
            if r['kind'] not in kinds:
                kinds.append(r['kind'])
        differ = sorted({k for a in kinds for b in kinds for k in set(a) | set(b) if a.get(k) != b.get(k)})
        if 'fingerprint' in differ:
            notes.append(f"warning: {corpus}/{label}: its runs trained on different texts under the name {corpus} "
                         f"(corpus fingerprints {', '.join(sorted({str(k.get('fingerprint')) for k in kinds}))}); "
                         f"never averaged")
        if len(kinds) > 1:
            notes.append(f"note: {corpus}/{label}: its runs are not all alike ({', '.join(differ)} differ); "
                         f"shown as {len(kinds)} rows")
        for kind in kinds:
            name = label if len(kinds) == 1 else label + ' [' + ', '.join(f"{k}={kind.get(k)}" for k in differ) + ']'
            rows[(corpus, name)] = dict(label=label, kind=kind, runs=[r for r in rs if r['kind'] == kind])
    return rows, notes


def agree(a, b, keys):
    return all(a.get(k) == b.get(k) for k in keys)


def done(runs):  # the runs that did not fail (a failed one's perplexity: inf); only these are averaged
    return [r for r in runs if math.isfinite(r['final']['val_ppl'])]


def by_seed(runs):  # {seed: the final perplexities of its runs}
    seeds = {}
    for r in runs:
        seeds.setdefault(str(r['config'].get('seed')), []).append(r['final']['val_ppl'])
    return seeds


def rows_of(folders):
    """The rows of the finished runs under folders, each row's final perplexities (one a seed: the mean of the runs
    that repeat it) and the notes to print last."""
    for top in folders:
        if not os.path.isdir(top):  # a typo would else be a table quietly short of a folder's rows
            sys.exit(f"error: {top} is not a folder; name run folders (the --out_dir of train.py), or folders above "
                     "them")
    runs = load_runs(folders)
    if not runs:
        sys.exit(f"error: no finished train.py runs in {', '.join(folders)}; name run folders (--out_dir of train.py)")
    rows, notes = group_runs(runs)
    notes += [f"note: {c}/{name}: a folder named {row['label']} holds {row['kind'].get('attn')} runs; the table "
              f"compares them as {row['kind'].get('attn')}" for (c, name), row in rows.items()
              if row['label'] in attn_names() and row['label'] != row['kind'].get('attn')]
    ppl = {}
    for (corpus, name), row in rows.items():
        seeds = by_seed(row['runs'])
        ppl[(corpus, name)] = [mean(p) for p in seeds.values()]
        notes += [f"note: {corpus}/{name}: {len(p)} runs share seed {s}" for s, p in seeds.items() if len(p) > 1]
    return rows, ppl, notes


# -----------------------------------------------------------------------------
# the tables

def finished(p):  # the perplexities of the seeds that did not fail (a failed one: inf)
    return [x for x in p if math.isfinite(x)]


def finite_mean(p):  # a row's mean over the seeds that did not fail
    return mean(finished(p) or [math.inf])


def spread_of(p):  # "mean +- std" over the seeds that did not fail, and how many did
    ok = finished(p)
    text = f"{mean(ok):.3f}" + (f" +- {stdev(ok):.3f}" if len(ok) > 1 else '') if ok else 'inf'
    return text + (f" ({len(p) - len(ok)} of {len(p)} failed)" if len(ok) < len(p) else '')


def curve(row):
    """Mean over the seeds that did not fail of the row's validation estimates: [(tokens, loss)] at the evals every
    one of them logged."""
    per_seed = [{e['tokens']: e['val_loss'] for e in r['evals']} for r in done(row['runs'])]
    common = sorted(set.intersection(*(set(p) for p in per_seed))) if per_seed else []
    return [(t, mean(p[t] for p in per_seed)) for t in common]


def tokens_to_reach(points, target):
    """The first token count at which a curve [(tokens, loss)] reaches target, linearly interpolated; None: never."""
    for (t0, l0), (t1, l1) in zip([(0, math.inf)] + points, points):
        if l1 <= target:
            return t1 if l0 == math.inf else t0 + (t1 - t0) * (l0 - target) / (l0 - l1)
    return None


def token_ratio(row, rows, corpus):
    """'standard tokens to match' (the paper's "2.4x"): the tokens the longest comparable standard row needs to
    reach this row's final estimate (mean over its seeds that did not fail), over this row's tokens; '> N': never.
    Returns (ratio, that row's key)."""
    refs = [k for k, r in rows.items() if k[0] == corpus and r['kind'].get('attn') == 'standard'
            and agree(r['kind'], row['kind'], BASE) and curve(r)
            and agree(r['runs'][0]['config'], row['runs'][0]['config'], BATCHES)]
    last = [r['evals'][-1]['val_loss'] for r in done(row['runs']) if r['evals']]
    if not refs or not last:
        return '-', None
    ref = max(refs, key=lambda k: (rows[k]['kind']['tokens'], len(rows[k]['runs'])))
    points, tokens = curve(rows[ref]), row['kind']['tokens']
    needed = tokens_to_reach(points, mean(last))
    return (f"{needed / tokens:.2f}x" if needed is not None else f"> {points[-1][0] / tokens:.2f}x"), ref


def results_table(rows, ppl):
    """The table, a row of runs a line, standard first in each corpus, then by perplexity. Returns the rows in that
    order, and the standard rows whose curves 'standard tokens to match' read."""
    print("| corpus | variant | seeds | val ppl (full split, mean +- std) | vs standard | standard tokens to match "
          "| nonlinear | dt | tokens | ms/iter |\n|---|---|---|---|---|---|---|---|---|---|")
    used = set()
    standard = lambda k: rows[k]['kind'].get('attn') == 'standard'  # noqa: E731  (what it trained, not its name)
    named = {k[0] for k in rows if standard(k) and rows[k]['label'] == 'standard'}

    def baseline(row, corpus):  # the row named standard that trained standard; else the only row that trained it
        found = [k for k in rows if k[0] == corpus and standard(k) and agree(rows[k]['kind'], row['kind'], BASE)
                 and (rows[k]['label'] == 'standard' or corpus not in named)]
        return min(found, key=lambda k: rows[k]['kind']['tokens'] != row['kind']['tokens']) if (
            corpus in named or len(found) == 1) and found else None  # same tokens first
    order = sorted(rows, key=lambda k: (k[0], baseline(rows[k], k[0]) != k, mean(ppl[k])))
    for corpus, name in order:
        row = rows[(corpus, name)]
        p, tokens = ppl[(corpus, name)], row['kind']['tokens']
        base = baseline(row, corpus)
        rel = '-'
        if base and finished(p) and finished(ppl[base]):
            rel = f"{100 * (finite_mean(p) / finite_mean(ppl[base]) - 1):+.1f}%"
            if rows[base]['kind']['tokens'] != tokens:  # never compared silently
                rel += f" at {tokens / rows[base]['kind']['tokens']:.2f}x its tokens"
            theirs = rows[base]['kind']
            trained = sorted(k for k in set(row['kind']) | set(theirs) if k not in ('tokens', 'attn')
                             and not k.startswith('qk_') and row['kind'].get(k) != theirs.get(k))
            if trained:  # another training (a learning rate, dropout, steps): said, not compared silently
                at = ', '.join(f"{k}={theirs.get(k)} (this row: {row['kind'].get(k)})" for k in trained)
                print(f"note: {corpus}/{name}: 'vs standard' compares with {base[1]}, trained at {at}",
                      file=sys.stderr)
        ratio, ref = token_ratio(row, rows, corpus)
        if ref:
            used.add(ref)
        qk = [r['evals'][-1]['qk'] for r in done(row['runs']) if r['evals'] and r['evals'][-1].get('qk')]
        nonlin = [n for n in (median_layer(q, 'nonlinear') for q in qk) if n is not None]  # None: too few tokens
        dts = [mean(d for s in q for d in s['dt']) for q in qk if q[0].get('dt')]
        ms = [m for r in row['runs'] for m in r['ms'][1:] or r['ms']]
        print(f"| {corpus} | {name} | {len(p)} | {spread_of(p)} | {rel} | {ratio} | "
              f"{f'{100 * mean(nonlin):.2f}%' if nonlin else '-'} | "
              f"{f'{mean(dts):.3f}' if dts else '-'} | {tokens:,} | "
              f"{f'{median(ms):.0f}' if ms else '-'} |")
    return order, used


def footnote(rows, ppl, used):  # which curves 'standard tokens to match' read, and how
    for corpus in sorted({c for c, _ in used}):
        keys = [k for k in rows if k in used and k[0] == corpus]
        refs = [f"{k[1]} ({len(ppl[k])} seed{'s' * (len(ppl[k]) > 1)}, {len(curve(rows[k]))} evals to "
                f"{curve(rows[k])[-1][0]:,} tokens)" for k in keys]
        n = rows[keys[0]]['runs'][0]['config'].get('eval_iters')
        print(f"\n{corpus}: 'standard tokens to match' reads the curve of {' and '.join(refs)}: its {n}-batch "
              f"validation estimates, mean over seeds, where they first reach each row's final estimate (interpolated "
              f"between evals). Estimates are noisy, and a mid-run point is not the end of a run (its learning "
              f"rate has not decayed yet): standard's own row calibrates the reading")


def attention_table(rows, order):
    """Each row's attention diagnostics at its final eval, per layer from first to last, mean over the seeds that
    did not fail and logged them all (older logs: none); no row, no table."""
    lines = []
    for key in order:
        att = [r['evals'][-1]['attn'] for r in done(rows[key]['runs']) if r['evals'] and r['evals'][-1].get('attn')]
        att = [a for a in att if all(math.isfinite(s[k]) for s in a for k in ATTENTION)]
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
    for i, a in enumerate(keys):
        x = finished(ppl[a])
        print(f"| {a[0]} | {a[1]} | {len(x)} | {stdev(x):.3f} | {stdev(x) ** 2:.4f} | | | | |")
        for b in (b for b in keys[i + 1:] if b[0] == a[0]):  # pairs within a corpus
            y = finished(ppl[b])
            if stdev(y) == 0:  # its seeds all ended alike: no ratio over it
                print(f"| {a[0]} | {a[1]} | | | | {b[1]} | - | - | - |")
                continue
            r, interval, lev = stdev(x) ** 2 / stdev(y) ** 2, '-', '-'
            if stats:  # r / F(0.975) .. r / F(0.025), F with (len(x) - 1, len(y) - 1) degrees of freedom
                f = lambda q: stats.f.ppf(q, len(x) - 1, len(y) - 1)  # noqa: E731
                interval, lev = f"{r / f(0.975):.2f} - {r / f(0.025):.2f}", f"{stats.levene(x, y).pvalue:.2f}"
            print(f"| {a[0]} | {a[1]} | | | | {b[1]} | {r:.2f} | {interval} | {lev} |")


# -----------------------------------------------------------------------------
# --sweep: final perplexity against one setting

def sweep_cells(rows, order, key):
    """The rows split by each run's setting `key`: [(row key, value, runs)] by corpus, variant, then value."""
    cells = []
    for k in order:
        values = {}
        for r in rows[k]['runs']:
            if key in r['config']:
                values.setdefault(r['config'][key], []).append(r)
        cells += [(k, v, rs) for v, rs in values.items()]
    return sorted(cells, key=lambda c: (c[0][0], series(rows, c[0], key), at(c[1])))


def at(v):  # a sweep's order of values: numbers first, then the rest by name
    return (0, v, '') if type(v) in (int, float) else (1, 0, str(v))


def series(rows, k, key):
    """Row k's line in a sweep of `key`: its variant, and the settings that tell apart two of the variant's rows at
    one value of `key` (standard [bias=True]), so that no line averages runs that differ in more than `key`."""
    attn, corpus = rows[k]['kind'].get('attn'), k[0]
    kinds = [r['kind'] for j, r in rows.items() if j[0] == corpus and r['kind'].get('attn') == attn]
    differ = sorted({d for a in kinds for b in kinds if a.get(key) == b.get(key)
                     for d in set(a) & set(b) if d not in (key, 'tokens') and a[d] != b[d]})
    return f"{attn}" + (' [' + ', '.join(f"{d}={rows[k]['kind'].get(d)}" for d in differ) + ']' if differ else '')


def check_sweep(rows, key):  # a key the runs do not vary is a mistyped one
    values = {str(r['config'].get(key)) for row in rows.values() for r in row['runs'] if key in r['config']}
    if len(values) < 2:
        sys.exit(f"error: --sweep={key}: " + (f"every run has {key}={values.pop()}" if values else "no run logged it")
                 + "; name a train.py setting the runs vary, e.g. learning_rate")


def sweep_table(rows, order, key):
    """The rows as variant x the setting `key`: final perplexity, failed runs, loss spikes after warmup."""
    print(f"\nSweep of {key}: full-split val perplexity over the seeds that did not fail; failed: a loss not finite "
          f"or not below a uniform guess; spikes: train-loss log points after warmup more than 10% above the lowest "
          f"before them\n| corpus | variant | {key} | seeds | val ppl | failed | spikes (runs with any) |\n"
          "|---|---|---|---|---|---|---|")
    for k, v, runs in sweep_cells(rows, order, key):
        p = [mean(x) for x in by_seed(runs).values()]
        ok, sp = finished(p), [r['spikes'] for r in runs]
        print(f"| {k[0]} | {series(rows, k, key)} | {v} | {len(p)} | {spread_of(ok) if ok else '-'} | "
              f"{len(p) - len(ok)} | {sum(sp)} ({sum(map(bool, sp))}) |")


# -----------------------------------------------------------------------------
# --plot

def pyplot():
    try:
        import matplotlib
        import matplotlib.ticker
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("error: --plot needs matplotlib (pip install matplotlib); without --plot, the tables need nothing")
    return matplotlib, plt


def plot_curves(rows, path):
    """Validation estimates against tokens, a line per row (mean over the seeds that did not fail, band: min to
    max), a panel per corpus: the axes follow the runs that did not fail."""
    matplotlib, plt = pyplot()
    corpora = sorted({c for c, _ in rows})
    names = sorted({name for _, name in rows})  # a colour per variant: 10 by default, 20 when there are more
    colors = {name: f"C{i}" if len(names) <= 10 else plt.get_cmap('tab20')(i % 20) for i, name in enumerate(names)}
    fig, axes = plt.subplots(1, len(corpora), figsize=(5 * len(corpora), 4.2), squeeze=False)
    for ax, corpus in zip(axes[0], corpora):
        for (c, name), row in sorted(rows.items(), key=lambda kv: kv[0][1]):
            if c != corpus or not curve(row):
                continue
            per_seed = [{e['tokens']: e['val_loss'] for e in r['evals']} for r in done(row['runs'])]
            t = [x for x, _ in curve(row)][1:]  # from the first eval after step 0
            ys = [[math.exp(p[x]) for p in per_seed] for x in t]
            t = [x / 1e6 for x in t]
            ax.plot(t, [mean(y) for y in ys], label=name, lw=1.3, color=colors[name],
                    ls='--' if row['kind'].get('attn') == 'standard' else '-')
            ax.fill_between(t, [min(y) for y in ys], [max(y) for y in ys], alpha=0.15, color=colors[name])
        ax.set(xlabel='tokens (millions)', title=corpus, yscale='log')
        ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.yaxis.set_minor_formatter(matplotlib.ticker.ScalarFormatter())
        ax.grid(alpha=0.3, which='both')
        ax.legend(fontsize=7)
    axes[0][0].set_ylabel('validation perplexity (estimate)')
    save(fig, path)


def plot_sweep(rows, path, key):
    """Final perplexity against the setting `key`, a line per variant (mean over the seeds that did not fail, band:
    min to max), failed runs as crosses along the top, a panel per corpus. Numbers: a log axis (a linear one where a
    value is 0 or below); anything else (attn, bias, dtype): a position per value."""
    matplotlib, plt = pyplot()
    cells = sweep_cells(rows, sorted(rows), key)
    values = sorted({v for _, v, _ in cells}, key=at)
    by_number = all(type(v) in (int, float) for v in values)
    log = by_number and min(values) > 0
    x_of = (lambda v: v) if by_number else values.index
    span = (max(values) - min(values) if by_number else len(values)) or 1
    nudge = (lambda x, i: x * 1.04 ** i) if log else (lambda x, i: x + 0.015 * span * i)  # a variant's crosses apart
    corpora = sorted({c for c, _ in rows})
    fig, axes = plt.subplots(1, len(corpora), figsize=(5 * len(corpora), 3.8), squeeze=False)
    for ax, corpus in zip(axes[0], corpora):
        variants = sorted({series(rows, k, key) for k, _, _ in cells if k[0] == corpus})
        failed = {}
        for i, v in enumerate(variants):
            seen = {}  # x: the final perplexities of the variant's seeds there, over its rows
            for k, x, rs in cells:
                if k[0] == corpus and series(rows, k, key) == v:
                    seen.setdefault(x_of(x), []).extend(mean(p) for p in by_seed(rs).values())
            ok = [(x, finished(p)) for x, p in sorted(seen.items()) if finished(p)]
            if ok:
                ax.plot([x for x, _ in ok], [mean(p) for _, p in ok], 'o-', label=v, color=f"C{i % 10}", lw=1.3, ms=3)
                ax.fill_between([x for x, _ in ok], [min(p) for _, p in ok], [max(p) for _, p in ok], alpha=0.15,
                                color=f"C{i % 10}")
            failed[v] = [x for x, p in sorted(seen.items()) for q in p if not math.isfinite(q)]
        low, high = ax.get_ylim()
        ax.set_ylim(low, high + 0.15 * (high - low))  # a strip along the top, above every line, for the crosses
        for i, v in enumerate(variants):  # a cross per failed run, nudged right per variant
            ax.plot([nudge(x, i) for x in failed[v]], [0.95] * len(failed[v]), 'x', color=f"C{i % 10}", ms=7,
                    transform=ax.get_xaxis_transform())
        axis = '' if log or not by_number else ' (linear axis: a value is 0 or below)'
        ax.set(xlabel=key + axis, ylabel='val perplexity (full split)', xscale='log' if log else 'linear',
               title=corpus + (": x along the top, a failed run" if any(failed.values()) else ''))
        if not by_number:
            ax.set_xticks(range(len(values)), [str(v) for v in values])
        ax.grid(alpha=0.3, which='both')
        ax.legend(fontsize=7)
    save(fig, path)


def save(fig, path):
    path += '.png' * (not os.path.splitext(path)[1])  # R/curves: R/curves.png, as matplotlib writes it, and said so
    os.makedirs(os.path.dirname(path) or '.', exist_ok=True)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=100)
    except ValueError as e:  # a format matplotlib does not write (x.txt)
        sys.exit(f"error: --plot={path}: {e}; name a .png file")
    print(f"wrote {path}", file=sys.stderr)


# -----------------------------------------------------------------------------

def report(folders, plot=None, sweep=None):
    """Every table of the finished runs under folders (and with plot, their picture)."""
    rows, ppl, notes = rows_of(folders)
    if sweep:
        check_sweep(rows, sweep)
    if plot:
        plot_sweep(rows, plot, sweep) if sweep else plot_curves(rows, plot)
    order, used = results_table(rows, ppl)
    attention_table(rows, order)
    variance_table(ppl, order)
    if sweep:
        sweep_table(rows, order, sweep)
    footnote(rows, ppl, used)
    for note in notes:
        print(note, file=sys.stderr)


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not a usage dump
        sys.exit(f"error: {message}; see python results/report.py --help")


def main(argv=None):
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('folders', nargs='+', help='run folders (--out_dir of train.py), or folders above them')
    p.add_argument('--sweep', help='a table (and with --plot, a picture) of final perplexity, failed runs and loss '
                   'spikes against this train.py setting, e.g. learning_rate')
    p.add_argument('--plot', help="the sweep's picture, or else each row's learning curve, into this file (.png)")
    args = p.parse_intermixed_args(argv)
    report(args.folders, args.plot, args.sweep)


if __name__ == '__main__':
    main()
