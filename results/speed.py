"""The timings of results/speed.md, on the CPU: bench.py's training step of coupled against standard at the page's
four shapes, each eager one three times (the page gives the median), and at 60m beside the MLP variants; then python
bench.py's every mode at the small preset, with the KV cache's gain. Each bench.py table is printed as it prints it,
every record goes to runs/speed.jsonl, and the page's table comes last. Timings need an idle machine.
Run from the repository root: python results/speed.py"""
import ctypes
import ctypes.util
import json
import os
import sys
from statistics import median

import runner

sys.path.insert(0, runner.ROOT)
import bench  # noqa: E402

TINY = '--preset=tiny --vocab_size=257 --batch_size=16 --block_size=128 --iters=20'
# the page's table: python bench.py --mode=train FLAGS, an eager row three times
ROWS = [('--preset=60m --iters=20', 3), ('--preset=60m --iters=10 --compile=True', 1), (TINY, 3),
        (TINY + ' --compile=True', 1)]
# the page's other commands ('': python bench.py)
MORE = ['--mode=train --preset=60m --iters=20 --attn=standard,coupled,euler-mlp,coupled-mlp', '']


def keep_freed_memory():
    """glibc returns large freed blocks to the OS, so each step of a GPT-2-vocabulary model page-faults its 200 MB
    logits back in (+10% time, +-5% noise on our 2-core VM). Keep them, as PyTorch's CUDA allocator does. glibc only."""
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library('c')).mallopt
    except (OSError, AttributeError, TypeError):
        return  # not glibc
    mallopt(-3, 1 << 30)        # M_MMAP_THRESHOLD: blocks under 1 GiB come from the heap, reused after free
    mallopt(-1, (1 << 31) - 1)  # M_TRIM_THRESHOLD: never shrink the heap


def summary(results):
    """What the page quotes beside a table of bench.py: the KV cache's gain, and the FLOP model's extra cost."""
    for (v, mode), r in results.items():
        if mode == 'generate-nocache':
            speedup = r['ms_per_iter'] / results[v, 'generate']['ms_per_iter']
            print(f"{v}: KV cache generates {r['tokens']} tokens {speedup:.1f}x as fast as recomputing the context "
                  "(a full forward pass per new token)")
    flops = {r['attn']: r['flop_model_ratio'] for r in results.values() if r['flop_model_ratio']}
    if len(flops) > 1:
        extra = ', '.join(f"{v} {100 * (e - 1):+.2f}%" for v, e in flops.items() if v != 'standard')
        print(f"FLOP model: vs standard, {extra} to a training step (matmuls, attention and the dynamics' "
              "elementwise work)")


def bench_py(flags, records):
    """python bench.py --device=cpu FLAGS, then its summary; its records, with flags and threads, join records."""
    results = bench.main(['--device=cpu', *flags.split()])
    summary(results)
    records += [r | dict(flags=flags, threads=bench.torch.get_num_threads()) for r in results.values()]
    return results


if __name__ == '__main__':
    runner.start()
    keep_freed_memory()
    records, table = [], []
    for flags, runs in ROWS:
        coupled = [bench_py('--mode=train ' + flags, records)['coupled', 'train'] for _ in range(runs)]
        table.append((flags, [r['ratio_vs_standard'] for r in coupled], coupled[0]['flop_model_ratio']))
    for flags in MORE:
        bench_py(flags, records)
    os.makedirs('runs', exist_ok=True)
    with open('runs/speed.jsonl', 'w') as f:
        f.writelines(json.dumps(r) + '\n' for r in records)
    print("\nwrote runs/speed.jsonl\n")
    print("| `python bench.py --mode=train ...` | coupled / standard | FLOP model | each run |\n|---|---|---|---|")
    for flags, ratios, flop in table:
        print(f"| `{flags}` | {median(ratios):.3f} | {flop:.3f} | {', '.join(f'{r:.3f}' for r in ratios)} |")
