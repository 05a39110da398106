"""
Train a GPT with any attention variant: one flat loop, nanoGPT-shaped. Every setting below is a flag.

  python train.py --attn=coupled                         # laptop CPU: tiny model on data/pydocs
  python train.py --preset=60m --dataset=wikitext103 --attn=coupled --compile=True  # one GPU (bench.py --plan)
  torchrun --standalone --nproc_per_node=8 train.py ...  # DDP (nccl on CUDA, gloo on CPU)
  python train.py --init_from=resume --out_dir=out       # continue a run; --eval_only=True, --sample="def " too

Flags (--key=value) > a --preset > the values below; resume, eval and sample take every setting no flag gives from
the checkpoint. A run owns its out_dir while it runs (train.lock).
"""
import json
import math
import os
import shlex
import signal
import sys
import time
from contextlib import nullcontext, suppress
from dataclasses import fields

# Ctrl-C stops with one line and exit code 130, from the first line on (installed before the slow imports, whatever
# was inherited), raising nothing an `except:` could swallow; a checkpoint being written is finished first.
# (ckpt_path and out_dir are set once the flags are read)
phase, iter_num, saved_iter, saving, interrupted, master = 'before training', 0, None, False, False, True


def on_ctrl_c(signum, frame):
    global interrupted
    if saving and not interrupted:  # a second Ctrl-C stops at once
        interrupted = True
        return say("Ctrl-C: stopping once this checkpoint is written (Ctrl-C again: stop now)")
    where = {'train': f"at iteration {iter_num}", 'final': "during the final evaluation"}.get(phase, phase)
    stop(130, "interrupted; nothing was written" if phase == 'read only' else f"interrupted {where}; {resume_hint()}")


def resume_hint():
    return "no checkpoint yet" if saved_iter is None else (
        f"the last checkpoint is at iteration {saved_iter}: {shlex.quote(ckpt_path)}. Continue with: python train.py "
        f"--init_from=resume --out_dir={shlex.quote(out_dir)}")


def say(line):  # the handler may interrupt a print(), which holds stdout's buffer: so os.write
    if master:
        with suppress(RuntimeError):
            sys.stdout.flush()
        os.write(sys.stdout.fileno(), f"\n{line}\n".encode())


def stop(code, line):
    say(line)
    os._exit(code)  # nothing is half-written: saves are atomic, the log is appended a whole line at a time


signal.signal(signal.SIGINT, on_ctrl_c)

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.distributed import destroy_process_group, init_process_group  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import prepare_data  # noqa: E402
from model import (POS, PRESETS, GPT, GPTConfig, attn_names, flops_per_token, median_layer, peak_flops,  # noqa: E402
                   qk_diagnostics)

# -----------------------------------------------------------------------------
_before = set(globals())  # the settings are what this block adds
# I/O
out_dir = 'out'
eval_interval = 250
log_interval = 10
eval_iters = 40         # batches per periodic validation estimate (the same batches in every run)
eval_only = False       # evaluate the checkpoint in out_dir on the full val and test splits, and exit
always_save_checkpoint = True  # save at every eval; False: only when val loss improves
init_from = 'scratch'   # 'scratch' (refuses an out_dir that holds a run) or 'resume' (from out_dir/ckpt.pt)
time_budget = 0.0       # seconds of training after which the run stops (0: none); counts across resumes
sample = ''             # a prompt: print a continuation from out_dir's checkpoint and exit (no training)
sample_tokens = 200     # tokens sampled (temperature 0.8, top 200) by --sample and at the end of a run; 0: none
# data
dataset = 'pydocs'      # data/<dataset>/ made by prepare_data.py
data_dir = 'data'
gradient_accumulation_steps = 1  # micro-steps per iteration, per rank
batch_size = 16         # sequences per micro-step, per rank
block_size = 128
# model
preset = ''             # '--preset=60m' etc. sets n_layer, n_head, n_embd (model.PRESETS); flags override it
n_layer = 4
n_head = 4
n_embd = 128
dropout = 0.0
bias = False
attn = 'standard'       # one of model.attn_names(); 'coupled' is the paper's method
# AdamW, linear warmup then cosine decay to min_lr
learning_rate = 2e-3
max_iters = 2000
weight_decay = 0.1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0         # 0 disables clipping
decay_lr = True
warmup_iters = 100
lr_decay_iters = 0      # 0: max_iters
min_lr = 2e-4
# system
device = 'auto'         # auto (cuda, mps, cpu), or e.g. cpu, cuda, cuda:1, mps
dtype = 'auto'          # auto: bfloat16 on CUDA if supported, else float16; float32 off CUDA. Or name one
compile = False         # torch.compile the model; falls back to eager with a warning if compiling fails
seed = 1337
# -----------------------------------------------------------------------------
defaults = {k: v for k, v in globals().items() if k not in _before and k != '_before'}
# every other model.GPTConfig field is a flag too, with its default there (qk_steps, qk_hidden, qk_scale, qk_dt,
# qk_decay, pos: see --help); a field added there needs no edit here
MODEL_KEYS = [f.name for f in fields(GPTConfig) if f.name != 'vocab_size']
defaults |= {f.name: f.default for f in fields(GPTConfig) if f.name in MODEL_KEYS and f.name not in defaults}
CHOICES = dict(attn=attn_names(), pos=POS, preset=('',) + tuple(PRESETS), init_from=('scratch', 'resume'),
               dtype=('auto', 'float32', 'bfloat16', 'float16'))
