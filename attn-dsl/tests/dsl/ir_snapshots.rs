//! The IR text form of every named spec, as written and folded (insta snapshots in
//! tests/snapshots/). A change to lowering or folding shows up here as a readable diff.

use attn_dsl::AttentionSpec;
use attn_dsl::catalog::NAMED_SPECS;
use attn_dsl::modifier::ScoreProgram;

#[test]
fn named_specs_lower_to_the_recorded_ir() {
    for (name, text) in NAMED_SPECS {
        let spec: AttentionSpec = text.parse().unwrap_or_else(|e| panic!("{name}: {e}"));
        let program = ScoreProgram::of(&spec);
        program.typecheck().unwrap();
        let folded = program.folded();
        folded.typecheck().unwrap();
        let text =
            format!("spec: {spec}\n\n-- as lowered --\n{program}\n\n-- folded --\n{folded}\n");
        insta::with_settings!({ omit_expression => true }, {
            insta::assert_snapshot!(*name, text);
        });
    }
}
