"""
Train a GPT with any attention variant, in nanoGPT's order: settings, setup, one loop, the end.

  python train.py --attn=coupled                         # laptop CPU: the tiny model on data/pydocs
  torchrun --standalone --nproc_per_node=8 train.py ...  # DDP: nccl on CUDA, gloo on CPU
  python train.py --init_from=resume --out_dir=out       # continue a run
  python train.py --eval_only=True --out_dir=out         # evaluate it (--sample="def ": sample it)

A flag (--key=value) wins over a --preset, which wins over the values below. Resuming, evaluating
and sampling take every setting no flag gives from the checkpoint. MFU (on a GPU) is
model.flops_per_token's FLOPs, causal attention at half, over the GPU's dense bf16 peak (float32,
which multiplies in TF32: half of that peak).
"""
import runfolder

# from here on Ctrl-C and SIGTERM stop with one line, also during torch's import (it takes seconds)
runfolder.catch_signals()

import difflib
import hashlib
import inspect
import json
import math
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import fields
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import prepare_data
from model import (POS, PRESETS, GPT, GPTConfig, attn_names, autocast_dtype, diagnostics,
                   find_device, flops_per_token, peak_flops, qk_flags_read)

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
time_budget = 0.0  # stop at a log step past this many seconds trained (across resumes; 0: never)
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
# ... and GPTConfig's other fields at model.py's defaults: the q/k map's qk_steps, qk_hidden,
# qk_scale, qk_dt and qk_decay, and pos (learned or rope)
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
dtype = 'auto'  # auto: bfloat16 where the GPU has it natively, else float16; float32 off CUDA
compile = False  # torch.compile the training step (eager, with a warning, if it fails)
seed = 1337
# -----------------------------------------------------------------------------
defaults = {k: v for k, v in globals().items() if k not in _before and k != '_before'}
# every GPTConfig field is a flag too
MODEL_KEYS = [f.name for f in fields(GPTConfig) if f.name != 'vocab_size']
defaults |= {k: getattr(GPTConfig, k) for k in MODEL_KEYS if k not in defaults}
CHOICES = dict(attn=attn_names(), pos=POS, preset=('', *PRESETS), init_from=('scratch', 'resume'),
               dtype=('auto', 'float32', 'bfloat16', 'float16'))
# this command's own: never taken from a checkpoint
LOCAL_KEYS = ('out_dir', 'init_from', 'eval_only', 'device', 'sample', 'sample_tokens', 'preset')
master = os.environ.get('RANK', '0') == '0'  # rank 0 logs, saves and speaks


def shutdown(code):
    """Every exit. Under torchrun: os._exit, past the interpreter's teardown, where gloo's
    threads can abort; after a mistake without destroy_process_group, whose teardown can hang
    (torch 2.4)."""
    if dist.is_initialized():
        if code == 0:
            dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def die(msg, code=2):
    """A plausible mistake: one line (rank 0's), and exit."""
    if master:
        print(f"error: {msg}", file=sys.stderr)
    elif not dist.is_initialized():
        # torchrun stops every rank at the first failure, maybe rank 0 still in its imports: wait
        time.sleep(30)
    shutdown(code)


def parse(key, text):
    """--key=text, as the type of the key's default."""
    kind = type(defaults[key])
    # e.g. --out_dir=$RUN with RUN unset
    if kind is str and not text and defaults[key]:
        die(f"--{key}= is empty (an unset shell variable?); give it a value, e.g. "
            f"--{key}={defaults[key]}")
    try:
        value = dict(true=True, false=False)[text.lower()] if kind is bool else kind(text)
    except (KeyError, ValueError):
        expects = dict(bool='True or False', int='an integer', float='a number')[kind.__name__]
        die(f"--{key} expects {expects}, got {text!r}")
    if key in CHOICES and value not in CHOICES[key]:
        die(f"--{key}={text} is not one of {', '.join(map(repr, CHOICES[key]))}")
    return value


