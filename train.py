"""
Train a GPT with any attention variant: one flat loop, nanoGPT-shaped. Every setting below is a flag.

  python train.py --attn=coupled                                   # laptop CPU: tiny model on data/pydocs
  python train.py --preset=60m --dataset=wikitext103 --attn=coupled --compile=True   # one GPU, the paper's scale
  torchrun --standalone --nproc_per_node=8 train.py --preset=60m --dataset=wikitext103 --attn=coupled
  python train.py --init_from=resume --out_dir=out                 # continue a run: its settings come along
  python train.py --eval_only=True --out_dir=out                   # full-split val/test perplexity of a run
  python train.py --sample="def " --out_dir=out                    # text from a run's model

Settings: flags (--key=value) > a --preset on the command line > the values written below. Resuming or
evaluating takes every setting not given as a flag from the checkpoint (model shape, dataset, schedule...).
Under torchrun: DDP (nccl on CUDA, gloo on CPU). A run owns its out_dir while it runs (train.lock).
"""
import json
import math
import os
import signal
import sys
import time
from contextlib import nullcontext, suppress
from dataclasses import fields


def on_ctrl_c(signum, frame):
    # Ctrl-C ends the run at once with one line and exit code 130, from the first line on; while a checkpoint is
    # being written it waits for the write to finish (a second Ctrl-C stops at once). Installed here, before the
    # slow imports, and whatever this process inherited: a background job of a non-interactive shell starts with
    # SIGINT ignored. No exception is raised, so no `except:` in a library can swallow it.
    global interrupted
    if saving and not interrupted:
        interrupted = True
        say("Ctrl-C: stopping once this checkpoint is written (Ctrl-C again: stop now)")
        return
    stop(130, where_to_continue())


def where_to_continue():  # the line a Ctrl-C prints: what happened, and how to go on
    g = globals()
    if g.get('eval_only') or g.get('sample'):
        return "interrupted; nothing was written"
    at = {'train': f"interrupted at iteration {g.get('iter_num')}", 'final': "interrupted during the final "
          "evaluation"}.get(g.get('phase'), "interrupted before training")
    return f"{at}; {resume_hint()}"


def resume_hint():  # every stop says where the last checkpoint is and how to continue from it
    g = globals()
    if g.get('saved_iter') is None:
        return "no checkpoint yet"
    return (f"the last checkpoint is at iteration {g['saved_iter']}: {g['ckpt_path']}. Continue with: python train.py "
            f"--init_from=resume --out_dir={g['out_dir']}")


def say(line):  # print from the signal handler: it may interrupt a print() in progress, so no print() here
    if globals().get('master', True):
        with suppress(RuntimeError):  # "reentrant call": the interrupted print() holds the buffer
            sys.stdout.flush()
        os.write(sys.stdout.fileno(), f"\n{line}\n".encode())


def stop(code, line):
    say(line)
    os._exit(code)  # nothing half-written remains: saves are atomic, the log is appended a whole line at a time


saving, interrupted = False, False
signal.signal(signal.SIGINT, on_ctrl_c)

# the slow imports come after the Ctrl-C handler: importing torch takes seconds
import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.distributed import destroy_process_group, init_process_group  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

from bench import median_layer, peak_flops, read_log  # noqa: E402
from model import POS, PRESETS, GPT, GPTConfig, attn_names, flops_per_token, qk_diagnostics  # noqa: E402

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
# every other field of model.GPTConfig is a flag too, with GPTConfig's default: qk_steps, qk_hidden, qk_scale, qk_dt,
# qk_decay, pos (see its comments, or --help). A field added there needs no edit here.
globals().update({f.name: f.default for f in fields(GPTConfig) if f.name not in globals() and f.name != 'vocab_size'})
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
CHOICES = dict(attn=attn_names(), pos=POS, preset=('',) + tuple(PRESETS), init_from=('scratch', 'resume'),
               dtype=('auto', 'float32', 'bfloat16', 'float16'))
MODEL_KEYS = [f.name for f in fields(GPTConfig) if f.name != 'vocab_size']
# settings of this command, not of the run: never taken from a checkpoint
LOCAL_KEYS = ('out_dir', 'init_from', 'eval_only', 'device', 'dtype', 'compile', 'sample', 'sample_tokens')


