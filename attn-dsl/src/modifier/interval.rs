//! Interval analysis: what an expression can evaluate to over a box of variable values, and from
//! it the classification of a tile of (query, key) pairs as all kept, all masked, or mixed.
//!
//! The analysis is sound: "all kept" means the mask holds at every point of the box, "all
//! masked" that it fails at every point; when unsure it says mixed. Integer intervals follow the
//! wrapping semantics of evaluation (a possible overflow gives the full range). Float intervals
//! are widened after every operation by a relative 2^-16, which covers f32 rounding and the
//! error of the polynomial exp/tanh kernels use, so a classification holds for the kernels too.

use super::{BinOp, Expr, Ty, UnOp, Var};

/// An inclusive range of i64 values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Interval {
    /// Smallest value.
    pub lo: i64,
    /// Largest value.
    pub hi: i64,
}

impl Interval {
    /// `[lo, hi]`; `lo <= hi`.
    pub fn new(lo: i64, hi: i64) -> Self {
        debug_assert!(lo <= hi, "empty interval [{lo}, {hi}]");
        Interval { lo, hi }
    }

    /// The single value `x`.
    pub fn point(x: i64) -> Self {
        Interval { lo: x, hi: x }
    }

    /// Every i64.
    pub const FULL: Interval = Interval {
        lo: i64::MIN,
        hi: i64::MAX,
    };
}

/// The box of values the integer variables range over: one tile of one (batch, head).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TileBounds {
    /// Batch indices.
    pub batch: Interval,
    /// Query heads.
    pub head: Interval,
    /// Absolute query positions.
    pub query: Interval,
    /// Absolute key positions.
    pub key: Interval,
    /// Query row indices in the call.
    pub query_index: Interval,
    /// Key indices in the call.
    pub key_index: Interval,
}

impl TileBounds {
    /// A tile of query rows `qi` and key indices `ki` of a call with `sq` queries against `skv`
    /// keys at position offset `p0` (queries are the last `sq` positions), for any batch and head.
    pub fn for_tile(qi: Interval, ki: Interval, sq: i64, skv: i64, p0: i64) -> Self {
        let shift = p0 + skv - sq;
        TileBounds {
            batch: Interval::new(0, i64::MAX),
            head: Interval::new(0, i64::MAX),
            query: Interval::new(qi.lo + shift, qi.hi + shift),
            key: Interval::new(ki.lo + p0, ki.hi + p0),
            query_index: qi,
            key_index: ki,
        }
    }

    fn of(&self, var: Var) -> Interval {
        match var {
            Var::Batch => self.batch,
            Var::Head => self.head,
            Var::Query => self.query,
            Var::Key => self.key,
            Var::QueryIndex => self.query_index,
            Var::KeyIndex => self.key_index,
            Var::Score => Interval::FULL,
        }
    }
}

/// A three-valued truth: what a boolean expression can be over a box.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Truth {
    /// True at every point.
    Always,
    /// False at every point.
    Never,
    /// Possibly either.
    Unknown,
}

impl Truth {
    fn of(b: bool) -> Truth {
        if b { Truth::Always } else { Truth::Never }
    }

    fn not(self) -> Truth {
        match self {
            Truth::Always => Truth::Never,
            Truth::Never => Truth::Always,
            Truth::Unknown => Truth::Unknown,
        }
    }

    fn join(self, other: Truth) -> Truth {
        if self == other { self } else { Truth::Unknown }
    }
}

/// The abstract value of an expression over a box.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Range {
    /// An integer in `[lo, hi]`.
    Int(Interval),
    /// A float in `[lo, hi]` (possibly infinite), or NaN when `nan`.
    Float {
        /// Lower bound.
        lo: f64,
        /// Upper bound.
        hi: f64,
        /// Whether NaN is possible.
        nan: bool,
    },
    /// A boolean.
    Bool(Truth),
}

/// How a tile relates to the mask.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TileClass {
    /// Every pair is kept: the tile runs without per-element masking.
    AllKept,
    /// Every pair is masked: the tile is skipped.
    AllMasked,
    /// Some pairs may be kept and some masked: the tile applies the mask per element.
    Mixed,
}

/// What the elements of a call's tensors can be over boxes of indices: the ranges that let a
/// mask reading data tensors classify tiles from the data (`None`: unknown).
pub trait TensorRanges {
    /// The range of tensor `name`'s elements over the indices `indices` (one interval per
    /// dimension, as the read's index expressions range, before any clamping).
    fn range(&self, name: &str, indices: &[Interval]) -> Option<Range>;
}