# ---- flags, the out_dir, the checkpoint

if {'-h', '--help'} & set(sys.argv[1:]):
    flags = '\n'.join(f"  --{k}={v}" for k, v in defaults.items())
    print(f"{__doc__}\nflags and their defaults:\n{flags}")
    sys.exit(0)
given = {}  # the command line's flags
for i, arg in enumerate(sys.argv[1:], 2):
    key, eq, text = arg.removeprefix('--').partition('=')
    if not (arg.startswith('--') and eq and key in defaults):
        near = difflib.get_close_matches(key, defaults, 1)
        # --key value (argparse's habit): the hint puts the value after '='
        text = text or (sys.argv[i] if i < len(sys.argv) else '...')
        die(f"{arg!r} is not a flag; flags look like --key=value"
            f"{f', e.g. --{near[0]}={text}' if near else ''}; see --help")
    given[key] = parse(key, text)
settings = defaults | PRESETS.get(given.get('preset'), {}) | given
out_dir, ckpt_path = settings['out_dir'], os.path.join(settings['out_dir'], 'ckpt.pt')
trains = not (settings['eval_only'] or settings['sample'])
# each line as it is printed, under nohup too (a compile takes minutes)
sys.stdout.reconfigure(line_buffering=True)

# DDP and the device come first: then every rank takes rank 0's decision on the out_dir
ddp = 'RANK' in os.environ  # launched by torchrun?
try:
    device = find_device(settings['device'])
except ValueError as e:
    die(str(e))
device_type = device.split(':')[0]
if ddp:
    rank = int(os.environ['RANK'])
    local_rank = int(os.environ['LOCAL_RANK'])
    world_size = int(os.environ['WORLD_SIZE'])
    if device_type == 'cuda':
        device = f'cuda:{local_rank}'
        torch.cuda.set_device(device)
    # NCCL's default timeout, 10 minutes, can pass while ranks wait for each other's compile (350m)
    backend = 'nccl' if device_type == 'cuda' else 'gloo'
    dist.init_process_group(backend=backend, timeout=timedelta(minutes=30))
else:
    rank, local_rank, world_size = 0, 0, 1
settings['device'] = device  # as resolved (never taken from a checkpoint)
# a run owns its out_dir: a lock, and never a new run over a checkpoint (runfolder.py)
refusal = runfolder.claim(out_dir, settings['init_from'] == 'scratch') if trains else None
if refusal:
    die(refusal)

# resume, eval, sample: every setting no flag gives comes from the checkpoint (here); its weights
# are loaded with the model, and its optimizer, counters and random states after it
checkpoint = None
if settings['init_from'] == 'resume' or not trains:
    if not os.path.exists(ckpt_path):
        die(f"no checkpoint at {ckpt_path}; train one first, or point --out_dir at a run")
    checkpoint = torch.load(ckpt_path, map_location='cpu', weights_only=True)
    # the model this command names (by flags or a preset) must be the checkpoint's
    asked, theirs = PRESETS.get(given.get('preset'), {}) | given, checkpoint['model_args']
    clash = [f"--{k}={asked[k]!r} here but {theirs[k]!r} in the checkpoint"
             for k in MODEL_KEYS if k in asked and asked[k] != theirs[k]]
    if clash:
        die(f"{ckpt_path} holds a different run: {'; '.join(clash)}; drop those flags (or "
            "--preset), or train in another --out_dir")
    settings |= {k: v for k, v in checkpoint['config'].items()
                 if k in defaults and k not in LOCAL_KEYS + tuple(given)}
    if trains:
        # a Ctrl-C during the rest of the setup names this checkpoint
        runfolder.saved_iter = checkpoint['iter_num']
# a q/k flag that the variant does not read would change nothing
unread = [f'--{k}' for k in given if k.startswith('qk_') and given[k] != defaults[k]
          and k not in qk_flags_read(settings['attn'])]
