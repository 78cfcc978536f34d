//! Running a compiled CPU backward kernel (FlashAttention-2 recomputation).
//!
//! One task per (batch, kv head), in parallel: it owns the dk and dv rows of its kv head and the
//! dq rows of its group's query heads, so no two tasks write the same gradient and nothing needs
//! atomics. When there are fewer (batch, kv head) units than twice the threads (MQA, small
//! batches), each unit's key tiles are dealt to several tasks with private gradients, summed
//! afterwards. With parameters (`params(...)`), each task also sums their gradients over its
//! tiles in a fixed order (`grad_tile` adds each pair's share), the tasks' sums are added in
//! task order, and the split count depends on the call's shape alone: the result is the same
//! bits for any thread count.
//!
//! A task rotates and scales its queries and keys once (`rotate_rows`), packs K and V into
//! tiles, and computes `D = rowsum(dO * out)`. Then, head by head of the group (its q, dO
//! and dq rows stay in cache), for each key tile and each query block the mask does not skip:
//! `S = Q K^T` and `dP = dO V^T` (the `qk_tile` microkernel), `P` and `dS` (generated
//! `grad_tile`), `dV += P^T dO`, `dK += dS^T Q` (the `pv_tile` microkernel reading its weights
//! transposed) and `dQ += dS K` (`pv_tile`); on tiles the mask cuts, those three skip the keys
//! (or query rows) where P and dS are zero (`spans::nonzero_spans`: half of a causal
//! diagonal tile). Last, dq is scaled and dq and dk are rotated back.

use super::backward_tiles::{TileClassed, classify, shared_classes};
pub(super) use super::backward_units::Grads;
use super::backward_units::{
    Lens, fixed_splits, key_splits, split_units, whole_units, whole_units_summing_params,
};
use super::launch::row_stride_for;
use super::{bf16_tiles, microkernels};
use crate::error::RuntimeError;
use crate::host::rope_table::{QkTables, RopeTables, Side};
use crate::memory::written_zeros;
use crate::placement::Piece;
use attn_dsl::DType;
use attn_dsl::modifier::interval::Interval;
use codegen::cpu::abi::{GradTileArgs, RotateArgs};
use codegen::cpu::{CpuKernel, Entry};
use codegen::plan::{CallShape, DataRanges, K_TILE, KernelPlan, TileCode};

const K: usize = K_TILE as usize;

/// Key tiles a task takes at a time against each query block (see `Task::run`).
const TILE_GROUP: usize = 4;

/// The inputs of one backward call as contiguous f32 BHSD arrays, and its shape.
pub(super) struct Problem<'a> {
    pub q: &'a [f32],
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub out: &'a [f32],
    pub lse: &'a [f32],
    pub dout: &'a [f32],
    /// Whether `dout` and `v` hold bf16 values (both tensors were bf16), so that `dO V^T`
    /// may take `vdpbf16ps` ([`bf16_tiles::qk_address`]), exactly.
    pub bf16_dout_and_v: bool,
    pub batch: usize,
    pub sq: usize,
    pub skv: usize,
    pub position_offset: i64,
    /// The call's heads and where its queries lie ([`crate::placement`]).
    pub piece: Piece,
    /// Laid out as the plan's `ParamLayout`; empty without parameters.
    pub params: &'a [f32],
}

type RotateFn = unsafe extern "C" fn(*const RotateArgs);
type GradTileFn = unsafe extern "C" fn(*const GradTileArgs);
type QkFn = unsafe extern "C" fn(*const f32, i64, i64, i64, *const f32, *mut f32, *mut f32);
type PvFn = unsafe extern "C" fn(*const f32, i64, i64, *const f32, i64, *mut f32, i64, *const u32);

/// The functions a task calls.
#[derive(Clone, Copy)]
struct Kernels {
    rotate: RotateFn,
    grad_tile: GradTileFn,
    qk: QkFn,
    /// `qk` for `dP = dO V^T`: on `vdpbf16ps` where dO and V are bf16 values and the CPU has
    /// avx512_bf16.
    dp: QkFn,
    /// `pv_tile` with spans (`microkernels::spanned_pv`).
    pv: PvFn,
    /// `pv` with the weights transposed.
    pt: PvFn,
    /// The instruction set of the microkernels (whether spans are worth computing).
    isa: microkernels::Isa,
}

