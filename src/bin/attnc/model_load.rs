//! The `--model` argument: a Hugging Face checkpoint (a directory) or a research model (a TOML
//! file, random weights), with its attention on the chosen backend; and `--tokens` lists.

use crate::backend_arg::Backend;
use attn::runtime::device::{Device, SimDevice};
use attn::runtime::model::{Model, hf, research};
use std::path::Path;

/// A checkpoint directory, or a research model's TOML file (its `weights` file, or weights
/// seeded by `seed`).
pub fn load(path: &Path, seed: u64) -> Result<Model, String> {
    let err = |e: attn::runtime::RuntimeError| format!("error: {e}");
    exists(path)?;
    if path.is_file() {
        return research::load(path, seed).map_err(err);
    }
    let model = hf::load(path).map_err(err)?;
    for warning in model.warnings() {
        eprintln!("warning: {warning}");
    }
    Ok(model)
}

/// The config of the model at `path` (a checkpoint folder or a research model's TOML), without
/// its weights.
pub fn load_config(path: &Path) -> Result<attn::runtime::model::ModelConfig, String> {
    let err = |e: attn::runtime::RuntimeError| format!("error: {e}");
    exists(path)?;
    if path.is_file() {
        return research::config_from_file(path).map_err(err);
    }
    hf::config(path).map_err(err)
}

/// An error naming `--model` when nothing is at `path`.
fn exists(path: &Path) -> Result<(), String> {
    if path.exists() {
        return Ok(());
    }
    Err(format!(
        "error: --model {}: no such file or folder; expected a Hugging Face checkpoint folder \
         (config.json and *.safetensors) or a research model's .toml file",
        path.display()
    ))
}

/// [`load`], with the model's attention on `backend`.
pub fn load_on(path: &Path, seed: u64, backend: Backend) -> Result<Model, String> {
    let mut model = load(path, seed)?;
    let name = backend.name();
    let opened = attn::runtime::backends::open(name).map_err(|e| format!("error: {e}"))?;
    model.set_backend(opened.into());
    model.set_layer_ops(attn::runtime::backends::layer_ops(name));
    Ok(model)
}

/// Token ids from `1,2,3`.
pub fn parse_tokens(text: &str) -> Result<Vec<u32>, String> {
    let tokens: Result<Vec<u32>, _> = text
        .split(',')
        .map(|t| t.trim().parse::<u32>().map_err(|_| t.trim().to_string()))
        .collect();
    match tokens {
        Ok(t) if !t.is_empty() => Ok(t),
        Ok(_) => Err("error: --tokens is empty; expected ids like 1,2,3".into()),
        Err(bad) => Err(format!(
            "error: --tokens: `{bad}` is not a token id; expected non-negative integers like 1,2,3"
        )),
    }
}

/// The device a model is resident on for `backend`: the interpreter for gpu-sim, CUDA device 0
/// for cuda; `None` on the CPU.
pub fn resident_device(backend: Backend) -> Result<Option<std::sync::Arc<dyn Device>>, String> {
    match backend {
        Backend::Cpu => Ok(None),
        Backend::GpuSim => Ok(Some(std::sync::Arc::new(SimDevice::new()))),
        Backend::Cuda => cuda_device().map(Some),
    }
}

#[cfg(feature = "cuda")]
fn cuda_device() -> Result<std::sync::Arc<dyn Device>, String> {
    attn::runtime::gpu::cuda::CudaDevice::new(0)
        .map(|d| std::sync::Arc::new(d) as std::sync::Arc<dyn Device>)
        .map_err(|e| format!("error: {e}"))
}

#[cfg(not(feature = "cuda"))]
fn cuda_device() -> Result<std::sync::Arc<dyn Device>, String> {
    Err(format!(
        "error: {}",
        attn::runtime::backends::no_cuda_feature()
    ))
}
