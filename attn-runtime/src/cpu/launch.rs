//! Running a compiled CPU kernel: inputs as f32 rows, RoPE tables, K packing per (batch, kv
//! head), then every (batch, head, query block) in parallel, each classifying its key tiles.
//!
//! RoPE tables are built in f64 for the call's positions (`host::rope_table`). Packed keys go to
//! buffers kept between calls. Blocks run on rayon last block first: under a causal mask the
//! last query blocks see the most keys, and started first they do not finish last.

use crate::error::RuntimeError;
use crate::host::checks::overflowed_rows_are_nan;
use crate::host::rope_table::{QkTables, Side};
use crate::placement::Piece;
use crate::tensor::{Storage, Tensor, narrow_into};
use attn_dsl::DType;
use attn_dsl::modifier::Var;
use attn_dsl::modifier::interval::Interval;
use codegen::cpu::abi::{BlockArgs, BlockTile, PackArgs, packed_k_len};
use codegen::cpu::{CpuKernel, Entry};
use codegen::plan::{CallShape, DataRanges, K_TILE, KernelPlan, TileCode};
use rayon::prelude::*;

/// Rows of a 4-D input as a kernel reads them: f32 storage, offset of element 0, and strides
/// of the three outer axes (the innermost is contiguous). Rows of 16-bit storage taken
/// [`Rows::by_slab`] stay in it (`narrow`) and are widened a slab at a time ([`Rows::slab`]).
pub(super) struct Rows<'a> {
    data: std::borrow::Cow<'a, [f32]>,
    narrow: Option<&'a Storage>,
    offset: usize,
    strides: [usize; 3],
}

/// A converted copy goes back to the buffer pool, for the next call's copy.
impl Drop for Rows<'_> {
    fn drop(&mut self) {
        if let std::borrow::Cow::Owned(data) = &mut self.data {
            crate::memory::recycle(std::mem::take(data));
        }
    }
}

impl<'a> Rows<'a> {
    /// Reads a 4-D tensor without a copy when it is f32 with contiguous rows, else converts it.
    pub fn of(t: &'a Tensor) -> Self {
        let s = t.strides();
        match t.f32_rows() {
            Some((data, offset)) => Rows {
                data: std::borrow::Cow::Borrowed(data),
                narrow: None,
                offset,
                strides: [s[0], s[1], s[2]],
            },
            None => {
                let sh = t.shape();
                Rows {
                    data: std::borrow::Cow::Owned(t.widened()),
                    narrow: None,
                    offset: 0,
                    strides: [sh[1] * sh[2] * sh[3], sh[2] * sh[3], sh[3]],
                }
            }
        }
    }

    /// [`Rows::of`], except that 16-bit rows are not converted up front: [`Rows::slab`]
    /// widens the rows a task reads as it reads them, so they reach the kernel from the
    /// cache rather than through a whole f32 copy in memory.
    pub fn by_slab(t: &'a Tensor) -> Self {
        match t.narrow_rows() {
            Some((storage, offset)) => {
                let s = t.strides();
                Rows {
                    data: std::borrow::Cow::Borrowed(&[]),
                    narrow: Some(storage),
                    offset,
                    strides: [s[0], s[1], s[2]],
                }
            }
            None => Rows::of(t),
        }
    }

    /// The values as the forward's `pv_tile` reads them: [`Rows::of`], except that rows whose
    /// stride [`row_stride_for`] would spread are copied, [`row_stride_for`]`(width)` apart.
    /// The copy costs a pass over v.
    pub fn of_values(t: &'a Tensor) -> Result<Self, RuntimeError> {
        let rows = Rows::of(t);
        let shape = t.shape();
        let [batch, heads, seq, width] = [shape[0], shape[1], shape[2], shape[3]];
        if row_stride_for(rows.strides[2]) == rows.strides[2] || width == 0 {
            return Ok(rows);
        }
        let stride = row_stride_for(width);
        rows.check_bounds([batch, heads, seq, width], "v")?;
        let count = batch * heads * seq;
        let bytes = crate::memory::checked_product(&[count as u64, stride as u64, 4]);
        crate::memory::ensure_fits("the values' copy with padded rows", bytes)?;
        let mut data = crate::memory::written_zeros(count * stride);
        data.par_chunks_mut(stride)
            .enumerate()
            .for_each(|(i, row)| {
                let at = rows.index(i / (heads * seq), i / seq % heads, i % seq);
                row[..width].copy_from_slice(&rows.data[at..at + width]);
            });
        Ok(Rows {
            data: std::borrow::Cow::Owned(data),
            narrow: None,
            offset: 0,
            strides: [heads * seq * stride, seq * stride, stride],
        })
    }