/// Classifies a tile against a boolean mask expression.
pub fn classify(mask: &Expr, bounds: &TileBounds) -> TileClass {
    classify_with(mask, bounds, None)
}

/// [`classify`] with the ranges of the tensors the mask reads.
pub fn classify_with(
    mask: &Expr,
    bounds: &TileBounds,
    tensors: Option<&dyn TensorRanges>,
) -> TileClass {
    match analyze_with(mask, bounds, tensors) {
        Range::Bool(Truth::Always) => TileClass::AllKept,
        Range::Bool(Truth::Never) => TileClass::AllMasked,
        _ => TileClass::Mixed,
    }
}

/// What `expr` can evaluate to over the box (`score` ranges over every float and NaN).
pub fn analyze(expr: &Expr, bounds: &TileBounds) -> Range {
    analyze_with(expr, bounds, None)
}

/// [`analyze`] with the ranges of the tensors `expr` reads (without them, a read may be any
/// value of its type).
pub fn analyze_with(expr: &Expr, bounds: &TileBounds, tensors: Option<&dyn TensorRanges>) -> Range {
    let go = |e: &Expr| analyze_with(e, bounds, tensors);
    match expr {
        Expr::Var(Var::Score) => FLOAT_ANY,
        Expr::Var(v) => Range::Int(bounds.of(*v)),
        Expr::Float(x) => Range::Float {
            lo: *x,
            hi: *x,
            nan: x.is_nan(),
        },
        Expr::Int(i) => Range::Int(Interval::point(*i)),
        Expr::Bool(b) => Range::Bool(Truth::of(*b)),
        Expr::Unary(op, a) => unary(*op, go(a)),
        Expr::Binary(op, a, b) => binary(*op, go(a), go(b)),
        Expr::Select(c, t, e) => match go(c) {
            Range::Bool(Truth::Always) => go(t),
            Range::Bool(Truth::Never) => go(e),
            _ => join(go(t), go(e)),
        },
        Expr::Cast(a, ty) => cast(go(a), *ty),
        Expr::Table(values, index) => {
            let Range::Int(i) = go(index) else {
                return FLOAT_ANY;
            };
            let last = values.len().saturating_sub(1) as i64;
            let (lo, hi) = (i.lo.clamp(0, last) as usize, i.hi.clamp(0, last) as usize);
            let slice = &values[lo..=hi];
            Range::Float {
                lo: slice.iter().copied().fold(f64::INFINITY, f64::min),
                hi: slice.iter().copied().fold(f64::NEG_INFINITY, f64::max),
                nan: slice.iter().any(|v| v.is_nan()),
            }
        }
        Expr::Param(read) => {
            let known = tensors.and_then(|t| {
                let mut indices = [Interval::FULL; MAX_INDICES];
                if read.indices.len() > MAX_INDICES {
                    return None;
                }
                for (slot, i) in indices.iter_mut().zip(&read.indices) {
                    let Range::Int(r) = go(i) else {
                        return None;
                    };
                    *slot = r;
                }
                t.range(&read.name, &indices[..read.indices.len()])
            });
            match (known, read.ty) {
                (Some(r), _) => r,
                // A tensor may hold any value, NaN included; i32 data any i32.
                (None, super::Ty::I64) => {
                    Range::Int(Interval::new(i64::from(i32::MIN), i64::from(i32::MAX)))
                }
                (None, _) => FLOAT_ANY,
            }
        }
    }
}

/// Most indices of a tensor read whose range is looked up (a spec's tensors have at most 4).
const MAX_INDICES: usize = 8;

const FLOAT_ANY: Range = Range::Float {
    lo: f64::NEG_INFINITY,
    hi: f64::INFINITY,
    nan: true,
};

/// An integer interval from i128 bounds; anything outside i64 may have wrapped: full range.
fn int(lo: i128, hi: i128) -> Range {
    if lo < i64::MIN as i128 || hi > i64::MAX as i128 {
        Range::Int(Interval::FULL)
    } else {
        Range::Int(Interval::new(lo as i64, hi as i64))
    }
}

/// A float interval from candidate endpoint values, widened for f32 rounding.
fn float(candidates: &[f64], nan: bool) -> Range {
    if candidates.iter().any(|c| c.is_nan()) {
        return FLOAT_ANY;
    }
    const EPS: f64 = 1.0 / 65536.0;
    let lo = candidates.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = candidates.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let tiny = f64::from(f32::MIN_POSITIVE);
    // Infinite endpoints stay as they are (widening them would make NaN).
    let widen = |x: f64, dir: f64| {
        if x.is_finite() {
            x + dir * (x.abs() * EPS + tiny)
        } else {
            x
        }
    };
    Range::Float {
        lo: widen(lo, -1.0),
        hi: widen(hi, 1.0),
        nan,
    }
}

