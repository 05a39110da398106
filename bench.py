"""
Speed and results: time attention variants against standard (a training step, a forward pass, generation with and
without the KV cache) next to the FLOP model's ratio; tabulate and plot train.py runs; the GPU recipe and check.

  python bench.py                                     # standard vs coupled, small preset, CPU-friendly
  python bench.py --preset=60m --batch_size=4 --block_size=256 --attn=standard,coupled,euler,uncoupled
  python bench.py --preset=60m --device=cuda --compile=True --dtype=bfloat16 --batch_size=16 --block_size=1024
  python bench.py --report=runs --plot=curves.png     # table (and curves) of the train.py runs under runs/
  python bench.py --plan --world_size=8               # the GPU recipe: commands, tokens, GPU time (for 8 GPUs)
  python bench.py --gpu_check                         # on one GPU, ~3 minutes: the recipe's step, eager and compiled
"""
import os
import signal


def on_ctrl_c(signum, frame):  # Ctrl-C during the imports (torch's: slow): one line, exit code 130
    os.write(2, b"\ninterrupted\n")
    os._exit(130)


if __name__ == '__main__':  # not when imported: the importer's handler stays
    signal.signal(signal.SIGINT, on_ctrl_c)

import argparse  # noqa: E402
import ctypes  # noqa: E402
import ctypes.util  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402
import time  # noqa: E402
from contextlib import nullcontext  # noqa: E402
from itertools import groupby  # noqa: E402
from statistics import mean, median, stdev  # noqa: E402

import torch  # noqa: E402
from torch._dynamo.utils import counters  # noqa: E402

from model import (GPU_PEAK_FLOPS, PRESETS, GPT, CausalSelfAttention, GPTConfig, attention_diagnostics,  # noqa
                   attn_names, flops_per_token, median_layer, peak_flops, qk_diagnostics)

MODES = ('train', 'forward', 'generate')


def flop_ratio(cfg, T):  # the FLOP model: cfg's variant over standard attention of its shape
    return flops_per_token(cfg, T) / flops_per_token(GPTConfig(**{**cfg.__dict__, 'attn': 'standard'}), T)


# -----------------------------------------------------------------------------
# --report: finished train.py runs in rows of comparable runs

# settings that change neither model nor training: runs that differ only in these share a row
NOT_COMPARED = {'seed', 'out_dir', 'data_dir', 'init_from', 'eval_only', 'device', 'compile', 'preset',
                'log_interval', 'eval_interval', 'eval_iters', 'always_save_checkpoint', 'time_budget', 'sample',
                'sample_tokens'}
COUNTS = ('max_iters', 'batch_size', 'block_size', 'gradient_accumulation_steps', 'warmup_iters')  # the report's sums
ATTENTION = ('entropy', 'sink', 'gap')  # model.attention_diagnostics, per layer


def well_typed(r):  # the fields the report reads have the types it expects
    num = lambda x: type(x) in (int, float)  # not a bool
    qk, att = r.get('qk', []), r.get('attn', [])
    return (isinstance(r.get('event'), str) and isinstance(r.get('config', {}), dict) and isinstance(qk, list)
            and all(num(r.get(k, 0)) for k in ('iter', 'model_iter', 'tokens', 'model_tokens', 'val_loss', 'val_ppl',
                                               'ms'))
            and all(isinstance(s, dict) and (num(s.get('nonlinear')) or s.get('nonlinear', 0) is None)  # None: too few
                    and isinstance(s.get('dt', []), list)
                    and all(map(num, s.get('dt', []))) for s in qk)
            and isinstance(att, list) and all(isinstance(s, dict) and all(num(s.get(k)) for k in ATTENTION)
                                              for s in att))


NUMBER = re.compile(r'[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?')


def number(v):  # a setting as train.py meant it: the string "0.002" (a hand-edited or older log) is 0.002
    if isinstance(v, str) and NUMBER.fullmatch(v.strip()):
        return int(v) if v.strip().lstrip('+-').isdigit() else float(v)
    return v


def read_log(path):
    """The records of a metrics.jsonl; a cut line (a run killed while writing) or a wrong record: a warning."""
    records = []
    for i, line in enumerate(open(path, encoding='utf-8', errors='replace'), 1):
        try:
            r = json.loads(line)
        except ValueError:
            r = None
        if isinstance(r, dict) and well_typed(r):
            records.append(r)
        else:
            print(f"warning: {path}:{i} is not a log record (cut short? wrong types?); skipped", file=sys.stderr)
    return records


def content(path):  # what makes a log one run: its bytes (a symlink, a hard link and a `cp -r` copy are one run)
    try:
        with open(path, 'rb') as f:
            return hashlib.sha256(f.read()).hexdigest()
    except OSError:  # a folder of that name: load_runs says so
        return path


def find_logs(folders):  # each folder once, by its real path (overlapping folders, symlinks, their loops); each run once
    seen, logs = set(), {}
    for top in folders:
        for d, subdirs, files in os.walk(top, followlinks=True):
            if os.path.realpath(d) in seen:
                subdirs.clear()
                continue
            seen.add(os.path.realpath(d))
            if d.endswith('.new') and os.path.isdir(d[:-4]):  # the lab launcher's retraining of d[:-4]
                print(f"note: {d} is the retraining of {d[:-4]}, not yet in its place (exercises/ex6_train.py "
                      "renames it when it ends); left out", file=sys.stderr)
                subdirs.clear()
                continue
            if 'metrics.jsonl' in files + subdirs:
                path = os.path.join(d, 'metrics.jsonl')
                logs.setdefault(content(path), []).append(path)
    for paths in logs.values():
        if len(paths) > 1:
            link = len({(os.stat(p).st_dev, os.stat(p).st_ino) for p in paths}) == 1
            print(f"note: {' and '.join(sorted(paths))} {'are one file (a link)' if link else 'are copies of one log'}"
                  "; counted once", file=sys.stderr)
    return sorted(min(paths) for paths in logs.values())


