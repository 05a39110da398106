"""
Train a GPT with any attention variant: one flat loop, nanoGPT-shaped. Every setting below is a flag.

  python train.py --attn=coupled                         # laptop CPU: tiny model on data/pydocs
  python train.py --preset=60m --dataset=wikitext103 --attn=coupled --compile=True  # one GPU (bench.py --plan)
  torchrun --standalone --nproc_per_node=8 train.py ...  # DDP (nccl on CUDA, gloo on CPU)
  python train.py --init_from=resume --out_dir=out       # continue a run; --eval_only=True, --sample="def " too

Flags (--key=value) > a --preset > the values below; resume, eval and sample take the model and training
settings no flag gives from the checkpoint.
"""
import os
import signal
import sys

# Ctrl-C: one line and exit code 130; a checkpoint being written is finished first
phase, iter_num, saved_iter, saving, interrupted = 'before training', 0, None, False, False
master = os.environ.get('RANK', '0') == '0'  # rank 0 logs, saves and speaks


def on_ctrl_c(signum, frame):  # Ctrl-C (SIGINT) or a kill's SIGTERM: one line, exit 128 + the signal's number
    global interrupted
    if saving and not interrupted:  # a second signal stops at once
        interrupted = signum
        return say(f"{'Ctrl-C' if signum == signal.SIGINT else 'SIGTERM'}: stopping once this checkpoint is written "
                   "(again: stop now)")
    where = {'train': f"at iteration {iter_num}", 'final': "during the final evaluation"}.get(phase, phase)
    stop = 'interrupted' if signum == signal.SIGINT else 'terminated (SIGTERM)'
    say(f"{stop}; nothing was written" if phase == 'read only' else f"{stop} {where}; {resume_hint()}")
    os._exit(128 + signum)  # 130 or 143; ckpt.pt and the log stay whole


def resume_hint():
    run = f"torchrun --nproc_per_node={os.environ['LOCAL_WORLD_SIZE']}" if 'RANK' in os.environ else 'python'
    return "no checkpoint yet" if saved_iter is None else (
        f"the last checkpoint is at iteration {saved_iter}: {shlex.quote(ckpt_path)}. Continue with: {run} train.py "
        f"--init_from=resume --out_dir={shlex.quote(out_dir)}")


def say(line):  # os.write: the handler may cut into a print() holding stdout's buffer
    if master:
        try:
            sys.stdout.flush()
        except RuntimeError:
            pass
        os.write(sys.stdout.fileno(), f"\n{line}\n".encode())


signal.signal(signal.SIGINT, on_ctrl_c)
signal.signal(signal.SIGTERM, on_ctrl_c)

import hashlib
import json
import math
import shlex
import time
from contextlib import nullcontext, suppress
from dataclasses import fields

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import prepare_data
from model import (DIAG_SEQUENCES, POS, PRESETS, GPT, GPTConfig, attention_diagnostics, attn_names, autocast_dtype,
                   flops_per_token, median_layer, peak_flops, qk_diagnostics, qk_flags_read)

# -----------------------------------------------------------------------------
_before = set(globals())  # the settings: what this block adds
# I/O
out_dir = 'out'
eval_interval = 250
log_interval = 10
eval_iters = 40  # batches per validation estimate
diag_interval = 1  # the q/k and attention diagnostics every N evals (and at the last); 0: never
eval_only = False  # evaluate out_dir's checkpoint on the full splits, and exit
always_save_checkpoint = True  # False: save only when the val loss improves
init_from = 'scratch'  # or 'resume' (from out_dir/ckpt.pt)
time_budget = 0.0  # stop at a log step past this many seconds of training (across resumes; 0: never)
sample = ''  # a prompt: print out_dir's model's continuation, and exit
sample_tokens = 200  # by --sample, and at the end of a run (0: none)
# data
dataset = 'pydocs'  # data/<dataset>/ made by prepare_data.py
data_dir = 'data'
gradient_accumulation_steps = 1  # micro-steps per iteration, per rank
batch_size = 16  # sequences per micro-step, per rank
block_size = 128
# model
preset = ''  # e.g. 60m: n_layer, n_head, n_embd from model.PRESETS
n_layer = 4
n_head = 4
n_embd = 128
dropout = 0.0
bias = False
attn = 'standard'  # one of model.attn_names(); 'coupled' is the paper's method
# AdamW, linear warmup then cosine decay to min_lr
learning_rate = 2e-3
max_iters = 2000
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0  # 0 disables clipping
warmup_iters = 100
lr_decay_iters = 0  # 0: max_iters
min_lr = 2e-4
# system
device = 'auto'  # auto (cuda, mps, cpu), or name one, e.g. cuda:1
dtype = 'auto'  # auto: bfloat16 where the GPU has it natively, float16 on older GPUs, float32 off CUDA
compile = False  # torch.compile the training step (eager, with a warning, if it fails); evaluation runs eager
seed = 1337
# -----------------------------------------------------------------------------
defaults = {k: v for k, v in globals().items() if k not in _before and k != '_before'}
# every other GPTConfig field is a flag too (see --help)
MODEL_KEYS = [f.name for f in fields(GPTConfig) if f.name != 'vocab_size']
defaults |= {k: getattr(GPTConfig, k) for k in MODEL_KEYS if k not in defaults}
CHOICES = dict(attn=attn_names(), pos=POS, preset=('',) + tuple(PRESETS), init_from=('scratch', 'resume'),
               dtype=('auto', 'float32', 'bfloat16', 'float16'))