POSITIVE = 'batch_size block_size gradient_accumulation_steps eval_interval eval_iters log_interval learning_rate'
BELOW = dict(beta1=1, beta2=1, seed=2 ** 63 - 1024)  # every number is finite, >= 0 (POSITIVE: > 0), < these
LOCAL_KEYS = ('out_dir', 'init_from', 'eval_only', 'device', 'dtype', 'compile', 'sample', 'sample_tokens', 'preset')


def shutdown(code):  # every exit goes through here
    if torch.distributed.is_initialized():
        destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # skip the teardown, where gloo's threads can abort the process (pytorch/pytorch#179291)
    sys.exit(code)


def die(msg, code=2):
    print(f"error: {msg}", file=sys.stderr)
    shutdown(code)


def why(e):  # an exception in a few words, for a one-line message
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:100]}"


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


def check(settings):  # the values of flags, and the types of a checkpoint's settings
    for k, v in settings.items():
        kind, low = type(defaults[k]), '> 0' if k in POSITIVE.split() else '>= 0'
        if not isinstance(v, (int, float) if kind is float else kind):
            die(f"{ckpt_path} is corrupt: its {k}={v!r} is not a {kind.__name__}")
        if kind in (int, float) and not (0 <= v < BELOW.get(k, math.inf) and (v > 0 or low == '>= 0')):
            die(f"--{k} must be {low}{f' and < {BELOW[k]}' if k in BELOW else ''} and finite, got {v}")


# -----------------------------------------------------------------------------
# flags; the out_dir's lock; settings from a checkpoint

if {'-h', '--help'} & set(sys.argv[1:]):
    print(__doc__ + '\nflags and their defaults:\n' + '\n'.join(f"  --{k}={v}" for k, v in defaults.items()))
    sys.exit(0)
given = {}  # the flags set on the command line
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
    die("--out_dir is empty; name a folder, e.g. --out_dir=out")
check(settings)

