//! `attnc grad`: the forward and backward of attention on tensors from a safetensors file, the
//! gradients written to another.

use crate::backend_arg::Backend;
use crate::input_file::{read_cu_seqlens, read_data_tensors, read_with_learned};
use crate::run::{Files, note_sim_time};
use attn::AttentionSpec;
use attn::runtime::io::{read_safetensors, write_safetensors};
use attn::runtime::learned::data_views;
use attn::runtime::varlen::{Varlen, VarlenSaved};
use attn::runtime::{
    BackwardInputs, HeadGradients, HeadsBackward, Inputs, Learned, MlaBackward, MlaTensors, Output,
    Variant,
};
use attn::runtime::{RuntimeError, Tensor};
use std::path::Path;

/// `attnc grad`.
pub fn command(files: Files) -> Result<(), String> {
    let spec = files.checked_spec()?;
    let summary = grad(
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

/// Reads `q, k, v, dout` (packed, with `cu_seqlens_q` and `cu_seqlens_k`, for a variable-length
/// batch), the spec's learnable tensors and its data tensors, runs the forward (out and lse) and
/// the backward on the backend, and writes `dq, dk, dv` (input dtype), `out` (input dtype),
/// `lse` (f32) and the gradient `d<name>` (f32) of each learnable tensor and f32 data tensor.
fn grad(
    spec: &AttentionSpec,
    input: &Path,
    output: &Path,
    offset: i64,
    backend: Backend,
) -> Result<String, RuntimeError> {
    let on = backend;
    let backend = attn::runtime::backends::open(backend.name())?;
    if spec.differential.is_some() {
        return crate::differential::run(spec, input, output, offset, &*backend, true);
    }
    let variant = attn::runtime::Variant::new(spec.clone())?;
    let cu_seqlens = read_cu_seqlens(input, spec)?;
    if spec.mla().is_some() {
        return grad_mla(&*backend, &variant, input, output, offset);
    }
    let (tensors, learned) = read_with_learned(input, spec, &["q", "k", "v", "dout"])?;
    let [q, k, v, dout]: [Tensor; 4] = tensors.try_into().expect("one tensor per name");
    let learned: Vec<(&str, &Tensor)> = learned.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let data = read_data_tensors(input, spec)?;
    let data = data_views(&data);
    let learned = Learned::new(&learned).with_data(&data);
    let (out, lse, gradients) = match &cu_seqlens {
        Some([cu_q, cu_k]) => {
            let x = Varlen {
                q: &q,
                k: &k,
                v: &v,
                cu_seqlens_q: cu_q,
                cu_seqlens_k: cu_k,
            };
            let Output { out, lse, .. } = backend.forward_varlen(&variant, x, offset, learned)?;
            let saved = VarlenSaved {
                out: &out,
                lse: &lse,
                dout: &dout,
            };
            let g = backend.backward_varlen(&variant, x, saved, offset, learned)?;
            (out, lse, g)
        }
        None => {
            note_sim_time(on, spec, &q, &k, true);
            let Output { out, lse, .. } =
                backend.forward_learned(&variant, Inputs::heads(&q, &k, &v), offset, learned)?;
            let x = BackwardInputs::Heads(HeadsBackward {
                q: &q,
                k: &k,
                v: &v,
                out: &out,
                lse: &lse,
                dout: &dout,
                position_offset: offset,
            });
            let g = backend.backward_learned(&variant, &x, learned)?.heads()?;
            (out, lse, g)
        }
    };
    let HeadGradients {
        dq,
        dk,
        dv,
        learned,
    } = gradients;
    let mut written = vec![
        ("dq", &dq),
        ("dk", &dk),
        ("dv", &dv),
        ("out", &out),
        ("lse", &lse),
    ];
    written.extend(learned.iter().map(|(n, t)| (n.as_str(), t)));
    write_safetensors(output, &written)?;
    let extra: String = learned
        .iter()
        .map(|(n, t)| format!(", {n} {:?} f32", t.shape()))
        .collect();
    Ok(format!(
        "wrote {}: dq {:?}, dk {:?}, dv {:?} {}, out {:?}, lse {:?} f32{extra}",
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