POSITIVE = 'batch_size block_size gradient_accumulation_steps eval_interval eval_iters log_interval learning_rate'
# numbers are finite, >= 0 (POSITIVE: > 0) and below BELOW; PER_RANK loops read at most MAX_SEQUENCES sequences
BELOW = dict(beta1=1, beta2=1, seed=2 ** 63 - 1024, max_iters=10 ** 9, sample_tokens=2 ** 20)
PER_RANK, MAX_SEQUENCES = dict(eval_iters='an estimate', gradient_accumulation_steps='an iteration'), 2 ** 20
LOCAL_KEYS = 'out_dir init_from eval_only device sample sample_tokens preset'.split()


def shutdown(code):  # every exit
    if dist.is_initialized():
        dist.destroy_process_group()
        sys.stdout.flush(), sys.stderr.flush()
        os._exit(code)  # skip the teardown, where gloo's threads can abort
    sys.exit(code)


def die(msg, code=2):
    print(f"error: {msg}", file=sys.stderr)
    shutdown(code)


def why(e):  # an exception, in a few words
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:100]}"


def args_sha256(model_args):  # saved with the weights: catches model_args edited later
    return hashlib.sha256(json.dumps(model_args, sort_keys=True).encode()).hexdigest()


def parse_value(key, text):
    kind = type(defaults[key])
    if kind is bool and text.lower() not in ('true', 'false', '1', '0'):
        die(f"--{key} expects True or False, got {text!r}")
    try:
        value = text.lower() in ('true', '1') if kind is bool else kind(text)
    except ValueError:
        die(f"--{key} expects {'a number' if kind is float else 'an integer'}, got {text!r}")
    if key in CHOICES and value not in CHOICES[key]:
        die(f"--{key}={text} is not one of {', '.join(repr(c) for c in CHOICES[key])}")
    return value


def check(settings):  # flags' values, and a checkpoint's settings' types
    for k, v in settings.items():
        kind, low = type(defaults[k]), '> 0' if k in POSITIVE.split() else '>= 0'
        if (not isinstance(v, (int, float) if kind is float else kind) or (k in CHOICES and v not in CHOICES[k])
                or (type(v) is bool) != (kind is bool)):  # True is an int to Python, not a count
            die(f"{ckpt_path} is corrupt: its {k}={v!r} is not " + (
                f"one of {', '.join(map(repr, CHOICES[k]))}" if k in CHOICES else
                {int: 'an integer', float: 'a number', bool: 'True or False', str: 'a string'}[kind])
                + "; resume from an intact copy, or train in another --out_dir")
        if kind in (int, float) and not (0 <= v < BELOW.get(k, math.inf) and (v > 0 or low == '>= 0')):
            die(f"--{k} must be {low}{f' and < {BELOW[k]:,}' if k in BELOW else ''} and finite, got {v}"
                + ('' if k in given else " (the checkpoint's value: give the flag)"))
    for k, what in PER_RANK.items():
        if settings[k] * settings['batch_size'] > MAX_SEQUENCES:
            die(f"--{k}={settings[k]:,} x --batch_size={settings['batch_size']} is "
                f"{settings[k] * settings['batch_size']:,} sequences per rank for {what}, a run that would not finish;"
                f" at most {MAX_SEQUENCES:,}: lower --{k}" + ('' if k in given else " (the checkpoint's value)"))


# ---- flags, the out_dir's lock, a checkpoint's settings

if {'-h', '--help'} & set(sys.argv[1:]):
    print(__doc__ + '\nflags and their defaults:\n' + '\n'.join(f"  --{k}={v}" for k, v in defaults.items()))
    sys.exit(0)
given = {}  # the command line's flags
for arg in sys.argv[1:]:
    key, eq, text = arg.removeprefix('--').partition('=')
    if not arg.startswith('--') or not eq:
        die(f"arguments look like --key=value, got {arg!r}")
    if key not in defaults:
        die(f"unknown flag --{key}; valid flags: {', '.join('--' + k for k in defaults)}; see --help")
    given[key] = parse_value(key, text)
settings = defaults | PRESETS.get(given.get('preset', ''), {}) | given
out_dir, ckpt_path = settings['out_dir'], os.path.join(settings['out_dir'], 'ckpt.pt')
if not out_dir.strip():
    die("--out_dir is empty; name a folder")
check(settings)