if unread:
    die(f"--attn={settings['attn']} reads no {', '.join(unread)}; drop it, or choose a variant "
        "that reads it")
config = settings  # saved in the checkpoint
globals().update(settings)
print0 = print if master else (lambda *a, **k: None)
dtype = autocast_dtype(device) if dtype == 'auto' else dtype
if dtype == 'bfloat16' and device_type == 'cuda':
    if not torch.cuda.is_bf16_supported(including_emulation=False):
        die(f"{torch.cuda.get_device_name(device)} emulates bfloat16, several times slower (this "
            "run asks for it: --dtype=bfloat16, or its checkpoint's); train with --dtype=auto "
            "(float16 there)")
ptdtype = getattr(torch, dtype)
autocast = nullcontext() if dtype == 'float32' else torch.autocast(device_type, ptdtype)
torch.manual_seed(seed + rank)  # each rank its own dropout
torch.set_float32_matmul_precision('high')  # float32 matmuls on TF32 tensor cores (Ampere on)

# ---- data: data/<dataset>/{train,val[,test]}.bin and meta.json, from prepare_data.py

try:
    meta, splits = prepare_data.load(data_dir, dataset, block_size)
except prepare_data.DataError as e:
    die(str(e))
if checkpoint and sample and checkpoint['model_args']['vocab_size'] != meta['vocab_size']:
    die(f"{ckpt_path} reads {checkpoint['model_args']['vocab_size']} tokens, "
        f"{data_dir}/{dataset}'s tokenizer {meta['vocab_size']}; name the corpus it was trained on "
        "with --dataset")
trained_on = checkpoint and checkpoint.get('fingerprint')
if trained_on and (trains or eval_only) and trained_on != meta['fingerprint']:
    die(f"{ckpt_path} was trained on other text than {data_dir}/{dataset} holds (corpus "
        f"fingerprint {trained_on[:12]}, not {meta['fingerprint'][:12]}); name its corpus with "
        "--dataset")
train_gen = torch.Generator().manual_seed(seed + rank)  # each rank its own batches


def to_device(t):
    # CUDA: from pinned memory, so the copy does not block the host
    return t.pin_memory().to(device, non_blocking=True) if device_type == 'cuda' else t.to(device)


def get_batch(split, gen, part=slice(None), n=None):
    # n: how many starts to draw (batch_size by default); part: which of them to build (the
    # evaluation splits a batch among ranks, and gen moves on as for the whole batch). A new memmap
    # every batch: a long-lived one leaks.
    data = np.memmap(splits[split], dtype=np.uint16, mode='r')
    ix = torch.randint(len(data) - block_size - 1, (n or batch_size,), generator=gen)[part]
    at = ix.numpy()[:, None] + np.arange(block_size)  # (len(ix), T) positions
    x, y = (torch.from_numpy(data[at + shift].astype(np.int64)) for shift in (0, 1))
    return to_device(x), to_device(y)


# ---- the model, the optimizer, the training state

model_args = {k: config[k] for k in MODEL_KEYS} | dict(vocab_size=meta['vocab_size'])
tokens_per_iter = gradient_accumulation_steps * world_size * batch_size * block_size
try:
    model = GPT(GPTConfig(**model_args), verbose=master)
except ValueError as e:  # e.g. n_embd not divisible by n_head
    die(str(e))
if checkpoint:
    model.load_state_dict(checkpoint['model'])
model.to(device)
raw_model, compiled = model, compile and trains  # evaluation and sampling run the model eager
if compiled:
    print0("compiling the model...")
    model = torch.compile(model)  # lazy: it compiles at its first call
# DDP around the compiled model, as PyTorch's docs say: the graph splits at DDP's gradient buckets
if ddp:
    model = DDP(model, device_ids=[local_rank] if device_type == 'cuda' else None)