def standing(log):
    """The records up to the last final; a start at iteration N (a resume) voids those past N (lost work), but not a
    final that scored a model of iteration N or before (a best-only checkpoint, which the resume continues).
    A run that stopped at a non-finite loss and has no final ends at its 'diverged' record. None: the records are
    out of order (their iterations go back other than at a start)."""
    kept, last = [], -math.inf
    for r in log:
        if r['event'] == 'start':
            at = r.get('iter', math.inf)
            kept = [k for k in kept if k.get('iter', 0) <= at
                    or k['event'] == 'final' and k.get('model_iter', at + 1) <= at]
            last = at
        elif r.get('iter', last) < last:
            return None
        kept.append(r)
        last = r.get('iter', last)
    ends = [i for i, r in enumerate(kept) if r['event'] == 'final'] or [  # an extension that diverged: its final
        i for i, r in enumerate(kept) if r['event'] == 'diverged']
    return kept[:max(ends) + 1] if ends else []


def typed(start):  # a start record with its settings typed; None: a count the report sums is not a number
    s = dict(start, config={k: number(v) for k, v in start['config'].items()}, world_size=number(
        start.get('world_size') or 1))
    counts = {k: s['config'][k] for k in COUNTS if k in s['config']} | {'world_size': s['world_size']}
    return s if all(type(v) in (int, float) for v in counts.values()) else None


def load_runs(folders):
    """Every finished train.py run in or under the folders, labeled by its folder's name less '-s<seed>' and 'out-'
    (out-coupled-s2: coupled; 'out': its attn) and by what a resume changed: coupled [resumed: max_iters 500->1000]."""
    runs = []
    for path in find_logs(folders):
        try:
            log = standing(read_log(path))
        except OSError as e:  # a folder of that name
            print(f"note: {path}: {e.strerror or e}; left out", file=sys.stderr)
            continue
        if log is None:
            print(f"note: {path}: its records are out of order (an iteration before an earlier one); left out",
                  file=sys.stderr)
            continue
        start = [typed(r) for r in log if r['event'] == 'start' and 'config' in r]
        if None in start:
            print(f"note: {path}: a setting among {', '.join(COUNTS)} or its world_size is not a number; left out",
                  file=sys.stderr)
            continue
        final = log[-1] if start else {}
        if final.get('event') == 'diverged':  # stopped at a non-finite loss: inf, at the tokens it set out to train
            c = start[-1]['config']
            final = dict(final, val_loss=math.inf, val_ppl=math.inf, tokens=c.get('max_iters', 0) * c.get(
                'batch_size', 0) * c.get('block_size', 0) * c.get('gradient_accumulation_steps', 1)
                * start[-1]['world_size'])
        if not ('val_loss' in final and min(final.get('tokens', 0), final.get('val_ppl', 0)) > 0):
            print(f"note: {path} is not a finished run (no final val_ppl, val_loss, tokens > 0); left out",
                  file=sys.stderr)
            continue
        cfg, name = start[-1]['config'], os.path.basename(os.path.dirname(os.path.abspath(path)))
        label, _, seed = name.rpartition('-s')
        label = (label if label and seed.isdigit() else name).removeprefix('out-').removeprefix('out_')
        label = str(cfg.get('attn', '?')) if label in ('out', '') else label
        # what each start trained with: a setting changed at a resume makes no straight run
        sets = [{k: v for k, v in s['config'].items() if k not in NOT_COMPARED} | {'world_size': s.get('world_size')}
                for s in start]
        changed = ', '.join(f"{k} " + '->'.join(v for v, _ in groupby(str(s.get(k)) for s in sets))
                            for k in sorted(set().union(*sets)) if any(s.get(k) != sets[0].get(k) for s in sets))
        if changed:
            label += f" [resumed: {changed}]"
            print(f"note: {path}: resumed with other settings; a row of its own", file=sys.stderr)
        if final.get('model_iter', final.get('iter')) != final.get('iter'):
            print(f"note: {path}: its result is its best-only checkpoint's model, iteration {final['model_iter']} of "
                  f"{final['iter']}", file=sys.stderr)
        evals = [r for r in log if r['event'] == 'eval' and 'val_loss' in r and 'tokens' in r
                 and r.get('iter', 0) <= final.get('model_iter', math.inf)]  # the curve of the model it scored
        ms = [r['ms'] for r in log if r['event'] == 'train' and 'ms' in r]
        losses = [r['loss'] for r in log if r['event'] == 'train' and r.get('iter', 0) > cfg.get('warmup_iters', 0)
                  and type(r.get('loss')) in (int, float)]  # after warmup
        text = [s['fingerprint'][:12] for s in start if isinstance(s.get('fingerprint'), str)][-1:]  # (older: none)
        runs.append(dict(path=path, label=label, corpus=str(cfg.get('dataset', '?')), final=final, evals=evals, ms=ms,
                         spikes=spikes(losses),
                         config=cfg | {'seed': start[0]['config'].get('seed')},  # a resume continues the run's RNG
                         kind=sets[-1] | {'tokens': final.get('model_tokens', final['tokens'])}
                         | ({'fingerprint': text[0]} if text else {})))
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


SHAPE = ('n_layer', 'n_head', 'n_embd', 'block_size', 'bias', 'pos', 'vocab_size')
BASE = SHAPE + ('fingerprint',)  # a baseline: standard of the same shape, on the same text
BATCHES = ('eval_iters', 'batch_size', 'block_size', 'dataset')  # equal: the estimates score the same batches


