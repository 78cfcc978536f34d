//! Expressions evaluated per thread: registers, parameters, specials, loads, and the unary,
//! binary and conversion operations with PTX's semantics.

use super::{Cta, Val};
use crate::gpu::ir::{Bin, Expr, Half, Special, Ty, Un};

impl Cta<'_> {
    /// The expression for every active thread.
    pub(super) fn eval_all(&self, e: &Expr, mask: &[bool]) -> Result<Vec<Option<Val>>, String> {
        // One allocation of the final size: collecting through `Result` loses the size hint,
        // and the regrowth showed as a fifth of the interpreter's time.
        let mut values = Vec::with_capacity(mask.len());
        for (t, &active) in mask.iter().enumerate() {
            values.push(if active {
                Some(self.eval(t, e, mask)?)
            } else {
                None
            });
        }
        Ok(values)
    }

    pub(super) fn eval(&self, t: usize, e: &Expr, mask: &[bool]) -> Result<Val, String> {
        let ev = |e: &Expr| self.eval(t, e, mask);
        Ok(match e {
            Expr::Int(x, Ty::I32) => Val::I32(*x as i32),
            Expr::Int(x, _) => Val::I64(*x),
            Expr::F32(x) => Val::F(*x),
            Expr::Pred(b) => Val::P(*b),
            Expr::Reg(r) => {
                self.check_not_busy(t, *r)?;
                self.regs[t][r.0 as usize]
            }
            Expr::SharedAddress(a) => Val::I64(ev(a)?.int()?),
            Expr::Param(i) => *self
                .args
                .get(*i as usize)
                .ok_or_else(|| format!("no parameter {i}"))?,
            Expr::Special(s) => Val::I32(match s {
                Special::Tid => t as i32,
                Special::Ntid => self.kernel.threads as i32,
                Special::Ctaid(a) => self.ctaid[*a as usize % 3] as i32,
                Special::Lane => (t % 32) as i32,
            }),
            Expr::Un(op, a) => {
                let a = ev(a)?;
                match (op, a) {
                    (Un::Not, v) => Val::P(!v.pred()?),
                    (Un::Neg, Val::F(x)) => Val::F(-x),
                    (Un::Neg, Val::I32(x)) => Val::I32(x.wrapping_neg()),
                    (Un::Neg, Val::I64(x)) => Val::I64(x.wrapping_neg()),
                    (Un::Abs, Val::F(x)) => Val::F(x.abs()),
                    (Un::Abs, Val::I32(x)) => Val::I32(x.wrapping_abs()),
                    (Un::Abs, Val::I64(x)) => Val::I64(x.wrapping_abs()),
                    (Un::Ex2, v) => Val::F(f64::from(v.float()?).exp2() as f32),
                    (Un::Ex2Ftz, v) => {
                        let flush = |x: f32| if x.is_subnormal() { 0.0 } else { x };
                        Val::F(flush(f64::from(flush(v.float()?)).exp2() as f32))
                    }
                    (Un::Lg2, v) => Val::F(f64::from(v.float()?).log2() as f32),
                    (Un::Sqrt, v) => Val::F(v.float()?.sqrt()),
                    (op, v) => return Err(format!("{op:?} of {v:?}")),
                }
            }
            Expr::Bin(op, a, b) => binary(*op, ev(a)?, ev(b)?)?,
            Expr::Fma(a, b, c) => Val::F(ev(a)?.float()?.mul_add(ev(b)?.float()?, ev(c)?.float()?)),
            Expr::Select(c, a, b) => {
                if ev(c)?.pred()? {
                    ev(a)?
                } else {
                    ev(b)?
                }
            }
            Expr::Cast(a, ty) => convert(ev(a)?, *ty)?,
            Expr::Load(space, ty, addr) => self.load(*space, *ty, ev(addr)?.int()?, t / 32)?,
            Expr::LoadHalf(space, half, addr) => {
                let a = ev(addr)?.int()?;
                if a % 2 != 0 {
                    return Err(format!("16-bit load at odd address {a}"));
                }
                let [lo, hi, ..] = self.load_bytes(*space, a, 2, t / 32)?;
                let bits = u32::from(u16::from_le_bytes([lo, hi]));
                Val::F(match half {
                    Half::Bf16 => f32::from_bits(bits << 16),
                    Half::F16 => half::f16::from_bits(bits as u16).to_f32(),
                })
            }
            Expr::Table(values, index) => {
                let i = ev(index)?.int()?.clamp(0, values.len() as i64 - 1);
                Val::F(values[i as usize])
            }
            Expr::PackHalf(h, lo, hi) => {
                let round = |x: f32| match h {
                    Half::Bf16 => bf16_bits(x),
                    Half::F16 => half::f16::from_f32(x).to_bits(),
                };
                let (lo, hi) = (round(ev(lo)?.float()?), round(ev(hi)?.float()?));
                Val::I32(((u32::from(hi) << 16) | u32::from(lo)) as i32)
            }
            Expr::ShflXor(v, lane_mask) => {
                let src = (t & !31) | ((t % 32) ^ (*lane_mask as usize % 32));
                if src >= mask.len() || !mask[src] {
                    return Err(format!("shfl from inactive lane {src} (thread {t})"));
                }
                self.eval(src, v, mask)?
            }
        })
    }
}

