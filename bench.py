"""
Speed: time attention variants against standard (a training step, a forward pass, generation with and without the
KV cache) next to the FLOP model's ratio; the GPU recipe and the check to run on a first GPU.

  python bench.py                                     # standard vs coupled, small preset, CPU-friendly
  python bench.py --preset=60m --batch_size=4 --block_size=256 --attn=standard,coupled,euler,uncoupled
  python bench.py --preset=60m --device=cuda --compile=True --batch_size=16 --block_size=1024
  python bench.py --plan --world_size=8               # the GPU recipe: commands, tokens, GPU time (for 8 GPUs)
  python bench.py --gpu_check                         # on one GPU, ~3 minutes: the recipe's step, eager and compiled

The tables of train.py runs are results/report.py's.
"""
import argparse
import ctypes
import ctypes.util
import json
import math
import sys
import textwrap
import time
from contextlib import nullcontext
from statistics import median

import torch
from torch._dynamo.utils import counters

from model import (GPU_PEAK_FLOPS, PRESETS, GPT, CausalSelfAttention, GPTConfig, attn_names, autocast_dtype,
                   find_device, flops_per_token, peak_flops, qk_flags_read)

MODES = ('train', 'forward', 'generate')


def flop_ratio(cfg, T):  # the FLOP model: cfg's variant over standard attention of its shape
    return flops_per_token(cfg, T) / flops_per_token(GPTConfig(**{**cfg.__dict__, 'attn': 'standard'}), T)


# -----------------------------------------------------------------------------
# --plan: the paper's 60M WikiText-103 ablation, a command per run, for 1 GPU or more.
# 20,000 steps of 65,536 tokens (128 sequences of 512) = 1.31B tokens (our choice: the paper's budget is not public).
# Batch flags are per rank: more GPUs, fewer sequences or micro-steps each, the same 128 sequences per step.

RECIPE = ("{launch} --preset=60m --dataset=wikitext103 --block_size=512 --batch_size={batch} "
          "--gradient_accumulation_steps={accum} --learning_rate=6e-4 --min_lr=6e-5 --warmup_iters=1000 "
          "--max_iters=20000 --eval_interval=1000{evals} --compile=True")
SEQUENCES_PER_STEP = 128
RECIPE_RUNS = [('standard', '--attn=standard'), ('coupled', '--attn=coupled'), ('euler', '--attn=euler'),
               ('uncoupled', '--attn=uncoupled'), ('coupled-steps7', '--attn=coupled --qk_steps=7'),
               ('invertible', '--attn=invertible'), ('diff', '--attn=diff'), ('diff+coupled', '--attn=diff+coupled'),
               ('standard-2.4x', '--attn=standard --max_iters=48000')]  # the paper's compute match: 2.4x the tokens
PLAN_GPUS = {'H100': 'NVIDIA H100 80GB HBM3', 'A100': 'NVIDIA A100-SXM4-80GB'}  # SXM
UTILISATION = 0.35  # of the bf16 peak: an estimate (never measured on these GPUs), for training and evaluation
COMPILE_MINUTES = 1.5  # torch.compile's first step, each rank at once: an estimate (1-2 minutes)
EVAL_ITERS, EVAL_BATCH = 40, 32  # train.py's --eval_iters, the 1-GPU recipe's batch: the estimates' sequences
DIAG_TOKENS = 8192 + 8 * 512  # rank 0's diagnostics at an eval: the q/k map's 8,192 tokens, 8 sequences' attention


