"""The column kernels' launch switches and tables, measured or set by benchmarks and tests, and the rules
that read them (``grads_in_place``, ``group_slots``, ``pairs_slots``, ``column_config``). The launch code
reads each switch as ``config.NAME`` when it runs, so that a value set here, or on the package
(``column.NAME = value``, which ``column/__init__.py`` forwards here), takes effect at the next launch."""

from __future__ import annotations

from ..launch import by_width


# slot.py and passes.py: the column kernel, one slot a pass or two; the group passes -------------------------

# Launch configuration of the column kernel by model width: tokens per program, warps, pipeline stages (0:
# the kernel that loads one site ahead into registers, one or two tokens; else the shared-memory pipeline
# over STAGES sites, for a tile of tokens that share each query row). Measured on the H200
# (benchmarks/bench_kernels.py, a step's calls; docs/benchmarks.md): d = 512 2.24 ms (pipelined 2.47 at
# best), d = 1024 7.84 ms (pipelined 9.4 at best), d = 1280 17.9 ms with two tokens, 3 stages (one token
# 27.5, registers 30.3). Other widths take the nearest. COLUMN_CONFIG, when set (benchmarks, tests),
# overrides the table; so does COLUMN_MAXNREG (0: no register cap).
COLUMN_CONFIGS = {512: (1, 2, 0), 1024: (1, 4, 0), 1280: (2, 2, 3)}
COLUMN_CONFIG: tuple[int, int, int] | None = None
COLUMN_MAXNREG = 0
# The same for a pass over two slots (``slot_passes``), whose program holds both slots' rows and sums; None:
# one slot a pass at that width. Measured on the H200 (a step's passes, docs/benchmarks.md): d = 512 1.91 ms
# against 2.26 one slot a pass, d = 1024 5.97 against 7.88; at d = 1280 the one-slot passes' two-token
# tiles (17.6 ms, 83 % of copy) are as fast as the best two-slot pass (one token, 17.6 ms at 195
# registers). TWO_SLOT_CONFIG overrides the table (and pairs at every width); TWO_SLOTS = False
# (benchmarks) takes one slot a pass everywhere.
TWO_SLOT_CONFIGS: dict[int, tuple[int, int, int] | None] = {512: (1, 2, 0), 1024: (1, 4, 0), 1280: None}
TWO_SLOT_CONFIG: tuple[int, int, int] | None = None
TWO_SLOTS = True
# The query gradients' product: sites a block at most (the sites padded to a power of two, at least 16),
# tokens a block, warps, stages, and programs an SM (the tokens are split in as many chunks as that
# takes, each chunk's sums a row of the partial sums). Measured on the H200 (one launch for a step's
# slots, d = 1024 / 1280 / 512): 0.454 / 1.100 / 0.304 ms; 2 programs an SM 0.483 / 1.197 / 0.420; blocks
# of 128 sites with 8 warps 1.40 / 1.26 / 0.47.
QUERY_GRAD_CONFIG = (64, 32, 4, 3, 8)


# Group passes (``column_group``) by model width: the most slots one takes (``slot_passes`` chooses the
# runs), 0 for none. Measured on the H200 (benchmarks/bench_kernels.py, a step's column passes of ``full``,
# call M1; docs/benchmarks.md "eleventh round"): d = 1024 5.04 ms against 5.96 for two slots a pass,
# d = 1280 11.4 against 17.5 one slot a pass; d = 512 2.11-2.32 against 1.92, so none there. Other widths
# take the nearest. ``block:K`` groupings take none: with them block:4's routing kernels took 4.4 ms at
# paper350m and 9.4 at paper1b (call M6) against 4.0 and 9.1 without (tenth round). GROUP_SLOTS, when set
# (benchmarks, tests), overrides the table.
GROUP_SLOTS_BY_WIDTH = {512: 0, 1024: 16, 1280: 16}
GROUP_SLOTS: int | None = None


# Whether a step's backward reads the sites' output gradients where autograd left them (``grad_rows``: a table
# of offsets, which each site's backward prologue writes) or copies each into one stacked buffer, by model
# width. Measured on the H200 in one call (benchmarks/bench_kernels.py --other-grads, a step's calls of
# ``full``; docs/benchmarks.md "fourteenth round"), copied -> in place: at d = 1024 the prologues 0.708 ->
# 0.503 ms, the partial-sum backward of block:4's sites 1.296 -> 1.137, the column passes 4.487 -> 4.561; at
# d = 512 0.367 -> 0.265, 0.664 -> 0.581 and 1.905 -> 1.971; at d = 1280 1.271 -> 1.149, 2.477 -> 2.191 but
# the column passes 9.691 -> 10.029 (not profiled: the pipelined kernel used there reads each site's offset
# back from shared memory before it can issue that site's row copies). Other widths take the nearest;
# GRADS_IN_PLACE overrides the table.
GRADS_IN_PLACE_BY_WIDTH = {512: True, 1024: True, 1280: False}
GRADS_IN_PLACE: bool | None = None


# passes.py: the byte model that plans a step's passes -------------------------------------------------------

# What a unit that a group pass moves costs against a unit of the other passes (1: the byte model). The
# group kernel moves its bytes at about 36 % of copy and the slots' own passes at about 75 %
# (benchmarks/bench_kernels.py, call N2), so 2: fewer, larger groups, and more pairs. Measured (a step's
# column passes, call N5): 4.80 -> 4.51 ms at paper350m, 10.69 -> 9.70 at paper1b; 1.25 and 1.5 gave
# 4.52 / 4.46 and 10.41 / 10.25 ms, 3 gave 5.93 and 9.81.
GROUP_PASS_WEIGHT = 2.0


def grads_in_place(d: int) -> bool:
    """Whether the backward reads the output gradients in place (a table) at width ``d``, or copies them."""
    return GRADS_IN_PLACE if GRADS_IN_PLACE is not None else by_width(GRADS_IN_PLACE_BY_WIDTH, d)


def group_slots(d: int, num_heads: int, block: int = 1) -> int:
    """The most slots a group pass may take at width ``d`` with ``num_heads`` heads, when slot j is read by
    sites ``block * j`` .. (0: none)."""
    from ..column_group import MAX_GROUP, group_fits

    if GROUP_SLOTS is not None:
        most = GROUP_SLOTS
    else:
        most = by_width(GROUP_SLOTS_BY_WIDTH, d) if block == 1 else 0
    return min(most, MAX_GROUP) if most >= 3 and group_fits(d, num_heads) else 0


def pairs_slots(d: int) -> bool:
    """Whether the backward by source takes two slots a pass at width ``d`` (``slot_passes``)."""
    return TWO_SLOTS and (TWO_SLOT_CONFIG is not None or by_width(TWO_SLOT_CONFIGS, d) is not None)


def column_config(d: int, two_slots: bool = False) -> tuple[int, int, int]:
    """(tokens a program, warps, stages) of the column kernel at width ``d``, for one slot a pass or two."""
    override, table = (TWO_SLOT_CONFIG, TWO_SLOT_CONFIGS) if two_slots else (COLUMN_CONFIG, COLUMN_CONFIGS)
    config = override if override is not None else by_width(table, d)
    if config is None:
        raise ValueError(f"no two-slot column config at d = {d}: the table takes one slot a pass there")
    if two_slots and config[0] > 1 and config[2] == 0:
        raise ValueError(f"column config {config}: a pass over two slots takes one token a program unless "
                         "pipelined (stages > 0)")
    return config
