//! A compiled attention variant: the spec validated and planned once, with the kernels each
//! backend builds from it, built on first use and shared.

use crate::cache::CacheLayout;
use crate::cpu::microkernels::Isa;
use crate::error::RuntimeError;
use attn_dsl::AttentionSpec;
use attn_dsl::modifier::grad::GradError;
use codegen::KernelPlan;
use codegen::cpu::CpuKernel;
use codegen::gpu::choice::{BackwardChoice, ForwardChoice};
use codegen::gpu::ir::Kernel as GpuKernel;
use codegen::gpu::{BackwardKernels, ForwardKernel};
use codegen::plan::PlanKind;
use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, OnceLock};

/// An attention variant ready to run: its spec (validated), its forward, decode and backward
/// plans, the
/// layout of its KV caches, and the kernels backends have built for it.
///
/// Build one with [`Variant::new`] (or [`Variant::shared`], which returns the process's one
/// variant per spec) and hand it to a [`Backend`](crate::Backend): calls then neither validate,
/// plan, lower nor compile again. Kernels are built lazily, once per backend and kind, and live
/// as long as the variant.
pub struct Variant {
    spec: AttentionSpec,
    text: String,
    forward: KernelPlan,
    decode: KernelPlan,
    /// The backward plan, or why there is none (a score derivative too large to build): made
    /// on first use, since most variants never train.
    backward: OnceLock<Result<KernelPlan, GradError>>,
    cache_layout: CacheLayout,
    kernels: Kernels,
}

/// The kernels backends have built for a variant, each under what it was built for.
#[derive(Default)]
struct Kernels {
    /// Compiled CPU kernels, by plan kind and instruction set.
    cpu: Mutex<HashMap<(PlanKind, Isa), Arc<CpuKernel>>>,
    /// GPU forward kernels, by the choice ([`codegen::gpu::choice::choose`]).
    gpu_forward: Mutex<HashMap<ForwardChoice, Arc<ForwardKernel>>>,
    /// The GPU decode kernel.
    gpu_decode: Mutex<Option<Arc<GpuKernel>>>,
    /// GPU backward kernels, by the choice.
    gpu_backward: Mutex<HashMap<BackwardChoice, Arc<BackwardKernels>>>,
}

/// The kernel `map` keeps under `key`, built by `build` on first use. Two threads that miss at
/// once both build (outside the lock: compiling takes milliseconds); the first to finish is kept.
fn kept<K: std::hash::Hash + Eq, T>(
    map: &Mutex<HashMap<K, Arc<T>>>,
    key: K,
    build: impl FnOnce() -> Result<T, RuntimeError>,
) -> Result<Arc<T>, RuntimeError> {
    let lock = || map.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    if let Some(found) = lock().get(&key) {
        return Ok(Arc::clone(found));
    }
    let made = Arc::new(build()?);
    Ok(Arc::clone(lock().entry(key).or_insert(made)))
}

impl Variant {
    /// Validates and plans `spec`.
    pub fn new(spec: AttentionSpec) -> Result<Arc<Variant>, RuntimeError> {
        if spec.differential.is_some() {
            // A variant's calls return one attention's output per query head.
            return Err(RuntimeError::Spec(
                "differential heads combine two attentions per head: run the spec through \
                 attn_runtime::differential::Differential (attnc run and grad do)"
                    .into(),
            ));
        }
        let cache_layout = CacheLayout::of(&spec)?;
        Ok(Arc::new(Variant {
            text: spec.to_string(),
            forward: KernelPlan::forward(&spec),
            decode: KernelPlan::decode(&spec),
            backward: OnceLock::new(),
            cache_layout,
            spec,
            kernels: Kernels::default(),
        }))
    }

    /// Parses, validates and plans a spec's text.
    pub fn parse(text: &str) -> Result<Arc<Variant>, RuntimeError> {
        let spec = attn_dsl::parse_str(text).map_err(|e| RuntimeError::Spec(e.render(text)))?;
        Variant::new(spec)
    }

