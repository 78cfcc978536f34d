//! `attn.Variant`: a spec parsed, checked and planned once per process, and what Python asks
//! of it (its dimensions, learnable and data tensors, costs).

use crate::error::{from_runtime, refuse};
use attn::dsl::{DataDim, ParamDim, ParamInit};
use attn::{DType, Variant};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// Most specs a process keeps planned; the cache starts over past it (a variant is replanned
/// and its kernels recompiled, in milliseconds, when it comes back).
const MAX_CACHED: usize = 256;

/// A spec's text parsed; parse errors rendered as `attnc check` prints them: each with its
/// source line and carets, then how many errors there were.
fn parsed(text: &str) -> PyResult<attn::AttentionSpec> {
    if text.len() > attn::dsl::MAX_SPEC_BYTES {
        return Err(refuse(format!(
            "the spec is {} bytes, more than the {} a spec may have",
            text.len(),
            attn::dsl::MAX_SPEC_BYTES
        )));
    }
    attn::dsl::parse_str(text).map_err(|errors| {
        let count = errors.0.len();
        let plural = if count == 1 { "" } else { "s" };
        refuse(format!(
            "{}spec rejected: {count} error{plural}",
            errors.render(text)
        ))
    })
}

/// The planned variant of a spec's text, parsed ([`parsed`]) on its first use in this
/// process.
pub fn planned(text: &str) -> PyResult<Arc<Variant>> {
    type Cache = Mutex<HashMap<String, Arc<Variant>>>;
    static CACHE: OnceLock<Cache> = OnceLock::new();
    let cache = CACHE.get_or_init(Cache::default);
    let lock = || {
        cache
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    };
    if let Some(found) = lock().get(text) {
        return Ok(Arc::clone(found));
    }
    let spec = parsed(text)?;
    let variant = Variant::shared(&spec).map_err(from_runtime)?;
    let mut cache = lock();
    if cache.len() >= MAX_CACHED {
        cache.clear();
    }
    cache.insert(text.to_string(), Arc::clone(&variant));
    Ok(variant)
}

/// A differential spec's parts (`differential = lambda(init = L)`): the text of its component
/// heads (the spec without `differential`, which the torch op runs) and `L`. Refuses a spec
/// without differential heads or one its rules refuse.
#[pyfunction]
pub fn differential_parts(text: &str) -> PyResult<(String, f64)> {
    let spec = parsed(text)?;
    let heads = attn::runtime::differential::Differential::new(spec).map_err(from_runtime)?;
    let init = heads.spec().differential.map_or(0.0, |d| d.lambda_init);
    Ok((heads.components().text().to_string(), init))
}

/// The normalized text of a spec (what `attnc check` prints), which the torch op carries.
#[pyfunction]
pub fn normalized(text: &str) -> PyResult<String> {
    Ok(planned(text)?.text().to_string())
}

/// An attention variant: a spec in attn's spec language, checked and planned.
#[pyclass(name = "Variant", module = "attn", frozen, eq, hash)]
pub struct PyVariant {
    pub variant: Arc<Variant>,
}

impl PartialEq for PyVariant {
    fn eq(&self, other: &Self) -> bool {
        self.variant.text() == other.variant.text()
    }
}

impl std::hash::Hash for PyVariant {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.variant.text().hash(state);
    }
}

/// The torch dtype name of a spec's element type.
fn torch_dtype(dtype: DType) -> &'static str {
    match dtype {
        DType::F32 => "float32",
        DType::F16 => "float16",
        DType::Bf16 => "bfloat16",
    }
}

fn data_dim(dim: &DataDim) -> String {
    match dim {
        DataDim::Fixed(n) => n.to_string(),
        DataDim::Heads => "heads".into(),
        DataDim::KvHeads => "kv_heads".into(),
        DataDim::Batch => "batch".into(),
        DataDim::Seq => "seq".into(),
    }
}

#[pymethods]
impl PyVariant {
    /// Parses and checks `spec`; raises `attn.AttnError` with `attnc check`'s message.
    #[new]
    fn new(spec: &str) -> PyResult<Self> {
        Ok(PyVariant {
            variant: planned(spec)?,
        })
    }

