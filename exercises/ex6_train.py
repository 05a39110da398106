"""Exercise 6's runs: each --attn given (default: mine coupled standard) for each seed, in the results' protocol
(500 iterations), two at a time with OMP_NUM_THREADS=1 (one core each), then their table from bench.py --report.
Run from the repository root:
    python exercises/ex6_train.py mine coupled --seeds 1           in class: 2 runs, about 5 minutes on 2 cores
    python exercises/ex6_train.py                                   homework: 9 runs, about 15 minutes on 2 cores
A run folder that holds a run already (runs/mine/<attn>-s<seed>) is kept, unless the step it trained with changed
since (a hash of the integrator's source, in <run>/step.txt): then it is trained again.
Flags after -- go to every train.py (e.g. -- --dataset=shakespeare); --runs names another folder than runs/mine."""
import argparse
import hashlib
import inspect
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROTOCOL = "--max_iters=500 --eval_interval=100 --eval_iters=20 --log_interval=100"  # the results' protocol

parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
parser.add_argument('attn', nargs='*', default=['mine', 'coupled', 'standard'])
parser.add_argument('--seeds', nargs='+', type=int, default=[1, 2, 3])
parser.add_argument('--runs', default=os.path.join('runs', 'mine'))
parser.add_argument('--jobs', type=int, default=2, help='runs at a time (one core each)')
args, extra = parser.parse_known_args()
extra = [a for a in extra if a != '--']
if args.jobs < 1:
    sys.exit(f"error: --jobs {args.jobs}: give 1 or more runs at a time (default 2, one a core)")
sys.path.insert(0, ROOT)
try:
    import model  # the model.py a run trains: yours, with `mine` appended
except Exception as e:  # a step that does not even import, such as a SyntaxError
    sys.exit(f"error: model.py does not import ({type(e).__name__}: {e}); fix your step, or start again with "
             "`git checkout model.py`")


def step_source(attn):
    """The source of the step `attn` trains with, its integrator's and the force's name ('' without one)."""
    name = attn.removeprefix('diff+')
    if name in ('standard', 'diff'):
        return ''
    if name not in model.QK_TRANSFORMS:
        sys.exit(f"error: --attn={attn} is unknown; choose one of {', '.join(model.attn_names())}")
    spec = model.QK_TRANSFORMS[name]
    built = spec.args(model.GPTConfig(attn=name))
    if 'integrator' not in built:  # a map with no integrator (uncoupled, invertible): its class
        return inspect.getsource(spec.cls)
    return inspect.getsource(model.INTEGRATORS[built['integrator']].step) + f"# force: {built['force']}\n"


sources = {a: step_source(a) for a in args.attn}


def train(attn, seed):
    out, source = os.path.join(args.runs, f"{attn}-s{seed}"), sources[attn]
    stamp = hashlib.sha256(source.encode()).hexdigest()[:12] + '\n' + source  # what <out>/step.txt records
    said = ''
    if os.path.exists(os.path.join(out, 'ckpt.pt')):
        try:
            kept = open(os.path.join(out, 'step.txt')).read() if source else ''
        except OSError:
            kept = None  # a run of an older launcher: its step is not known
        if kept == (stamp if source else ''):
            return f"{out}: holds a run of this step already, kept"
        shutil.rmtree(out)  # a stale run: another step trained it, or one no record names
        said = ('its step is not recorded' if kept is None else 'its step changed since') + ', trained again: '
    os.makedirs(args.runs, exist_ok=True)
    with open(out + '.log', 'w') as log:  # each run's output, beside its folder
        code = subprocess.call([sys.executable, os.path.join(ROOT, 'train.py'), f'--seed={seed}', f'--attn={attn}',
                                *PROTOCOL.split(), f'--out_dir={out}', *extra], stdout=log, stderr=subprocess.STDOUT,
                               env=dict(os.environ, OMP_NUM_THREADS='1'))
    if code == 0 and source:
        with open(os.path.join(out, 'step.txt.tmp'), 'w') as f:  # atomically: a whole record or none
            f.write(stamp)
        os.replace(os.path.join(out, 'step.txt.tmp'), os.path.join(out, 'step.txt'))
    return f"{out}: {said}" + ('done' if code == 0 else f"failed (exit {code}); see {out}.log")


runs = [(a, s) for s in args.seeds for a in args.attn]
print(f"training {len(runs)} runs, {args.jobs} at a time: {', '.join(f'{a}-s{s}' for a, s in runs)}", flush=True)
with ThreadPoolExecutor(args.jobs) as pool:
    for line in pool.map(lambda r: train(*r), runs):
        print(line, flush=True)
sys.exit(subprocess.call([sys.executable, os.path.join(ROOT, 'bench.py'), f'--report={args.runs}']))