/// An f32 rounded to bf16 (to nearest, ties to even), as bits.
fn bf16_bits(x: f32) -> u16 {
    if x.is_nan() {
        return 0x7fc0;
    }
    let bits = x.to_bits();
    let rounded = bits.wrapping_add(0x7fff + ((bits >> 16) & 1));
    (rounded >> 16) as u16
}

fn binary(op: Bin, a: Val, b: Val) -> Result<Val, String> {
    use Bin::*;
    Ok(match (a, b) {
        (Val::F(x), Val::F(y)) => match op {
            Add => Val::F(x + y),
            Sub => Val::F(x - y),
            Mul => Val::F(x * y),
            Div => Val::F(x / y),
            Rem => Val::F(x % y),
            Min => Val::F(x.min(y)),
            Max => Val::F(x.max(y)),
            Lt => Val::P(x < y),
            Le => Val::P(x <= y),
            Gt => Val::P(x > y),
            Ge => Val::P(x >= y),
            Eq => Val::P(x == y),
            Ne => Val::P(x != y),
            _ => return Err(format!("{op:?} on f32")),
        },
        (Val::P(x), Val::P(y)) => match op {
            And => Val::P(x && y),
            Or => Val::P(x || y),
            Eq => Val::P(x == y),
            Ne => Val::P(x != y),
            _ => return Err(format!("{op:?} on predicates")),
        },
        (Val::I32(x), Val::I32(y)) => int_op(op, i64::from(x), i64::from(y), Ty::I32)?,
        (Val::I64(x), Val::I64(y)) => int_op(op, x, y, Ty::I64)?,
        (a, b) => return Err(format!("{op:?} of {a:?} and {b:?} (types differ)")),
    })
}

fn int_op(op: Bin, x: i64, y: i64, ty: Ty) -> Result<Val, String> {
    use Bin::*;
    let wrap = |v: i64| {
        if ty == Ty::I32 {
            Val::I32(v as i32)
        } else {
            Val::I64(v)
        }
    };
    let (x32, y32) = (x as i32, y as i32);
    Ok(match op {
        Add if ty == Ty::I32 => Val::I32(x32.wrapping_add(y32)),
        Sub if ty == Ty::I32 => Val::I32(x32.wrapping_sub(y32)),
        Mul if ty == Ty::I32 => Val::I32(x32.wrapping_mul(y32)),
        Add => wrap(x.wrapping_add(y)),
        Sub => wrap(x.wrapping_sub(y)),
        Mul => wrap(x.wrapping_mul(y)),
        Div | Rem if y == 0 => return Err("integer division by zero".into()),
        Div => wrap(x.wrapping_div(y)),
        Rem => wrap(x.wrapping_rem(y)),
        Min => wrap(x.min(y)),
        Max => wrap(x.max(y)),
        And => wrap(x & y),
        Or => wrap(x | y),
        Shl => wrap(x.wrapping_shl(y as u32)),
        Lt => Val::P(x < y),
        Le => Val::P(x <= y),
        Gt => Val::P(x > y),
        Ge => Val::P(x >= y),
        Eq => Val::P(x == y),
        Ne => Val::P(x != y),
    })
}

fn convert(v: Val, ty: Ty) -> Result<Val, String> {
    Ok(match (v, ty) {
        (Val::P(b), Ty::I32) => Val::I32(i32::from(b)),
        (Val::P(b), Ty::I64) => Val::I64(i64::from(b)),
        (Val::I32(x), Ty::I64) => Val::I64(i64::from(x)),
        (Val::I64(x), Ty::I32) => Val::I32(x as i32),
        (Val::I32(x), Ty::F32) => Val::F(x as f32),
        (Val::I64(x), Ty::F32) => Val::F(x as f32),
        (Val::F(x), Ty::I32) => Val::I32(x as i32),
        (Val::F(x), Ty::I64) => Val::I64(x as i64),
        (v, t) if Val::zero(t).same_type(&v) => v,
        (v, t) => return Err(format!("cannot convert {v:?} to {t}")),
    })
}

impl Val {
    fn same_type(&self, other: &Val) -> bool {
        std::mem::discriminant(self) == std::mem::discriminant(other)
    }
}
