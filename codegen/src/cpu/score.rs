//! Lowering of the modifier IR (score program and mask) to Cranelift, four keys at a time.
//!
//! Subexpressions that read neither the score nor the key are *uniform* over a row: they are
//! emitted once per query row, as scalars ([`Uniforms`]). The rest is emitted per group of four
//! keys: floats as f32x4, booleans as i32x4 lane masks, integers as four i64 scalars (x64
//! Cranelift has no 64-bit lane arithmetic to spare). Integer division and remainder by zero give
//! 0 and wrap like the reference evaluator; table indices are clamped.

use super::fx::Fx;
use crate::plan::ParamLayout;
use attn_dsl::modifier::{BinOp, Expr, ParamRead, Ty, UnOp, Var};
use cranelift_codegen::ir::condcodes::{FloatCC, IntCC};
use cranelift_codegen::ir::types::{F32, F32X4, I8, I32, I32X4, I64};
use cranelift_codegen::ir::{FuncRef, InstBuilder, MemFlagsData, Value};
use std::collections::HashMap;

/// Values of the row-uniform variables.
#[derive(Clone, Copy)]
pub(super) struct RowEnv {
    pub batch: Value,
    pub head: Value,
    pub query: Value,
    pub query_index: Value,
}

/// Values of the per-key variables for one group of four keys.
#[derive(Clone, Copy)]
pub(super) struct GroupEnv {
    /// f32x4 scores.
    pub score: Value,
    /// Absolute position of the group's first key (i64).
    pub key0: Value,
    /// Index of the group's first key (i64).
    pub key_index0: Value,
}

/// Addresses of constant tables (ALiBi slopes and the like), kept alive by the kernel, and the
/// parameter buffer of the function being emitted.
pub(super) struct Tables {
    pub data: Vec<Box<[f32]>>,
    /// The function's parameter buffer (loaded from its launch record at entry) and where
    /// each parameter lies in it; `None` for specs without parameters.
    pub params: Option<(Value, ParamLayout)>,
}

impl Tables {
    fn address(&mut self, values: &[f64]) -> i64 {
        let table: Box<[f32]> = values.iter().map(|v| *v as f32).collect();
        let address = table.as_ptr() as i64;
        self.data.push(table);
        address
    }
}

/// A scalar value of a uniform subexpression.
#[derive(Clone, Copy)]
enum Scalar {
    F(Value),
    I(Value),
    /// An i8 that is 0 or 1.
    B(Value),
}

/// A value over four keys.
#[derive(Clone, Copy)]
enum Lanes {
    F(Value),
    I([Value; 4]),
    /// Integers `base + step * lane`: keys and expressions affine in them stay one scalar until
    /// something needs the lanes (uniform integers are `step == 0`).
    Affine {
        base: Value,
        step: i64,
    },
    /// An i32x4 of 0 / -1.
    B(Value),
}

/// The uniform subexpressions of a row, by node address, and the header words of the data
/// tensors the row reads (loaded once per row rather than once per group of keys).
pub(super) struct Uniforms {
    values: HashMap<*const Expr, Scalar>,
    headers: HashMap<String, Vec<Value>>,
}

fn is_uniform(e: &Expr) -> bool {
    !(e.uses(Var::Score) || e.uses(Var::Key) || e.uses(Var::KeyIndex))
}

pub(super) struct ScoreLowering<'t> {
    pub logf: FuncRef,
    pub tables: &'t mut Tables,
}

