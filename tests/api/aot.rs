//! Kernels compiled at cargo time (feature `aot`): a type declared with `targets` carries every
//! GPU kernel of its spec as PTX for each target, and the runtime serves those kernels from it
//! (the same GPU IR, lowered at run time, finds them by its hash).
#![cfg(feature = "aot")]

use attn::codegen::gpu::artifacts::spec_kernels;
use attn::codegen::gpu::ir::target::{Arch, kernel_hash};
use attn::runtime::gpu::ptx::{PtxOrigin, ptx_for};
use attn::{Attention, attention};

#[attention(
    heads = 4, kv_heads = 2, head_dim = 32, mask = causal, position = rope, dtype = bf16,
    targets = [sm_80, sm_90]
)]
struct Embedded;

#[attention(
    heads = 8, head_dim = 64, mask = causal, dtype = bf16,
    targets = [sm_90a]
)]
struct Hopper;

#[test]
fn every_kernel_of_the_spec_is_embedded_for_every_target_and_served() {
    let embedded = Embedded::embedded_kernels();
    let kernels = spec_kernels(Embedded::spec()).unwrap();
    assert_eq!(embedded.len(), 2 * kernels.len());
    let _ = Embedded::variant();
    for arch in [Arch::Sm80, Arch::Sm90] {
        for k in &kernels {
            let e = embedded
                .iter()
                .find(|e| e.target == arch.name() && e.role == k.role)
                .unwrap_or_else(|| panic!("{} not embedded for {}", k.role, arch.name()));
            assert_eq!(
                (e.name, e.hash),
                (k.kernel.name.as_str(), kernel_hash(&k.kernel).as_str())
            );
            assert!(
                e.ptx.contains(&format!(".target {}", arch.name())),
                "{}",
                e.role
            );
            assert!(e.ptx.contains(&format!(".entry {}", e.name)), "{}", e.role);
            let launch: serde_json::Value = serde_json::from_str(e.launch).unwrap();
            assert_eq!(
                launch["threads"].as_u64(),
                Some(u64::from(k.kernel.threads))
            );
            let ptx = ptx_for(&k.kernel, arch, None).unwrap();
            assert_eq!(ptx.origin, PtxOrigin::Embedded, "{}", k.role);
            assert_eq!(&*ptx.text, e.ptx);
        }
    }
}

#[test]
fn sm_90a_embeds_the_warp_specialized_forward_and_serves_it() {
    use attn::codegen::gpu::artifacts::spec_kernels_for;
    let embedded = Hopper::embedded_kernels();
    let kernels = spec_kernels_for(Hopper::spec(), Arch::Sm90a).unwrap();
    assert_eq!(embedded.len(), kernels.len());
    let _ = Hopper::variant();
    let wgmma = embedded
        .iter()
        .find(|e| e.role == "forward wgmma")
        .expect("the sm_90a forward is embedded");
    assert_eq!(wgmma.target, "sm_90a");
    for op in [
        "wgmma.mma_async",
        "cp.async.bulk.tensor",
        "setmaxnreg",
        ".target sm_90a",
    ] {
        assert!(wgmma.ptx.contains(op), "{op}");
    }
    let launch: serde_json::Value = serde_json::from_str(wgmma.launch).unwrap();
    // The launch record's fields (the last, `params`, an address), then the tensor maps.
    let fields = launch["params"].as_array().expect("a list of parameters");
    let last = fields
        .iter()
        .position(|p| p["name"] == "params")
        .expect("the learnable parameters' address");
    assert_eq!(fields[last]["kind"], "address");
    assert!(fields[..last].iter().all(|p| p["kind"] != "tensor map"));
    assert!(fields[last + 1..].iter().all(|p| p["kind"] == "tensor map"));
    assert!(fields.len() > last + 1, "tensor maps follow the fields");
    let ptx = ptx_for(&kernels[0].kernel, Arch::Sm90a, None).unwrap();
    assert_eq!(ptx.origin, PtxOrigin::Embedded);
}

#[attention(
    heads = 4, kv_heads = 2, head_dim = 32, mask = causal, differential = lambda,
    targets = [sm_80]
)]
struct Paired;

#[test]
fn differential_heads_embed_their_component_heads_kernels() {
    use attn::DifferentialAttention;
    let embedded = Paired::embedded_kernels();
    let kernels = spec_kernels(&Paired::spec().differential_components()).unwrap();
    assert_eq!(embedded.len(), kernels.len());
    let _ = Paired::differential();
    for k in &kernels {
        let ptx = ptx_for(&k.kernel, Arch::Sm80, None).unwrap();
        assert_eq!(ptx.origin, PtxOrigin::Embedded, "{}", k.role);
    }
}
