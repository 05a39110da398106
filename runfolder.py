"""
The run folder's machinery, beside train.py as nanoGPT's configurator.py is beside its train.py.
It keeps the README's first promise, that no run is lost:
- one trainer per out_dir (a lock), and a new run never writes over a checkpoint;
- the log of an attempt stopped before its first save is kept beside (metrics.jsonl.1, ...);
- a checkpoint is written whole, or the previous one stays;
- Ctrl-C or SIGTERM stops a run with one line that says how to go on, after any checkpoint write.
It imports only fast modules of the standard library: train.py catches Ctrl-C before torch's import.
"""
import os
import shlex
import signal
import sys
import time
from contextlib import suppress

ddp = 'RANK' in os.environ  # launched by torchrun?
master = os.environ.get('RANK', '0') == '0'  # rank 0 speaks and saves
out_dir = ckpt_path = lock = None  # set by claim()
# set by train.py: its globals once its loop begins (a signal's line names iter_num)
loop = None
# the iteration of the checkpoint on disk: set by train.py on a resume, then by save(); train.py
# reads it at the end (which model the final evaluation scores)
saved_iter = None
saving = False  # a checkpoint is being written: a signal waits
stop_signal = None  # the signal that came meanwhile
renaming = None  # the iteration whose .tmp is being renamed to ckpt.pt


def catch_signals():
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)


def on_signal(signum, frame):
    global stop_signal
    # a checkpoint being written is finished first, unless the signal comes twice (under torchrun,
    # which passes its own signals on, every one waits)
    if saving and (stop_signal is None or ddp):
        if stop_signal is None:
            say("stopping once this checkpoint is written" + " (again: stop now)" * (not ddp))
        stop_signal = signum
        return
    at = f" at iteration {loop['iter_num']}" if loop else ''
    say(f"{'interrupted' if signum == signal.SIGINT else 'terminated'}{at}; {resume_hint()}")
    # exit with 128 + the signal's number, as a shell does; ckpt.pt and the log stay whole
    os._exit(128 + signum)


def resume_hint():
    launch = f"torchrun --nproc_per_node={os.environ['LOCAL_WORLD_SIZE']}" if ddp else 'python'
    # mid-rename, ckpt.pt is the new checkpoint once its .tmp is gone
    at = renaming if renaming is not None and not os.path.exists(ckpt_path + '.tmp') else saved_iter
    # stopped before the setup read the checkpoint
    if at is None and '--init_from=resume' in sys.argv:
        command = shlex.join(sys.argv[1:])
        return f"its checkpoint is as it was. Continue with: {launch} train.py {command}"
    return "nothing was saved" if at is None else (
        f"the last checkpoint is at iteration {at}: {ckpt_path}. Continue with: {launch} train.py "
        f"--init_from=resume --out_dir={shlex.quote(out_dir)}")


def say(line):
    # os.write: the signal may have cut into a print() that holds stdout's buffer
    if master:
        with suppress(RuntimeError):
            sys.stdout.flush()
        os.write(sys.stdout.fileno(), f"\n{line}\n".encode())


def claim(folder, scratch):
    """Why this run may not train in folder, or None: rank 0's decision, which every rank takes."""
    global out_dir, ckpt_path, lock
    out_dir, ckpt_path, refusal = folder, os.path.join(folder, 'ckpt.pt'), None
    if master:
        # train.lock stays locked (flock, also on NFS) until this process ends
        os.makedirs(out_dir, exist_ok=True)
        lock = open(os.path.join(out_dir, 'train.lock'), 'a+')
        try:
            import fcntl  # (none on Windows: no lock there)
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except ImportError:
            pass
        except BlockingIOError:
            lock.seek(0)
            refusal = (f"{out_dir}/ is in use by a running train.py ({lock.read().strip()}); "
                       "wait for it, or train in another --out_dir")
        if scratch and os.path.exists(ckpt_path) and not refusal:
            refusal = (f"{out_dir}/ holds a run; continue it with --init_from=resume, or train in "
                       "another --out_dir")
    if ddp:
        import torch.distributed as dist
        box = [refusal]
        dist.broadcast_object_list(box, src=0)
        refusal = box[0]
    if master and not refusal:
        lock.truncate(0)
        lock.write(f"pid {os.getpid()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        lock.flush()
        # the records of an attempt stopped before its first save are kept beside
        log_path = os.path.join(out_dir, 'metrics.jsonl')
        if scratch and os.path.exists(log_path):
            kept = next(f"{log_path}.{i}" for i in range(1, 10 ** 6)
                        if not os.path.exists(f"{log_path}.{i}"))
            os.replace(log_path, kept)
            print(f"note: {log_path} held an earlier attempt's records; kept as {kept}")
    return refusal


def save(checkpoint):
    """Every rank: rank 0 writes ckpt.pt whole; a signal meanwhile waits for the write."""
    global saving, saved_iter, renaming
    import torch  # (train.py's, imported long since)
    saving = True
    if master:
        torch.save(checkpoint, ckpt_path + '.tmp')
        renaming = checkpoint['iter_num']
        # atomic: a crash before it keeps the previous checkpoint
        os.replace(ckpt_path + '.tmp', ckpt_path)
    saved_iter, saving, renaming = checkpoint['iter_num'], False, None
    if stop_signal:  # a signal came during the save
        on_signal(stop_signal, None)