def recipe(world_size):
    """The recipe's command for world_size GPUs (8 a node): 32 sequences a micro-step while they last, then fewer."""
    per_rank = SEQUENCES_PER_STEP // world_size
    batch = min(32, per_rank)
    launch = ('python train.py' if world_size == 1 else f'torchrun --standalone --nproc_per_node={world_size} train.py'
              if world_size <= 8 else f'torchrun --nnodes={world_size // 8} --nproc_per_node=8 --node_rank=$NODE_RANK '
              '--rdzv_backend=c10d --rdzv_endpoint=$FIRST_NODE:29500 train.py')
    evals = '' if batch == EVAL_BATCH else f' --eval_iters={EVAL_ITERS * EVAL_BATCH // batch}'  # the same 1,280
    return RECIPE.format(launch=launch, batch=batch, accum=per_rank // batch, evals=evals)


def plan_minutes(cfg, T, tokens, evals, world_size, peak):
    """A run's wall-clock minutes, each part an estimate: training (the FLOP model at UTILISATION, split over the
    ranks); evaluation (evals x a forward, a third of a training step's FLOPs, of the estimates' 2 x EVAL_ITERS x
    EVAL_BATCH sequences split by sequence over the ranks, plus rank 0's DIAG_TOKENS, which do not split); compile."""
    rate = UTILISATION * peak  # FLOP/s on one GPU
    forward = flops_per_token(cfg, T) / 3
    train = tokens * flops_per_token(cfg, T) / (rate * world_size)
    evaluation = evals * forward * (2 * EVAL_ITERS * EVAL_BATCH * T / world_size + DIAG_TOKENS) / rate
    return dict(train=train / 60, eval=evaluation / 60, compile=COMPILE_MINUTES)


def plan(world_size):
    """The GPU recipe as a markdown table: each run's command, tokens and wall-clock time (plan_minutes: training
    from the FLOP model, evaluations and compile; all estimates)."""
    flags = lambda text: dict(a.removeprefix('--').split('=', 1) for a in text.split() if a[:2] == '--' and '=' in a)
    command = recipe(world_size)
    base, gpus = flags(command), f"{world_size}x " if world_size > 1 else ''
    step = world_size * math.prod(int(base[k]) for k in ('batch_size', 'gradient_accumulation_steps', 'block_size'))
    print(f"R=\"{command}\"\n")
    accum = int(base['gradient_accumulation_steps'])
    if world_size > 1:  # batch flags are per rank
        print(f"{step:,} tokens per step: {world_size} GPUs x {base['batch_size']} sequences x {accum} "
              f"micro-step{'s' * (accum > 1)} x {base['block_size']} tokens\n")
    print("| run | command | tokens | GFLOP/token | " + ' | '.join(f"{gpus}{g}" for g in PLAN_GPUS)
          + " |\n|---|---|---|---|" + '---|' * len(PLAN_GPUS))
    fmt = lambda m: f"{m:.0f} min" if m < 120 else f"{m / 60:.1f} h"
    for name, extra in RECIPE_RUNS:
        f = base | flags(extra)
        cfg = GPTConfig(attn=f['attn'], qk_steps=int(f.get('qk_steps', 1)), **PRESETS[f['preset']])
        tokens, T = step * int(f['max_iters']), int(f['block_size'])
        evals = int(f['max_iters']) // int(f['eval_interval']) + 1  # at 0, every eval_interval, and the last
        parts = [plan_minutes(cfg, T, tokens, evals, world_size, GPU_PEAK_FLOPS[g]) for g in PLAN_GPUS.values()]
        if name == 'standard':
            first, first_evals = parts, evals
        print(f"| {name} | `$R {extra} --out_dir=runs/60m/{name}` | {tokens / 1e9:.2f}B | "
              f"{flops_per_token(cfg, T) / 1e9:.3f} | " + ' | '.join(fmt(sum(p.values())) for p in parts) + ' |')
    shared = 'on one GPU' if world_size == 1 else f'shared by {world_size} GPUs'
    note = (f"Each time is an estimate, not a measurement. Training is most of it, from the FLOP model at "
            f"{UTILISATION:.0%} of the GPU's bf16 peak. Then come {first_evals} evaluations, each of "
            f"{EVAL_ITERS * EVAL_BATCH:,} sequences of each split {shared}, and the diagnostics. Compilation adds "
            f"about {COMPILE_MINUTES} minutes. The parts for standard are "
            + ', '.join(f"{g} {p['train']:.0f} + {p['eval']:.1f} + {p['compile']} min"
                        for g, p in zip(PLAN_GPUS, first)) + '.')
    print('\n' + textwrap.fill(note, 116))


# -----------------------------------------------------------------------------
# timing

def keep_freed_memory():
    """glibc returns large freed blocks to the OS, so each step of a GPT-2-vocabulary model page-faults its 200 MB
    logits back in (+10% time, +-5% noise on our 2-core VM). Keep them, as PyTorch's CUDA allocator does. glibc only."""
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library('c')).mallopt
    except (OSError, AttributeError, TypeError):
        return  # not glibc
    mallopt(-3, 1 << 30)        # M_MMAP_THRESHOLD: blocks under 1 GiB come from the heap, reused after free
    mallopt(-1, (1 << 31) - 1)  # M_TRIM_THRESHOLD: never shrink the heap


def why(e):  # an exception, in a few words
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:100]}"