# a run owns its out_dir: an exclusive lock on out_dir/train.lock, released by the OS however the process ends
# (fcntl: Linux, macOS; not Windows). Then a scratch run refuses a folder with a run in it, and starts the log.
trains = not (settings['eval_only'] or settings['sample'])
if trains and int(os.environ.get('RANK', 0)) == 0:
    try:
        os.makedirs(out_dir, exist_ok=True)
        lock = open(os.path.join(out_dir, 'train.lock'), 'a+')  # held open (a global) until the process ends
        with suppress(ImportError):
            import fcntl
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        lock.truncate(0)
        lock.write(f"pid {os.getpid()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        lock.flush()
        if settings['init_from'] == 'scratch' and os.path.exists(ckpt_path):
            die(f"{out_dir}/ holds a run (ckpt.pt); continue it with --init_from=resume, or train in another "
                f"--out_dir (delete {out_dir}/ to start over)")
        open(os.path.join(out_dir, 'metrics.jsonl'), 'w' if settings['init_from'] == 'scratch' else 'a').close()
        if os.path.exists(ckpt_path + '.tmp'):
            os.remove(ckpt_path + '.tmp')  # a save cut short by kill -9: the checkpoint before it is intact
    except BlockingIOError:
        die(f"{out_dir}/ is in use by a running train.py ({lock.seek(0) or lock.read().strip()}); wait for it to "
            "finish, or train in another --out_dir")
    except OSError as e:
        die(f"cannot write to --out_dir={out_dir} ({e.strerror or e}); choose a writable folder")

# resume, eval, sample: every setting no flag gives comes from the checkpoint, except this command's own
checkpoint = None
if settings['init_from'] == 'resume' or not trains:
    if not os.path.exists(ckpt_path):
        die(f"no checkpoint at {ckpt_path}; train one with --init_from=scratch first, or point --out_dir at a run")
    try:
        checkpoint = torch.load(ckpt_path, map_location='cpu', weights_only=True)
        ckpt_args = dict(checkpoint['model_args'])
        taken = {k: v for k, v in dict(checkpoint['config']).items() if k in defaults and k not in LOCAL_KEYS}
        taken |= {k: v for k, v in ckpt_args.items() if k in MODEL_KEYS}
        if not (isinstance(checkpoint['iter_num'], int) and isinstance(checkpoint['best_val_loss'], (int, float))
                and checkpoint['model'] and checkpoint['optimizer']):
            raise TypeError('a field of the wrong type')
    except Exception as e:
        die(f"{ckpt_path} cannot be read ({why(e)}); it is corrupt or not from train.py")
    clash = [f"--{k}={given[k]!r} here but {ckpt_args[k]!r} in the checkpoint" for k in MODEL_KEYS
             if k in given and k in ckpt_args and ckpt_args[k] != given[k]]
    if clash:
        die(f"{ckpt_path} holds a different model: {'; '.join(clash)}; drop those flags to use the checkpoint's, "
            f"or train anew in another --out_dir")
    settings |= {k: v for k, v in taken.items() if k not in given}
    check(settings)
config = settings  # this run's settings, saved in the checkpoint
globals().update(settings)
phase = 'before training' if trains else 'read only'

# -----------------------------------------------------------------------------
# distributed and device setup

ddp = int(os.environ.get('RANK', -1)) != -1  # launched by torchrun?
if device == 'auto':
    device = 'cuda' if torch.cuda.is_available() else 'mps' if torch.backends.mps.is_available() else 'cpu'
device_type = device.split(':')[0]
if not {'cpu': True, 'cuda': torch.cuda.is_available(), 'mps': torch.backends.mps.is_available()}.get(device_type):
    die(f"--device={device} is unknown, or {device_type.upper()} is not available here (MPS: macOS on Apple silicon);"
        " use auto, cpu, cuda, cuda:N or mps")
if ddp:
    rank, local_rank, world_size = int(os.environ['RANK']), int(os.environ['LOCAL_RANK']), int(os.environ['WORLD_SIZE'])
    if device_type == 'cuda':
        device = f'cuda:{local_rank}'
        torch.cuda.set_device(device)
    init_process_group(backend='nccl' if device_type == 'cuda' else 'gloo')
else:
    rank, local_rank, world_size = 0, 0, 1
master = rank == 0  # logs and saves
print0 = print if master else (lambda *a, **k: None)
if dtype == 'auto':
    dtype = ('bfloat16' if torch.cuda.is_bf16_supported() else 'float16') if device_type == 'cuda' else 'float32'
ptdtype = {'float32': torch.float32, 'bfloat16': torch.bfloat16, 'float16': torch.float16}[dtype]
autocast = nullcontext() if dtype == 'float32' else torch.autocast(device_type=device_type, dtype=ptdtype)
torch.manual_seed(seed)
torch.backends.cuda.matmul.allow_tf32 = True
torch.backends.cudnn.allow_tf32 = True

# -----------------------------------------------------------------------------
# data: data/<dataset>/{train,val[,test]}.bin of uint16 tokens, checked in full against its meta.json

try:
    meta, splits = prepare_data.load(data_dir, dataset, block_size)
except prepare_data.DataError as e:
    die(str(e))
if checkpoint is not None and ckpt_args['vocab_size'] != meta['vocab_size']:
    die(f"the checkpoint was trained on a {ckpt_args['vocab_size']}-token vocabulary, {data_dir}/{dataset} has "
        f"{meta['vocab_size']}; name the dataset it was trained on with --dataset")
train_gen = torch.Generator().manual_seed(seed + rank)  # ranks draw different batches


def get_batch(split, gen):
    # recreate the memmap every batch to avoid a memory leak, per
    # https://stackoverflow.com/questions/45132940/numpy-memmap-memory-usage-want-to-iterate-once/61472122#61472122
    data = np.memmap(splits[split], dtype=np.uint16, mode='r')
    ix = torch.randint(len(data) - block_size - 1, (batch_size,), generator=gen)
    x = torch.stack([torch.from_numpy(data[i:i + block_size].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + block_size].astype(np.int64)) for i in ix])
    if device_type == 'cuda':
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)