# one compiled step now, without gradient sync and with dropout's random state left as it was: if it
# fails (no C compiler, a Python that Dynamo does not support yet), every rank goes on eager
if compiled:
    failed = ''  # why this rank's compile failed
    try:
        same_rng = torch.random.fork_rng([device] if device_type == 'cuda' else [])
        with model.no_sync() if ddp else nullcontext(), autocast, same_rng:
            model(*get_batch('train', torch.Generator().manual_seed(0)))[1].backward()
    except Exception as e:
        e, compiled = getattr(e, 'inner_exception', e), False
        # the GPU's own errors: eager would fail too
        if isinstance(e, torch.cuda.OutOfMemoryError) or 'CUDA error' in str(e):
            raise e
        failed = f"{type(e).__name__}: {str(e)[:100]}"
    raw_model.zero_grad(set_to_none=True)
    if ddp:
        ok = torch.tensor(float(compiled), device=device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        compiled = bool(ok.item())
    if not compiled:
        print0(f"warning: torch.compile failed ({failed or 'on another rank'}); running eager")
    if not compiled and ddp:
        model.module = raw_model  # DDP calls the eager model
    elif not compiled:
        model = raw_model
scaler = torch.amp.GradScaler(device_type, enabled=dtype == 'float16')
optimizer = raw_model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2), device_type)
iter_num, best_val_loss, saved_val, train_time, tokens = 0, 1e9, math.nan, 0.0, 0
if checkpoint and trains:
    optimizer.load_state_dict(checkpoint['optimizer'])
    if checkpoint.get('scaler'):  # float16's loss scale
        scaler.load_state_dict(checkpoint['scaler'])
    counters = ('iter_num', 'best_val_loss', 'train_time', 'tokens')
    iter_num, best_val_loss, train_time, tokens = (checkpoint[k] for k in counters)
    saved_val = checkpoint.get('val_loss', best_val_loss)
    # an exact resume: the data's position, dropout's random state
    if world_size == checkpoint['world_size']:
        rng = checkpoint['rng'][rank]
        train_gen.set_state(rng['batches'])
        torch.set_rng_state(rng['torch'])
        if device_type == 'cuda' and rng.get('cuda') is not None:
            torch.cuda.set_rng_state(rng['cuda'], device)
    else:
        print0(f"note: the checkpoint was trained by {checkpoint['world_size']} process(es), "
               f"this run has {world_size}: its batches are drawn anew (seed {seed}), not as one "
               "run would go on")
    print0(f"resuming from {ckpt_path} at iteration {iter_num} ({train_time:.0f} s trained)")
# loaded: its weights and AdamW's state are not kept (0.77 GB at 60m, on every rank)
if checkpoint:
    del checkpoint['model'], checkpoint['optimizer']
# MFU's terms (None: not known)
peak = peak_flops(device, dtype) if trains else None
flops_per_iter = None
if peak:
    try:
        flops_per_iter = flops_per_token(raw_model.config, block_size) * tokens_per_iter
        flops_per_iter /= world_size
    except ValueError as e:  # a variant without a FLOP price (flops=None)
        die(str(e))


def perplexity(loss):  # inf for a diverged run, not an OverflowError
    return math.exp(loss) if loss < 700 else math.inf


@torch.no_grad()
def estimate_loss():
    """Mean loss over eval_iters batches from one seed, the same at every eval and in every run;
    under DDP rank r takes the r-th of world_size slices of its sequences (maybe none), and one
    all-reduce per split sums them."""
    out, n = {}, eval_iters * batch_size
    # this rank's sequences of the set
    lo, hi = rank * n // world_size, (rank + 1) * n // world_size
    raw_model.eval()
    for split in ('train', 'val'):
        gen, losses = torch.Generator().manual_seed(10_000), torch.zeros(eval_iters, device=device)
        # batch k: sequences k B .. k B + B - 1, this rank's a..b of them: its share of the mean
        for k in range(eval_iters):
            a, b = (min(max(i - k * batch_size, 0), batch_size) for i in (lo, hi))
            x, y = get_batch(split, gen, slice(a, b))
            if b > a:
                with autocast:
                    losses[k] = raw_model(x, y)[1].float() * ((b - a) / batch_size)
        # (eval_iters,): each batch's mean loss, its ranks' shares summed; the mean on the host, as
        # one process takes it
        if ddp:
            dist.all_reduce(losses)
        out[split] = losses.cpu().mean().item()
    raw_model.train()
    return out


