"""The history kernels' launch switches and tables, measured or set by benchmarks and tests. The launch code
reads each as ``config.NAME`` when it launches, so that a value set here, or on the package
(``history.NAME = value``, which ``history/__init__.py`` forwards here), takes effect at the next launch."""

from __future__ import annotations


# slots.write_slot -------------------------------------------------------------------------------------------

# write_slot: tokens a program and warps, when set (benchmarks); else as many tokens as make 2,048 channels
# (4 KB of a bf16 buffer), 4 warps. Measured on the H200: at d = 512 four tokens 0.261 ms a step against
# 0.303 for one (75 against 65 % of copy); at d = 1024 and 1280, 1 to 8 tokens a program within 4 %.
WRITE_SLOT_CONFIG: tuple[int, int] | None = None


# The row kernels (sites.py, backward.py, slots.norm_rows) ---------------------------------------------------

# When set (benchmarks), the row kernels' warps. Measured on the H200: 2 or 8 warps instead of the rule's
# 4 were slower at every preset but `sites_fwd` at d = 1024 (0.933 against 0.961 ms a step).
ROW_WARPS: int | None = None
# The backward row kernel's launch by (model width, heads), for a site's prologue alone (S = 0) and with a
# source (S = 1, a block's partial sum): a cap on its registers a thread (0: none) and the tokens its loop
# keeps in flight (``num_stages``); other shapes take ROW_BWD_DEFAULT. Measured on the H200
# (benchmarks/bench_kernels.py --row-stages, a step's calls, docs/benchmarks.md "ninth round"): at
# d = 1280 (heads split 128 + 32) the partial-sum backward 2.86 ms with 2 stages, 2.45 with 3 (uncapped:
# 2.64, 2.54), the prologues 1.26 ms with 2 stages and a cap of 96 (1.25 with 160, 1.31-1.37 with 1 or 3
# stages or no cap); at d = 1024,
# 1.28 and 0.70 ms with 2 stages and no cap (3 stages 1.32 and 0.71, 1 stage 1.53 and 0.70).
ROW_BWD_CONFIG: dict[tuple[int, int], tuple[tuple[int, int], tuple[int, int]]] = {(1280, 8): ((96, 2), (128, 3))}
ROW_BWD_DEFAULT = (0, 2)
# The same for the sites whose sublayer's pre-norm the prologue's backward takes in (``Norm``, where a
# model's ``fold_norms`` says). Measured on the H200 for the first form of the kernel, whose norm took two
# levels of row sums (benchmarks/bench_kernels.py --norms, a step's calls, docs/benchmarks.md "seventeenth
# round"): it waited on its sums rather than on memory, and 3 stages without a cap were the fastest of 1-3
# stages and caps of 128 and 160 at d = 1024 and 1280 (at paper1b 2.04 ms for the prologues and 3.42 for the
# partial sums' backward, against 2.36 / 3.69 with the table's caps and 1.27 / 2.47 without the norm). The
# present form, which reads the norm's statistics and the partial sum's RMS from the forward, is not yet
# measured there.
ROW_BWD_NORM_CONFIG: dict[tuple[int, int], tuple[tuple[int, int], tuple[int, int]]] = {}
ROW_BWD_NORM_DEFAULT = (0, 3)
# When set (benchmarks): a cap on every row kernel's registers, the backward's stages.
ROW_MAXNREG: int | None = None
ROW_BWD_STAGES: int | None = None


# sites.py: the merges' kernel -------------------------------------------------------------------------------

# The merges' kernel (``_merge_fwd_kernel``) takes up to MERGE_MAX_S sources (unrolled: each count is a kernel
# of its own; training takes 1 to sites_per_pass - 1), at the (model width, heads) in MERGE_CONFIG, launched
# with its (warps, pipeline stages); other shapes merge in ``_sites_fwd_kernel``, one token a program.
# Measured on the H200 (benchmarks/bench_kernels.py, a step's calls, docs/benchmarks.md "fifteenth round"):
# at d = 1280 (heads split 128 + 32) block:4's merges 1.86 ms with (4, 2) against 2.11 in the row kernel
# (full's: 1.78 against 2.08; 3 stages 1.91 / 1.82, 4 stages 2.14 / 1.93, 2 or 8 warps slower); at d = 1024
# and 512 the row kernel was as fast or faster (block:4's 0.92 against 0.97 ms at paper350m, 0.48 against
# 0.51 at paper100m).
MERGE_MAX_S = 4
MERGE_CONFIG: dict[tuple[int, int], tuple[int, int]] = {(1280, 8): (4, 2)}


# shared.py: the shared pass's reductions' form --------------------------------------------------------------

