"""Exercise 5. What did the quick start's model learn? Per layer its nonlinearity and dt; a line of text through
layer 1, attention with the learned dt and with dt = 0 (one run: the quick start's, in out/).
Run from the repository root: python exercises/ex5_learned.py [run folder] (default: out; the lab's own copy of a
quick-start run: exercises/quickstart)"""
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # model.py, from any folder
from model import GPT, GPTConfig, qk_diagnostics  # noqa: E402

run = sys.argv[1] if len(sys.argv) > 1 else 'out'
QUICK = "python exercises/ex5_learned.py exercises/quickstart"  # the lab's own copy of a quick-start run
if run in ('-h', '--help'):
    sys.exit(print(__doc__))
if os.path.basename(run) == 'ckpt.pt':  # the checkpoint named: its run folder
    run = os.path.dirname(run) or '.'
if not os.path.exists(os.path.join(run, 'ckpt.pt')):
    sys.exit(f"error: no {run}/ckpt.pt; wait for the quick start to save one, or use the lab's copy: {QUICK}")
ckpt = torch.load(os.path.join(run, 'ckpt.pt'), weights_only=True)
model = GPT(GPTConfig(**ckpt['model_args']), verbose=False).eval()
model.load_state_dict(ckpt['model'])
done, total = ckpt['iter_num'], ckpt['config']['max_iters']  # a run still training saves mid-run checkpoints
print(f"{run}/ckpt.pt: iteration {done} of {total}" + ('' if done >= total else ", not a finished run: its numbers are "
      f"not the worksheet's; wait for the quick start to finish, or use the lab's copy: {QUICK}"))
qk = model.transformer.h[1].attn.qk if model.config.n_layer > 1 else None
if not (hasattr(qk, 'force') and hasattr(qk, 'dt')):  # standard attention has no q/k map; uncoupled no force
    sys.exit(f"error: {run} is an --attn={model.config.attn} run; exercise 5 reads layer 1's Hamiltonian step: train "
             f"one with `python train.py --attn=coupled`, or use {QUICK}")
path = os.path.join(run, 'val.bin')  # the lab's copy keeps the part of its val split read here
if not os.path.exists(path):  # else the run's corpus
    path = os.path.join(ckpt['config'].get('data_dir', 'data'), ckpt['config']['dataset'], 'val.bin')
val, T = np.fromfile(path, dtype=np.uint16).astype(np.int64), model.config.block_size
for i, s in enumerate(qk_diagnostics(model, torch.from_numpy(val[:16 * T]).view(16, T))):
    print(f"layer {i}: nonlinear {s['nonlinear']:.2%}, dt {np.round(model.transformer.h[i].attn.qk.dt.tolist(), 3)}")
start = 1000 + bytes(val[1000:2000].astype(np.uint8)).index(b'\n') + 1  # a line of val text
print('on:', bytes(val[start:start + 48].astype(np.uint8)).decode(errors='replace'))
seen = []  # layer 1's q/k map: its input (dt = 0), output (learned dt), (1, n_head, 48, head_size)
hook = qk.register_forward_hook(lambda m, inp, out: seen.append((*inp, *out)))
with torch.no_grad():
    model(torch.from_numpy(val[start:start + 48])[None])
    hook.remove()
    q, k, q1, k1 = (t[0] for t in seen[0])  # (n_head, 48, hs)
    dt = qk.dt.view(-1, 1)  # (n_head, 1): each head's learned step
    mask, S = torch.ones(48, 48, dtype=torch.bool).tril(), lambda a, b: a @ b.transpose(-1, -2)  # S: a_i . b_j
    attend = lambda q, k: (S(q, k) / q.size(-1) ** 0.5).masked_fill(~mask, float('-inf')).softmax(-1)  # noqa: E731
    p0, p1 = attend(q, k), attend(q1, k1)  # (n_head, 48, 48): row i is where token i looks
    change = S(q1, k1) - S(q, k)  # (n_head, 48, 48): how each score moved
    kk, first = dt * S(k, k)[:, mask], dt * (S(k, k) + S(q, qk.force(q)))[:, mask]  # dt k_i.k_j; + dt q_i.F(q_j)
    gain = change[:, mask]  # the causal pairs' score changes, (n_head, pairs)
    r2 = lambda pred: 1 - (gain - pred).pow(2).sum(-1) / (gain - gain.mean(-1, keepdim=True)).pow(2).sum(-1)  # noqa
    for h in range(len(p0)):
        print(f"head {h}: R^2 {r2(kk)[h]:.2f} (dt k_i.k_j alone), {r2(first)[h]:.2f} (first order); the diagonal's "
              f"score rises in {(change[h].diagonal() > 0).sum()}/48 rows, its attention falls in "
              f"{((p1 - p0)[h].diagonal() < 0).sum()}/48")
try:
    import matplotlib.pyplot as plt
    d, (fig, ax) = (p1 - p0).abs().max().item(), plt.subplots(3, len(p0), figsize=(10.4, 7.5))
    for h, row in ((h, row) for h in range(len(p0)) for row in range(3)):  # the change: red gains, blue loses
        ax[row, h].imshow((p0, p1, p1 - p0)[row][h], **(dict(cmap='RdBu_r', vmin=-d, vmax=d) if row == 2 else {}))
        ax[row, h].set(title=f"head {h}: " + ('dt = 0', 'learned dt', f'change, +-{d:.2f}')[row], xticks=[], yticks=[])
    fig.tight_layout(), fig.savefig('ex5_attention.png', dpi=80)
    print("drew ex5_attention.png")
except ImportError:
    print("for the picture: pip install matplotlib")
