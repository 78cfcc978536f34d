//! `attnc run`: attention on tensors from a safetensors file, written to another.

use attn::AttentionSpec;
use attn::runtime::io::{read_safetensors, write_safetensors};
use attn::runtime::{
    BackwardInputs, HeadGradients, HeadsBackward, Inputs, MlaBackward, MlaTensors, Output, Variant,
};
use attn::runtime::{RuntimeError, Tensor};
use std::path::Path;

/// Where `attnc run` computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Backend {
    /// Cranelift-compiled kernels on this machine's CPU.
    Cpu,
    /// The GPU kernel on a CUDA device (needs the `cuda` feature and an NVIDIA GPU).
    Cuda,
    /// The GPU kernel on the GPU IR interpreter (slow; no GPU needed).
    GpuSim,
}

impl Backend {
    /// The backend's name, as `attn::runtime::backends::open` takes it.
    pub fn name(self) -> &'static str {
        match self {
            Backend::Cpu => "cpu",
            Backend::Cuda => "cuda",
            Backend::GpuSim => "gpu-sim",
        }
    }
}

/// On gpu-sim, says on stderr how long the interpreter will take when that is more than a few
/// seconds (calls it would take too long on are refused by the backend).
fn note_interpreted(on: Backend, spec: &AttentionSpec, q: &Tensor, k: &Tensor, backward: bool) {
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

/// Reads the inputs the spec needs (`q, k, v`, or for MLA `q_nope, q_pe, c_kv, k_pe, w_kv_b`),
/// runs the backend and writes `out` (input dtype) and `lse` (f32).
pub fn run(
    spec: &AttentionSpec,
    input: &Path,
    output: &Path,
    offset: i64,
    backend: Backend,
) -> Result<String, RuntimeError> {
    let on = backend;
    let backend = attn::runtime::backends::open(backend.name())?;
    let variant = attn::runtime::Variant::new(spec.clone())?;
    let Output { out, lse, .. } = if spec.mla().is_some() {
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
        let [q, k, v]: [Tensor; 3] = read_safetensors(input, &["q", "k", "v"])?
            .try_into()
            .expect("one tensor per name");
        note_interpreted(on, spec, &q, &k, false);
        backend.forward(&variant, Inputs::heads(&q, &k, &v), offset)?
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

/// Reads `q, k, v, dout`, runs the forward (out and lse) and the backward on the backend, and
/// writes `dq, dk, dv` (input dtype), `out` (input dtype) and `lse` (f32).
pub fn grad(
    spec: &AttentionSpec,
    input: &Path,
    output: &Path,
    offset: i64,
    backend: Backend,
) -> Result<String, RuntimeError> {
    let on = backend;
    let backend = attn::runtime::backends::open(backend.name())?;
    let variant = attn::runtime::Variant::new(spec.clone())?;
    if spec.mla().is_some() {
        return grad_mla(&*backend, &variant, input, output, offset);
    }
    let [q, k, v, dout]: [Tensor; 4] = read_safetensors(input, &["q", "k", "v", "dout"])?
        .try_into()
        .expect("one tensor per name");
    note_interpreted(on, spec, &q, &k, true);
    let Output { out, lse, .. } = backend.forward(&variant, Inputs::heads(&q, &k, &v), offset)?;
    let x = BackwardInputs::Heads(HeadsBackward {
        q: &q,
        k: &k,
        v: &v,
        out: &out,
        lse: &lse,
        dout: &dout,
        position_offset: offset,
    });
    let HeadGradients { dq, dk, dv } = backend.backward(&variant, &x)?.heads()?;
    write_safetensors(
        output,
        &[
            ("dq", &dq),
            ("dk", &dk),
            ("dv", &dv),
            ("out", &out),
            ("lse", &lse),
        ],
    )?;
    Ok(format!(
        "wrote {}: dq {:?}, dk {:?}, dv {:?} {}, out {:?}, lse {:?} f32",
        output.display(),
        dq.shape(),
        dk.shape(),
        dv.shape(),
        dq.dtype().name(),
        out.shape(),
        lse.shape()
    ))
}

/// `attnc grad` for an MLA spec: q_nope, q_pe, c_kv, k_pe, w_kv_b and dout in; the gradient of
/// each input, out and lse out.
fn grad_mla(
    backend: &dyn attn::runtime::Backend,
    variant: &Variant,
    input: &Path,
    output: &Path,
    offset: i64,
) -> Result<String, RuntimeError> {
    let names = ["q_nope", "q_pe", "c_kv", "k_pe", "w_kv_b", "dout"];
    let [q_nope, q_pe, c_kv, k_pe, w_kv_b, dout]: [Tensor; 6] = read_safetensors(input, &names)?
        .try_into()
        .expect("one tensor per name");
    let x = MlaTensors {
        q_nope: &q_nope,
        q_pe: &q_pe,
        c_kv: &c_kv,
        k_pe: &k_pe,
        w_kv_b: &w_kv_b,
    };
    let Output { out, lse, latent } = backend.forward(variant, Inputs::Mla(x), offset)?;
    let latent = latent.ok_or_else(|| {
        RuntimeError::Data("the MLA forward returned no latent output".to_string())
    })?;
    let x = BackwardInputs::Mla(MlaBackward {
        x,
        latent: &latent,
        lse: &lse,
        dout: &dout,
        position_offset: offset,
    });
    let g = backend.backward(variant, &x)?.mla()?;
    write_safetensors(
        output,
        &[
            ("dq_nope", &g.dq_nope),
            ("dq_pe", &g.dq_pe),
            ("dc_kv", &g.dc_kv),
            ("dk_pe", &g.dk_pe),
            ("dw_kv_b", &g.dw_kv_b),
            ("out", &out),
            ("lse", &lse),
        ],
    )?;
    Ok(format!(
        "wrote {}: dq_nope {:?}, dq_pe {:?}, dc_kv {:?}, dk_pe {:?}, dw_kv_b {:?} {}, out {:?}, \
         lse {:?} f32",
        output.display(),
        g.dq_nope.shape(),
        g.dq_pe.shape(),
        g.dc_kv.shape(),
        g.dk_pe.shape(),
        g.dw_kv_b.shape(),
        g.dq_nope.dtype().name(),
        out.shape(),
        lse.shape()
    ))
}