    /// Pickles (and `copy.deepcopy`s) as its spec text, planned again when loaded.
    fn __reduce__<'py>(
        slf: &Bound<'py, Self>,
    ) -> PyResult<(Bound<'py, pyo3::types::PyType>, (String,))> {
        Ok((slf.get_type(), (slf.get().variant.text().to_string(),)))
    }

    fn __repr__(&self) -> String {
        format!("attn.Variant({:?})", self.variant.text())
    }

    fn __str__(&self) -> String {
        self.variant.text().to_string()
    }

    /// The spec in normalized form (every default written out).
    #[getter]
    fn text(&self) -> &str {
        self.variant.text()
    }

    /// Query heads.
    #[getter]
    fn heads(&self) -> u32 {
        self.variant.spec().heads
    }

    /// Key/value heads (1 for MLA: the latent is shared).
    #[getter]
    fn kv_heads(&self) -> u32 {
        self.variant.spec().kv_heads()
    }

    /// The query/key head dimension.
    #[getter]
    fn head_dim(&self) -> u32 {
        self.variant.spec().head_dim
    }

    /// The value head dimension.
    #[getter]
    fn v_head_dim(&self) -> u32 {
        self.variant.spec().v_head_dim
    }

    /// The softmax scale: the spec's `scale`, else `1 / sqrt(head_dim)`.
    #[getter]
    fn scale(&self) -> f64 {
        self.variant.spec().effective_scale()
    }

    /// The element type, as torch names it (`"float32"`, `"float16"`, `"bfloat16"`).
    #[getter]
    fn dtype(&self) -> &'static str {
        torch_dtype(self.variant.spec().dtype)
    }

    /// Whether the variant is MLA (five inputs: `attn.attention_mla`).
    #[getter]
    fn is_mla(&self) -> bool {
        self.variant.spec().mla().is_some()
    }

    /// MLA's latent rank (`None` for a per-head variant).
    #[getter]
    fn latent_rank(&self) -> Option<u32> {
        self.variant.spec().mla().map(|m| m.latent_rank)
    }

    /// Bytes of KV cache per token for one such attention (K and V of every KV head in the
    /// spec's dtype; MLA: the latent and the rotary key).
    #[getter]
    fn kv_bytes_per_token(&self) -> u64 {
        attn::accounting::kv_cache_bytes_per_token(self.variant.spec())
    }

    /// The learnable tensors, in the spec's order: `(name, shape)`, the declared parameters,
    /// then `sinks` (`[heads]`) with learned sinks.
    #[getter]
    fn learnable(&self) -> Vec<(String, Vec<usize>)> {
        self.variant.spec().learnable_tensors()
    }

    /// Whether any learnable tensor starts at random values (`= normal(..)`, `= uniform(..)`).
    #[getter]
    fn random_start(&self) -> bool {
        self.variant
            .spec()
            .params
            .iter()
            .any(|p| matches!(p.init, ParamInit::Normal(_) | ParamInit::Uniform(..)))
    }

    /// The learnable tensors' initial values, in [`learnable`]'s order: `(name, shape,
    /// values)`, values flat and row-major, as the spec's `= INIT` says (0 by default; learned
    /// sinks start at 0); random ones drawn from `seed` and the tensor's name.
    fn initial_values(&self, seed: u64) -> Vec<(String, Vec<usize>, Vec<f32>)> {
        self.variant.spec().initial_values(seed)
    }

    /// The parameters' declared dimensions: `(name, dims)`, each dim a size or `"heads"`,
    /// `"kv_heads"`.
    #[getter]
    fn params(&self) -> Vec<(String, Vec<String>)> {
        let dim = |d: &ParamDim| match d {
            ParamDim::Fixed(n) => n.to_string(),
            ParamDim::Heads => "heads".into(),
            ParamDim::KvHeads => "kv_heads".into(),
        };
        let spec = self.variant.spec();
        spec.params
            .iter()
            .map(|p| (p.name.clone(), p.dims.iter().map(dim).collect()))
            .collect()
    }

    /// The data tensors: `(name, dims, dtype)`, each dim a size or `"heads"`, `"kv_heads"`,
    /// `"batch"`, `"seq"`; dtype `"int32"` or `"float32"`.
    #[getter]
    fn data(&self) -> Vec<(String, Vec<String>, &'static str)> {
        let spec = self.variant.spec();
        spec.data
            .iter()
            .map(|d| {
                let dtype = match d.dtype {
                    attn::dsl::DataType::I32 => "int32",
                    attn::dsl::DataType::F32 => "float32",
                };
                (d.name.clone(), d.dims.iter().map(data_dim).collect(), dtype)
            })
            .collect()
    }

    /// Forward FLOPs of one call (2 (qk_dim + v_dim) per head, query and key): a dict with
    /// `dense` (every pair) and `with_skipping` (the pairs the built-in mask keeps; a custom
    /// mask counts as dense, and `custom_mask` says so).
    #[pyo3(signature = (batch, seq_q, seq_kv = None))]
    fn flops<'py>(
        &self,
        py: Python<'py>,
        batch: u64,
        seq_q: u64,
        seq_kv: Option<u64>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let f = attn::accounting::forward_flops(
            self.variant.spec(),
            batch,
            seq_q,
            seq_kv.unwrap_or(seq_q),
        )
        .ok_or_else(|| refuse("the FLOP count does not fit in 64 bits"))?;
        let d = PyDict::new(py);
        d.set_item("dense", f.dense)?;
        d.set_item("with_skipping", f.with_skipping)?;
        d.set_item("custom_mask", f.custom_mask)?;
        Ok(d)
    }
}
