"""
Two jobs. First, time attention variants against standard attention: a training step, a forward pass, and
generation with the KV cache vs recomputing the context; variants run interleaved (A B B A ...) after a warm-up,
medians reported, next to a FLOP model of what a perfect implementation would pay. Second, with --report,
tabulate finished train.py runs (full-split perplexity over seeds, the coupling diagnostic) and plot their curves.
Third, with --plan, print the paper's 60M WikiText-103 ablation as one-GPU commands, with the FLOP model's cost.

  python bench.py                                              # standard vs coupled, small preset, CPU-friendly
  python bench.py --preset=60m --batch_size=4 --block_size=256 --attn=standard,coupled,euler,uncoupled
  python bench.py --preset=60m --device=cuda --compile=True --dtype=bfloat16 --batch_size=16 --block_size=1024
  python bench.py --report=runs --plot=curves.png    # table (and learning curves) of the train.py runs under runs/
  python bench.py --report=out-standard,out-coupled   # or of any run folders
  python bench.py --plan                              # the GPU recipe: commands, tokens, estimated GPU time
"""
import argparse
import ctypes
import ctypes.util
import glob
import json
import math
import os
import statistics
import sys
import time
from contextlib import nullcontext

import torch

from model import ATTN, PRESETS, GPT, GPTConfig

MODES = ('train', 'forward', 'generate')


def load_runs(folders):
    """Every finished train.py run in or under the given folders: {(corpus, label): [run, ...]}. A run is labeled by
    its folder's name without a '-s<seed>' suffix and an 'out-' prefix (out-coupled-s2: coupled), 'out' by its attn;
    its corpus is the dataset it trained on. Rows are compared with the label 'standard' on the same corpus."""
    runs = {}
    paths = sorted({p for f in folders for p in glob.glob(os.path.join(f, '**', 'metrics.jsonl'), recursive=True)})
    for path in paths:
        log = []
        for i, line in enumerate(open(path), 1):
            try:
                log.append(json.loads(line))
            except ValueError:
                print(f"warning: {path}:{i} is not a JSON line (a run killed while writing?); skipped", file=sys.stderr)
        start = [r for r in log if r.get('event') == 'start']
        final = [r for r in log if r.get('event') == 'final']
        if not start or not final:
            print(f"note: {path} is not a finished run; left out", file=sys.stderr)
            continue
        cfg, name = start[-1]['config'], os.path.basename(os.path.dirname(os.path.abspath(path)))
        label, _, seed = name.rpartition('-s')
        label = label if label and seed.isdigit() else name
        label = label.removeprefix('out-').removeprefix('out_')
        label = cfg['attn'] if label in ('out', '') else label
        evals = [r for r in log if r.get('event') == 'eval']
        ms = [r['ms'] for r in log if r.get('event') == 'train']
        runs.setdefault((cfg['dataset'], label), []).append(dict(final=final[-1], evals=evals, config=cfg, ms=ms))
    return runs