    /// Rows in `data` with the given outer strides (the innermost axis contiguous).
    pub fn borrowed(data: &'a [f32], strides: [usize; 3]) -> Self {
        Rows {
            data: std::borrow::Cow::Borrowed(data),
            narrow: None,
            offset: 0,
            strides,
        }
    }

    fn index(&self, a: usize, b: usize, c: usize) -> usize {
        self.offset + a * self.strides[0] + b * self.strides[1] + c * self.strides[2]
    }

    /// Row `[a, b, c]` of f32 rows (not of [`Rows::by_slab`]'s 16-bit ones: see
    /// [`Rows::slab`]).
    fn ptr(&self, a: usize, b: usize, c: usize) -> *const f32 {
        debug_assert!(self.narrow.is_none());
        self.data.as_ptr().wrapping_add(self.index(a, b, c))
    }

    /// Rows `[a, b, c..c + count]` of `width` values as f32, and their row stride: where they
    /// lie, or widened into `buffer` from 16-bit storage. Rows inside the input
    /// ([`Rows::check_bounds`]).
    fn slab(
        &self,
        [a, b, c]: [usize; 3],
        count: usize,
        width: usize,
        buffer: &mut Vec<f32>,
    ) -> (*const f32, i64) {
        let Some(storage) = self.narrow else {
            return (self.ptr(a, b, c), self.row_stride());
        };
        buffer.resize(count * width, 0.0);
        for (r, row) in buffer.chunks_exact_mut(width.max(1)).enumerate() {
            storage.widen_into(self.index(a, b, c + r), row);
        }
        (buffer.as_ptr(), width as i64)
    }

    fn row_stride(&self) -> i64 {
        self.strides[2] as i64
    }

    fn check_bounds(&self, shape: [usize; 4], name: &str) -> Result<(), RuntimeError> {
        let last = self.offset
            + (0..3)
                .map(|i| (shape[i].max(1) - 1) * self.strides[i])
                .sum::<usize>()
            + shape[3];
        let len = self.narrow.map_or(self.data.len(), Storage::len);
        if shape.contains(&0) || last <= len {
            Ok(())
        } else {
            Err(RuntimeError::Data(format!(
                "tensor `{name}`: strides run past its storage"
            )))
        }
    }
}

/// The row stride, in floats, for rows `stride` apart that the `pv_tile` microkernel reads
/// many of at once (values in the forward; queries, keys and output gradients in the
/// backward): `stride`, or a cache line more where it is a multiple of 512 bytes.
///
/// `pv_tile` reads a 128-byte panel of each of up to 64 rows, once per pair of accumulator
/// rows: 128 cache lines. Rows 512 bytes apart (dim 128) put them in 16 of L1's 64 sets, all 8
/// ways of each, with no room left for the rest of the tile's data; 1 KiB apart (dim 256), in 8
/// sets, twice what their ways hold, so every pass misses. A stride of an odd number of lines
/// spreads them over all 64 sets (measured on a 2-core AMD EPYC VM at 2,048 tokens, causal,
/// BENCHMARKS.md: differential heads with values of 256, forward 215-231 ms against 315-322
/// ms; head dim 256, forward + backward 565-633 ms against 744-811 ms).
pub(super) fn row_stride_for(stride: usize) -> usize {
    match stride > 0 && stride.is_multiple_of(128) {
        true => stride + 16,
        false => stride,
    }
}

/// Packed-key buffers kept between calls: they are large (a copy of K in f32) and fresh memory
/// costs page faults on every call.
struct PackedPool;

static PACKED_POOL: std::sync::Mutex<Vec<Vec<f32>>> = std::sync::Mutex::new(Vec::new());