fn join(a: Range, b: Range) -> Range {
    match (a, b) {
        (Range::Int(x), Range::Int(y)) => Range::Int(Interval::new(x.lo.min(y.lo), x.hi.max(y.hi))),
        (
            Range::Float { lo, hi, nan },
            Range::Float {
                lo: l2,
                hi: h2,
                nan: n2,
            },
        ) => Range::Float {
            lo: lo.min(l2),
            hi: hi.max(h2),
            nan: nan || n2,
        },
        (Range::Bool(x), Range::Bool(y)) => Range::Bool(x.join(y)),
        // Ill-typed trees never reach here (typecheck); stay sound regardless.
        _ => FLOAT_ANY,
    }
}

fn unary(op: UnOp, a: Range) -> Range {
    match (op, a) {
        (UnOp::Not, Range::Bool(t)) => Range::Bool(t.not()),
        (UnOp::Neg, Range::Int(i)) => int(-(i.hi as i128), -(i.lo as i128)),
        (UnOp::Abs, Range::Int(i)) => {
            let (lo, hi) = (i.lo as i128, i.hi as i128);
            if lo >= 0 {
                int(lo, hi)
            } else if hi <= 0 {
                int(-hi, -lo)
            } else {
                int(0, (-lo).max(hi))
            }
        }
        (op, Range::Float { lo, hi, nan }) => match op {
            UnOp::Neg => float(&[-hi, -lo], nan),
            UnOp::Abs if lo >= 0.0 => float(&[lo, hi], nan),
            UnOp::Abs if hi <= 0.0 => float(&[-hi, -lo], nan),
            UnOp::Abs => float(&[0.0, -lo, hi], nan),
            UnOp::Exp => float(&[lo.exp(), hi.exp()], nan),
            UnOp::Tanh => float(&[lo.tanh(), hi.tanh()], nan),
            UnOp::Ln => float(&[lo.max(0.0).ln(), hi.max(0.0).ln()], nan || lo < 0.0),
            UnOp::Sqrt => float(&[lo.max(0.0).sqrt(), hi.max(0.0).sqrt()], nan || lo < 0.0),
            UnOp::Not => FLOAT_ANY,
        },
        _ => FLOAT_ANY,
    }
}

fn binary(op: BinOp, a: Range, b: Range) -> Range {
    match (a, b) {
        (Range::Bool(x), Range::Bool(y)) => Range::Bool(boolean(op, x, y)),
        (Range::Int(x), Range::Int(y)) => integer(op, x, y),
        (
            Range::Float { lo, hi, nan },
            Range::Float {
                lo: l2,
                hi: h2,
                nan: n2,
            },
        ) => floating(op, (lo, hi, nan), (l2, h2, n2)),
        _ => FLOAT_ANY,
    }
}

fn boolean(op: BinOp, x: Truth, y: Truth) -> Truth {
    use Truth::*;
    match op {
        BinOp::And => match (x, y) {
            (Never, _) | (_, Never) => Never,
            (Always, Always) => Always,
            _ => Unknown,
        },
        BinOp::Or => match (x, y) {
            (Always, _) | (_, Always) => Always,
            (Never, Never) => Never,
            _ => Unknown,
        },
        BinOp::Eq | BinOp::Ne => {
            let eq = match (x, y) {
                (Unknown, _) | (_, Unknown) => Unknown,
                _ => Truth::of(x == y),
            };
            if op == BinOp::Eq { eq } else { eq.not() }
        }
        _ => Unknown,
    }
}

/// Three-valued comparison of ranges `[alo, ahi]` and `[blo, bhi]`.
fn compare<T: PartialOrd + Copy>(op: BinOp, (alo, ahi): (T, T), (blo, bhi): (T, T)) -> Truth {
    let decide = |always: bool, never: bool| {
        if always {
            Truth::Always
        } else if never {
            Truth::Never
        } else {
            Truth::Unknown
        }
    };
    match op {
        BinOp::Lt => decide(ahi < blo, alo >= bhi),
        BinOp::Le => decide(ahi <= blo, alo > bhi),
        BinOp::Gt => decide(alo > bhi, ahi <= blo),
        BinOp::Ge => decide(alo >= bhi, ahi < blo),
        BinOp::Eq => decide(
            alo == ahi && blo == bhi && alo == blo,
            ahi < blo || bhi < alo,
        ),
        BinOp::Ne => decide(
            ahi < blo || bhi < alo,
            alo == ahi && blo == bhi && alo == blo,
        ),
        _ => Truth::Unknown,
    }
}