def shutdown(code):  # every exit goes through here
    if torch.distributed.is_initialized():
        destroy_process_group()
        # gloo's worker threads can abort the process during interpreter teardown ("terminate called without an
        # active exception", pytorch/pytorch#179291); everything is saved and flushed, so skip that teardown
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def die(msg, code=2):
    print(f"error: {msg}", file=sys.stderr)
    shutdown(code)


def parse_value(key, text):
    kind = type(defaults[key])
    if kind is bool:
        if text.lower() not in ('true', 'false', '1', '0'):
            die(f"--{key} expects True or False, got {text!r}")
        return text.lower() in ('true', '1')
    try:
        value = kind(text)
    except ValueError:
        die(f"--{key} expects {'a number' if kind is float else 'an integer'}, got {text!r}")
    if key in CHOICES and value not in CHOICES[key]:
        die(f"--{key}={text} is not one of {', '.join(repr(c) for c in CHOICES[key])}")
    return value


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
explicit = dict(PRESETS.get(given.get('preset', ''), {})) | given  # flags > preset > the values above
globals().update(explicit)
if not out_dir.strip():
    die("--out_dir is empty; name a folder, e.g. --out_dir=out")

# resume and eval: the checkpoint's settings, except what the command line says and the machine-specific ones
ckpt_path = os.path.join(out_dir, 'ckpt.pt')
checkpoint = None
if init_from == 'resume' or eval_only or sample:
    if not os.path.exists(ckpt_path):
        die(f"no checkpoint at {ckpt_path} to {'evaluate' if eval_only else 'sample' if sample else 'resume'}; train "
            f"one with --init_from=scratch first, or point --out_dir at a run")
    try:
        checkpoint = torch.load(ckpt_path, map_location='cpu', weights_only=True)
        ckpt_args, ckpt_config = dict(checkpoint['model_args']), dict(checkpoint['config'])
        for key in ('model', 'optimizer', 'iter_num', 'best_val_loss'):
            checkpoint[key]
    except Exception as e:
        die(f"{ckpt_path} cannot be read ({type(e).__name__}: {str(e).splitlines()[0][:80] if str(e) else ''}); "
            "it is corrupt or not from train.py")
    clash = [f"--{k}={explicit[k]!r} here but {ckpt_args.get(k)!r} in the checkpoint" for k in MODEL_KEYS
             if k in explicit and ckpt_args.get(k, explicit[k]) != explicit[k]]
    if clash:
        die(f"{ckpt_path} holds a different model: {'; '.join(clash)}; drop those flags to use the checkpoint's, "
            f"or train anew in another --out_dir")
    globals().update({k: v for k, v in ckpt_config.items()
                      if k in defaults and k not in explicit and k not in LOCAL_KEYS and k != 'preset'})
    globals().update({k: v for k, v in ckpt_args.items() if k in MODEL_KEYS})
for key, low in [('batch_size', 1), ('block_size', 1), ('gradient_accumulation_steps', 1), ('max_iters', 0),
                 ('eval_interval', 1), ('eval_iters', 1), ('log_interval', 1), ('warmup_iters', 0),
                 ('sample_tokens', 0)]:
    if globals()[key] < low:
        die(f"--{key} must be >= {low}, got {globals()[key]}")
if not learning_rate > 0 or min_lr < 0 or time_budget < 0:
    die("--learning_rate must be > 0, --min_lr >= 0 and --time_budget >= 0")
config = {k: globals()[k] for k in defaults}  # this run's settings, saved in the checkpoint

# -----------------------------------------------------------------------------
# distributed and device setup

ddp = int(os.environ.get('RANK', -1)) != -1  # launched by torchrun?
if device == 'auto':
    device = 'cuda' if torch.cuda.is_available() else 'mps' if torch.backends.mps.is_available() else 'cpu'
device_type = device.split(':')[0]
if device_type not in ('cpu', 'cuda', 'mps'):
    die(f"--device={device} is unknown; use auto, cpu, cuda, cuda:N or mps")
if device_type == 'cuda' and not torch.cuda.is_available():
    die(f"--device={device} but CUDA is not available here; use --device=cpu")