impl PackedPool {
    /// A buffer of `len` values; `pack_k` overwrites every one of them.
    fn take(len: usize) -> Vec<f32> {
        let reused = PACKED_POOL
            .lock()
            .map(|mut pool| pool.pop())
            .unwrap_or(None);
        let mut buffer = reused.unwrap_or_default();
        buffer.resize(len, 0.0);
        buffer
    }

    /// Returns buffers for later calls.
    fn give(buffers: Vec<Vec<f32>>) {
        if let Ok(mut pool) = PACKED_POOL.lock() {
            pool.extend(buffers);
        }
    }
}

/// The parameter buffer as a kernel reads it (null without parameters or data), after checking
/// that it holds the plan's layout: generated code clamps each index into its tensor (a data
/// tensor's as its checked header says), so the buffer is never read past.
pub(super) fn param_pointer(plan: &KernelPlan, params: &[f32]) -> Result<ParamPtr, RuntimeError> {
    plan.params
        .check_buffer(params)
        .map_err(RuntimeError::Data)?;
    Ok(ParamPtr(if params.is_empty() {
        std::ptr::null()
    } else {
        params.as_ptr()
    }))
}

/// A read-only parameter buffer shared by the parallel tasks.
#[derive(Clone, Copy)]
pub(super) struct ParamPtr(*const f32);

impl ParamPtr {
    /// The pointer (a method, so closures capture the whole `Send` wrapper).
    pub fn get(self) -> *const f32 {
        self.0
    }
}
// SAFETY: the buffer is only read, and outlives the parallel loops of the call.
unsafe impl Send for ParamPtr {}
// SAFETY: as above.
unsafe impl Sync for ParamPtr {}

/// Shapes of one call.
pub(super) struct Call<'a> {
    pub batch: usize,
    pub sq: usize,
    pub skv: usize,
    pub position_offset: i64,
    /// The call's heads and where its queries lie ([`crate::placement`]).
    pub piece: Piece,
    /// Laid out as the plan's `ParamLayout`; empty without parameters.
    pub params: &'a [f32],
}

/// A pointer shared by the parallel tasks, each of which writes rows no other task writes.
#[derive(Clone, Copy)]
struct Shared<T>(*mut T);
// SAFETY: tasks write disjoint rows of the buffer (one query block of one (batch, head) each)
// and the buffer outlives the parallel loop.
unsafe impl<T> Send for Shared<T> {}
// SAFETY: as above; no task reads what another writes.
unsafe impl<T> Sync for Shared<T> {}

/// A call's output in its dtype, as the blocks write it: f32 rows straight into place; 16-bit
/// rows through each task's own f32 rows, rounded into place a block at a time, so that a
/// 16-bit output never passes through memory as f32.
struct OutputBuffer {
    room: Room,
    len: usize,
}

/// An output's vector, in its dtype.
enum Room {
    F32(Vec<f32>),
    F16(Vec<half::f16>),
    Bf16(Vec<half::bf16>),
}

/// Where a block's output rows go (see [`OutputBuffer`]).
#[derive(Clone, Copy)]
enum Target {
    F32(Shared<f32>),
    /// The bits of 16-bit values of `DType`, in capacity not yet initialized.
    Bits(Shared<std::mem::MaybeUninit<u16>>, DType),
}

impl OutputBuffer {
    /// Room for `len` values of `dtype`; f32 values start as zeros.
    fn new(dtype: DType, len: usize) -> Self {
        let room = match dtype {
            // Every row is written once by its block (never added to): calloc's untouched
            // zero pages fault in on that first write, with no zeroing pass before it.
            DType::F32 => Room::F32(crate::memory::written_zeros(len)),
            DType::F16 => Room::F16(Vec::with_capacity(len)),
            DType::Bf16 => Room::Bf16(Vec::with_capacity(len)),
        };
        OutputBuffer { room, len }
    }

    fn target(&mut self) -> Target {
        // f16 and bf16 are `repr(transparent)` over their u16 bits.
        match &mut self.room {
            Room::F32(v) => Target::F32(Shared(v.as_mut_ptr())),
            Room::F16(v) => Target::Bits(Shared(v.as_mut_ptr().cast()), DType::F16),
            Room::Bf16(v) => Target::Bits(Shared(v.as_mut_ptr().cast()), DType::Bf16),
        }
    }

