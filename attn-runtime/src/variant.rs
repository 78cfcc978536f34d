//! A compiled attention variant: the spec validated and planned once, with the kernels each
//! backend builds from it, built on first use and shared.

use crate::cache::CacheLayout;
use crate::error::RuntimeError;
use attn_dsl::AttentionSpec;
use attn_dsl::modifier::grad::GradError;
use codegen::KernelPlan;
use codegen::plan::PlanKind;
use std::any::Any;
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
    kernels: Mutex<HashMap<KernelKey, Arc<dyn Any + Send + Sync>>>,
}

/// Which kernel of a variant a backend keeps: the backend's name, what the kernel is for, and a
/// detail such as the CPU's instruction set or the GPU kernel's form.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct KernelKey {
    pub backend: &'static str,
    pub kind: PlanKind,
    pub detail: &'static str,
}

impl Variant {
    /// Validates and plans `spec`.
    pub fn new(spec: AttentionSpec) -> Result<Arc<Variant>, RuntimeError> {
        let cache_layout = CacheLayout::of(&spec)?;
        Ok(Arc::new(Variant {
            text: spec.to_string(),
            forward: KernelPlan::forward(&spec),
            decode: KernelPlan::decode(&spec),
            backward: OnceLock::new(),
            cache_layout,
            spec,
            kernels: Mutex::new(HashMap::new()),
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

    /// The kernel a backend keeps under `key`, built by `build` on first use. Two threads that
    /// miss at once both build; the first to finish is kept.
    pub(crate) fn kernel<T: Any + Send + Sync>(
        &self,
        key: KernelKey,
        build: impl FnOnce(&Variant) -> Result<T, RuntimeError>,
    ) -> Result<Arc<T>, RuntimeError> {
        let found = self
            .kernels
            .lock()
            .expect("variant kernel lock")
            .get(&key)
            .cloned();
        let kernel = match found {
            Some(kernel) => kernel,
            None => {
                // Built outside the lock: compiling takes milliseconds.
                let made: Arc<dyn Any + Send + Sync> = Arc::new(build(self)?);
                let mut kernels = self.kernels.lock().expect("variant kernel lock");
                Arc::clone(kernels.entry(key).or_insert(made))
            }
        };
        kernel.downcast::<T>().map_err(|_| {
            RuntimeError::Spec(format!(
                "internal: the {} kernel kept for `{}` has another type",
                key.backend, self.text
            ))
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
