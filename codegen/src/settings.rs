//! Environment settings (`ATTN_*` variables): each takes a few exact spellings, and any other
//! value is an error that names it, so a mistyped setting is never silently read as off.

/// The meaning of environment setting `name`'s `value` among `choices` (unset: the first), or
/// an error that names the value and says what is allowed (`help`).
pub fn choice<T: Copy>(
    name: &str,
    value: Option<&std::ffi::OsStr>,
    choices: &[(&str, T)],
    help: &str,
) -> Result<T, String> {
    let Some(value) = value else {
        return Ok(choices[0].1);
    };
    let text = value.to_str();
    choices
        .iter()
        .find(|(spelling, _)| Some(*spelling) == text)
        .map(|(_, meaning)| *meaning)
        .ok_or_else(|| format!("{name} is `{}`: {help}", text.unwrap_or("(not UTF-8)")))
}

/// An on/off setting: unset, empty or `0` is off, `1` is on, anything else an error.
pub fn flag(name: &str, value: Option<&std::ffi::OsStr>, help: &str) -> Result<bool, String> {
    choice(name, value, &[("", false), ("0", false), ("1", true)], help)
}

/// Whether `ATTN_DUMP_ASM` asks for the machine code of each CPU kernel function on stderr.
pub fn dump_asm() -> Result<bool, String> {
    static ON: std::sync::OnceLock<Result<bool, String>> = std::sync::OnceLock::new();
    ON.get_or_init(|| dump_asm_setting(std::env::var_os("ATTN_DUMP_ASM").as_deref()))
        .clone()
}

fn dump_asm_setting(value: Option<&std::ffi::OsStr>) -> Result<bool, String> {
    flag(
        "ATTN_DUMP_ASM",
        value,
        "set it to 1 to print each CPU kernel function's machine code on stderr, or to 0 (or \
         leave it unset) for none",
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::OsStr;

    #[test]
    fn only_unset_empty_0_and_1_are_dump_asm_settings() {
        assert_eq!(dump_asm_setting(None), Ok(false));
        assert_eq!(dump_asm_setting(Some(OsStr::new(""))), Ok(false));
        assert_eq!(dump_asm_setting(Some(OsStr::new("0"))), Ok(false));
        assert_eq!(dump_asm_setting(Some(OsStr::new("1"))), Ok(true));
        for bad in ["yes", "true", " 1", "01"] {
            let e = dump_asm_setting(Some(OsStr::new(bad))).unwrap_err();
            assert!(
                e.starts_with(&format!("ATTN_DUMP_ASM is `{bad}`: set it to 1")),
                "{e}"
            );
        }
    }
}
