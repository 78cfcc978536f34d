//! Rows staged synchronously from global into shared memory as 16-bit pairs, rotated by the
//! plan's RoPE where it has it (the RoPE prologue of the tensor-core kernels' Q, K and dO rows):
//! a column pair is one 32-bit load where RoPE leaves it as it is, else both elements rotated
//! in f32 and repacked.

use super::build::half_of;
use super::build::{Regs, special64};
use super::rope::{Side, rotate_pair, table_names};
use crate::gpu::ir::build::*;
use crate::gpu::ir::{Bin, Expr, Half, Space, Special, Stmt, Ty};
use crate::plan::KernelPlan;

/// Element `d` of a row at `row_addr` (16-bit in global memory) as f32, rotated by RoPE at `pos`
/// when the plan has it. With `shift`, the column is `d + 2 shift` (a lane's offset in its
/// fragment); the RoPE pairing is decided on `d`, which the caller guarantees is the same for
/// every shift ([`lane_aligned`]).
fn element(
    plan: &KernelPlan,
    (param, side): (Params, Side),
    row_addr: &Expr,
    d: usize,
    pos: &Expr,
    shift: Option<&Expr>,
) -> Expr {
    let lane = |bytes_per_step: i64| shift.map_or(i64(0), |q| mul(q.clone(), i64(bytes_per_step)));
    let at_d = |d: usize| {
        let addr = add(add(row_addr.clone(), i64(2 * d as i64)), lane(4));
        Expr::LoadHalf(Space::Global, half_of(plan), Box::new(addr))
    };
    let Some(rope) = &plan.rope else {
        return at_d(d);
    };
    let (first, half) = (rope.first_dim as usize, (rope.rope.dim / 2) as usize);
    if d < first || d >= first + 2 * half {
        return at_d(d);
    }
    let i = d - first;
    // The pair (a, b) this element belongs to, whether it is a, its frequency index, and how
    // far the index moves per step of `shift`.
    let pairing = rope.rope.layout.pairing(rope.rope.dim);
    let (f, is_a) = pairing.owner(i);
    let (a, b) = pairing.pair(f);
    let (a, b, f_step) = (first + a, first + b, (2 / pairing.stride) as i64);
    let entry = add(
        add(
            mul(sub(pos.clone(), param("rope_pos0")), i64(4 * half as i64)),
            i64(4 * f as i64),
        ),
        lane(4 * f_step),
    );
    let [cos, sin] = table_names(side);
    let c = load(Space::Global, Ty::F32, add(param(cos), entry.clone()));
    let s = load(Space::Global, Ty::F32, add(param(sin), entry));
    let (ra, rb) = rotate_pair(at_d(a), at_d(b), c, s);
    if is_a { ra } else { rb }
}

/// Columns `d` and `d + 1` (`d` even; plus `2 shift`) of a 16-bit row as a packed pair: one 32-bit
/// load where RoPE leaves them as they are (or the row is not `rotated`), else both rotated and
/// repacked.
fn pair(
    plan: &KernelPlan,
    to: &Staging,
    row_addr: &Expr,
    d: usize,
    pos: &Expr,
    shift: Option<&Expr>,
) -> Expr {
    let (qk, param) = (to.qk, to.param);
    let inside = plan.rope.as_ref().is_some_and(|r| {
        let first = r.first_dim as usize;
        d + 1 >= first && d < first + r.rope.dim as usize
    });
    if let (Some(side), true) = (to.rotation, inside) {
        return Expr::PackHalf(
            qk,
            Box::new(element(plan, (param, side), row_addr, d, pos, shift)),
            Box::new(element(plan, (param, side), row_addr, d + 1, pos, shift)),
        );
    }
    let lane = shift.map_or(i64(0), |q| mul(q.clone(), i64(4)));
    let addr = add(add(row_addr.clone(), i64(2 * d as i64)), lane);
    load(Space::Global, Ty::I32, addr)
}

/// Whether every lane's fragment columns (`8 j + 2 q`, `+1`) pair up under RoPE the same way as
/// lane 0's, so a lane offset can be added to addresses instead of selecting per lane.
pub(crate) fn lane_aligned(plan: &KernelPlan) -> bool {
    plan.rope.as_ref().is_none_or(|r| {
        let pairing = r.rope.layout.pairing(r.rope.dim);
        r.first_dim.is_multiple_of(8) && (pairing.adjacent() || pairing.partner.is_multiple_of(8))
    })
}

/// A kernel's parameters by name (its launch record's positions).
pub(crate) type Params = fn(&str) -> Expr;

/// Where [`stage_rows`] writes: `count` rows of `width` 16-bit columns at `dst`, `stride`
/// bytes apart.
pub(crate) struct Staging {
    pub count: i64,
    pub width: usize,
    pub dst: Expr,
    pub stride: usize,
    /// The format of the `Q K^T` operands the rows are staged as.
    pub qk: Half,
    /// Which operand the rows are, when rotated by the plan's RoPE (queries and keys); `None`
    /// for rows copied as they are (values, output gradients).
    pub rotation: Option<Side>,
    /// The kernel's parameters (the RoPE tables among them).
    pub param: Params,
    /// Threads of the CTA, which share the rows.
    pub threads: u32,
}

/// Synchronous staging of rows into shared memory, rotated by RoPE where the plan has it.
/// `source(local)` gives row `local`'s global address, its position, and whether it exists
/// (else zeros are stored). Where RoPE pairs line up with lane offsets, four threads share a
/// row, thread p of them taking the column pairs 8 i + 2 p (coalesced); else thread j stages
/// row j whole. The CTA stages `threads / (threads per row)` rows per pass.
pub(crate) fn stage_rows(
    plan: &KernelPlan,
    r: &mut Regs,
    name: &str,
    to: Staging,
    source: impl Fn(Expr) -> (Expr, Expr, Option<Expr>),
) -> Vec<Stmt> {
    let tid = special64(Special::Tid);
    let split = lane_aligned(plan);
    let per_row: i64 = if split { 4 } else { 1 };
    let rows_per_pass = i64::from(to.threads) / per_row;
    let passes = (to.count + rows_per_pass - 1) / rows_per_pass;
    let (pass, local, part) = (
        r.add(format!("{name}_pass"), Ty::I64),
        r.add(format!("{name}_row"), Ty::I64),
        r.add(format!("{name}_part"), Ty::I64),
    );
    let (addr, pos, inside) = source(reg(local));
    let (shift, col_step) = if split {
        (Some(reg(part)), 8)
    } else {
        (None, 2)
    };
    let mut stage = vec![Stmt::Set(part, bin(Bin::Rem, tid.clone(), i64(per_row)))];
    for dd in (0..to.width).step_by(col_step) {
        let value = pair(plan, &to, &addr, dd, &pos, shift.as_ref());
        let dst = add(
            add(to.dst.clone(), mul(reg(local), i64(to.stride as i64))),
            add(i64(2 * dd as i64), mul(reg(part), i64(4))),
        );
        let value = match &inside {
            Some(inside) => select(inside.clone(), value, Expr::Int(0, Ty::I32)),
            None => value,
        };
        stage.push(Stmt::Store(Space::Shared, dst, value));
    }
    vec![Stmt::For {
        reg: pass,
        start: i64(0),
        end: i64(passes),
        step: 1,
        body: vec![
            Stmt::Set(
                local,
                add(
                    mul(reg(pass), i64(rows_per_pass)),
                    bin(Bin::Div, tid, i64(per_row)),
                ),
            ),
            Stmt::If(bin(Bin::Lt, reg(local), i64(to.count)), stage, vec![]),
        ],
    }]
}
