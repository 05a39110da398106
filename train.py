"""
Train a GPT with any attention variant. One flat loop, nanoGPT-shaped.

  python train.py --attn=coupled                                   # laptop CPU: tiny model on data/pydocs
  python train.py --preset=60m --dataset=wikitext103 --attn=coupled --compile=True   # one GPU, the paper's scale
  torchrun --standalone --nproc_per_node=8 train.py --preset=60m --dataset=wikitext103 --attn=coupled

Every setting below is overridable as --key=value. Under torchrun: DDP (nccl on CUDA, gloo on CPU).
"""
import json
import math
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import fields

import numpy as np
import torch
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP

from model import ATTN, POS, PRESETS, GPT, GPTConfig

# -----------------------------------------------------------------------------
# I/O
out_dir = 'out'
eval_interval = 250
log_interval = 10
eval_iters = 40         # batches per validation estimate (the same batches every time)
eval_only = False       # evaluate the checkpoint in out_dir and exit
always_save_checkpoint = True  # save at every eval; False: only when val loss improves
init_from = 'scratch'   # 'scratch' or 'resume' (from out_dir/ckpt.pt)
time_budget = 0.0       # seconds of training after which the run stops (0: no budget); compute-matched runs
# data
dataset = 'pydocs'      # data/<dataset>/ made by prepare_data.py
data_dir = 'data'
gradient_accumulation_steps = 1  # micro-steps per iteration, per rank
batch_size = 16         # sequences per micro-step, per rank
block_size = 128
# model (a preset sets n_layer, n_head, n_embd; explicit flags override it)
preset = 'tiny'         # one of model.PRESETS, or '' for the explicit shape
n_layer = 4
n_head = 4
n_embd = 128
dropout = 0.0
bias = False
attn = 'standard'       # one of model.ATTN; 'coupled' is the paper's method
qk_steps = 1            # integration steps of the q/k dynamics (1..7)
qk_hidden = 8           # hidden width of the potential V
pos = 'learned'         # 'learned' or 'rope'
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
defaults = {k: v for k, v in globals().items() if not k.startswith('_') and isinstance(v, (int, float, bool, str))}
CHOICES = dict(attn=ATTN, pos=POS, preset=('',) + tuple(PRESETS), init_from=('scratch', 'resume'),
               dtype=('auto', 'float32', 'bfloat16', 'float16'))
MODEL_KEYS = [f.name for f in fields(GPTConfig) if f.name != 'vocab_size']


def shutdown(code):
    if torch.distributed.is_initialized():
        destroy_process_group()
        # gloo's worker threads can abort the process during interpreter teardown ("terminate called without an
        # active exception", pytorch/pytorch#179291); everything is saved and flushed, so skip that teardown
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


def die(msg):
    print(f"error: {msg}", file=sys.stderr)
    shutdown(2)


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


given = {}  # the flags set on the command line
for arg in sys.argv[1:]:
    key, eq, text = arg.removeprefix('--').partition('=')
    if not arg.startswith('--') or not eq:
        die(f"arguments look like --key=value, got {arg!r}")
    if key not in defaults:
        die(f"unknown flag --{key}; valid flags: {', '.join('--' + k for k in defaults)}")
    given[key] = parse_value(key, text)
if given.get('preset', preset):
    globals().update(PRESETS[given.get('preset', preset)])
globals().update(given)
for key, low in [('batch_size', 1), ('block_size', 1), ('gradient_accumulation_steps', 1), ('max_iters', 0),
                 ('eval_interval', 1), ('eval_iters', 1), ('log_interval', 1), ('warmup_iters', 0)]:
    if globals()[key] < low:
        die(f"--{key} must be >= {low}, got {globals()[key]}")
if not learning_rate > 0 or min_lr < 0:
    die("--learning_rate must be > 0 and --min_lr >= 0")
config = {k: globals()[k] for k in defaults}  # what this run was asked, saved in the checkpoint
# -----------------------------------------------------------------------------
# distributed and device setup

ddp = int(os.environ.get('RANK', -1)) != -1  # launched by torchrun?
if device == 'auto':
    device = 'cuda' if torch.cuda.is_available() else 'mps' if torch.backends.mps.is_available() else 'cpu'
device_type = 'cuda' if device.startswith('cuda') else device.split(':')[0]
if device_type == 'cuda' and not torch.cuda.is_available():
    die(f"--device={device} but CUDA is not available here; use --device=cpu")
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
if master:
    os.makedirs(out_dir, exist_ok=True)

# -----------------------------------------------------------------------------
# data: data/<dataset>/{train,val,test}.bin of uint16 tokens, and meta.json

data_path = os.path.join(data_dir, dataset)
if not os.path.exists(os.path.join(data_path, 'meta.json')):
    die(f"{data_path}/meta.json not found; prepare the corpus first: python prepare_data.py {dataset}"
        f" (or --input=PATH --name={dataset})")
try:
    meta = json.load(open(os.path.join(data_path, 'meta.json')))
    vocab_size = int(meta['vocab_size'])
except (ValueError, KeyError, TypeError):
    die(f"{data_path}/meta.json is corrupt; run prepare_data.py again with --force")