# a run owns its out_dir: the folder is flocked (not on Windows) until the process ends; train.lock says by whom
trains = not (settings['eval_only'] or settings['sample'])
phase = 'before training' if trains else 'read only'
if trains and master:
    try:
        os.makedirs(out_dir, exist_ok=True)
        with suppress(ImportError):
            import fcntl
            lock = os.open(out_dir, os.O_RDONLY)  # the folder: a file inside could be deleted
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise
            except OSError:  # NFS: flock is emulated by fcntl locks, which need a file open for writing
                lock = os.open(os.path.join(out_dir, 'train.lock'), os.O_WRONLY | os.O_CREAT)
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    raise
                except OSError as e:
                    die(f"cannot lock --out_dir={out_dir} ({e.strerror or e}): its filesystem offers no file locks "
                        "(NFS without its lock service?); train in a local folder")
        with open(os.path.join(out_dir, 'train.lock'), 'w') as f:
            print(f"pid {os.getpid()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}", file=f)
        if settings['init_from'] == 'scratch' and os.path.exists(ckpt_path):
            die(f"{out_dir}/ holds a run; continue it with --init_from=resume, or train in another --out_dir")
        log_path = os.path.join(out_dir, 'metrics.jsonl')
        if os.path.lexists(log_path) and not os.path.isfile(log_path):  # a folder, or a link to nothing
            die(f"{log_path} is not a file; move it out of the way, or train in another --out_dir")
        if settings['init_from'] == 'scratch' and os.path.isfile(log_path) and os.path.getsize(log_path):
            kept = next(f"{log_path}.{i}" for i in range(1, 10 ** 6) if not os.path.exists(f"{log_path}.{i}"))
            os.replace(log_path, kept)  # an earlier run's records, its checkpoint gone
            print(f"note: {log_path} held an earlier run's records; kept as {kept}")
        with suppress(OSError):
            os.remove(ckpt_path + '.tmp')  # a save cut short
    except BlockingIOError:
        who = ''
        with suppress(OSError):
            who = open(os.path.join(out_dir, 'train.lock')).read().strip()
        die(f"{out_dir}/ is in use by a running train.py ({who or 'its pid unknown'}); wait for it, or train in "
            "another --out_dir")
    except FileExistsError:  # os.makedirs: a file, or a link to nothing, in the way
        to = f" but a link to {os.readlink(out_dir)}, which does not exist" if os.path.islink(out_dir) else ''
        die(f"--out_dir={out_dir} is not a folder{to}; choose another --out_dir")
    except OSError as e:
        die(f"cannot write to --out_dir={out_dir} ({e.strerror or e}); choose a writable folder")

# resume, eval, sample: settings no flag gives come from the checkpoint (LOCAL_KEYS: this command's)
checkpoint = None
if settings['init_from'] == 'resume' or not trains:
    if not os.path.exists(ckpt_path):
        die(f"no checkpoint at {ckpt_path}; train one first, or point --out_dir at a run")
    try:
        checkpoint = torch.load(ckpt_path, map_location='cpu', weights_only=True)
        ckpt_args, saved_iter = dict(checkpoint['model_args']), checkpoint['iter_num']
        taken = {k: v for k, v in dict(checkpoint['config']).items() if k in defaults and k not in LOCAL_KEYS}
        taken |= {k: v for k, v in ckpt_args.items() if k in MODEL_KEYS}
    except Exception as e:
        die(f"{ckpt_path} cannot be read ({why(e)}); it is corrupt or not from train.py")
    clash = [f"--{k}={given[k]!r} here but {ckpt_args[k]!r} in the checkpoint" for k in MODEL_KEYS
             if k in given and k in ckpt_args and ckpt_args[k] != given[k]]
    if trains and 'seed' in given and given['seed'] != taken.get('seed', given['seed']):  # (its RNG state continues)
        clash.append(f"--seed={given['seed']} here but the run started with seed {taken['seed']}")
    if clash:
        die(f"{ckpt_path} holds a different run: {'; '.join(clash)}; drop those flags, or train in another --out_dir")
    settings |= {k: v for k, v in taken.items() if k not in given}
    check(settings)
    # the checkpoint's own fields: counts are ints >= 0 (world_size >= 1), numbers finite, >= 0
    counts, rngs = {k: checkpoint.get(k) for k in ('iter_num', 'tokens', 'world_size')}, checkpoint.get('rng')
    bad = [f"{k}={v!r}" for k, v in counts.items() if type(v) is not int or v < (k == 'world_size')]
    bad += [f"{k}={checkpoint.get(k)!r}" for k in ('train_time', 'best_val_loss')
            if type(checkpoint.get(k)) not in (int, float) or not 0 <= checkpoint[k] < math.inf]
    ran_to = dict(checkpoint['config']).get('max_iters')
    if type(ran_to) is not int:  # (True is not a count)
        bad.append(f"max_iters={ran_to!r}")
    elif not bad and counts['iter_num'] > ran_to:
        bad.append(f"iter_num={counts['iter_num']} is past its max_iters={ran_to}")
    if not isinstance(checkpoint.get('fingerprint'), (str, type(None))):
        bad.append(f"fingerprint={checkpoint['fingerprint']!r}")
    if checkpoint.get('args_sha256') not in (None, args_sha256(ckpt_args)):  # (older checkpoints: none)
        bad.append(f"its model_args (attn={ckpt_args.get('attn')!r}, qk_steps={ckpt_args.get('qk_steps')!r}) are "
                   "not those its weights were saved with")
    if bad or not (isinstance(rngs, list) and len(rngs) == counts['world_size']
                   and all(isinstance(r, dict) and {'batches', 'torch'} <= set(r) for r in rngs)):
        die(f"{ckpt_path} is corrupt: " + (', '.join(bad) or "it lacks a random state per rank")
            + "; resume from an intact copy, or train in another --out_dir")
    if trains and settings['max_iters'] < saved_iter:
        die(f"--max_iters={settings['max_iters']} is below the checkpoint's iteration {saved_iter}; give a larger "
            "--max_iters to train longer, or --eval_only=True to evaluate it")
