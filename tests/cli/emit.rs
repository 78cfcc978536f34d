//! `attnc emit`: PTX for each target, every kernel of a spec and a manifest.

use crate::{attnc, stderr, stdout, temp};

#[test]
fn emit_writes_the_gpu_kernel() {
    let spec = "heads = 2, head_dim = 8, mask = causal, position = alibi";
    let o = attnc(&["emit", spec, "--emit", "gpu-ir"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(
        stdout(&o).starts_with("kernel attention_forward("),
        "{}",
        stdout(&o)
    );
    let out = std::env::temp_dir().join(format!("attn-emit-{}.ptx", std::process::id()));
    let o = attnc(&[
        "emit",
        spec,
        "--target",
        "sm_80",
        "--emit",
        "ptx",
        "-o",
        out.to_str().unwrap(),
    ]);
    if cfg!(feature = "llvm") {
        assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
        let ptx = std::fs::read_to_string(&out).unwrap();
        assert!(ptx.contains(".target sm_80") && ptx.contains(".entry attention_forward"));
    } else {
        assert_eq!(o.status.code(), Some(2));
        assert!(stderr(&o).contains("`llvm` feature"), "{}", stderr(&o));
    }
    let o = attnc(&["emit", spec, "--target", "sm_70"]);
    assert_eq!(o.status.code(), Some(2));
}

#[test]
fn emit_for_sm_90a_writes_the_warp_specialized_forward() {
    let spec = "heads = 8, head_dim = 128, mask = causal, dtype = bf16";
    let o = attnc(&["emit", spec, "--target", "sm_90a", "--emit", "gpu-ir"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let ir = stdout(&o);
    assert!(ir.starts_with("kernel attention_forward_wgmma("), "{ir}");
    for op in [
        "wgmma.m64n128k16.bf16",
        "tma.load",
        "mbarrier.wait",
        "setmaxnreg.inc 240",
    ] {
        assert!(ir.contains(op), "{op}");
    }
    if cfg!(feature = "llvm") {
        let o = attnc(&["emit", spec, "--target", "sm_90a", "--emit", "ptx"]);
        assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
        let ptx = stdout(&o);
        for op in [
            ".target sm_90a",
            "wgmma.mma_async",
            "cp.async.bulk.tensor",
            "setmaxnreg",
        ] {
            assert!(ptx.contains(op), "{op}");
        }
    }
    // A spec the kernel does not take (head dim 96) gets the mma.sync forward.
    let o = attnc(&[
        "emit",
        "heads = 8, head_dim = 96, position = rope, dtype = bf16",
        "--target",
        "sm_90a",
        "--emit",
        "gpu-ir",
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert!(stdout(&o).starts_with("kernel attention_forward_tc("));
}

#[test]
fn emit_writes_every_kernel_and_a_manifest() {
    let dir = temp("emit-all");
    let spec = "heads = 4, kv_heads = 2, head_dim = 64, mask = causal, dtype = bf16";
    let o = attnc(&[
        "emit",
        spec,
        "--emit",
        "gpu-ir",
        "--target",
        "sm_80",
        "--target",
        "sm_90",
        "--out-dir",
        dir.to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let manifest: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("manifest.json")).unwrap()).unwrap();
    let kernels = manifest["kernels"].as_array().unwrap();
    assert!(
        manifest["spec"]
            .as_str()
            .unwrap()
            .starts_with("heads = 4, kv_heads = 2")
    );
    for role in ["forward", "decode", "backward dq", "backward dkdv"] {
        for target in ["sm_80", "sm_90"] {
            let k = kernels
                .iter()
                .find(|k| k["role"] == role && k["target"] == target)
                .unwrap_or_else(|| panic!("no {role} for {target}"));
            let text = std::fs::read_to_string(dir.join(k["file"].as_str().unwrap())).unwrap();
            let name = k["launch"]["name"].as_str().unwrap();
            assert!(
                text.starts_with(&format!("kernel {name}")),
                "{role}: {}",
                &text[..40]
            );
            assert!(k["launch"]["threads"].as_u64().unwrap() > 0);
        }
    }
    // One kernel for several targets is refused.
    let o = attnc(&["emit", spec, "--target", "sm_80", "--target", "sm_90"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(stderr(&o).contains("one --target"), "{}", stderr(&o));
    // A manifest that cannot be written is named once.
    std::fs::remove_file(dir.join("manifest.json")).unwrap();
    std::fs::create_dir(dir.join("manifest.json")).unwrap();
    let args = [
        "emit",
        spec,
        "--emit",
        "gpu-ir",
        "--out-dir",
        dir.to_str().unwrap(),
    ];
    let o = attnc(&args);
    assert_eq!(o.status.code(), Some(2));
    let path = dir.join("manifest.json").display().to_string();
    assert_eq!(stderr(&o).matches(&path).count(), 1, "{}", stderr(&o));
}