splits = {}
for split in ('train', 'val', 'test'):
    path = os.path.join(data_path, f'{split}.bin')
    if not os.path.exists(path):
        if split != 'test':
            die(f"{path} not found; run prepare_data.py again with --force")
        continue
    n = os.path.getsize(path) // 2
    if os.path.getsize(path) % 2 or n != meta.get('tokens', {}).get(split, n):
        die(f"{path} has {os.path.getsize(path)} bytes, not the {meta['tokens'][split]} tokens meta.json lists; "
            "it is truncated or corrupt: run prepare_data.py again with --force")
    if n < block_size + 2:
        die(f"{path} has only {n} tokens, fewer than block_size+2 = {block_size + 2}; lower --block_size")
    if np.memmap(path, dtype=np.uint16, mode='r').max() >= vocab_size:
        die(f"{path} holds token ids >= vocab_size {vocab_size}; it does not match meta.json, prepare it again")
    splits[split] = path
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

ckpt_path = os.path.join(out_dir, 'ckpt.pt')
model_args = {k: globals()[k] for k in MODEL_KEYS} | dict(vocab_size=vocab_size)
iter_num, best_val_loss, checkpoint = 0, 1e9, None
if init_from == 'resume' or eval_only:
    if not os.path.exists(ckpt_path):
        die(f"no checkpoint at {ckpt_path} to resume from; train with --init_from=scratch first, or set --out_dir")
    try:
        checkpoint = torch.load(ckpt_path, map_location='cpu', weights_only=True)
        ckpt_args = checkpoint['model_args']
    except Exception as e:
        die(f"{ckpt_path} cannot be read ({type(e).__name__}); it is corrupt or not from train.py")
    clash = {k: (ckpt_args.get(k), model_args[k]) for k in model_args
             if k in given or (k == 'vocab_size' or k in PRESETS.get(given.get('preset', ''), {}))
             if ckpt_args.get(k) != model_args[k]}
    if clash:
        die(f"{ckpt_path} holds a different model: " + ', '.join(f"{k}={a!r} there but {b!r} here" for k, (a, b) in
            clash.items()) + "; drop those flags to resume it, or train anew in another --out_dir")
    model_args = ckpt_args
try:
    model = GPT(GPTConfig(**model_args), verbose=master)
except ValueError as e:
    die(str(e))
if checkpoint is not None:
    state = {k.removeprefix('_orig_mod.'): v for k, v in checkpoint['model'].items()}
    model.load_state_dict(state)
    iter_num, best_val_loss = checkpoint['iter_num'], checkpoint['best_val_loss']
model.to(device)
scaler = torch.amp.GradScaler(device_type, enabled=dtype == 'float16')
optimizer = model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2), device_type)
if checkpoint is not None:
    optimizer.load_state_dict(checkpoint['optimizer'])
    if 'rng' in checkpoint and world_size == checkpoint.get('world_size', 1):  # data position and dropout RNG
        train_gen.set_state(checkpoint['rng'][rank]['batches'])
        torch.set_rng_state(checkpoint['rng'][rank]['torch'])
    print0(f"resuming from {ckpt_path} at iteration {iter_num}")
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
    """Mean loss over eval_iters batches; the same batches every time (own generator), so evals compare."""
    out = {}
    model.eval()
    for split in split_names:
        gen = torch.Generator().manual_seed(seed + 10_000 + rank)
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


def get_lr(it):
    decay_iters = lr_decay_iters or max_iters
    if it < warmup_iters:  # 1) linear warmup
        return learning_rate * (it + 1) / (warmup_iters + 1)
    if it > decay_iters:   # 2) after decay, min learning rate
        return min_lr
    ratio = (it - warmup_iters) / max(1, decay_iters - warmup_iters)  # 3) cosine decay down to min learning rate
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (learning_rate - min_lr)


def save_checkpoint():
    rng = {'batches': train_gen.get_state(), 'torch': torch.get_rng_state()}
    rngs = [None] * world_size
    if ddp:
        torch.distributed.all_gather_object(rngs, rng)
    else:
        rngs = [rng]
    if master:
        ckpt = dict(model=raw_model.state_dict(), optimizer=optimizer.state_dict(), model_args=model_args,
                    iter_num=iter_num, best_val_loss=best_val_loss, config=config, rng=rngs, world_size=world_size)
        torch.save(ckpt, ckpt_path + '.tmp')
        os.replace(ckpt_path + '.tmp', ckpt_path)  # atomic: a crash mid-save keeps the previous checkpoint


def log(record):
    if master:
        with open(os.path.join(out_dir, 'metrics.jsonl'), 'a') as f:
            f.write(json.dumps(record) + '\n')


def fmt_time(s):
    return f"{int(s // 3600)}h{int(s % 3600 // 60):02d}m" if s >= 3600 else f"{int(s // 60)}m{int(s % 60):02d}s"


tokens_per_iter = gradient_accumulation_steps * world_size * batch_size * block_size
print0(f"{dataset}: {vocab_size} token vocabulary ({meta.get('tokenizer')}); {tokens_per_iter:,} tokens per "
       f"iteration; device {device}, {dtype}, {world_size} process(es)")
