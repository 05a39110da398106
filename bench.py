"""
Speed: time attention variants against standard (a training step, a forward pass, generation with and without the
KV cache) beside the FLOP model's ratio; plan a GPU run, and check a first GPU.

  python bench.py                        # standard vs coupled, small preset, on a CPU
  python bench.py --preset=60m --attn=standard,coupled,euler --mode=train --compile=True
  python bench.py --plan --world_size=8  # the GPU recipe: commands, tokens, GPU time
  python bench.py --gpu_check            # on one GPU, ~3 minutes: the recipe's step, eager and compiled

results/speed.py makes the timings of results/speed.md.
"""
import argparse
import math
import sys
import time
from contextlib import nullcontext
from statistics import median

import torch
from torch._dynamo.utils import counters

from model import (GPU_PEAK_FLOPS, PRESETS, GPT, CausalSelfAttention, GPTConfig, attn_names, autocast_dtype,
                   find_device, flops_per_token, peak_flops, qk_flags_read)

MODES = ('train', 'forward', 'generate')


def flop_ratio(cfg, T):  # the FLOP model: cfg's variant over standard of its shape
    return flops_per_token(cfg, T) / flops_per_token(GPTConfig(**{**cfg.__dict__, 'attn': 'standard'}), T)


# -----------------------------------------------------------------------------
# --plan: the paper's 60M WikiText-103 ablation, a command per run, on any number of GPUs. 1.31B tokens: ours, as
# the paper's budget is not public.

RECIPE = ("{launch} --preset=60m --dataset=wikitext103 --block_size=512 --batch_size={batch} "
          "--gradient_accumulation_steps={accum} --learning_rate=6e-4 --min_lr=6e-5 --warmup_iters=1000 "
          "--max_iters=20000 --eval_interval=1000{evals} --compile=True")
# the last: the paper's compute match, standard with 2.4x the tokens
RECIPE_RUNS = {'standard': '--attn=standard', 'coupled': '--attn=coupled', 'euler': '--attn=euler',
               'uncoupled': '--attn=uncoupled', 'coupled-steps7': '--attn=coupled --qk_steps=7',
               'invertible': '--attn=invertible', 'diff': '--attn=diff', 'diff+coupled': '--attn=diff+coupled',
               'standard-2.4x': '--attn=standard --max_iters=48000'}
PLAN_GPUS = {'H100': 'NVIDIA H100 80GB HBM3', 'A100': 'NVIDIA A100-SXM4-80GB'}  # SXM
# estimates, never measured on these GPUs: the share of the bf16 peak, and the first step's compile on each rank
UTILISATION, COMPILE_MINUTES = 0.35, 1.5
EVAL_ITERS, EVAL_BATCH = 40, 32  # an evaluation: 1,280 sequences, as train.py's --eval_iters at 32 a batch


def plan_minutes(cfg, T, tokens, world_size, peak):  # training split over the ranks, then the compile
    return tokens * flops_per_token(cfg, T) / (UTILISATION * peak * world_size) / 60 + COMPILE_MINUTES