/// RoPE tables for the call's positions, forward and transposed (sines negated), of its
/// queries and of its keys (which differ under xPos).
struct Tables {
    forward: [RopeTables; 2],
    transposed: [RopeTables; 2],
}

/// Runs the backward kernel.
pub(super) fn run(
    kernel: &CpuKernel,
    isa: microkernels::Isa,
    x: &Problem,
) -> Result<Grads, RuntimeError> {
    let plan = &kernel.plan;
    let (hq, hkv) = (x.piece.hq, x.piece.hkv);
    let (d, dv) = (plan.shape.qk_dim as usize, plan.shape.v_dim as usize);
    let (batch, sq, skv) = (x.batch, x.sq, x.skv);
    let positions = x.piece.positions(x.position_offset, sq, skv)?;
    let params = super::launch::param_pointer(plan, x.params)?;
    let mut grads = (
        (
            written_zeros(batch * hq * sq * d),
            written_zeros(batch * hkv * skv * d),
            written_zeros(batch * hkv * skv * dv),
        ),
        vec![0f32; x.params.len()],
    );
    if batch * hq * sq == 0 || skv == 0 {
        return Ok(grads);
    }
    let kernels = task_kernels(kernel, isa, x.bf16_dout_and_v)?;
    let tables = rope_tables(plan, positions, skv as i64 + x.position_offset)?;
    let group = hq / hkv;
    let lens = Lens {
        q: group * sq * d,
        k: skv * d,
        v: skv * dv,
        params: x.params.len(),
    };
    let (units, tiles) = (batch * hkv, skv.div_ceil(K));
    // Parameter gradients are summed per task in a fixed order of tiles, then over the tasks in
    // order; with parameters the tasks therefore depend on the call's shape alone, never on the
    // thread count.
    // A stick-breaking row carries its state from tile to tile: one task takes every tile.
    let splits = if plan.stick_breaking() {
        1
    } else if lens.params == 0 {
        key_splits(units, tiles, lens.q + lens.k + lens.v)
    } else {
        fixed_splits(units, tiles, lens.q + lens.k + lens.v + lens.params)
    };
    let data = plan.mask_data_ranges(x.params);
    let classified = shared_classes(
        plan,
        [x.batch, x.sq, x.skv],
        (x.position_offset, x.piece),
        data.as_ref(),
    );
    let run_task = |unit: usize, split: usize, grads: [&mut [f32]; 4]| {
        let task = Task {
            plan,
            kernels,
            tables: tables.as_ref(),
            data: data.as_ref(),
            classified: classified.as_deref(),
            x,
            b: unit / hkv,
            kvh: unit % hkv,
            tiles: (split, splits),
            params,
        };
        SCRATCH.with_borrow_mut(|scratch| {
            task.run(scratch, grads);
            scratch.trim();
        });
    };
    match (splits, lens.params) {
        (1, 0) => whole_units(&mut grads, lens, &run_task),
        (1, _) => whole_units_summing_params(&mut grads, lens, units, &run_task),
        _ => split_units(&mut grads, lens, units, splits, &run_task),
    }
    Ok(grads)
}

/// The functions a task calls: the kernel's entries and the microkernels of `isa` (for `dO V^T`
/// on bf16 values, `bf16_tiles`' where `isa` has it).
fn task_kernels(
    kernel: &CpuKernel,
    isa: microkernels::Isa,
    bf16_dout_and_v: bool,
) -> Result<Kernels, RuntimeError> {
    let Entry::Backward {
        rotate_rows,
        grad_tile,
    } = kernel.entry
    else {
        return Err(RuntimeError::Spec(
            "internal: the backward call got a kernel of another kind".into(),
        ));
    };
    let (qk, _) = microkernels::addresses(isa);
    let dp = match bf16_dout_and_v {
        true => bf16_tiles::qk_address(isa, DType::Bf16, kernel.plan.shape.v_dim as usize),
        false => None,
    };
    let (pv, pt) = microkernels::spanned_pv(isa);
    // SAFETY: `rotate_rows` and `grad_tile` were compiled by codegen::cpu with the signature
    // `extern "C" fn(*const Args)`, and `qk`, `pv` are the microkernels' C-ABI functions with the
    // signatures above (`pt` as `pv`); all stay valid for the process.
    Ok(unsafe {
        Kernels {
            rotate: std::mem::transmute::<usize, RotateFn>(rotate_rows),
            grad_tile: std::mem::transmute::<usize, GradTileFn>(grad_tile),
            qk: std::mem::transmute::<usize, QkFn>(qk),
            dp: std::mem::transmute::<usize, QkFn>(dp.unwrap_or(qk)),
            pv: std::mem::transmute::<usize, PvFn>(pv),
            pt: std::mem::transmute::<usize, PvFn>(pt),
            isa,
        }
    })
}

