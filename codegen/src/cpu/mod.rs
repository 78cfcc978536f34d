//! The CPU backend: a [`KernelPlan`] lowered to machine code through Cranelift and loaded in
//! memory (JIT).
//!
//! A forward kernel is two generated functions (see [`abi`] for their argument records):
//! - `pack_k`, once per (batch, kv head): RoPE on the keys and a transpose into tiles of
//!   [`K_TILE`](crate::plan::K_TILE) keys, the layout the score microkernel streams;
//! - `block`, once per (batch, head, block of query rows): RoPE on the queries, then for every
//!   key tile the plan does not skip, the scores (`qk_tile`), the score program and the mask
//!   (vectorized, masked only on mixed or partial tiles), the online-softmax update, and the
//!   value product (`pv_tile`); finally `out` and `lse`. Plans that [`scales_scores`] allows,
//!   given an exact bf16 `qk_tile`, leave the queries unscaled and multiply each tile's scores
//!   by the plan's `q_scale` instead.
//!
//! A decode kernel is one function, `decode`, once per (sequence, kv head, rows, partition of
//! the keys): the same steps over key segments read in place in the cache's dtype (`qk_rows`,
//! `pv_rows`), every query head of the kv head sharing each key read.
//!
//! A backward kernel is two functions: `rotate_rows` (RoPE and a factor on rows in place) and
//! `grad_tile` (one query block against one key tile: probabilities recomputed from the saved
//! lse, and `dS`); the runtime drives the tile loop and the five tile products around them.
//!
//! The dense tile products are native SIMD microkernels the runtime provides ([`abi::Imports`]);
//! everything that varies with the spec is generated. Sequence lengths and batch are runtime
//! values: one compilation serves every shape.

pub mod abi;
mod backward;
mod emit;
mod fx;
mod rows;
mod score;
mod step;

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
    /// The generated functions.
    pub entry: Entry,
    /// Scratch the block function needs.
    pub scratch: abi::ScratchLayout,
    /// Time spent compiling.
    pub compile_time: Duration,
}

/// The addresses of a kernel's generated functions, by plan kind.
#[derive(Clone, Copy, Debug)]
pub enum Entry {
    /// `pack_k(args: *const PackArgs)` and `block(args: *const BlockArgs)`.
    Forward {
        /// Address of `pack_k`.
        pack_k: usize,
        /// Address of `block`.
        block: usize,
    },
    /// `decode(args: *const DecodeArgs)`.
    Decode {
        /// Address of `decode`.
        decode: usize,
    },
    /// `rotate_rows(args: *const RotateArgs)` and `grad_tile(args: *const GradTileArgs)`.
    Backward {
        /// Address of `rotate_rows`.
        rotate_rows: usize,
        /// Address of `grad_tile`.
        grad_tile: usize,
    },
}

/// Whether a plan's `block` may multiply the raw scores by `q_scale` after `qk_tile` instead of
/// scaling the queries before it: forwards of bf16 specs whose queries and keys reach the
/// product as given (no RoPE, no MLA absorption), so that a `qk_tile` on bf16 pairs multiplies
/// them exactly. It does where the runtime imports such a `qk_tile`
/// ([`Imports::scores_after_qk`](abi::Imports)); with an f32 one, scaling the queries once
/// costs less than scaling every tile's scores.
pub fn scales_scores(plan: &KernelPlan) -> bool {
    plan.kind == PlanKind::Forward
        && plan.dtype == attn_dsl::DType::Bf16
        && plan.rope.is_none()
        && plan.mla.is_none()
        && plan.q_scale > 0.0
}

