//! Small helpers over Cranelift's function builder: constants, loads and stores, counted loops,
//! and the vector math (exp) generated kernels share.

use cranelift_codegen::ir::condcodes::{FloatCC, IntCC};
use cranelift_codegen::ir::types::{F32, F32X4, I8X16, I32X4, I64};
use cranelift_codegen::ir::{Endianness, InstBuilder, MemFlagsData, Type, Value};
use cranelift_frontend::FunctionBuilder;

/// A function being built.
pub(super) struct Fx<'a> {
    pub b: FunctionBuilder<'a>,
}

fn flags() -> MemFlagsData {
    MemFlagsData::trusted()
}

impl<'a> Fx<'a> {
    pub fn i64(&mut self, x: i64) -> Value {
        self.b.ins().iconst(I64, x)
    }

    pub fn f32(&mut self, x: f32) -> Value {
        self.b.ins().f32const(x)
    }

    /// `[x; 4]`, loaded from the constant pool (one instruction).
    pub fn f32x4(&mut self, x: f32) -> Value {
        self.vconst(F32X4, x.to_bits())
    }

    /// A 4 x 32-bit vector constant of type `ty` with every lane `bits`.
    pub fn vconst(&mut self, ty: Type, bits: u32) -> Value {
        self.vconst4(ty, [bits; 4])
    }

    /// A 4 x 32-bit vector constant of type `ty` with the given lanes.
    pub fn vconst4(&mut self, ty: Type, lanes: [u32; 4]) -> Value {
        let bytes: Vec<u8> = lanes.iter().flat_map(|b| b.to_le_bytes()).collect();
        let constant = self.b.func.dfg.constants.insert(bytes.into());
        self.b.ins().vconst(ty, constant)
    }

    pub fn load(&mut self, ty: Type, base: Value, offset: i32) -> Value {
        self.b.ins().load(ty, flags(), base, offset)
    }

    pub fn store(&mut self, value: Value, base: Value, offset: i32) {
        self.b.ins().store(flags(), value, base, offset);
    }

    /// `base + index * 4` (the address of f32 element `index`).
    pub fn elem(&mut self, base: Value, index: Value) -> Value {
        let bytes = self.b.ins().ishl_imm_s(index, 2);
        self.b.ins().iadd(base, bytes)
    }

    /// `base + index * scale * 4`.
    pub fn elem_scaled(&mut self, base: Value, index: Value, scale: Value) -> Value {
        let i = self.b.ins().imul(index, scale);
        self.elem(base, i)
    }

    /// `for i in (start..end).step_by(step) { body(i) }`, with `i` an i64.
    pub fn for_range(
        &mut self,
        start: Value,
        end: Value,
        step: i64,
        mut body: impl FnMut(&mut Self, Value),
    ) {
        let header = self.b.create_block();
        let body_block = self.b.create_block();
        let exit = self.b.create_block();
        self.b.append_block_param(header, I64);
        self.b.ins().jump(header, &[start.into()]);
        self.b.switch_to_block(header);
        let i = self.b.block_params(header)[0];
        // The exit is the branch's first target. Cranelift hoists loop-invariant code out of a
        // loop only if its dominator-tree walk reaches the body before the exit (leaving the
        // loop forgets it), and that walk is in reverse postorder, where a branch's first
        // target comes after its second. With the body first, nothing was hoisted.
        let done = self.b.ins().icmp(IntCC::SignedGreaterThanOrEqual, i, end);
        self.b.ins().brif(done, exit, &[], body_block, &[]);
        self.b.switch_to_block(body_block);
        self.b.seal_block(body_block);
        body(self, i);
        let next = self.b.ins().iadd_imm_s(i, step);
        self.b.ins().jump(header, &[next.into()]);
        self.b.seal_block(header);
        self.b.switch_to_block(exit);
        self.b.seal_block(exit);
    }

    /// `if cond { then() }` (cond: an i8 truth value).
    pub fn if_then(&mut self, cond: Value, then: impl FnOnce(&mut Self)) {
        let then_block = self.b.create_block();
        let join = self.b.create_block();
        self.b.ins().brif(cond, then_block, &[], join, &[]);
        self.b.switch_to_block(then_block);
        self.b.seal_block(then_block);
        then(self);
        self.b.ins().jump(join, &[]);
        self.b.switch_to_block(join);
        self.b.seal_block(join);
    }

