//! Hopper's asynchronous operations as inline PTX: LLVM 19 has no intrinsics for `wgmma`, TMA
//! tensor copies or the mbarrier `expect_tx` and parity-wait forms. Each IR statement is one
//! asm block, so that a `wgmma` sequence (fence, products, commit) cannot be split by the
//! compiler, and the accumulators of products in flight pass through the blocks that wait for
//! them (no access to them moves across a wait).

use super::{Lowering, err};
use crate::error::CodegenError;
use crate::gpu::ir::{Expr, Half, Reg, Space, Wgmma, WgmmaA};
use inkwell::types::{BasicMetadataTypeEnum, BasicTypeEnum};
use inkwell::values::{BasicMetadataValueEnum, BasicValueEnum, IntValue};

/// Operands of an asm block: values and their constraint letters.
#[derive(Default)]
struct Operands<'ctx> {
    values: Vec<BasicMetadataValueEnum<'ctx>>,
    constraints: Vec<String>,
}

impl<'ctx> Operands<'ctx> {
    /// Adds an input; returns its `$n` (after `outputs` outputs).
    fn push(&mut self, outputs: usize, value: BasicValueEnum<'ctx>, letter: &str) -> String {
        self.values.push(value.into());
        self.constraints.push(letter.to_string());
        format!("${}", outputs + self.values.len() - 1)
    }
}

