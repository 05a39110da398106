"""Exercise 6's homework: trains each variant given (default: mine coupled standard) with each seed, 500 iterations
in the results' protocol, two at a time (one core each), then prints their table. From the repository root:
    python exercises/ex6_train.py                          9 runs, about 7 minutes on 2 idle cores
    python exercises/ex6_train.py mine coupled             6 runs
    python exercises/ex6_train.py mine coupled --seeds 1   2 runs (one seed: no spread over seeds)
    python exercises/ex6_train.py -- --max_iters=200       flags after -- go to every train.py
Runs shorter than 500 iterations do not compare with results/laptop.md. A run goes to
runs/lab/<hash>/<variant>-s<seed> (--runs: another folder). The hash is of model.py (for the built-in variants, before
your step) and of the flags that differ from train.py's defaults. A run is used again only while both are unchanged,
and only if its log names the model.py read here. No run is ever deleted. Ctrl-C stops the runs. The same command
then resumes each from its checkpoint, or starts it again if it had saved none yet."""
import argparse
import ast
import dataclasses
import hashlib
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROTOCOL = "--max_iters=500 --eval_interval=100 --eval_iters=20 --log_interval=100"  # the results' protocol
TEMPLATE = b"# Exercise 6: your own integrator."  # ex6_mine.py's first line: in model.py, where your step starts


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not the usage block
        sys.exit(f"error: {message}; see python exercises/ex6_train.py --help")


parser = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument('attn', nargs='*', default=['mine', 'coupled', 'standard'])
parser.add_argument('--seeds', nargs='+', type=int, default=[1, 2, 3])
parser.add_argument('--runs', default=os.path.join('runs', 'lab'))
argv = sys.argv[1:]
cut = argv.index('--') if '--' in argv else len(argv)  # after --: train.py's flags
args, flags = parser.parse_args(argv[:cut]), [*PROTOCOL.split(), *argv[cut + 1:]]
given = dict(f.partition('=')[::2] for f in flags)  # {'--key': 'value'}: the last one wins, as in train.py
named = sorted(set(given) & {'--attn', '--seed', '--out_dir', '--init_from'})
if named:  # the folder's name says what trained it
    sys.exit(f"error: {', '.join(named)} after -- would train another run than its folder names; name variants as "
             "arguments and seeds with --seeds, e.g. mine coupled --seeds 1 2")
sys.path[:0] = [ROOT, os.path.join(ROOT, 'results')]
import model  # noqa: E402  the model.py the runs train: yours, with `mine` appended
import report  # noqa: E402  results/report.py, which prints the runs' table

for attn in args.attn:
    if attn not in model.attn_names():
        hint = "; append the template first: cat exercises/ex6_mine.py >> model.py" if attn == 'mine' else ''
        sys.exit(f"error: --attn={attn} is unknown{hint}; choose one of {', '.join(model.attn_names())}")
source = open(os.path.join(ROOT, 'model.py'), 'rb').read()
sha = hashlib.sha256(source).hexdigest()  # as train.py logs the model.py it imported
# train.py's defaults, read rather than run: GPTConfig's fields, then the values train.py's settings give
settings = ast.parse(open(os.path.join(ROOT, 'train.py')).read()).body
defaults = {f'--{f.name}': str(f.default) for f in dataclasses.fields(model.GPTConfig)} | {
    f'--{n.targets[0].id}': str(n.value.value) for n in settings if isinstance(n, ast.Assign)
    and isinstance(n.targets[0], ast.Name) and isinstance(n.value, ast.Constant)}


def value(text):  # a flag's value as train.py reads it: 2e-3 is 0.002, True is true
    try:
        return float(text)
    except ValueError:
        return text.lower() if text.lower() in ('true', 'false') else text


changed = sorted(f"{k}={v}" for k, v in given.items() if k not in defaults or value(v) != value(defaults[k]))


def folder(attn, seed):  # runs/lab/<hash>/<attn>-s<seed>; a flag at train.py's default changes no hash
    code = source if 'mine' in attn else source.split(TEMPLATE)[0]  # the built-in variants: without your step
    digest = hashlib.sha256(code + f"\n{' '.join(changed)}".encode()).hexdigest()[:8]
    return os.path.join(args.runs, digest, f"{attn}-s{seed}")


def records(out):  # out's log, a record a line (none where no run is)
    path = os.path.join(out, 'metrics.jsonl')
    return [json.loads(line) for line in open(path)] if os.path.exists(path) else []


def ours(out):  # started by this launcher, each train.py there on a model.py that a launcher read (their hashes)
    stamp = os.path.join(out, 'launched.txt')  # a line a start: the model.py's hash, then the flags
    read = {line.split()[0] for line in open(stamp)} if os.path.exists(stamp) else set()
    return bool(read) and {r.get('model_sha256') for r in records(out) if r['event'] == 'start'} <= read


def ended(out):  # 'final' or 'diverged' if the run's log ends so; else None (a run cut short, or no run)
    events = [r['event'] for r in records(out) if r['event'] in ('start', 'final', 'diverged')]
    return events[-1] if events and events[-1] != 'start' else None


def train(attn, seed):
    """Trains attn's run of this seed unless it is there already: (whether it is there now, a line to print)."""
    out, command = folder(attn, seed), [f'--attn={attn}', f'--seed={seed}', *flags]
    if os.path.exists(out) and not ours(out):
        return False, (f"{out}: holds a run this launcher did not start, or one of a model.py edited as it started; "
                       "left alone: move it, or name another --runs")
    end = ended(out)
    if end:
        return True, f"{out}: trained already with this step and these flags, kept" + " (it diverged)" * (
            end == 'diverged')
    if open(os.path.join(ROOT, 'model.py'), 'rb').read() != source:  # edited since: this run would train other code
        return False, f"{out}: not started, as model.py changed while this launcher ran; run the command again"
    resume = os.path.exists(os.path.join(out, 'ckpt.pt'))  # a run cut short
    os.makedirs(out, exist_ok=True)
    open(os.path.join(out, 'launched.txt'), 'a').write(f"{sha} {' '.join(command)}\n")
    with open(os.path.join(out, 'output.txt'), 'a') as log:
        code = subprocess.call([sys.executable, os.path.join(ROOT, 'train.py'), *command, f'--out_dir={out}',
                                *['--init_from=resume'] * resume], stdout=log, stderr=subprocess.STDOUT,
                               env=dict(os.environ, OMP_NUM_THREADS='1'))
    if not ours(out):  # model.py was edited between the check above and train.py's import
        return False, f"{out}: trained a model.py edited as it started, so it is not filed as this one's; left alone"
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
    if there:
        report.main(there)
except KeyboardInterrupt:  # Ctrl-C reaches every train.py too: each stops at its checkpoint
    pool.shutdown(cancel_futures=True)
    sys.exit("Ctrl-C: stopped; the same command again resumes each run cut short from its checkpoint, or starts it "
             "again if it had saved none yet")
if there:
    print(f"\nthe table again, at any time: python results/report.py {' '.join(there)}")
if len(there) < len(runs):
    sys.exit(f"error: {len(runs) - len(there)} of {len(runs)} runs are not in the table (their lines above say why)")
