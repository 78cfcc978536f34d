//! Property: every valid spec, custom modifiers included, prints to text that parses back to the
//! same spec.

use crate::support;

use proptest::prelude::*;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn print_then_parse_is_the_identity(s in support::spec()) {
        prop_assume!(s.validate().is_ok());
        let printed = s.to_string();
        let parsed = attn_dsl::parse_str(&printed)
            .map_err(|e| TestCaseError::fail(format!("{printed}\n{}", e.render(&printed))))?;
        prop_assert_eq!(&parsed, &s, "printed as {}", printed);
    }
}
