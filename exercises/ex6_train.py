"""Exercise 6's runs: each --attn given (default: mine coupled standard) for each seed, in the results' protocol
(500 iterations), two at a time with OMP_NUM_THREADS=1 (one core each), then their table from bench.py --report.
Run from the repository root:
    python exercises/ex6_train.py mine coupled --seeds 1           in class: 2 runs, about 5 minutes on 2 cores
    python exercises/ex6_train.py                                   homework: 9 runs, about 15 minutes on 2 cores
A run folder that holds a run already (runs/mine/<attn>-s<seed>) is kept: rm -rf it to retrain a changed `mine`.
Flags after -- go to every train.py (e.g. -- --dataset=shakespeare); --runs names another folder than runs/mine."""
import argparse
import os
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


def train(attn, seed):
    out = os.path.join(args.runs, f"{attn}-s{seed}")
    if os.path.exists(os.path.join(out, 'ckpt.pt')):
        return f"{out}: holds a run already, kept (rm -rf it to retrain)"
    os.makedirs(args.runs, exist_ok=True)
    with open(out + '.log', 'w') as log:  # each run's output, beside its folder
        code = subprocess.call([sys.executable, os.path.join(ROOT, 'train.py'), f'--seed={seed}', f'--attn={attn}',
                                *PROTOCOL.split(), f'--out_dir={out}', *extra], stdout=log, stderr=subprocess.STDOUT,
                               env=dict(os.environ, OMP_NUM_THREADS='1'))
    return f"{out}: " + ('done' if code == 0 else f"failed (exit {code}); see {out}.log")


runs = [(a, s) for s in args.seeds for a in args.attn]
print(f"training {len(runs)} runs, {args.jobs} at a time: {', '.join(f'{a}-s{s}' for a, s in runs)}", flush=True)
with ThreadPoolExecutor(args.jobs) as pool:
    for line in pool.map(lambda r: train(*r), runs):
        print(line, flush=True)
sys.exit(subprocess.call([sys.executable, os.path.join(ROOT, 'bench.py'), f'--report={args.runs}']))
