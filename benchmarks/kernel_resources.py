"""What the fused path's kernels compile to for the H200 (sm_90), without a GPU: registers a thread, stack
bytes, shared memory a program, the layout conversions left inside the main loop (each one a trip
through shared memory, with a barrier when it crosses warps), read from the TTGIR, and the machine
instructions (SASS) of the main loop. Register counts decide how many programs fit on an SM, and for a
loop bound by the instructions it issues (the head-tiled forward) the loop's instructions per byte it
reads predict its speed, so these are the first things to look at before a device call.

The device machine runs triton 3.6.0, whose counts differ from newer versions'; install that version
beside this machine's and put it first on the path:

    python3 -m pip install --no-deps --target /tmp/t36 triton==3.6.0
    PYTHONPATH=/tmp/t36:$PWD python3 benchmarks/kernel_resources.py --widths 512,1024,1280

Rows: kernel, width d, launch configuration (the launch tables' entry for that width first; for the
backward row kernel its pipeline depth and register cap; the shared pass's matrix-product form and the
backward's group pass, ``--group-configs``, with the sources or sites in one tile and in several; the
stacked products' form at 4 and 8 sources, ``--stacked-configs``), warps,
registers, stack, shared memory, conversions in the loop, SASS instructions of the loop (the longest one
closed by a backward branch) and those per byte of the rows one iteration of a warp reads. ``--portable``
compiles the forms the interpreter runs instead of the inline PTX (``kernels/ptx.py``); ``--only
column,group`` (say) compiles those kernels alone.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from mhar_ablate.bench.model import markdown_table
from mhar_ablate.kernels import column, column_group, history
from mhar_ablate.kernels.launch import head_meta, products_fit

TARGET = GPUTarget("cuda", 90, 32)
POINTERS = {  # argument: element type; the rest of the arguments are i32 or constexpr
    "x_ptr": "bf16", "rms_ptr": "fp32", "g_ptr": "bf16", "lse_ptr": "fp32", "delta_ptr": "fp32", "qg_ptr": "fp32",
    "dx_ptr": "bf16", "dzr_ptr": "fp32", "y_ptr": "bf16", "ry_ptr": "fp32", "dzr_low_ptr": "fp32",
    "carry_ptr": "fp32", "carry_dr_ptr": "fp32", "src_ptr": "bf16", "out0_ptr": "bf16", "rest_ptr": "bf16",
    "part_ptr": "fp32", "dsrc_ptr": "bf16", "base_ptr": "bf16", "out_ptr": "bf16", "gcopy_ptr": "bf16",
    "gtab_ptr": "i64", "init_ptr": "bf16", "add_ptr": "bf16", "sum_ptr": "bf16",
    "dqg_part_ptr": "fp32", "acc_ptr": "fp32", "dr_ptr": "fp32", "nw_ptr": "fp32", "normed_ptr": "bf16",
    "nstats_ptr": "fp32",
}
FLOATS = {"eps", "norm_eps"}
INT64 = {"g_offset"}  # an offset in elements, of any size
ALIGNED = set(POINTERS) | {"stride_s"}  # 16-divisible, as the JIT sees them on a launch
TOKENS = "N"  # 16-divisible at every preset: so too on a launch where the kernel specialises it


def compile_for_sm90(fn, meta: dict, warps: int, stages: int | None = None, maxnreg: int | None = None):
    names = fn.arg_names
    constexprs = {k: v for k, v in meta.items() if k in names}
    signature = {n: "constexpr" if n in constexprs else f"*{POINTERS[n]}" if n in POINTERS
                 else "fp32" if n in FLOATS else "i64" if n in INT64 else "i32" for n in names}
    aligned = ALIGNED | ({TOKENS} if TOKENS not in fn.do_not_specialize else set())
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n in aligned}
    options = {"num_warps": warps, **({"num_stages": stages} if stages else {}), **({"maxnreg": maxnreg} if maxnreg else {})}
    return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs), target=TARGET,
                          options=options)


def cuobjdump(compiled, flag: str) -> str:
    """``cuobjdump FLAG`` of the kernel's cubin (the cuobjdump in triton's package)."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        return subprocess.run([tool, flag, f.name], capture_output=True, text=True, check=True).stdout


def registers(compiled) -> tuple[int, int]:
    """Registers a thread and stack bytes, from ``cuobjdump -res-usage``."""
    m = re.search(r"REG:(\d+) STACK:(\d+)", cuobjdump(compiled, "-res-usage"))
    return int(m.group(1)), int(m.group(2))