def agree(a, b, keys):
    return all(a.get(k) == b.get(k) for k in keys)


def done(runs):  # the runs that finished (a diverged one's perplexity: inf); only these are averaged, in every column
    return [r for r in runs if math.isfinite(r['final']['val_ppl'])]


def curve(row):
    """Mean over the seeds that finished of the row's validation estimates: [(tokens, loss)] at the evals every one
    of them logged."""
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
    reach this row's final estimate (mean over its seeds that finished), over this row's tokens; '> N': never.
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


def by_seed(runs):  # {seed: the final perplexities of its runs}
    seeds = {}
    for r in runs:
        seeds.setdefault(str(r['config'].get('seed')), []).append(r['final']['val_ppl'])
    return seeds


def rows_of(folders):
    """The rows of the finished runs under folders, each row's final perplexities (one a seed: the mean of the runs
    that repeat it) and the notes to print last."""
    for top in folders:
        if not os.path.isdir(top):  # a typo would else be no runs, or a table quietly short of a folder's rows
            sys.exit(f"error: {top} is {'a file, ' if os.path.exists(top) else ''}not a run folder; name run folders "
                     "(the --out_dir of train.py), or folders above them")
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
        if base and finished(p):
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
        qk = []  # each finished seed's final q/k diagnostics, per layer
        for r in done(row['runs']):
            q = r['evals'][-1].get('qk') if r['evals'] else None
            if q and len(q) != r['config'].get('n_layer', len(q)):  # a median over fewer layers is another figure
                print(f"note: {r['path']}: its final q/k diagnostics logged {len(q)} of {r['config']['n_layer']} "
                      "layers; left out of the nonlinear and dt columns", file=sys.stderr)
            elif q:
                qk.append(q)
        nonlin = [n for n in (median_layer(q, 'nonlinear') for q in qk) if n is not None]  # None: too few tokens
        dts = [mean(d for s in q for d in s.get('dt', [])) for q in qk if q[0].get('dt')]
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


def report(folders, plot=None):
    """The table of finished train.py runs (and, with plot, their curves)."""
    rows, ppl, notes = rows_of(folders)
    if plot:  # first: a path it cannot write to stops it before any output
        plot_curves(rows, plot)
    order, used = results_table(rows, ppl)
    footnote(rows, ppl, used)
    for note in notes:
        print(note, file=sys.stderr)


def finished(p):  # the perplexities of the seeds that did not diverge (a diverged one: inf)
    return [x for x in p if math.isfinite(x)]


def finite_mean(p):  # a row's mean over the seeds that did not diverge
    return mean(finished(p) or [math.inf])


def spread_of(p):  # "mean +- std" over the seeds that did not diverge, and how many did
    ok = finished(p)
    text = f"{mean(ok):.3f}" + (f" +- {stdev(ok):.3f}" if len(ok) > 1 else '') if ok else 'inf'
    return text + (f" ({len(p) - len(ok)} of {len(p)} diverged)" if len(ok) < len(p) else '')


def pyplot():
    try:
        import matplotlib
        import matplotlib.ticker
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit("error: --plot needs matplotlib (pip install matplotlib); without --plot, the table needs nothing")
    return matplotlib, plt


def save(fig, path):
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=100)
    except (OSError, ValueError, RuntimeError) as e:  # no such folder, a format matplotlib lacks, .pgf without LaTeX
        sys.exit(f"error: cannot write --plot={path} ({(str(e) or type(e).__name__).splitlines()[0]})")
    print(f"wrote {path}", file=sys.stderr)


def plot_curves(rows, path):
    """Validation estimates against tokens, a line per row (mean over the seeds that finished, band: min to max), a
    panel per corpus."""
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
            ys = [[math.exp(min(p[x], 700)) for p in per_seed] for x in t]
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


# -----------------------------------------------------------------------------
# --plan: the paper's 60M WikiText-103 ablation, a command per run, for 1 GPU or more.
# 20,000 steps of 65,536 tokens (128 sequences of 512) = 1.31B tokens (our choice: the paper's budget is not public).
# Batch flags are per rank: more GPUs, fewer sequences or micro-steps each, the same 128 sequences per step.

RECIPE = ("{launch} --preset=60m --dataset=wikitext103 --block_size=512 --batch_size={batch} "
          "--gradient_accumulation_steps={accum} --learning_rate=6e-4 --min_lr=6e-5 --warmup_iters=1000 "
          "--max_iters=20000 --eval_interval=1000{evals} --dtype=bfloat16 --compile=True")
SEQUENCES_PER_STEP = 128
RECIPE_RUNS = [('standard', '--attn=standard'), ('coupled', '--attn=coupled'), ('euler', '--attn=euler'),
               ('uncoupled', '--attn=uncoupled'), ('coupled-steps7', '--attn=coupled --qk_steps=7'),
               ('invertible', '--attn=invertible'), ('diff', '--attn=diff'), ('diff+coupled', '--attn=diff+coupled'),
               ('standard-2.4x', '--attn=standard --max_iters=48000')]  # the paper's compute match: 2.4x the tokens
PLAN_GPUS = {'H100': 'NVIDIA H100 80GB HBM3', 'A100': 'NVIDIA A100-SXM4-80GB'}  # SXM
UTILISATION = 0.35  # of the bf16 peak: an estimate (never measured on these GPUs), for training and evaluation
COMPILE_MINUTES = 1.5  # torch.compile's first step, each rank at once: an estimate (1-2 minutes)
EVAL_ITERS, EVAL_BATCH = 40, 32  # train.py's --eval_iters, the 1-GPU recipe's batch: the estimates' sequences
DIAG_TOKENS = 8192 + 8 * 512  # rank 0's diagnostics at an eval: the q/k map's 8,192 tokens, 8 sequences' attention