    /// The written output.
    ///
    /// # Safety
    /// Every one of the `len` values of 16-bit storage was written through
    /// [`OutputBuffer::target`].
    unsafe fn finish(self) -> Storage {
        // SAFETY: the caller's contract; the capacity is `len` (`OutputBuffer::new`).
        unsafe {
            match self.room {
                Room::F32(v) => Storage::F32(v.into()),
                Room::F16(mut v) => {
                    v.set_len(self.len);
                    Storage::F16(v.into())
                }
                Room::Bf16(mut v) => {
                    v.set_len(self.len);
                    Storage::Bf16(v.into())
                }
            }
        }
    }
}

/// How query rows `q0..q1` of one (batch, head) meet each key tile (given the ranges of the data
/// its mask reads): its code, and the rows of a mixed tile that can keep a key (relative to
/// `q0`).
fn block_tiles(
    plan: &KernelPlan,
    call: &Call,
    data: Option<&DataRanges>,
    q0: usize,
    q1: usize,
    [b, h]: [usize; 2],
) -> Vec<BlockTile> {
    let shape = CallShape {
        sq: call.sq as i64,
        skv: call.skv as i64,
        p0: call.position_offset,
        query_shift: call.piece.query_shift,
        batch: Interval::point(b as i64),
        head: Interval::point(h as i64),
        data,
    };
    let rows = Interval::new(q0 as i64, q1 as i64 - 1);
    let tile = K_TILE as usize;
    let record = |code: TileCode, live: Interval, kept_from: i64| BlockTile {
        code: code as u32,
        first_row: (live.lo - rows.lo) as u32,
        end_row: (live.hi + 1 - rows.lo) as u32,
        kept_from: (kept_from - rows.lo) as u32,
    };
    let skip = record(TileCode::Skip, rows, rows.lo);
    (0..call.skv.div_ceil(tile))
        .map(|t| {
            let keys = Interval::new(
                (t * tile) as i64,
                (((t + 1) * tile).min(call.skv) - 1) as i64,
            );
            // The block function bounds keys itself: an incomplete tile can be `Full`.
            match plan.tile_code(rows, keys, shape, true) {
                TileCode::Skip => skip,
                TileCode::Full => record(TileCode::Full, rows, rows.lo),
                TileCode::Masked => match plan.live_rows(rows, keys, shape) {
                    Some(live) => record(TileCode::Masked, live, plan.kept_from(live, keys, shape)),
                    None => skip,
                },
            }
        })
        .collect()
}

/// Rows `rows` of a call after their block ran: overflowed ones NaN
/// ([`overflowed_rows_are_nan`]), and 16-bit outputs rounded into place from `out_rows`, the
/// task's f32 rows.
///
/// # Safety
/// `lse` points at the rows' log-sum-exps and `target` has room for their outputs (f32 ones
/// written there); nothing else reads or writes them meanwhile.
unsafe fn settle_rows(
    target: Target,
    out_rows: &mut [f32],
    lse: *mut f32,
    rows: std::ops::Range<usize>,
    dv: usize,
) {
    let values = rows.len() * dv;
    // SAFETY: the caller's contract.
    unsafe {
        let lse = std::slice::from_raw_parts_mut(lse, rows.len());
        match target {
            Target::F32(out) => {
                let out = std::slice::from_raw_parts_mut(out.0.add(rows.start * dv), values);
                overflowed_rows_are_nan(out, lse, dv);
            }
            Target::Bits(bits, dtype) => {
                overflowed_rows_are_nan(out_rows, lse, dv);
                let dst = std::slice::from_raw_parts_mut(bits.0.add(rows.start * dv), values);
                narrow_into(dtype, out_rows, dst);
            }
        }
    }
}