def plan(world_size):
    """The GPU recipe for world_size GPUs (8 a node) as a markdown table: each run's command, tokens and estimated
    time. A rank takes 32 sequences a micro-step while they last."""
    per_rank = 128 // world_size
    B = min(32, per_rank)
    accum = per_rank // B
    launch = 'python train.py'
    if world_size > 8:
        launch = (f'torchrun --nnodes={world_size // 8} --nproc_per_node=8 --node_rank=$NODE_RANK '
                  '--rdzv_backend=c10d --rdzv_endpoint=$FIRST_NODE:29500 train.py')
    elif world_size > 1:
        launch = f'torchrun --standalone --nproc_per_node={world_size} train.py'
    evals = '' if B == EVAL_BATCH else f' --eval_iters={EVAL_ITERS * EVAL_BATCH // B}'
    command = RECIPE.format(launch=launch, batch=B, accum=accum, evals=evals)
    flags = lambda text: dict(a[2:].split('=', 1) for a in text.split() if a[:2] == '--' and '=' in a)
    base = flags(command)
    T = int(base['block_size'])
    step = world_size * B * accum * T
    print(f"R=\"{command}\"\n")
    if world_size > 1:  # batch flags are per rank
        print(f"{step:,} tokens per step: {world_size} GPUs x {B} sequences x {accum} "
              f"micro-step{'s' * (accum > 1)} x {T} tokens\n")
    gpus = f"{world_size}x " if world_size > 1 else ''
    print("| run | command | tokens | GFLOP/token | " + ' | '.join(gpus + g for g in PLAN_GPUS)
          + " |\n|---|---|---|---|" + '---|' * len(PLAN_GPUS))
    fmt = lambda m: f"{m:.0f} min" if m < 120 else f"{m / 60:.1f} h"
    for name, extra in RECIPE_RUNS.items():
        f = base | flags(extra)
        cfg = GPTConfig(attn=f['attn'], qk_steps=int(f.get('qk_steps', 1)), **PRESETS[f['preset']])
        tokens = step * int(f['max_iters'])
        minutes = [fmt(plan_minutes(cfg, T, tokens, world_size, GPU_PEAK_FLOPS[g])) for g in PLAN_GPUS.values()]
        print(f"| {name} | `$R {extra} --out_dir=runs/60m/{name}` | {tokens / 1e9:.2f}B | "
              f"{flops_per_token(cfg, T) / 1e9:.3f} | " + ' | '.join(minutes) + ' |')
    print(f"\nEach time is an estimate, not a measurement: training from the FLOP model at {UTILISATION:.0%} of the "
          f"GPU's bf16 peak,\nand {COMPILE_MINUTES} minutes of compilation. Evaluation adds under 1%.")


# -----------------------------------------------------------------------------
# timing

def why(e):  # an exception, in a few words
    return f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:100]}"