def report(folders, plot):
    """Full-split validation perplexity of train.py runs: mean and spread over seeds, change against standard on the
    same corpus, the coupling diagnostic at the end; optionally learning curves (needs matplotlib)."""
    runs = load_runs(folders)
    if not runs:
        sys.exit(f"error: no finished train.py runs in {', '.join(folders)}; name run folders (--out_dir of train.py)")
    ppl = {k: [r['final']['val_ppl'] for r in v] for k, v in runs.items()}
    print("| corpus | variant | seeds | val ppl (full split, mean +- std) | vs standard | nonlinear | dt | tokens "
          "| ms/iter |\n|---|---|---|---|---|---|---|---|---|")
    for corpus, label in sorted(ppl, key=lambda k: (k[0], k[1] != 'standard', statistics.mean(ppl[k]))):
        p, base = ppl[(corpus, label)], ppl.get((corpus, 'standard'))
        mean = statistics.mean(p)
        spread = f"{mean:.3f} +- {statistics.stdev(p):.3f}" if len(p) > 1 else f"{mean:.3f}"
        rel = f"{100 * (mean / statistics.mean(base) - 1):+.1f}%" if base else '-'
        qk = [r['evals'][-1].get('qk') for r in runs[(corpus, label)] if r['evals']]
        nonlin = [statistics.median(s['nonlinear'] for s in q) for q in qk if q]
        dts = [statistics.mean(d for s in q for d in s.get('dt', [])) for q in qk if q and 'dt' in q[0]]
        ms = statistics.median(m for r in runs[(corpus, label)] for m in r['ms'][1:] or r['ms'] or [0])
        print(f"| {corpus} | {label} | {len(p)} | {spread} | {rel} | "
              f"{f'{100 * statistics.mean(nonlin):.2f}%' if nonlin else '-'} | "
              f"{f'{statistics.mean(dts):.3f}' if dts else '-'} | {runs[(corpus, label)][0]['final']['tokens']:,} | "
              f"{ms:.0f} |")
    if plot:
        try:
            import matplotlib
            matplotlib.use('Agg')
            import matplotlib.pyplot as plt
        except ImportError:
            sys.exit("error: --plot needs matplotlib (pip install matplotlib); the table above needs nothing")
        corpora = sorted({c for c, label in runs if label in ('standard', 'coupled')})
        fig, axes = plt.subplots(1, len(corpora), figsize=(3.6 * len(corpora), 3.4), squeeze=False)
        for ax, corpus in zip(axes[0], corpora):
            for label, color in (('standard', 'tab:blue'), ('coupled', 'tab:red')):
                for i, r in enumerate(runs.get((corpus, label), [])):
                    ax.plot([e['iter'] for e in r['evals'][1:]], [math.exp(e['val_loss']) for e in r['evals'][1:]],
                            color=color, alpha=0.6, marker='.', label=label if i == 0 else None)
            ax.set(xlabel='iteration', title=corpus)
            ax.grid(alpha=0.3)
        axes[0][0].set_ylabel('validation perplexity (estimate)')
        axes[0][0].legend()
        fig.tight_layout()
        fig.savefig(plot, dpi=100)
        print(f"wrote {plot}", file=sys.stderr)


# -----------------------------------------------------------------------------------------------------------
# FLOP model: what a perfect implementation would pay, per token of a training step (forward + backward = 3x fwd)