# -----------------------------------------------------------------------------
# model, optimizer, resume

model_args = {k: config[k] for k in MODEL_KEYS} | dict(vocab_size=meta['vocab_size'])
tokens_per_iter = gradient_accumulation_steps * world_size * batch_size * block_size
best_val_loss, train_time, tokens = 1e9, 0.0, 0  # tokens: trained so far, counted as they are
try:
    model = GPT(GPTConfig(**model_args), verbose=master)
except ValueError as e:
    die(str(e))
if checkpoint is not None:
    try:
        model.load_state_dict({k.removeprefix('_orig_mod.'): v for k, v in checkpoint['model'].items()})
    except RuntimeError as e:
        die(f"{ckpt_path} does not fit the model it names ({why(e)}); it is corrupt, or was written by another "
            "version of model.py (use the commit that trained it)")
    iter_num = saved_iter = checkpoint['iter_num']
    best_val_loss = checkpoint['best_val_loss']
    train_time, tokens = checkpoint.get('train_time', 0.0), checkpoint.get('tokens', iter_num * tokens_per_iter)
model.to(device)
scaler = torch.amp.GradScaler(device_type, enabled=dtype == 'float16')
optimizer = model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2), device_type)
if checkpoint is not None and trains:
    try:
        optimizer.load_state_dict(checkpoint['optimizer'])
        if world_size == checkpoint.get('world_size', 1):  # the data position and dropout's RNG: exact resume
            rng = checkpoint['rng'][rank]
            train_gen.set_state(rng['batches'])
            torch.set_rng_state(rng['torch'])
            if device_type == 'cuda' and rng.get('cuda') is not None:
                torch.cuda.set_rng_state(rng['cuda'], device)
        train_time, tokens = float(train_time), int(tokens)
    except Exception as e:
        die(f"{ckpt_path}'s optimizer or RNG state does not fit this run ({why(e)}); resume it with the settings "
            "it was trained with")
    print0(f"resuming from {ckpt_path} at iteration {iter_num} ({train_time:.0f} s trained)")
checkpoint = None  # free memory
raw_model = model
if compile and trains:
    print0("compiling the model... (takes a minute)")
    try:
        model = torch.compile(model)
        x, y = get_batch('train', torch.Generator().manual_seed(0))
        with autocast:  # compile happens lazily: try one step now and fall back if it fails
            model(x, y)[1].backward()
    except Exception as e:
        print0(f"warning: torch.compile failed ({why(e)}); continuing without --compile")
        model = raw_model
    optimizer.zero_grad(set_to_none=True)
if ddp:
    model = DDP(model, device_ids=[local_rank] if device_type == 'cuda' else None)


def perplexity(loss):  # infinite for a diverged run, not an OverflowError
    return math.exp(loss) if loss < 700 else math.inf


