//! GPU IR expressions lowered to LLVM values: registers, parameters, specials, loads (16-bit
//! halves and constant tables included), unary and binary operations, shuffles and casts.

use super::{Lowering, basic, err};
use crate::error::CodegenError;
use crate::gpu::ir::{Bin, Expr, Half, Space, Special, Ty, Un};
use inkwell::module::Linkage;
use inkwell::values::{BasicValue, BasicValueEnum, IntValue, PointerValue};
use inkwell::{AddressSpace, FloatPredicate, IntPredicate};

impl<'ctx> Lowering<'_, 'ctx> {
    pub(super) fn expr(&mut self, e: &Expr) -> Result<BasicValueEnum<'ctx>, CodegenError> {
        let ctx = self.ctx;
        let f32t = ctx.f32_type();
        Ok(match e {
            Expr::Int(x, t) => match t {
                Ty::I32 => ctx.i32_type().const_int(*x as u64, true).into(),
                _ => ctx.i64_type().const_int(*x as u64, true).into(),
            },
            Expr::F32(x) => f32t.const_float(f64::from(*x)).into(),
            Expr::Pred(p) => ctx.bool_type().const_int(u64::from(*p), false).into(),
            Expr::Reg(r) => {
                let t = basic(ctx, self.kernel.regs[r.0 as usize].1);
                self.b
                    .build_load(t, self.regs[r.0 as usize], "r")
                    .map_err(err)?
            }
            Expr::Param(i) => self
                .function
                .get_nth_param(*i)
                .ok_or_else(|| err(format!("no parameter {i}")))?,
            Expr::Special(s) => {
                let name = match s {
                    Special::Tid => "llvm.nvvm.read.ptx.sreg.tid.x",
                    Special::Ntid => "llvm.nvvm.read.ptx.sreg.ntid.x",
                    Special::Ctaid(0) => "llvm.nvvm.read.ptx.sreg.ctaid.x",
                    Special::Ctaid(1) => "llvm.nvvm.read.ptx.sreg.ctaid.y",
                    Special::Ctaid(_) => "llvm.nvvm.read.ptx.sreg.ctaid.z",
                    Special::Lane => "llvm.nvvm.read.ptx.sreg.laneid",
                };
                self.intrinsic(name, &[], &[])?
            }
            Expr::Un(op, a) => {
                let ty = self.kernel.type_of(a);
                let v = self.expr(a)?;
                self.unary(*op, ty, v)?
            }
            Expr::Bin(op, a, b) => {
                let ty = self.kernel.type_of(a);
                let (x, y) = (self.expr(a)?, self.expr(b)?);
                self.binary(*op, ty, x, y)?
            }
            Expr::Fma(a, b, c) => {
                let (x, y, z) = (self.expr(a)?, self.expr(b)?, self.expr(c)?);
                self.intrinsic("llvm.fma", &[f32t.into()], &[x, y, z])?
            }
            Expr::Select(c, a, b) => {
                let c = self.expr(c)?.into_int_value();
                let (x, y) = (self.expr(a)?, self.expr(b)?);
                self.b.build_select(c, x, y, "sel").map_err(err)?
            }
            Expr::Cast(a, to) => {
                let from = self.kernel.type_of(a);
                let v = self.expr(a)?;
                self.cast(v, from, *to)?
            }
            Expr::Load(space, ty, addr) => {
                let a = self.expr(addr)?;
                let p = self.pointer(*space, a)?;
                self.b.build_load(basic(ctx, *ty), p, "ld").map_err(err)?
            }
            Expr::LoadHalf(space, half, addr) => {
                let a = self.expr(addr)?;
                let p = self.pointer(*space, a)?;
                self.load_half(*half, p)?
            }
            Expr::Table(values, index) => {
                let i = self.expr(index)?.into_int_value();
                self.table(values, i)?
            }
            Expr::SharedAddress(a) => self.shared_address(a)?,
            Expr::PackHalf(h, lo, hi) => {
                let (lo, hi) = (self.expr(lo)?, self.expr(hi)?);
                // cvt.rn.{bf16,f16}x2.f32 puts its first operand in the upper half.
                let name = match h {
                    Half::Bf16 => "llvm.nvvm.ff2bf16x2.rn",
                    Half::F16 => "llvm.nvvm.ff2f16x2.rn",
                };
                let pair = self.intrinsic(name, &[], &[hi, lo])?;
                self.b
                    .build_bit_cast(pair, ctx.i32_type(), "x2")
                    .map_err(err)?
            }
            Expr::ShflXor(v, mask) => {
                let ty = self.kernel.type_of(v);
                let v = self.expr(v)?;
                self.shuffle_xor(ty, v, *mask)?
            }
        })
    }

    /// A unary operation on `v` (of type `ty`).
    fn unary(
        &mut self,
        op: Un,
        ty: Ty,
        v: BasicValueEnum<'ctx>,
    ) -> Result<BasicValueEnum<'ctx>, CodegenError> {
        let (ctx, f32t) = (self.ctx, self.ctx.f32_type());
        Ok(match (op, ty) {
            (Un::Not, _) => self
                .b
                .build_not(v.into_int_value(), "not")
                .map_err(err)?
                .into(),
            (Un::Neg, Ty::F32) => self
                .b
                .build_float_neg(v.into_float_value(), "neg")
                .map_err(err)?
                .into(),
            (Un::Neg, _) => self
                .b
                .build_int_neg(v.into_int_value(), "neg")
                .map_err(err)?
                .into(),
            (Un::Abs, Ty::F32) => self.intrinsic("llvm.fabs", &[f32t.into()], &[v])?,
            (Un::Abs, t) => {
                let poison = ctx.bool_type().const_int(0, false).into();
                self.intrinsic("llvm.abs", &[basic(ctx, t)], &[v, poison])?
            }
            (Un::Ex2, _) => self.intrinsic("llvm.nvvm.ex2.approx.f", &[], &[v])?,
            (Un::Ex2Ftz, _) => self.intrinsic("llvm.nvvm.ex2.approx.ftz.f", &[], &[v])?,
            (Un::Lg2, _) => self.intrinsic("llvm.nvvm.lg2.approx.f", &[], &[v])?,
            (Un::Sqrt, _) => self.intrinsic("llvm.sqrt", &[f32t.into()], &[v])?,
        })
    }

    /// A 16-bit value at `p`, widened to f32.
    fn load_half(
        &mut self,
        half: Half,
        p: PointerValue<'ctx>,
    ) -> Result<BasicValueEnum<'ctx>, CodegenError> {
        let (ctx, f32t) = (self.ctx, self.ctx.f32_type());
        match half {
            Half::F16 => {
                let h = self
                    .b
                    .build_load(ctx.f16_type(), p, "f16")
                    .map_err(err)?
                    .into_float_value();
                Ok(self.b.build_float_ext(h, f32t, "f16f").map_err(err)?.into())
            }
            Half::Bf16 => {
                // bf16 bits are the upper half of the f32 they widen to.
                let bits = self
                    .b
                    .build_load(ctx.i16_type(), p, "bf16")
                    .map_err(err)?
                    .into_int_value();
                let wide = self
                    .b
                    .build_int_z_extend(bits, ctx.i32_type(), "bf16w")
                    .map_err(err)?;
                let shifted = self
                    .b
                    .build_left_shift(wide, ctx.i32_type().const_int(16, false), "bf16s")
                    .map_err(err)?;
                self.b.build_bit_cast(shifted, f32t, "bf16f").map_err(err)
            }
        }
    }

    /// Entry `i` (clamped into the table) of a constant table.
    fn table(
        &mut self,
        values: &[f32],
        i: IntValue<'ctx>,
    ) -> Result<BasicValueEnum<'ctx>, CodegenError> {
        let (ctx, f32t) = (self.ctx, self.ctx.f32_type());
        let i64t = ctx.i64_type();
        let hi = i64t.const_int(values.len() as u64 - 1, false);
        let zero = i64t.const_zero();
        let i = self
            .b
            .build_int_s_extend_or_bit_cast(i, i64t, "ix")
            .map_err(err)?;
        let lo_ok = self
            .b
            .build_int_compare(IntPredicate::SLT, i, zero, "neg")
            .map_err(err)?;
        let i = self
            .b
            .build_select(lo_ok, zero, i, "ix0")
            .map_err(err)?
            .into_int_value();
        let hi_ok = self
            .b
            .build_int_compare(IntPredicate::SGT, i, hi, "big")
            .map_err(err)?;
        let i = self
            .b
            .build_select(hi_ok, hi, i, "ix1")
            .map_err(err)?
            .into_int_value();
        // One constant global per distinct table, its loads marked invariant: the loads of one
        // table at one index merge (ALiBi's slope, once per tile rather than once per score).
        let key: Vec<u32> = values.iter().map(|v| v.to_bits()).collect();
        let next = self.tables.len();
        let g = *self.tables.entry(key).or_insert_with(|| {
            let consts: Vec<_> = values
                .iter()
                .map(|v| f32t.const_float(f64::from(*v)))
                .collect();
            let array = f32t.const_array(&consts);
            let g = self.module.add_global(
                array.get_type(),
                Some(AddressSpace::from(1u16)),
                &format!("table{next}"),
            );
            g.set_linkage(Linkage::Internal);
            g.set_constant(true);
            g.set_initializer(&array);
            g
        });
        let base = self
            .b
            .build_ptr_to_int(g.as_pointer_value(), i64t, "tbase")
            .map_err(err)?;
        let off = self
            .b
            .build_int_mul(i, i64t.const_int(4, false), "toff")
            .map_err(err)?;
        let a = self.b.build_int_add(base, off, "taddr").map_err(err)?;
        let p = self.pointer(Space::Global, a.into())?;
        let value = self.b.build_load(f32t, p, "tv").map_err(err)?;
        if let Some(load) = value.as_instruction_value() {
            let kind = ctx.get_kind_id("invariant.load");
            load.set_metadata(ctx.metadata_node(&[]), kind)
                .map_err(|e| err(format!("invariant.load metadata: {e:?}")))?;
        }
        Ok(value)
    }

    /// `v` (of type `ty`) from lane `lane ^ mask` of the warp.
    fn shuffle_xor(
        &mut self,
        ty: Ty,
        v: BasicValueEnum<'ctx>,
        mask: u32,
    ) -> Result<BasicValueEnum<'ctx>, CodegenError> {
        let i32t = self.ctx.i32_type();
        let args = [
            i32t.const_int(0xffff_ffff, false).into(),
            v,
            i32t.const_int(u64::from(mask), false).into(),
            i32t.const_int(0x1f, false).into(),
        ];
        let name = if ty == Ty::F32 {
            "llvm.nvvm.shfl.sync.bfly.f32"
        } else {
            "llvm.nvvm.shfl.sync.bfly.i32"
        };
        self.intrinsic(name, &[], &args)
    }

    fn binary(
        &mut self,
        op: Bin,
        ty: Ty,
        x: BasicValueEnum<'ctx>,
        y: BasicValueEnum<'ctx>,
    ) -> Result<BasicValueEnum<'ctx>, CodegenError> {
        let b = &self.b;
        if ty == Ty::F32 {
            let (x, y) = (x.into_float_value(), y.into_float_value());
            let cmp = |p| {
                b.build_float_compare(p, x, y, "fc")
                    .map(Into::into)
                    .map_err(err)
            };
            return match op {
                Bin::Add => b.build_float_add(x, y, "fa").map(Into::into).map_err(err),
                Bin::Sub => b.build_float_sub(x, y, "fs").map(Into::into).map_err(err),
                Bin::Mul => b.build_float_mul(x, y, "fm").map(Into::into).map_err(err),
                Bin::Div => b.build_float_div(x, y, "fd").map(Into::into).map_err(err),
                Bin::Rem => b.build_float_rem(x, y, "fr").map(Into::into).map_err(err),
                Bin::Min => {
                    self.intrinsic("llvm.minnum", &[x.get_type().into()], &[x.into(), y.into()])
                }
                Bin::Max => {
                    self.intrinsic("llvm.maxnum", &[x.get_type().into()], &[x.into(), y.into()])
                }
                Bin::Lt => cmp(FloatPredicate::OLT),
                Bin::Le => cmp(FloatPredicate::OLE),
                Bin::Gt => cmp(FloatPredicate::OGT),
                Bin::Ge => cmp(FloatPredicate::OGE),
                Bin::Eq => cmp(FloatPredicate::OEQ),
                Bin::Ne => cmp(FloatPredicate::UNE),
                Bin::And | Bin::Or | Bin::Shl => Err(err(format!("{op:?} on f32"))),
            };
        }
        let (x, y) = (x.into_int_value(), y.into_int_value());
        let cmp = |p| b.build_int_compare(p, x, y, "ic").map_err(err);
        Ok(match op {
            Bin::Add => b.build_int_add(x, y, "a").map_err(err)?.into(),
            Bin::Sub => b.build_int_sub(x, y, "s").map_err(err)?.into(),
            Bin::Mul => b.build_int_mul(x, y, "m").map_err(err)?.into(),
            Bin::Div => b.build_int_signed_div(x, y, "d").map_err(err)?.into(),
            Bin::Rem => b.build_int_signed_rem(x, y, "r").map_err(err)?.into(),
            Bin::Min => b
                .build_select(cmp(IntPredicate::SLT)?, x, y, "min")
                .map_err(err)?,
            Bin::Max => b
                .build_select(cmp(IntPredicate::SGT)?, x, y, "max")
                .map_err(err)?,
            Bin::And => b.build_and(x, y, "and").map_err(err)?.into(),
            Bin::Or => b.build_or(x, y, "or").map_err(err)?.into(),
            Bin::Shl => b.build_left_shift(x, y, "shl").map_err(err)?.into(),
            Bin::Lt => cmp(IntPredicate::SLT)?.into(),
            Bin::Le => cmp(IntPredicate::SLE)?.into(),
            Bin::Gt => cmp(IntPredicate::SGT)?.into(),
            Bin::Ge => cmp(IntPredicate::SGE)?.into(),
            Bin::Eq => cmp(IntPredicate::EQ)?.into(),
            Bin::Ne => cmp(IntPredicate::NE)?.into(),
        })
    }

    fn cast(
        &mut self,
        v: BasicValueEnum<'ctx>,
        from: Ty,
        to: Ty,
    ) -> Result<BasicValueEnum<'ctx>, CodegenError> {
        let target = basic(self.ctx, to);
        let b = &self.b;
        Ok(match (from, to) {
            (a, c) if a == c => v,
            (Ty::Pred, _) => b
                .build_int_z_extend(v.into_int_value(), target.into_int_type(), "zext")
                .map_err(err)?
                .into(),
            (Ty::I32, Ty::I64) => b
                .build_int_s_extend(v.into_int_value(), target.into_int_type(), "sext")
                .map_err(err)?
                .into(),
            (Ty::I64, Ty::I32) => b
                .build_int_truncate(v.into_int_value(), target.into_int_type(), "trunc")
                .map_err(err)?
                .into(),
            (Ty::I32 | Ty::I64, Ty::F32) => b
                .build_signed_int_to_float(v.into_int_value(), target.into_float_type(), "itof")
                .map_err(err)?
                .into(),
            (Ty::F32, Ty::I32 | Ty::I64) => {
                // Saturating, NaN to 0: the interpreter's (and Rust's) conversion.
                self.intrinsic(
                    "llvm.fptosi.sat",
                    &[target, self.ctx.f32_type().into()],
                    &[v],
                )?
            }
            (a, c) => return Err(err(format!("no conversion from {a} to {c}"))),
        })
    }
}