config = settings  # saved in the checkpoint
globals().update(settings)

# ---- DDP and the device

ddp = 'RANK' in os.environ  # launched by torchrun?
launcher = os.getppid()  # under torchrun, its agent: the ranks stop together if it is killed
if device == 'auto':
    device = 'cuda' if torch.cuda.is_available() else 'mps' if torch.backends.mps.is_available() else 'cpu'
device_type = device.split(':')[0]
if not {'cpu': True, 'cuda': torch.cuda.is_available(), 'mps': torch.backends.mps.is_available()}.get(device_type):
    die(f"--device={device} is unknown, or {device_type.upper()} is not available here; use auto, cpu, cuda[:N] or mps")
if ddp:
    rank, local_rank, world_size = (int(os.environ[k]) for k in ('RANK', 'LOCAL_RANK', 'WORLD_SIZE'))
    if device_type == 'cuda':
        device = f'cuda:{local_rank}'
        torch.cuda.set_device(device)
    dist.init_process_group(backend='nccl' if device_type == 'cuda' else 'gloo')
else:
    rank, local_rank, world_size = 0, 0, 1
print0 = print if master else (lambda *a, **k: None)
dtype = autocast_dtype(device) if dtype == 'auto' else dtype
autocast = nullcontext() if dtype == 'float32' else torch.autocast(device_type, getattr(torch, dtype))
torch.manual_seed(seed + rank)  # each rank its own dropout
torch.set_float32_matmul_precision('high')  # float32 matmuls on TF32 tensor cores (Ampere on)
try:
    peak = peak_flops(device)  # for MFU
except ValueError as e:
    die(str(e))

# ---- data: data/<dataset>/{train,val[,test]}.bin, checked against its meta.json

try:
    meta, splits = prepare_data.load(data_dir, dataset, block_size)
except prepare_data.DataError as e:
    die(str(e))
if checkpoint is not None and ckpt_args['vocab_size'] != meta['vocab_size']:
    die(f"the checkpoint's vocabulary has {ckpt_args['vocab_size']} tokens, {data_dir}/{dataset}'s "
        f"{meta['vocab_size']}; name its dataset with --dataset")
trained_on = checkpoint and os.path.join(*(dict(checkpoint['config']).get(k, v) for k, v in (('data_dir', data_dir),
                                                                                              ('dataset', dataset))))
if checkpoint is not None and not sample and checkpoint.get('fingerprint') not in (None, meta['fingerprint']):
    if trained_on != os.path.join(data_dir, dataset):
        die(f"{ckpt_path} was trained on {trained_on} (corpus fingerprint {checkpoint['fingerprint'][:12]}), not on "
            f"{data_dir}/{dataset} ({meta['fingerprint'][:12]}); drop --dataset and --data_dir, or name its corpus")
    die(f"{ckpt_path} was trained on {data_dir}/{dataset} as it was then (corpus fingerprint "
        f"{checkpoint['fingerprint'][:12]}), and that folder now holds other text ({meta['fingerprint'][:12]}); "
        f"prepare the run's text again (prepare_data.py --force), or name its corpus with --dataset")
train_gen = torch.Generator().manual_seed(seed + rank)  # each rank its own batches
reads, val_tokens = eval_iters * batch_size * block_size, meta['tokens'].get('val', 0)
if master and trains and val_tokens and reads > 10 * val_tokens:  # legal, but hours an eval on a small split
    print(f"note: an estimate reads {reads:,} tokens a rank, {reads / val_tokens:.0f} times the val split's "
          f"{val_tokens:,}, so each eval is slow; --eval_iters={max(1, val_tokens // (batch_size * block_size))} "
          "reads about the split once")
if master and trains and max_iters > 0 and warmup_iters >= max_iters:
    print(f"note: --warmup_iters={warmup_iters:,} >= --max_iters={max_iters:,}: the learning rate stays in its warmup, "
          f"at most {learning_rate * max_iters / (warmup_iters + 1):.2g} of {learning_rate:g}")


def to_device(t):  # CUDA: from pinned memory, so the copy does not block the host
    return t.pin_memory().to(device, non_blocking=True) if device_type == 'cuda' else t.to(device)


def get_batch(split, gen, part=slice(None), n=None):  # n starts drawn (batch_size by default), part of them built
    # a new memmap every batch: a long-lived one leaks memory. All n starts are drawn: gen moves on as for the batch
    data = np.memmap(splits[split], dtype=np.uint16, mode='r')
    ix = torch.randint(len(data) - block_size - 1, (n or batch_size,), generator=gen)[part]
    at = ix.numpy()[:, None] + np.arange(block_size)  # (B, T) positions
    x, y = (torch.from_numpy(data[at + shift].astype(np.int64)) for shift in (0, 1))
    return to_device(x), to_device(y)