impl ScoreLowering<'_> {
    /// Emits every maximal uniform subexpression of `exprs` for one row.
    pub fn row_uniforms(&mut self, fx: &mut Fx, row: &RowEnv, exprs: &[&Expr]) -> Uniforms {
        let mut u = Uniforms {
            values: HashMap::new(),
            headers: HashMap::new(),
        };
        for e in exprs {
            for read in e.param_reads() {
                if !u.headers.contains_key(&read.name)
                    && let Some(words) = self.data_header(fx, &read)
                {
                    u.headers.insert(read.name.clone(), words);
                }
            }
        }
        for e in exprs {
            self.collect(fx, row, e, &mut u);
        }
        u
    }

    /// The header words of the data tensor `read` reads, sign-extended to i64 (`None` for a
    /// parameter).
    fn data_header(&self, fx: &mut Fx, read: &ParamRead) -> Option<Vec<Value>> {
        let (base, layout) = self.tables.params.as_ref()?;
        let slot = layout.data_slot(&read.name)?;
        let base = *base;
        Some(
            (0..slot.header_len())
                .map(|i| {
                    let x = fx.load(I32, base, (4 * (slot.header + i)) as i32);
                    fx.b.ins().sextend(I64, x)
                })
                .collect(),
        )
    }

    fn collect(&mut self, fx: &mut Fx, row: &RowEnv, e: &Expr, u: &mut Uniforms) {
        if is_uniform(e) {
            let v = self.scalar(fx, row, e);
            u.values.insert(e as *const Expr, v);
            return;
        }
        match e {
            Expr::Unary(_, a) | Expr::Cast(a, _) | Expr::Table(_, a) => self.collect(fx, row, a, u),
            Expr::Param(read) => {
                for i in &read.indices {
                    self.collect(fx, row, i, u);
                }
            }
            Expr::Binary(_, a, b) => {
                self.collect(fx, row, a, u);
                self.collect(fx, row, b, u);
            }
            Expr::Select(c, t, f) => {
                self.collect(fx, row, c, u);
                self.collect(fx, row, t, u);
                self.collect(fx, row, f, u);
            }
            _ => {}
        }
    }

    /// The f32x4 value of a float expression for a group of keys.
    pub fn float4(&mut self, fx: &mut Fx, u: &Uniforms, g: &GroupEnv, e: &Expr) -> Value {
        let v = self.lanes(fx, u, g, e);
        match v {
            Lanes::F(x) => x,
            _ => unreachable!("float4 is called on f32 expressions"),
        }
    }

    /// The i32x4 lane mask of a boolean expression for a group of keys.
    pub fn mask4(&mut self, fx: &mut Fx, u: &Uniforms, g: &GroupEnv, e: &Expr) -> Value {
        match self.lanes(fx, u, g, e) {
            Lanes::B(m) => m,
            _ => unreachable!("the mask is typed bool"),
        }
    }

    fn broadcast(&mut self, fx: &mut Fx, s: Scalar) -> Lanes {
        match s {
            Scalar::F(x) => Lanes::F(fx.b.ins().splat(F32X4, x)),
            Scalar::I(x) => Lanes::Affine { base: x, step: 0 },
            Scalar::B(x) => {
                let m = fx.b.ins().bmask(I32, x);
                Lanes::B(fx.b.ins().splat(I32X4, m))
            }
        }
    }

    fn lanes(&mut self, fx: &mut Fx, u: &Uniforms, g: &GroupEnv, e: &Expr) -> Lanes {
        if let Some(s) = u.values.get(&(e as *const Expr)) {
            return self.broadcast(fx, *s);
        }
        match e {
            Expr::Var(Var::Score) => Lanes::F(g.score),
            Expr::Var(Var::Key) => Lanes::Affine {
                base: g.key0,
                step: 1,
            },
            Expr::Var(Var::KeyIndex) => Lanes::Affine {
                base: g.key_index0,
                step: 1,
            },
            Expr::Unary(op, a) => {
                let a = self.lanes(fx, u, g, a);
                self.unary4(fx, *op, a)
            }
            // `c * tanh(x)` (softcap): c goes into tanh's numerator coefficients.
            Expr::Binary(BinOp::Mul, a, b) if scaled_tanh(a, b).is_some() => {
                let (c, x) = scaled_tanh(a, b).expect("matched");
                let x = self.float4(fx, u, g, x);
                Lanes::F(fx.tanh4_scaled(x, c as f32))
            }
            // Division by a constant: a multiply by its reciprocal (within 1 ulp, and a
            // fraction of a division's cost).
            Expr::Binary(BinOp::Div, a, b) if matches!(**b, Expr::Float(c) if c != 0.0) => {
                let Expr::Float(c) = **b else { unreachable!() };
                let a = self.float4(fx, u, g, a);
                let r = fx.f32x4((1.0 / c) as f32);
                Lanes::F(fx.b.ins().fmul(a, r))
            }
            Expr::Binary(op, a, b) => {
                let a = self.lanes(fx, u, g, a);
                let b = self.lanes(fx, u, g, b);
                self.binary4(fx, *op, a, b)
            }
            Expr::Select(c, t, f) => {
                let c = self.lanes(fx, u, g, c);
                let t = self.lanes(fx, u, g, t);
                let f = self.lanes(fx, u, g, f);
                let Lanes::B(mask) = c else {
                    unreachable!("conditions are bool")
                };
                match (t, f) {
                    (Lanes::F(t), Lanes::F(f)) => {
                        let m = fx.b.ins().bitcast(F32X4, MemFlagsData::new(), mask);
                        Lanes::F(fx.b.ins().bitselect(m, t, f))
                    }
                    (Lanes::B(t), Lanes::B(f)) => Lanes::B(fx.b.ins().bitselect(mask, t, f)),
                    (t, f) if is_int(t) && is_int(f) => {
                        let (t, f) = (ints(fx, t), ints(fx, f));
                        let m = fx.lanes(mask);
                        Lanes::I([0, 1, 2, 3].map(|i| {
                            let c = fx.b.ins().icmp_imm_s(IntCC::NotEqual, m[i], 0);
                            fx.b.ins().select(c, t[i], f[i])
                        }))
                    }
                    _ => unreachable!("branches share a type"),
                }
            }
            Expr::Cast(a, ty) => {
                let a = self.lanes(fx, u, g, a);
                match (a, ty) {
                    // Exact while |value| <= 2^24, where f32 holds every integer.
                    (Lanes::Affine { base, step }, Ty::F32) => {
                        let f = fx.b.ins().fcvt_from_sint(F32, base);
                        let v = fx.b.ins().splat(F32X4, f);
                        if step == 0 {
                            Lanes::F(v)
                        } else {
                            let offsets = [0, 1, 2, 3].map(|i| ((step * i) as f32).to_bits());
                            let offsets = fx.vconst4(F32X4, offsets);
                            Lanes::F(fx.b.ins().fadd(v, offsets))
                        }
                    }
                    (Lanes::I(x), Ty::F32) => {
                        let f = x.map(|x| fx.b.ins().fcvt_from_sint(F32, x));
                        Lanes::F(fx.gather4(F32X4, f))
                    }
                    (Lanes::F(x), Ty::I64) => {
                        let l = fx.lanes(x);
                        Lanes::I(l.map(|x| fx.b.ins().fcvt_to_sint_sat(I64, x)))
                    }
                    (Lanes::B(m), Ty::I64) => {
                        let l = fx.lanes(m);
                        Lanes::I(l.map(|x| {
                            let one = fx.b.ins().ineg(x);
                            fx.b.ins().uextend(I64, one)
                        }))
                    }
                    (same, _) => same,
                }
            }
            Expr::Table(values, index) => {
                let ix = self.lanes(fx, u, g, index);
                let ix = ints(fx, ix);
                let base = self.tables.address(values);
                let len = values.len() as i64;
                let f = ix.map(|i| table_load(fx, base, len, i));
                Lanes::F(fx.gather4(F32X4, f))
            }
            Expr::Param(read) => {
                let flat = self.param_flat4(fx, u, g, read);
                let base = self.param_base();
                let addrs = flat.map(|i| fx.elem(base, i));
                if read.ty == Ty::I64 {
                    Lanes::I(addrs.map(|a| {
                        let x = fx.load(I32, a, 0);
                        fx.b.ins().sextend(I64, x)
                    }))
                } else {
                    let f = addrs.map(|a| fx.load(F32, a, 0));
                    Lanes::F(fx.gather4(F32X4, f))
                }
            }
            // Constants and row variables are uniform and were looked up above.
            _ => unreachable!("uniform expression not collected: {e}"),
        }
    }

    fn unary4(&mut self, fx: &mut Fx, op: UnOp, a: Lanes) -> Lanes {
        match a {
            Lanes::F(x) => Lanes::F(match op {
                UnOp::Neg => fx.b.ins().fneg(x),
                UnOp::Abs => fx.b.ins().fabs(x),
                UnOp::Sqrt => fx.b.ins().sqrt(x),
                UnOp::Exp => fx.exp4(x),
                UnOp::Tanh => fx.tanh4(x),
                UnOp::Ln => {
                    let l = fx.lanes(x);
                    let r = l.map(|x| {
                        let call = fx.b.ins().call(self.logf, &[x]);
                        fx.b.inst_results(call)[0]
                    });
                    fx.gather4(F32X4, r)
                }
                UnOp::Not => unreachable!("typed"),
            }),
            Lanes::Affine { base, step } if op == UnOp::Neg => Lanes::Affine {
                base: fx.b.ins().ineg(base),
                step: step.wrapping_neg(),
            },
            int @ (Lanes::I(_) | Lanes::Affine { .. }) => {
                let x = ints(fx, int);
                Lanes::I(x.map(|x| match op {
                    UnOp::Neg => fx.b.ins().ineg(x),
                    _ => fx.b.ins().iabs(x),
                }))
            }
            Lanes::B(m) => Lanes::B(fx.b.ins().bnot(m)),
        }
    }

    fn binary4(&mut self, fx: &mut Fx, op: BinOp, a: Lanes, b: Lanes) -> Lanes {
        match (a, b) {
            (Lanes::F(x), Lanes::F(y)) => match op {
                BinOp::Add => Lanes::F(fx.b.ins().fadd(x, y)),
                BinOp::Sub => Lanes::F(fx.b.ins().fsub(x, y)),
                BinOp::Mul => Lanes::F(fx.b.ins().fmul(x, y)),
                BinOp::Div => Lanes::F(fx.b.ins().fdiv(x, y)),
                BinOp::Rem => {
                    let q = fx.b.ins().fdiv(x, y);
                    let q = fx.b.ins().trunc(q);
                    let qy = fx.b.ins().fmul(q, y);
                    Lanes::F(fx.b.ins().fsub(x, qy))
                }
                BinOp::Min | BinOp::Max => Lanes::F(float_min_max(fx, op, x, y)),
                cmp => Lanes::B(fx.b.ins().fcmp(float_cc(cmp), x, y)),
            },
            (Lanes::Affine { base: x, step: sx }, Lanes::Affine { base: y, step: sy })
                if matches!(op, BinOp::Add | BinOp::Sub) =>
            {
                if op == BinOp::Add {
                    Lanes::Affine {
                        base: fx.b.ins().iadd(x, y),
                        step: sx.wrapping_add(sy),
                    }
                } else {
                    Lanes::Affine {
                        base: fx.b.ins().isub(x, y),
                        step: sx.wrapping_sub(sy),
                    }
                }
            }
            (x, y) if is_int(x) && is_int(y) => {
                let (x, y) = (ints(fx, x), ints(fx, y));
                if let Some(cc) = int_cc(op) {
                    let bits = [0, 1, 2, 3].map(|i| {
                        let c = fx.b.ins().icmp(cc, x[i], y[i]);
                        fx.b.ins().bmask(I32, c)
                    });
                    Lanes::B(fx.gather4(I32X4, bits))
                } else {
                    Lanes::I([0, 1, 2, 3].map(|i| int_op(fx, op, x[i], y[i])))
                }
            }
            (Lanes::B(x), Lanes::B(y)) => Lanes::B(match op {
                BinOp::And => fx.b.ins().band(x, y),
                BinOp::Or => fx.b.ins().bor(x, y),
                BinOp::Eq => fx.b.ins().icmp(IntCC::Equal, x, y),
                _ => fx.b.ins().icmp(IntCC::NotEqual, x, y),
            }),
            _ => unreachable!("operands share a type"),
        }
    }

    /// Emits a uniform expression as a scalar.
    fn scalar(&mut self, fx: &mut Fx, row: &RowEnv, e: &Expr) -> Scalar {
        match e {
            Expr::Var(v) => Scalar::I(match v {
                Var::Batch => row.batch,
                Var::Head => row.head,
                Var::Query => row.query,
                Var::QueryIndex => row.query_index,
                _ => unreachable!("not uniform"),
            }),
            Expr::Float(x) => Scalar::F(fx.f32(*x as f32)),
            Expr::Int(i) => Scalar::I(fx.i64(*i)),
            Expr::Bool(b) => Scalar::B(fx.b.ins().iconst(I8, i64::from(*b))),
            Expr::Unary(op, a) => {
                let a = self.scalar(fx, row, a);
                match a {
                    Scalar::F(x) => Scalar::F(match op {
                        UnOp::Neg => fx.b.ins().fneg(x),
                        UnOp::Abs => fx.b.ins().fabs(x),
                        UnOp::Sqrt => fx.b.ins().sqrt(x),
                        UnOp::Exp => fx.exp1(x),
                        UnOp::Tanh => {
                            let v = fx.splat_f32(x);
                            let t = fx.tanh4(v);
                            fx.b.ins().extractlane(t, 0)
                        }
                        UnOp::Ln => {
                            let call = fx.b.ins().call(self.logf, &[x]);
                            fx.b.inst_results(call)[0]
                        }
                        UnOp::Not => unreachable!("typed"),
                    }),
                    Scalar::I(x) => Scalar::I(match op {
                        UnOp::Neg => fx.b.ins().ineg(x),
                        _ => fx.b.ins().iabs(x),
                    }),
                    Scalar::B(x) => Scalar::B(fx.b.ins().bxor_imm_s(x, 1)),
                }
            }
            Expr::Binary(op, a, b) => {
                let a = self.scalar(fx, row, a);
                let b = self.scalar(fx, row, b);
                match (a, b) {
                    (Scalar::F(x), Scalar::F(y)) => match op {
                        BinOp::Add => Scalar::F(fx.b.ins().fadd(x, y)),
                        BinOp::Sub => Scalar::F(fx.b.ins().fsub(x, y)),
                        BinOp::Mul => Scalar::F(fx.b.ins().fmul(x, y)),
                        BinOp::Div => Scalar::F(fx.b.ins().fdiv(x, y)),
                        BinOp::Rem => {
                            let q = fx.b.ins().fdiv(x, y);
                            let q = fx.b.ins().trunc(q);
                            let qy = fx.b.ins().fmul(q, y);
                            Scalar::F(fx.b.ins().fsub(x, qy))
                        }
                        BinOp::Min | BinOp::Max => Scalar::F(float_min_max(fx, *op, x, y)),
                        cmp => Scalar::B(fx.b.ins().fcmp(float_cc(*cmp), x, y)),
                    },
                    (Scalar::I(x), Scalar::I(y)) => match int_cc(*op) {
                        Some(cc) => Scalar::B(fx.b.ins().icmp(cc, x, y)),
                        None => Scalar::I(int_op(fx, *op, x, y)),
                    },
                    (Scalar::B(x), Scalar::B(y)) => Scalar::B(match op {
                        BinOp::And => fx.b.ins().band(x, y),
                        BinOp::Or => fx.b.ins().bor(x, y),
                        BinOp::Eq => fx.b.ins().icmp(IntCC::Equal, x, y),
                        _ => fx.b.ins().icmp(IntCC::NotEqual, x, y),
                    }),
                    _ => unreachable!("operands share a type"),
                }
            }
            Expr::Select(c, t, f) => {
                let (c, t, f) = (
                    self.scalar(fx, row, c),
                    self.scalar(fx, row, t),
                    self.scalar(fx, row, f),
                );
                let Scalar::B(c) = c else {
                    unreachable!("conditions are bool")
                };
                match (t, f) {
                    (Scalar::F(t), Scalar::F(f)) => Scalar::F(fx.b.ins().select(c, t, f)),
                    (Scalar::I(t), Scalar::I(f)) => Scalar::I(fx.b.ins().select(c, t, f)),
                    (Scalar::B(t), Scalar::B(f)) => Scalar::B(fx.b.ins().select(c, t, f)),
                    _ => unreachable!("branches share a type"),
                }
            }
            Expr::Cast(a, ty) => match (self.scalar(fx, row, a), ty) {
                (Scalar::I(x), Ty::F32) => Scalar::F(fx.b.ins().fcvt_from_sint(F32, x)),
                (Scalar::F(x), Ty::I64) => Scalar::I(fx.b.ins().fcvt_to_sint_sat(I64, x)),
                (Scalar::B(x), Ty::I64) => Scalar::I(fx.b.ins().uextend(I64, x)),
                (same, _) => same,
            },
            Expr::Table(values, index) => {
                let Scalar::I(i) = self.scalar(fx, row, index) else {
                    unreachable!("table indices are i64")
                };
                let base = self.tables.address(values);
                Scalar::F(table_load(fx, base, values.len() as i64, i))
            }
            Expr::Param(read) => {
                let indices: Vec<Value> = read
                    .indices
                    .iter()
                    .map(|i| match self.scalar(fx, row, i) {
                        Scalar::I(v) => v,
                        _ => unreachable!("parameter indices are i64"),
                    })
                    .collect();
                let flat = self.flat_index(fx, read, &indices);
                let base = self.param_base();
                let addr = fx.elem(base, flat);
                if read.ty == Ty::I64 {
                    let x = fx.load(I32, addr, 0);
                    Scalar::I(fx.b.ins().sextend(I64, x))
                } else {
                    Scalar::F(fx.load(F32, addr, 0))
                }
            }
        }
    }

    /// The function's parameter buffer.
    fn param_base(&self) -> Value {
        self.tables
            .params
            .as_ref()
            .expect("a program that reads parameters is emitted with a parameter buffer")
            .0
    }

    /// For each of four keys, the element of the buffer `read` reads (each index clamped into
    /// its dimension, as the reference does; the spec proved they are in range).
    pub fn param_flat4(
        &mut self,
        fx: &mut Fx,
        u: &Uniforms,
        g: &GroupEnv,
        read: &ParamRead,
    ) -> [Value; 4] {
        let per_index: Vec<[Value; 4]> = read
            .indices
            .iter()
            .map(|i| {
                let l = self.lanes(fx, u, g, i);
                ints(fx, l)
            })
            .collect();
        let header = u.headers.get(&read.name);
        [0, 1, 2, 3].map(|lane| {
            let indices: Vec<Value> = per_index.iter().map(|l| l[lane]).collect();
            match header {
                Some(words) => data_flat_index(fx, words, &indices),
                None => self.flat_index(fx, read, &indices),
            }
        })
    }

    /// The element of the buffer `read` reads: `offset + sum(clamp(i_d) * stride_d)` for a
    /// parameter, through the call's header for a data tensor ([`crate::plan::DataSlot`]).
    fn flat_index(&self, fx: &mut Fx, read: &ParamRead, indices: &[Value]) -> Value {
        let layout = &self
            .tables
            .params
            .as_ref()
            .expect("a program that reads tensors is emitted with a parameter buffer")
            .1;
        if layout.data_slot(&read.name).is_some() {
            let words = self
                .data_header(fx, read)
                .expect("a data slot has a header");
            return data_flat_index(fx, &words, indices);
        }
        let slot = layout
            .slot(&read.name)
            .expect("validation resolves every read to a declared tensor");
        let mut flat = fx.i64(slot.offset as i64);
        let mut stride = 1i64;
        for (&i, &dim) in indices.iter().zip(&slot.shape).rev() {
            let zero = fx.i64(0);
            let last = fx.i64(dim as i64 - 1);
            let i = fx.b.ins().smax(i, zero);
            let i = fx.b.ins().smin(i, last);
            let scaled = fx.b.ins().imul_imm_s(i, stride);
            flat = fx.b.ins().iadd(flat, scaled);
            stride *= dim as i64;
        }
        flat
    }
}