    /// Two versions of the same code, `body(fx, true)` where `cond` holds and `body(fx, false)`
    /// where it does not (a masked and an unmasked version of a row's loop).
    pub fn versions(&mut self, cond: Value, mut body: impl FnMut(&mut Self, bool)) {
        let (when, otherwise, join) = (
            self.b.create_block(),
            self.b.create_block(),
            self.b.create_block(),
        );
        self.b.ins().brif(cond, when, &[], otherwise, &[]);
        for (block, holds) in [(when, true), (otherwise, false)] {
            self.b.switch_to_block(block);
            self.b.seal_block(block);
            body(self, holds);
            self.b.ins().jump(join, &[]);
        }
        self.b.switch_to_block(join);
        self.b.seal_block(join);
    }

    /// `if cond { then() } else { otherwise() }`.
    pub fn if_else(
        &mut self,
        cond: Value,
        then: impl FnOnce(&mut Self),
        otherwise: impl FnOnce(&mut Self),
    ) {
        let then_block = self.b.create_block();
        let else_block = self.b.create_block();
        let join = self.b.create_block();
        self.b.ins().brif(cond, then_block, &[], else_block, &[]);
        self.b.switch_to_block(then_block);
        self.b.seal_block(then_block);
        then(self);
        self.b.ins().jump(join, &[]);
        self.b.switch_to_block(else_block);
        self.b.seal_block(else_block);
        otherwise(self);
        self.b.ins().jump(join, &[]);
        self.b.switch_to_block(join);
        self.b.seal_block(join);
    }

    /// A vector from four scalars.
    pub fn gather4(&mut self, ty: Type, lanes: [Value; 4]) -> Value {
        let mut v = self.b.ins().scalar_to_vector(ty, lanes[0]);
        for (i, lane) in lanes.iter().enumerate().skip(1) {
            v = self.b.ins().insertlane(v, *lane, i as u8);
        }
        v
    }

    /// The four lanes of a vector.
    pub fn lanes(&mut self, v: Value) -> [Value; 4] {
        [0u8, 1, 2, 3].map(|i| self.b.ins().extractlane(v, i))
    }

    /// Lanes of two f32x4 vectors: lane `i` of the result is lane `lanes[i]` of `a` for values
    /// 0-3, of `b` for 4-7.
    fn shuffle2(&mut self, a: Value, b: Value, lanes: [u8; 4]) -> Value {
        let bytes: Vec<u8> = lanes
            .iter()
            .flat_map(|&lane| (0..4).map(move |byte| lane * 4 + byte))
            .collect();
        let mask = self.b.func.dfg.immediates.push(bytes.into());
        let little = MemFlagsData::new().with_endianness(Endianness::Little);
        let a8 = self.b.ins().bitcast(I8X16, little, a);
        let b8 = self.b.ins().bitcast(I8X16, little, b);
        let shuffled = self.b.ins().shuffle(a8, b8, mask);
        self.b.ins().bitcast(F32X4, little, shuffled)
    }

    /// The 4 x 4 transpose of four f32x4 rows (eight unpack instructions on x64).
    pub fn transpose4(&mut self, rows: [Value; 4]) -> [Value; 4] {
        let [a, b, c, d] = rows;
        let ab_lo = self.shuffle2(a, b, [0, 4, 1, 5]);
        let cd_lo = self.shuffle2(c, d, [0, 4, 1, 5]);
        let ab_hi = self.shuffle2(a, b, [2, 6, 3, 7]);
        let cd_hi = self.shuffle2(c, d, [2, 6, 3, 7]);
        [
            self.shuffle2(ab_lo, cd_lo, [0, 1, 4, 5]),
            self.shuffle2(ab_lo, cd_lo, [2, 3, 6, 7]),
            self.shuffle2(ab_hi, cd_hi, [0, 1, 4, 5]),
            self.shuffle2(ab_hi, cd_hi, [2, 3, 6, 7]),
        ]
    }

    /// The f32x4 `v` with its lanes permuted: lane `i` of the result is lane `order[i]` of `v`.
    fn permute(&mut self, v: Value, order: [u8; 4]) -> Value {
        self.shuffle2(v, v, order)
    }

    /// The largest lane (NaN-blind, like [`Fx::pmax4`]) or the sum of the lanes of an f32x4,
    /// by two shuffle steps.
    pub fn reduce(&mut self, v: Value, max: bool) -> Value {
        let mut acc = v;
        for order in [[2, 3, 0, 1], [1, 0, 3, 2]] {
            let other = self.permute(acc, order);
            acc = if max {
                self.pmax4(acc, other)
            } else {
                self.b.ins().fadd(acc, other)
            };
        }
        self.b.ins().extractlane(acc, 0)
    }