/// The RoPE tables of a call's positions `first..end`, when the plan has RoPE; `total_len`
/// (`p0 + Skv`) picks the dynamic NTK base.
fn rope_tables(
    plan: &KernelPlan,
    (first, end): (i64, i64),
    total_len: i64,
) -> Result<Option<Tables>, RuntimeError> {
    let Some(r) = plan.rope.as_ref() else {
        return Ok(None);
    };
    let forward = QkTables::new(r, first, end, total_len.max(0) as u64)?.split();
    let transposed = forward.clone().map(|t| RopeTables {
        sin: t.sin.iter().map(|s| -s).collect(),
        ..t
    });
    Ok(Some(Tables {
        forward,
        transposed,
    }))
}

thread_local! {
    /// Each thread's buffers, kept from task to task and call to call: fresh memory costs page
    /// faults, and freeing it costs TLB shootdowns on every core.
    static SCRATCH: std::cell::RefCell<Scratch> = std::cell::RefCell::new(Scratch::default());
}

/// Values of scratch a thread keeps between calls; a call that needed more frees the excess.
const KEPT_SCRATCH: usize = 16 << 20;

/// A thread's buffers for the tasks it runs.
#[derive(Default)]
struct Scratch {
    /// The group's queries, rotated and scaled.
    q: Vec<f32>,
    /// `D` per query row of the group.
    delta: Vec<f32>,
    /// The kv head's keys, rotated.
    k: Vec<f32>,
    /// Keys and values packed into tiles.
    kt: Vec<f32>,
    vt: Vec<f32>,
    /// The group's output gradients, where their rows are copied further apart
    /// ([`row_stride_for`]).
    dout: Vec<f32>,
    /// One tile of scores / probabilities, and of dP / dS.
    s: Vec<f32>,
    dp: Vec<f32>,
}

impl Scratch {
    /// Frees the buffers when together they hold more than [`KEPT_SCRATCH`] values.
    fn trim(&mut self) {
        let held: usize = [
            &self.q,
            &self.delta,
            &self.k,
            &self.kt,
            &self.vt,
            &self.dout,
        ]
        .iter()
        .map(|b| b.capacity())
        .sum();
        if held > KEPT_SCRATCH {
            *self = Scratch::default();
        }
    }
}

/// `buffer` holding a copy of `from`.
fn copy_into(buffer: &mut Vec<f32>, from: &[f32]) {
    buffer.clear();
    buffer.extend_from_slice(from);
}

/// `buffer` holding the rows of `from` (`width` values each), `stride` apart.
fn copy_rows(buffer: &mut Vec<f32>, from: &[f32], width: usize, stride: usize) {
    if stride == width {
        return copy_into(buffer, from);
    }
    let rows = sized(buffer, from.len() / width.max(1) * stride);
    for (to, from) in rows.chunks_exact_mut(stride).zip(from.chunks_exact(width)) {
        to[..width].copy_from_slice(from);
    }
}

/// `buffer` as `len` values (their contents left to the caller to overwrite).
fn sized(buffer: &mut Vec<f32>, len: usize) -> &mut [f32] {
    buffer.resize(len, 0.0);
    buffer
}

/// A task's rows once prepared ([`Task::prepare`]): the group's queries (rotated and scaled),
/// output gradients, lse and D; its keys as the scores saw them; K and V packed into tiles.
struct TaskRows<'s> {
    q: &'s [f32],
    /// Floats from one row of `q` (and of `keys`) to the next.
    row_stride: usize,
    dout: &'s [f32],
    /// Floats from one row of `dout` to the next.
    dout_stride: usize,
    lse: &'s [f32],
    delta: &'s [f32],
    keys: &'s [f32],
    kt: &'s [f32],
    vt: &'s [f32],
}

