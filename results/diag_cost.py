"""The diagnostics' cost (results/speed.md): one evaluation's diagnostics, as train.py runs them (qk_diagnostics on
8,192 tokens, attention_diagnostics on their first sequences), against one forward pass of the estimate's batch,
at the GPU recipe's shape, on random tokens. Run from the repository root: python results/diag_cost.py"""
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # model.py, from any folder
from model import PRESETS, GPT, GPTConfig, attention_diagnostics, qk_diagnostics  # noqa: E402

PRESET, BLOCK, BATCH, EVAL_ITERS = '60m', 512, 32, 40  # the recipe's (bench.py --plan); train.py's --eval_iters

if __name__ == '__main__':
    if sys.argv[1:]:
        sys.exit(__doc__)
    torch.manual_seed(0)
    model = GPT(GPTConfig(attn='coupled', block_size=BLOCK, **PRESETS[PRESET]), verbose=False).eval()
    batch = torch.randint(model.config.vocab_size, (BATCH, BLOCK))
    diag = torch.randint(model.config.vocab_size, (-(-8192 // BLOCK), BLOCK))
    seconds = {}
    for name, fn in (('forward', lambda: model(batch, batch)), ('qk_diagnostics', lambda: qk_diagnostics(model, diag)),
                     ('attention_diagnostics', lambda: attention_diagnostics(model, diag))):
        with torch.no_grad():
            t0 = time.time()
            fn()
            seconds[name] = time.time() - t0
    both = seconds['qk_diagnostics'] + seconds['attention_diagnostics']
    print(f"coupled, preset {PRESET}, block {BLOCK}, cpu, {torch.get_num_threads()} threads: one forward of {BATCH} "
          f"sequences {seconds['forward']:.2f} s; qk_diagnostics ({diag.numel():,} tokens) "
          f"{seconds['qk_diagnostics']:.2f} s, attention_diagnostics {seconds['attention_diagnostics']:.2f} s: "
          f"{both / seconds['forward']:.1f} forwards, {both / (2 * EVAL_ITERS * seconds['forward']):.1%} of an "
          f"estimate of the loss ({2 * EVAL_ITERS} forwards)")
