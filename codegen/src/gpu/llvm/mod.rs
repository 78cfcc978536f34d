//! GPU IR to LLVM IR and PTX through LLVM's NVPTX backend (feature `llvm`, LLVM 19).
//!
//! A direct translation: each register is an `alloca` (promoted by `mem2reg` in the O3
//! pipeline), each operation its PTX counterpart (`llvm.nvvm.ex2.approx.f`, `lg2.approx`,
//! `shfl.sync.bfly`, `barrier0`, `fma`, `minnum`/`maxnum`, saturating `fptosi`), global and
//! shared memory in address spaces 1 and 3, structured control flow as basic blocks. The kernel
//! uses the PTX kernel calling convention. Hopper's asynchronous operations are inline PTX
//! ([`asm`]); tensor maps are `byval` parameters marked `grid_constant`, whose generic address
//! TMA copies take. Statements are lowered here, expressions in `expr.rs`.

mod asm;
mod expr;

use super::ir::{Expr, Half, Kernel, Reg, Space, Stmt, Ty};
use crate::error::CodegenError;
use inkwell::attributes::{Attribute, AttributeLoc};
use inkwell::builder::Builder;
use inkwell::context::Context;
use inkwell::intrinsics::Intrinsic;
use inkwell::module::{Linkage, Module};
use inkwell::passes::PassBuilderOptions;
use inkwell::targets::{
    CodeModel, FileType, InitializationConfig, RelocMode, Target, TargetTriple,
};
use inkwell::types::AnyType;
use inkwell::types::BasicTypeEnum;
use inkwell::values::{
    BasicMetadataValueEnum, BasicValueEnum, FunctionValue, GlobalValue, PointerValue,
};
use inkwell::{AddressSpace, IntPredicate, OptimizationLevel};
use std::collections::HashMap;

pub use super::ir::target::{Arch, STATIC_SHARED_LIMIT, dynamic_shared_bytes};

/// A kernel compiled for a GPU architecture.
#[derive(Clone, Debug)]
pub struct Emitted {
    /// The optimized LLVM IR.
    pub llvm_ir: String,
    /// The PTX assembly.
    pub ptx: String,
}

/// The PTX kernel calling convention (`ptx_kernel`).
const PTX_KERNEL: u32 = 71;

fn err(what: impl std::fmt::Display) -> CodegenError {
    CodegenError::Llvm(what.to_string())
}

/// Stack for the thread LLVM compiles on: its passes recurse along expression trees, and a score
/// program at the spec language's depth limit needs about 4 MiB in a debug build, more than a
/// spawned thread has by default (2 MiB).
const LLVM_STACK_BYTES: usize = 64 << 20;

/// Compiles a kernel to LLVM IR and PTX for `arch`, on a thread of its own with a stack sized
/// for the deepest program a spec may hold.
pub fn emit(kernel: &Kernel, arch: Arch) -> Result<Emitted, CodegenError> {
    std::thread::scope(|scope| {
        let worker = std::thread::Builder::new()
            .name("attn-llvm".into())
            .stack_size(LLVM_STACK_BYTES)
            .spawn_scoped(scope, || emit_here(kernel, arch))
            .map_err(|e| err(format!("cannot start the LLVM thread: {e}")))?;
        worker
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic))
    })
}

fn emit_here(kernel: &Kernel, arch: Arch) -> Result<Emitted, CodegenError> {
    Target::initialize_nvptx(&InitializationConfig::default());
    let triple = TargetTriple::create("nvptx64-nvidia-cuda");
    let target = Target::from_triple(&triple).map_err(err)?;
    let machine = target
        .create_target_machine(
            &triple,
            arch.name(),
            "+ptx80",
            OptimizationLevel::Aggressive,
            RelocMode::Default,
            CodeModel::Default,
        )
        .ok_or_else(|| err(format!("no NVPTX target machine for {}", arch.name())))?;
    let context = Context::create();
    let module = context.create_module(&kernel.name);
    module.set_triple(&triple);
    module.set_data_layout(&machine.get_target_data().get_data_layout());
    lower(&context, &module, kernel)?;
    module
        .verify()
        .map_err(|e| err(format!("LLVM rejected the module: {e}")))?;
    module
        .run_passes("default<O3>", &machine, PassBuilderOptions::create())
        .map_err(err)?;
    let ptx = machine
        .write_to_memory_buffer(&module, FileType::Assembly)
        .map_err(err)?;
    Ok(Emitted {
        llvm_ir: module.print_to_string().to_string(),
        ptx: String::from_utf8_lossy(ptx.as_slice()).into_owned(),
    })
}

