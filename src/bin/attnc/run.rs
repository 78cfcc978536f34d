//! `attnc run`: attention on tensors from a safetensors file, written to another.

use crate::backend_arg::Backend;
use crate::input_file::{read_cu_seqlens, read_data_tensors, read_with_learned};
use crate::{outputs, spec_arg};
use attn::AttentionSpec;
use attn::runtime::io::{read_safetensors, write_safetensors};
use attn::runtime::learned::data_views;
use attn::runtime::varlen::Varlen;
use attn::runtime::{Inputs, Learned, MlaTensors, Output};
use attn::runtime::{RuntimeError, Tensor};
use std::path::{Path, PathBuf};

/// What `attnc run` and `attnc grad` read and write.
#[derive(clap::Args)]
pub struct Files {
    /// The spec, in the spec language, or @FILE to read it from a file.
    #[arg(long, allow_hyphen_values = true)]
    pub spec: String,
    /// Input safetensors file (BHSD tensors in the spec's dtype). With i32 tensors
    /// `cu_seqlens_q` and `cu_seqlens_k` (B + 1 offsets each), a variable-length batch: q
    /// [total_q, heads, D], k and v [total_k, kv_heads, D], outputs in the same packed layout.
    /// The spec's learnable tensors (params(...), sinks) and data tensors (data(...): i32 ones
    /// stored as I32, f32 ones as F32) by their names. Differential heads (differential =
    /// lambda): v holds kv_heads / 2 heads, and lambda_q1, lambda_k1, lambda_q2, lambda_k2
    /// (f32, head_dim values each) are read.
    #[arg(long, value_name = "FILE")]
    pub input: PathBuf,
    /// Output safetensors file.
    #[arg(long, value_name = "FILE")]
    pub output: PathBuf,
    /// Position of key 0.
    #[arg(
        long,
        value_name = "N",
        default_value_t = 0,
        allow_negative_numbers = true
    )]
    pub position_offset: i64,
    /// The backend.
    #[arg(long, value_enum, default_value_t = Backend::Cpu)]
    pub backend: Backend,
}

impl Files {
    /// The spec, once the output is known not to be special or one of the inputs.
    pub fn checked_spec(&self) -> Result<AttentionSpec, String> {
        let mut inputs = vec![self.input.as_path()];
        inputs.extend(spec_arg::spec_file(&self.spec));
        outputs::check(&self.output, &inputs, "--output")?;
        spec_arg::load(&self.spec).map(|(spec, _)| spec)
    }
}

/// `attnc run`.
pub fn command(files: Files) -> Result<(), String> {
    let spec = files.checked_spec()?;
    let summary = run(
        &spec,
        &files.input,
        &files.output,
        files.position_offset,
        files.backend,
    )
    .map_err(|e| format!("error: {e}"))?;
    println!("{summary}");
    Ok(())
}

/// On gpu-sim, says on stderr how long the interpreter will take when that is more than a few
/// seconds (calls it would take too long on are refused by the backend).
pub fn note_sim_time(on: Backend, spec: &AttentionSpec, q: &Tensor, k: &Tensor, backward: bool) {
    use attn::runtime::gpu::sim_cost;
    if on != Backend::GpuSim {
        return;
    }
    let dim = |t: &Tensor, i: usize| t.shape().get(i).map_or(0, |&d| d as u64);
    let seconds = sim_cost::attention_seconds(spec, dim(q, 0), dim(q, 2), dim(k, 2), backward);
    if (10.0..=sim_cost::MAX_SECONDS).contains(&seconds) {
        eprintln!(
            "note: the GPU IR interpreter will take about {} for this",
            sim_cost::duration(seconds)
        );
    }
}

/// Reads the inputs the spec needs (`q, k, v`, packed with `cu_seqlens_q` and `cu_seqlens_k`
/// for a variable-length batch, or for MLA `q_nope, q_pe, c_kv, k_pe, w_kv_b`; and the spec's
/// learnable tensors by name), runs the backend and writes `out` (input dtype) and `lse` (f32).
fn run(
    spec: &AttentionSpec,
    input: &Path,
    output: &Path,
    offset: i64,
    backend: Backend,
) -> Result<String, RuntimeError> {
    let on = backend;
    let backend = attn::runtime::backends::open(backend.name())?;
    if spec.differential.is_some() {
        return crate::differential::run(spec, input, output, offset, &*backend, false);
    }
    let variant = attn::runtime::Variant::new(spec.clone())?;
    let cu_seqlens = read_cu_seqlens(input, spec)?;
    let Output { out, lse, .. } = if let Some([cu_q, cu_k]) = &cu_seqlens {
        let (tensors, learned) = read_with_learned(input, spec, &["q", "k", "v"])?;
        let [q, k, v]: [Tensor; 3] = tensors.try_into().expect("one tensor per name");
        let learned: Vec<(&str, &Tensor)> = learned.iter().map(|(n, t)| (n.as_str(), t)).collect();
        let data = read_data_tensors(input, spec)?;
        let data = data_views(&data);
        let x = Varlen {
            q: &q,
            k: &k,
            v: &v,
            cu_seqlens_q: cu_q,
            cu_seqlens_k: cu_k,
        };
        let learned = Learned::new(&learned).with_data(&data);
        backend.forward_varlen(&variant, x, offset, learned)?
    } else if spec.mla().is_some() {
        let names = ["q_nope", "q_pe", "c_kv", "k_pe", "w_kv_b"];
        let [q_nope, q_pe, c_kv, k_pe, w_kv_b]: [Tensor; 5] = read_safetensors(input, &names)?
            .try_into()
            .expect("one tensor per name");
        let x = MlaTensors {
            q_nope: &q_nope,
            q_pe: &q_pe,
            c_kv: &c_kv,
            k_pe: &k_pe,
            w_kv_b: &w_kv_b,
        };
        backend.forward(&variant, Inputs::Mla(x), offset)?
    } else {
        let (tensors, learned) = read_with_learned(input, spec, &["q", "k", "v"])?;
        let [q, k, v]: [Tensor; 3] = tensors.try_into().expect("one tensor per name");
        note_sim_time(on, spec, &q, &k, false);
        let learned: Vec<(&str, &Tensor)> = learned.iter().map(|(n, t)| (n.as_str(), t)).collect();
        let data = read_data_tensors(input, spec)?;
        let data = data_views(&data);
        let learned = Learned::new(&learned).with_data(&data);
        backend.forward_learned(&variant, Inputs::heads(&q, &k, &v), offset, learned)?
    };
    write_safetensors(output, &[("out", &out), ("lse", &lse)])?;
    Ok(format!(
        "wrote {}: out {:?} {}, lse {:?} f32",
        output.display(),
        out.shape(),
        out.dtype().name(),
        lse.shape()
    ))
}