def sass_loop(compiled) -> list[str]:
    """The longest loop's instructions in the kernel's SASS (``cuobjdump -sass``)."""
    return loop_instructions(cuobjdump(compiled, "-sass"))


def longest_loop(sass: str) -> int:
    """Instructions from a backward branch's target to the branch, for the longest such loop; 0 if none."""
    return len(loop_instructions(sass))


def loop_instructions(sass: str) -> list[str]:
    """The instructions from a backward branch's target to the branch, for the longest such loop."""
    listing = [(int(m.group(1), 16), m.group(2))
               for m in re.finditer(r"^\s+/\*([0-9a-f]{4,})\*/\s*([^\n]*)", sass, re.M)]
    longest: list[str] = []
    for at, text in listing:
        m = re.search(r"BRA[^\n]*?(0x[0-9a-f]+)", text)
        if m and int(m.group(1), 16) < at:
            loop = [t for a, t in listing if int(m.group(1), 16) <= a <= at]
            longest = loop if len(loop) > len(longest) else longest
    return longest


def barriers(loop: list[str]) -> int:
    """``BAR`` instructions (a block-wide barrier: a reduction or a layout conversion across warps) in a loop."""
    return sum(re.match(r"(@!?U?P\w+\s+)?BAR\b", t.strip()) is not None for t in loop)


def loop_conversions(ttgir: str) -> int:
    """``convert_layout`` ops after the first loop's start (the main loop; the epilogue's count too)."""
    lines = ttgir.splitlines()
    start = next((i for i, line in enumerate(lines) if "scf.for" in line), len(lines))
    return sum("convert_layout" in line for line in lines[start:])


def row(kernel: str, d: int, config, warps: int, compiled, loop_bytes: float) -> dict:
    """``loop_bytes``: bytes of rows that one iteration of the main loop reads, for the whole program."""
    regs, stack = registers(compiled)
    loop = sass_loop(compiled)
    return {"kernel": kernel, "d": d, "config": str(config), "warps": warps, "registers": regs, "stack": stack,
            "shared bytes": compiled.metadata.shared, "conversions in loop": loop_conversions(compiled.asm["ttgir"]),
            "barriers in loop": barriers(loop), "loop instructions": len(loop),
            "per byte a warp": round(len(loop) * warps / loop_bytes, 3)}


def column_rows(d: int, heads: int, configs: list[tuple], use_ptx: bool) -> list[dict]:
    """The column kernel at the tables' configurations and ``configs``, one slot a pass and (where the
    two-slot table pairs, or for ``configs``) two slots a pass."""
    out = []
    for two in (False, True):
        table = column.column_config(d, two_slots=two) if not two or column.pairs_slots(d) else None
        for block_n, warps, stages in ([table] if table else []) + [c for c in configs if c != table]:
            if two and block_n > 1 and not stages:
                continue  # the prefetching kernel takes two slots with one token a program
            meta = {**head_meta(d, heads, has_b=True), "PTX": use_ptx, "LOW": two, "CARRY": False,
                    "TABLE": column.grads_in_place(d)}
            if stages:
                fn, meta = column.slot._column_bwd_kernel, {**meta, "BLOCK_N": block_n, "STAGES": stages}
            else:
                fn, meta = column.slot._column_bwd_prefetch_kernel, {**meta, "PAIR": block_n == 2}
            # per site: the tokens' output-gradient rows (bf16) and the site's query row (fp32)
            loop_bytes = block_n * d * 2 + d * 4
            name = fn.fn.__name__ + (" (two slots)" if two else "")
            out.append(row(name, d, (block_n, warps, stages), warps, compile_for_sm90(fn, meta, warps), loop_bytes))
    return out