    /// The process's variant for `spec`, made on first use: every call with an equal spec
    /// shares its plans and kernels. (The spec-taking entry points of the backends use it; it
    /// prints the spec to find it, which a held [`Variant`] avoids.)
    pub fn shared(spec: &AttentionSpec) -> Result<Arc<Variant>, RuntimeError> {
        type Registry = Mutex<HashMap<String, Arc<Variant>>>;
        static REGISTRY: OnceLock<Registry> = OnceLock::new();
        let registry = REGISTRY.get_or_init(|| Mutex::new(HashMap::new()));
        let text = spec.to_string();
        if let Some(found) = registry.lock().expect("variant registry lock").get(&text) {
            return Ok(Arc::clone(found));
        }
        let made = Variant::new(spec.clone())?;
        let mut registry = registry.lock().expect("variant registry lock");
        Ok(Arc::clone(registry.entry(text).or_insert(made)))
    }

    /// The spec.
    pub fn spec(&self) -> &AttentionSpec {
        &self.spec
    }

    /// The spec in normalized text form.
    pub fn text(&self) -> &str {
        &self.text
    }

    /// The plan of the forward kernel (prefill, whole sequences).
    pub fn forward_plan(&self) -> &KernelPlan {
        &self.forward
    }

    /// The plan of the decode kernel (queries against cached keys).
    pub fn decode_plan(&self) -> &KernelPlan {
        &self.decode
    }

    /// The plan of the backward kernel (gradients by recomputation), or why the spec has none.
    pub fn backward_plan(&self) -> Result<&KernelPlan, RuntimeError> {
        self.backward
            .get_or_init(|| KernelPlan::backward(&self.spec))
            .as_ref()
            .map_err(|e| RuntimeError::Spec(format!("no backward pass for `{}`: {e}", self.text)))
    }

    /// The plan of a kind.
    pub fn plan(&self, kind: PlanKind) -> Result<&KernelPlan, RuntimeError> {
        match kind {
            PlanKind::Forward => Ok(&self.forward),
            PlanKind::Decode => Ok(&self.decode),
            PlanKind::Backward => self.backward_plan(),
        }
    }

    /// What the variant's KV caches store per token.
    pub fn cache_layout(&self) -> &CacheLayout {
        &self.cache_layout
    }

    /// The CPU kernel of a plan kind for `isa`, compiled by `compile` on first use.
    pub(crate) fn cpu_kernel(
        &self,
        kind: PlanKind,
        isa: Isa,
        compile: impl FnOnce(&Variant) -> Result<CpuKernel, RuntimeError>,
    ) -> Result<Arc<CpuKernel>, RuntimeError> {
        kept(&self.kernels.cpu, (kind, isa), || compile(self))
    }

    /// The GPU forward kernel `choice`, lowered from the forward plan on first use.
    pub(crate) fn gpu_forward(
        &self,
        choice: ForwardChoice,
    ) -> Result<Arc<ForwardKernel>, RuntimeError> {
        kept(&self.kernels.gpu_forward, choice, || {
            Ok(choice.lower(&self.forward)?)
        })
    }

    /// The GPU decode kernel, lowered from the decode plan on first use.
    pub(crate) fn gpu_decode(&self) -> Result<Arc<GpuKernel>, RuntimeError> {
        let mut decode = self
            .kernels
            .gpu_decode
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(kernel) = &*decode {
            return Ok(Arc::clone(kernel));
        }
        // Lowered under the lock: a decode kernel lowers in well under a millisecond.
        let kernel = Arc::new(codegen::gpu::decode_kernel(&self.decode)?);
        *decode = Some(Arc::clone(&kernel));
        Ok(kernel)
    }

    /// The GPU backward kernels `choice`, lowered from the backward plan on first use.
    pub(crate) fn gpu_backward(
        &self,
        choice: BackwardChoice,
    ) -> Result<Arc<BackwardKernels>, RuntimeError> {
        let plan = self.backward_plan()?;
        kept(&self.kernels.gpu_backward, choice, || {
            Ok(choice.lower(plan)?)
        })
    }
}

impl fmt::Debug for Variant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Variant").field("spec", &self.text).finish()
    }
}

impl fmt::Display for Variant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}
