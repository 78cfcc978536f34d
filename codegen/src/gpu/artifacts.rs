//! Every GPU kernel a spec's calls may load, with what a launch needs to know of each: the set
//! `#[attention(..., targets = [..])]` embeds at cargo time and `attnc emit --out-dir` writes
//! (PTX per target, plus a manifest of launch records).

use super::choice::{Call, ForwardChoice, KernelChoice, Target, choose, decode_kernel};
use super::ir::Kernel;
use super::ir::Ty;
use super::ir::target;
use super::ir::target::Arch;
use super::kernels::decode::pages;
use super::kernels::layers;
use super::launch::{
    BackwardArgs, BackwardTcArgs, DecodeArgs, ForwardArgs, LaunchRecord, Param, ParamKind,
};
use super::verified;
use crate::error::CodegenError;
use crate::plan::{KernelPlan, PlanKind};
use attn_dsl::AttentionSpec;

/// One kernel of a spec.
#[derive(Clone, Debug)]
pub struct SpecKernel {
    /// What it is for: `forward`, `forward simt`, `forward bf16 qk`, `decode`, `decode merge`,
    /// `decode pages`, `backward delta`, `backward dq`, `backward dkdv`; for sm_90a also
    /// `forward wgmma`.
    pub role: &'static str,
    /// The kernel, verified.
    pub kernel: Kernel,
}

/// The calls a program built ahead of time ships kernels for, each with the role its kernels
/// are listed under: plain forward calls, forward calls whose inputs are past f16's range,
/// resident models' forwards, decode calls, and plain backward calls.
const SHIPPED_CALLS: [(&str, Call); 5] = [
    ("forward", Call::Forward { wide: false }),
    ("forward simt", Call::Forward { wide: true }),
    ("forward bf16 qk", Call::ResidentForward),
    ("decode", Call::Decode),
    ("backward", Call::Backward { wide: false }),
];

/// The kernels of `spec` on every target but sm_90a, each once (a kernel two roles share is
/// listed under the first): what [`choose`] picks for each of [`SHIPPED_CALLS`], with the
/// decode kernel's split-KV merge and page-table kernels. No backward for MLA.
pub fn spec_kernels(spec: &AttentionSpec) -> Result<Vec<SpecKernel>, CodegenError> {
    spec_kernels_for(spec, Arch::Sm90)
}

/// The kernels of `spec` for `arch`: [`spec_kernels`], and for [`Arch::Sm90a`] first the
/// warp-specialized `wgmma` forward ([`forward_wgmma`]) where the spec runs on it.
pub fn spec_kernels_for(spec: &AttentionSpec, arch: Arch) -> Result<Vec<SpecKernel>, CodegenError> {
    let forward = KernelPlan::forward(spec);
    let decode = KernelPlan::decode(spec);
    let backward = match spec.mla() {
        None => KernelPlan::backward(spec).ok(),
        Some(_) => None,
    };
    let mut out: Vec<SpecKernel> = Vec::new();
    // Kernels are told apart by their printed IR (`==` on a kernel holding a NaN constant,
    // as the split-KV merge does, never finds it equal to itself).
    let mut printed: Vec<String> = Vec::new();
    let mut add = |role: &'static str, kernel: Kernel| {
        let text = kernel.to_string();
        if !printed.contains(&text) {
            printed.push(text);
            out.push(SpecKernel { role, kernel });
        }
    };
    for (role, call) in SHIPPED_CALLS {
        for &target in Target::of_arch(arch) {
            let plan = match call.plan_kind() {
                PlanKind::Forward => &forward,
                PlanKind::Decode => &decode,
                PlanKind::Backward => match &backward {
                    Some(plan) => plan,
                    None => continue,
                },
            };
            match choose(call, plan, target) {
                KernelChoice::Forward(ForwardChoice::Wgmma) => add(
                    "forward wgmma",
                    (*ForwardChoice::Wgmma.lower(plan)?.kernel).clone(),
                ),
                KernelChoice::Forward(choice) => add(role, (*choice.lower(plan)?.kernel).clone()),
                KernelChoice::Decode => {
                    add(role, decode_kernel(plan)?);
                    add("decode merge", verified(layers::merge_partitions())?);
                    add("decode pages", verified(pages::segments_from_pages())?);
                }
                KernelChoice::Backward(choice) => {
                    let kernels = choice.lower(plan)?.kernels;
                    for (part, kernel) in
                        ["delta", "dq", "dkdv", "dparams"].into_iter().zip(kernels)
                    {
                        add(backward_role(part), (*kernel).clone());
                    }
                }
            }
        }
    }
    Ok(out)
}

/// The role of one of the backward kernels.
fn backward_role(part: &str) -> &'static str {
    match part {
        "delta" => "backward delta",
        "dq" => "backward dq",
        "dkdv" => "backward dkdv",
        _ => "backward dparams",
    }
}

