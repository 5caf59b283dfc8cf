"""The norm's CUDA launch plans (csrc/norm/norm_plan.c) as a table, checked on
the CPU with no GPU: fusedops._C._norm_plan makes the plan the CUDA launcher
would make for a call, on a device described by its facts.

The expected plans are those of the planning code before it moved into
norm_plan.c (norm_cuda.cu at e28ed3f), worked out by hand from its rules; the
comment on each row names the rule that decides it. Occupancy comes from
OCCUPANCY below, a stand-in for the CUDA occupancy calculator that knows
threads and shared memory but not registers: the grids are the plans' arithmetic
on those answers, not a GPU's."""
import pytest

from fusedops import _C

F32, F16, BF16 = 0, 1, 2  # fo_dtype

# (SMs, shared memory a block may opt in to, GB/s of memory bandwidth an SM,
# compute capability) and the shared memory an SM has.
DEVICES = {
    "h100": ((132, 227 * 1024, 25, 90), 228 * 1024),
    "h200": ((132, 227 * 1024, 36, 90), 228 * 1024),
    "a100": ((108, 163 * 1024, 14, 80), 164 * 1024),
}


def occupancy(device):
    """blocks_per_sm and clusters callables for a device: at most 32 blocks and
    2048 threads an SM, 1 KB of shared memory reserved a block."""
    facts, smem_sm = DEVICES[device]

    def blocks(plan, threads, smem):
        n = min(32, 2048 // threads, smem_sm // (smem + 1024) if smem else 32)
        return max(1, n)

    def clusters(plan, threads, smem):
        return max(1, facts[0] * blocks(plan, threads, smem) // plan["cl"])

    return blocks, clusters


def plan(direction, device, cols, dtypes=(BF16, BF16, BF16), rows=4096, **opts):
    blocks, clusters = occupancy(device)
    return _C._norm_plan(direction, rows, cols, *dtypes, opts, DEVICES[device][0], blocks, clusters)


LN, RMS = {}, {"rms": 1}
# (direction, device, cols, dtypes, options, rows) -> the plan's fields that matter
TABLE = [
    # fwd_regs: 8 values a thread where that team has at most 512 threads
    ("fwd", "h100", 4096, (BF16,) * 3, LN, 4096, dict(kernel="regs", vec=8, nv=1, team=512, rpb=1, grid=4096)),
    ("fwd", "a100", 4096, (BF16,) * 3, LN, 4096, dict(kernel="regs", vec=8, nv=1, team=512, rpb=1, grid=4096)),
    # ln_sixteen: LayerNorm at 2K-4K takes 16 values on bandwidth-rich SMs (H200), RMSNorm does not
    ("fwd", "h200", 4096, (BF16,) * 3, LN, 4096, dict(kernel="regs", vec=8, nv=2, team=256, rpb=1, grid=4096)),
    ("fwd", "h200", 4096, (BF16,) * 3, RMS, 4096, dict(kernel="regs", vec=8, nv=1, team=512, rpb=1)),
    # past 512 threads at 8 values: 16 values a thread; 32 where 16 cannot
    ("fwd", "h100", 8192, (BF16,) * 3, RMS, 4096, dict(kernel="regs", vec=8, nv=2, team=512)),
    ("fwd", "h100", 16384, (BF16,) * 3, RMS, 4096, dict(kernel="regs", vec=8, nv=4, team=512)),
    # fp32: 4 values a chunk, a team of 1024 at 8 values
    ("fwd", "h100", 8192, (F32,) * 3, LN, 4096, dict(kernel="regs", vec=4, nv=2, team=1024, grid=4096)),
    # an fp32 s: 16-byte access still (8 fp16 values of x)
    ("fwd", "h100", 4096, (F16, F32, F16), RMS, 4096, dict(kernel="regs", vec=8, nv=1, team=512)),
    # fwd_warp: a team of 64 half empty (264 = 33 chunks) runs one warp a row, 8 rows a block
    ("fwd", "h100", 264, (BF16,) * 3, LN, 4096, dict(kernel="regs", vec=8, nv=2, team=32, rpb=8, grid=512)),
    # fwd_narrow: a block a row at 1024; eight rows with statistics at 256 (and LayerNorm's 512)
    ("fwd", "h100", 1024, (BF16,) * 3, LN, 4096, dict(kernel="narrow", team=32, rpb=1, grid=4096, small_l1=0)),
    ("fwd", "h100", 512, (BF16,) * 3, LN, 4096, dict(kernel="narrow", rpb=8, grid=512, small_l1=0)),
    ("fwd", "h100", 512, (BF16,) * 3, RMS, 4096, dict(kernel="narrow", rpb=1, grid=4096, small_l1=1)),
    ("fwd", "h100", 256, (BF16,) * 3, RMS, 4096, dict(kernel="narrow", rpb=8, grid=512)),
    # without statistics at 256: two rows a block on bandwidth-rich SMs only
    ("fwd", "h100", 256, (BF16,) * 3, dict(rms=1, stats=0), 4096, dict(kernel="narrow", rpb=1, grid=4096)),
    ("fwd", "h200", 256, (BF16,) * 3, dict(rms=1, stats=0), 4096, dict(kernel="narrow", rpb=2, grid=2048)),
    # no residual: not fwd_narrow's call
    ("fwd", "h100", 1024, (BF16,) * 3, dict(residual=0), 4096, dict(kernel="regs", vec=8, nv=1, team=128)),
    # fwd_group: rows that allow no 8-byte access, a group of 16 bytes' rows
    ("fwd", "h100", 257, (BF16,) * 3, LN, 4096, dict(kernel="group", team=32, rpb=8, smem=8224, grid=512)),
    ("fwd", "h100", 257, (F32,) * 3, LN, 4096, dict(kernel="group", team=32, rpb=4, smem=8224, grid=1024)),
    # fwd_shift: 8-byte rows (4 mod 8), 4-byte rows past 1536, odd rows; 1, 1, 4 chunks (of 8 values)
    ("fwd", "h100", 4100, (BF16,) * 3, LN, 4096, dict(kernel="shift", vec=8, nv=1, team=512, grid=4096)),
    ("fwd", "h100", 2050, (BF16,) * 3, LN, 4096, dict(kernel="shift", vec=8, nv=1, team=256)),
    ("fwd", "h100", 10002, (BF16,) * 3, LN, 4096, dict(kernel="shift", vec=8, nv=4, team=320)),
    ("fwd", "h100", 4097, (BF16,) * 3, LN, 4096, dict(kernel="shift", vec=8, nv=1, team=512)),
    # rows with gaps: no shift; one-element chunks past 512 threads take the loop kernel
    ("fwd", "h100", 4097, (BF16,) * 3, dict(stride=4100), 4096, dict(kernel="loop", vec=1, team=512, grid=528)),
    # fwd_park: 16K-32K rows that fill their last wave; in place of bf16's 1024-thread teams
    # at most two waves, one for RMSNorm on bandwidth-rich SMs
    ("fwd", "h100", 32768, (BF16,) * 3, RMS, 512, dict(kernel="regs", vec=8, nv=4, team=1024, grid=512)),
    ("fwd", "h100", 32768, (BF16,) * 3, RMS, 792, dict(kernel="park", team=512, smem=65536, grid=792)),
    ("fwd", "h200", 32768, (BF16,) * 3, RMS, 792, dict(kernel="regs", vec=8, nv=4, team=1024)),
    ("fwd", "h200", 32768, (BF16,) * 3, LN, 792, dict(kernel="park", team=512, grid=792)),
    ("fwd", "a100", 32768, (F16,) * 3, RMS, 792, dict(kernel="park", team=512, grid=792)),
    # fwd_pipe: rows no team holds, over a cluster on sm_90; the loop kernel on sm_80
    ("fwd", "h100", 65536, (BF16,) * 3, LN, 4096, dict(kernel="pipe", nv=2, team=512, cl=8, stages=2,
                                                      smem=65536, grid=392)),
    ("fwd", "a100", 65536, (BF16,) * 3, LN, 4096, dict(kernel="loop", vec=8, team=512, grid=432)),
    ("fwd", "h100", 16384, (F32,) * 3, LN, 4096, dict(kernel="pipe", vec=4, team=512, cl=4, smem=65536,
                                                     grid=396)),
    ("fwd", "a100", 16384, (F32,) * 3, LN, 4096, dict(kernel="loop", vec=4, team=512, grid=432)),
    # bwd_pipe: 16-bit rows from 2304 values
    ("bwd", "h100", 4096, (BF16,) * 3, LN, 4096, dict(kernel="pipe", nv=2, team=256, cl=1, stages=2,
                                                     smem=49152, grid=528, parts=528)),
    ("bwd", "a100", 4096, (BF16,) * 3, LN, 4096, dict(kernel="pipe", team=256, smem=49152, grid=324, parts=324)),
    # bwd_regs: teams toward 1024-thread blocks, a persistent grid, a partial row a block
    ("bwd", "h100", 1024, (BF16,) * 3, LN, 4096, dict(kernel="regs", vec=8, nv=1, team=128, rpb=8, smem=65536,
                                                     grid=264, parts=264)),
    # bwd_mid_bf16: bf16 at 2056 wide takes 16 values a thread
    ("bwd", "h100", 2056, (BF16,) * 3, RMS, 4096, dict(kernel="regs", vec=8, nv=2, team=160, rpb=3, smem=61440,
                                                      grid=396, parts=396)),
    # one warp a row where a team of two warps has lanes to spare (384 wide), 15 teams a block
    ("bwd", "h100", 384, (BF16,) * 3, LN, 4096, dict(kernel="regs", vec=8, nv=2, team=32, rpb=15, smem=61440,
                                                    grid=274, parts=274)),
    # one-element chunks: 8 a thread; resident_rows keeps 3 teams a block
    ("bwd", "h100", 1025, (F16, F32, F16), LN, 4096, dict(kernel="regs", vec=1, nv=8, team=160, rpb=3,
                                                           smem=30720, grid=528, parts=528)),
    # 16 one-element chunks from sm_90 on (rows with gaps: no bwd_shift); sm_80 takes the loop kernel
    ("bwd", "h100", 4097, (BF16,) * 3, dict(stride=4100), 4096, dict(kernel="regs", vec=1, nv=16, team=288, rpb=1,
                                                                     smem=36864, grid=792, parts=792)),
    ("bwd", "a100", 4097, (BF16,) * 3, dict(stride=4100), 4096, dict(kernel="loop", vec=1, team=512, grid=432,
                                                                     parts=4, col_blocks=129, rows_per_part=1024)),
    # bwd_loop + dwdb_cols past what a team holds
    ("bwd", "h100", 8195, (BF16,) * 3, LN, 4096, dict(kernel="loop", vec=1, team=512, grid=528, parts=3,
                                                     col_blocks=257, rows_per_part=1366)),
    # bwd_shift: contiguous odd rows where bwd_group's sums do not fit
    ("bwd", "h100", 1025, (BF16,) * 3, LN, 4096, dict(kernel="shift", nv=1, team=128, smem=8256, grid=2112,
                                                     parts=2112)),
    # bwd_group: rows of a 4-byte access within 48 KB a group
    ("bwd", "h100", 262, (BF16,) * 3, dict(ds=0), 4096, dict(kernel="group", team=32, rpb=8)),
    # no dweight / dbias wanted: no partial rows
    ("bwd", "h100", 1024, (BF16,) * 3, dict(weight=0, dbias=0), 4096, dict(kernel="regs", parts=0, smem=0)),
]


@pytest.mark.parametrize("direction,device,cols,dtypes,opts,rows,want", TABLE,
                         ids=[f"{r[0]}-{r[1]}-{r[2]}-{'x'.join(map(str, r[3]))}-{r[5]}" for r in TABLE])
def test_plan_table(direction, device, cols, dtypes, opts, rows, want):
    got = plan(direction, device, cols, dtypes, rows, **opts)
    assert {k: got[k] for k in want} == want, got


# Tuning knobs (common/tune.h) change plans in-process, and restore.
KNOB_TABLE = [
    ("norm_park", 2, ("fwd", "h100", 32768, (BF16,) * 3, RMS, 512), dict(kernel="park", grid=512)),
    ("norm_park", 0, ("fwd", "h100", 32768, (BF16,) * 3, RMS, 792), dict(kernel="regs", team=1024)),
    ("norm_stages", 0, ("fwd", "h100", 65536, (BF16,) * 3, LN, 4096), dict(kernel="loop")),
    ("norm_stages", 4, ("fwd", "h100", 65536, (BF16,) * 3, LN, 4096), dict(kernel="pipe", stages=4,
                                                                          smem=4 * 32768)),
    ("norm_values", 16, ("bwd", "h100", 1024, (BF16,) * 3, LN, 4096), dict(kernel="regs", nv=2, team=64, rpb=8,
                                                                          grid=396)),
    ("norm_narrow_block", 2, ("fwd", "h100", 256, (BF16,) * 3, dict(rms=1, stats=0), 4096), dict(rpb=2)),
    ("norm_ln16", 0, ("fwd", "h200", 4096, (BF16,) * 3, LN, 4096), dict(nv=1, team=512)),
    ("norm_ln16", 2, ("fwd", "h100", 4096, (BF16,) * 3, LN, 4096), dict(nv=2, team=256)),
    ("norm_bwd_pipe_from", 65536, ("bwd", "h100", 4096, (BF16,) * 3, LN, 4096), dict(kernel="regs", nv=1,
                                                                                    team=512, rpb=2)),
    ("norm_narrow", 0, ("fwd", "h100", 1024, (BF16,) * 3, LN, 4096), dict(kernel="regs", team=128)),
    ("norm_group", 0, ("fwd", "h100", 257, (BF16,) * 3, LN, 4096), dict(kernel="regs", vec=1)),
    ("norm_shift", 0, ("fwd", "h100", 4100, (BF16,) * 3, LN, 4096), dict(kernel="regs", vec=4)),
    ("norm_shift_bwd", 0, ("bwd", "h100", 1025, (BF16,) * 3, LN, 4096), dict(kernel="regs", vec=1)),
    ("norm_group_bwd", 0, ("bwd", "h100", 262, (BF16,) * 3, dict(ds=0), 4096), dict(kernel="regs", vec=2, nv=8,
                                                                                   team=32)),
]


@pytest.mark.parametrize("name,value,call,want", KNOB_TABLE, ids=[f"{k[0]}={k[1]}" for k in KNOB_TABLE])
def test_plan_knobs(name, value, call, want):
    default = _C._tune()[name][3]
    old = _C._tune(name, value)
    try:
        direction, device, cols, dtypes, opts, rows = call
        got = plan(direction, device, cols, dtypes, rows, **opts)
        assert {k: got[k] for k in want} == want, got
    finally:
        assert _C._tune(name, None) == value
    assert old == default and _C._tune()[name][0] == default


def test_tune_rejects():
    with pytest.raises(KeyError, match="no knob named norm_nothing"):
        _C._tune("norm_nothing", 1)
    with pytest.raises(ValueError, match="norm_park=3 is outside its range"):
        _C._tune("norm_park", 3)
    assert _C._tune()["norm_park"][0] == 1
