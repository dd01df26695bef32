"""``mhar-ablate bench``: its parser (``model`` and ``infer``) and the options they share.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from ..errors import UsageError
from .model import bench_model
from .options import add_shared_options

if TYPE_CHECKING:  # annotations only
    import torch

# torch is imported inside the functions that run: the command line builds this parser for every command.


def add_bench_parser(subparsers: Any) -> None:
    """Add ``bench`` (with its targets ``model`` and ``infer``) to the command line's subparsers."""
    from .infer import add_infer_parser

    bench = subparsers.add_parser("bench", help="measure training and inference speed and memory of the residual "
                                                "variants on a GPU")
    targets = bench.add_subparsers(dest="bench_target", metavar="TARGET", parser_class=type(bench))
    m = targets.add_parser("model", help="training step of each variant: tokens/s, ratio to the baseline, "
                                         "peak memory, routing time")
    add_shared_options(m)
    m.add_argument("--variants", default="all", metavar="LIST",
                   help="comma-separated variant names or patterns, e.g. 'mhar-full-*,*-compiled' (default: all); "
                        "names: baseline-{eager,compiled}, {attnres,mhar,delta}-{full,block4}-{ref,fused}-{eager,compiled}, "
                        "{hc,hc-static,mhc,denseformer,muddformer}-{eager,compiled}")
    m.add_argument("--sites-per-pass", default=None, metavar="N[,N...]",
                   help="fused path: sites sharing one pass over the history (default: the model's); "
                        "several values give one row each")
    m.add_argument("--fold-norms", default=None, metavar="off|on[,...]",
                   help="fused path of mhar and attnres: compute the sublayers' pre-norms in the routing kernels "
                        "(on) or in the sublayers (off); default: the model's; 'off,on' gives one row each")
    m.add_argument("--stacked-config", default=None, metavar="off|T,W,S,R[;...]",
                   help="fused path: the shared pass's stacked products' form, off or its tokens a program, warps, "
                        "stages and rows a tile (16 or 32); default: the package's; 'off;32,1,3,16' gives one row "
                        "each")
    m.add_argument("--batch", type=int, help="sequences per step (default 8; 1 with --device cpu)")
    m.add_argument("--seq", type=int, help="tokens per sequence (default: the preset's seq_len; 16 with --device cpu)")
    m.add_argument("--steps", type=int, default=10, help="timed steps, after warm-up (default 10)")
    m.add_argument("--warmup", type=int, default=3, help="untimed steps first, compilation included (default 3)")
    m.add_argument("--rounds", type=int, default=1, metavar="R",
                   help="after a variant's own rows, time its last step (the replayed one with --cuda-graph) and "
                        "its baseline's in turn R times, each round's ratio from steps timed side by side: the "
                        "ratio is their median, with their range (default 1: the rows alone, one after another). "
                        "Holds the baselines on the GPU beside each variant")
    m.add_argument("--no-split", action="store_true", help="skip the profiled step that splits routing time off")
    m.add_argument("--cuda-graph", action="store_true",
                   help="also replay each variant's whole step from a CUDA graph (a NAME-graph row after each): "
                        "the GPU work without the host's launch cost")
    # The modes that capture CUDA graphs themselves are left out: --cuda-graph captures the whole step.
    m.add_argument("--compile-mode", choices=("default", "max-autotune-no-cudagraphs"), default="default",
                   help="torch.compile mode of the compiled variants (default: default)")
    m.add_argument("--check", action="store_true",
                   help="first check the fused path against the reference (loss and gradients, small model), in "
                        "each --stacked-config form")
    m.add_argument("--json", metavar="FILE", help="also write the rows as a JSON list")
    add_infer_parser(targets)


def cmd_bench(args: argparse.Namespace) -> int:
    target = getattr(args, "bench_target", None)
    if target == "infer":
        from .infer import bench_infer

        return bench_infer(args)
    if target != "model":
        raise UsageError("bench needs a target: mhar-ablate bench model|infer [--preset NAME] ...")
    return bench_model(args)


# ------------------------------------------------------------------------------------------------ the command