/// A kernel's launch record as JSON: entry point, parameters in order (each a 64-bit value:
/// a device address or an integer), threads per CTA, shared memory (and how much of it a
/// launch must ask for dynamically), CTAs per SM its registers were sized for, and its
/// [`target::kernel_hash`].
pub fn launch_json(kernel: &Kernel) -> String {
    let fields = record_fields(kernel);
    let params: Vec<String> = kernel
        .params
        .iter()
        .enumerate()
        .map(|(i, (name, ty))| {
            let kind = match fields.and_then(|f| f.get(i)).map(|p| p.kind) {
                _ if *ty == Ty::TensorMap => "tensor map",
                Some(ParamKind::Address) => "address",
                Some(ParamKind::Scalar) => "scalar",
                None => "value",
            };
            format!(
                "{{\"name\": {}, \"type\": \"{ty}\", \"kind\": \"{kind}\"}}",
                json_string(name)
            )
        })
        .collect();
    format!(
        "{{\"name\": {}, \"params\": [{}], \"threads\": {}, \"shared_bytes\": {}, \
         \"dynamic_shared_bytes\": {}, \"ctas_per_sm\": {}, \"hash\": \"{}\"}}",
        json_string(&kernel.name),
        params.join(", "),
        kernel.threads,
        kernel.shared_bytes,
        target::dynamic_shared_bytes(kernel),
        kernel.ctas_per_sm,
        target::kernel_hash(kernel)
    )
}

/// The fields of the launch record a spec kernel takes (each kernel family's parameters are
/// its record's fields, in order).
fn record_fields(kernel: &Kernel) -> Option<&'static [Param]> {
    // A record's fields, then (sm_90a forward) tensor maps.
    fn of<R: LaunchRecord>(kernel: &Kernel) -> Option<&'static [Param]> {
        let record = R::params();
        let maps = kernel.params.get(record.len()..)?;
        (kernel.params[..record.len()] == record && maps.iter().all(|(_, t)| *t == Ty::TensorMap))
            .then_some(R::FIELDS)
    }
    of::<ForwardArgs>(kernel)
        .or_else(|| of::<DecodeArgs>(kernel))
        .or_else(|| of::<BackwardArgs>(kernel))
        .or_else(|| of::<BackwardTcArgs>(kernel))
        .or_else(|| of::<layers::MergeArgs>(kernel))
        .or_else(|| of::<pages::PagesArgs>(kernel))
}

/// `text` as a JSON string literal.
pub fn json_string(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 2);
    out.push('"');
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_spec_lists_each_kernel_once_with_its_roles() {
        let spec: AttentionSpec = "heads = 8, kv_heads = 2, head_dim = 64, mask = causal, \
                                   position = rope, dtype = bf16"
            .parse()
            .unwrap();
        let kernels = spec_kernels(&spec).unwrap();
        let roles: Vec<&str> = kernels.iter().map(|k| k.role).collect();
        for role in [
            "forward",
            "forward simt",
            "decode",
            "backward dq",
            "backward dkdv",
        ] {
            assert!(roles.contains(&role), "{roles:?}");
        }
        for (i, a) in kernels.iter().enumerate() {
            assert!(
                kernels[i + 1..]
                    .iter()
                    .all(|b| b.kernel.to_string() != a.kernel.to_string())
            );
            // Every parameter is known as an address or a scalar of its launch record.
            assert!(
                !launch_json(&a.kernel).contains("\"kind\": \"value\""),
                "{}",
                a.role
            );
        }
        let mla: AttentionSpec = "heads = 4, head_dim = 16, mla(latent_rank = 32, rope_dim = 16)"
            .parse()
            .unwrap();
        assert!(
            spec_kernels(&mla)
                .unwrap()
                .iter()
                .all(|k| !k.role.starts_with("backward"))
        );
    }

    #[test]
    fn sm_90a_adds_the_wgmma_forward_whose_maps_are_named() {
        let spec: AttentionSpec = "heads = 8, head_dim = 128, mask = causal, dtype = bf16"
            .parse()
            .unwrap();
        let hopper = spec_kernels_for(&spec, Arch::Sm90a).unwrap();
        assert_eq!(hopper[0].role, "forward wgmma");
        let json = launch_json(&hopper[0].kernel);
        assert!(
            json.contains(
                "{\"name\": \"k_map\", \"type\": \"tensormap\", \"kind\": \"tensor map\"}"
            ),
            "{json}"
        );
        assert!(json.contains("\"kind\": \"address\"") && !json.contains("\"kind\": \"value\""));
        assert_eq!(
            spec_kernels_for(&spec, Arch::Sm90).unwrap().len() + 1,
            hopper.len()
        );
        let odd: AttentionSpec = "heads = 8, head_dim = 96, position = rope, dtype = bf16"
            .parse()
            .unwrap();
        assert!(spec_kernels_for(&odd, Arch::Sm90a).unwrap()[0].role != "forward wgmma");
    }

    #[test]
    fn launch_records_are_json() {
        let k = super::super::kernels::layers::merge_partitions();
        let json = launch_json(&k);
        assert!(json.starts_with("{\"name\": \"") && json.contains("\"params\": [{\"name\": "));
        assert!(json.contains("\"kind\": \"address\"") && !json.contains("\"kind\": \"value\""));
        assert_eq!(json_string("a\"b\\c\n\u{1}"), "\"a\\\"b\\\\c\\n\\u0001\"");
    }
}