if device_type == 'mps' and not torch.backends.mps.is_available():
    die(f"--device={device} but Apple's MPS is not available here (it needs macOS on Apple silicon); use --device=cpu")
# the out_dir is this run's alone while it runs: an exclusive lock on out_dir/train.lock, which the OS releases when
# the process ends, however it ends (a crash leaves no stale lock). Taken before anything in out_dir is touched.
# (fcntl's flock: Linux and macOS; on Windows runs are not locked.)
writes = not (eval_only or sample)
if writes and int(os.environ.get('RANK', 0)) == 0:
    try:
        os.makedirs(out_dir, exist_ok=True)
        lock = open(os.path.join(out_dir, 'train.lock'), 'a+')
    except OSError as e:
        die(f"cannot write to --out_dir={out_dir} ({e.strerror or e}); choose a writable folder")
    try:
        import fcntl
    except ImportError:  # Windows
        fcntl = None
    try:
        if fcntl:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        lock.seek(0)
        die(f"{out_dir}/ is in use by a running train.py ({lock.read().strip() or 'another process'}); wait for it "
            f"to finish, or train in another --out_dir")
    lock.seek(0)
    lock.truncate()
    lock.write(f"pid {os.getpid()}, started {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    lock.flush()

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

# out_dir (under the lock): never overwrite a run without being asked; find out now, not at the first save, if it
# cannot be written
metrics_path = os.path.join(out_dir, 'metrics.jsonl')
if writes:
    if init_from == 'scratch' and os.path.exists(ckpt_path):
        die(f"{out_dir}/ holds a run (ckpt.pt); continue it with --init_from=resume, or train in another --out_dir "
            f"(delete {out_dir}/ to start over)")
    if master:
        try:
            probe = os.path.join(out_dir, f'.write-test{os.getpid()}')
            open(probe, 'w').close()
            os.remove(probe)
            if os.path.exists(ckpt_path + '.tmp'):
                os.remove(ckpt_path + '.tmp')  # a save cut short by kill -9: the checkpoint before it is intact
        except OSError as e:
            die(f"cannot write to --out_dir={out_dir} ({e.strerror or e}); choose a writable folder")

# -----------------------------------------------------------------------------
# data: data/<dataset>/{train,val,test}.bin of uint16 tokens, and meta.json

data_path = os.path.join(data_dir, dataset)
if not os.path.exists(os.path.join(data_path, 'meta.json')):
    die(f"{data_path}/meta.json not found; prepare the corpus first: python prepare_data.py {dataset}"
        f" (or --input=PATH --name={dataset})")
try:
    meta = json.load(open(os.path.join(data_path, 'meta.json')))
    vocab_size = int(meta['vocab_size'])
    n_tokens = {s: int(n) for s, n in meta['tokens'].items()}
except (ValueError, KeyError, TypeError, AttributeError):
    die(f"{data_path}/meta.json is corrupt; run prepare_data.py again with --force")
splits = {}
for split in ('train', 'val', 'test'):
    path = os.path.join(data_path, f'{split}.bin')
    if not os.path.exists(path):
        if split != 'test':
            die(f"{path} not found; run prepare_data.py again with --force")
        continue
    n = os.path.getsize(path) // 2
    if os.path.getsize(path) % 2 or n != n_tokens.get(split, n):
        die(f"{path} has {os.path.getsize(path)} bytes, not the {n_tokens.get(split)} tokens meta.json lists; "
            "it is truncated or corrupt: run prepare_data.py again with --force")
    if n < block_size + 2:
        die(f"{path} has only {n} tokens, fewer than block_size+2 = {block_size + 2}; lower --block_size")
    if np.memmap(path, dtype=np.uint16, mode='r').max() >= vocab_size:
        die(f"{path} holds token ids >= vocab_size {vocab_size}; it does not match meta.json: run prepare_data.py "
            "again with --force")
    splits[split] = path
if checkpoint is not None and ckpt_args['vocab_size'] != vocab_size:
    die(f"the checkpoint was trained on a {ckpt_args['vocab_size']}-token vocabulary, {data_path} has "
        f"{vocab_size}; name the dataset it was trained on with --dataset")
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

model_args = {k: globals()[k] for k in MODEL_KEYS} | dict(vocab_size=vocab_size)
iter_num, best_val_loss, train_time, saved_iter = 0, 1e9, 0.0, None
try:
    model = GPT(GPTConfig(**model_args), verbose=master)
except ValueError as e:
    die(str(e))
if checkpoint is not None:
    try:
        model.load_state_dict({k.removeprefix('_orig_mod.'): v for k, v in checkpoint['model'].items()})
    except RuntimeError as e:
        die(f"{ckpt_path} does not fit the model it names ({str(e).splitlines()[0][:100]}); it is corrupt, or "
            "was written by another version of model.py (use the commit that trained it)")
    iter_num, best_val_loss = checkpoint['iter_num'], checkpoint['best_val_loss']
    saved_iter = iter_num
    train_time = checkpoint.get('train_time', 0.0)
model.to(device)
scaler = torch.amp.GradScaler(device_type, enabled=dtype == 'float16')
optimizer = model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2), device_type)
if checkpoint is not None and writes:
    try:
        optimizer.load_state_dict(checkpoint['optimizer'])
    except ValueError as e:
        die(f"{ckpt_path}'s optimizer state does not fit this run's ({e}); resume it with the settings it was "
            "trained with, or evaluate it with --eval_only=True")
    if 'rng' in checkpoint and world_size == checkpoint.get('world_size', 1):  # data position and dropout RNG
        train_gen.set_state(checkpoint['rng'][rank]['batches'])
        torch.set_rng_state(checkpoint['rng'][rank]['torch'])
        if device_type == 'cuda' and checkpoint['rng'][rank].get('cuda') is not None:
            torch.cuda.set_rng_state(checkpoint['rng'][rank]['cuda'], device)
    print0(f"resuming from {ckpt_path} at iteration {iter_num} ({train_time:.0f} s trained)")
