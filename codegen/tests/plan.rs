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

#[test]
fn causal_1024_has_exactly_the_diagonal_mixed() {
    let map = plan("mha_causal").tile_map(1024, 1024, 0);
    assert_eq!(map.classes.len(), 16);
    for (r, row) in map.classes.iter().enumerate() {
        for (c, class) in row.iter().enumerate() {
            let want = match c.cmp(&r) {
                std::cmp::Ordering::Less => TileClass::AllKept,
                std::cmp::Ordering::Equal => TileClass::Mixed,
                std::cmp::Ordering::Greater => TileClass::AllMasked,
            };
            assert_eq!(*class, want, "tile ({r}, {c})");
        }
    }
}

#[test]
fn ragged_lengths_get_partial_edge_tiles() {
    // 1000 = 15 full tiles of 64 and one of 40.
    let map = plan("mha_causal").tile_map(1000, 1000, 0);
    assert_eq!(map.classes.len(), 16);
    assert_eq!(map.count(TileClass::Mixed), 16);
    assert_eq!(map.count(TileClass::AllKept), 120);
}

#[test]
fn an_unmasked_spec_classifies_nothing() {
    let p = plan("mqa_unmasked_f16");
    assert_eq!(p.masking, TileMasking::Unmasked);
    assert_eq!(p.tile_map(100, 300, 0).count(TileClass::AllKept), 2 * 5);
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
