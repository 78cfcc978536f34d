//! `attnc run` and `attnc grad` for a spec with differential heads: q, k, v (padded, or packed
//! with `cu_seqlens_q` and `cu_seqlens_k`) and lambda's four vectors (`lambda_q1`,
//! `lambda_k1`, `lambda_q2`, `lambda_k2`) in; the output (`heads / 2` heads), the component
//! heads' `lse` and, for grad, every gradient out.

use crate::input_file::{read_cu_seqlens, read_data_tensors, read_with_learned};
use attn::AttentionSpec;
use attn::dsl::LAMBDA_NAMES;
use attn::runtime::differential::{
    Differential, DifferentialInputs, DifferentialOutput, DifferentialVarlen,
};
use attn::runtime::io::{read_safetensors, write_safetensors};
use attn::runtime::learned::data_views;
use attn::runtime::varlen::Varlen;
use attn::runtime::{Backend, Learned, RuntimeError, Tensor};
use std::path::Path;

/// The tensors of a differential call, read from `input`.
struct Read {
    qkv: [Tensor; 3],
    /// `cu_seqlens_q` and `cu_seqlens_k` of a packed batch.
    cu_seqlens: Option<[Vec<i32>; 2]>,
    dout: Option<Tensor>,
    lambda: Vec<Tensor>,
    learned: Vec<(String, Tensor)>,
    data: Vec<(String, attn::runtime::learned::DataBuf)>,
}

fn read(spec: &AttentionSpec, input: &Path, with_dout: bool) -> Result<Read, RuntimeError> {
    let cu_seqlens = read_cu_seqlens(input, spec)?;
    let names: &[&str] = if with_dout {
        &["q", "k", "v", "dout"]
    } else {
        &["q", "k", "v"]
    };
    let (mut tensors, learned) = read_with_learned(input, spec, names)?;
    let dout = with_dout.then(|| tensors.pop()).flatten();
    let qkv: [Tensor; 3] = tensors.try_into().expect("one tensor per name");
    Ok(Read {
        qkv,
        cu_seqlens,
        dout,
        lambda: read_safetensors(input, &LAMBDA_NAMES)?,
        learned,
        data: read_data_tensors(input, spec)?,
    })
}

/// Runs the forward (and with `dout` in the file, the backward) and writes what it computed.
pub fn run(
    spec: &AttentionSpec,
    input: &Path,
    output: &Path,
    offset: i64,
    backend: &dyn Backend,
    with_grad: bool,
) -> Result<String, RuntimeError> {
    let heads = Differential::new(spec.clone())?;
    let r = read(spec, input, with_grad)?;
    let learned: Vec<(&str, &Tensor)> = r.learned.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let data = data_views(&r.data);
    let [q, k, v] = &r.qkv;
    let lambda = [&r.lambda[0], &r.lambda[1], &r.lambda[2], &r.lambda[3]];
    let learned = Learned::new(&learned).with_data(&data);
    let (saved, grads) = match &r.cu_seqlens {
        Some([cu_q, cu_k]) => {
            let x = DifferentialVarlen {
                batch: Varlen {
                    q,
                    k,
                    v,
                    cu_seqlens_q: cu_q,
                    cu_seqlens_k: cu_k,
                },
                lambda,
                position_offset: offset,
                learned,
            };
            let saved = heads.forward_varlen(backend, &x)?;
            let grads = match &r.dout {
                Some(dout) => Some(heads.backward_varlen(backend, &x, &saved, dout)?),
                None => None,
            };
            (saved, grads)
        }
        None => {
            let x = DifferentialInputs {
                q,
                k,
                v,
                lambda,
                position_offset: offset,
                learned,
            };
            let saved = heads.forward(backend, &x)?;
            let grads = match &r.dout {
                Some(dout) => Some(heads.backward(backend, &x, &saved, dout)?),
                None => None,
            };
            (saved, grads)
        }
    };
    let written = written(&saved, grads);
    let views: Vec<(&str, &Tensor)> = written.iter().map(|(n, t)| (n.as_str(), t)).collect();
    write_safetensors(output, &views)?;
    let shapes: Vec<String> = written
        .iter()
        .map(|(n, t)| format!("{n} {:?} {}", t.shape(), t.dtype().name()))
        .collect();
    Ok(format!(
        "wrote {} (lambda = {}): {}",
        output.display(),
        saved.lambda,
        shapes.join(", ")
    ))
}

/// What a run writes: the output and the components' lse, then any gradients.
fn written(
    saved: &DifferentialOutput,
    grads: Option<attn::runtime::differential::DifferentialGradients>,
) -> Vec<(String, Tensor)> {
    let mut written: Vec<(String, Tensor)> = vec![
        ("out".into(), saved.out.clone()),
        ("lse".into(), saved.components.lse.clone()),
    ];
    if let Some(g) = grads {
        written.extend([
            ("dq".into(), g.inputs.dq),
            ("dk".into(), g.inputs.dk),
            ("dv".into(), g.inputs.dv),
        ]);
        written.extend(g.inputs.learned);
        written.extend(g.lambda);
    }
    written
}
