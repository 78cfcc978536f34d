//! Kernel plans of the named specs (insta snapshots) and the tile maps they imply.

use attn_dsl::AttentionSpec;
use attn_dsl::catalog::{NAMED_SPECS, named};
use attn_dsl::modifier::interval::TileClass;
use codegen::plan::{Frequencies, KernelPlan, TileMasking};

fn plan(name: &str) -> KernelPlan {
    let spec: AttentionSpec = named(name).unwrap().parse().unwrap();
    KernelPlan::forward(&spec)
}

#[test]
fn named_specs_plan_as_recorded() {
    for (name, text) in NAMED_SPECS {
        let spec: AttentionSpec = text.parse().unwrap();
        let plan = KernelPlan::forward(&spec);
        let map = plan.tile_map(256, 256, 0);
        insta::with_settings!({ omit_expression => true }, {
            insta::assert_snapshot!(*name, format!("{plan}\n\ntiles at Sq = Skv = 256:\n{map}"));
        });
    }
}

/// The class causal masking gives the tile of query rows `q0..=q1` and keys `k0..=k1`
/// (Sq == Skv, so positions equal indices).
fn causal_class(q0: u64, q1: u64, k0: u64, k1: u64) -> TileClass {
    if k1 <= q0 {
        TileClass::AllKept
    } else if k0 > q1 {
        TileClass::AllMasked
    } else {
        TileClass::Mixed
    }
}

#[test]
fn causal_tiles_are_mixed_exactly_on_the_diagonal() {
    let p = plan("mha_causal");
    let (rows, cols) = (u64::from(p.tiles.q_rows), u64::from(p.tiles.k_cols));
    for n in [1024u64, 1000, 65] {
        let map = p.tile_map(n, n, 0);
        assert_eq!(map.classes.len() as u64, n.div_ceil(rows));
        for (r, row) in map.classes.iter().enumerate() {
            assert_eq!(row.len() as u64, n.div_ceil(cols));
            for (c, class) in row.iter().enumerate() {
                let (q0, k0) = (r as u64 * rows, c as u64 * cols);
                let want = causal_class(q0, (q0 + rows).min(n) - 1, k0, (k0 + cols).min(n) - 1);
                assert_eq!(*class, want, "N {n}, tile ({r}, {c})");
            }
        }
    }
}

#[test]
fn an_unmasked_spec_classifies_nothing() {
    let p = plan("mqa_unmasked_f16");
    assert_eq!(p.masking, TileMasking::Unmasked);
    let map = p.tile_map(100, 300, 0);
    assert_eq!(map.count(TileClass::AllKept), map.classes.len() * 5);
    assert_eq!(
        map.count(TileClass::Mixed) + map.count(TileClass::AllMasked),
        0
    );
}

#[test]
fn mla_plans_one_shared_latent_head() {
    let p = plan("deepseek_v3_mla");
    assert_eq!(
        (p.shape.kv_heads, p.shape.qk_dim, p.shape.v_dim),
        (1, 576, 512)
    );
    assert_eq!(p.shape.group(), 128);
    let rope = p.rope.as_ref().unwrap();
    assert_eq!((rope.first_dim, rope.rope.dim), (512, 64));
    // mscale == mscale_all_dim: the attention factor is 1.
    assert_eq!(rope.attention_factor, 1.0);
}

#[test]
fn dynamic_ntk_frequencies_are_left_to_the_launch() {
    assert_eq!(
        plan("rope_dynamic_ntk").rope.unwrap().frequencies,
        Frequencies::PerLaunch
    );
    match plan("llama3_8b").rope.unwrap().frequencies {
        Frequencies::Static(f) => assert_eq!(f.len(), 64),
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_per_head_mask_reads_the_head() {
    match plan("custom_local_global").masking {
        TileMasking::Classified { reads } => {
            let names: Vec<&str> = reads.iter().map(|v| v.canonical_name()).collect();
            assert_eq!(names, ["h", "q", "k"]);
        }
        other => panic!("{other:?}"),
    }
}