/// A data tensor's element from its header `words` (the first element, each dimension's length
/// and origin; [`crate::plan::DataSlot`]): each index, less its origin, clamped into its
/// dimension (min before max, so an empty dimension reads the first element, which the call
/// keeps inside the buffer).
fn data_flat_index(fx: &mut Fx, words: &[Value], indices: &[Value]) -> Value {
    let rank = indices.len();
    let mut flat = words[0];
    let mut stride: Option<Value> = None;
    for (axis, &i) in indices.iter().enumerate().rev() {
        let (len, origin) = (words[1 + axis], words[1 + rank + axis]);
        let i = fx.b.ins().isub(i, origin);
        let last = fx.b.ins().iadd_imm_s(len, -1);
        let i = fx.b.ins().smin(i, last);
        let zero = fx.i64(0);
        let i = fx.b.ins().smax(i, zero);
        let scaled = match stride {
            Some(s) => fx.b.ins().imul(i, s),
            None => i,
        };
        flat = fx.b.ins().iadd(flat, scaled);
        stride = Some(match stride {
            Some(s) => fx.b.ins().imul(s, len),
            None => len,
        });
    }
    flat
}

/// `min(x, y)` / `max(x, y)` of floats: NaN when either is NaN (as PyTorch's `minimum` and
/// `maximum`), which Cranelift's `fmin`/`fmax` give.
fn float_min_max(fx: &mut Fx, op: BinOp, x: Value, y: Value) -> Value {
    if op == BinOp::Min {
        fx.b.ins().fmin(x, y)
    } else {
        fx.b.ins().fmax(x, y)
    }
}