# ---- model, optimizer, resume

model_args = {k: config[k] for k in MODEL_KEYS} | dict(vocab_size=meta['vocab_size'])
tokens_per_iter = gradient_accumulation_steps * world_size * batch_size * block_size
best_val_loss, saved_val, train_time, tokens = 1e9, math.nan, 0.0, 0
try:
    model = GPT(GPTConfig(**model_args), verbose=master)
except ValueError as e:
    die(str(e))
unread = [f"--{k}" for k in given if k.startswith('qk_') and k not in qk_flags_read(model.config)]
if unread and master:  # e.g. --qk_dt for a map with no step size
    print(f"note: {', '.join(unread)} {'is' if len(unread) == 1 else 'are'} not read by --attn={model.config.attn}")
square = model.config.n_head * block_size ** 2 * 4  # bytes of one sequence's (nh, T, T) float32 attention a layer
sizes = {'the diagnostics': DIAG_SEQUENCES * square * bool(diag_interval),  # one layer at a time
         "a CPU step's backward": batch_size * model.config.n_layer * square * (device_type == 'cpu')}  # every layer's
big = [f"{gb / 2**30:,.0f} GB for {what}" for what, gb in sizes.items() if gb > 4 * 2**30]  # the OOM killer's size
if master and big:
    print(f"note: --block_size={block_size:,} makes attention matrices of {' and '.join(big)}; lower --block_size"
          " or --batch_size" + (", or set --diag_interval=0" if sizes['the diagnostics'] else ''))
if checkpoint is not None:
    try:
        model.load_state_dict(checkpoint['model'])
    except Exception as e:
        die(f"{ckpt_path} does not fit its model ({why(e)}); it is corrupt, or from another version of model.py")
model.to(device)
raw_model = model  # evaluation and sampling run it eager
compiled, failed = compile and trains, None
if compiled:
    print0("compiling the model...")
    try:
        model = torch.compile(model)  # lazy: its first call compiles
    except Exception as e:  # e.g. a Python version Dynamo does not support yet
        failed = e
if ddp:  # around the compiled model, as PyTorch's docs say: the graph splits at DDP's gradient buckets
    model = DDP(model, device_ids=[local_rank] if device_type == 'cuda' else None)
if compiled:
    if failed is None:
        try:  # a step now, without gradient sync: a rank that fails here leaves no other rank waiting
            with model.no_sync() if ddp else nullcontext(), autocast:
                model(*get_batch('train', torch.Generator().manual_seed(0)))[1].backward()
        except Exception as e:
            failed = e
        raw_model.zero_grad(set_to_none=True)
    if failed is not None:
        failed = getattr(failed, 'inner_exception', failed)  # inside Dynamo's BackendCompilerFailed
        print(f"warning: torch.compile failed{f' on rank {rank}' if ddp else ''} ({why(failed)}); running eager")
    ok = torch.tensor(float(failed is None), device=device)
    if ddp:  # one rank failed: all run eager
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if not ok.item():
        compiled = False
        if ddp:
            model.module = raw_model  # DDP calls the eager model
        else:
            model = raw_model
scaler = torch.amp.GradScaler(device_type, enabled=dtype == 'float16')
optimizer = raw_model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2), device_type)
if checkpoint is not None and trains:
    try:
        optimizer.load_state_dict(checkpoint['optimizer'])
        iter_num, best_val_loss = int(checkpoint['iter_num']), float(checkpoint['best_val_loss'])
        saved_val = float(checkpoint.get('val_loss', best_val_loss))
        train_time, tokens = float(checkpoint['train_time']), int(checkpoint['tokens'])
        if world_size == checkpoint['world_size']:  # exact resume: the data's position, dropout's RNG
            rng = checkpoint['rng'][rank]
            train_gen.set_state(rng['batches'])
            torch.set_rng_state(rng['torch'])
            if device_type == 'cuda' and rng.get('cuda') is not None:
                torch.cuda.set_rng_state(rng['cuda'], device)
        else:
            print0(f"note: the checkpoint was trained by {checkpoint['world_size']} process(es), this run has "
                   f"{world_size}: the batches continue in a new order (seed {seed}), not as one run would")
    except Exception as e:
        die(f"{ckpt_path}'s training state does not fit this run ({why(e)}); resume with the settings it had")
    best_only = dict(checkpoint['config']).get('always_save_checkpoint') is False
    print0(f"resuming from {ckpt_path} at iteration {iter_num} ({train_time:.0f} s trained)" + (
        "; a best-only checkpoint: iterations the earlier run trained past it are trained again" if best_only else ''))
    if checkpoint.get('args_sha256') is None:
        print0("note: an older checkpoint, saved without a hash of its model_args: they are not verified")
checkpoint = None  # free memory


def perplexity(loss):  # inf for a diverged run, not an OverflowError
    return math.exp(loss) if loss < 700 else math.inf