checkpoint = None  # free memory
raw_model = model
if compile:
    print0("compiling the model... (takes a minute)")
    try:
        model = torch.compile(model)
        x, y = get_batch('train', torch.Generator().manual_seed(0))
        with autocast:  # compile happens lazily: try one step now and fall back if it fails
            model(x, y)[1].backward()
    except Exception as e:
        print0(f"warning: torch.compile failed ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
               "continuing without --compile")
        model = raw_model
    optimizer.zero_grad(set_to_none=True)
if ddp:
    model = DDP(model, device_ids=[local_rank] if device_type == 'cuda' else None)


@torch.no_grad()
def estimate_loss(split_names=('train', 'val')):
    """Mean loss over eval_iters random batches: an estimate, for learning curves. The batches depend on neither
    --seed nor the iteration, so every eval of every run scores the same ones."""
    out = {}
    model.eval()
    for split in split_names:
        gen = torch.Generator().manual_seed(10_000 + rank)
        losses = torch.zeros(eval_iters)
        for k in range(eval_iters):
            X, Y = get_batch(split, gen)
            with autocast:
                losses[k] = model(X, Y)[1].item()
        out[split] = losses.mean().item()
    model.train()
    if ddp:  # average over ranks (each evaluated different batches)
        t = torch.tensor([out[s] for s in split_names], device=device)
        torch.distributed.all_reduce(t)
        out = dict(zip(split_names, (t / world_size).tolist()))
    return out