fn integer(op: BinOp, x: Interval, y: Interval) -> Range {
    let (xl, xh, yl, yh) = (x.lo as i128, x.hi as i128, y.lo as i128, y.hi as i128);
    let hull = |c: &[i128]| int(*c.iter().min().unwrap(), *c.iter().max().unwrap());
    match op {
        BinOp::Add => int(xl + yl, xh + yh),
        BinOp::Sub => int(xl - yh, xh - yl),
        BinOp::Mul => hull(&[xl * yl, xl * yh, xh * yl, xh * yh]),
        BinOp::Div => {
            // Truncating division is monotone on each side of a zero-free divisor range, so the
            // extremes are at the corners; a divisor that may be 0 adds the result 0.
            let mut c = Vec::new();
            for (dl, dh) in [(yl, yh.min(-1)), (yl.max(1), yh)] {
                if dl <= dh {
                    c.extend([xl / dl, xl / dh, xh / dl, xh / dh]);
                }
            }
            if yl <= 0 && 0 <= yh {
                c.push(0);
            }
            hull(&c)
        }
        BinOp::Rem => integer_rem(xl, xh, yl, yh),
        BinOp::Min => int(xl.min(yl), xh.min(yh)),
        BinOp::Max => int(xl.max(yl), xh.max(yh)),
        _ => Range::Bool(compare(op, (xl, xh), (yl, yh))),
    }
}

fn integer_rem(xl: i128, xh: i128, yl: i128, yh: i128) -> Range {
    // A single divisor and a dividend range within one block of it: `x % c = x - c*(x/c)` with
    // `x/c` constant, so the range maps exactly.
    if yl == yh && yl != 0 && (xl >= 0 || xh <= 0) && xl / yl == xh / yl {
        return int(xl % yl, xh % yl);
    }
    // Otherwise: the sign of the dividend, magnitude below the largest divisor (0 when the
    // divisor may be 0, which gives 0).
    let m = yl.abs().max(yh.abs());
    if m == 0 {
        return int(0, 0);
    }
    int(xl.min(0).max(-(m - 1)), xh.max(0).min(m - 1))
}

fn floating(op: BinOp, (al, ah, an): (f64, f64, bool), (bl, bh, bn): (f64, f64, bool)) -> Range {
    let nan = an || bn;
    match op {
        BinOp::Add => float(&[al + bl, ah + bh], nan),
        BinOp::Sub => float(&[al - bh, ah - bl], nan),
        BinOp::Mul => float(&[al * bl, al * bh, ah * bl, ah * bh], nan),
        BinOp::Div if bl <= 0.0 && 0.0 <= bh => FLOAT_ANY,
        BinOp::Div => float(&[al / bl, al / bh, ah / bl, ah / bh], nan),
        BinOp::Rem => {
            let m = bl.abs().max(bh.abs());
            let nan = nan || (bl <= 0.0 && 0.0 <= bh) || al.is_infinite() || ah.is_infinite();
            float(&[al.min(0.0).max(-m), ah.max(0.0).min(m)], nan)
        }
        // A NaN operand makes the result NaN (as PyTorch's `minimum` and `maximum`).
        BinOp::Min => float(&[al.min(bl), ah.min(bh)], nan),
        BinOp::Max => float(&[al.max(bl), ah.max(bh)], nan),
        _ => {
            let t = compare(op, (al, ah), (bl, bh));
            // NaN makes every comparison false except `!=`.
            Range::Bool(match (nan, op, t) {
                (false, ..) => t,
                (true, BinOp::Ne, Truth::Never) => Truth::Unknown,
                (true, BinOp::Ne, t) => t,
                (true, _, Truth::Always) => Truth::Unknown,
                (true, _, t) => t,
            })
        }
    }
}

fn cast(a: Range, ty: Ty) -> Range {
    match (a, ty) {
        (Range::Int(i), Ty::F32) => float(&[i.lo as f64, i.hi as f64], false),
        (Range::Int(i), Ty::I64) => Range::Int(i),
        (Range::Bool(t), Ty::I64) => match t {
            Truth::Always => int(1, 1),
            Truth::Never => int(0, 0),
            Truth::Unknown => int(0, 1),
        },
        (Range::Float { lo, hi, nan }, Ty::I64) => {
            // `as i64` truncates toward zero, saturates, and maps NaN to 0.
            let (lo, hi) = (lo as i64 as i128, hi as i64 as i128);
            if nan {
                int(lo.min(0), hi.max(0))
            } else {
                int(lo, hi)
            }
        }
        (r @ Range::Float { .. }, Ty::F32) => r,
        _ => FLOAT_ANY,
    }
}