if eval_only:
    losses = estimate_loss([s for s in ('val', 'test') if s in splits])
    print0(' | '.join(f"{s} loss {v:.4f} ppl {math.exp(v):.2f}" for s, v in losses.items()))
    sys.exit(0)

# -----------------------------------------------------------------------------
# the loop

if master and init_from == 'scratch':
    open(os.path.join(out_dir, 'metrics.jsonl'), 'w').close()  # a fresh run starts a fresh log
log(dict(event='start', iter=iter_num, config=config, params=raw_model.get_num_params(),
         qk_params=raw_model.get_num_qk_params(), world_size=world_size))
first_batch_sum = None
t_start = time.time()
t0 = time.time()
train_time, done_iters, start_iter = 0.0, 0, iter_num
while True:
    lr = get_lr(iter_num) if decay_lr else learning_rate
    for group in optimizer.param_groups:
        group['lr'] = lr
    out_of_time = time_budget > 0 and train_time >= time_budget
    if ddp and time_budget > 0:  # every rank must stop at the same iteration: rank 0's clock decides
        flag = torch.tensor(float(out_of_time), device=device)
        torch.distributed.broadcast(flag, 0)
        out_of_time = bool(flag.item())
    last = iter_num >= max_iters or out_of_time
    if iter_num % eval_interval == 0 or last:
        losses = estimate_loss()
        print0(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}, "
               f"val ppl {math.exp(losses['val']):.2f}")
        log(dict(event='eval', iter=iter_num, train_loss=losses['train'], val_loss=losses['val'],
                 val_ppl=math.exp(losses['val']), tokens=iter_num * tokens_per_iter, time=train_time))
        if losses['val'] < best_val_loss or always_save_checkpoint:
            best_val_loss = min(best_val_loss, losses['val'])
            if iter_num > start_iter or last:
                save_checkpoint()
        t0 = time.time()  # evaluation time is not training time
    if last:
        break
    # forward backward update, with optional gradient accumulation to simulate larger batch size
    for micro_step in range(gradient_accumulation_steps):
        X, Y = get_batch('train', train_gen)
        if first_batch_sum is None:
            first_batch_sum = (X * torch.arange(X.numel(), device=X.device).view_as(X)).sum().item()
        if ddp:  # sync gradients only on the last micro-step; must be set before the forward pass
            model.require_backward_grad_sync = micro_step == gradient_accumulation_steps - 1
        with autocast:
            logits, loss = model(X, Y)
            loss = loss / gradient_accumulation_steps
        scaler.scale(loss).backward()
    lossf = loss.item() * gradient_accumulation_steps
    finite = math.isfinite(lossf)
    if ddp:  # stop together: a rank that leaves alone would hang the others in the next all-reduce
        flag = torch.tensor(float(finite), device=device)
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
        finite = bool(flag.item())
    if not finite:
        print(f"error: the loss is not finite at iteration {iter_num} (here: {lossf}); the run stopped. Lower "
              f"--learning_rate or use --dtype=float32; resume from the last good checkpoint with --init_from=resume",
              file=sys.stderr)
        shutdown(3)
    if grad_clip > 0:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    # timing and logging
    dt = time.time() - t0
    t0 = time.time()
    train_time += dt
    done_iters += 1
    iter_num += 1
    if iter_num % log_interval == 0 or iter_num == 1:
        per_iter = train_time / done_iters
        left = (max_iters - iter_num) * per_iter
        if time_budget > 0:
            left = min(left, time_budget - train_time)
        print0(f"iter {iter_num}/{max_iters} | loss {lossf:.4f} | lr {lr:.2e} | {dt * 1000:.0f} ms/iter | "
               f"{tokens_per_iter / dt:,.0f} tok/s | eta {fmt_time(max(left, 0))}")
        log(dict(event='train', iter=iter_num, loss=lossf, lr=lr, ms=dt * 1000, tok_s=tokens_per_iter / dt,
                 time=train_time))

if 'test' in splits:
    test_loss = estimate_loss(['test'])['test']
    print0(f"test loss {test_loss:.4f}, test ppl {math.exp(test_loss):.2f}")
    log(dict(event='test', iter=iter_num, test_loss=test_loss, test_ppl=math.exp(test_loss)))
print0(f"done: {iter_num} iterations, {fmt_time(time.time() - t_start)}; checkpoint {ckpt_path}")
if ddp:
    # sanity check: every rank holds the same weights, after drawing different batches
    sums = torch.stack([torch.stack((p.double().sum(), p.double().pow(2).sum())) for p in raw_model.parameters()])
    gathered = [torch.zeros_like(sums) for _ in range(world_size)]
    torch.distributed.all_gather(gathered, sums)
    batches = [None] * world_size
    torch.distributed.all_gather_object(batches, first_batch_sum)
    same = all(torch.equal(g, gathered[0]) for g in gathered)
    print0(f"ddp check: {world_size} ranks, identical weights: {same}, distinct batches: "
           f"{len(set(batches)) == world_size}")
    torch.distributed.barrier()
    shutdown(0)