def timing(args, variants, modes, device, sync_check=False):
    """Time every (variant, mode), interleaved; returns {(variant, mode): record}. sync_check (CUDA): a host sync in a
    timed step raises, after the models are built and warmed up (where copies to the GPU and compiling sync)."""
    cuda = device.startswith('cuda')
    dtype = getattr(torch, args.dtype)
    autocast = torch.autocast(device.split(':')[0], dtype=dtype) if dtype != torch.float32 else nullcontext()
    B, T = args.batch_size, args.block_size
    gen_block = max(T, args.new_tokens + 1)  # generation never refills the cache window
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    peak_flop = peak_flops(device, args.dtype)  # for MFU; None: unknown

    models, flop = {}, {}
    for v in variants:  # standard first
        torch.manual_seed(0)
        cfg = GPTConfig(attn=v, block_size=gen_block, vocab_size=args.vocab_size, qk_steps=args.qk_steps,
                        qk_hidden=args.qk_hidden, **PRESETS[args.preset])
        model = GPT(cfg, verbose=False)
        flop[v] = flop_ratio(cfg, T) if 'train' in modes else None  # (an entry without a price fails here, first)
        if v != 'standard':  # same weights as standard wherever the architectures agree: CPU speed depends on
            model.load_state_dict(models['standard'][0].state_dict(), strict=False)  # values (up to +-5%)
        model = model.to(device)
        opt = model.configure_optimizers(0.1, 1e-4, (0.9, 0.95), device.split(':')[0])
        models[v] = (model, torch.compile(model) if args.compile == 'True' else model, opt)
    compiled = {v: False for v in variants}  # whether compile really ran (Dynamo made a graph), per variant

    x = torch.randint(0, args.vocab_size, (B, T), device=device)

    def step(mode, model, fwd, opt):  # one timed call
        if mode == 'train':
            with autocast:
                loss = fwd(x, x)[1]
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return
        with torch.no_grad(), autocast:
            if mode == 'forward':
                fwd(x)
            else:  # with the KV cache, or recomputing the context
                model.generate(x[:1, :1], args.new_tokens, temperature=0, use_cache=mode == 'generate')

    cfg0 = models['standard'][0].config
    print(f"bench: preset {args.preset} ({cfg0.n_layer}x{cfg0.n_embd}, {cfg0.n_head} heads), batch {B}x{T}, vocab "
          f"{args.vocab_size}, {device} ({torch.get_num_threads()} threads), {args.dtype}, compile={args.compile}")
    results = {}
    for mode in [m for m in (*MODES, 'generate-nocache') if m.split('-')[0] in modes]:
        # generation is slow to time: 1/3 of the rounds; recomputation (O(n^2) work) once, warmed up by the cached run
        iters = {'generate': max(1, args.iters // 3), 'generate-nocache': 1}.get(mode, args.iters)
        start = time.perf_counter()
        for v in variants:  # warm-up (and compilation: at least one step)
            graphs = counters['stats']['unique_graphs']
            for _ in range({'generate': 1, 'generate-nocache': 0}.get(mode, max(args.warmup, args.compile == 'True'))):
                try:
                    step(mode, *models[v])
                except Exception as e:  # a compile failure: this variant runs eager
                    if models[v][1] is models[v][0]:
                        raise
                    e = getattr(e, 'inner_exception', e)  # the error inside Dynamo's BackendCompilerFailed
                    print(f"warning: torch.compile failed for {v} ({why(e)}); eager")
                    models[v] = (models[v][0], models[v][0], models[v][2])
            compiled[v] |= counters['stats']['unique_graphs'] > graphs and models[v][1] is not models[v][0]
        warm = time.perf_counter() - start
        times, peak = {v: [] for v in variants}, {}
        if sync_check:
            torch.cuda.set_sync_debug_mode('error')  # until the timed rounds end (torch.cuda.synchronize is allowed)
        for r in range(iters):  # A B B A ...: drift in machine speed, and going first, hit all alike
            for v in (variants if r % 2 == 0 else variants[::-1]):
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
                sync()
                t0 = time.perf_counter()
                step(mode, *models[v])
                sync()
                times[v].append(time.perf_counter() - t0)
                if cuda:
                    peak[v] = max(peak.get(v, 0), torch.cuda.max_memory_allocated() / 2**20)
            spent = time.perf_counter() - start
            print(f"  {mode}: round {r + 1}/{iters} | warm-up {warm:.0f} s | {spent:.0f} s so far, about "
                  f"{(spent - warm) / (r + 1) * (iters - r - 1):.0f} s left", flush=True)
        if sync_check:
            torch.cuda.set_sync_debug_mode('default')
        ntok = args.new_tokens if mode.startswith('generate') else B * T
        for v in variants:
            ms = 1000 * median(times[v])
            flops = flops_per_token(models[v][0].config, T) * ntok if mode == 'train' else None
            # the median of each round's ratio to standard's: a slow spell (shared VM: +-10% for seconds) cancels
            ratio = median(t / t0 for t, t0 in zip(times[v], times['standard']))
            results[(v, mode)] = dict(attn=v, mode=mode, ms_per_iter=ms, tokens_per_s=ntok / ms * 1000,
                                      ratio_vs_standard=ratio, peak_mem_mb=peak.get(v), iters=iters,
                                      flop_model_ratio=flop[v] if mode == 'train' else None,
                                      mfu=flops / (ms / 1000) / peak_flop if flops and peak_flop else None,
                                      compiled=compiled[v])
            if mode == 'generate-nocache':  # after 'generate'
                results[(v, mode)]['cache_speedup'] = ms / results[(v, 'generate')]['ms_per_iter']
    return results


def print_timing(results, args):
    w = max(len(r['attn']) for r in results.values()) + 2  # the widest --attn name, e.g. diff+symplectic-euler
    print(f"\n{'attn':<{w}}{'mode':<18}{'compiled':>9}{'ms/iter':>10}{'tokens/s':>12}{'MFU':>7}{'peak MB':>9}"
          f"{'vs standard':>13}{'FLOP model':>12}")
    for r in results.values():
        peak = f"{r['peak_mem_mb']:.0f}" if r['peak_mem_mb'] else '-'
        flop = f"{r['flop_model_ratio']:.4f}" if r['flop_model_ratio'] else ''
        mfu = f"{r['mfu']:.1%}" if r['mfu'] else '-'
        print(f"{r['attn']:<{w}}{r['mode']:<18}{'yes' if r['compiled'] else 'no':>9}{r['ms_per_iter']:>10.1f}"
              f"{r['tokens_per_s']:>12,.0f}{mfu:>7}{peak:>9}{r['ratio_vs_standard']:>13.3f}{flop:>12}")
    for r in results.values():
        if 'cache_speedup' in r:
            print(f"{r['attn']}: KV cache generates {args.new_tokens} tokens {r['cache_speedup']:.1f}x as fast "
                  f"as recomputing the context (a full forward pass per new token)")
    flops = {r['attn']: r['flop_model_ratio'] for r in results.values() if r['flop_model_ratio']}
    if len(flops) > 1:
        extra = ', '.join(f"{v} {100 * (e - 1):+.2f}%" for v, e in flops.items() if v != 'standard')
        print(f"FLOP model: vs standard, {extra} to a training step (matmuls, attention and the dynamics' "
              "elementwise work)")


# -----------------------------------------------------------------------------
# --gpu_check: the first thing to run on a GPU

def qk_bf16_error(device, attn='coupled', batch_size=2, block_size=512):
    """The q/k map of one layer at 60m's head shape under bf16 autocast against float64, on the same bf16 q, k (as
    autocast's c_attn gives them, at their initial spread): the relative error of its output (q', k') and of its
    move (q' - q, k' - k), the larger of q's and k's."""
    torch.manual_seed(0)
    cfg = GPTConfig(attn=attn, **(PRESETS['60m'] | dict(n_layer=1)), vocab_size=64)
    qk, hs = GPT(cfg, verbose=False).transformer.h[0].attn.qk.to(device), cfg.n_embd // cfg.n_head
    q, k = ((0.02 * math.sqrt(cfg.n_embd) * torch.randn(batch_size, cfg.n_head, block_size, hs)).bfloat16().to(device)
            for _ in range(2))
    with torch.no_grad():
        want = [w.float() for w in qk.double()(q.double(), k.double())]  # the reference in float64: no TF32
        qk.float()
        with torch.autocast(device.split(':')[0], dtype=torch.bfloat16):
            got = qk(q, k)
    rel = lambda err, ref: max((e.norm() / r.norm()).item() for e, r in zip(err, ref))
    return (rel([g.float() - w for g, w in zip(got, want)], want),
            rel([g.float() - w for g, w in zip(got, want)], [w - x.float() for w, x in zip(want, (q, k))]))


def gpu_check(args, device):
    """The recipe's training step (60m, GPT-2 vocabulary, 32 x 512 tokens, bf16 or fp16) timed eager and compiled,
    standard and coupled, with MFU; diff's two SDPA layouts; the q/k map in bf16 against float32. Random tokens."""
    t_start, name = time.time(), torch.cuda.get_device_name(device) if device.startswith('cuda') else device
    cfg = GPTConfig(vocab_size=args.vocab_size, **PRESETS[args.preset])
    flop = flops_per_token(cfg, args.block_size) * args.batch_size * args.block_size  # one training step
    peak = peak_flops(device, args.dtype)
    steps = 4 * (max(args.warmup, 1) + args.iters)  # (standard, coupled, diff one call, diff split) x eager, compiled
    print(f"gpu check: {name}, preset {args.preset}, {args.batch_size} x {args.block_size} tokens, vocabulary "
          f"{args.vocab_size}, {args.dtype}; {flop / 1e12:.1f} TFLOP a step. Estimate: {2 * steps} steps"
          + (f" ({2 * steps * flop / (0.3 * peak):.0f} s at 30% MFU)" if peak else '')
          + ", plus about a minute's compile per compiled variant")
    if not peak:
        print(f"note: no MFU: {name!r} is not in model.GPU_PEAK_FLOPS; set GPU_PEAK_TFLOPS to its dense bf16 TFLOP/s")
    out, move = qk_bf16_error(device)
    print(f"q/k map (coupled) in bf16 against float64: output {out:.2%}, its move {move:.2%} (relative errors)")
    records, cuda, synced = [], device.startswith('cuda'), []
    for compiled in ('False', 'True'):  # eager, then compiled as the recipe trains
        args.compile = compiled
        try:  # CUDA: a host sync in a timed step is an error (a step queues its work; it never waits for the GPU)
            res = timing(args, ['standard', 'coupled'], ['train'], device, sync_check=cuda)
        except RuntimeError as e:
            if not (cuda and 'synchroniz' in str(e)):
                raise
            torch.cuda.set_sync_debug_mode('default')
            synced.append(f"{'compiled' if compiled == 'True' else 'eager'} ({why(e)})")
            res = timing(args, ['standard', 'coupled'], ['train'], device)
        print_timing(res, args)
        records += list(res.values())
    args.compile, args.qk_steps = 'False', 7  # coupled --qk_steps=7 (14 forces a layer) beside steps 1, eager
    res = timing(args, ['standard', 'coupled'], ['train'], device)
    records.append(res[('coupled', 'train')] | dict(attn='coupled (qk_steps=7)'))
    print(f"coupled --qk_steps=7 / standard, eager: {res[('coupled', 'train')]['ratio_vs_standard']:.3f}")
    args.qk_steps = 1
    print("sync debug mode: skipped (CUDA only)" if not cuda else
          f"sync debug mode 'error': a host sync in a training step, {', '.join(synced)}" if synced else
          "sync debug mode 'error': a training step of standard and coupled makes no host sync, eager or compiled")
    layouts = {}
    for split in (False, True):  # diff's attention: one SDPA call per sub-head (v at 2hs), or per half of v (flash)
        CausalSelfAttention.split_v = split
        res = timing(args, ['standard', 'diff'], ['train'], device)
        layouts[split] = res[('diff', 'train')]
        records.append(layouts[split] | dict(attn=f"diff (split_v={split})"))
    CausalSelfAttention.split_v = None
    faster = min(layouts, key=lambda s: layouts[s]['ms_per_iter'])
    print(f"diff, eager: v at 2hs {layouts[False]['ms_per_iter']:.1f} ms, v's halves (flash-eligible) "
          f"{layouts[True]['ms_per_iter']:.1f} ms; faster: split_v={faster} (the default on CUDA: split_v=True)")
    by = {(r['attn'], r['compiled']): r for r in records if r['mode'] == 'train'}
    for compiled in (False, True):
        if ('coupled', compiled) in by:
            print(f"coupled / standard, {'compiled' if compiled else 'eager'}: "
                  f"{by[('coupled', compiled)]['ratio_vs_standard']:.3f}")
    if not any(r['compiled'] for r in records):
        print("compile did not run: every figure above is eager")
    print(f"gpu check done in {time.time() - t_start:.0f} s")
    return records


# -----------------------------------------------------------------------------

class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not a usage dump
        sys.exit(f"error: {message}; see python bench.py --help")


def main():
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--preset', choices=list(PRESETS), help='default small (--gpu_check: 60m)')
    p.add_argument('--attn', default='standard,coupled', help=f"comma-separated, from: {', '.join(attn_names())}")
    p.add_argument('--mode', default='train,forward,generate', help='comma-separated, from: ' + ', '.join(MODES))
    p.add_argument('--batch_size', type=int, help='default 4 (--gpu_check: 32)')
    p.add_argument('--block_size', type=int, help='default 256 (--gpu_check: 512)')
    p.add_argument('--vocab_size', type=int, default=50257, help="GPT-2's, as in the paper")
    p.add_argument('--qk_steps', type=int, default=1)
    p.add_argument('--qk_hidden', type=int, default=GPTConfig.qk_hidden, help='hidden width of the potential')
    p.add_argument('--new_tokens', type=int, default=256, help='tokens generated in --mode=generate')
    p.add_argument('--iters', type=int, default=6, help='timed rounds per (variant, mode); generation: fewer')
    p.add_argument('--warmup', type=int, default=3, help='untimed rounds first (CPU: the heap settles)')
    p.add_argument('--device', default='auto')
    p.add_argument('--dtype', choices=['float32', 'bfloat16', 'float16'],
                   help="default float32 (--gpu_check: bf16 where the GPU has it natively, else float16)")
    p.add_argument('--compile', default='False', choices=['True', 'False'])
    p.add_argument('--json_out', help='a JSON record per (variant, mode) into this file')
    p.add_argument('--plan', action='store_true', help="print the paper's 60M ablation as GPU commands with their cost")
    p.add_argument('--world_size', type=int, default=1, help='--plan: GPUs in all (8 a node)')
    p.add_argument('--gpu_check', action='store_true', help="the recipe's training step on one CUDA GPU (60m, "
                   "32 x 512 tokens, bf16 or fp16), eager and compiled, with MFU")
    args = p.parse_args()
    if args.plan:
        if SEQUENCES_PER_STEP % args.world_size or not (args.world_size <= 8 or args.world_size % 8 == 0):
            p.error(f"--world_size={args.world_size}: the recipe's {SEQUENCES_PER_STEP} sequences per step split "
                    "evenly over 1, 2, 4, 8, 16, 32, 64 or 128 GPUs")
        return plan(args.world_size)
    gpu = dict(preset='60m', batch_size=32, block_size=512) if args.gpu_check else {}
    for k, default in dict(preset='small', batch_size=4, block_size=256).items():
        if getattr(args, k) is None:  # a flag wins, then the GPU check's shape, then the CPU-friendly one
            setattr(args, k, gpu.get(k, default))
    variants, modes = args.attn.split(','), args.mode.split(',')
    for flag, given, known in (('attn', variants, attn_names()), ('mode', modes, MODES)):
        for x in given:
            if x not in known:
                p.error(f"--{flag}: {x!r} is not one of {', '.join(known)}")
    variants = ['standard'] + [v for v in variants if v != 'standard']  # first: every ratio is against it
    for flag in ('qk_steps', 'qk_hidden'):
        if getattr(args, flag) != p.get_default(flag) and not any(flag in qk_flags_read(v) for v in variants):
            p.error(f"--attn={args.attn} reads no --{flag}; drop it, or choose a variant that reads it")
    for v in variants:
        try:
            GPTConfig(attn=v, qk_steps=args.qk_steps, qk_hidden=args.qk_hidden, **PRESETS[args.preset])
        except ValueError as e:  # e.g. --qk_steps=8
            p.error(str(e))
    try:
        device = find_device(args.device)
    except ValueError as e:
        p.error(str(e))
    if args.gpu_check and not torch.cuda.is_available():
        p.error("--gpu_check needs a CUDA GPU and there is none here; on a CPU, time a step with python bench.py "
                "--preset=60m --mode=train")
    args.dtype = args.dtype or (autocast_dtype(device) if args.gpu_check else 'float32')
    torch.set_float32_matmul_precision('high')  # float32 matmuls on TF32 tensor cores (Ampere on)
    if not device.startswith('cuda'):
        keep_freed_memory()
    if args.gpu_check:
        results = dict(enumerate(gpu_check(args, device)))
    else:
        results = timing(args, variants, modes, device)
        print_timing(results, args)
    if args.json_out:
        run = dict(preset=args.preset, batch_size=args.batch_size, block_size=args.block_size, device=device,
                   dtype=args.dtype, threads=torch.get_num_threads())  # each record: compiled, really
        with open(args.json_out, 'w') as f:
            f.writelines(json.dumps(r | run) + '\n' for r in results.values())
        print(f"wrote {args.json_out}")


if __name__ == '__main__':
    main()
