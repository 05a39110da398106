"""Exercise 4. The linear-regime trap: the coupling diagnostic at init as the spread of the potential's
pre-activations doubles (no training, seconds), on the lab's 2,048 validation tokens (exercises/quickstart/val.bin:
the same on every machine, whichever Python's documentation the quick start reads).
Run from the repository root: python exercises/ex4_linear_regime.py"""
import math
import os
import sys

import numpy as np
import torch

if sys.argv[1:]:  # it takes none: --help, or a one-line error
    print(__doc__) if sys.argv[1:] in (['-h'], ['--help']) else sys.exit(
        f"error: {os.path.basename(__file__)} takes no arguments (given: {' '.join(sys.argv[1:])})")
    sys.exit()
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # model.py, from any folder
from model import GPT, GPTConfig, qk_diagnostics  # noqa: E402

path = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'quickstart', 'val.bin')
x = torch.from_numpy(np.fromfile(path, dtype=np.uint16)[:16 * 128].astype(np.int64)).view(16, 128)
spreads, fractions = (0.0625, 0.125, 0.25, 0.5, 1, 2, 4), {}  # --qk_scale (2: the default)
for b in (0.0, 0.5):  # the potential's bias b: 0 at init, as model.py starts it; then every b_j = 0.5
    last, fractions[b] = None, []
    for scale in spreads[:None if b == 0 else 4]:  # b = 0.5: the small spreads, where the growth law shows
        torch.manual_seed(0)
        model = GPT(GPTConfig(n_layer=4, n_head=4, n_embd=128, vocab_size=257, block_size=128, attn='coupled',
                              qk_scale=scale), verbose=False)
        with torch.no_grad():
            for blk in model.transformer.h:
                blk.attn.qk.f.b.fill_(b)
        f = float(np.median([s['nonlinear'] for s in qk_diagnostics(model, x)]))  # the median layer, as logged
        print(f"b={b} spread {scale}: nonlinear {f:.1e}" + (f", {f / last:.1f}x the last" if last else ""))
        last = f
        fractions[b].append(f)
for b, f in fractions.items():  # the growth law at the three smallest spreads: nonlinear ~ spread^p
    print(f"b={b}: log-log slope {math.log2(f[2] / f[0]) / 2:.2f} over the three smallest spreads")
try:
    import matplotlib.pyplot as plt
    for b, f in fractions.items():
        plt.loglog(spreads[:len(f)], f, 'o-', label=f"b = {b}")
    plt.xlabel('spread (--qk_scale)'), plt.ylabel('nonlinear fraction at init'), plt.legend()
    plt.savefig('ex4_linear_regime.png', dpi=80)
    print("drew ex4_linear_regime.png")
except ImportError:
    print("for the picture: pip install matplotlib")
