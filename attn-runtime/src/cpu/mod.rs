//! The CPU backend: compiles plans with codegen's Cranelift backend (once per spec per process)
//! and runs them over rayon's thread pool.

mod decode;
mod launch;
pub mod microkernels;
pub mod row_kernels;

use crate::backend::{MlaTensors, Output};
use crate::error::RuntimeError;
use crate::host::checks::{check_qkv, finish};
use crate::host::mla::AbsorbedForward;
use crate::tensor::Tensor;
use attn_dsl::AttentionSpec;
use codegen::KernelPlan;
use codegen::cpu::abi::Imports;
use codegen::cpu::{CpuKernel, compile};
use codegen::plan::PlanKind;
use launch::{Call, Rows};
use microkernels::Isa;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// The CPU backend for one instruction set of microkernels.
#[derive(Clone, Copy, Debug)]
pub struct CpuBackend {
    isa: Isa,
}

type Cache = Mutex<HashMap<(String, &'static str, PlanKind), Arc<CpuKernel>>>;

fn cache() -> &'static Cache {
    static CACHE: OnceLock<Cache> = OnceLock::new();
    CACHE.get_or_init(|| Mutex::new(HashMap::new()))
}

impl Default for CpuBackend {
    fn default() -> Self {
        CpuBackend::new()
    }
}

impl CpuBackend {
    /// The backend with the best microkernels this CPU supports.
    pub fn new() -> Self {
        CpuBackend { isa: Isa::detect() }
    }

    /// The backend with the given microkernels; `None` if this CPU lacks the instructions.
    pub fn with_isa(isa: Isa) -> Option<Self> {
        let supported = match (isa, Isa::detect()) {
            (Isa::Portable, _) | (_, Isa::Avx512) => true,
            (Isa::Avx2, best) => best == Isa::Avx2,
            (Isa::Avx512, _) => false,
        };
        supported.then_some(CpuBackend { isa })
    }

    /// The microkernels in use.
    pub fn isa(&self) -> Isa {
        self.isa
    }

    /// The compiled forward kernel of a spec: compiled on first use, then cached for the
    /// process (a new shape never recompiles).
    pub fn kernel(&self, spec: &AttentionSpec) -> Result<Arc<CpuKernel>, RuntimeError> {
        self.kernel_of(spec, PlanKind::Forward)
    }

    /// The compiled kernel of a spec for a plan kind (forward or decode), cached like
    /// [`CpuBackend::kernel`].
    pub fn kernel_of(
        &self,
        spec: &AttentionSpec,
        kind: PlanKind,
    ) -> Result<Arc<CpuKernel>, RuntimeError> {
        crate::error::check_spec(spec)?;
        let key = (spec.to_string(), isa_name(self.isa), kind);
        if let Some(k) = cache().lock().expect("kernel cache lock").get(&key) {
            return Ok(Arc::clone(k));
        }
        let (qk_tile, pv_tile) = microkernels::addresses(self.isa);
        let (qk_rows, pv_rows) = row_kernels::addresses(self.isa, spec.dtype);
        let imports = Imports {
            qk_tile,
            pv_tile,
            qk_rows,
            pv_rows,
            logf: microkernels::logf as *const () as usize,
        };
        let plan = match kind {
            PlanKind::Forward => KernelPlan::forward(spec),
            PlanKind::Decode => KernelPlan::decode(spec),
        };
        let kernel = Arc::new(compile(&plan, &imports)?);
        cache()
            .lock()
            .expect("kernel cache lock")
            .insert(key, Arc::clone(&kernel));
        Ok(kernel)
    }

    /// Attention for a per-head spec: q `[B, Hq, Sq, D]`, k `[B, Hkv, Skv, D]`, v
    /// `[B, Hkv, Skv, Dv]` (any strides with contiguous rows are read in place; other layouts and
    /// dtypes are converted), keys at positions `position_offset + j`.
    pub fn forward(
        &self,
        spec: &AttentionSpec,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        position_offset: i64,
    ) -> Result<Output, RuntimeError> {
        if spec.mla().is_some() {
            return Err(RuntimeError::Spec(
                "this is an MLA spec: use forward_mla with q_nope, q_pe, c_kv, k_pe, w_kv_b".into(),
            ));
        }
        let kernel = self.kernel(spec)?;
        let (h, dv) = (spec.heads as usize, spec.v_head_dim as usize);
        let [b, sq, skv] = check_qkv(spec, q, k, v)?;
        let call = Call {
            batch: b,
            sq,
            skv,
            position_offset,
        };
        let (out, lse) = launch::run(&kernel, &Rows::of(q), &Rows::of(k), &Rows::of(v), &call)?;
        finish(spec.dtype, [b, h, sq, dv], out, lse)
    }
}
impl CpuBackend {
    /// MLA attention in the absorbed form: `q_latent = W_uk^T q_nope` per head, the kernel over
    /// one shared head `[c_kv | k_pe]` with values `c_kv`, then `out = W_uv out_latent`.
    pub fn forward_mla(
        &self,
        spec: &AttentionSpec,
        x: &MlaTensors,
        position_offset: i64,
    ) -> Result<Output, RuntimeError> {
        let a = AbsorbedForward::of(spec, x)?;
        let kernel = self.kernel(spec)?;
        let (wq, h, sq, skv) = (a.width(), spec.heads as usize, a.sq, a.skv);
        let call = Call {
            batch: a.b,
            sq,
            skv,
            position_offset,
        };
        let q_rows = Rows::borrowed(&a.q, [h * sq * wq, sq * wq, wq]);
        // Keys and values share storage: v is the latent part of each key row.
        let k_rows = Rows::borrowed(&a.k, [skv * wq, skv * wq, wq]);
        let v_rows = Rows::borrowed(&a.k, [skv * wq, skv * wq, wq]);
        let (latent, lse) = launch::run(&kernel, &q_rows, &k_rows, &v_rows, &call)?;
        a.finish(spec, &latent, lse)
    }
}

fn isa_name(isa: Isa) -> &'static str {
    match isa {
        Isa::Avx512 => "avx512",
        Isa::Avx2 => "avx2",
        Isa::Portable => "portable",
    }
}