    /// `e^x` on f32x4: Cody-Waite range reduction to `r in [-ln2/2, ln2/2]`, a degree-6
    /// polynomial (Cephes expf, about 1 ulp), and `2^n` built in the exponent bits. `-inf` and
    /// everything below -87 give exactly 0; above 88.72, `+inf`.
    pub fn exp4(&mut self, x: Value) -> Value {
        let hi = self.f32x4(88.0);
        let clamped = self.pmin4(x, hi);
        let y = self.exp4_core(clamped);
        let over_limit = self.f32x4(88.72);
        let over = self.b.ins().fcmp(FloatCC::GreaterThan, x, over_limit);
        let over = self.b.ins().bitcast(F32X4, MemFlagsData::new(), over);
        let inf = self.f32x4(f32::INFINITY);
        self.b.ins().bitselect(over, inf, y)
    }

    /// `2^(2x)` on f32x4 for `x <= 0` or `-inf` (softmax probabilities, whose scores the kernel
    /// keeps in half base-2 units). `2x` is clamped to -127 and split as `n + r`,
    /// `n = round(2x)`, `r in [-1/2, 1/2]`, the doubling folded into the two FMAs that split it;
    /// `2^r` is `1 + r P(r)`, P of degree 5 (a relative minimax fit made for this kernel: 2e-9
    /// in exact arithmetic, under 1 ulp evaluated in f32); `2^n` is built in the exponent bits.
    /// At -127 those bits are all zero, so masked scores (`-inf`) give exactly 0 with no extra
    /// compare, while a NaN passes the clamp and gives NaN. 13 vector operations.
    pub fn exp2_of_double_4(&mut self, x: Value) -> Value {
        use super::abi::exp2::{LOWEST, MAGIC, P};
        let lo = self.f32x4(LOWEST);
        // `x < lo ? lo : x`: a NaN passes through, never the clamp's 0.
        let x = self.pmax4(lo, x);
        let magic = self.f32x4(MAGIC);
        let two = self.f32x4(2.0);
        let t = self.b.ins().fma(x, two, magic);
        let neg_n = self.b.ins().fsub(magic, t);
        // 2x - n, exact: 2x is, and it lies within 1/2 of the integer n.
        let r = self.b.ins().fma(x, two, neg_n);
        // P(r) by Estrin's scheme: three independent FMAs, then two.
        let c = P.map(|c| self.f32x4(c));
        let r2 = self.b.ins().fmul(r, r);
        let a = self.b.ins().fma(c[1], r, c[0]);
        let b = self.b.ins().fma(c[3], r, c[2]);
        let d = self.b.ins().fma(c[5], r, c[4]);
        let inner = self.b.ins().fma(r2, d, b);
        let p = self.b.ins().fma(r2, inner, a);
        let one = self.f32x4(1.0);
        let y = self.b.ins().fma(r, p, one);
        let t_bits = self.b.ins().bitcast(I32X4, MemFlagsData::new(), t);
        let e = self.b.ins().ishl_imm_s(t_bits, 23);
        let pow2 = self.b.ins().bitcast(F32X4, MemFlagsData::new(), e);
        self.b.ins().fmul(y, pow2)
    }

    /// `2^(2x)` for one f32 `x <= 0`, through [`Fx::exp2_of_double_4`].
    pub fn exp2_of_double_1(&mut self, x: Value) -> Value {
        let v = self.b.ins().splat(F32X4, x);
        let e = self.exp2_of_double_4(v);
        self.b.ins().extractlane(e, 0)
    }

    /// `e^x` for `x <= 88`; exactly 0 below -87 (so `-inf` gives 0).
    fn exp4_core(&mut self, x: Value) -> Value {
        const LOG2E: f32 = std::f32::consts::LOG2_E;
        const LN2_HI: f32 = 0.693_359_4;
        const LN2_LO: f32 = -2.121_944_4e-4;
        // 1.5 * 2^23: adding it rounds to an integer held in the low mantissa bits.
        const MAGIC: f32 = 12_582_912.0;
        const COEFFS: [f32; 6] = [
            1.987_569_1e-4,
            1.398_199_9e-3,
            8.333_452e-3,
            4.166_579_6e-2,
            1.666_666_5e-1,
            0.5,
        ];
        let lo = self.f32x4(-87.0);
        let kept = self.b.ins().fcmp(FloatCC::GreaterThanOrEqual, x, lo);
        let x = self.pmax4(x, lo);
        let log2e = self.f32x4(LOG2E);
        let magic = self.f32x4(MAGIC);
        let t = self.b.ins().fma(x, log2e, magic);
        let n = self.b.ins().fsub(t, magic);
        let ln2_hi = self.f32x4(-LN2_HI);
        let ln2_lo = self.f32x4(-LN2_LO);
        let r = self.b.ins().fma(n, ln2_hi, x);
        let r = self.b.ins().fma(n, ln2_lo, r);
        // p(r) = sum COEFFS[5 - i] r^i by Estrin's scheme: three dependent FMAs instead of
        // five, so consecutive groups overlap in the pipeline.
        let c = COEFFS.map(|c| self.f32x4(c));
        let r2 = self.b.ins().fmul(r, r);
        let t0 = self.b.ins().fma(c[4], r, c[5]);
        let t1 = self.b.ins().fma(c[2], r, c[3]);
        let t2 = self.b.ins().fma(c[0], r, c[1]);
        let inner = self.b.ins().fma(r2, t2, t1);
        let p = self.b.ins().fma(r2, inner, t0);
        let one = self.f32x4(1.0);
        let r1 = self.b.ins().fadd(r, one);
        let y = self.b.ins().fma(p, r2, r1);
        // 2^n: the integer n sits in t's low bits; (bits(t) - bits(MAGIC) + 127) << 23.
        let t_bits = self.b.ins().bitcast(I32X4, MemFlagsData::new(), t);
        let bias = self.vconst(I32X4, 127u32.wrapping_sub(MAGIC.to_bits()));
        let e = self.b.ins().iadd(t_bits, bias);
        let e = self.b.ins().ishl_imm_s(e, 23);
        let pow2 = self.b.ins().bitcast(F32X4, MemFlagsData::new(), e);
        let result = self.b.ins().fmul(y, pow2);
        let kept = self.b.ins().bitcast(F32X4, MemFlagsData::new(), kept);
        self.b.ins().band(result, kept)
    }