def flops_per_token(cfg, T):
    C, L, nh, hs, m, n = cfg.n_embd, cfg.n_layer, cfg.n_head, cfg.n_embd // cfg.n_head, cfg.qk_hidden, cfg.qk_steps
    h, hi = max(1, m // 4), max(1, round(0.4 * m))  # hidden widths of uncoupled's and invertible's nets
    matmul = 2 * (L * 12 * C * C + C * cfg.vocab_size)              # c_attn, c_proj, c_fc, mlp.c_proj; lm_head
    attend = L * 2 * T * C * (3 if cfg.attn.startswith('diff') else 2) / 2  # q k^T and (attention) v, causal half
    force = 4 * m * hs + 10 * m                                    # W q, W^T (.), silu' elementwise
    qk = {'coupled': (n + 1) * force + n * 6 * hs, 'euler': n * (force + 4 * hs),
          'uncoupled': n * 2 * (4 * h * hs + 5 * h + 2 * hs), 'invertible': n * 2 * (6 * hi * hs + 5 * hi + 8 * hs),
          }.get(cfg.attn.removeprefix('diff').removeprefix('+'), 0) * L * nh
    return 3 * (matmul + attend + qk)


# The paper's 60M WikiText-103 ablation on one GPU: each run is $R, its flags and a folder under runs/60m. 20,000
# iterations of 32 x 4 x 512 tokens = 1.31B tokens (our choice: the paper's budget is not public).
RECIPE = ("python train.py --preset=60m --dataset=wikitext103 --block_size=512 --batch_size=32 "
          "--gradient_accumulation_steps=4 --learning_rate=6e-4 --min_lr=6e-5 --warmup_iters=1000 --max_iters=20000 "
          "--eval_interval=1000 --dtype=bfloat16 --compile=True")
RECIPE_RUNS = [('standard', '--attn=standard'), ('coupled', '--attn=coupled'), ('euler', '--attn=euler'),
               ('uncoupled', '--attn=uncoupled'), ('coupled-steps7', '--attn=coupled --qk_steps=7'),
               ('invertible', '--attn=invertible'), ('diff', '--attn=diff'), ('diff+coupled', '--attn=diff+coupled'),
               ('standard-2.4x', '--attn=standard --max_iters=48000')]  # the paper's compute match: 2.4x the tokens
GPUS = {'H100': 989e12, 'A100': 312e12}  # dense bf16 peak FLOP/s (SXM)
UTILISATION = 0.35


def plan():
    """The GPU recipe as a markdown table: each run's command, tokens and its training time from the FLOP model at
    35% of the GPU's bf16 peak (evaluation adds ~1%)."""
    flags = lambda text: dict(a.removeprefix('--').split('=', 1) for a in text.split() if a.startswith('--'))
    base = flags(RECIPE)
    print(f"R=\"{RECIPE}\"\n")
    print("| run | command | tokens | GFLOP/token | " + ' | '.join(f"{g} at {UTILISATION:.0%}" for g in GPUS)
          + " |\n|---|---|---|---|" + '---|' * len(GPUS))
    for name, extra in RECIPE_RUNS:
        f = base | flags(extra)
        cfg = GPTConfig(attn=f['attn'], qk_steps=int(f.get('qk_steps', 1)), **PRESETS[f['preset']])
        tokens = math.prod(int(f[k]) for k in ('batch_size', 'gradient_accumulation_steps', 'block_size', 'max_iters'))
        flop = flops_per_token(cfg, int(f['block_size']))
        hours = [tokens * flop / (UTILISATION * peak) / 3600 for peak in GPUS.values()]
        print(f"| {name} | `$R {extra} --out_dir=runs/60m/{name}` | {tokens / 1e9:.2f}B | {flop / 1e9:.3f} | "
              + ' | '.join(f"{h * 60:.0f} min" if h < 2 else f"{h:.1f} h" for h in hours) + ' |')


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, not a usage dump
        sys.exit(f"error: {message}; see python bench.py --help")


p = Parser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
p.add_argument('--preset', default='small', choices=list(PRESETS))
p.add_argument('--attn', default='standard,coupled', help=f"comma-separated, from: {', '.join(ATTN)}")
p.add_argument('--mode', default='train,forward,generate', help='comma-separated, from: ' + ', '.join(MODES))
p.add_argument('--batch_size', type=int, default=4)
p.add_argument('--block_size', type=int, default=256)
p.add_argument('--vocab_size', type=int, default=50257, help='GPT-2 by default, as in the paper')
p.add_argument('--qk_steps', type=int, default=1)
p.add_argument('--qk_hidden', type=int, default=GPTConfig.qk_hidden, help='hidden width of the potential')
p.add_argument('--new_tokens', type=int, default=256, help='tokens generated in --mode=generate')
p.add_argument('--iters', type=int, default=6, help='timed rounds per (variant, mode); generation: fewer')
p.add_argument('--warmup', type=int, default=3, help='untimed rounds first (CPU: the heap settles)')
p.add_argument('--device', default='auto')
p.add_argument('--dtype', default='float32', choices=['float32', 'bfloat16', 'float16'])
p.add_argument('--compile', default='False', choices=['True', 'False'])
p.add_argument('--json_out', default='', help='write one JSON record per (variant, mode) to this file')
p.add_argument('--report', default='', help='instead of timing: tabulate train.py runs in or under these '
                                           'comma-separated folders')
p.add_argument('--plan', action='store_true', help="print the paper's 60M ablation as GPU commands with their cost")
p.add_argument('--plot', default='', help='with --report: write learning curves of standard vs coupled here')
args = p.parse_args()
if args.report:
    report(args.report.split(','), args.plot)
    sys.exit(0)
if args.plan:
    plan()
    sys.exit(0)
for name, low in (('iters', 1), ('warmup', 0), ('batch_size', 1), ('block_size', 1), ('new_tokens', 1),
                  ('vocab_size', 2), ('qk_steps', 1)):
    if getattr(args, name) < low:
        p.error(f"--{name} must be >= {low}, got {getattr(args, name)}")
if args.json_out and not os.path.isdir(os.path.dirname(os.path.abspath(args.json_out))):
    p.error(f"--json_out={args.json_out}: its folder does not exist; create it first (nothing was timed)")
variants, modes = args.attn.split(','), args.mode.split(',')
for v in variants:
    if v not in ATTN:
        p.error(f"--attn: {v!r} is not one of {', '.join(ATTN)}")
for m in modes:
    if m not in MODES:
        p.error(f"--mode: {m!r} is not one of {', '.join(MODES)}")
if 'standard' not in variants:
    variants.insert(0, 'standard')  # every ratio is against standard
device = args.device if args.device != 'auto' else 'cuda' if torch.cuda.is_available() else 'cpu'
if device.startswith('cuda') and not torch.cuda.is_available():
    p.error(f"--device={device} but CUDA is not available here; use --device=cpu")
cuda = device.startswith('cuda')
dtype = getattr(torch, args.dtype)
autocast = torch.autocast('cuda', dtype=dtype) if cuda and dtype != torch.float32 else nullcontext()
B, T = args.batch_size, args.block_size
gen_block = max(T, args.new_tokens + 1)  # generation never refills the cache window
torch.backends.cuda.matmul.allow_tf32 = True


def keep_freed_memory():
    """
    glibc hands freed blocks above a threshold back to the OS, so every training step of a GPT-2-vocabulary model
    page-faults its 200 MB logits back in: on our 2-core VM that is +10% time and +-5% noise, landing on whichever
    variant happens to allocate next. Keep freed memory in the process instead, as PyTorch's CUDA caching allocator
    does. Linux/glibc only; elsewhere nothing changes.
    """
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library('c')).mallopt
    except (OSError, AttributeError, TypeError):
        return  # not glibc
    mallopt(-3, 1 << 30)        # M_MMAP_THRESHOLD: blocks under 1 GiB come from the heap, reused after free
    mallopt(-1, (1 << 31) - 1)  # M_TRIM_THRESHOLD: never shrink the heap