@torch.no_grad()
def estimate_loss():
    """Mean loss over eval_iters batches from one seed, the same at every eval and in every run; under DDP rank r
    takes the r-th of world_size slices of its sequences (maybe none), and one all-reduce per split sums them."""
    out, n = {}, eval_iters * batch_size
    lo, hi = rank * n // world_size, (rank + 1) * n // world_size  # this rank's sequences of the set
    raw_model.eval()
    for split in ('train', 'val'):
        gen, losses = torch.Generator().manual_seed(10_000), torch.zeros(eval_iters, device=device)
        for k in range(eval_iters):  # batch k: sequences k B .. k B + B - 1, this rank's a..b of them
            a, b = (min(max(i - k * batch_size, 0), batch_size) for i in (lo, hi))
            x, y = get_batch(split, gen, slice(a, b))
            if b > a:
                with autocast:
                    losses[k] = raw_model(x, y)[1].float() * ((b - a) / batch_size)  # its share of batch k's mean
        if ddp:
            dist.all_reduce(losses)  # (eval_iters,): each batch's mean loss, its ranks' shares summed
        out[split] = losses.cpu().mean().item()  # on the host, as one process takes it
    raw_model.train()
    return out


@torch.no_grad()
def full_eval():
    """Our metric: the loss on every token of val and test (prepare_data.windows), perplexity, bits per byte."""
    out = {}
    model.eval()
    for split in [s for s in ('val', 'test') if s in splits]:
        nats, n = torch.zeros((), dtype=torch.float64, device=device), 0  # the loss summed over n tokens
        for x, y in prepare_data.windows(splits[split], block_size, rank, world_size, 8192 // block_size + 1):
            with autocast:
                loss = raw_model(to_device(torch.from_numpy(x)), to_device(torch.from_numpy(y)))[1]
            nats, n = nats + loss.double() * y.size, n + y.size  # n on the host: no copy per batch
        nats = torch.stack((nats, torch.tensor(float(n), dtype=torch.float64, device=device)))
        if ddp:
            dist.all_reduce(nats)
        loss, n_bytes = (nats[0] / nats[1]).item(), meta['bytes'].get(split)
        bpb = nats[0].item() / (math.log(2) * n_bytes) if n_bytes else None
        out |= {f'{split}_loss': loss, f'{split}_ppl': perplexity(loss), f'{split}_bpb': bpb}
        print0(f"full {split} split: loss {loss:.4f}, ppl {perplexity(loss):.3f}"
               + (f", {bpb:.4f} bits per byte" if bpb else '') + f" ({meta['tokens'][split]:,} tokens)")
    return out


def write_sample(prompt):
    """sample_tokens tokens after prompt ('': a document's start): temperature 0.8, top 200."""
    tok = prepare_data.get_tokenizer(meta['tokenizer'])
    ids = tok['encode']([prompt])[0].tolist() if prompt else [tok['eot']]
    torch.manual_seed(seed)
    idx = torch.tensor([ids[-block_size:]], dtype=torch.long, device=device)
    raw_model.eval()
    with autocast:
        out = raw_model.generate(idx, sample_tokens, temperature=0.8, top_k=200)[0, idx.size(1):].tolist()
    text = tok['decode'](ids if prompt else [])
    print0(f"sample (seed {seed}, {sample_tokens} tokens after {text[:40]!r}):\n{text}{tok['decode'](out)}")


print0(f"{dataset}: {meta['vocab_size']} token vocabulary ({meta['tokenizer']}); {tokens_per_iter:,} tokens per "
       f"iteration; device {device}, {dtype}, {'compiled' if compiled else 'eager'}, {world_size} process(es)")
if sample:
    try:
        write_sample(sample)
    except prepare_data.DataError as e:
        die(f"cannot sample: {e}")
    shutdown(0)
if eval_only:
    ended, best = max_iters, not always_save_checkpoint  # where the run ended: its log's final record
    with suppress(OSError, ValueError, TypeError, KeyError, IndexError, AttributeError):
        end = [r for r in map(json.loads, open(os.path.join(out_dir, 'metrics.jsonl'))) if r['event'] == 'final'][-1]
        if end['iter'] >= saved_iter:  # (not a record older than the checkpoint)
            ended, best = end['iter'], end['model_iter'] == saved_iter
    print0(f"{ckpt_path} holds the model of iteration {saved_iter} of {ended}" + (
        ", the run's best estimate (--always_save_checkpoint=False)" if best and saved_iter != ended else ''))
    full_eval()
    shutdown(0)


def save_checkpoint():
    global saving, saved_iter
    rngs = [dict(batches=batch_state, torch=torch.get_rng_state(), cuda=torch.cuda.get_rng_state(device)
                 if device_type == 'cuda' else None)] * world_size  # each rank's, for an exact resume
    if ddp:
        dist.all_gather_object(rngs, rngs[rank])
    if not master:
        saved_iter = iter_num  # rank 0 saves it
        return
    ckpt = dict(model=raw_model.state_dict(), optimizer=optimizer.state_dict(), model_args=model_args, rng=rngs,
                iter_num=iter_num, best_val_loss=best_val_loss, train_time=train_time, tokens=tokens, config=config,
                world_size=world_size, fingerprint=meta['fingerprint'], val_loss=saved_val,
                args_sha256=args_sha256(model_args))
    saving, mask = True, getattr(signal, 'pthread_sigmask', lambda *a: None)  # a Ctrl-C now waits for the save
    try:
        torch.save(ckpt, ckpt_path + '.tmp')
        mask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})  # no signal between the rename and saved_iter
        os.replace(ckpt_path + '.tmp', ckpt_path)  # atomic: a crash mid-save keeps the previous checkpoint
        saved_iter = iter_num
        mask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
    except (OSError, RuntimeError) as e:  # a full disk (torch.save: RuntimeError)
        with suppress(OSError):
            os.remove(ckpt_path + '.tmp')
        disk_full(ckpt_path, e)
    saving = False
    if interrupted:  # a signal came during the save: it is complete now
        on_ctrl_c(interrupted, None)