def recipe(world_size):
    """The recipe's command for world_size GPUs (8 a node): 32 sequences a micro-step while they last, then fewer."""
    per_rank = SEQUENCES_PER_STEP // world_size
    batch = min(32, per_rank)
    launch = ('python train.py' if world_size == 1 else f'torchrun --standalone --nproc_per_node={world_size} train.py'
              if world_size <= 8 else f'torchrun --nnodes={world_size // 8} --nproc_per_node=8 --node_rank=$NODE_RANK '
              '--rdzv_backend=c10d --rdzv_endpoint=$FIRST_NODE:29500 train.py')
    evals = '' if batch == EVAL_BATCH else f' --eval_iters={EVAL_ITERS * EVAL_BATCH // batch}'  # the same 1,280 sequences
    return RECIPE.format(launch=launch, batch=batch, accum=per_rank // batch, evals=evals)


def plan_minutes(cfg, T, tokens, evals, world_size, peak):
    """A run's wall-clock minutes, each part an estimate: training (the FLOP model at UTILISATION, split over the
    ranks); evaluation (evals x a forward, a third of a training step's FLOPs, of the estimates' 2 x EVAL_ITERS x
    EVAL_BATCH sequences split by sequence over the ranks, plus rank 0's DIAG_TOKENS, which do not split); compile."""
    rate = UTILISATION * peak  # FLOP/s on one GPU
    forward = flops_per_token(cfg, T) / 3
    train = tokens * flops_per_token(cfg, T) / (rate * world_size)
    evaluation = evals * forward * (2 * EVAL_ITERS * EVAL_BATCH * T / world_size + DIAG_TOKENS) / rate
    return dict(train=train / 60, eval=evaluation / 60, compile=COMPILE_MINUTES)


def plan(world_size):
    """The GPU recipe as a markdown table: each run's command, tokens and wall-clock time (plan_minutes: training
    from the FLOP model, evaluations and compile; all estimates)."""
    flags = lambda text: dict(a.removeprefix('--').split('=', 1) for a in text.split() if a[:2] == '--' and '=' in a)
    command = recipe(world_size)
    base, gpus = flags(command), f"{world_size}x " if world_size > 1 else ''
    step = world_size * math.prod(int(base[k]) for k in ('batch_size', 'gradient_accumulation_steps', 'block_size'))
    print(f"R=\"{command}\"\n")
    accum = int(base['gradient_accumulation_steps'])
    if world_size > 1:  # batch flags are per rank
        print(f"{step:,} tokens per step: {world_size} GPUs x {base['batch_size']} sequences x {accum} "
              f"micro-step{'s' * (accum > 1)} x {base['block_size']} tokens\n")
    print("| run | command | tokens | GFLOP/token | " + ' | '.join(f"{gpus}{g}" for g in PLAN_GPUS)
          + " |\n|---|---|---|---|" + '---|' * len(PLAN_GPUS))
    fmt = lambda m: f"{m:.0f} min" if m < 120 else f"{m / 60:.1f} h"
    for name, extra in RECIPE_RUNS:
        f = base | flags(extra)
        cfg = GPTConfig(attn=f['attn'], qk_steps=int(f.get('qk_steps', 1)), **PRESETS[f['preset']])
        tokens, T = step * int(f['max_iters']), int(f['block_size'])
        evals = int(f['max_iters']) // int(f['eval_interval']) + 1  # at 0, every eval_interval, and the last
        parts = [plan_minutes(cfg, T, tokens, evals, world_size, GPU_PEAK_FLOPS[g]) for g in PLAN_GPUS.values()]
        if name == 'standard':
            first, first_evals = parts, evals
        print(f"| {name} | `$R {extra} --out_dir=runs/60m/{name}` | {tokens / 1e9:.2f}B | "
              f"{flops_per_token(cfg, T) / 1e9:.3f} | " + ' | '.join(fmt(sum(p.values())) for p in parts) + ' |')
    shared = 'on one GPU' if world_size == 1 else f'shared by {world_size} GPUs'
    note = (f"Each time is an estimate with three parts: training at {UTILISATION:.0%} of the GPU's bf16 peak (the "
            f"FLOP model), {first_evals} evaluations (each scores {EVAL_ITERS * EVAL_BATCH:,} sequences a split "
            f"{shared}, plus the diagnostics), and about {COMPILE_MINUTES} minutes of compilation. For standard: "
            + ', '.join(f"{g} {p['train']:.0f} + {p['eval']:.1f} + {p['compile']} min" for g, p in zip(PLAN_GPUS, first))
            + '.')
    print('\n' + textwrap.fill(note, 116))


# -----------------------------------------------------------------------------
# timing

def keep_freed_memory():
    """glibc returns large freed blocks to the OS, so each step of a GPT-2-vocabulary model page-faults its 200 MB
    logits back in (+10% time, +-5% noise on our 2-core VM). Keep them, as PyTorch's CUDA allocator does. glibc only."""
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library('c')).mallopt
    except (OSError, AttributeError, TypeError):
        return  # not glibc
    mallopt(-3, 1 << 30)        # M_MMAP_THRESHOLD: blocks under 1 GiB come from the heap, reused after free
    mallopt(-1, (1 << 31) - 1)  # M_TRIM_THRESHOLD: never shrink the heap


def why(e):  # an exception, in a few words
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:100]}"


