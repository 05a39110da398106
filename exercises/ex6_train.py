"""Exercise 6's runs: each --attn given (default: mine coupled standard) for each seed, in the results' protocol
(500 iterations), two at a time with OMP_NUM_THREADS=1 (one core each), then their table from bench.py --report.
Run from the repository root:
    python exercises/ex6_train.py mine coupled --seeds 1           in class: 2 runs, about 5 minutes on 2 cores
    python exercises/ex6_train.py                                   homework: 9 runs, about 15 minutes on 2 cores
A run folder that holds a run already (runs/mine/<attn>-s<seed>) is kept, unless what it trained with changed since:
the step's source, the source of every model.py function and constant the step names, and train.py's flags (a hash
in <run>/step.txt). Then it is trained again, in <run>.new, which replaces it once it ends (a failure keeps the old
run). A run cut short (Ctrl-C) resumes on the next launch. A run folder a train.py is still writing is left alone.
Flags after -- go to every train.py (e.g. -- --dataset=shakespeare); --runs names another folder than runs/mine."""
import argparse
import hashlib
import inspect
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress

signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C stops it even as a background job, as train.py
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROTOCOL = "--max_iters=500 --eval_interval=100 --eval_iters=20 --log_interval=100"  # the results' protocol


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not the usage block
        sys.exit(f"error: {message}; see python exercises/ex6_train.py --help")


parser = Parser(description=__doc__.splitlines()[0])
parser.add_argument('attn', nargs='*', default=['mine', 'coupled', 'standard'])
parser.add_argument('--seeds', nargs='+', type=int, default=[1, 2, 3])
parser.add_argument('--runs', default=os.path.join('runs', 'mine'))
parser.add_argument('--jobs', type=int, default=2, help='runs at a time (one core each)')
argv = sys.argv[1:]
cut = argv.index('--') if '--' in argv else len(argv)  # after --: train.py's flags, never an --attn
args, extra = parser.parse_known_args(argv[:cut])
extra += argv[cut + 1:]
if args.jobs < 1:
    sys.exit(f"error: --jobs {args.jobs}: give 1 or more runs at a time (default 2, one a core)")
if min(args.seeds) < 0:
    sys.exit(f"error: --seeds {min(args.seeds)}: a seed is 0 or more, e.g. --seeds 1 2 3")
ours = sorted({a.split('=')[0] for a in extra} & {'--attn', '--seed', '--out_dir', '--init_from'})
if ours:  # the folder's name says what trained it
    sys.exit(f"error: {', '.join(ours)} after -- would train another run than its folder names; the launcher sets "
             "them: name variants as arguments and seeds with --seeds, e.g. mine coupled --seeds 1 2")
if not args.runs.strip():
    sys.exit("error: --runs names no folder; name one, e.g. --runs runs/mine")
sys.path.insert(0, ROOT)
try:
    import model  # the model.py a run trains: yours, with `mine` appended
except KeyboardInterrupt:
    print("Ctrl-C: stopped before any run started", file=sys.stderr)
    sys.exit(130)
except Exception as e:  # a step that does not even import, such as a SyntaxError
    sys.exit(f"error: model.py does not import ({type(e).__name__}: {e}); fix your step, or start again with "
             "`git checkout model.py`")


def source(obj, seen):
    """obj's source, then that of every model.py function, class and constant its code names, each once."""
    if id(obj) in seen:
        return ''
    seen.add(id(obj))
    text, codes, names = inspect.getsource(obj), [], set()
    codes = [obj.__code__] if inspect.isfunction(obj) else [f.__code__ for f in vars(obj).values()
                                                             if inspect.isfunction(f)]
    while codes:  # the code, and the code inside it (lambdas, inner functions)
        code = codes.pop()
        names |= set(code.co_names)
        codes += [c for c in code.co_consts if inspect.iscode(c)]
    for name in sorted(names):
        value = vars(model).get(name)
        if (inspect.isfunction(value) or inspect.isclass(value)) and value.__module__ == model.__name__:
            text += source(value, seen)
        elif type(value) in (int, float, complex, str, tuple, list, dict) and ' at 0x' not in repr(value):
            text += f"{name} = {value!r}\n"  # a constant, such as Yoshida's coefficients
    return text


def step_source(attn):
    """The source of what `attn` trains with beyond standard attention: its integrator's step and its force (or its
    map's class), with what they call in model.py ('' for standard and diff)."""
    name = attn.removeprefix('diff+')
    if name in ('standard', 'diff'):
        return ''
    if name not in model.QK_TRANSFORMS:
        hint = "; append the template first: cat exercises/ex6_mine.py >> model.py" if name == 'mine' else ''
        sys.exit(f"error: --attn={attn} is unknown{hint}; choose one of {', '.join(model.attn_names())}")
    spec, seen = model.QK_TRANSFORMS[name], set()
    built = spec.args(model.GPTConfig(attn=name))
    if 'integrator' not in built:  # a map with no integrator (uncoupled, invertible): its class
        return source(spec.cls, seen)
    return source(model.INTEGRATORS[built['integrator']].step, seen) + source(model.FORCES[built['force']], seen)