@torch.no_grad()
def estimate_loss():
    """Mean loss over eval_iters batches, for learning curves: the same batches at every eval of every run, on every
    rank, whatever the seed or the number of ranks."""
    out = {}
    model.eval()
    for split in ('train', 'val'):
        gen, losses = torch.Generator().manual_seed(10_000), torch.zeros(eval_iters)
        for k in range(eval_iters):
            with autocast:
                losses[k] = model(*get_batch(split, gen))[1].item()
        out[split] = losses.mean().item()
    model.train()
    return out


@torch.no_grad()
def full_eval():
    """The loss over every token of val and test (prepare_data.windows): our metric. Printed, and returned
    with perplexity and bits per byte."""
    out = {}
    model.eval()
    for split in [s for s in ('val', 'test') if s in splits]:
        nats = torch.zeros(2, dtype=torch.float64, device=device)  # [loss summed over tokens, tokens]
        for x, y in prepare_data.windows(splits[split], block_size, rank, world_size, 8192 // block_size + 1):
            with autocast:
                loss = raw_model(torch.from_numpy(x).to(device), torch.from_numpy(y).to(device))[1]
            nats += torch.stack((loss.double() * y.size, torch.tensor(y.size, device=device)))
        if ddp:
            torch.distributed.all_reduce(nats)
        loss, n_bytes = (nats[0] / nats[1]).item(), meta['bytes'].get(split)
        bpb = nats[0].item() / (math.log(2) * n_bytes) if n_bytes else None
        out |= {f'{split}_loss': loss, f'{split}_ppl': perplexity(loss), f'{split}_bpb': bpb}
        print0(f"full {split} split: loss {loss:.4f}, ppl {perplexity(loss):.3f}"
               + (f", {bpb:.4f} bits per byte" if bpb else '') + f" ({meta['tokens'][split]:,} tokens)")
    model.train()
    return out


def write_sample(prompt):
    """sample_tokens tokens after prompt ('': a document's start) through the KV cache: temperature 0.8, top 200."""
    tok = prepare_data.get_tokenizer(meta['tokenizer'])  # GPT-2's BPE files may need a download: a DataError
    ids = tok['encode']([prompt])[0].tolist() if prompt else [tok['eot']]
    torch.manual_seed(seed)
    idx = torch.tensor([ids[-block_size:]], dtype=torch.long, device=device)
    raw_model.eval()
    with autocast:
        out = raw_model.generate(idx, sample_tokens, temperature=0.8, top_k=200)[0, idx.size(1):].tolist()
    raw_model.train()
    text = tok['decode'](ids if prompt else [])
    print0(f"sample (seed {seed}, {sample_tokens} tokens after {text[:40]!r}):\n{text}{tok['decode'](out)}")


print0(f"{dataset}: {meta['vocab_size']} token vocabulary ({meta['tokenizer']}); {tokens_per_iter:,} tokens per "
       f"iteration; device {device}, {dtype}, {world_size} process(es)")
if sample:
    try:
        write_sample(sample)
    except prepare_data.DataError as e:
        die(f"cannot sample: {e}")
    shutdown(0)
if eval_only:
    full_eval()
    shutdown(0)


def save_checkpoint():
    global saving, saved_iter
    rngs = [dict(batches=batch_state, torch=torch.get_rng_state(), cuda=torch.cuda.get_rng_state(device)
                 if device_type == 'cuda' else None)] * world_size  # each rank's: exact resume
    if ddp:
        torch.distributed.all_gather_object(rngs, rngs[rank])
    if not master:
        return
    ckpt = dict(model=raw_model.state_dict(), optimizer=optimizer.state_dict(), model_args=model_args, rng=rngs,
                iter_num=iter_num, best_val_loss=best_val_loss, train_time=train_time, tokens=tokens, config=config,
                world_size=world_size)
    saving, mask = True, getattr(signal, 'pthread_sigmask', lambda *a: None)  # a Ctrl-C now waits for the save
    try:
        torch.save(ckpt, ckpt_path + '.tmp')
        mask(signal.SIG_BLOCK, {signal.SIGINT})  # no Ctrl-C between the rename and saved_iter: a message is true
        os.replace(ckpt_path + '.tmp', ckpt_path)  # atomic: a crash mid-save keeps the previous checkpoint
        saved_iter = iter_num
        mask(signal.SIG_UNBLOCK, {signal.SIGINT})
    except (OSError, RuntimeError) as e:  # a full disk: torch.save says RuntimeError ("file write failed")
        with suppress(OSError):
            os.remove(ckpt_path + '.tmp')
        disk_full(ckpt_path, e)
    saving = False
    if interrupted:  # a Ctrl-C came during the save: it is complete now
        on_ctrl_c(signal.SIGINT, None)


def log(record):  # append one whole line: on a full disk the file is cut back to before it, and the run stops
    if master:
        line = (json.dumps(record) + '\n').encode()
        with open(os.path.join(out_dir, 'metrics.jsonl'), 'ab', buffering=0) as f:  # unbuffered: nothing to flush
            size, written = f.seek(0, os.SEEK_END), 0
            try:
                while written < len(line):
                    written += f.write(line[written:]) or 0
            except OSError as e:
                f.truncate(size)
                disk_full(f.name, e)


def disk_full(what, e):
    die(f"cannot write {what} ({why(e)}); nothing else was touched, free some space: {resume_hint()}", code=1)


def check_losses():  # the losses kept on the device since the last check; stop, before any save, at a non-finite one
    global pending
    losses = torch.stack(pending).float()
    bad = (~torch.isfinite(losses)).any().float()
    if ddp:  # every rank stops together: a rank that leaves alone would hang the others in the next all-reduce
        torch.distributed.all_reduce(bad, op=torch.distributed.ReduceOp.MAX)
    losses, pending = losses.cpu().tolist(), []
    if bad.item():
        i = next((i for i, v in enumerate(losses) if not math.isfinite(v)), len(losses) - 1)
        not_finite(iter_num - len(losses) + i, losses[i] if not math.isfinite(losses[i]) else 'another rank')
    return losses[-1]


def not_finite(at, value):
    die(f"the loss is not finite at iteration {at} (here: {value}); the run stopped before saving. Lower "
        f"--learning_rate or use --dtype=float32; {resume_hint()}", code=3)


def get_lr(it):
    decay_iters = lr_decay_iters or max_iters
    if it < warmup_iters:  # 1) linear warmup
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > decay_iters:   # 2) after decay, min learning rate
        return min_lr
    ratio = (it - warmup_iters) / max(1, decay_iters - warmup_iters)  # 3) cosine decay down to min learning rate
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)