def log(record):  # a whole line appended; on a full disk, cut back, and the run stops
    if master:
        line = (json.dumps(record) + '\n').encode()
        with open(os.path.join(out_dir, 'metrics.jsonl'), 'ab', buffering=0) as f:
            size, written = f.seek(0, os.SEEK_END), 0
            try:
                while written < len(line):
                    written += f.write(line[written:]) or 0
            except OSError as e:
                f.truncate(size)
                disk_full(f.name, e)


def disk_full(what, e):
    die(f"cannot write {what} ({why(e)}); nothing else was touched, free some space: {resume_hint()}", code=1)


def check_losses():  # losses since the last check; stop before any save at a non-finite one
    global pending
    losses = torch.stack(pending).float()
    bad = (~torch.isfinite(losses)).any().float()
    if ddp:  # all ranks stop together, also when torchrun is gone
        flags = torch.stack([bad, torch.tensor(float(os.getppid() != launcher), device=bad.device)])
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        bad, gone = flags.tolist()
        if gone and not master:  # SIGKILL to torchrun leaves its ranks running, their parent changed
            shutdown(1)  # (one line for all ranks: rank 0's)
        if gone:
            die(f"torchrun, the launcher, is gone (killed?); all ranks stop at iteration {iter_num}; "
                f"{resume_hint()}", code=1)
    losses, pending = losses.cpu().tolist(), []
    if bad:
        i = next((i for i, v in enumerate(losses) if not math.isfinite(v)), len(losses) - 1)
        not_finite(iter_num - len(losses) + 1 + i, losses[i] if not math.isfinite(losses[i]) else 'another rank')
    return losses[-1]


def not_finite(at, value):
    log(dict(event='diverged', iter=at))
    die(f"the loss is not finite at iteration {at} (here: {value}); stopped before saving. Lower --learning_rate "
        f"or use --dtype=float32; {resume_hint()}", code=3)


def get_lr(it):
    decay_iters = lr_decay_iters or max_iters
    if it < warmup_iters:  # 1) linear warmup
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > decay_iters:   # 2) after decay, min learning rate
        return min_lr
    ratio = (it - warmup_iters) / max(1, decay_iters - warmup_iters)  # 3) cosine decay down to min learning rate
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)


# ---- the loop (metrics.jsonl is only appended to)

if peak is None and device_type == 'cuda':
    print0(f"note: no MFU: {torch.cuda.get_device_name(device)!r} is not in model.GPU_PEAK_FLOPS; set GPU_PEAK_TFLOPS "
           "to its dense bf16 TFLOP/s")
try:  # only MFU needs a FLOP price
    flops_per_iter = flops_per_token(raw_model.config, block_size) * tokens_per_iter / world_size if peak else None
except ValueError as e:
    die(str(e))
log(dict(event='start', iter=iter_num, tokens=tokens, config=config, params=raw_model.get_num_params(),
         qk_params=sum(p.numel() for p in raw_model.qk_parameters()), world_size=world_size, compiled=compiled,
         fingerprint=meta['fingerprint']))