def log(record):  # metrics.jsonl: a line a record, only appended to
    if master:
        with open(os.path.join(out_dir, 'metrics.jsonl'), 'a') as f:
            f.write(json.dumps(record) + '\n')


def check_losses():
    """The losses since the last check: a non-finite one stops every rank, before a save."""
    global pending
    losses = torch.stack(pending).float()
    bad = (~torch.isfinite(losses)).any().float()
    if ddp:
        dist.all_reduce(bad, op=dist.ReduceOp.MAX)
    losses, pending = losses.cpu().tolist(), []
    if bad.item():
        # the first non-finite loss here, or (none here) another rank's
        i = next((i for i, v in enumerate(losses) if not math.isfinite(v)), len(losses) - 1)
        value = losses[i] if not math.isfinite(losses[i]) else 'another rank'
        not_finite(iter_num - len(losses) + 1 + i, value)
    return losses[-1]


def not_finite(at, value):
    log(dict(event='diverged', iter=at))
    die(f"the loss is not finite at iteration {at} (here: {value}); stopped before saving. Lower "
        f"--learning_rate or use --dtype=float32; {runfolder.resume_hint()}", code=3)


def get_lr(it):
    decay_iters = lr_decay_iters or max_iters
    if it < warmup_iters:  # 1) linear warmup
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > decay_iters:   # 2) after decay, min learning rate
        return min_lr
    # 3) cosine decay down to min learning rate
    ratio = (it - warmup_iters) / max(1, decay_iters - warmup_iters)
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)


print0(f"{dataset}: {meta['vocab_size']} token vocabulary ({meta['tokenizer']}); "
       f"{tokens_per_iter:,} tokens per iteration; device {device}, {dtype}, "
       f"{'compiled' if compiled else 'eager'}, {world_size} process(es)")
start_iter, pending, interval_iters, out_of_time = iter_num, [], 0, False
t_start = t_log = time.time()
if trains:
    runfolder.loop = globals()  # a signal's line names the loop's iteration
    model_sha256 = hashlib.sha256(open(inspect.getsourcefile(GPT), 'rb').read()).hexdigest()
    qk_params = sum(p.numel() for p in raw_model.qk_parameters())
    log(dict(event='start', iter=iter_num, tokens=tokens, config=config,
             vocab_size=meta['vocab_size'], params=raw_model.get_num_params(), qk_params=qk_params,
             world_size=world_size, compiled=compiled, fingerprint=meta['fingerprint'],
             model_sha256=model_sha256))  # the model.py imported (the lab's launcher reads it)
    # what a checkpoint keeps: the generator before the next batch
    batch_state = train_gen.get_state()
    X, Y = get_batch('train', train_gen)

# ---- the loop (eval_only and sample skip it)

