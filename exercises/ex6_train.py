"""Exercise 6's homework: trains each variant given (default: mine coupled standard) with each seed, 500 iterations in
the results' protocol, two at a time (one core each), then prints the table of the runs. From the repository root:
    python exercises/ex6_train.py                              9 runs, about 7 minutes on 2 idle cores
    python exercises/ex6_train.py mine coupled --seeds 1       2 runs
    python exercises/ex6_train.py -- --dataset=shakespeare     flags after -- go to every train.py
A run goes to runs/lab/<hash>/<variant>-s<seed> (--runs: another folder). The hash is of the flags and of model.py
(for the built-in variants, of model.py before your step). A run is used again only while both are unchanged, and no
run is ever deleted or replaced. Ctrl-C stops it, and the same command resumes the runs it cut short."""
import argparse
import hashlib
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROTOCOL = "--max_iters=500 --eval_interval=100 --eval_iters=20 --log_interval=100"  # the results' protocol
TEMPLATE = "# Exercise 6: your own integrator."  # ex6_mine.py's first line: in model.py, where your step starts


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not the usage block
        sys.exit(f"error: {message}; see python exercises/ex6_train.py --help")


parser = Parser(description=__doc__.splitlines()[0])
parser.add_argument('attn', nargs='*', default=['mine', 'coupled', 'standard'])
parser.add_argument('--seeds', nargs='+', type=int, default=[1, 2, 3])
parser.add_argument('--runs', default=os.path.join('runs', 'lab'))
argv = sys.argv[1:]
cut = argv.index('--') if '--' in argv else len(argv)  # after --: train.py's flags
args, flags = parser.parse_args(argv[:cut]), [*PROTOCOL.split(), *argv[cut + 1:]]
ours = sorted({f.split('=')[0] for f in flags} & {'--attn', '--seed', '--out_dir', '--init_from'})
if ours:  # the folder's name says what trained it
    sys.exit(f"error: {', '.join(ours)} after -- would train another run than its folder names; name variants as "
             "arguments and seeds with --seeds, e.g. mine coupled --seeds 1 2")
sys.path.insert(0, ROOT)
import model  # noqa: E402  the model.py the runs train: yours, with `mine` appended

for attn in args.attn:
    if attn not in model.attn_names():
        hint = "; append the template first: cat exercises/ex6_mine.py >> model.py" if attn == 'mine' else ''
        sys.exit(f"error: --attn={attn} is unknown{hint}; choose one of {', '.join(model.attn_names())}")
source = open(os.path.join(ROOT, 'model.py')).read()


def folder(attn, seed):  # runs/lab/<hash>/<attn>-s<seed>
    code = source if 'mine' in attn else source.split(TEMPLATE)[0]  # the built-in variants: without your step
    digest = hashlib.sha256(f"{code}\n{' '.join(flags)}".encode()).hexdigest()[:8]
    return os.path.join(args.runs, digest, f"{attn}-s{seed}")


def ended(out):  # 'final' or 'diverged' if the run's log ends so; else None (a run cut short, or no run)
    if not os.path.exists(os.path.join(out, 'metrics.jsonl')):
        return None
    events = [json.loads(line)['event'] for line in open(os.path.join(out, 'metrics.jsonl'))]
    events = [e for e in events if e in ('start', 'final', 'diverged')]
    return events[-1] if events and events[-1] != 'start' else None


class Changed(Exception):  # model.py is not the one this launcher read and files its runs under
    pass


def train(attn, seed):
    """Trains attn's run of this seed unless it is there already: (whether it is there now, a line to print)."""
    out, command = folder(attn, seed), [f'--attn={attn}', f'--seed={seed}', *flags]
    stamp = os.path.join(out, 'launched.txt')  # what this launcher started there
    if os.path.exists(out) and not (os.path.exists(stamp) and open(stamp).read() == ' '.join(command)):
        return False, f"{out}: holds a run this launcher did not start; left alone: move it, or name another --runs"
    end = ended(out)
    if end:
        return True, f"{out}: trained already with this step and these flags, kept" + " (it diverged)" * (
            end == 'diverged')
    if open(os.path.join(ROOT, 'model.py')).read() != source:  # edited since: this run would train other code
        raise Changed(out)
    resume = os.path.exists(os.path.join(out, 'ckpt.pt'))  # a run cut short
    os.makedirs(out, exist_ok=True)
    open(stamp, 'w').write(' '.join(command))
    with open(os.path.join(out, 'output.txt'), 'a') as log:
        code = subprocess.call([sys.executable, os.path.join(ROOT, 'train.py'), *command, f'--out_dir={out}',
                                *['--init_from=resume'] * resume], stdout=log, stderr=subprocess.STDOUT,
                               env=dict(os.environ, OMP_NUM_THREADS='1'))
    end, said = ended(out), 'resumed, ' * resume
    if end:  # a diverged run is a result too: the table counts it
        return True, f"{out}: {said}{'done' if end == 'final' else 'diverged; the table counts it'}"
    last = [line for line in open(os.path.join(out, 'output.txt')).read().split('\n') if line.strip()] or ['']
    return False, f"{out}: {said}stopped (exit {code}): {last[-1]}\n  (all of its output: {out}/output.txt)"


runs = [(attn, seed) for seed in dict.fromkeys(args.seeds) for attn in dict.fromkeys(args.attn)]
print(f"training {len(runs)} run{'s' * (len(runs) != 1)}, 2 at a time: {', '.join(f'{a}-s{s}' for a, s in runs)}",
      flush=True)
pool, there = ThreadPoolExecutor(2), []  # the run folders it trained, now or before
try:
    for run, (ok, line) in zip(runs, pool.map(lambda run: train(*run), runs)):
        print(line, flush=True)
        there += [folder(*run)] * ok
    code = subprocess.call([sys.executable, os.path.join(ROOT, 'results', 'report.py'), *there]) if there else 1
except KeyboardInterrupt:  # Ctrl-C reaches every train.py too: each stops at its checkpoint
    pool.shutdown(cancel_futures=True)
    sys.exit("Ctrl-C: stopped; run the same command again to resume the runs cut short")
except Changed as e:  # the runs under way finish (they read model.py as it was), no other starts
    pool.shutdown(cancel_futures=True)
    sys.exit(f"error: model.py changed while this launcher ran, so {e} did not start (the runs before it are kept); "
             "run the same command again to train the rest with model.py as it is now")
if there:
    print(f"\nthe table again, at any time: python results/report.py {' '.join(there)}")
if len(there) < len(runs):
    sys.exit(f"error: {len(runs) - len(there)} of {len(runs)} runs are not in the table (their lines above say why)")
sys.exit(code)