fn is_int(l: Lanes) -> bool {
    matches!(l, Lanes::I(_) | Lanes::Affine { .. })
}

/// The four integer lanes.
fn ints(fx: &mut Fx, l: Lanes) -> [Value; 4] {
    match l {
        Lanes::I(x) => x,
        Lanes::Affine { base, step } => {
            [0, 1, 2, 3].map(|i| fx.b.ins().iadd_imm_s(base, step.wrapping_mul(i)))
        }
        _ => unreachable!("not an integer"),
    }
}

/// `table[clamp(i, 0, len-1)]`.
fn table_load(fx: &mut Fx, base: i64, len: i64, i: Value) -> Value {
    let zero = fx.i64(0);
    let last = fx.i64(len - 1);
    let i = fx.b.ins().smax(i, zero);
    let i = fx.b.ins().smin(i, last);
    let base = fx.i64(base);
    let addr = fx.elem(base, i);
    fx.load(F32, addr, 0)
}

fn float_cc(op: BinOp) -> FloatCC {
    match op {
        BinOp::Lt => FloatCC::LessThan,
        BinOp::Le => FloatCC::LessThanOrEqual,
        BinOp::Gt => FloatCC::GreaterThan,
        BinOp::Ge => FloatCC::GreaterThanOrEqual,
        BinOp::Eq => FloatCC::Equal,
        BinOp::Ne => FloatCC::NotEqual,
        _ => unreachable!("not a comparison: {op:?}"),
    }
}