struct Lowering<'a, 'ctx> {
    ctx: &'ctx Context,
    module: &'a Module<'ctx>,
    b: Builder<'ctx>,
    kernel: &'a Kernel,
    function: FunctionValue<'ctx>,
    regs: Vec<PointerValue<'ctx>>,
    shared: Option<GlobalValue<'ctx>>,
    tables: HashMap<Vec<u32>, GlobalValue<'ctx>>,
}

fn lower<'ctx>(
    ctx: &'ctx Context,
    module: &Module<'ctx>,
    kernel: &Kernel,
) -> Result<(), CodegenError> {
    let params: Vec<_> = kernel
        .params
        .iter()
        .map(|(_, t)| basic(ctx, *t).into())
        .collect();
    let function = module.add_function(&kernel.name, ctx.void_type().fn_type(&params, false), None);
    function.set_call_conventions(PTX_KERNEL);
    // Tensor maps: 128 bytes by value, 64-aligned, read in place (`__grid_constant__`).
    let maps: Vec<u32> = (0..kernel.params.len() as u32)
        .filter(|&i| kernel.params[i as usize].1 == Ty::TensorMap)
        .collect();
    for &i in &maps {
        let bytes = ctx.i8_type().array_type(128);
        let byval = ctx.create_type_attribute(
            Attribute::get_named_enum_kind_id("byval"),
            bytes.as_any_type_enum(),
        );
        let align = ctx.create_enum_attribute(Attribute::get_named_enum_kind_id("align"), 64);
        function.add_attribute(AttributeLoc::Param(i), byval);
        function.add_attribute(AttributeLoc::Param(i), align);
    }
    if !maps.is_empty() {
        // Argument indices count from 1 here.
        let indices: Vec<_> = maps
            .iter()
            .map(|&i| ctx.i32_type().const_int(u64::from(i) + 1, false).into())
            .collect();
        let node = ctx.metadata_node(&[
            function.as_global_value().as_pointer_value().into(),
            ctx.metadata_string("grid_constant").into(),
            ctx.metadata_node(&indices).into(),
        ]);
        module
            .add_global_metadata("nvvm.annotations", &node)
            .map_err(err)?;
    }
    // Launch bounds: the CTA size, and two CTAs per SM, so ptxas budgets registers for both.
    for (key, value) in [
        ("maxntidx", kernel.threads),
        ("minctasm", kernel.ctas_per_sm),
    ] {
        let node = ctx.metadata_node(&[
            function.as_global_value().as_pointer_value().into(),
            ctx.metadata_string(key).into(),
            ctx.i32_type().const_int(u64::from(value), false).into(),
        ]);
        module
            .add_global_metadata("nvvm.annotations", &node)
            .map_err(err)?;
    }
    let entry = ctx.append_basic_block(function, "entry");
    let b = ctx.create_builder();
    b.position_at_end(entry);
    let regs = kernel
        .regs
        .iter()
        .map(|(name, t)| b.build_alloca(basic(ctx, *t), name).map_err(err))
        .collect::<Result<Vec<_>, _>>()?;
    // Up to 48 KiB, a static array; beyond, the CTA's dynamic shared memory (`extern`, sized
    // by the launch: see `dynamic_shared_bytes`).
    let shared = (kernel.shared_bytes > 0).then(|| {
        let dynamic = dynamic_shared_bytes(kernel) > 0;
        let ty = ctx
            .i8_type()
            .array_type(if dynamic { 0 } else { kernel.shared_bytes });
        let g = module.add_global(ty, Some(AddressSpace::from(3u16)), "shared");
        if dynamic {
            g.set_linkage(Linkage::External);
        } else {
            g.set_linkage(Linkage::Internal);
            g.set_initializer(&ty.get_undef());
        }
        // Swizzled tiles that TMA writes and `wgmma` reads follow address bits up to 1024.
        g.set_alignment(if uses_async_proxy(&kernel.body) {
            1024
        } else {
            16
        });
        g
    });
    let mut l = Lowering {
        ctx,
        module,
        b,
        kernel,
        function,
        regs,
        shared,
        tables: HashMap::new(),
    };
    l.stmts(&kernel.body)?;
    l.b.build_return(None).map_err(err)?;
    Ok(())
}