def timing(args, variants, modes, device):
    """Time every (variant, mode), interleaved; returns {(variant, mode): record}."""
    cuda = device.startswith('cuda')
    dtype = getattr(torch, args.dtype)
    autocast = torch.autocast(device.split(':')[0], dtype=dtype) if dtype != torch.float32 else nullcontext()
    B, T = args.batch_size, args.block_size
    gen_block = max(T, args.new_tokens + 1)  # generation never refills the cache window
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    peak_flop = peak_flops(device)  # for MFU; None: unknown

    models = {}
    for v in variants:  # standard first
        torch.manual_seed(0)
        cfg = GPTConfig(attn=v, block_size=gen_block, vocab_size=args.vocab_size, qk_steps=args.qk_steps,
                        qk_hidden=args.qk_hidden, **PRESETS[args.preset])
        model = GPT(cfg, verbose=False)
        if v != 'standard':  # same weights as standard wherever the architectures agree: CPU speed depends on
            model.load_state_dict(models['standard'][0].state_dict(), strict=False)  # values (up to +-5%)
        model = model.to(device)
        opt = model.configure_optimizers(0.1, 1e-4, (0.9, 0.95), device.split(':')[0])
        models[v] = (model, torch.compile(model) if args.compile == 'True' else model, opt)
    compiled = {v: False for v in variants}  # whether compile really ran (Dynamo made a graph), per variant

    x = torch.randint(0, args.vocab_size, (B, T), device=device)

    def step(mode, model, fwd, opt):  # one timed call
        if mode == 'train':
            with autocast:
                loss = fwd(x, x)[1]
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return
        with torch.no_grad(), autocast:
            if mode == 'forward':
                fwd(x)
            else:  # with the KV cache, or recomputing the context
                model.generate(x[:1, :1], args.new_tokens, temperature=0, use_cache=mode == 'generate')

    cfg0 = models['standard'][0].config
    print(f"bench: preset {args.preset} ({cfg0.n_layer}x{cfg0.n_embd}, {cfg0.n_head} heads), batch {B}x{T}, vocab "
          f"{args.vocab_size}, {device} ({torch.get_num_threads()} threads), {args.dtype}, compile={args.compile}")
    results = {}
    for mode in [m for m in (*MODES, 'generate-nocache') if m.split('-')[0] in modes]:
        # generation is slow to time: 1/3 of the rounds; recomputation (O(n^2) work) once, warmed up by the cached run
        iters = {'generate': max(1, args.iters // 3), 'generate-nocache': 1}.get(mode, args.iters)
        start = time.perf_counter()
        for v in variants:  # warm-up (and compilation: at least one step)
            graphs = counters['stats']['unique_graphs']
            for _ in range({'generate': 1, 'generate-nocache': 0}.get(mode, max(args.warmup, args.compile == 'True'))):
                try:
                    step(mode, *models[v])
                except Exception as e:  # a compile failure: this variant runs eager
                    if models[v][1] is models[v][0]:
                        raise
                    e = getattr(e, 'inner_exception', e)  # the error inside Dynamo's BackendCompilerFailed
                    print(f"warning: torch.compile failed for {v} ({why(e)}); eager")
                    models[v] = (models[v][0], models[v][0], models[v][2])
            compiled[v] |= counters['stats']['unique_graphs'] > graphs and models[v][1] is not models[v][0]
        warm = time.perf_counter() - start
        times, peak = {v: [] for v in variants}, {}
        for r in range(iters):  # A B B A ...: drift in machine speed, and going first, hit all alike
            for v in (variants if r % 2 == 0 else variants[::-1]):
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
                sync()
                t0 = time.perf_counter()
                step(mode, *models[v])
                sync()
                times[v].append(time.perf_counter() - t0)
                if cuda:
                    peak[v] = max(peak.get(v, 0), torch.cuda.max_memory_allocated() / 2**20)
            spent = time.perf_counter() - start
            print(f"  {mode}: round {r + 1}/{iters} | warm-up {warm:.0f} s | {spent:.0f} s so far, about "
                  f"{(spent - warm) / (r + 1) * (iters - r - 1):.0f} s left", flush=True)
        ntok = args.new_tokens if mode.startswith('generate') else B * T
        for v in variants:
            ms = 1000 * median(times[v])
            flops = flops_per_token(models[v][0].config, T) * ntok if mode == 'train' else None
            # the median of each round's ratio to standard's: a slow spell (shared VM: +-10% for seconds) cancels
            ratio = median(t / t0 for t, t0 in zip(times[v], times['standard']))
            results[(v, mode)] = dict(attn=v, mode=mode, ms_per_iter=ms, tokens_per_s=ntok / ms * 1000,
                                      ratio_vs_standard=ratio, peak_mem_mb=peak.get(v), iters=iters,
                                      flop_model_ratio=flop_ratio(models[v][0].config, T) if mode == 'train' else None,
                                      mfu=flops / (ms / 1000) / peak_flop if flops and peak_flop else None,
                                      compiled=compiled[v])
            if mode == 'generate-nocache':  # after 'generate'
                results[(v, mode)]['cache_speedup'] = ms / results[(v, 'generate')]['ms_per_iter']
    return results


def print_timing(results, args):
    w = max(len(r['attn']) for r in results.values()) + 2  # the widest --attn name, e.g. diff+symplectic-euler
    print(f"\n{'attn':<{w}}{'mode':<18}{'compiled':>9}{'ms/iter':>10}{'tokens/s':>12}{'MFU':>7}{'peak MB':>9}"
          f"{'vs standard':>13}{'FLOP model':>12}")
    for r in results.values():
        peak = f"{r['peak_mem_mb']:.0f}" if r['peak_mem_mb'] else '-'
        flop = f"{r['flop_model_ratio']:.4f}" if r['flop_model_ratio'] else ''
        mfu = f"{r['mfu']:.1%}" if r['mfu'] else '-'
        print(f"{r['attn']:<{w}}{r['mode']:<18}{'yes' if r['compiled'] else 'no':>9}{r['ms_per_iter']:>10.1f}"
              f"{r['tokens_per_s']:>12,.0f}{mfu:>7}{peak:>9}{r['ratio_vs_standard']:>13.3f}{flop:>12}")
    for r in results.values():
        if 'cache_speedup' in r:
            print(f"{r['attn']}: KV cache generates {args.new_tokens} tokens {r['cache_speedup']:.1f}x as fast "
                  f"as recomputing the context (a full forward pass per new token)")
    flops = {r['attn']: r['flop_model_ratio'] for r in results.values() if r['flop_model_ratio']}
    if len(flops) > 1:
        extra = ', '.join(f"{v} {100 * (e - 1):+.2f}%" for v, e in flops.items() if v != 'standard')
        print(f"FLOP model: vs standard, {extra} to a training step (matmuls, attention and the dynamics' "
              "elementwise work)")


# -----------------------------------------------------------------------------
# --gpu_check: the first thing to run on a GPU

def qk_bf16_error(device, attn='coupled', batch_size=2, block_size=512):
    """The q/k map of one layer at 60m's head shape under bf16 autocast against float64, on the same bf16 q, k (as
    autocast's c_attn gives them, at their initial spread): the relative error of its output (q', k') and of its
    move (q' - q, k' - k), the larger of q's and k's."""
    torch.manual_seed(0)
    cfg = GPTConfig(attn=attn, **(PRESETS['60m'] | dict(n_layer=1)), vocab_size=64)
    qk, hs = GPT(cfg, verbose=False).transformer.h[0].attn.qk.to(device), cfg.n_embd // cfg.n_head
    q, k = ((0.02 * math.sqrt(cfg.n_embd) * torch.randn(batch_size, cfg.n_head, block_size, hs)).bfloat16().to(device)
            for _ in range(2))
    with torch.no_grad():
        want = [w.float() for w in qk.double()(q.double(), k.double())]  # the reference in float64: no TF32
        qk.float()
        with torch.autocast(device.split(':')[0], dtype=torch.bfloat16):
            got = qk(q, k)
    rel = lambda err, ref: max((e.norm() / r.norm()).item() for e, r in zip(err, ref))
    return (rel([g.float() - w for g, w in zip(got, want)], want),
            rel([g.float() - w for g, w in zip(got, want)], [w - x.float() for w, x in zip(want, (q, k))]))


def gpu_check(args, device):
    """The recipe's training step (60m, GPT-2 vocabulary, 32 x 512 tokens, bf16) timed eager and compiled, standard
    and coupled, with MFU; diff's two SDPA layouts; the q/k map in bf16 against float32. Random tokens: offline."""
    t_start, name = time.time(), torch.cuda.get_device_name(device) if device.startswith('cuda') else device
    cfg = GPTConfig(vocab_size=args.vocab_size, **PRESETS[args.preset])
    flop = flops_per_token(cfg, args.block_size) * args.batch_size * args.block_size  # one training step
    peak = peak_flops(device)
    steps = 4 * (max(args.warmup, 1) + args.iters)  # (standard, coupled, diff one call, diff split) x eager, compiled
    print(f"gpu check: {name}, preset {args.preset}, {args.batch_size} x {args.block_size} tokens, vocabulary "
          f"{args.vocab_size}, {args.dtype}; {flop / 1e12:.1f} TFLOP a step. Estimate: {2 * steps} steps"
          + (f" ({2 * steps * flop / (0.3 * peak):.0f} s at 30% MFU)" if peak else '')
          + ", plus about a minute's compile per compiled variant")
    if not peak:
        print(f"note: no MFU: {name!r} is not in model.GPU_PEAK_FLOPS; set GPU_PEAK_TFLOPS to its dense bf16 TFLOP/s")
    out, move = qk_bf16_error(device)
    print(f"q/k map (coupled) in bf16 against float64: output {out:.2%}, its move {move:.2%} (relative errors)")
    records = []
    for compiled in ('False', 'True'):
        args.compile = compiled
        res = timing(args, ['standard', 'coupled'], ['train'], device)
        print_timing(res, args)
        records += list(res.values())
    args.compile, args.qk_steps = 'False', 7  # coupled --qk_steps=7 (14 forces a layer) beside steps 1, eager
    res = timing(args, ['standard', 'coupled'], ['train'], device)
    records.append(res[('coupled', 'train')] | dict(attn='coupled (qk_steps=7)'))
    print(f"coupled --qk_steps=7 / standard, eager: {res[('coupled', 'train')]['ratio_vs_standard']:.3f}")
    args.qk_steps = 1
    if device.startswith('cuda'):  # a few steps where any device-to-host sync is an error (CUDA only)
        args.iters, iters = 1, args.iters
        torch.cuda.set_sync_debug_mode('error')
        try:
            timing(args, ['standard', 'coupled'], ['train'], device)
            print("sync debug mode 'error': a training step of standard and coupled makes no host sync")
        except RuntimeError as e:
            print(f"sync debug mode 'error': a host sync in a training step ({why(e)})")
        finally:
            torch.cuda.set_sync_debug_mode('default')
            args.iters = iters
    else:
        print("sync debug mode: skipped (CUDA only)")
    layouts = {}
    for split in (False, True):  # diff's attention: one SDPA call per sub-head (v at 2hs), or per half of v (flash)
        CausalSelfAttention.split_v = split
        res = timing(args, ['standard', 'diff'], ['train'], device)
        layouts[split] = res[('diff', 'train')]
        records.append(layouts[split] | dict(attn=f"diff (split_v={split})"))
    CausalSelfAttention.split_v = None
    faster = min(layouts, key=lambda s: layouts[s]['ms_per_iter'])
    print(f"diff, eager: v at 2hs {layouts[False]['ms_per_iter']:.1f} ms, v's halves (flash-eligible) "
          f"{layouts[True]['ms_per_iter']:.1f} ms; faster: split_v={faster} (the default on CUDA: split_v=True)")
    by = {(r['attn'], r['compiled']): r for r in records if r['mode'] == 'train'}
    for compiled in (False, True):
        if ('coupled', compiled) in by:
            print(f"coupled / standard, {'compiled' if compiled else 'eager'}: "
                  f"{by[('coupled', compiled)]['ratio_vs_standard']:.3f}")
    if not any(r['compiled'] for r in records):
        print("compile did not run: every figure above is eager")
    print(f"gpu check done in {time.time() - t_start:.0f} s")
    return records


def diag_cost(args, device):
    """One eval's diagnostics (train.py's: qk_diagnostics on 8,192 tokens, attention_diagnostics on their first
    sequences) against one forward of the estimate's batch (batch_size sequences, as estimate_loss runs each of its
    batches), for each --attn variant at --preset, --block_size; random tokens. Wall-clock seconds, one call each."""
    autocast = (torch.autocast(device.split(':')[0], dtype=getattr(torch, args.dtype)) if args.dtype != 'float32'
                else nullcontext())
    sync = torch.cuda.synchronize if device.startswith('cuda') else (lambda: None)
    records = []
    for attn in args.attn.split(','):
        cfg = GPTConfig(attn=attn, block_size=args.block_size, vocab_size=args.vocab_size, qk_steps=args.qk_steps,
                        **PRESETS[args.preset])
        model, gen = GPT(cfg, verbose=False).to(device).eval(), torch.Generator().manual_seed(0)
        batch = torch.randint(args.vocab_size, (args.batch_size, args.block_size), generator=gen).to(device)
        diag = torch.randint(args.vocab_size, (-(-8192 // args.block_size), args.block_size), generator=gen).to(device)
        seconds = {}
        for name, fn in (('forward', lambda: model(batch, batch)),
                         ('qk_diagnostics', lambda: qk_diagnostics(model, diag)),
                         ('attention_diagnostics', lambda: attention_diagnostics(model, diag))):
            with torch.no_grad(), autocast if name == 'forward' else nullcontext():
                sync()
                t0 = time.time()
                fn()
                sync()
                seconds[name] = time.time() - t0
        both = seconds['qk_diagnostics'] + seconds['attention_diagnostics']
        print(f"diagnostics cost: {cfg.attn}, preset {args.preset}, block {args.block_size}, {device}, "
              f"{torch.get_num_threads()} threads: one forward of {args.batch_size} sequences "
              f"{seconds['forward']:.2f} s; qk_diagnostics ({diag.numel():,} tokens) "
              f"{seconds['qk_diagnostics']:.2f} s, attention_diagnostics {seconds['attention_diagnostics']:.2f} s: "
              f"{both / seconds['forward']:.1f} forwards, {both / (2 * EVAL_ITERS * seconds['forward']):.1%} of an estimate_loss "
              f"({2 * EVAL_ITERS} forwards)")
        records.append(dict(seconds, attn=cfg.attn, mode='diag_cost'))
    return records


# -----------------------------------------------------------------------------

class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not a usage dump
        sys.exit(f"error: {message}; see python bench.py --help")


def main():
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--preset', choices=list(PRESETS), help='default small (--gpu_check: 60m)')
    p.add_argument('--attn', default='standard,coupled', help=f"comma-separated, from: {', '.join(attn_names())}")
    p.add_argument('--mode', default='train,forward,generate', help='comma-separated, from: ' + ', '.join(MODES))
    p.add_argument('--batch_size', type=int, help='default 4 (--gpu_check: 32)')
    p.add_argument('--block_size', type=int, help='default 256 (--gpu_check: 512)')
    p.add_argument('--vocab_size', type=int, default=50257, help="GPT-2's, as in the paper")
    p.add_argument('--qk_steps', type=int, default=1)
    p.add_argument('--qk_hidden', type=int, default=GPTConfig.qk_hidden, help='hidden width of the potential')
    p.add_argument('--new_tokens', type=int, default=256, help='tokens generated in --mode=generate')
    p.add_argument('--iters', type=int, default=6, help='timed rounds per (variant, mode); generation: fewer')
    p.add_argument('--warmup', type=int, default=3, help='untimed rounds first (CPU: the heap settles)')
    p.add_argument('--device', default='auto')
    p.add_argument('--dtype', choices=['float32', 'bfloat16', 'float16'], help='default float32 (--gpu_check: bf16)')
    p.add_argument('--compile', default='False', choices=['True', 'False'])
    p.add_argument('--json_out', help='a JSON record per (variant, mode) into this file')
    p.add_argument('--report', help='instead of timing: tabulate the train.py runs under these comma-separated folders')
    p.add_argument('--plot', help="with --report: draw each row's learning curve into this file")
    p.add_argument('--plan', action='store_true', help="print the paper's 60M ablation as GPU commands with their cost")
    p.add_argument('--world_size', type=int, default=1, help='--plan: GPUs in all (8 a node)')
    p.add_argument('--diag_cost', action='store_true', help="time one eval's diagnostics against one forward of "
                   "the estimate's batch (e.g. --preset=60m --block_size=512 --batch_size=32 --attn=coupled)")
    p.add_argument('--gpu_check', action='store_true', help="the recipe's training step on one CUDA GPU (60m, "
                   "32 x 512 tokens, bf16), eager and compiled, with MFU")
    args = p.parse_args()
    given = {k for k, v in vars(args).items() if v != p.get_default(k)}
    chosen = [k for k in ('report', 'plan', 'gpu_check', 'diag_cost') if k in given]
    if len(chosen) > 1:
        p.error(f"--{' and --'.join(chosen)} are different jobs; run them one at a time")
    reads = dict(report={'report', 'plot'}, plan={'plan', 'world_size'}).get(chosen[0] if chosen else None)
    if reads and given - reads:  # e.g. --plan --preset=tiny: the plan is the recipe's, whatever the flags
        p.error(f"--{chosen[0]} reads only --{', --'.join(sorted(reads - {chosen[0]}))}, not "
                f"--{', --'.join(sorted(given - reads))}; drop {'it' if len(given - reads) == 1 else 'them'}")
    if 'world_size' in given and not args.plan:
        p.error("--world_size is read by --plan only: python bench.py --plan --world_size=8")
    if args.report is not None and not all(args.report.split(',')):
        p.error(f"--report={args.report!r} names an empty folder; name the run folders, e.g. --report=runs")
    if args.plot is not None and not (args.report and os.path.splitext(args.plot)[1]):
        p.error("--plot draws the runs of --report into a file named by its format: --report=runs --plot=curves.png")
    if args.report:
        return report(args.report.split(','), args.plot)
    if args.plan:
        if not (0 < args.world_size <= SEQUENCES_PER_STEP and SEQUENCES_PER_STEP % args.world_size == 0
                and (args.world_size <= 8 or args.world_size % 8 == 0)):
            p.error(f"--world_size={args.world_size}: the recipe's {SEQUENCES_PER_STEP} sequences per step split "
                    "evenly over 1, 2, 4, 8, 16, 32, 64 or 128 GPUs")
        return plan(args.world_size)
    gpu = dict(preset='60m', dtype='bfloat16', batch_size=32, block_size=512) if args.gpu_check else {}
    for k, default in dict(preset='small', dtype='float32', batch_size=4, block_size=256).items():
        if getattr(args, k) is None:  # a flag wins, then the GPU check's shape, then the CPU-friendly one
            setattr(args, k, gpu.get(k, default))
    for name, low in dict(iters=1, warmup=0, batch_size=1, block_size=1, new_tokens=1, vocab_size=2,
                          qk_steps=1).items():
        if getattr(args, name) < low:
            p.error(f"--{name} must be >= {low}, got {getattr(args, name)}")
    if args.json_out and not os.path.isdir(os.path.dirname(os.path.abspath(args.json_out))):
        p.error(f"--json_out={args.json_out}: its folder does not exist; create it first (nothing was timed)")
    variants, modes = args.attn.split(','), args.mode.split(',')
    for flag, given, known in (('attn', variants, attn_names()), ('mode', modes, MODES)):
        for x in given:
            if x not in known:
                p.error(f"--{flag}: {x!r} is not one of {', '.join(known)}")
    variants = ['standard'] + [v for v in variants if v != 'standard']  # first: every ratio is against it
    for v in variants:  # the model's own checks, as train.py makes them; the train rows' FLOP model needs a price
        try:
            cfg = GPTConfig(attn=v, block_size=max(args.block_size, args.new_tokens + 1), vocab_size=args.vocab_size,
                            qk_steps=args.qk_steps, qk_hidden=args.qk_hidden, **PRESETS[args.preset])
        except ValueError as e:
            p.error(str(e))
        try:
            flops_per_token(cfg, 16) if 'train' in modes else None
        except ValueError as e:
            p.error(f"--attn={v}: {e}")
    device = args.device if args.device != 'auto' else 'cuda' if torch.cuda.is_available() else 'cpu'
    if device.split(':')[0] not in ('cpu', 'cuda', 'mps'):
        p.error(f"--device={device} is unknown; use auto, cpu, cuda, cuda:N or mps")
    if args.gpu_check and not torch.cuda.is_available():
        p.error("--gpu_check needs a CUDA GPU and there is none here; on a CPU, time a step with python bench.py "
                "--preset=60m --mode=train")
    if device.startswith('cuda') and not torch.cuda.is_available():
        p.error(f"--device={device} but CUDA is not available here; use --device=cpu")
    if device == 'mps' and not torch.backends.mps.is_available():
        p.error("--device=mps but Apple's MPS is not available here (macOS on Apple silicon only); use --device=cpu")
    try:
        peak_flops(device)  # for MFU: $GPU_PEAK_TFLOPS, checked before any work
    except ValueError as e:
        p.error(str(e))
    # float32 matmuls on TF32 tensor cores (Ampere on); sets the legacy and the new flag alike on every torch
    # (the new fp32_precision alone: unknown before 2.9, at odds with Inductor's reads of allow_tf32 after)
    torch.set_float32_matmul_precision('high')
    if not device.startswith('cuda'):
        keep_freed_memory()
    if args.gpu_check:
        results = {i: r for i, r in enumerate(gpu_check(args, device))}
    elif args.diag_cost:
        results = {i: r for i, r in enumerate(diag_cost(args, device))}
    else:
        results = timing(args, variants, modes, device)
        print_timing(results, args)
    if args.json_out:
        run = dict(preset=args.preset, batch_size=args.batch_size, block_size=args.block_size, device=device,
                   dtype=args.dtype, threads=torch.get_num_threads())  # each record: compiled, really
        with open(args.json_out, 'w') as f:
            f.writelines(json.dumps(r | run) + '\n' for r in results.values())
        print(f"wrote {args.json_out}")


if __name__ == '__main__':
    main()
