//! The CPU backend: a [`KernelPlan`] lowered to machine code through Cranelift and loaded in
//! memory (JIT).
//!
//! A kernel is two generated functions (see [`abi`] for their argument records):
//! - `pack_k`, once per (batch, kv head): RoPE on the keys and a transpose into tiles of
//!   [`K_TILE`](crate::plan::K_TILE) keys, the layout the score microkernel streams;
//! - `block`, once per (batch, head, block of query rows): RoPE on the queries, then for every
//!   key tile the plan does not skip, the scores (`qk_tile`), the score program and the mask
//!   (vectorized, masked only on mixed or partial tiles), the online-softmax update, and the
//!   value product (`pv_tile`); finally `out` and `lse`.
//!
//! The dense tile products are native SIMD microkernels the runtime provides ([`abi::Imports`]);
//! everything that varies with the spec is generated. Sequence lengths and batch are runtime
//! values: one compilation serves every shape.

pub mod abi;
mod emit;
mod fx;
mod score;

use crate::error::CodegenError;
use crate::plan::{KernelPlan, PlanKind};
use abi::Imports;
use cranelift_codegen::ir::types::{F32, I64};
use cranelift_codegen::ir::{AbiParam, Signature, UserFuncName};
use cranelift_codegen::isa::CallConv;
use cranelift_codegen::settings::{self, Configurable};
use cranelift_frontend::{FunctionBuilder, FunctionBuilderContext};
use cranelift_jit::{JITBuilder, JITModule};
use cranelift_module::{Linkage, Module, default_libcall_names};
use std::time::{Duration, Instant};

/// A compiled CPU kernel: the addresses of its generated functions. The machine code lives for
/// the rest of the process (kernels are compiled once and cached by the runtime).
#[derive(Debug)]
pub struct CpuKernel {
    /// The plan compiled.
    pub plan: KernelPlan,
    /// Address of `pack_k(args: *const PackArgs)`.
    pub pack_k: usize,
    /// Address of `block(args: *const BlockArgs)`.
    pub block: usize,
    /// Scratch the block function needs.
    pub scratch: abi::ScratchLayout,
    /// Time spent compiling.
    pub compile_time: Duration,
}

/// Compiles a forward plan for the host CPU.
pub fn compile(plan: &KernelPlan, imports: &Imports) -> Result<CpuKernel, CodegenError> {
    let PlanKind::Forward = plan.kind;
    let start = Instant::now();
    let mut flags = settings::builder();
    for (name, value) in [
        ("opt_level", "speed"),
        ("is_pic", "false"),
        ("use_colocated_libcalls", "false"),
    ] {
        flags
            .set(name, value)
            .map_err(|e| CodegenError::Cranelift(format!("flag {name}: {e}")))?;
    }
    let isa = cranelift_native::builder()
        .map_err(|e| CodegenError::Cranelift(format!("host ISA: {e}")))?
        .finish(settings::Flags::new(flags))
        .map_err(|e| CodegenError::Cranelift(format!("host ISA: {e}")))?;
    let mut builder = JITBuilder::with_isa(isa, default_libcall_names());
    builder.symbol("attn_qk_tile", imports.qk_tile as *const u8);
    builder.symbol("attn_pv_tile", imports.pv_tile as *const u8);
    builder.symbol("attn_logf", imports.logf as *const u8);
    let mut module = JITModule::new(builder);

    let sig = |params: &[cranelift_codegen::ir::Type], returns: &[cranelift_codegen::ir::Type]| {
        let mut s = Signature::new(CallConv::SystemV);
        s.params.extend(params.iter().map(|t| AbiParam::new(*t)));
        s.returns.extend(returns.iter().map(|t| AbiParam::new(*t)));
        s
    };
    let err = |e: cranelift_module::ModuleError| CodegenError::Cranelift(e.to_string());
    let qk = module
        .declare_function("attn_qk_tile", Linkage::Import, &sig(&[I64; 7], &[]))
        .map_err(err)?;
    let pv = module
        .declare_function("attn_pv_tile", Linkage::Import, &sig(&[I64; 7], &[]))
        .map_err(err)?;
    let logf = module
        .declare_function("attn_logf", Linkage::Import, &sig(&[F32], &[F32]))
        .map_err(err)?;

    let entry_sig = sig(&[I64], &[]);
    let pack_id = module
        .declare_function("pack_k", Linkage::Local, &entry_sig)
        .map_err(err)?;
    let block_id = module
        .declare_function("block", Linkage::Local, &entry_sig)
        .map_err(err)?;
    let mut tables = score::Tables { data: Vec::new() };
    let mut fctx = FunctionBuilderContext::new();

    for (id, is_block) in [(pack_id, false), (block_id, true)] {
        let mut ctx = module.make_context();
        ctx.func.signature = entry_sig.clone();
        ctx.func.name = UserFuncName::user(0, id.as_u32());
        {
            let mut b = FunctionBuilder::new(&mut ctx.func, &mut fctx);
            let entry = b.create_block();
            b.append_block_params_for_function_params(entry);
            b.switch_to_block(entry);
            b.seal_block(entry);
            let args = b.block_params(entry)[0];
            let refs = emit::Refs {
                qk_tile: module.declare_func_in_func(qk, b.func),
                pv_tile: module.declare_func_in_func(pv, b.func),
                logf: module.declare_func_in_func(logf, b.func),
            };
            let mut fx = fx::Fx { b };
            if is_block {
                emit::block(&mut fx, plan, &refs, &mut tables, args);
            } else {
                emit::pack_k(&mut fx, plan, args);
            }
            fx.b.finalize(module.target_config());
        }
        module.define_function(id, &mut ctx).map_err(|e| {
            CodegenError::Cranelift(format!(
                "{}: {e:?}",
                if is_block { "block" } else { "pack_k" }
            ))
        })?;
        module.clear_context(&mut ctx);
    }
    module.finalize_definitions().map_err(err)?;
    let pack_k = module.get_finalized_function(pack_id) as usize;
    let block = module.get_finalized_function(block_id) as usize;
    // The code and the constant tables it reads stay mapped for the life of the process.
    Box::leak(Box::new(module));
    Box::leak(Box::new(tables));
    Ok(CpuKernel {
        plan: plan.clone(),
        pack_k,
        block,
        scratch: abi::ScratchLayout::of(plan),
        compile_time: start.elapsed(),
    })
}