fn int_cc(op: BinOp) -> Option<IntCC> {
    Some(match op {
        BinOp::Lt => IntCC::SignedLessThan,
        BinOp::Le => IntCC::SignedLessThanOrEqual,
        BinOp::Gt => IntCC::SignedGreaterThan,
        BinOp::Ge => IntCC::SignedGreaterThanOrEqual,
        BinOp::Eq => IntCC::Equal,
        BinOp::Ne => IntCC::NotEqual,
        _ => return None,
    })
}

/// Integer arithmetic with the reference's semantics: wrapping, and `x / 0 == x % 0 == 0`.
fn int_op(fx: &mut Fx, op: BinOp, x: Value, y: Value) -> Value {
    match op {
        BinOp::Add => fx.b.ins().iadd(x, y),
        BinOp::Sub => fx.b.ins().isub(x, y),
        BinOp::Mul => fx.b.ins().imul(x, y),
        BinOp::Min => fx.b.ins().smin(x, y),
        BinOp::Max => fx.b.ins().smax(x, y),
        BinOp::Div | BinOp::Rem => {
            // sdiv/srem trap on 0 and on MIN / -1: divide by 1 there and fix the result up.
            let is_zero = fx.b.ins().icmp_imm_s(IntCC::Equal, y, 0);
            let is_neg1 = fx.b.ins().icmp_imm_s(IntCC::Equal, y, -1);
            let unsafe_divisor = fx.b.ins().bor(is_zero, is_neg1);
            let one = fx.i64(1);
            let d = fx.b.ins().select(unsafe_divisor, one, y);
            let zero = fx.i64(0);
            if op == BinOp::Div {
                let q = fx.b.ins().sdiv(x, d);
                let neg = fx.b.ins().ineg(x);
                let q = fx.b.ins().select(is_neg1, neg, q);
                fx.b.ins().select(is_zero, zero, q)
            } else {
                let r = fx.b.ins().srem(x, d);
                fx.b.ins().select(unsafe_divisor, zero, r)
            }
        }
        _ => unreachable!("not arithmetic: {op:?}"),
    }
}

/// `c * tanh(x)` or `tanh(x) * c` with a constant `c`: `(c, x)`.
fn scaled_tanh<'e>(a: &'e Expr, b: &'e Expr) -> Option<(f64, &'e Expr)> {
    match (a, b) {
        (Expr::Float(c), Expr::Unary(UnOp::Tanh, x))
        | (Expr::Unary(UnOp::Tanh, x), Expr::Float(c)) => Some((*c, x)),
        _ => None,
    }
}