/// Runs the kernel; returns `out` `[B, Hq, Sq, Dv]` and `lse` `[B, Hq, Sq]` as f32.
pub(super) fn run(
    kernel: &CpuKernel,
    q: &Rows,
    k: &Rows,
    v: &Rows,
    call: &Call,
) -> Result<(Vec<f32>, Vec<f32>), RuntimeError> {
    let (mut out, lse) = run_as(kernel, [q, k, v], call, DType::F32)?;
    let Storage::F32(out) = &mut out else {
        unreachable!("an f32 output was asked for");
    };
    Ok((std::mem::take(out).into_vec(), lse))
}

/// Runs the kernel; returns `out` `[B, Hq, Sq, Dv]` in `out_dtype` and `lse` `[B, Hq, Sq]`
/// (f32), rows whose scores overflowed NaN in both ([`overflowed_rows_are_nan`]).
pub(super) fn run_as(
    kernel: &CpuKernel,
    [q, k, v]: [&Rows; 3],
    call: &Call,
    out_dtype: DType,
) -> Result<(Storage, Vec<f32>), RuntimeError> {
    let plan = &kernel.plan;
    let (hq, hkv) = (call.piece.hq, call.piece.hkv);
    let (dqk, dv) = (plan.shape.qk_dim as usize, plan.shape.v_dim as usize);
    let Call { batch, sq, skv, .. } = *call;
    let params = param_pointer(plan, call.params)?;
    q.check_bounds([batch, hq, sq, dqk], "q")?;
    k.check_bounds([batch, hkv, skv, dqk], "k")?;
    v.check_bounds([batch, hkv, skv, dv], "v")?;
    let p0 = call.position_offset;
    let (first_pos, end_pos) = call.piece.positions(p0, sq, skv)?;
    let mut out = OutputBuffer::new(out_dtype, batch * hq * sq * dv);
    let mut lse = vec![0f32; batch * hq * sq];
    if batch * hq * sq == 0 {
        // SAFETY: there are no values to write.
        return Ok((unsafe { out.finish() }, lse));
    }

    // Positions used: keys p0..p0+Skv, queries from `Piece::first_query`.
    let total_len = (skv as i64 + p0).max(0) as u64;
    let tables = match &plan.rope {
        Some(r) => Some(QkTables::new(r, first_pos, end_pos, total_len)?),
        None => None,
    };
    let table_ptrs = |side: Side| match &tables {
        Some(t) => {
            let t = match side {
                Side::Query => &t.query,
                Side::Key => t.key(),
            };
            (t.cos.as_ptr(), t.sin.as_ptr(), t.pos0)
        }
        None => (std::ptr::null(), std::ptr::null(), 0),
    };

    type PackFn = unsafe extern "C" fn(*const PackArgs);
    type BlockFn = unsafe extern "C" fn(*const BlockArgs);
    let Entry::Forward { pack_k, block } = kernel.entry else {
        return Err(RuntimeError::Spec(
            "a decode kernel cannot run a forward call".into(),
        ));
    };
    // SAFETY: `pack_k` and `block` were compiled by codegen::cpu with the signature
    // `extern "C" fn(*const Args)`; the addresses stay valid for the process.
    let (pack_k, block) = unsafe {
        (
            std::mem::transmute::<usize, PackFn>(pack_k),
            std::mem::transmute::<usize, BlockFn>(block),
        )
    };

    let packed: Vec<Vec<f32>> = (0..batch * hkv)
        .into_par_iter()
        .map_init(Vec::new, |widened, i| {
            let (b, kvh) = (i / hkv, i % hkv);
            let mut kt = PackedPool::take(packed_k_len(plan, skv));
            let (cos, sin, table_pos0) = table_ptrs(Side::Key);
            let (k_rows, k_row_stride) = k.slab([b, kvh, 0], skv, dqk, widened);
            let args = PackArgs {
                k: k_rows,
                k_row_stride,
                skv: skv as i64,
                k_pos0: p0,
                rope_cos: cos,
                rope_sin: sin,
                table_pos0,
                kt: kt.as_mut_ptr(),
            };
            // SAFETY: `args` points at Skv rows of K within bounds (checked above), tables that
            // cover positions p0..p0+Skv, and a buffer of `packed_k_len` values.
            unsafe { pack_k(&args) };
            kt
        })
        .collect();

    let rows = plan.tiles.q_rows as usize;
    let blocks = sq.div_ceil(rows);
    let group = hq / hkv;
    let data = plan.mask_data_ranges(call.params);
    // A mask that does not read the head classifies a block's tiles alike for every head: once
    // per (batch item, block), in parallel, rather than once per head.
    let per_head = plan.program.mask.uses(Var::Head);
    let shared: Vec<Vec<BlockTile>> = if per_head {
        Vec::new()
    } else {
        (0..batch * blocks)
            .into_par_iter()
            .map(|i| {
                let (b, blk) = (i / blocks, i % blocks);
                let (q0, q1) = (blk * rows, ((blk + 1) * rows).min(sq));
                block_tiles(plan, call, data.as_ref(), q0, q1, [b, call.piece.head0])
            })
            .collect()
    };
    // Later blocks see more keys under causal masks: hand them out first.
    let mut items: Vec<(usize, usize, usize)> = (0..batch)
        .flat_map(|b| (0..hq).flat_map(move |h| (0..blocks).map(move |blk| (b, h, blk))))
        .collect();
    items.sort_by_key(|&(_, _, blk)| std::cmp::Reverse(blk));
    let (target, lse_ptr) = (out.target(), Shared(lse.as_mut_ptr()));
    let scratch_len = kernel.scratch.total;
    items.par_iter().for_each_init(
        || (vec![0f32; scratch_len], Vec::new(), Vec::new()),
        |(scratch, widened, out_rows), &(b, h, blk)| {
            let (target, lse_ptr) = (target, lse_ptr);
            let q0 = blk * rows;
            let q1 = (q0 + rows).min(sq);
            let own;
            let tiles = if per_head {
                own = block_tiles(plan, call, data.as_ref(), q0, q1, [b, call.piece.head0 + h]);
                &own
            } else {
                &shared[b * blocks + blk]
            };
            let kvh = h / group;
            let row0 = (b * hq + h) * sq + q0;
            let (cos, sin, table_pos0) = table_ptrs(Side::Query);
            let (q_rows, q_row_stride) = q.slab([b, h, q0], q1 - q0, dqk, widened);
            let values = (q1 - q0) * dv;
            let out_at = match target {
                Target::F32(out) => out.0.wrapping_add(row0 * dv),
                Target::Bits(..) => {
                    out_rows.resize(values, 0.0);
                    out_rows.as_mut_ptr()
                }
            };
            let args = BlockArgs {
                q: q_rows,
                q_row_stride,
                rows: (q1 - q0) as i64,
                q_pos0: call.piece.first_query(p0, sq, skv) + q0 as i64,
                qi0: q0 as i64,
                batch: b as i64,
                head: (call.piece.head0 + h) as i64,
                kt: packed[b * hkv + kvh].as_ptr(),
                v: v.ptr(b, kvh, 0),
                v_row_stride: v.row_stride(),
                skv: skv as i64,
                k_pos0: p0,
                tiles: tiles.as_ptr(),
                out: out_at,
                out_row_stride: dv as i64,
                lse: lse_ptr.0.wrapping_add(row0),
                scratch: scratch.as_mut_ptr(),
                rope_cos: cos,
                rope_sin: sin,
                table_pos0,
                params: params.get(),
            };
            // SAFETY: every pointer in `args` addresses memory of the sizes the ABI requires:
            // rows q0..q1 of q, the packed keys and the values of this (batch, kv head), one
            // record per key tile (rows within the block), rows q0..q1 of out (or this task's
            // f32 rows) and of lse (written by this task only), a scratch of
            // `ScratchLayout::total` values, tables covering every query position, and the
            // parameters of the plan's layout.
            unsafe { block(&args) };
            // SAFETY: rows q0..q1 of this (batch, head) are this block's alone, written by it.
            unsafe {
                settle_rows(
                    target,
                    out_rows,
                    lse_ptr.0.add(row0),
                    row0..row0 + q1 - q0,
                    dv,
                )
            };
        },
    );
    PackedPool::give(packed);
    // SAFETY: the blocks cover every (batch, head) and query row, and each rounded all its
    // output values into place.
    Ok((unsafe { out.finish() }, lse))
}
