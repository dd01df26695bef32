"""How long the fused path's per-pass state (``FusedState``) and its buffers live, on the CPU: a tiny routed
model trains a few steps as ``TrainStep`` does (loss, backward, loss detached), with Python's cyclic
collector off, so that only reference counting frees anything. After each step it prints, for every
step's state so far, whether the state object is still alive and whether it still holds its source
buffer; then it collects garbage and prints which states survive that.

    TRITON_INTERPRET=1 PYTHONPATH=$PWD python3 benchmarks/state_lifetime.py --compile

Measured (docs/kernel-notes.md, "Memory: a pass's buffers outlived its backward"): with ``--compile`` the
state of the step that compiled the loss outlives its step, in a reference cycle, until ``gc.collect()``.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import weakref

import torch

from mhar_ablate.config import build_config
from mhar_ablate.model.transformer import Decoder
from mhar_ablate.training.step import make_loss

VOCAB = 64


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--compile", action="store_true", help="compile the loss (torch.compile, default mode)")
    p.add_argument("--steps", type=int, default=3)
    args = p.parse_args()
    if not os.environ.get("TRITON_INTERPRET"):
        print("state_lifetime.py: set TRITON_INTERPRET=1 (the fused path's kernels on the CPU)", file=sys.stderr)
        return 2
    cfg = build_config(overrides={"residual.kind": "mhar", "residual.grouping": "full", "residual.heads": "4",
                                  "residual.backend": "triton", "model.d_model": "32", "model.n_layers": "2",
                                  "model.n_heads": "2", "model.n_kv_heads": "1", "model.ffn": "48"})
    torch.manual_seed(0)
    model = Decoder(cfg.model, cfg.residual, VOCAB)
    states = []
    start = model.residual.start
    model.residual.start = lambda x0: states.append(weakref.ref(start(x0))) or states[-1]()
    loss_fn = make_loss(model, "default" if args.compile else None)
    x, y = torch.randint(0, VOCAB, (1, 9)), torch.randint(0, VOCAB, (1, 9))
    gc.disable()
    for step in range(args.steps):
        loss = loss_fn(x, y)
        loss.backward()
        loss = loss.detach()
        alive = [s() is not None for s in states]
        holding = [s() is not None and s().buffer is not None for s in states]
        print(f"after step {step}: state alive {alive}, holding its buffer {holding}", flush=True)
    gc.collect()
    print(f"after gc.collect(): state alive {[s() is not None for s in states]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