fn basic(ctx: &Context, t: Ty) -> BasicTypeEnum<'_> {
    match t {
        Ty::Pred => ctx.bool_type().into(),
        Ty::I32 => ctx.i32_type().into(),
        Ty::I64 => ctx.i64_type().into(),
        Ty::F32 => ctx.f32_type().into(),
        Ty::TensorMap => ctx.ptr_type(AddressSpace::default()).into(),
    }
}

/// Whether a program has TMA copies or `wgmma` products (which need swizzle-aligned shared
/// memory).
fn uses_async_proxy(body: &[Stmt]) -> bool {
    super::ir::any_stmt(body, &|s| {
        matches!(s, Stmt::TmaLoad { .. } | Stmt::Wgmma(_))
    })
}

impl<'ctx> Lowering<'_, 'ctx> {
    fn intrinsic(
        &self,
        name: &str,
        overloads: &[BasicTypeEnum<'ctx>],
        args: &[BasicValueEnum<'ctx>],
    ) -> Result<BasicValueEnum<'ctx>, CodegenError> {
        let f = Intrinsic::find(name)
            .and_then(|i| i.get_declaration(self.module, overloads))
            .ok_or_else(|| err(format!("LLVM has no intrinsic {name}")))?;
        let args: Vec<BasicMetadataValueEnum> = args.iter().map(|a| (*a).into()).collect();
        self.b
            .build_call(f, &args, "")
            .map_err(err)?
            .try_as_basic_value()
            .basic()
            .ok_or_else(|| err(format!("{name} returns nothing")))
    }

    /// A void intrinsic call.
    fn call_void(&self, name: &str) -> Result<(), CodegenError> {
        let f = Intrinsic::find(name)
            .and_then(|i| i.get_declaration(self.module, &[]))
            .ok_or_else(|| err(format!("LLVM has no intrinsic {name}")))?;
        self.b.build_call(f, &[], "").map_err(err)?;
        Ok(())
    }

    /// A pointer into `space` at a byte address (global: the address itself; shared: an offset
    /// from the CTA's shared array).
    fn pointer(
        &self,
        space: Space,
        addr: BasicValueEnum<'ctx>,
    ) -> Result<PointerValue<'ctx>, CodegenError> {
        let addr = addr.into_int_value();
        match space {
            Space::Global => {
                let ty = self.ctx.ptr_type(AddressSpace::from(1u16));
                self.b.build_int_to_ptr(addr, ty, "gptr").map_err(err)
            }
            Space::Shared => {
                let shared = self
                    .shared
                    .ok_or_else(|| err("shared access in a kernel without shared memory"))?;
                let base = self
                    .b
                    .build_ptr_to_int(shared.as_pointer_value(), self.ctx.i64_type(), "sbase")
                    .map_err(err)?;
                let a = self.b.build_int_add(base, addr, "saddr").map_err(err)?;
                let ty = self.ctx.ptr_type(AddressSpace::from(3u16));
                self.b.build_int_to_ptr(a, ty, "sptr").map_err(err)
            }
        }
    }

    fn stmts(&mut self, body: &[Stmt]) -> Result<(), CodegenError> {
        for s in body {
            self.stmt(s)?;
        }
        Ok(())
    }

    fn stmt(&mut self, s: &Stmt) -> Result<(), CodegenError> {
        match s {
            Stmt::Set(r, e) => {
                let v = self.expr(e)?;
                self.b
                    .build_store(self.regs[r.0 as usize], v)
                    .map_err(err)?;
            }
            Stmt::Store(space, addr, value) => {
                let a = self.expr(addr)?;
                let v = self.expr(value)?;
                let p = self.pointer(*space, a)?;
                self.b.build_store(p, v).map_err(err)?;
            }
            Stmt::If(c, then, otherwise) => self.branch(c, then, otherwise)?,
            Stmt::For {
                reg,
                start,
                end,
                step,
                body,
            } => self.for_loop(*reg, [start, end], *step, body)?,
            Stmt::Barrier => self.call_void("llvm.nvvm.barrier0")?,
            Stmt::CpAsync {
                dst,
                src,
                src_bytes,
            } => self.cp_async(dst, src, src_bytes)?,
            Stmt::CpAsyncCommit => self.call_void("llvm.nvvm.cp.async.commit.group")?,
            Stmt::CpAsyncWait(n) => {
                let f = self.declaration("llvm.nvvm.cp.async.wait.group", &[])?;
                let n = self.ctx.i32_type().const_int(u64::from(*n), false);
                self.b.build_call(f, &[n.into()], "").map_err(err)?;
            }
            Stmt::LdMatrix { dst, addr, trans } => self.ldmatrix(dst, addr, *trans)?,
            Stmt::MbarInit { bar, count } => self.mbar_init(bar, *count)?,
            Stmt::MbarArrive { bar, tx } => self.mbar_arrive(bar, tx.as_ref())?,
            Stmt::MbarWait { bar, parity } => self.mbar_wait(bar, parity)?,
            Stmt::TmaLoad {
                dst,
                map,
                coords,
                bar,
            } => self.tma_load(dst, *map, coords, bar)?,
            Stmt::FenceProxyAsync => self.plain("fence.proxy.async.shared::cta;")?,
            Stmt::Wgmma(w) => self.wgmma(w)?,
            Stmt::WgmmaWait { groups, regs } => self.wgmma_wait(*groups, regs)?,
            Stmt::NamedBarrier { id, threads, wait } => self.named_barrier(id, *threads, *wait)?,
            Stmt::SetMaxNReg { inc, regs } => self.plain(&format!(
                "setmaxnreg.{}.sync.aligned.u32 {regs};",
                if *inc { "inc" } else { "dec" }
            ))?,
            Stmt::Mma { half, d, a, b, c } => self.mma(*half, [d, c], a, b)?,
        }
        Ok(())
    }

    /// The declaration of intrinsic `name` for `overloads`.
    fn declaration(
        &self,
        name: &str,
        overloads: &[BasicTypeEnum<'ctx>],
    ) -> Result<FunctionValue<'ctx>, CodegenError> {
        Intrinsic::find(name)
            .and_then(|i| i.get_declaration(self.module, overloads))
            .ok_or_else(|| err(format!("LLVM has no intrinsic {name}")))
    }

    /// `if c { then } else { otherwise }`: both arms join.
    fn branch(&mut self, c: &Expr, then: &[Stmt], otherwise: &[Stmt]) -> Result<(), CodegenError> {
        let c = self.expr(c)?.into_int_value();
        let (t, e, join) = (
            self.ctx.append_basic_block(self.function, "then"),
            self.ctx.append_basic_block(self.function, "else"),
            self.ctx.append_basic_block(self.function, "join"),
        );
        self.b.build_conditional_branch(c, t, e).map_err(err)?;
        for (block, body) in [(t, then), (e, otherwise)] {
            self.b.position_at_end(block);
            self.stmts(body)?;
            self.b.build_unconditional_branch(join).map_err(err)?;
        }
        self.b.position_at_end(join);
        Ok(())
    }

    /// `for reg in start..end by step { body }`: the bound evaluated once, the counter in the
    /// register's slot (the body may read it).
    fn for_loop(
        &mut self,
        reg: Reg,
        [start, end]: [&Expr; 2],
        step: i64,
        body: &[Stmt],
    ) -> Result<(), CodegenError> {
        let slot = self.regs[reg.0 as usize];
        let start = self.expr(start)?;
        let end = self.expr(end)?.into_int_value();
        self.b.build_store(slot, start).map_err(err)?;
        let (head, block, exit) = (
            self.ctx.append_basic_block(self.function, "loop"),
            self.ctx.append_basic_block(self.function, "body"),
            self.ctx.append_basic_block(self.function, "exit"),
        );
        self.b.build_unconditional_branch(head).map_err(err)?;
        self.b.position_at_end(head);
        let i64t = self.ctx.i64_type();
        let i = self
            .b
            .build_load(i64t, slot, "i")
            .map_err(err)?
            .into_int_value();
        let more = self
            .b
            .build_int_compare(IntPredicate::SLT, i, end, "more")
            .map_err(err)?;
        self.b
            .build_conditional_branch(more, block, exit)
            .map_err(err)?;
        self.b.position_at_end(block);
        self.stmts(body)?;
        let i = self
            .b
            .build_load(i64t, slot, "i")
            .map_err(err)?
            .into_int_value();
        let next = self
            .b
            .build_int_add(i, i64t.const_int(step as u64, true), "next")
            .map_err(err)?;
        self.b.build_store(slot, next).map_err(err)?;
        self.b.build_unconditional_branch(head).map_err(err)?;
        self.b.position_at_end(exit);
        Ok(())
    }

    /// A 16-byte `cp.async` from global `src` to shared `dst`, `src_bytes` of it read.
    fn cp_async(&mut self, dst: &Expr, src: &Expr, src_bytes: &Expr) -> Result<(), CodegenError> {
        let f = self.declaration("llvm.nvvm.cp.async.cg.shared.global.16.s", &[])?;
        let (dst, src) = (self.expr(dst)?, self.expr(src)?);
        let dst = self.pointer(Space::Shared, dst)?;
        let src = self.pointer(Space::Global, src)?;
        let bytes = self.expr(src_bytes)?;
        self.b
            .build_call(f, &[dst.into(), src.into(), bytes.into()], "")
            .map_err(err)?;
        Ok(())
    }

    /// `ldmatrix` of `dst.len()` 8 x 8 matrices (transposed with `trans`) from this lane's
    /// shared row address.
    fn ldmatrix(&mut self, dst: &[Reg], addr: &Expr, trans: bool) -> Result<(), CodegenError> {
        let name = format!(
            "llvm.nvvm.ldmatrix.sync.aligned.m8n8.x{}{}.b16",
            dst.len(),
            if trans { ".trans" } else { "" }
        );
        // Overloaded on the pointer type: the shared address space's.
        let shared_ptr = self.ctx.ptr_type(AddressSpace::from(3u16));
        let f = self.declaration(&name, &[shared_ptr.into()])?;
        let addr = self.expr(addr)?;
        let ptr = self.pointer(Space::Shared, addr)?;
        let result = self
            .b
            .build_call(f, &[ptr.into()], "ldmatrix")
            .map_err(err)?
            .try_as_basic_value()
            .basic()
            .ok_or_else(|| err("ldmatrix returns nothing"))?;
        if let [r] = dst {
            self.b
                .build_store(self.regs[r.0 as usize], result)
                .map_err(err)?;
        } else {
            for (i, r) in dst.iter().enumerate() {
                let v = self
                    .b
                    .build_extract_value(result.into_struct_value(), i as u32, "m")
                    .map_err(err)?;
                self.b
                    .build_store(self.regs[r.0 as usize], v)
                    .map_err(err)?;
            }
        }
        Ok(())
    }

    /// `d = a b + c` by `mma.sync.m16n8k16` (f32 accumulators, `half` operands).
    fn mma(
        &mut self,
        half: Half,
        [d, c]: [&[Reg; 4]; 2],
        a: &[Reg; 4],
        b: &[Reg; 2],
    ) -> Result<(), CodegenError> {
        let mut args = Vec::with_capacity(10);
        // bf16 operands are i32 pairs; f16 ones <2 x half>.
        let pair_type = self.ctx.f16_type().vec_type(2);
        for r in a.iter().chain(b) {
            let v = self.expr(&Expr::Reg(*r))?;
            args.push(match half {
                Half::Bf16 => v,
                Half::F16 => self.b.build_bit_cast(v, pair_type, "f16x2").map_err(err)?,
            });
        }
        for r in c {
            args.push(self.expr(&Expr::Reg(*r))?);
        }
        let name = match half {
            Half::Bf16 => "llvm.nvvm.mma.m16n8k16.row.col.bf16",
            Half::F16 => "llvm.nvvm.mma.m16n8k16.row.col.f32.f32",
        };
        let f = self.declaration(name, &[])?;
        let args: Vec<BasicMetadataValueEnum> = args.iter().map(|v| (*v).into()).collect();
        let result = self
            .b
            .build_call(f, &args, "mma")
            .map_err(err)?
            .try_as_basic_value()
            .basic()
            .ok_or_else(|| err("mma returns nothing"))?
            .into_struct_value();
        for (i, r) in d.iter().enumerate() {
            let v = self
                .b
                .build_extract_value(result, i as u32, "d")
                .map_err(err)?;
            self.b
                .build_store(self.regs[r.0 as usize], v)
                .map_err(err)?;
        }
        Ok(())
    }
}