# Launch configuration of the head-tiled kernel by the number of sites G (padded): tokens per program,
# warps, pipeline stages (iterations ahead), sources an iteration (2 or 4); "fwd_split" where a head is
# split in two blocks (a width that is not a power of two: with one token the rest block's loads are 2
# bytes a thread). Measured on the H200 at G = 4 (benchmarks/bench_kernels.py, a step's calls): d = 1024
# 2.70 ms (4 sources an iteration 2.93, two tokens 3.34), d = 512 1.02 ms, d = 1280 6.91 ms (one token
# 11.6); docs/benchmarks.md. A benchmark may replace entries to sweep them. On the interpreter: two-token
# tiles, so that tests cover the token mask.
HISTORY_CONFIG: dict[str, dict[int, tuple[int, int, int, int]]] = {
    "fwd": {2: (1, 1, 3, 2), 4: (1, 1, 3, 2), 8: (1, 1, 3, 2), 16: (1, 2, 3, 2)},
    "fwd_split": {2: (2, 1, 3, 2), 4: (2, 1, 3, 2), 8: (2, 1, 3, 2), 16: (2, 2, 3, 2)},  # heads split in two
}
_INTERPRETER_CONFIG = (2, 1, 2, 2)
# Token tiles a program of the reductions' form walks, by model width (0: as many programs as fit on the GPU at
# once, the tiles shared among them); HISTORY_TILES, when set (benchmarks), overrides the table. Measured on the
# H200 (benchmarks/bench_kernels.py, block:4's shared passes of a step, docs/benchmarks.md "fifteenth round"),
# ms with 16 / 4 / 1 / 0 tiles, and for the earlier kernel (one tile a program, no loop over tiles): d = 512
# 0.353 / 0.368 / 0.540 / 0.367 against 0.507; d = 1024 0.742 / 0.743 / 0.895 / 0.851 against 0.770; d = 1280
# 1.685 / 1.796 / 2.187 / 1.658 against 1.609 (64 tiles: 2.44). full's passes (this form below 8 or 12 sources):
# within 1 % of the earlier kernel's at d = 1024 and 1280, 4 % faster at 512.
HISTORY_TILES_BY_WIDTH = {512: 16, 1024: 16, 1280: 0}
HISTORY_TILES: int | None = None


# shared_dot.py ----------------------------------------------------------------------------------------------

# The matrix-product form of the shared pass (``_history_fwd_dot_kernel``), used where a head's blocks are
# wide enough for ``tl.dot``: tokens a program, warps, pipeline stages, and the most sources a tile (a
# tile is the next power of two >= S, at least 16, up to that). None (benchmarks): the reductions' form
# everywhere. Measured on the H200 (benchmarks/bench_history.py, G = 4, docs/benchmarks.md "tenth
# round"): 76-85 % of copy at S = 16, 32 and 64 against 36-50 % for the reductions, and within 8 % of the
# best of five configurations at every S measured. On the interpreter:
# three tokens a program, so that tests walk a program's token loop and a last program past the last token.
HISTORY_DOT_CONFIG: tuple[int, int, int, int] | None = (32, 1, 3, 32)
_INTERPRETER_DOT_CONFIG = (3, 1, 1, 16)
# From how many sources the products' form is used, for heads of a power-of-two width and for split heads:
# a tile is at least 16 sources, and below these counts the reductions' form measured faster (at S = 4:
# 0.070 against 0.089 ms at paper350m; at S = 8 with the split head of paper1b, 0.117 against 0.121).
HISTORY_DOT_MIN_S = (8, 12)


# shared_stacked.py ------------------------------------------------------------------------------------------

# The stacked products' form (``_history_fwd_stacked_kernel``), where a head's blocks are wide enough for
# ``tl.dot``, for passes over at most half as many sources as a tile has rows (so that a tile holds at least two
# tokens' sources; a pass over more, or over fewer tokens than a tile holds, takes the matrix products' or the
# reductions' form): tokens a program, warps, pipeline stages, rows a tile (16 or 32). None: not used.
# Compiled for sm_90 (benchmarks/kernel_resources.py --only stacked; docs/benchmarks.md "nineteenth round"),
# with 16 rows its loop issues 0.13-0.15 instructions a byte read, a warp, at d = 1024 and 1280 against the
# reductions' form's 0.84 and 0.64 (0.19-0.22 against 1.15 at d = 512); 32 rows 0.10-0.11 there, with 196-255
# registers. Measured on the H200 in training steps (docs/benchmarks.md "twentieth round"): block:4's shared
# passes at paper1b 1.7 -> 1.2 ms a step (0.9 in this form, 0.3 for the pass over 9 sources, which takes the
# reductions'); the step, block:4 against the compiled baseline with --rounds 11: 0.987x against 0.977x at
# paper350m, 0.976x against 0.974x at paper1b with the norms folded. On the interpreter: two tiles a program,
# so that tests walk a program's tiles and a last tile that overlaps the one before.
HISTORY_STACKED_CONFIG: tuple[int, int, int, int] | None = (32, 1, 3, 16)
_INTERPRETER_STACKED_TILES = 2


# row_sums.py ------------------------------------------------------------------------------------------------

# add_row_sums: rows a tile, channels a program, warps, pipeline stages. Its input is a persistent kernel's
# partial sums, one row per program (1,056 at d = 1024 on the H200), just written and in L2. Measured there
# (benchmarks/bench_row_sums.py, a step's calls replayed from a CUDA graph): 2.8 us a call at d = 1024,
# 3.9 at d = 512, 2.4 at d = 1280, against 9.0-9.9 for torch's sum and add; (128, 16, 4, 3) 3.0 / 4.3 / 2.4.
ROW_SUM_CONFIG = (256, 16, 4, 3)