/// Compiles a plan for the host CPU.
pub fn compile(plan: &KernelPlan, imports: &Imports) -> Result<CpuKernel, CodegenError> {
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
    builder.symbol("attn_qk_rows", imports.qk_rows as *const u8);
    builder.symbol("attn_pv_rows", imports.pv_rows as *const u8);
    builder.symbol("attn_logf", imports.logf as *const u8);
    builder.symbol("attn_exp_tile", imports.exp_tile as *const u8);
    builder.symbol("attn_ds_tile", imports.ds_tile as *const u8);
    let mut module = JITModule::new(builder);

    let sig = |params: &[cranelift_codegen::ir::Type], returns: &[cranelift_codegen::ir::Type]| {
        let mut s = Signature::new(CallConv::SystemV);
        s.params.extend(params.iter().map(|t| AbiParam::new(*t)));
        s.returns.extend(returns.iter().map(|t| AbiParam::new(*t)));
        s
    };
    let err = |e: cranelift_module::ModuleError| CodegenError::Cranelift(e.to_string());
    // Backward kernels call no tile product themselves; they declare the forward's.
    let forward = plan.kind != PlanKind::Decode;
    let (qk_name, pv_name) = if forward {
        ("attn_qk_tile", "attn_pv_tile")
    } else {
        ("attn_qk_rows", "attn_pv_rows")
    };
    // Decode's row products take two more: the rows read next, which they prefetch.
    let (qk_params, pv_params): (&[_], &[_]) = if forward {
        (&[I64; 7], &[I64; 7])
    } else {
        (&[I64; 11], &[I64; 9])
    };
    let qk = module
        .declare_function(qk_name, Linkage::Import, &sig(qk_params, &[]))
        .map_err(err)?;
    let pv = module
        .declare_function(pv_name, Linkage::Import, &sig(pv_params, &[]))
        .map_err(err)?;
    let logf = module
        .declare_function("attn_logf", Linkage::Import, &sig(&[F32], &[F32]))
        .map_err(err)?;
    let exp_tile = module
        .declare_function("attn_exp_tile", Linkage::Import, &sig(&[I64; 4], &[]))
        .map_err(err)?;
    let ds_tile = module
        .declare_function(
            "attn_ds_tile",
            Linkage::Import,
            &sig(&[I64, I64, I64, I64, I64, F32], &[]),
        )
        .map_err(err)?;

    let entry_sig = sig(&[I64], &[]);
    let names: &[&str] = match plan.kind {
        PlanKind::Forward => &["pack_k", "block"],
        PlanKind::Decode => &["decode"],
        PlanKind::Backward => &["rotate_rows", "grad_tile"],
    };
    let mut ids = Vec::new();
    for name in names {
        ids.push(
            module
                .declare_function(name, Linkage::Local, &entry_sig)
                .map_err(err)?,
        );
    }
    let mut tables = score::Tables {
        data: Vec::new(),
        params: None,
    };
    let mut fctx = FunctionBuilderContext::new();

    for (&id, &name) in ids.iter().zip(names) {
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
            let refs = rows::Refs {
                qk: module.declare_func_in_func(qk, b.func),
                pv: module.declare_func_in_func(pv, b.func),
                logf: module.declare_func_in_func(logf, b.func),
                exp_tile: module.declare_func_in_func(exp_tile, b.func),
                ds_tile: module.declare_func_in_func(ds_tile, b.func),
                scales_scores: imports.scores_after_qk && scales_scores(plan),
            };
            let mut fx = fx::Fx { b };
            match name {
                "pack_k" => emit::pack_k(&mut fx, plan, args),
                "block" => emit::block(&mut fx, plan, &refs, &mut tables, args),
                "rotate_rows" => backward::rotate_rows(&mut fx, plan, args),
                "grad_tile" => backward::grad_tile(&mut fx, plan, &refs, &mut tables, args),
                _ => emit::decode(&mut fx, plan, &refs, &mut tables, args),
            }
            fx.b.finalize(module.target_config());
        }
        // `ATTN_DUMP_ASM=1` prints each generated function's machine code to stderr (for
        // reading what Cranelift made of a loop: spills, hoisting).
        let dump = crate::settings::dump_asm().map_err(CodegenError::Setting)?;
        ctx.set_disasm(dump);
        module
            .define_function(id, &mut ctx)
            .map_err(|e| CodegenError::Cranelift(format!("{name}: {e:?}")))?;
        if dump && let Some(code) = ctx.compiled_code() {
            eprintln!("== {name}\n{}", code.vcode.clone().unwrap_or_default());
        }
        module.clear_context(&mut ctx);
    }
    module.finalize_definitions().map_err(err)?;
    let address = |i: usize| module.get_finalized_function(ids[i]) as usize;
    let entry = match plan.kind {
        PlanKind::Forward => Entry::Forward {
            pack_k: address(0),
            block: address(1),
        },
        PlanKind::Decode => Entry::Decode { decode: address(0) },
        PlanKind::Backward => Entry::Backward {
            rotate_rows: address(0),
            grad_tile: address(1),
        },
    };
    // The code and the constant tables it reads stay mapped for the life of the process.
    Box::leak(Box::new(module));
    Box::leak(Box::new(tables));
    Ok(CpuKernel {
        plan: plan.clone(),
        entry,
        scratch: abi::ScratchLayout::of(plan),
        compile_time: start.elapsed(),
    })
}
