//! What every decode kernel reads and shares: the task and segment records a launch passes (see
//! [`super`] for their fields), the registers that hold them, strided row staging, and Q
//! staged (rotated and scaled) in shared memory.

use crate::gpu::ir::build::*;
use crate::gpu::ir::{Bin, Expr, Reg, Space, Special, Stmt, Ty};
use crate::gpu::kernels::{Regs, cos_sin, rotate_pair, special64};
use crate::gpu::launch::{DecodeArgs, LaunchRecord};
use crate::plan::KernelPlan;

/// i64 fields of a task record.
pub const TASK_FIELDS: usize = 9;

/// i64 fields of a segment record.
pub const SEGMENT_FIELDS: usize = 7;

/// Threads per CTA.
pub const THREADS: u32 = 128;

pub(super) fn param(name: &str) -> Expr {
    Expr::Param(DecodeArgs::position(name))
}

/// Field `i` of the record at `base` (i64s).
pub(super) fn field(base: &Expr, i: usize) -> Expr {
    load(Space::Global, Ty::I64, add(base.clone(), i64(8 * i as i64)))
}

/// The registers holding a task record's fields (see the module doc).
#[derive(Clone, Copy)]
pub(super) struct Task {
    pub row0: Reg,
    pub rows: Reg,
    pub q_len: Reg,
    pub q_pos0: Reg,
    pub qi0: Reg,
    pub batch: Reg,
    pub head0: Reg,
    pub seg0: Reg,
    pub nseg: Reg,
}

impl Task {
    /// Loads the record of this CTA's task (`tasks[ctaid.x]`).
    pub(super) fn load(r: &mut Regs, body: &mut Vec<Stmt>) -> Task {
        let record = r.add("task", Ty::I64);
        body.push(Stmt::Set(
            record,
            add(
                param("tasks"),
                mul(special64(Special::Ctaid(0)), i64(8 * TASK_FIELDS as i64)),
            ),
        ));
        let names = [
            "row0", "rows", "q_len", "q_pos0", "qi0", "batch", "head0", "seg0", "nseg",
        ];
        let f: Vec<_> = names.iter().map(|n| r.add(*n, Ty::I64)).collect();
        for (i, &reg_i) in f.iter().enumerate() {
            body.push(Stmt::Set(reg_i, field(&reg(record), i)));
        }
        let [row0, rows, q_len, q_pos0, qi0, batch, head0, seg0, nseg] =
            <[_; 9]>::try_from(f).expect("nine fields");
        Task {
            row0,
            rows,
            q_len,
            q_pos0,
            qi0,
            batch,
            head0,
            seg0,
            nseg,
        }
    }

    /// The head of the task's row `row`: `head0 + row / q_len`.
    pub(super) fn head_of(&self, row: Expr) -> Expr {
        add(reg(self.head0), bin(Bin::Div, row, reg(self.q_len)))
    }

    /// The query (of the call's `q_len`) of the task's row `row`: `row % q_len`.
    pub(super) fn query_of(&self, row: Expr) -> Expr {
        bin(Bin::Rem, row, reg(self.q_len))
    }
}

/// The registers of a segment record's fields (see the module doc).
pub(super) struct Segment {
    pub k_addr: Reg,
    pub v_addr: Reg,
    pub first_key: Reg,
    pub keys: Reg,
    pub code: Reg,
    pub k_stride: Reg,
    pub v_stride: Reg,
}

impl Segment {
    /// Registers for a segment's fields, and the statements that load record `index`'s.
    pub(super) fn load(r: &mut Regs, index: Expr) -> (Segment, Vec<Stmt>) {
        let record = r.add("segment_record", Ty::I64);
        let names = [
            "k_addr",
            "v_addr",
            "first_key",
            "keys",
            "code",
            "k_stride",
            "v_stride",
        ];
        let f: Vec<_> = names.iter().map(|n| r.add(*n, Ty::I64)).collect();
        let mut body = vec![Stmt::Set(
            record,
            add(
                param("segments"),
                mul(index, i64(8 * SEGMENT_FIELDS as i64)),
            ),
        )];
        for (i, &x) in f.iter().enumerate() {
            let value = field(&reg(record), i);
            body.push(Stmt::Set(
                x,
                match i {
                    0 => add(value, param("k_base")),
                    1 => add(value, param("v_base")),
                    _ => value,
                },
            ));
        }
        let [k_addr, v_addr, first_key, keys, code, k_stride, v_stride] =
            <[_; 7]>::try_from(f).expect("seven fields");
        (
            Segment {
                k_addr,
                v_addr,
                first_key,
                keys,
                code,
                k_stride,
                v_stride,
            },
            body,
        )
    }
}

