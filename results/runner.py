"""The results' runs: train.py commands, two at a time with OMP_NUM_THREADS=1 (one core each). A run folder whose
log ends its run (a final record, or a 'diverged' one) is kept, so a script that was stopped or is run again makes
only the runs still missing. Each run's output goes beside its folder (runs/.../NAME.log)."""
import json
import os
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def finished(out_dir):
    try:
        with open(os.path.join(out_dir, 'metrics.jsonl'), encoding='utf-8', errors='replace') as f:
            return any(json.loads(line).get('event') in ('final', 'diverged') for line in f if line.startswith('{'))
    except (OSError, ValueError, AttributeError):
        return False


def prepare(*args):  # python prepare_data.py ARGS (it keeps finished work); a failure stops the script
    if subprocess.call([sys.executable, os.path.join(ROOT, 'prepare_data.py'), *args]):
        sys.exit(f"error: python prepare_data.py {' '.join(args)} failed (see above)")


def train(job):
    out_dir, flags = job
    os.makedirs(os.path.dirname(out_dir), exist_ok=True)
    resume = ['--init_from=resume'] * os.path.exists(os.path.join(out_dir, 'ckpt.pt'))  # a run cut short goes on
    with open(out_dir + '.log', 'a') as log:
        code = subprocess.call([sys.executable, os.path.join(ROOT, 'train.py'), *flags.split(), f'--out_dir={out_dir}',
                                *resume],
                               stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, OMP_NUM_THREADS='1'))
    return f"{out_dir}: " + ('done' if code == 0 else f"stopped (exit {code}); see {out_dir}.log")


def start():
    """A section's script takes no arguments (--help: its docstring, and nothing runs); it works from the repository
    root wherever it is started (runs/... and results/*.png are paths from there)."""
    if sys.argv[1:]:
        print(sys.modules['__main__'].__doc__)
        sys.exit(0 if sys.argv[1:] in (['-h'], ['--help']) else f"error: {os.path.basename(sys.argv[0])} takes no "
                 f"arguments (it was given {' '.join(sys.argv[1:])}); its runs and tables are fixed, see above")
    os.chdir(ROOT)


unprepared = []  # the prepare() calls that failed: asked once


def run(jobs, prepare=None, jobs_at_once=2):
    """jobs: [(out_dir, train.py flags)], made in this order, jobs_at_once at a time; those finished are skipped.
    prepare(): makes the corpora they read, called only when a job is missing (a clone's kept runs need none)."""
    start()
    todo = [j for j in jobs if not finished(j[0])]
    if todo and prepare and prepare not in unprepared:
        try:
            prepare()
        except SystemExit as e:  # no corpus here (a clone, say): the tables show the kept runs only
            print(e.code)
            unprepared.append(prepare)
    if todo and prepare in unprepared:
        print(f"{len(todo)} of {len(jobs)} runs are missing; none trained", flush=True)
        return
    if not jobs:
        return
    print(f"{len(jobs) - len(todo)} of {len(jobs)} runs finished already; training {len(todo)}, {jobs_at_once} at a "
          "time", flush=True)
    try:
        with ThreadPoolExecutor(jobs_at_once) as pool:
            for line in pool.map(train, todo):
                print(line, flush=True)
    except KeyboardInterrupt:  # the runs stop with their own line; finished ones stay
        sys.exit("interrupted: run the script again to finish the runs still missing")


def copy(src, dst):  # a run reused under another name (cp -r): the report counts a copy once
    if not finished(dst):
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(src, dst)