def timing(args, variants, modes, device, sync_check=False):
    """Time every (variant, mode) in interleaved rounds: {(variant, mode): record}. sync_check (CUDA): a host sync
    in a timed step raises (warm-up may sync)."""
    cuda = device.startswith('cuda')
    autocast = (torch.autocast(device.split(':')[0], dtype=getattr(torch, args.dtype))
                if args.dtype != 'float32' else nullcontext())
    B, T = args.batch_size, args.block_size
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    models, fwd, opt, flop = {}, {}, {}, {}
    for v in variants:  # standard first
        torch.manual_seed(0)
        # block_size: generation never refills the cache window
        cfg = GPTConfig(attn=v, block_size=max(T, args.new_tokens + 1), vocab_size=args.vocab_size,
                        qk_steps=args.qk_steps, qk_hidden=args.qk_hidden, **PRESETS[args.preset])
        model = GPT(cfg, verbose=False)
        flop[v] = flop_ratio(cfg, T) if 'train' in modes else None  # (no price: fails here)
        # standard's weights where the architectures agree: a CPU's speed depends on the values (+-5%)
        if v != 'standard':
            model.load_state_dict(models['standard'].state_dict(), strict=False)
        models[v] = model = model.to(device)
        opt[v] = model.configure_optimizers(0.1, 1e-4, (0.9, 0.95), device.split(':')[0])
        fwd[v] = torch.compile(model) if args.compile else model
    compiled = dict.fromkeys(variants, False)  # whether compile really ran (Dynamo made a graph)
    x = torch.randint(0, args.vocab_size, (B, T), device=device)

    def step(mode, v):
        if mode == 'train':
            with autocast:
                loss = fwd[v](x, x)[1]
            loss.backward()
            opt[v].step()
            opt[v].zero_grad(set_to_none=True)
            return
        with torch.no_grad(), autocast:
            if mode == 'forward':
                fwd[v](x)
            else:  # with the KV cache, or recomputing the context
                models[v].generate(x[:1, :1], args.new_tokens, temperature=0, use_cache=mode == 'generate')

    print(f"bench: preset {args.preset} ({cfg.n_layer}x{cfg.n_embd}, {cfg.n_head} heads), batch {B}x{T}, vocab "
          f"{args.vocab_size}, {device} ({torch.get_num_threads()} threads), {args.dtype}, compile={args.compile}")
    results, peak_flop = {}, peak_flops(device, args.dtype)  # None: unknown, no MFU
    # --mode=generate times two: with the KV cache, and recomputing the context
    for mode in modes + ['generate-nocache'] * ('generate' in modes):
        iters, warmups = args.iters, max(args.warmup, args.compile)  # compiling: at least one step
        if mode == 'generate':  # slow: a third of the rounds
            iters, warmups = max(1, args.iters // 3), 1
        elif mode == 'generate-nocache':  # once, warmed up by the cached run
            iters, warmups = 1, 0
        start = time.perf_counter()
        for v in variants:  # warm-up (compiling: at least one step)
            graphs = counters['stats']['unique_graphs']
            for _ in range(warmups):
                try:
                    step(mode, v)
                except Exception as e:  # a compile failure: this variant runs eager
                    if fwd[v] is models[v]:
                        raise
                    e = getattr(e, 'inner_exception', e)  # the error inside Dynamo's BackendCompilerFailed
                    print(f"warning: torch.compile failed for {v} ({why(e)}); eager")
                    fwd[v] = models[v]
            compiled[v] |= counters['stats']['unique_graphs'] > graphs and fwd[v] is not models[v]
        warm = time.perf_counter() - start
        times, peak = {v: [] for v in variants}, {}
        if sync_check:
            torch.cuda.set_sync_debug_mode('error')  # the timed rounds (torch.cuda.synchronize is allowed)
        for r in range(iters):  # A B B A ...: drift, and going first, hit all alike
            for v in (variants if r % 2 == 0 else variants[::-1]):
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
                sync()
                t0 = time.perf_counter()
                step(mode, v)
                sync()
                times[v].append(time.perf_counter() - t0)
                if cuda:
                    peak[v] = max(peak.get(v, 0), torch.cuda.max_memory_allocated() / 2**20)
            spent = time.perf_counter() - start
            print(f"  {mode}: round {r + 1}/{iters}, {spent:.0f} s so far, about "
                  f"{(spent - warm) / (r + 1) * (iters - r - 1):.0f} s left", flush=True)
        if sync_check:
            torch.cuda.set_sync_debug_mode('default')
        train, ntok = mode == 'train', args.new_tokens if mode.startswith('generate') else B * T
        for v in variants:
            ms = 1000 * median(times[v])
            flops = flops_per_token(models[v].config, T) * ntok if train and peak_flop else None
            # the median of each round's ratio to standard's: a slow spell of the machine cancels
            ratio = median(t / t0 for t, t0 in zip(times[v], times['standard']))
            results[v, mode] = dict(attn=v, mode=mode, ms_per_iter=ms, tokens=ntok, tokens_per_s=ntok / ms * 1000,
                                    ratio_vs_standard=ratio, peak_mem_mb=peak.get(v),
                                    flop_model_ratio=flop[v] if train else None,
                                    mfu=flops / (ms / 1000) / peak_flop if flops else None, compiled=compiled[v])
    return results


def print_timing(results):
    w = max(len(r['attn']) for r in results.values()) + 2
    print(f"\n{'attn':<{w}}{'mode':<18}{'compiled':>9}{'ms/iter':>10}{'tokens/s':>12}{'MFU':>7}{'peak MB':>9}"
          f"{'vs standard':>13}{'FLOP model':>12}")
    for r in results.values():
        peak = f"{r['peak_mem_mb']:.0f}" if r['peak_mem_mb'] else '-'
        flop = f"{r['flop_model_ratio']:.4f}" if r['flop_model_ratio'] else ''
        mfu = f"{r['mfu']:.1%}" if r['mfu'] else '-'
        print(f"{r['attn']:<{w}}{r['mode']:<18}{'yes' if r['compiled'] else 'no':>9}{r['ms_per_iter']:>10.1f}"
              f"{r['tokens_per_s']:>12,.0f}{mfu:>7}{peak:>9}{r['ratio_vs_standard']:>13.3f}{flop:>12}")


# -----------------------------------------------------------------------------
# --gpu_check: the first thing to run on a GPU

def qk_bf16_error(device):
    """Coupled's q/k map (60m's heads) under bf16 autocast against float64, on bf16 q, k at their initial spread:
    the relative errors of its output (q', k') and of its move (q' - q, k' - k), the larger of q's and k's."""
    torch.manual_seed(0)
    cfg = GPTConfig(attn='coupled', **(PRESETS['60m'] | dict(n_layer=1)), vocab_size=64)
    qk = GPT(cfg, verbose=False).transformer.h[0].attn.qk.to(device)
    shape = (2, cfg.n_head, 512, cfg.n_embd // cfg.n_head)
    q, k = ((0.02 * math.sqrt(cfg.n_embd) * torch.randn(shape)).bfloat16().to(device) for _ in range(2))
    with torch.no_grad():
        want = [w.float() for w in qk.double()(q.double(), k.double())]  # the reference in float64: no TF32
        qk.float()
        with torch.autocast(device.split(':')[0], dtype=torch.bfloat16):
            err = [g.float() - w for g, w in zip(qk(q, k), want)]
    rel = lambda ref: max((e.norm() / r.norm()).item() for e, r in zip(err, ref))
    return rel(want), rel([w - x.float() for w, x in zip(want, (q, k))])


def gpu_check(args, device):
    """The recipe's training step (60m, GPT-2 vocabulary, 32 x 512 tokens, bf16 or fp16) timed eager and compiled,
    standard and coupled, with MFU; diff's two SDPA layouts; the q/k map in bf16. Random tokens."""
    t_start, cuda = time.time(), device.startswith('cuda')
    name = torch.cuda.get_device_name(device) if cuda else device
    flop = flops_per_token(GPTConfig(vocab_size=args.vocab_size, **PRESETS[args.preset]), args.block_size)
    print(f"gpu check: {name}, preset {args.preset}, {args.batch_size} x {args.block_size} tokens, vocabulary "
          f"{args.vocab_size}, {args.dtype}; {flop * args.batch_size * args.block_size / 1e12:.1f} TFLOP a step")
    if not peak_flops(device, args.dtype):
        print(f"note: no MFU: set GPU_PEAK_TFLOPS to {name!r}'s dense bf16 TFLOP/s (not in model.GPU_PEAK_FLOPS)")
    out, move = qk_bf16_error(device)
    print(f"q/k map (coupled) in bf16 against float64: output {out:.2%}, its move {move:.2%} (relative errors)")
    records, synced, ratios = [], [], {}
    for compiled in (False, True):  # eager, then compiled as the recipe trains
        args.compile = compiled
        # CUDA: a host sync in a timed step is an error (a step queues its work; it never waits for the GPU)
        try:
            res = timing(args, ['standard', 'coupled'], ['train'], device, sync_check=cuda)
        except RuntimeError as e:
            if not (cuda and 'synchroniz' in str(e)):
                raise
            torch.cuda.set_sync_debug_mode('default')
            synced.append(f"{'compiled' if compiled else 'eager'} ({why(e)})")
            res = timing(args, ['standard', 'coupled'], ['train'], device)
        print_timing(res)
        records += res.values()
        ratios[res['coupled', 'train']['compiled']] = res['coupled', 'train']['ratio_vs_standard']
    print("sync debug mode: skipped (CUDA only)" if not cuda else
          f"sync debug mode 'error': a host sync in a training step, {', '.join(synced)}" if synced else
          "sync debug mode 'error': a training step of standard and coupled makes no host sync, eager or compiled")
    # eager, diff's attention as one SDPA call per sub-head (v at 2hs), or one per half of v (flash-eligible)
    args.compile, ms = False, {}
    for split in (False, True):
        CausalSelfAttention.split_v = split
        records.append(timing(args, ['standard', 'diff'], ['train'], device)['diff', 'train']
                       | dict(attn=f"diff (split_v={split})"))
        ms[split] = records[-1]['ms_per_iter']
    CausalSelfAttention.split_v = None
    print(f"diff, eager: v at 2hs {ms[False]:.1f} ms, v's halves (flash-eligible) {ms[True]:.1f} ms; faster: "
          f"split_v={min(ms, key=ms.get)} (the default on CUDA: split_v=True)")
    for compiled, ratio in sorted(ratios.items()):
        print(f"coupled / standard, {'compiled' if compiled else 'eager'}: {ratio:.3f}")
    if not any(r['compiled'] for r in records):
        print("compile did not run: every figure above is eager")
    print(f"gpu check done in {time.time() - t_start:.0f} s")
    return records


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not a usage dump
        sys.exit(f"error: {message}; see python bench.py --help")


def main(argv=None):
    """python bench.py ARGV: prints its tables and returns their records (--plan: None)."""
    p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--preset', choices=list(PRESETS), help='default small (--gpu_check: 60m)')
    p.add_argument('--attn', default='standard,coupled', help=f"comma-separated, from: {', '.join(attn_names())}")
    p.add_argument('--mode', default='train,forward,generate', help='comma-separated, from: ' + ', '.join(MODES))
    p.add_argument('--batch_size', type=int, help='default 4 (--gpu_check: 32)')
    p.add_argument('--block_size', type=int, help='default 256 (--gpu_check: 512)')
    p.add_argument('--vocab_size', type=int, default=50257, help="GPT-2's")
    p.add_argument('--qk_steps', type=int, default=1)
    p.add_argument('--qk_hidden', type=int, default=GPTConfig.qk_hidden, help='hidden width of the potential')
    p.add_argument('--new_tokens', type=int, default=256, help='tokens generated in --mode=generate')
    p.add_argument('--iters', type=int, default=6, help='timed rounds per (variant, mode)')
    p.add_argument('--warmup', type=int, default=3, help='untimed rounds first')
    p.add_argument('--device', default='auto')
    p.add_argument('--dtype', choices=['float32', 'bfloat16', 'float16'],
                   help="default float32 (--gpu_check: bf16 where native, else float16)")
    p.add_argument('--compile', default='False', choices=['True', 'False'])
    p.add_argument('--json_out', help=argparse.SUPPRESS)
    p.add_argument('--plan', action='store_true', help="the paper's 60M ablation as GPU commands, with their cost")
    p.add_argument('--world_size', type=int, default=1, help='--plan: GPUs in all (8 a node)')
    p.add_argument('--gpu_check', action='store_true', help="the recipe's step on one CUDA GPU, eager and compiled")
    args = p.parse_args(argv)
    args.compile = args.compile == 'True'
    if args.json_out:
        p.error("--json_out has moved: results/speed.py writes runs/speed.jsonl; bench.main(ARGV) returns records")
    if args.plan:
        if args.world_size not in (1, 2, 4, 8, 16, 32, 64, 128):  # they split 128 sequences, and fill 8-GPU nodes
            p.error(f"--world_size={args.world_size}: the recipe's 128 sequences per step split evenly over 1, 2, 4, "
                    "8, 16, 32, 64 or 128 GPUs")
        return plan(args.world_size)
    # a flag wins, then the GPU check's shape, then the CPU-friendly one
    for k, cpu, gpu in (('preset', 'small', '60m'), ('batch_size', 4, 32), ('block_size', 256, 512)):
        if getattr(args, k) is None:
            setattr(args, k, gpu if args.gpu_check else cpu)
    variants, modes = args.attn.split(','), args.mode.split(',')
    for flag, given, known in (('attn', variants, attn_names()), ('mode', modes, MODES)):
        for x in given:
            if x not in known:
                p.error(f"--{flag}: {x!r} is not one of {', '.join(known)}")
    variants = ['standard'] + [v for v in variants if v != 'standard']  # first: every ratio is against it
    for flag in ('qk_steps', 'qk_hidden'):
        if getattr(args, flag) != p.get_default(flag) and not any(flag in qk_flags_read(v) for v in variants):
            p.error(f"--attn={args.attn} reads no --{flag}; drop it, or choose a variant that reads it")
    try:
        device = find_device(args.device)
    except ValueError as e:
        p.error(str(e))
    if args.gpu_check and not torch.cuda.is_available():
        p.error("--gpu_check needs a CUDA GPU and there is none here; on a CPU, time a step with python bench.py "
                "--preset=60m --mode=train")
    args.dtype = args.dtype or (autocast_dtype(device) if args.gpu_check else 'float32')
    torch.set_float32_matmul_precision('high')  # float32 matmuls on TF32 tensor cores (Ampere on)
    if args.gpu_check:
        return gpu_check(args, device)
    results = timing(args, variants, modes, device)
    print_timing(results)
    return results


if __name__ == '__main__':
    main()