    /// `x < y ? x : y` on f32x4 (one `minps`; NaN-blind, unlike Cranelift's `fmin`).
    pub fn pmin4(&mut self, x: Value, y: Value) -> Value {
        let lt = self.b.ins().fcmp(FloatCC::LessThan, x, y);
        let lt = self.b.ins().bitcast(F32X4, MemFlagsData::new(), lt);
        self.b.ins().bitselect(lt, x, y)
    }

    /// `y < x ? x : y` on f32x4 (one `maxps`).
    pub fn pmax4(&mut self, x: Value, y: Value) -> Value {
        let lt = self.b.ins().fcmp(FloatCC::LessThan, y, x);
        let lt = self.b.ins().bitcast(F32X4, MemFlagsData::new(), lt);
        self.b.ins().bitselect(lt, x, y)
    }

    /// `e^x` for one f32, through [`Fx::exp4`].
    pub fn exp1(&mut self, x: Value) -> Value {
        let v = self.b.ins().splat(F32X4, x);
        let e = self.exp4(v);
        self.b.ins().extractlane(e, 0)
    }

    /// `tanh x` on f32x4 as `x P(x^2) / Q(x^2)` on `x` clamped to [-9, 9] (where tanh is 1 to
    /// f32 precision), P and Q of degree 4: a rational fit made for this kernel (Lawson-weighted
    /// least squares; 2e-8 in exact arithmetic, 3.4e-7 absolute when evaluated in f32).
    pub fn tanh4(&mut self, x: Value) -> Value {
        self.tanh4_scaled(x, 1.0)
    }

    /// `c tanh x` on f32x4, as [`Fx::tanh4`] with `c` folded into the numerator's coefficients
    /// (one multiply fewer than scaling the result).
    pub fn tanh4_scaled(&mut self, x: Value, c: f32) -> Value {
        const P: [f64; 5] = [
            0.999_999_9,
            0.133_731_9,
            0.003_486_573,
            2.047_168_2e-5,
            1.318_401_5e-8,
        ];
        const Q: [f64; 5] = [1.0, 0.467_064_9, 0.025_841_946, 3.271_370_7e-4, 7.702_58e-7];
        // Both divided by Q's leading coefficient: Q's Horner scheme then starts with an add,
        // and one constant fewer is live in the loop.
        let lead = Q[4];
        let p = P.map(|p| (p * f64::from(c) / lead) as f32);
        let q = Q.map(|q| (q / lead) as f32);
        let hi = self.f32x4(9.0);
        let lo = self.f32x4(-9.0);
        let x = self.pmin4(x, hi);
        let x = self.pmax4(x, lo);
        let z = self.b.ins().fmul(x, x);
        let mut num = self.f32x4(p[4]);
        for k in (0..4).rev() {
            let ck = self.f32x4(p[k]);
            num = self.b.ins().fma(num, z, ck);
        }
        let q3 = self.f32x4(q[3]);
        let mut den = self.b.ins().fadd(z, q3);
        for k in (0..3).rev() {
            let ck = self.f32x4(q[k]);
            den = self.b.ins().fma(den, z, ck);
        }
        let xp = self.b.ins().fmul(x, num);
        self.b.ins().fdiv(xp, den)
    }

    /// An f32 scalar splatted.
    pub fn splat_f32(&mut self, x: Value) -> Value {
        debug_assert_eq!(self.b.func.dfg.value_type(x), F32);
        self.b.ins().splat(F32X4, x)
    }
}