@torch.no_grad()
def evaluate_split(split):
    """
    The loss over every token of a split: the paper's metric. Non-overlapping windows of block_size tokens; each
    predicts its tokens 2..block_size+1 from the window so far (context 1..block_size tokens), the last window is
    shorter. Returns (mean loss per token, perplexity, bits per byte of the split's text or None).
    """
    data = torch.from_numpy(np.fromfile(splits[split], dtype=np.uint16).astype(np.int64))
    starts = list(range(0, len(data) - 1, block_size))[rank::world_size]  # ranks share the windows
    nats, count = torch.zeros((), dtype=torch.float64), 0
    model.eval()
    t0 = time.time()
    n = max(batch_size, 8192 // block_size)  # windows per forward pass
    for b in range(0, len(starts), n):
        group = starts[b:b + n]
        for lens in sorted({min(block_size, len(data) - 1 - i) for i in group}):  # the short last window first
            ix = [i for i in group if min(block_size, len(data) - 1 - i) == lens]
            X = torch.stack([data[i:i + lens] for i in ix]).to(device)
            Y = torch.stack([data[i + 1:i + 1 + lens] for i in ix]).to(device)
            with autocast:
                nats += raw_model(X, Y)[1].double().cpu() * Y.numel()
            count += Y.numel()
        if master and time.time() - t0 > 10 and (b // n) % 50 == 0:
            print(f"  {split}: {b + len(group):,}/{len(starts):,} windows", flush=True)
    model.train()
    if ddp:
        t = torch.tensor([nats.item(), count], dtype=torch.float64, device=device)
        torch.distributed.all_reduce(t)
        nats, count = t[0].cpu(), int(t[1].item())
    loss = nats.item() / count
    n_bytes = meta.get('bytes', {}).get(split)
    return loss, math.exp(loss), (nats.item() / (math.log(2) * n_bytes) if n_bytes else None)


def coupling():
    """qk_diagnostics on the first validation batch, plus each layer's step sizes dt: logged with every eval."""
    if raw_model.transformer.h[0].attn.qk is None:
        return []
    X, _ = get_batch('val', torch.Generator().manual_seed(10_000))
    stats = qk_diagnostics(raw_model, X)
    for s, blk in zip(stats, raw_model.transformer.h):
        if hasattr(blk.attn.qk, 'dt'):
            s['dt'] = blk.attn.qk.dt.tolist()
    return stats


def full_eval():
    """Full-split loss, perplexity and bits per byte of val and test: printed, and returned for the log."""
    out = {}
    for split in [s for s in ('val', 'test') if s in splits]:
        loss, ppl, bpb = evaluate_split(split)
        out |= {f'{split}_loss': loss, f'{split}_ppl': ppl, f'{split}_bpb': bpb}
        print0(f"full {split} split: loss {loss:.4f}, ppl {ppl:.3f}" + (f", {bpb:.4f} bits per byte" if bpb else '')
               + f" ({n_tokens[split]:,} tokens)")
    return out


def get_lr(it):
    decay_iters = lr_decay_iters or max_iters
    if it < warmup_iters:  # 1) linear warmup
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > decay_iters:   # 2) after decay, min learning rate
        return min_lr
    ratio = (it - warmup_iters) / max(1, decay_iters - warmup_iters)  # 3) cosine decay down to min learning rate
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)


def disk_full(what, e):  # a failed write (a full disk): one line, nothing else touched
    die(f"cannot write {what} ({getattr(e, 'strerror', None) or str(e).splitlines()[0][:120]}); nothing else was "
        f"touched, free some space: {resume_hint()}", code=1)


def save_checkpoint():
    global saving
    rng = {'batches': batch_state, 'torch': torch.get_rng_state(),
           'cuda': torch.cuda.get_rng_state(device) if device_type == 'cuda' else None}
    rngs = [None] * world_size
    if ddp:
        torch.distributed.all_gather_object(rngs, rng)
    else:
        rngs = [rng]
    if master:
        ckpt = dict(model=raw_model.state_dict(), optimizer=optimizer.state_dict(), model_args=model_args,
                    iter_num=iter_num, best_val_loss=best_val_loss, train_time=train_time, config=config, rng=rngs,
                    world_size=world_size)
        saving = True  # a Ctrl-C now waits until the checkpoint is complete
        try:
            torch.save(ckpt, ckpt_path + '.tmp')
            os.replace(ckpt_path + '.tmp', ckpt_path)  # atomic: a crash mid-save keeps the previous checkpoint
        except (OSError, RuntimeError) as e:  # a full disk: torch.save says RuntimeError ("file write failed")
            if os.path.exists(ckpt_path + '.tmp'):
                os.remove(ckpt_path + '.tmp')
            disk_full(ckpt_path, e)
        saving = False


def log(record):
    # one whole line per record: on a full disk the file is cut back to before the line, and the run stops
    if master:
        line = (json.dumps(record) + '\n').encode()
        with open(metrics_path, 'ab', buffering=0) as f:  # unbuffered: nothing is left to flush after a failure
            size, written = f.seek(0, os.SEEK_END), 0
            try:
                while written < len(line):
                    written += f.write(line[written:]) or 0
            except OSError as e:
                f.truncate(size)
                disk_full(metrics_path, e)


def fmt_time(s):
    return f"{int(s // 3600)}h{int(s % 3600 // 60):02d}m" if s >= 3600 else f"{int(s // 60)}m{int(s % 60):02d}s"


def decode(tokens):  # token ids -> text, by the corpus's tokenizer
    if meta.get('tokenizer') == 'gpt2':
        import tiktoken
        return tiktoken.get_encoding('gpt2').decode(tokens)
    return b''.join(b'\n<|endoftext|>\n' if t == 256 else bytes([t]) for t in tokens).decode('utf-8', 'replace')


def write_sample(prompt):
    """Print sample_tokens tokens continuing prompt ('': the start of a document), sampled with temperature 0.8
    from the 200 most likely tokens, through the KV cache; the seed is --seed."""
    if meta.get('tokenizer') == 'gpt2':
        import tiktoken
        enc = tiktoken.get_encoding('gpt2')
        ids = enc.encode(prompt) if prompt else [enc.eot_token]
    else:
        ids = list(prompt.encode('utf-8')) if prompt else [256]
    torch.manual_seed(seed)
    idx = torch.tensor([ids[-block_size:]], dtype=torch.long, device=device)
    raw_model.eval()
    with autocast:
        out = raw_model.generate(idx, sample_tokens, temperature=0.8, top_k=200)[0, idx.size(1):].tolist()
    raw_model.train()
    print0(f"sample (seed {seed}, {sample_tokens} tokens after {prompt[:40]!r}):\n{prompt}{decode(out)}")


tokens_per_iter = gradient_accumulation_steps * world_size * batch_size * block_size
print0(f"{dataset}: {vocab_size} token vocabulary ({meta.get('tokenizer')}); {tokens_per_iter:,} tokens per "
       f"iteration; device {device}, {dtype}, {world_size} process(es)")
if sample:
    if meta.get('tokenizer') == 'gpt2':
        try:
            import tiktoken
            tiktoken.get_encoding('gpt2')  # tiktoken downloads its BPE files on first use
        except Exception as e:
            die(f"cannot sample: the GPT-2 tokenizer did not load ({type(e).__name__}); offline, export "
                "TIKTOKEN_CACHE_DIR=<a folder with tiktoken's cached files>")
    write_sample(sample)
    shutdown(0)
if eval_only:
    full_eval()
    shutdown(0)
peak = peak_flops(device)  # for MFU, on CUDA
if device_type == 'cuda' and peak is None:
    print0(f"note: no MFU: the peak FLOP/s of {torch.cuda.get_device_name(device)} is not in bench.GPU_PEAK_FLOPS")
flops_per_iter = flops_per_token(raw_model.config, block_size) * tokens_per_iter

# -----------------------------------------------------------------------------
# the loop

if master:  # the log holds this run only: a fresh run starts it, a resumed one drops what came after its checkpoint
    kept = [r for r in read_log(metrics_path) if init_from == 'resume' and (
        r.get('iter', 0) < iter_num or (r['event'] == 'train' and r.get('iter') == iter_num))] if (
        os.path.exists(metrics_path)) else []
    try:
        with open(metrics_path + '.tmp', 'w') as f:
            f.writelines(json.dumps(r) + '\n' for r in kept)
        os.replace(metrics_path + '.tmp', metrics_path)
    except OSError as e:
        disk_full(metrics_path, e)
log(dict(event='start', iter=iter_num, config=config, params=raw_model.get_num_params(),
         qk_params=sum(p.numel() for p in raw_model.qk_parameters()), world_size=world_size))


def not_finite(at, value):
    die(f"the loss is not finite at iteration {at} (here: {value}); the run stopped before saving. Lower "
        f"--learning_rate or use --dtype=float32; {resume_hint()}", code=3)


def check_losses():
    """Fetch the losses kept on the device since the last check (the one host-device sync between evals), and stop
    the run if one is not finite: before anything is saved. Returns the last loss."""
    global pending
    if not pending:
        return None
    losses = torch.stack(pending).float()
    bad = (~torch.isfinite(losses)).any().float()
    if ddp:  # every rank stops together: a rank that leaves alone would hang the others in the next all-reduce
        torch.distributed.all_reduce(bad, op=torch.distributed.ReduceOp.MAX)
    losses, n = losses.cpu().tolist(), len(pending)
    pending = []
    if bad.item():
        first = next((i for i, v in enumerate(losses) if not math.isfinite(v)), None)
        not_finite(iter_num - n + first, losses[first]) if first is not None else not_finite(iter_num, 'another rank')
    return losses[-1]


phase = 'train'
t_start = t_log = time.time()
done_iters, start_iter, pending, interval_iters = 0, iter_num, [], 0
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
    if iter_num % eval_interval == 0 or last:
        check_losses()  # a model that went non-finite is never evaluated into a checkpoint
        losses = estimate_loss()
        if not all(math.isfinite(v) for v in losses.values()):  # the last update broke the model
            not_finite(iter_num, losses['val'])
        qk = coupling() if master else []
        print0(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}, val ppl "
               f"{math.exp(losses['val']):.2f} ({eval_iters}-batch estimates)" + (
                   " | q/k map: nonlinear {:.2%}, dq {:.1%}, dk {:.1%} (median layer)".format(
                       *(median_layer(qk, k) for k in ('nonlinear', 'dq', 'dk'))) if qk else ''))
        log(dict(event='eval', iter=iter_num, train_loss=losses['train'], val_loss=losses['val'],
                 val_ppl=math.exp(losses['val']), tokens=iter_num * tokens_per_iter, time=train_time, qk=qk))
        if losses['val'] < best_val_loss or always_save_checkpoint:
            best_val_loss = min(best_val_loss, losses['val'])
            if iter_num > start_iter or last:
                save_checkpoint()
                saved_iter = iter_num
                if interrupted:  # a Ctrl-C came during the save: it is complete now
                    stop(130, where_to_continue())
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
    done_iters += 1
    interval_iters += 1
    iter_num += 1
    if iter_num % log_interval == 0 or iter_num == start_iter + 1:
        lossf = check_losses()  # the one host-device sync between evals
        elapsed = (time.time() - t_log) / interval_iters  # seconds per iteration over the interval, after the sync
        t_log, interval_iters = time.time(), 0
        left = (max_iters - iter_num) * (time.time() - t_start) / done_iters  # evals included
        if time_budget > 0:
            left = min(left, time_budget - train_time)
        mfu = flops_per_iter / elapsed / peak if peak else None
        print0(f"iter {iter_num}/{max_iters} | loss {lossf:.4f} | lr {lr:.2e} | {elapsed * 1000:.0f} ms/iter | "
               f"{tokens_per_iter / elapsed:,.0f} tok/s" + (f" | mfu {mfu:.1%}" if mfu else '')
               + f" | eta {fmt_time(max(left, 0))}")
        log(dict(event='train', iter=iter_num, loss=lossf, lr=lr, ms=elapsed * 1000, tok_s=tokens_per_iter / elapsed,
                 mfu=mfu, time=train_time))

phase = 'final'
final = full_eval()
log(dict(event='final', iter=iter_num, tokens=iter_num * tokens_per_iter, time=train_time) | final)
if master and sample_tokens:
    try:
        write_sample('')
    except Exception as e:  # never fail a finished run over its sample (e.g. GPT-2's tokenizer files offline)
        print(f"note: no sample ({type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''})")
print0(f"done: {iter_num} iterations, {fmt_time(time.time() - t_start)}; checkpoint {ckpt_path}")
if ddp:
    # sanity check: every rank holds the same weights, and ranks draw from different batch generators
    sums = torch.stack([torch.stack((p.double().sum(), p.double().pow(2).sum())) for p in raw_model.parameters()])
    gathered = [torch.zeros_like(sums) for _ in range(world_size)]
    torch.distributed.all_gather(gathered, sums)
    first = [None] * world_size
    torch.distributed.all_gather_object(first, get_batch('train', torch.Generator().manual_seed(seed + rank))[0]
                                        .sum().item())
    same = all(torch.equal(g, gathered[0]) for g in gathered)
    print0(f"ddp check: {world_size} ranks, identical weights: {same}, distinct batches: "
           f"{len(set(first)) == world_size}")
    torch.distributed.barrier()
shutdown(0)