/// A tile's scores and probabilities (`s`), dP and dS (`dp`), and the spans of their nonzero
/// rows and columns.
struct Products<'s> {
    s: &'s mut [f32],
    dp: &'s mut [f32],
    by_row: [u32; 2 * K],
    by_col: [u32; 2 * K],
}

/// Areas of `K_TILE^2` values in the dP buffer: dP alone; under stick-breaking also each
/// score's derivative, and with parameters' gradients the raw scores.
fn stick_areas(plan: &KernelPlan) -> usize {
    match (plan.stick_breaking(), plan.param_grads.is_empty()) {
        (false, _) => 1,
        (true, true) => 2,
        (true, false) => 3,
    }
}

/// Stick-breaking's running state of a task's rows: the softplus sum of the keys nearer than
/// the tile, and `D` less their `dP A`.
type RowState = (Vec<f32>, Vec<f32>);

/// Where a tile is: head `h` of the group (`head` in the call), key tile `tile` of `cols` keys,
/// the `n` live query rows from `r0`, and its code.
struct TileAt {
    h: usize,
    head: usize,
    tile: usize,
    cols: usize,
    r0: usize,
    n: usize,
    code: TileCode,
    /// Stick-breaking's first sweep: only the rows' state advances (no gradients).
    state_only: bool,
}

/// One (batch, kv head) of a call, or one split of its key tiles.
struct Task<'a> {
    plan: &'a KernelPlan,
    kernels: Kernels,
    tables: Option<&'a Tables>,
    /// The ranges of the data tensors the mask reads, for classifying tiles.
    data: Option<&'a DataRanges>,
    /// The tiles classified once for every head, where the mask does not read the head.
    classified: Option<&'a [Vec<TileClassed>]>,
    x: &'a Problem<'a>,
    b: usize,
    kvh: usize,
    /// `(split, splits)`: the task takes the key tiles `t` with `t % splits == split`.
    tiles: (usize, usize),
    /// The call's parameters, as the kernel reads them.
    params: super::launch::ParamPtr,
}