if not cuda:
    keep_freed_memory()


def sync():
    if cuda:
        torch.cuda.synchronize()


def make(attn):
    torch.manual_seed(0)
    try:
        cfg = GPTConfig(attn=attn, block_size=gen_block, vocab_size=args.vocab_size, qk_steps=args.qk_steps,
                        qk_hidden=args.qk_hidden, **PRESETS[args.preset])
    except ValueError as e:
        p.error(str(e))
    model = GPT(cfg, verbose=False)
    if attn != 'standard':  # same weights as standard wherever the architectures agree: CPU speed depends on
        model.load_state_dict(models['standard'][0].state_dict(), strict=False)  # values (up to +-5%)
    model = model.to(device)
    opt = model.configure_optimizers(0.1, 1e-4, (0.9, 0.95), 'cuda' if cuda else 'cpu')
    fwd = torch.compile(model) if args.compile == 'True' else model
    return model, fwd, opt


# -----------------------------------------------------------------------------------------------------------

def step_train(model, fwd, opt, x):
    with autocast:
        loss = fwd(x, x)[1]
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


@torch.no_grad()
def step_forward(model, fwd, opt, x):
    with autocast:
        fwd(x)


@torch.no_grad()
def step_generate(model, fwd, opt, x, use_cache):
    with autocast:
        model.generate(x[:1, :1], args.new_tokens, temperature=0, use_cache=use_cache)


jobs = []  # (mode label, step function, tokens per call)
if 'train' in modes:
    jobs.append(('train', step_train, B * T))
if 'forward' in modes:
    jobs.append(('forward', step_forward, B * T))
if 'generate' in modes:
    jobs.append(('generate', lambda *a: step_generate(*a, True), args.new_tokens))
    jobs.append(('generate-nocache', lambda *a: step_generate(*a, False), args.new_tokens))

models = {}
for v in variants:  # standard first
    models[v] = make(v)