while trains:
    lr = get_lr(iter_num)
    for group in optimizer.param_groups:
        group['lr'] = lr
    # --time_budget: rank 0's clock decides for all
    if time_budget > 0 and iter_num % log_interval == 0:
        flag = torch.tensor(float(train_time >= time_budget), device=device)
        if ddp:
            dist.broadcast(flag, 0)
        out_of_time = bool(flag.item())
    last = iter_num >= max_iters or out_of_time
    # evaluate and save (a resume's first iteration was evaluated before the save it resumes from)
    resumed_here = iter_num == start_iter and init_from == 'resume'
    if (iter_num % eval_interval == 0 and not resumed_here) or last:
        if pending:
            check_losses()  # a model gone non-finite is never saved
        losses = estimate_loss()
        # rank 0's estimates decide for all: ranks may differ in a bit
        if ddp:
            est = torch.tensor([losses['train'], losses['val']], device=device)
            dist.broadcast(est, 0)
            losses = dict(train=est[0].item(), val=est[1].item())
        if not all(math.isfinite(v) for v in losses.values()):  # the last update broke it
            not_finite(iter_num, losses['val'])
        # the diagnostics: 8,192 val tokens at any batch or world size (the fewest the nonlinear fit
        # reads well)
        qk, att, line = [], [], ''
        if master and diag_interval and (iter_num // eval_interval % diag_interval == 0 or last):
            gen, n = torch.Generator().manual_seed(10_000), math.ceil(8192 / block_size)
            qk, att, line = diagnostics(raw_model, get_batch('val', gen, n=n)[0])
        print0(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}, "
               f"val ppl {perplexity(losses['val']):.2f} ({eval_iters}-batch estimates){line}")
        log(dict(event='eval', iter=iter_num, train_loss=losses['train'], val_loss=losses['val'],
                 val_ppl=perplexity(losses['val']), tokens=tokens, time=train_time, qk=qk,
                 attn=att))
        save = losses['val'] < best_val_loss or always_save_checkpoint
        if save and (iter_num > start_iter or last):
            best_val_loss, saved_val = min(best_val_loss, losses['val']), losses['val']
            # each rank's random states, for an exact resume
            cuda = torch.cuda.get_rng_state(device) if device_type == 'cuda' else None
            rngs = [dict(batches=batch_state, torch=torch.get_rng_state(), cuda=cuda)] * world_size
            if ddp:
                dist.all_gather_object(rngs, rngs[rank])
            runfolder.save(dict(model=raw_model.state_dict(), optimizer=optimizer.state_dict(),
                                model_args=model_args, rng=rngs, iter_num=iter_num,
                                best_val_loss=best_val_loss, val_loss=saved_val,
                                train_time=train_time, tokens=tokens, config=config,
                                world_size=world_size, fingerprint=meta['fingerprint'],
                                scaler=scaler.state_dict()))
        t_log, interval_iters = time.time(), 0  # evaluation time is not training time
    if last:
        break
    # forward, backward, update; gradient accumulation simulates a larger batch
    t0 = time.time()
    for micro_step in range(gradient_accumulation_steps):
        # under DDP, sync gradients at the last micro-step only (set before the forward pass)
        if ddp:
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
    # log: the loss is read from the device here only (a sync)
    if iter_num % log_interval == 0 or iter_num == start_iter + 1:
        lossf = check_losses()
        elapsed = (time.time() - t_log) / interval_iters  # seconds per iteration, after the sync
        t_log, interval_iters = time.time(), 0
        # the ETA's clock starts after step 0's evaluation and the first step; evaluations count in
        if iter_num == start_iter + 1:
            t_first = time.time()
        left = (max_iters - iter_num) * (time.time() - t_first) / max(iter_num - start_iter - 1, 1)
        left = min(left, time_budget - train_time) if time_budget > 0 else left
        eta = f"{max(left, 0) / 60:.1f} min" if iter_num > start_iter + 1 else '-'
        mfu = flops_per_iter / elapsed / peak if peak else None
        print0(f"iter {iter_num}/{max_iters} | loss {lossf:.4f} | lr {lr:.2e} | "
               f"{elapsed * 1000:.0f} ms/iter | {tokens_per_iter / elapsed:,.0f} tok/s"
               + (f" | mfu {mfu:.1%}" if mfu else '') + f" | eta {eta}")
        log(dict(event='train', iter=iter_num, loss=lossf, lr=lr, ms=elapsed * 1000,
                 tok_s=tokens_per_iter / elapsed, mfu=mfu, tokens=tokens,
                 time=train_time + time.time() - t0))
    train_time += time.time() - t0  # after the log step's sync: a GPU's queue counts

# ---- the end: every val (and test) token scored, a sample; --eval_only and --sample start here