impl Task<'_> {
    /// Accumulates the task's gradients into `dq` (its group's query heads), `dk`, `dv` and
    /// (with parameters; else empty) the parameters' gradients, in a fixed order of tiles.
    fn run(&self, scratch: &mut Scratch, [dq, dk, dv_acc, dparams]: [&mut [f32]; 4]) {
        let plan = self.plan;
        let (sq, skv, p0) = (self.x.sq, self.x.skv, self.x.position_offset);
        let group = self.x.piece.hq / self.x.piece.hkv;
        let Scratch {
            q,
            delta,
            k,
            kt,
            vt,
            dout,
            s,
            dp,
        } = scratch;
        let rows = self.prepare([q, delta, k, kt, vt, dout]);
        // Stick-breaking: dP's derivatives follow it, and each row's running state (the
        // softplus sum of the keys nearer than the tile, and D less their dP A) lives in place
        // of lse and D, for tiles visited from the last.
        let stick = plan.stick_breaking();
        let rows_len = rows.delta.len();
        let mut state = stick.then(|| (vec![0f32; rows_len], vec![0f32; rows_len]));
        let mut products = Products {
            s: sized(s, K * K),
            // Stick-breaking: dP, then each score's derivative (`ds_tile` leaves dS_final
            // there), then with parameters the raw scores their pass reads.
            dp: sized(dp, K * K * stick_areas(plan)),
            by_row: [0u32; 2 * K],
            by_col: [0u32; 2 * K],
        };
        let mut grads = [dq, dk, dv_acc, dparams];
        let (split, splits) = self.tiles;
        let mut tiles: Vec<usize> = (split..skv.div_ceil(K)).step_by(splits).collect();
        if stick {
            tiles.reverse();
        }
        // Stick-breaking sweeps twice: first each row's exact `D = sum_j dP_j A_j` (its state
        // starts at 0 and ends at -D: `D` from the saved output would carry the output's
        // rounding into every key's dS), then the gradients.
        let sweeps: &[bool] = if stick { &[true, false] } else { &[false] };
        for &state_only in sweeps {
            if let Some((nearer, remaining)) = state.as_mut() {
                nearer.fill(0.0);
                if state_only {
                    remaining.fill(0.0);
                } else {
                    remaining.iter_mut().for_each(|e| *e = -*e);
                }
            }
            self.sweep(
                (&rows, &mut state),
                &mut products,
                &tiles,
                state_only,
                &mut grads,
            );
        }
        let [dq, dk, _, _] = grads;
        // The scores were of q scaled by `q_scale`: so is their gradient. RoPE's transpose
        // brings dq and dk back to the unrotated inputs.
        let d = plan.shape.qk_dim as usize;
        for h in 0..group {
            let rows = &mut dq[h * sq * d..(h + 1) * sq * d];
            self.rotate(
                (rows, d),
                Side::Query,
                self.q_pos0(),
                plan.q_scale as f32,
                true,
            );
        }
        self.rotate((dk, d), Side::Key, p0, 1.0, true);
    }

    /// One sweep over the task's `tiles` in their order. Head by head, and for each head
    /// [`TILE_GROUP`] key tiles at a time: a group's keys, values and dk, dv rows stay in L2
    /// while the head's query blocks pass, and each query block's q, dout and dq rows are read
    /// once per group rather than once per tile. With `state_only`, only stick-breaking's
    /// row state advances.
    fn sweep(
        &self,
        (rows, state): (&TaskRows, &mut Option<RowState>),
        products: &mut Products,
        tiles: &[usize],
        state_only: bool,
        grads: &mut [&mut [f32]; 4],
    ) {
        let plan = self.plan;
        let (sq, skv, p0) = (self.x.sq, self.x.skv, self.x.position_offset);
        let group = self.x.piece.hq / self.x.piece.hkv;
        let h0 = self.kvh * group;
        let blocks = sq.div_ceil(K);
        for h in 0..group {
            let head = self.x.piece.head0 + h0 + h;
            let call = CallShape {
                sq: sq as i64,
                skv: skv as i64,
                p0,
                query_shift: self.x.piece.query_shift,
                batch: Interval::point(self.b as i64),
                head: Interval::point(head as i64),
                data: self.data,
            };
            for tile_group in tiles.chunks(TILE_GROUP) {
                for block in 0..blocks {
                    for &tile in tile_group {
                        let cols = (skv - tile * K).min(K);
                        let (code, live) = match self.classified {
                            Some(c) => c[self.b * blocks + block][tile],
                            None => classify(plan, call, block, tile, [sq, skv]),
                        };
                        let Some(live) = live else { continue };
                        let at = TileAt {
                            h,
                            head,
                            tile,
                            cols,
                            r0: live.lo as usize,
                            n: (live.hi - live.lo + 1) as usize,
                            code,
                            state_only,
                        };
                        let state = state.as_mut().map(|(r, e)| [&mut r[..], &mut e[..]]);
                        self.tile((rows, state), products, &at, grads);
                    }
                }
            }
        }
    }

    /// The position of the call's first query.
    fn q_pos0(&self) -> i64 {
        let x = self.x;
        x.piece.first_query(x.position_offset, x.sq, x.skv)
    }

    /// This task's rows, ready for the tiles: the group's queries (rotated and scaled), output
    /// gradients, lse and `D = rowsum(dO * out)`; its keys as the scores saw them (rotated into
    /// scratch under RoPE, else read in place), and its keys and values packed into tiles.
    /// Queries, keys and output gradients whose rows [`row_stride_for`] spreads are copied
    /// into scratch that far apart.
    fn prepare<'s>(&'s self, [q, delta, k, kt, vt, padded]: [&'s mut Vec<f32>; 6]) -> TaskRows<'s> {
        let (plan, x) = (self.plan, self.x);
        let (hq, hkv) = (x.piece.hq, x.piece.hkv);
        let (d, dv) = (plan.shape.qk_dim as usize, plan.shape.v_dim as usize);
        let (sq, skv, p0) = (x.sq, x.skv, x.position_offset);
        let group = hq / hkv;
        let h0 = self.kvh * group;
        let heads = |width: usize| {
            let start = (self.b * hq + h0) * sq * width;
            start..start + group * sq * width
        };
        let kv = |width: usize| {
            let start = (self.b * hkv + self.kvh) * skv * width;
            start..start + skv * width
        };
        // Rows the tile products read many of at once lie `row_stride_for` apart.
        let (row_stride, dout_stride) = (row_stride_for(d), row_stride_for(dv));
        copy_rows(q, &x.q[heads(d)], d, row_stride);
        let dout = &x.dout[heads(dv)];
        let out = &x.out[heads(dv)];
        delta.clear();
        delta.extend(
            dout.chunks_exact(dv)
                .zip(out.chunks_exact(dv))
                .map(|(g, o)| dot(g, o)),
        );
        for h in 0..group {
            self.rotate(
                (
                    &mut q[h * sq * row_stride..(h + 1) * sq * row_stride],
                    row_stride,
                ),
                Side::Query,
                self.q_pos0(),
                plan.q_scale as f32,
                false,
            );
        }
        let keys: &[f32] = if plan.rope.is_some() || row_stride != d {
            copy_rows(k, &x.k[kv(d)], d, row_stride);
            self.rotate((k, row_stride), Side::Key, p0, 1.0, false);
            k
        } else {
            &x.k[kv(d)]
        };
        pack(
            keys,
            [d, row_stride],
            skv,
            sized(kt, skv.div_ceil(K) * d * K),
        );
        pack(
            &x.v[kv(dv)],
            [dv, dv],
            skv,
            sized(vt, skv.div_ceil(K) * dv * K),
        );
        let dout: &[f32] = match dout_stride == dv {
            true => dout,
            false => {
                copy_rows(padded, dout, dv, dout_stride);
                padded
            }
        };
        TaskRows {
            q,
            row_stride,
            dout,
            dout_stride,
            lse: &x.lse[heads(1)],
            delta,
            keys,
            kt,
            vt,
        }
    }

    /// One tile: `S = Q K^T` and `dP = dO V^T`, `P` and `dS` (`grad_tile`), then `dV += P^T
    /// dO`, `dK += dS^T Q` and `dQ += dS K` into `[dq, dk, dv]`.
    fn tile(
        &self,
        (rows, state): (&TaskRows, Option<[&mut [f32]; 2]>),
        products: &mut Products,
        at: &TileAt,
        [dq, dk, dv_acc, dparams]: &mut [&mut [f32]; 4],
    ) {
        let plan = self.plan;
        let (d, dv) = (plan.shape.qk_dim as usize, plan.shape.v_dim as usize);
        let (sq, p0) = (self.x.sq, self.x.position_offset);
        let (n, cols, tile, code) = (at.n, at.cols, at.tile, at.code);
        let first_key = tile * K;
        let row = at.h * sq + at.r0;
        let Products {
            s,
            dp,
            by_row,
            by_col,
        } = products;
        // SAFETY: every pointer addresses the ranges the microkernel and GradTileArgs
        // contracts require: `n <= K` rows of q (`d` wide, `row_stride` apart) and of dout
        // (`dv` wide, `dout_stride` apart) from row `row` of this task's arrays, one packed
        // tile of K and of V, `n * K` scores and dP values, `n` lse and D values, `cols` rows
        // of k (`row_stride` apart), and `cols` / `n` rows of the dk, dv and dq accumulators.
        unsafe {
            (self.kernels.qk)(
                rows.q.as_ptr().add(row * rows.row_stride),
                rows.row_stride as i64,
                n as i64,
                d as i64,
                rows.kt.as_ptr().add(tile * d * K),
                s.as_mut_ptr(),
                std::ptr::null_mut(),
            );
            (self.kernels.dp)(
                rows.dout.as_ptr().add(row * rows.dout_stride),
                rows.dout_stride as i64,
                n as i64,
                dv as i64,
                rows.vt.as_ptr().add(tile * dv * K),
                dp.as_mut_ptr(),
                std::ptr::null_mut(),
            );
            let (lse, delta) = match state {
                Some([nearer, remaining]) => (
                    nearer.as_mut_ptr().add(row).cast_const(),
                    remaining.as_mut_ptr().add(row).cast_const(),
                ),
                None => (rows.lse.as_ptr().add(row), rows.delta.as_ptr().add(row)),
            };
            let args = GradTileArgs {
                s: s.as_mut_ptr(),
                dp: dp.as_mut_ptr(),
                rows: n as i64,
                lse,
                delta,
                q_pos0: self.q_pos0() + at.r0 as i64,
                qi0: at.r0 as i64,
                batch: self.b as i64,
                head: at.head as i64,
                first_key: first_key as i64,
                k_pos0: p0 + first_key as i64,
                cols: cols as i64,
                code: code as i64,
                params: self.params.get(),
                // Stick-breaking's first sweep advances the rows' state only.
                dparams: if dparams.is_empty() || at.state_only {
                    std::ptr::null_mut()
                } else {
                    dparams.as_mut_ptr()
                },
            };
            (self.kernels.grad_tile)(&args);
        }
        if at.state_only {
            return;
        }
        // Where a mask zeroes part of the tile, the products below skip the keys (rows, for
        // the transposed ones) whose P and dS are all zero.
        let spanned = matches!(code, TileCode::Masked)
            && super::spans::nonzero_spans(self.kernels.isa, [s, dp], n, cols, by_row, by_col);
        let (row_spans, col_spans) = match spanned {
            true => (by_row.as_ptr(), by_col.as_ptr()),
            false => (std::ptr::null(), std::ptr::null()),
        };
        // SAFETY: as above; the spans are null or hold `n` (rows) and `cols` (columns) pairs.
        unsafe {
            (self.kernels.pt)(
                s.as_ptr(),
                cols as i64,
                n as i64,
                rows.dout.as_ptr().add(row * rows.dout_stride),
                rows.dout_stride as i64,
                dv_acc.as_mut_ptr().add(first_key * dv),
                dv as i64,
                col_spans,
            );
            (self.kernels.pt)(
                dp.as_ptr(),
                cols as i64,
                n as i64,
                rows.q.as_ptr().add(row * rows.row_stride),
                rows.row_stride as i64,
                dk.as_mut_ptr().add(first_key * d),
                d as i64,
                col_spans,
            );
            (self.kernels.pv)(
                dp.as_ptr(),
                n as i64,
                cols as i64,
                rows.keys.as_ptr().add(first_key * rows.row_stride),
                rows.row_stride as i64,
                dq.as_mut_ptr().add(row * d),
                d as i64,
                row_spans,
            );
        }
    }

    /// Rows of `qk_dim` values, `stride` apart, of operand `side` in place: rotated from
    /// position `pos0` on (transposed when `back`), then multiplied by `factor`.
    fn rotate(
        &self,
        (rows, stride): (&mut [f32], usize),
        side: Side,
        pos0: i64,
        factor: f32,
        back: bool,
    ) {
        if rows.is_empty() || (self.tables.is_none() && factor == 1.0) {
            return;
        }
        let (cos, sin, table_pos0) = match self.tables {
            Some(t) => {
                let t = if back { &t.transposed } else { &t.forward };
                let t = match side {
                    Side::Query => &t[0],
                    Side::Key => &t[1],
                };
                (t.cos.as_ptr(), t.sin.as_ptr(), t.pos0)
            }
            None => (std::ptr::null(), std::ptr::null(), 0),
        };
        let args = RotateArgs {
            x: rows.as_mut_ptr(),
            row_stride: stride as i64,
            rows: (rows.len() / stride) as i64,
            pos0,
            factor,
            rope_cos: cos,
            rope_sin: sin,
            table_pos0,
        };
        // SAFETY: `args` addresses `rows.len() / stride` rows of `qk_dim <= stride` values,
        // `stride` apart, and tables that cover every position of the call (the rows are
        // queries or keys of it).
        unsafe { (self.kernels.rotate)(&args) };
    }
}

/// `sum_i a[i] b[i]`, in 16 partial sums the compiler keeps in vector lanes.
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut partial = [0f32; 16];
    let (a16, b16) = (a.chunks_exact(16), b.chunks_exact(16));
    let tail: f32 = a16
        .remainder()
        .iter()
        .zip(b16.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (a, b) in a16.zip(b16) {
        for i in 0..16 {
            partial[i] += a[i] * b[i];
        }
    }
    partial.iter().sum::<f32>() + tail
}

/// Rows `[n][width]`, `stride` apart, packed into `packed` as the score microkernel reads
/// keys: tiles of `K` rows, `tile[dim][row]`, the last one zero-padded. Rows are read in order (the prefetcher
/// streams them from memory; the tile being written stays in L1).
fn pack(rows: &[f32], [width, stride]: [usize; 2], n: usize, packed: &mut [f32]) {
    if !n.is_multiple_of(K) {
        packed[(n / K) * width * K..].fill(0.0);
    }
    for (j, row) in rows.chunks(stride).take(n).enumerate() {
        let tile = &mut packed[(j / K) * width * K..][..width * K];
        for (dim, x) in row[..width].iter().enumerate() {
            tile[dim * K + j % K] = *x;
        }
    }
}