# -----------------------------------------------------------------------------
# the loop. The log is only appended to: a resumed run's records follow a 'start' at its checkpoint's iteration
# (earlier records past that iteration are lost work, which bench.py --report drops)

peak = peak_flops(device)  # for MFU, on a CUDA device in model.GPU_PEAK_FLOPS
flops_per_iter = flops_per_token(raw_model.config, block_size) * tokens_per_iter
log(dict(event='start', iter=iter_num, tokens=tokens, config=config, params=raw_model.get_num_params(),
         qk_params=sum(p.numel() for p in raw_model.qk_parameters()), world_size=world_size))
phase, start_iter, pending, interval_iters = 'train', iter_num, [], 0
t_start = t_log = time.time()
batch_state = train_gen.get_state()  # the batch generator before the next batch is drawn: what a checkpoint keeps
X, Y = get_batch('train', train_gen)  # the first batch; later ones are fetched while the GPU computes
while True:
    lr = get_lr(iter_num) if decay_lr else learning_rate
    for group in optimizer.param_groups:
        group['lr'] = lr
    out_of_time = time_budget > 0 and train_time >= time_budget
    if ddp and time_budget > 0:  # every rank must stop at the same iteration: rank 0's clock decides, at log steps
        if iter_num % log_interval == 0:
            flag = torch.tensor(float(out_of_time), device=device)
            torch.distributed.broadcast(flag, 0)
        out_of_time = iter_num % log_interval == 0 and bool(flag.item())
    last = iter_num >= max_iters or out_of_time
    if (iter_num % eval_interval == 0 and (iter_num > start_iter or init_from == 'scratch')) or last:
        if pending:
            check_losses()  # a model that went non-finite is never evaluated into a checkpoint
        losses = estimate_loss()
        if not all(math.isfinite(v) for v in losses.values()):  # the last update broke the model
            not_finite(iter_num, losses['val'])
        qk = qk_diagnostics(raw_model, get_batch('val', torch.Generator().manual_seed(10_000))[0]) if master else []
        print0(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}, val ppl "
               f"{perplexity(losses['val']):.2f} ({eval_iters}-batch estimates)" + (
                   " | q/k map: nonlinear {:.2%}, dq {:.1%}, dk {:.1%} (median layer)".format(
                       *(median_layer(qk, k) for k in ('nonlinear', 'dq', 'dk'))) if qk else ''))
        log(dict(event='eval', iter=iter_num, train_loss=losses['train'], val_loss=losses['val'],
                 val_ppl=perplexity(losses['val']), tokens=tokens, time=train_time, qk=qk))
        if losses['val'] < best_val_loss or always_save_checkpoint:
            best_val_loss = min(best_val_loss, losses['val'])
            if iter_num > start_iter or last:
                save_checkpoint()
        t_log, interval_iters = time.time(), 0  # evaluation time is not training time
    if last:
        break
    # forward backward update, with optional gradient accumulation to simulate larger batch size
    t0 = time.time()
    for micro_step in range(gradient_accumulation_steps):
        if ddp:  # sync gradients only on the last micro-step; must be set before the forward pass
            model.require_backward_grad_sync = micro_step == gradient_accumulation_steps - 1
        with autocast:
            logits, loss = model(X, Y)
            loss = loss / gradient_accumulation_steps
        batch_state = train_gen.get_state()
        X, Y = get_batch('train', train_gen)  # the next batch, fetched while the GPU works on this one
        scaler.scale(loss).backward()
    if grad_clip > 0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    pending.append(loss.detach() * gradient_accumulation_steps)  # stays on the device: no sync here
    train_time += time.time() - t0
    tokens += tokens_per_iter
    interval_iters += 1
    iter_num += 1
    if iter_num % log_interval == 0 or iter_num == start_iter + 1:
        lossf = check_losses()  # the one host-device sync between evals
        elapsed = (time.time() - t_log) / interval_iters  # seconds per iteration over the interval, after the sync
        t_log, interval_iters = time.time(), 0
        left = (max_iters - iter_num) * (time.time() - t_start) / (iter_num - start_iter)  # evals included
        left = min(left, time_budget - train_time) if time_budget > 0 else left
        mfu = flops_per_iter / elapsed / peak if peak else None
        print0(f"iter {iter_num}/{max_iters} | loss {lossf:.4f} | lr {lr:.2e} | {elapsed * 1000:.0f} ms/iter | "
               f"{tokens_per_iter / elapsed:,.0f} tok/s" + (f" | mfu {mfu:.1%}" if mfu else '')
               + f" | eta {max(left, 0) / 60:.1f} min")
        log(dict(event='train', iter=iter_num, loss=lossf, lr=lr, ms=elapsed * 1000, tok_s=tokens_per_iter / elapsed,
                 mfu=mfu, tokens=tokens, time=train_time))

# -----------------------------------------------------------------------------
# the end: full-split evaluation, a sample, the DDP check

phase = 'final'
log(dict(event='final', iter=iter_num, tokens=tokens, time=train_time) | full_eval())
if master and sample_tokens:
    try:
        write_sample('')
    except Exception as e:  # never fail a finished run over its sample (e.g. GPT-2's tokenizer files offline)
        print(f"note: no sample ({why(e)})")
print0(f"done: {iter_num} iterations, {(time.time() - t_start) / 60:.1f} min; checkpoint {ckpt_path}")
if ddp:  # sanity check: every rank holds the same weights, and drew other batches
    mine = [sum(p.double().sum().item() for p in raw_model.parameters()),
            get_batch('train', torch.Generator().manual_seed(seed + rank))[0].sum().item()]
    ranks = [None] * world_size
    torch.distributed.all_gather_object(ranks, mine)
    print0(f"ddp check: {world_size} ranks, identical weights: {len({w for w, b in ranks}) == 1}, distinct batches: "
           f"{len({b for w, b in ranks}) == world_size}")
shutdown(0)