/// Element loops over the CTA: thread `tid` takes elements `tid`, `tid + THREADS`, .. of a
/// range, split into (row, column) of a width.
#[derive(Clone, Copy)]
pub(super) struct Strided {
    pub e: Reg,
    pub row: Reg,
    pub col: Reg,
}

impl Strided {
    pub(super) fn new(r: &mut Regs) -> Strided {
        Strided {
            e: r.add("element", Ty::I64),
            row: r.add("element_row", Ty::I64),
            col: r.add("element_col", Ty::I64),
        }
    }

    /// The loop over elements below `end`.
    pub(super) fn over(&self, end: Expr, body: Vec<Stmt>) -> Stmt {
        Stmt::For {
            reg: self.e,
            start: special64(Special::Tid),
            end,
            step: i64::from(THREADS),
            body,
        }
    }

    /// Sets the element's row and column in rows of `width`.
    pub(super) fn split(&self, width: i64) -> Vec<Stmt> {
        vec![
            Stmt::Set(self.row, bin(Bin::Div, reg(self.e), i64(width))),
            Stmt::Set(self.col, bin(Bin::Rem, reg(self.e), i64(width))),
        ]
    }
}

/// Stages the task's query rows in shared memory at `at` (f32 `[row][qk_dim]`): scaled by the
/// plan's `q_scale` (rotation is linear, so before it), then rotated in place by pairs at their
/// queries' positions; rows from the task's up to `pad_to` are zeros. Ends with a barrier.
pub(super) fn stage_q(
    plan: &KernelPlan,
    r: &mut Regs,
    task: &Task,
    at: i64,
    pad_to: Option<i64>,
) -> Vec<Stmt> {
    let d = i64::from(plan.shape.qk_dim);
    let it = Strided::new(r);
    let (row, col) = (it.row, it.col);
    let q_sh = |row: Expr, col: Expr| add(i64(at), mul(add(mul(row, i64(d)), col), i64(4)));
    let mut body = Vec::new();
    let mut stage = it.split(d);
    stage.push(Stmt::Store(
        Space::Shared,
        q_sh(reg(row), reg(col)),
        mul(
            load(
                Space::Global,
                Ty::F32,
                add(
                    param("q_rows"),
                    mul(
                        add(mul(add(reg(task.row0), reg(row)), i64(d)), reg(col)),
                        i64(4),
                    ),
                ),
            ),
            f32(plan.q_scale as f32),
        ),
    ));
    let staged = mul(reg(task.rows), i64(d));
    body.push(it.over(staged.clone(), stage));
    if let Some(rows) = pad_to {
        // Zeros after the task's rows: the same loop, shifted past them.
        body.push(Stmt::For {
            reg: it.e,
            start: add(staged, special64(Special::Tid)),
            end: i64(rows * d),
            step: i64::from(THREADS),
            body: vec![Stmt::Store(
                Space::Shared,
                add(i64(at), mul(reg(it.e), i64(4))),
                f32(0.0),
            )],
        });
    }
    body.push(Stmt::Barrier);
    let Some(rope) = &plan.rope else {
        return body;
    };
    let half = i64::from(rope.rope.dim / 2);
    let first = i64::from(rope.first_dim);
    // Pair `col` is dims `first + stride col` and that plus `partner`.
    let pairing = rope.rope.layout.pairing(rope.rope.dim);
    let scaled = || match pairing.stride {
        1 => reg(col),
        stride => mul(reg(col), i64(stride as i64)),
    };
    let (ia, ib) = (
        add(i64(first), scaled()),
        add(i64(first + pairing.partner as i64), scaled()),
    );
    // Pair `col` of row `row` at its query's position.
    let pos = add(reg(task.q_pos0), task.query_of(reg(row)));
    let entry = add(
        mul(sub(pos, param("rope_pos0")), i64(half * 4)),
        mul(reg(col), i64(4)),
    );
    let (c, s, a, b) = (
        r.add("cos", Ty::F32),
        r.add("sin", Ty::F32),
        r.add("rot_a", Ty::F32),
        r.add("rot_b", Ty::F32),
    );
    let mut rotate = it.split(half);
    rotate.extend(cos_sin(
        [c, s],
        [param("rope_cos"), param("rope_sin")],
        entry,
    ));
    rotate.extend([
        Stmt::Set(a, load(Space::Shared, Ty::F32, q_sh(reg(row), ia.clone()))),
        Stmt::Set(b, load(Space::Shared, Ty::F32, q_sh(reg(row), ib.clone()))),
    ]);
    let (ra, rb) = rotate_pair(reg(a), reg(b), reg(c), reg(s));
    rotate.extend([
        Stmt::Store(Space::Shared, q_sh(reg(row), ia), ra),
        Stmt::Store(Space::Shared, q_sh(reg(row), ib), rb),
    ]);
    body.push(it.over(mul(reg(task.rows), i64(half)), rotate));
    body.push(Stmt::Barrier);
    body
}