phase, start_iter, pending, interval_iters, out_of_time = 'train', iter_num, [], 0, False
t_start = t_log = time.time()
batch_state = train_gen.get_state()  # what a checkpoint keeps: the generator before the next batch
X, Y = get_batch('train', train_gen)
while True:
    lr = get_lr(iter_num)
    for group in optimizer.param_groups:
        group['lr'] = lr
    if time_budget > 0 and iter_num % log_interval == 0:  # rank 0's clock decides for all
        flag = torch.tensor(float(train_time >= time_budget), device=device)
        if ddp:
            dist.broadcast(flag, 0)
        out_of_time = bool(flag.item())
    last = iter_num >= max_iters or out_of_time
    if (iter_num % eval_interval == 0 and (iter_num > start_iter or init_from == 'scratch')) or last:
        if pending:
            check_losses()  # a model gone non-finite is never saved
        losses = estimate_loss()
        if ddp:  # rank 0's estimates decide for all: ranks may differ in a bit
            est = torch.tensor([losses['train'], losses['val']], device=device)
            dist.broadcast(est, 0)
            losses = dict(train=est[0].item(), val=est[1].item())
        if not all(math.isfinite(v) for v in losses.values()):  # the last update broke it
            not_finite(iter_num, losses['val'])
        # the diagnostics' batch: 8,192 val tokens whatever the batch or world size (the nonlinear fit's floor)
        diag = master and diag_interval and (iter_num // eval_interval % diag_interval == 0 or last)
        x = get_batch('val', torch.Generator().manual_seed(10_000), n=-(-8192 // block_size))[0] if diag else None
        qk, att = (qk_diagnostics(raw_model, x), attention_diagnostics(raw_model, x)) if diag else ([], [])
        nonlinear = median_layer(qk, 'nonlinear') if qk else None
        unfit = [str(i) for i, s in enumerate(qk) if s['nonlinear'] is None]  # rope: layer 0's q, k are the token's
        print0(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}, val ppl "
               f"{perplexity(losses['val']):.2f} ({eval_iters}-batch estimates)" + (
                   " | q/k map: nonlinear {}, dq {:.1%}, dk {:.1%} (median layer)".format(
                       'too few distinct tokens' if nonlinear is None else f"{nonlinear:.2%}" + (
                           f" (layer {', '.join(unfit)}: too few distinct (q, k))" if unfit else ''),
                       *(median_layer(qk, k) for k in ('dq', 'dk'))) if qk else '') + (
                   " | attention: entropy {:.2f}, sink {:.2f}, gap {:.2f} (median layer)".format(
                       *(median_layer(att, k) for k in ('entropy', 'sink', 'gap'))) if att else ''))
        log(dict(event='eval', iter=iter_num, train_loss=losses['train'], val_loss=losses['val'],
                 val_ppl=perplexity(losses['val']), tokens=tokens, time=train_time, qk=qk, attn=att))
        if (losses['val'] < best_val_loss or always_save_checkpoint) and (iter_num > start_iter or last):
            best_val_loss, saved_val = min(best_val_loss, losses['val']), losses['val']
            save_checkpoint()
        t_log, interval_iters = time.time(), 0  # evaluation time is not training time
    if last:
        break
    # forward, backward, update; gradient accumulation simulates a larger batch
    t0 = time.time()
    for micro_step in range(gradient_accumulation_steps):
        if ddp:  # sync gradients at the last micro-step only (set before the forward pass)
            model.require_backward_grad_sync = micro_step == gradient_accumulation_steps - 1
        with autocast:
            logits, loss = model(X, Y)
            loss = loss / gradient_accumulation_steps
        batch_state = train_gen.get_state()
        X, Y = get_batch('train', train_gen)  # the next batch, fetched while the GPU works
        scaler.scale(loss).backward()
    if grad_clip > 0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    pending.append(loss.detach() * gradient_accumulation_steps)  # on the device: no sync
    tokens += tokens_per_iter
    interval_iters += 1
    iter_num += 1
    if iter_num % log_interval == 0 or iter_num == start_iter + 1:
        lossf = check_losses()  # syncs with the device: at log steps only
        elapsed = (time.time() - t_log) / interval_iters  # seconds per iteration, after the sync
        t_log, interval_iters = time.time(), 0
        left = (max_iters - iter_num) * (time.time() - t_start) / (iter_num - start_iter)  # evals included
        left = min(left, time_budget - train_time) if time_budget > 0 else left
        mfu = flops_per_iter / elapsed / peak if peak else None
        eta = f"{max(left, 0) / 60:.1f} min" if iter_num > start_iter + 1 else '-'  # one step and step 0's eval: hours
        print0(f"iter {iter_num}/{max_iters} | loss {lossf:.4f} | lr {lr:.2e} | {elapsed * 1000:.0f} ms/iter | "
               f"{tokens_per_iter / elapsed:,.0f} tok/s" + (f" | mfu {mfu:.1%}" if mfu else '')
               + f" | eta {eta}")
        log(dict(event='train', iter=iter_num, loss=lossf, lr=lr, ms=elapsed * 1000, tok_s=tokens_per_iter / elapsed,
                 mfu=mfu, tokens=tokens, time=train_time + time.time() - t0))
    train_time += time.time() - t0  # after the log step's sync: a GPU's queue counts

# ---- the end: full-split evaluation, a sample

phase = 'final'
model_iter, model_tokens = iter_num, tokens  # the model the final evaluation scores: the last weights, or
if saved_iter is not None and saved_iter != iter_num:  # the best-only checkpoint's
    if ddp:
        dist.barrier()  # rank 0 has written it
    best = torch.load(ckpt_path, map_location=device, weights_only=True)
    raw_model.load_state_dict(best['model'])
    model_iter, model_tokens = saved_iter, best['tokens']
log(dict(event='final', iter=iter_num, tokens=tokens, model_iter=model_iter, model_tokens=model_tokens,
         time=train_time) | full_eval())
if master and sample_tokens:
    try:
        write_sample('')
    except Exception as e:  # a finished run never fails over its sample
        print(f"note: no sample ({why(e)})")
print0(f"done: {iter_num} iterations, {(time.time() - t_start) / 60:.1f} min; checkpoint {ckpt_path}" + (
    '' if saved_iter == iter_num else f" at iteration {saved_iter} (val loss {saved_val:.4f}, the best estimate): "
    "the model the final evaluation scored"))
shutdown(0)
