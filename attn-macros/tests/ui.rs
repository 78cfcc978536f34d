//! `#[attention(...)]` on invalid specs: the user's build fails with the message under the
//! offending tokens (expected compiler output in tests/ui/*.stderr; regenerate with
//! `TRYBUILD=overwrite cargo test --test ui` and review the diff).

#[test]
fn invalid_specs_fail_the_build_at_the_offending_tokens() {
    let cases = trybuild::TestCases::new();
    cases.compile_fail("tests/ui/*.rs");
}

/// Without attn's `aot` feature, a `targets` list cannot be compiled: the build says so at it.
#[cfg(not(feature = "aot"))]
#[test]
fn targets_without_aot_fail_the_build_at_the_list() {
    let cases = trybuild::TestCases::new();
    cases.compile_fail("tests/ui_without_aot/*.rs");
}