sources = {a: step_source(a) for a in args.attn}
stopping = threading.Event()  # set by Ctrl-C


def held(out):
    """None, or who holds out's lock: a train.py still writing it (train.py flocks its folder, and train.lock says
    who). Checked before a run folder is deleted or written: two launchers must not share a run."""
    try:
        import fcntl
        fd = os.open(out, os.O_RDONLY)
    except (ImportError, OSError):  # Windows, or no folder yet
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    except BlockingIOError:
        try:
            return open(os.path.join(out, 'train.lock')).read().strip() or 'its pid unknown'
        except OSError:
            return 'its pid unknown'
    except OSError:  # a filesystem without flock: train.py's own check still refuses a second run
        return None
    finally:
        os.close(fd)


def recorded(folder):
    """What trained folder's run, as its step.txt records it (None: no record)."""
    try:
        return open(os.path.join(folder, 'step.txt'), errors='replace').read()
    except OSError:
        return None


def ended(folder):
    """'final' (with tokens trained) or 'diverged' if the run's last start ended so (its metrics.jsonl says), else
    None."""
    events = []
    with suppress(OSError):
        for line in open(os.path.join(folder, 'metrics.jsonl'), errors='replace'):
            with suppress(ValueError, TypeError):  # a cut or foreign line
                events.append(dict(json.loads(line)))
    last = ([e for e in events if e.get('event') in ('start', 'final', 'diverged')] or [{}])[-1]
    if last.get('event') == 'diverged':
        return 'diverged'
    tokens = last.get('tokens')
    trained = type(tokens) in (int, float) and tokens > 0  # not a final of no training (-- --max_iters=0)
    return 'final' if last.get('event') == 'final' and trained else None  # (else unfinished, or no run)


def remove(folder):
    """Deletes folder; a link to a folder kept elsewhere: the link goes, the folder it points to stays."""
    if os.path.islink(folder):
        os.remove(folder)
    shutil.rmtree(folder, ignore_errors=True)


def promote(new, out):
    """The retraining `new` takes the place of the run `out`, and its log that of out's."""
    remove(out)
    os.replace(new, out)
    with suppress(OSError):
        os.remove(out + '.log')  # the old run's output goes with it
    with suppress(OSError):
        os.replace(new + '.log', out + '.log')