impl<'ctx> Lowering<'_, 'ctx> {
    /// An asm block with side effects: `outputs` F32 results (tied to the first `outputs`
    /// inputs when `tied`), then the inputs. Returns the results.
    fn asm(
        &self,
        text: &str,
        outputs: usize,
        operands: Operands<'ctx>,
    ) -> Result<Vec<BasicValueEnum<'ctx>>, CodegenError> {
        let f32t = self.ctx.f32_type();
        let inputs: Vec<BasicMetadataTypeEnum> = operands
            .values
            .iter()
            .map(|v| match v {
                BasicMetadataValueEnum::IntValue(i) => i.get_type().into(),
                BasicMetadataValueEnum::FloatValue(f) => f.get_type().into(),
                _ => f32t.into(),
            })
            .collect();
        let results: Vec<BasicTypeEnum> = vec![f32t.into(); outputs];
        let ty = match outputs {
            0 => self.ctx.void_type().fn_type(&inputs, false),
            1 => f32t.fn_type(&inputs, false),
            _ => self
                .ctx
                .struct_type(&results, false)
                .fn_type(&inputs, false),
        };
        let mut constraints: Vec<String> = (0..outputs).map(|_| "=f".to_string()).collect();
        constraints.extend(operands.constraints);
        constraints.push("~{memory}".into());
        let asm = self.ctx.create_inline_asm(
            ty,
            text.to_string(),
            constraints.join(","),
            true,
            false,
            None,
            false,
        );
        let call = self
            .b
            .build_indirect_call(ty, asm, &operands.values, "asm")
            .map_err(err)?;
        let value = call.try_as_basic_value().basic();
        Ok(match (outputs, value) {
            (0, _) | (_, None) => Vec::new(),
            (1, Some(v)) => vec![v],
            (_, Some(v)) => (0..outputs as u32)
                .map(|i| {
                    self.b
                        .build_extract_value(v.into_struct_value(), i, "out")
                        .map_err(err)
                })
                .collect::<Result<_, _>>()?,
        })
    }

    /// The 32-bit shared-window address of a shared byte offset.
    fn shared32(&mut self, offset: &Expr) -> Result<IntValue<'ctx>, CodegenError> {
        let offset = self.expr(offset)?;
        let ptr = self.pointer(Space::Shared, offset)?;
        self.b
            .build_ptr_to_int(ptr, self.ctx.i32_type(), "saddr32")
            .map_err(err)
    }

    /// The shared-window address (I64) of a shared byte offset.
    pub(super) fn shared_address(
        &mut self,
        offset: &Expr,
    ) -> Result<BasicValueEnum<'ctx>, CodegenError> {
        let offset = self.expr(offset)?;
        let ptr = self.pointer(Space::Shared, offset)?;
        Ok(self
            .b
            .build_ptr_to_int(ptr, self.ctx.i64_type(), "saddr")
            .map_err(err)?
            .into())
    }

    fn store_results(
        &self,
        regs: &[Reg],
        values: Vec<BasicValueEnum<'ctx>>,
    ) -> Result<(), CodegenError> {
        for (r, v) in regs.iter().zip(values) {
            self.b
                .build_store(self.regs[r.0 as usize], v)
                .map_err(err)?;
        }
        Ok(())
    }

    pub(super) fn mbar_init(&mut self, bar: &Expr, count: u32) -> Result<(), CodegenError> {
        let mut ops = Operands::default();
        let bar = self.shared32(bar)?;
        let bar = ops.push(0, bar.into(), "r");
        let text = format!(
            "mbarrier.init.shared::cta.b64 [{bar}], {count};\n\tfence.mbarrier_init.release.cluster;"
        );
        self.asm(&text, 0, ops).map(drop)
    }

    pub(super) fn mbar_arrive(
        &mut self,
        bar: &Expr,
        tx: Option<&Expr>,
    ) -> Result<(), CodegenError> {
        let mut ops = Operands::default();
        let bar = self.shared32(bar)?;
        let bar = ops.push(0, bar.into(), "r");
        let text = match tx {
            None => format!("mbarrier.arrive.shared::cta.b64 _, [{bar}];"),
            Some(tx) => {
                let tx = self.expr(tx)?;
                let tx = ops.push(0, tx, "r");
                format!("mbarrier.arrive.expect_tx.shared::cta.b64 _, [{bar}], {tx};")
            }
        };
        self.asm(&text, 0, ops).map(drop)
    }

    pub(super) fn mbar_wait(&mut self, bar: &Expr, parity: &Expr) -> Result<(), CodegenError> {
        let mut ops = Operands::default();
        let bar = self.shared32(bar)?;
        let bar = ops.push(0, bar.into(), "r");
        let parity = self.expr(parity)?;
        let parity = ops.push(0, parity, "r");
        // Labels inside a `{ }` block are local to it.
        let text = format!(
            "{{\n\t.reg .pred done;\n\twait:\n\tmbarrier.try_wait.parity.shared::cta.b64 done, \
             [{bar}], {parity};\n\t@!done bra wait;\n\t}}"
        );
        self.asm(&text, 0, ops).map(drop)
    }

    pub(super) fn tma_load(
        &mut self,
        dst: &Expr,
        map: u32,
        coords: &[Expr],
        bar: &Expr,
    ) -> Result<(), CodegenError> {
        let mut ops = Operands::default();
        let dst = self.shared32(dst)?;
        let dst = ops.push(0, dst.into(), "r");
        // The tensor map's generic address (a `__grid_constant__` parameter's).
        let param = self
            .function
            .get_nth_param(map)
            .ok_or_else(|| err(format!("no parameter {map}")))?
            .into_pointer_value();
        let map_addr = self
            .b
            .build_ptr_to_int(param, self.ctx.i64_type(), "tmap")
            .map_err(err)?;
        let map_op = ops.push(0, map_addr.into(), "l");
        let mut cs = Vec::new();
        for c in coords {
            let v = self.expr(c)?;
            cs.push(ops.push(0, v, "r"));
        }
        let bar = self.shared32(bar)?;
        let bar = ops.push(0, bar.into(), "r");
        let text = format!(
            "cp.async.bulk.tensor.{}d.shared::cluster.global.tile.mbarrier::complete_tx::bytes \
             [{dst}], [{map_op}, {{{}}}], [{bar}];",
            coords.len(),
            cs.join(", ")
        );
        self.asm(&text, 0, ops).map(drop)
    }

    pub(super) fn plain(&mut self, text: &str) -> Result<(), CodegenError> {
        self.asm(text, 0, Operands::default()).map(drop)
    }

    pub(super) fn wgmma(&mut self, w: &Wgmma) -> Result<(), CodegenError> {
        let outputs = w.d.len();
        let mut ops = Operands::default();
        // The accumulators in, tied to the outputs.
        for (i, r) in w.d.iter().enumerate() {
            let v = self.expr(&Expr::Reg(*r))?;
            ops.push(outputs, v, &i.to_string());
        }
        let accumulate = self.expr(&w.accumulate)?.into_int_value();
        let accumulate = self
            .b
            .build_int_z_extend(accumulate, self.ctx.i32_type(), "acc")
            .map_err(err)?;
        let accumulate = ops.push(outputs, accumulate.into(), "r");
        let one = ops.push(outputs, self.ctx.i32_type().const_int(1, false).into(), "r");
        let half = match w.half {
            Half::Bf16 => "bf16",
            Half::F16 => "f16",
        };
        let d: Vec<String> = (0..outputs).map(|i| format!("${i}")).collect();
        let d = d.join(", ");
        let trans_b = u32::from(w.b_n_major);
        let mut text = format!(
            "{{\n\t.reg .pred first, rest;\n\tsetp.ne.b32 first, {accumulate}, 0;\n\t\
             setp.ne.b32 rest, {one}, 0;\n\twgmma.fence.sync.aligned;\n"
        );
        for (i, (a, b)) in w.steps.iter().enumerate() {
            let scale = if i == 0 { "first" } else { "rest" };
            let b = self.expr(b)?;
            let b = ops.push(outputs, b, "l");
            let op = format!(
                "wgmma.mma_async.sync.aligned.m64n{}k16.f32.{half}.{half}",
                w.n
            );
            match a {
                WgmmaA::Shared(desc) => {
                    let desc = self.expr(desc)?;
                    let desc = ops.push(outputs, desc, "l");
                    text.push_str(&format!(
                        "\t{op} {{{d}}}, {desc}, {b}, {scale}, 1, 1, 0, {trans_b};\n"
                    ));
                }
                WgmmaA::Regs(regs) => {
                    let mut names = Vec::new();
                    for r in regs {
                        let v = self.expr(&Expr::Reg(*r))?;
                        names.push(ops.push(outputs, v, "r"));
                    }
                    text.push_str(&format!(
                        "\t{op} {{{d}}}, {{{}}}, {b}, {scale}, 1, 1, {trans_b};\n",
                        names.join(", ")
                    ));
                }
            }
        }
        text.push_str("\twgmma.commit_group.sync.aligned;\n\t}");
        let results = self.asm(&text, outputs, ops)?;
        self.store_results(&w.d, results)
    }

    pub(super) fn named_barrier(
        &mut self,
        id: &Expr,
        threads: u32,
        wait: bool,
    ) -> Result<(), CodegenError> {
        let mut ops = Operands::default();
        let id = self.expr(id)?;
        let id = ops.push(0, id, "r");
        let op = if wait { "bar.sync" } else { "bar.arrive" };
        self.asm(&format!("{op} {id}, {threads};"), 0, ops)
            .map(drop)
    }

    pub(super) fn wgmma_wait(&mut self, groups: u32, regs: &[Reg]) -> Result<(), CodegenError> {
        let outputs = regs.len();
        let mut ops = Operands::default();
        for (i, r) in regs.iter().enumerate() {
            let v = self.expr(&Expr::Reg(*r))?;
            ops.push(outputs, v, &i.to_string());
        }
        let results = self.asm(
            &format!("wgmma.wait_group.sync.aligned {groups};"),
            outputs,
            ops,
        )?;
        self.store_results(regs, results)
    }
}