x = torch.randint(0, args.vocab_size, (B, T), device=device)
cfg0 = models['standard'][0].config
print(f"bench: preset {args.preset} ({cfg0.n_layer}x{cfg0.n_embd}, {cfg0.n_head} heads), batch {B}x{T}, vocab "
      f"{args.vocab_size}, {device} ({torch.get_num_threads()} threads), {args.dtype}, compile={args.compile}")
results = {}
for mode, fn, ntok in jobs:
    # generation is slow to time: 1/3 of the rounds; recomputation (O(n^2) work) once, warmed up by the cached run
    iters = {'generate': max(1, args.iters // 3), 'generate-nocache': 1}.get(mode, args.iters)
    start = time.perf_counter()
    for v in variants:  # warm-up (and compilation)
        for _ in range({'generate': 1, 'generate-nocache': 0}.get(mode, args.warmup)):
            fn(*models[v], x)
    warm = time.perf_counter() - start
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = {v: [] for v in variants}
    peak = {}
    for r in range(iters):  # interleaved, the order reversed every other round (A B B A ...): drift in machine
        for v in (variants if r % 2 == 0 else variants[::-1]):  # speed, and whichever runs first, hit all alike
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            sync()
            t0 = time.perf_counter()
            fn(*models[v], x)
            sync()
            times[v].append(time.perf_counter() - t0)
            if cuda:
                peak[v] = max(peak.get(v, 0), torch.cuda.max_memory_allocated() / 2**20)
        spent = time.perf_counter() - start
        print(f"  {mode}: round {r + 1}/{iters} | warm-up {warm:.0f} s | {spent:.0f} s so far, about "
              f"{(spent - warm) / (r + 1) * (iters - r - 1):.0f} s left", flush=True)
    for v in variants:
        ms = 1000 * statistics.median(times[v])
        # the ratio pairs each round's time with standard's in the same round, then takes the median: a slow spell
        # of the machine (on a shared VM, +-10% for seconds at a time) then cancels instead of landing on one variant
        ratio = statistics.median(t / t0 for t, t0 in zip(times[v], times['standard']))
        results[(v, mode)] = dict(attn=v, mode=mode, ms_per_iter=ms, tokens_per_s=ntok / ms * 1000,
                                  ratio_vs_standard=ratio, peak_mem_mb=peak.get(v), iters=iters)

base_flops = flops_per_token(cfg0, T)
flop_ratio = {v: flops_per_token(models[v][0].config, T) / base_flops for v in variants}
records = []
print(f"\n{'attn':<16}{'mode':<18}{'ms/iter':>10}{'tokens/s':>12}{'peak MB':>9}{'vs standard':>13}{'FLOP model':>12}")
for (v, mode), r in results.items():
    r['flop_model_ratio'] = flop_ratio[v] if mode == 'train' else None
    if mode == 'generate-nocache':
        r['cache_speedup'] = r['ms_per_iter'] / results[(v, 'generate')]['ms_per_iter']
    records.append(r)
    peak = f"{r['peak_mem_mb']:.0f}" if r['peak_mem_mb'] else '-'
    flop = f"{r['flop_model_ratio']:.4f}" if r['flop_model_ratio'] else ''
    print(f"{v:<16}{mode:<18}{r['ms_per_iter']:>10.1f}{r['tokens_per_s']:>12,.0f}{peak:>9}"
          f"{r['ratio_vs_standard']:>13.3f}{flop:>12}")
for r in records:
    if 'cache_speedup' in r:
        print(f"{r['attn']}: KV cache generates {args.new_tokens} tokens {r['cache_speedup']:.1f}x as fast "
              f"as recomputing the context (a full forward pass per new token)")
print("FLOP model: vs standard, " + ', '.join(f"{v} {100 * (e - 1):+.2f}%" for v, e in flop_ratio.items()
                                             if v != 'standard')
      + " to a training step (matmuls, attention, and the dynamics' elementwise work; a perfect implementation's "
        "ratio)")
if args.json_out:
    with open(args.json_out, 'w') as f:
        for r in records:
            f.write(json.dumps(r | dict(preset=args.preset, batch_size=B, block_size=T, device=device,
                                        dtype=args.dtype, compile=args.compile == 'True',
                                        threads=torch.get_num_threads())) + '\n')
    print(f"wrote {args.json_out}")