def train(attn, seed):
    """Trains runs/mine/<attn>-s<seed> unless it holds this run already: (whether it now does, what happened)."""
    out, flags = os.path.join(args.runs, f"{attn}-s{seed}"), [*PROTOCOL.split(), *extra]
    record = f"train.py {' '.join(flags)}\n{sources[attn]}"  # what trained it: the flags, then the step's source
    stamp = hashlib.sha256(record.encode()).hexdigest()[:12] + '\n' + record  # what <out>/step.txt records
    new = out + '.new'  # a stale run's retraining: the stale run stays whole until its retraining ends
    for folder in (out, new):
        who = held(folder)
        if who:
            return False, (f"{folder}: in use by a running train.py ({who}); left alone: wait for it, or stop it, "
                           "then run again")
    said, dest, was = '', out, recorded(out)  # was: what trained the run out holds
    if (os.path.exists(os.path.join(out, 'ckpt.pt')) or ended(out)) and was != stamp:
        old = re.match(r'[0-9a-f]{12}\ntrain\.py (.*)\n', was or '')
        why = ('its step and flags are not recorded' if not old else 'its flags changed since'
               if old.group(1) != ' '.join(flags) else 'its step changed since')
        said, dest = f"{why}, trained again: ", new
    if dest == out and not os.path.exists(os.path.join(out, 'ckpt.pt')) and recorded(new) == stamp:
        promote(new, out)  # a retraining whose rename was cut short: it is this run
    if os.path.isdir(new) and (dest == out or recorded(new) != stamp):
        remove(new)  # a retraining cut short, of other flags or a step since changed: nothing to keep
    end = ended(out) if dest == out else None
    if end:  # (step.txt matches)
        how = ' (it diverged)' * (end == 'diverged')
        return True, f"{out}: holds a run of this step and these flags already{how}, kept"
    resume = os.path.exists(os.path.join(dest, 'ckpt.pt'))  # then step.txt matches: an interrupted run
    try:
        os.makedirs(dest, exist_ok=True)
        with open(os.path.join(dest, 'step.txt.tmp'), 'w') as f:  # atomically: a whole record or none
            f.write(stamp)
        os.replace(os.path.join(dest, 'step.txt.tmp'), os.path.join(dest, 'step.txt'))
    except OSError as e:  # e.g. a file where the run's folder goes
        return False, f"{dest}: cannot make the run's folder there ({e.strerror or e}); move what is in the way"
    code = 0
    if stopping.is_set():  # Ctrl-C came while this run was being set up
        return False, ''
    if not ended(dest):  # (else a retraining that ended, its folder not yet renamed: it is done)
        try:
            log = open(dest + '.log', 'a' if resume else 'w')  # each run's output, beside its folder
        except OSError as e:  # e.g. a folder of that name
            return False, (f"{dest}.log: cannot write the run's output there ({e.strerror or e}); move what is in "
                           "the way")
        with log:
            code = subprocess.call([sys.executable, os.path.join(ROOT, 'train.py'), f'--seed={seed}',
                                    f'--attn={attn}', *flags, f'--out_dir={dest}', *['--init_from=resume'] * resume],
                                   stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, OMP_NUM_THREADS='1'))
    said += 'interrupted before, resumed: ' * resume
    if code in (130, -signal.SIGINT):
        return False, f"{out}: {said}interrupted; run the same command again to resume it"
    end = ended(dest)  # a run is its log's end: 'final' (done) or 'diverged' (a result too), not an exit code
    lines = [l.strip() for l in open(dest + '.log', errors='replace') if l.strip()] if code or end != 'final' else []
    cause = next((l for l in reversed(lines) if l.startswith('error:')), lines[-1] if lines else 'the log is empty')
    if not code and not end:  # e.g. -- --help: train.py printed and stopped
        cause = f"train.py ended without training a run (its last line: {cause})"
    if dest == new and (end == 'diverged' or end == 'final' and not code):  # it replaces the stale run
        promote(new, out)
    elif dest == new:  # it failed: the stale run stays
        if not os.path.exists(os.path.join(new, 'ckpt.pt')):
            remove(new)
        return False, (f"{out}: {said}failed (exit {code}): {cause}\n  (all of its output: {new}.log; the run the "
                       "folder held, of the earlier step or flags, is kept, and its row below is that run's)")
    if end == 'final' and not code:
        return True, f"{out}: {said}done"
    if end == 'diverged':  # a result, not a failure: the table counts it among the seeds
        return True, f"{out}: {said}diverged: {cause.removeprefix('error: ').split(';')[0]}; the table counts it"
    return False, f"{out}: {said}failed (exit {code}): {cause}\n  (all of its output: {out}.log)"


def lock(folder):
    """Holds folder (runs/mine) for this launcher, or says which one holds it: two launchers must not share runs."""
    try:
        os.makedirs(folder, exist_ok=True)
        fd = os.open(folder, os.O_RDONLY)
    except OSError as e:
        sys.exit(f"error: --runs={folder}: cannot make or open that folder ({e.strerror or e}); name another")
    try:
        import fcntl
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except ImportError:  # Windows: train.py's own lock still refuses a second run in one folder
        pass
    except BlockingIOError:
        sys.exit(f"error: another exercises/ex6_train.py is training into {folder}; wait for it to finish, or name "
                 "another folder with --runs")
    except OSError:  # a filesystem without flock
        pass
    return fd


runs = [(a, s) for s in dict.fromkeys(args.seeds) for a in dict.fromkeys(args.attn)]
if len(runs) < len(args.seeds) * len(args.attn):
    print("note: a repeated --attn or seed is trained once")
held_runs = lock(args.runs)  # (released when the launcher exits)
jobs = min(args.jobs, len(runs))  # never more at a time than there are runs
if jobs > (os.cpu_count() or 1):
    print(f"note: {jobs} runs at a time on {os.cpu_count()} cores: they share them, each slower")
print(f"training {len(runs)} run{'s' * (len(runs) > 1)}, {jobs} at a time: "
      f"{', '.join(f'{a}-s{s}' for a, s in runs)}", flush=True)
missing, pool, reporting = 0, ThreadPoolExecutor(jobs), False
try:
    for ok, line in pool.map(lambda r: train(*r), runs):
        missing += not ok
        print(line, flush=True)
    reporting = True
    code = subprocess.call([sys.executable, os.path.join(ROOT, 'bench.py'), f'--report={args.runs}'])
except KeyboardInterrupt:  # Ctrl-C reaches every train.py too: each stops at its checkpoint; no run starts after it
    stopping.set()
    pool.shutdown(cancel_futures=True)
    if not reporting:  # (bench.py says its own line)
        print("Ctrl-C: stopped; run the same command again to resume the runs cut short", file=sys.stderr)
    sys.exit(130)
if missing:
    sys.exit(f"error: {missing} of {len(runs)} runs did not finish (their lines above say why)")
sys.exit(code)