def history_rows(d: int, heads: int, block_g: int, configs: list[tuple], use_ptx: bool) -> list[dict]:
    out = []
    table = history.HISTORY_CONFIG["fwd_split" if (d // heads) & (d // heads - 1) else "fwd"][block_g]
    for config in [table] + [c for c in configs if c != table]:
        block_n, warps, stages, sources = config
        meta = {**head_meta(d, heads, has_b=True), "BLOCK_G": block_g, "BLOCK_N": block_n, "STAGES": stages,
                "SOURCES": sources, "PTX": use_ptx}
        fn = history.shared._history_fwd_kernel
        loop_bytes = sources * block_n * (d // heads) * 2  # an iteration's sources, one head of bf16 rows
        out.append(row(fn.fn.__name__, d, config, warps, compile_for_sm90(fn, meta, warps), loop_bytes))
    return out


def history_dot_rows(d: int, heads: int, block_g: int, configs: list[tuple], use_ptx: bool) -> list[dict]:
    """The shared pass's matrix-product form at the table's configuration and ``configs`` (TOKENS, WARPS,
    STAGES, MAX_S), with a token's sources in one tile of MAX_S and over several (the running softmax)."""
    out = []
    meta = head_meta(d, heads, has_b=True)
    if not products_fit(meta):
        return out
    table = history.HISTORY_DOT_CONFIG
    for config in ([table] if table else []) + [c for c in configs if c != table]:
        _, warps, stages, max_s = config
        for one_tile in (True, False):
            fn_meta = {**meta, "HALF": max(8, block_g), "BLOCK_S": max_s, "STAGES": stages, "ONE_TILE": one_tile,
                       "PTX": use_ptx}
            fn = history.shared_dot._history_fwd_dot_kernel
            loop_bytes = max_s * (d // heads) * 2  # a tile of one head's rows, bf16
            name = fn.fn.__name__ + (" (one tile)" if one_tile else " (tiles)")
            out.append(row(name, d, config, warps, compile_for_sm90(fn, fn_meta, warps), loop_bytes))
    return out


def stacked_rows(d: int, heads: int, block_g: int, configs: list[tuple], use_ptx: bool) -> list[dict]:
    """The shared pass's stacked products' form (several tokens' sources in a tile's rows) at the table's
    configuration if set and ``configs`` (TOKENS, WARPS, STAGES, ROWS), at a quarter and half as many sources as
    the tile has rows (four tokens a tile and two, at four sites)."""
    out = []
    meta = head_meta(d, heads, has_b=True)
    if not products_fit(meta):
        return out
    table = [history.HISTORY_STACKED_CONFIG[1:]] if history.HISTORY_STACKED_CONFIG else []
    for warps, stages, rows in table + [c[1:] for c in configs if c[1:] not in table]:
        for S in (rows // 4, rows // 2):
            tokens, per_token = history.stacked_tile(S, block_g, rows)
            fn_meta = {**meta, "BLOCK_G": block_g, "T": tokens, "SP": per_token, "STAGES": stages, "PTX": use_ptx}
            fn = history.shared_stacked._history_fwd_stacked_kernel
            loop_bytes = tokens * S * (d // heads) * 2  # a tile's sources, one head of bf16 rows
            out.append(row(f"{fn.fn.__name__} (S = {S}: {tokens} tokens a tile of {rows})", d, (warps, stages),
                           warps, compile_for_sm90(fn, fn_meta, warps), loop_bytes))
    return out


def group_rows(d: int, heads: int, configs: list[tuple], use_ptx: bool) -> list[dict]:
    """The backward by source over a group of slots (``column_group``) at the table's configuration and
    ``configs`` (TOKENS, WARPS, STAGES, MAX_S[, HOLD]), for groups of 16 slots, with a pass's sites in one
    tile of MAX_S and over several."""
    out = []
    meta = head_meta(d, heads, has_b=True)
    if not products_fit(meta):
        return out
    table = column_group.GROUP_CONFIGS[min(column_group.GROUP_CONFIGS, key=lambda w: (abs(w - d), w))]
    for config in [table] + [c for c in configs if c != table]:
        _, warps, stages, max_s, hold = column_group.unpack_config(config)
        for block_b in (column_group.MAX_GROUP,):
            for one_tile in (True, False):
                fn_meta = {**meta, "BLOCK_B": block_b, "BLOCK_S": max_s, "STAGES": stages, "ONE_TILE": one_tile,
                           "HOLD": hold if one_tile else 1, "PTX": use_ptx, "TABLE": column.grads_in_place(d)}
                fn = column_group._column_group_kernel
                # a tile of one head's output-gradient rows (bf16) and the group's slot rows (bf16)
                loop_bytes = (max_s + block_b) * (d // heads) * 2
                name = f"{fn.fn.__name__} ({block_b} slots, {'one tile' if one_tile else 'tiles'})"
                out.append(row(name, d, config, warps, compile_for_sm90(fn, fn_meta, warps), loop_bytes))
    return out


def row_bwd_rows(d: int, heads: int, stages: list[int], norms: bool, warps_list: list[int]) -> list[dict]:
    """The backward row kernel (``history.sites_backward``) as training launches it: a site's prologue
    alone (S = 0) and a ``block:K`` site with its partial sum (S = 1, added to the later sums' gradient),
    with ``norms`` the sublayer's pre-norm's backward folded in, at the table's pipeline depth and at
    ``stages``, with the table's register cap; and at the table's depth with ``warps_list``' warps."""
    out = []
    warps = history.common._num_warps(d, heads, 1)
    in_place = column.grads_in_place(d)
    configs, default = ((history.ROW_BWD_NORM_CONFIG, history.ROW_BWD_NORM_DEFAULT) if norms
                        else (history.ROW_BWD_CONFIG, history.ROW_BWD_DEFAULT))
    for S in (0, 1):
        meta = {**head_meta(d, heads, has_b=True), "BLOCK_G": 1, "ACCUMULATE": S > 0, "COMPUTE_DELTA": True,
                "COPY_GRAD": norms or not in_place, "RECORD": in_place, "WRITE_DQG": S > 0, "NORM": norms,
                "USE_RMS": S > 0, "S": S}
        cap, table = configs.get((d, heads), (default,) * 2)[S]
        fn = history.backward._sites_bwd_kernel
        # a token's rows: the output gradient and the output, and with S = 1 the sum and the later gradient
        loop_bytes = (2 + 2 * S) * d * 2
        for depth, w in [(depth, warps) for depth in [table] + [s for s in stages if s != table]] + [
                (table, w) for w in warps_list if w != warps]:
            compiled = compile_for_sm90(fn, {**meta, "STAGES": depth}, w, maxnreg=cap or None)
            out.append(row(f"{fn.fn.__name__} (S = {S})", d, (depth, cap), w, compiled, loop_bytes))
    return out


def merge_rows(d: int, heads: int, stages: list[int], norms: bool) -> list[dict]:
    """A site's merge (``history._merge_fwd_kernel``) as training launches it: ``block:K``'s (one source, the
    block's partial sum made in the pass) and ``full``'s (1 to 3 slots with their RMS), at the table's pipeline
    depth (2 and the row kernels' warps at widths the table leaves to the row kernel) and at ``stages``; with
    ``norms`` the sublayer's pre-norm written too."""
    out = []
    warps, table = history.MERGE_CONFIG.get((d, heads), (history.common._num_warps(d, heads, 1), 2))
    for S, add in ((1, True), (1, False), (3, False)):
        meta = {**head_meta(d, heads, has_b=True), "S": S, "USE_RMS": not add, "KEEP_RMS": add, "ADD": add,
                "NORM": norms}
        for depth in [table] + [s for s in stages if s != table]:
            fn = history.sites._merge_fwd_kernel
            # a token's rows: the partial state, the S sources, with ADD the block's last output
            loop_bytes = (1 + S + add) * d * 2
            compiled = compile_for_sm90(fn, {**meta, "STAGES": depth}, warps)
            out.append(row(f"{fn.fn.__name__} (S = {S}{', sum made' if add else ''})", d, (warps, depth), warps,
                           compiled, loop_bytes))
    return out


def query_rows(d: int, heads: int, configs: list[tuple]) -> list[dict]:
    """The query gradients' kernel at the table's configuration and ``configs`` (SITES, TOKENS, WARPS,
    STAGES, PROGRAMS A SM), for a block of SITES sites."""
    out = []
    meta = {**head_meta(d, heads, has_b=True), "BLOCKS": 1}
    for config in [column.QUERY_GRAD_CONFIG] + [c for c in configs if c != column.QUERY_GRAD_CONFIG]:
        block_s, block_k, warps, stages = config[:4]
        fn_meta = {**meta, "BLOCK_S": block_s, "BLOCK_K": block_k, "USE_DOT": True, "SPLIT_BF16": True}
        # a block of dz*r (fp32) and of the slot's head (bf16)
        loop_bytes = block_s * block_k * 4 + block_k * (d // heads) * 2
        out.append(row(column.query._dqg_kernel.fn.__name__, d, config, warps,
                       compile_for_sm90(column.query._dqg_kernel, fn_meta, warps, stages), loop_bytes))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--widths", default="512,1024,1280")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--column-configs", default="1,4,0;2,4,0;1,4,3;1,2,4",
                   help="'TOKENS,WARPS,STAGES;...' beside the table's entry (STAGES 0: the prefetching kernel)")
    p.add_argument("--history-configs", default="",
                   help="'TOKENS,WARPS,STAGES,SOURCES;...' for the head-tiled forward, beside the table's entry")
    p.add_argument("--history-dot", default="",
                   help="'TOKENS,WARPS,STAGES,MAX_S;...' for the head-tiled forward's matrix-product form")
    p.add_argument("--stacked-configs", default="1,1,3,16;1,1,2,16;1,1,3,32",
                   help="'TOKENS,WARPS,STAGES,ROWS;...' for the head-tiled forward's stacked products' form "
                   "(TOKENS does not change what compiles)")
    p.add_argument("--group-configs", default="",
                   help="'TOKENS,WARPS,STAGES,MAX_S[,HOLD];...' for the group pass of the backward by source")
    p.add_argument("--only", default="",
                   help="'column,history,dot,stacked,group,query,row,merge': these kernels' rows only")
    p.add_argument("--query-configs", default="",
                   help="'SITES,TOKENS,WARPS,STAGES,PER_SM;...' for the query gradients, beside the table's")
    p.add_argument("--row-stages", default="1,3", help="'STAGES,...': the backward row kernel's pipeline depths")
    p.add_argument("--row-warps", default="", help="'WARPS,...': the backward row kernel's warps a program, beside "
                   "the rule's (at the table's depth)")
    p.add_argument("--merge-stages", default="2,4", help="'STAGES,...': the merges' kernel's pipeline depths")
    p.add_argument("--sites-per-pass", type=int, default=4)
    p.add_argument("--portable", action="store_true", help="the interpreter's forms instead of the inline PTX")
    p.add_argument("--norms", action="store_true", help="the row and merge kernels with the sublayers' pre-norms "
                   "folded in (model/residual/fused.py, FOLD_NORMS_BY_GROUPING: block:K's default)")
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET"):
        print("kernel_resources.py: unset TRITON_INTERPRET (it compiles for the GPU)", file=sys.stderr)
        return 2
    configs = [tuple(int(v) for v in c.split(",")) for c in args.column_configs.split(";") if c.strip()]
    fwd_configs = [tuple(int(v) for v in c.split(",")) for c in args.history_configs.split(";") if c.strip()]
    query_configs = [tuple(int(v) for v in c.split(",")) for c in args.query_configs.split(";") if c.strip()]
    dot_configs = [tuple(int(v) for v in c.split(",")) for c in args.history_dot.split(";") if c.strip()]
    group_configs = [tuple(int(v) for v in c.split(",")) for c in args.group_configs.split(";") if c.strip()]
    stacked_configs = [tuple(int(v) for v in c.split(",")) for c in args.stacked_configs.split(";") if c.strip()]
    block_g = triton.next_power_of_2(args.sites_per_pass)
    ptx_forms = not args.portable
    kinds = {
        "column": lambda d: column_rows(d, args.heads, configs, ptx_forms),
        "history": lambda d: history_rows(d, args.heads, block_g, fwd_configs, ptx_forms),
        "dot": lambda d: history_dot_rows(d, args.heads, block_g, dot_configs, ptx_forms),
        "stacked": lambda d: stacked_rows(d, args.heads, block_g, stacked_configs, ptx_forms),
        "group": lambda d: group_rows(d, args.heads, group_configs, ptx_forms),
        "query": lambda d: query_rows(d, args.heads, query_configs),
        "row": lambda d: row_bwd_rows(d, args.heads, [int(v) for v in args.row_stages.split(",") if v.strip()],
                                      args.norms, [int(v) for v in args.row_warps.split(",") if v.strip()]),
        "merge": lambda d: merge_rows(d, args.heads, [int(v) for v in args.merge_stages.split(",") if v.strip()],
                                      args.norms),
    }
    only = [k for k in args.only.split(",") if k.strip()] or list(kinds)
    unknown = sorted(set(only) - set(kinds))
    if unknown:
        print(f"kernel_resources.py: --only takes {', '.join(kinds)}, not {', '.join(unknown)}", file=sys.stderr)
        return 2
    rows = []
    for d in (int(w) for w in args.widths.split(",")):
        for kind in only:
            rows += kinds[kind](d)
    print(f"triton {triton.__version__}, sm_90, H = {args.heads}{', portable forms' if args.portable else ''}")
    print(markdown_table(list(rows[0]), [[str(v) for v in r.values()] for r in rows]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