@torch.no_grad()
def full_eval():
    """Our metric: the loss on every token of val and test (prepare_data.windows), perplexity,
    bits per byte."""
    out = {}
    raw_model.eval()
    for split in [s for s in ('val', 'test') if s in splits]:
        # the loss summed over n tokens (n on the host: no copy per batch)
        nats, n = torch.zeros((), dtype=torch.float64, device=device), 0
        windows = prepare_data.windows(splits[split], block_size, rank, world_size,
                                       8192 // block_size + 1)
        for x, y in windows:
            with autocast:
                loss = raw_model(to_device(torch.from_numpy(x)), to_device(torch.from_numpy(y)))[1]
            nats, n = nats + loss.double() * y.size, n + y.size
        nats = torch.stack((nats, torch.tensor(float(n), dtype=torch.float64, device=device)))
        if ddp:
            dist.all_reduce(nats)
        loss, n_bytes = (nats[0] / nats[1]).item(), meta['bytes'].get(split)
        bpb = nats[0].item() / (math.log(2) * n_bytes) if n_bytes else None
        out |= {f'{split}_loss': loss, f'{split}_ppl': perplexity(loss), f'{split}_bpb': bpb}
        print0(f"full {split} split: loss {loss:.4f}, ppl {perplexity(loss):.3f}"
               + (f", {bpb:.4f} bits per byte" if bpb else '')
               + f" ({meta['tokens'][split]:,} tokens)")
    return out


def write_sample(prompt):
    """sample_tokens tokens after prompt ('': a document's start): temperature 0.8, top 200."""
    tok = prepare_data.get_tokenizer(meta['tokenizer'])
    ids = tok['encode']([prompt])[0].tolist() if prompt else [tok['eot']]
    torch.manual_seed(seed)
    idx = torch.tensor([ids[-block_size:]], dtype=torch.long, device=device)
    raw_model.eval()
    with autocast:
        out = raw_model.generate(idx, sample_tokens, temperature=0.8, top_k=200)[0, idx.size(1):]
    text = tok['decode'](ids if prompt else [])
    print0(f"sample (seed {seed}, {sample_tokens} tokens after {text[:40]!r}):\n"
           f"{text}{tok['decode'](out.tolist())}")


if eval_only:
    print0(f"{ckpt_path} holds the model of iteration {checkpoint['iter_num']}")
    full_eval()
elif sample:
    try:
        write_sample(sample)
    except prepare_data.DataError as e:  # no tokenizer here (offline): one line
        die(str(e))
else:
    # the model the final evaluation scores: the last weights, or the best-only checkpoint's
    model_iter, model_tokens, saved_iter = iter_num, tokens, runfolder.saved_iter
    if prepare_data.load(data_dir, dataset, block_size)[0]['fingerprint'] != meta['fingerprint']:
        die(f"{data_dir}/{dataset} was prepared again while this run trained, so its final "
            "evaluation would score other text; train it again in another --out_dir")
    if saved_iter != iter_num:
        # AdamW's state stays off the GPU
        best = torch.load(ckpt_path, map_location='cpu', weights_only=True)
        raw_model.load_state_dict(best['model'])
        model_iter, model_tokens = saved_iter, best['tokens']
    log(dict(event='final', iter=iter_num, tokens=tokens, model_iter=model_iter,
             model_tokens=model_tokens, time=train_time) | full_eval())
    if master and sample_tokens:
        try:
            write_sample('')
        except prepare_data.DataError as e:  # offline, say: the run is logged and saved already
            print(f"note: no sample: {e}; the run's results are in {out_dir}/metrics.jsonl")
    kept = '' if saved_iter == iter_num else (
        f" at iteration {saved_iter} (val loss {saved_val:.4f}, the best estimate): the model the "
        "final evaluation scored")
    minutes = (time.time() - t_start) / 60
    print0(f"done: {iter_num} iterations, {minutes:.1f} min; checkpoint {ckpt_path}{kept}")
shutdown(0)
